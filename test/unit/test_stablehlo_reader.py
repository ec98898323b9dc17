# ruff: noqa: E501  (the StableHLO module below is one op per line, as MLIR prints it)
"""``graphs.stablehlo``: StableHLO text (generic form, debug locations) read as an HLO proto and costed by
``hlo_cost``, against hand computations on modules written here; and the collectives put back in place of their
stand-ins. Needs only the standard library and protobuf (no torch-mlir: the vLLM Neuron suite lowers real graphs)."""

from __future__ import annotations

import inspect

import pytest

from minimax_m3 import ops
from minimax_m3.graphs import hlo_cost
from minimax_m3.graphs.stablehlo import StableHloError, collective_marker, restore_collectives, to_hlo

MOE = inspect.getsourcefile(ops.moe)
FFN_LINE = inspect.getsourcelines(ops.moe.expert_ffn)[1] + 8  # a line inside expert_ffn's body

# a step over a weight [8, 16, 32] (a batched matmul issued in ops/moe.py expert_ffn, called from a caller frame),
# a page table state [10, 4] written at one row (scatter) and read at 3 rows (gather), an all-reduce of the product
MODULE = f'''#loc1 = loc("{MOE}":{FFN_LINE}:0)
#loc2 = loc("/elsewhere/caller.py":7:0)
#loc3 = loc(callsite(#loc1 at #loc2))
"builtin.module"() ({{
  "func.func"() <{{function_type = (tensor<8x4x16xbf16>, tensor<8x16x32xbf16>, tensor<10x4xf32>, tensor<1x4xf32>, tensor<3x1xi64>) -> (tensor<10x4xf32>, tensor<8x4x32xbf16>, tensor<3x4xf32>), sym_name = "main"}}> ({{
  ^bb0(%arg0: tensor<8x4x16xbf16> loc("/elsewhere/caller.py":7:0), %arg1: tensor<8x16x32xbf16> loc("/elsewhere/caller.py":7:0), %arg2: tensor<10x4xf32> loc("/elsewhere/caller.py":7:0), %arg3: tensor<1x4xf32> loc("/elsewhere/caller.py":7:0), %arg4: tensor<3x1xi64> loc("/elsewhere/caller.py":7:0)):
    %0 = "stablehlo.constant"() <{{value = dense<1> : tensor<1x1xi64>}}> : () -> tensor<1x1xi64> loc(#loc2)
    %1 = "stablehlo.scatter"(%arg2, %0, %arg3) <{{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<update_window_dims = [1], inserted_window_dims = [0], scatter_dims_to_operand_dims = [0], index_vector_dim = 1>, unique_indices = false}}> ({{
    ^bb0(%arg5: tensor<f32> loc("/elsewhere/caller.py":7:0), %arg6: tensor<f32> loc("/elsewhere/caller.py":7:0)):
      "stablehlo.return"(%arg6) : (tensor<f32>) -> () loc(#loc2)
    }}) : (tensor<10x4xf32>, tensor<1x1xi64>, tensor<1x4xf32>) -> tensor<10x4xf32> loc(#loc2)
    %2 = "stablehlo.dot_general"(%arg0, %arg1) <{{dot_dimension_numbers = #stablehlo.dot<lhs_batching_dimensions = [0], rhs_batching_dimensions = [0], lhs_contracting_dimensions = [2], rhs_contracting_dimensions = [1]>}}> : (tensor<8x4x16xbf16>, tensor<8x16x32xbf16>) -> tensor<8x4x32xbf16> loc(#loc3)
    %3 = "stablehlo.abs"(%2) : (tensor<8x4x32xbf16>) -> tensor<8x4x32xbf16> loc(#loc9)
    %4 = "stablehlo.gather"(%1, %arg4) <{{dimension_numbers = #stablehlo.gather<offset_dims = [1], collapsed_slice_dims = [0], start_index_map = [0], index_vector_dim = 1>, indices_are_sorted = false, slice_sizes = array<i64: 1, 4>}}> : (tensor<10x4xf32>, tensor<3x1xi64>) -> tensor<3x4xf32> loc(#loc2)
    %5 = "stablehlo.exponential"(%4) : (tensor<3x4xf32>) -> tensor<3x4xf32> loc(#loc2)
    "func.return"(%1, %3, %5) : (tensor<10x4xf32>, tensor<8x4x32xbf16>, tensor<3x4xf32>) -> () loc(#loc2)
  }}) : () -> () loc(#loc2)
}}) : () -> () loc(#loc)
#loc = loc(unknown)
#loc8 = loc("{collective_marker("all-reduce", "sum", 64, 0)}":1:0)
#loc9 = loc(callsite(#loc8 at #loc2))
'''


def test_a_module_is_costed_like_hlo():
    text = restore_collectives(MODULE)
    assert '"stablehlo.all_reduce"(%2)' in text and '"stablehlo.abs"' not in text
    assert "dense<[[" + ", ".join(map(str, range(64))) + "]]> : tensor<1x64xi64>" in text
    a = hlo_cost.analyze_module(to_hlo(text, {2: 0}), states={2: 1.0})
    # 8 batches of [4, 16] @ [16, 32]: 2 * 8 * 4 * 32 * 16, issued in ops/moe.py expert_ffn (its innermost frame)
    assert a["flops"] == {"attention": 0, "indexer": 0, "routed_experts": 2 * 8 * 4 * 32 * 16, "rest": 0}
    # the all-reduce of the bf16 [8, 4, 32] product over 64 ranks, named at the caller's frame (the stand-in's
    # own frame is skipped)
    (coll,) = a["collectives"]
    assert (coll["kind"], coll["dtype"], coll["group_size"], coll["count"], coll["bytes"]) == (
        "all-reduce", "bf16", 64, 1, 8 * 4 * 32 * 2)
    assert a["collective_ops"][0]["where"] == "caller.py::7"
    # reads: the activations and the weight whole; the state: only the 3 rows gathered (f32 [3, 4]), its own
    # write (scatter operand 0) reads nothing; no copy of it (the scatter is the in-place chain to output 0)
    assert a["reads"][0] == 8 * 4 * 16 * 2 and a["reads"][1] == 8 * 16 * 32 * 2
    assert a["reads"][2] == 3 * 4 * 4
    assert a["copies"] == {2: 0} and a["aliases"] == {2: 0}


def test_unreadable_text_is_one_error():
    with pytest.raises(StableHloError, match="no func.func @main"):
        to_hlo('"builtin.module"() ({\n}) : () -> ()\n')
    bad = MODULE.replace(") -> tensor<8x4x32xbf16> loc(#loc3)", ") -> tensor<?x4x32xbf16> loc(#loc3)")
    with pytest.raises(StableHloError, match="dynamic or unreadable dimension"):
        to_hlo(bad)
