"""``minimax-m3 graphs`` and its HLO cost analysis against exact hand computations.

The modules are lowered from small torch programs on torch-xla's CPU device (``LoweringContext``), in one
subprocess run with ``XLA_IR_DEBUG=1 XLA_HLO_DEBUG=1`` (the flags the dry run traces with; torch-xla reads them
once per process), or built directly with ``hlo_schema`` (collectives, custom calls). Every expected figure is
worked out by hand in the test that checks it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minimax_m3.config import M3Config
from minimax_m3.graphs import report as graphs, hlo_cost
from minimax_m3 import planner as plan
from minimax_m3.graphs import hlo_schema as hs

# ---- programs lowered in a subprocess (run this file as a script: python test_graphs.py OUTDIR) --------------
CONTRIB_LINES = {137: "def forward(a, b):", 138: "    return a @ b", 139: "rope_forward = forward",
                 239: "def forward(a, b):", 240: "    return torch.matmul(a, b)"}


def _write_fake_sources(root: Path) -> None:
    """Files at the paths the rule table keys on: NxD's MoE folder and the published port's one-file model."""
    moe = root / "neuronx_distributed" / "modules" / "moe"
    moe.mkdir(parents=True)
    (moe / "fake_experts.py").write_text("import torch\n\n\ndef experts(x, w):\n    return torch.matmul(x, w)\n")
    contrib = root / "MiniMax-M3" / "src"
    contrib.mkdir(parents=True)
    lines = ["import torch"] + [""] * 239
    for n, text in CONTRIB_LINES.items():
        lines[n - 1] = text
    (contrib / "modeling_minimax_m3.py").write_text("\n".join(lines) + "\n")


def _load(path: Path, name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _lower_all(where: Path) -> None:  # runs in the subprocess
    import torch
    import torch_xla

    from minimax_m3 import ops
    from minimax_m3.ops.cache import write_positions

    dev = torch_xla.device()
    _write_fake_sources(where / "src")
    moe = _load(where / "src/neuronx_distributed/modules/moe/fake_experts.py", "fake_experts")
    contrib = _load(where / "src/MiniMax-M3/src/modeling_minimax_m3.py", "fake_contrib")
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g).to(dev)

    def lower(name, outs, params, aliases=()):
        ctx = torch_xla._XLAC.lowering.LoweringContext("x")
        ctx.build(list(outs))
        m = hs.parse_module(ctx.hlo())
        ids = [ctx.tensor_parameter_id(p) for p in params]
        for out_index, k in aliases:  # output index <-> the k-th of params, as NxD records a cache alias
            e = m.input_output_alias.entries.add(output_shape_index=[out_index], parameter_number=ids[k])
            e.kind = hs.Kind.Value("MUST_ALIAS")
        (where / f"{name}.hlo").write_bytes(m.SerializeToString())
        (where / f"{name}.json").write_text(json.dumps(ids))

    x, w1, w2 = t(4, 8), t(8, 16), t(16, 2)
    lower("chain", [x @ w1 @ w2], [x, w1, w2])
    q, k, v, pos = t(1, 4, 1, 8), t(1, 4, 16, 8), t(1, 4, 16, 8), torch.tensor([9]).to(dev)
    iq, ik = t(1, 2, 1, 8), t(1, 16, 8)
    att = ops.masked_attention(q, k, v, ops.causal_keep(pos.view(-1, 1), k.shape[2]), 0.5)  # decode, dense
    lower("attn_index", [att, ops.index_block_scores(iq, ik, pos.view(1, 1), 4)], [q, k, v, iq, ik])
    xe, we = t(1, 4, 8), t(2, 8, 6)
    a, b, c = t(3, 5), t(5, 7), t(7, 2)
    lower("experts_contrib", [moe.experts(xe, we), contrib.rope_forward(a, b), contrib.forward(b, c)],
          [xe, we, a, b, c])

    cache, new, qc = t(1, 2, 16, 4), t(1, 2, 1, 4), t(1, 2, 1, 4)
    p5 = torch.tensor([[5]]).to(dev)
    idx = p5.view(1, 1, 1, 1).expand(1, 2, 1, 4)
    out = torch.scatter(cache, 2, idx, new)
    lower("inplace", [qc @ out[:, :, :8].transpose(2, 3), out], [cache], aliases=[(1, 0)])
    seen = write_positions(cache.clone(), new, p5, 2)
    lower("clone_write", [qc @ seen.transpose(2, 3), torch.scatter(cache, 2, idx, new * 2)], [cache],
          aliases=[(1, 0)])
    twin = torch.scatter(cache, 2, idx, new)
    lower("twin_write", [qc @ twin.transpose(2, 3), torch.scatter(cache, 2, idx, new)], [cache], aliases=[(1, 0)])
    window = write_positions(cache[:, :, :8].clone(), new, p5, 2)
    lower("window_write", [qc @ window.transpose(2, 3), torch.scatter(cache, 2, idx, new)], [cache],
          aliases=[(1, 0)])
    ikc, ikn = t(1, 16, 4), t(1, 8, 4)
    lower("concat_write", [torch.cat([ikn, ikc[:, 8:]], dim=1)], [ikc], aliases=[(0, 0)])


@pytest.fixture(scope="module")
def lowered(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("lowered")
    env = dict(os.environ, XLA_IR_DEBUG="1", XLA_HLO_DEBUG="1", PJRT_DEVICE="CPU")
    r = subprocess.run([sys.executable, __file__, str(where)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return where


def _module(where: Path, name: str):
    return hs.parse_module((where / f"{name}.hlo").read_bytes()), json.loads((where / f"{name}.json").read_text())


# ---- FLOPs and their classes ---------------------------------------------------------------------------------
def test_matmul_chain_flops(lowered):
    m, _ = _module(lowered, "chain")
    a = hlo_cost.analyze_module(m)
    # [4,8]@[8,16]: 2*4*16*8 = 1024; [4,16]@[16,2]: 2*4*2*16 = 256; called from this file -> rest
    assert a["flops"] == {"attention": 0, "indexer": 0, "routed_experts": 0, "rest": 1024 + 256}
    assert a["entry_instructions"] <= a["instructions"] and a["entry_instructions"] >= 6  # 3 params, 2 dots, root


def test_attention_and_indexer_classified_by_source(lowered):
    a = hlo_cost.analyze_module(_module(lowered, "attn_index")[0])
    # decode attention, 4 heads, 1 query, 16 keys, head_dim 8: scores 2*4*16*8 = 1024, values 2*4*8*16 = 1024
    # index scores, 2 index heads x 1 query against 16 keys of dim 8: 2*16*2*8 = 512
    assert a["flops"] == {"attention": 2048, "indexer": 512, "routed_experts": 0, "rest": 0}


def test_experts_and_published_port_rows(lowered):
    a = hlo_cost.analyze_module(_module(lowered, "experts_contrib")[0])
    # NxD MoE folder: [1,4,8] @ [2,8,6] -> [2,4,6] x 8: 2*2*4*6*8 = 768
    # the published port's file: forward at line 138 (rotary span) [3,5]@[5,7] = 2*3*7*5 = 210 -> rest,
    # forward at line 240 (indexer span) [5,7]@[7,2] = 2*5*2*7 = 140 -> indexer
    assert a["flops"] == {"attention": 0, "indexer": 140, "routed_experts": 768, "rest": 210}


def test_rule_table_on_frames():
    assert hlo_cost.classify([("/x/site-packages/torch/nn/modules/linear.py", "forward", 1),
                              ("/x/neuronx_distributed/modules/moe/routing.py", "forward", 9)]) == "rest"
    assert hlo_cost.classify([("/x/neuronx_distributed/modules/moe/expert_mlps_v2.py", "f", 1)]) == "routed_experts"
    assert hlo_cost.classify([("/x/neuronx_distributed_inference/modules/attention/attention_base.py", "f", 1),
                              ("/y/minimax_m3/ops/indexer.py", "f", 1)]) == "attention"  # innermost decides
    assert hlo_cost.classify([]) == "rest"


# ---- bytes read and state copies -------------------------------------------------------------------------------
def _state_figures(where, name, fraction=1.0):
    m, (cache,) = _module(where, name)
    a = hlo_cost.analyze_module(m, states={cache: fraction})
    return a["reads"][cache], a["copies"][cache]


def test_inplace_write_reads_the_slice_and_copies_nothing(lowered):
    # cache f32 [1,2,16,4]; the scatter into it reads nothing; attention reads [:, :, :8]: 1*2*8*4 x 4 bytes
    assert _state_figures(lowered, "inplace") == (1 * 2 * 8 * 4 * 4, 0)


def test_clone_then_write_is_a_copy(lowered):
    # the clone's scatter is a second full-size write beside the aliased one; attention reads the whole clone
    assert _state_figures(lowered, "clone_write") == (1 * 2 * 16 * 4 * 4, 1)


def test_identical_second_write_merges(lowered):
    # the same scatter twice: XLA's CSE merges them, so no copy is counted
    assert _state_figures(lowered, "twin_write") == (512, 0)


def test_bucket_window_copy_counts_against_the_bucket(lowered):
    # clone-then-write of the first 8 of 16 slots: not full size, but a full copy of a bucket of 8
    reads, copies = _state_figures(lowered, "window_write")
    assert (reads, copies) == (1 * 2 * 8 * 4 * 4, 0)
    assert _state_figures(lowered, "window_write", fraction=8 / 16)[1] == 1


def test_concatenate_rebuild_is_a_copy(lowered):
    # index-K [1,16,4] f32 rebuilt as cat([new 8 rows, cache[:, 8:]]): reads 8*4*4 bytes, one full-size copy
    assert _state_figures(lowered, "concat_write") == (8 * 4 * 4, 1)


# ---- collectives, custom calls, calls and loops built directly ------------------------------------------------
def _shape(dtype, dims):
    return hs.ShapeProto(element_type=hs.PrimitiveType.Value(dtype), dimensions=dims)


def _hand_module():
    """entry: p0 bf16[4,8]; all-reduce over groups of 4 (x2, one f32; one more with a max reduction); all-gather;
    reduce-scatter; custom calls; two calls of a computation holding a [4,8]x[8,3] dot; a while loop whose body
    holds a [2,2]x[2,2] dot."""
    m = hs.HloModuleProto(name="hand", entry_computation_id=1)
    add = m.computations.add(name="add", id=2, root_id=22)
    add.instructions.add(name="a", opcode="parameter", id=20, parameter_number=0, shape=_shape("F32", []))
    add.instructions.add(name="b", opcode="parameter", id=21, parameter_number=1, shape=_shape("F32", []))
    add.instructions.add(name="s", opcode="add", id=22, operand_ids=[20, 21], shape=_shape("F32", []))
    mx = m.computations.add(name="max", id=5, root_id=52)
    mx.instructions.add(name="a", opcode="parameter", id=50, parameter_number=0, shape=_shape("BF16", []))
    mx.instructions.add(name="b", opcode="parameter", id=51, parameter_number=1, shape=_shape("BF16", []))
    mx.instructions.add(name="m", opcode="maximum", id=52, operand_ids=[50, 51], shape=_shape("BF16", []))
    callee = m.computations.add(name="callee", id=3, root_id=32)
    callee.instructions.add(name="x", opcode="parameter", id=30, parameter_number=0, shape=_shape("BF16", [4, 8]))
    callee.instructions.add(name="w", opcode="parameter", id=31, parameter_number=1, shape=_shape("BF16", [8, 3]))
    d = callee.instructions.add(name="d", opcode="dot", id=32, operand_ids=[30, 31], shape=_shape("BF16", [4, 3]))
    d.dot_dimension_numbers.lhs_contracting_dimensions.append(1)
    d.dot_dimension_numbers.rhs_contracting_dimensions.append(0)
    body = m.computations.add(name="body", id=4, root_id=41)
    body.instructions.add(name="y", opcode="parameter", id=40, parameter_number=0, shape=_shape("F32", [2, 2]))
    d2 = body.instructions.add(name="d2", opcode="dot", id=41, operand_ids=[40, 40], shape=_shape("F32", [2, 2]))
    d2.dot_dimension_numbers.lhs_contracting_dimensions.append(1)
    d2.dot_dimension_numbers.rhs_contracting_dimensions.append(0)
    e = m.computations.add(name="entry", id=1, root_id=19)
    ins = e.instructions
    ins.add(name="p0", opcode="parameter", id=10, parameter_number=0, shape=_shape("BF16", [4, 8]))
    ins.add(name="p1", opcode="parameter", id=11, parameter_number=1, shape=_shape("BF16", [8, 3]))
    ins.add(name="p2", opcode="parameter", id=18, parameter_number=2, shape=_shape("F32", [2, 2]))
    group = [hs.message_classes()["ReplicaGroup"](replica_ids=[0, 1, 2, 3])]
    ins.add(name="ar", opcode="all-reduce", id=12, operand_ids=[10], shape=_shape("BF16", [4, 8]),
            called_computation_ids=[2], replica_groups=group)
    ins.add(name="cv", opcode="convert", id=13, operand_ids=[12], shape=_shape("F32", [4, 8]))
    ins.add(name="ar2", opcode="all-reduce", id=14, operand_ids=[13], shape=_shape("F32", [4, 8]),
            called_computation_ids=[2], replica_groups=group)
    ins.add(name="ag", opcode="all-gather", id=15, operand_ids=[10], shape=_shape("BF16", [16, 8]),
            replica_groups=group, dimensions=[0])
    two = [hs.message_classes()["ReplicaGroup"](replica_ids=[0, 1]), hs.message_classes()["ReplicaGroup"](
        replica_ids=[2, 3])]
    ins.add(name="arm", opcode="all-reduce", id=26, operand_ids=[10], shape=_shape("BF16", [4, 8]),
            called_computation_ids=[5], replica_groups=two)
    ins.add(name="rs", opcode="reduce-scatter", id=27, operand_ids=[10], shape=_shape("BF16", [2, 8]),
            called_computation_ids=[2], replica_groups=two, dimensions=[0])
    ins.add(name="c1", opcode="call", id=16, operand_ids=[10, 11], shape=_shape("BF16", [4, 3]),
            called_computation_ids=[3])
    ins.add(name="c2", opcode="call", id=17, operand_ids=[10, 11], shape=_shape("BF16", [4, 3]),
            called_computation_ids=[3])
    ins.add(name="rms", opcode="custom-call", id=23, operand_ids=[10], shape=_shape("BF16", [4, 8]),
            custom_call_target="AwsNeuronRmsNorm")
    ins.add(name="nki", opcode="custom-call", id=24, operand_ids=[10], shape=_shape("BF16", [4, 8]),
            custom_call_target="AwsNeuronCustomNativeKernel")
    ins.add(name="wh", opcode="while", id=25, operand_ids=[18], shape=_shape("F32", [2, 2]),
            called_computation_ids=[4, 4])
    root = ins.add(name="t", opcode="tuple", id=19, operand_ids=[14, 15, 16, 17, 23, 24, 25, 26, 27])
    root.shape.element_type = hs.PrimitiveType.Value("TUPLE")
    return m


def test_collectives_custom_calls_calls_and_loops():
    a = hlo_cost.analyze_module(hs.parse_module(_hand_module().SerializeToString()))
    # bytes: the full buffer on each rank (an all-gather's output, a reduce-scatter's input, an all-reduce's buffer)
    assert a["collectives"] == [
        {"kind": "all-gather", "dtype": "bf16", "group_size": 4, "count": 1, "bytes": 16 * 8 * 2},
        {"kind": "all-reduce", "dtype": "bf16", "group_size": 4, "count": 1, "bytes": 4 * 8 * 2},
        {"kind": "all-reduce", "dtype": "f32", "group_size": 4, "count": 1, "bytes": 4 * 8 * 4},
        {"kind": "all-reduce (max)", "dtype": "bf16", "group_size": 2, "count": 1, "bytes": 4 * 8 * 2},
        {"kind": "reduce-scatter", "dtype": "bf16", "group_size": 2, "count": 1, "bytes": 4 * 8 * 2},
    ]
    ops = {(o["kind"], o["dtype"], tuple(o["shape"]), o["bytes"]): o["replica_groups"] for o in a["collective_ops"]}
    assert ops == {("all-reduce", "bf16", (4, 8), 64): [[0, 1, 2, 3]],
                   ("all-reduce", "f32", (4, 8), 128): [[0, 1, 2, 3]],
                   ("all-gather", "bf16", (16, 8), 256): [[0, 1, 2, 3]],
                   ("all-reduce (max)", "bf16", (4, 8), 64): [[0, 1], [2, 3]],
                   ("reduce-scatter", "bf16", (2, 8), 64): [[0, 1], [2, 3]]}
    assert a["custom_calls"] == {"AwsNeuronCustomNativeKernel": 1, "AwsNeuronRmsNorm": 1}
    assert a["uncounted_custom_calls"] == ["AwsNeuronCustomNativeKernel"]
    # two call sites of a 2*4*3*8 = 192 FLOP dot, and the while body's 2*2*2*2 = 16 counted once
    assert a["flops"]["rest"] == 2 * 192 + 16
    assert any("while" in n for n in a["notes"]) and any("uncounted" in n for n in a["notes"])
    assert "3 dot(s) without debug metadata counted as rest (trace with XLA_IR_DEBUG=1 XLA_HLO_DEBUG=1)" in a["notes"]
    assert a["instructions"] == 3 + 3 + 3 + 2 + 15 and a["entry_instructions"] == 15  # add, max, callee, body, entry
    # p0 is read by 4 collectives, 2 call sites' dots and 2 custom calls: 8 x 64 bytes; p1 by two dots
    assert a["reads"][0] == 8 * 64 and a["reads"][1] == 2 * 8 * 3 * 2


TINY = M3Config.preset("tiny")  # h 128, 4 layers (1 dense + 3 sparse MoE), 8 q / 2 KV / 2 index heads, d 32


def test_grouped_convolution_flops():
    # conv1d: input [N=1, C=4, W=10], kernel [K=3, C/groups=2, O=6], 2 groups, output [1, 6, 8]: each output
    # element sums 2 channels x 3 taps = 6 multiply-adds -> 48 x 6 x 2 = 576 FLOPs
    m = hs.HloModuleProto(name="conv", entry_computation_id=1)
    e = m.computations.add(name="entry", id=1, root_id=3)
    e.instructions.add(name="x", opcode="parameter", id=1, parameter_number=0, shape=_shape("F32", [1, 4, 10]))
    e.instructions.add(name="k", opcode="parameter", id=2, parameter_number=1, shape=_shape("F32", [3, 2, 6]))
    conv = e.instructions.add(name="c", opcode="convolution", id=3, operand_ids=[1, 2], shape=_shape("F32", [1, 6, 8]),
                              feature_group_count=2)
    conv.convolution_dimension_numbers.kernel_output_feature_dimension = 2  # read from the wire, not defaulted
    a = hlo_cost.analyze_module(hs.parse_module(m.SerializeToString()))
    assert a["flops"]["rest"] == 576 and a["reads"] == {0: 1 * 4 * 10 * 4, 1: 6 * 2 * 3 * 4}


# ---- a dry-run directory and the command ---------------------------------------------------------------------
def _dry_dir(root: Path, lowered: Path, port: str, tg_module: str, params: bool = True) -> Path:
    (root / "hlo").mkdir(parents=True)
    graphs_ = []
    for submodel, name, bucket, cache_name in (("token_generation_model", tg_module, 8, "kv_mgr.past_key_values.2"),
                                               ("context_encoding_model", "concat_write", 16,
                                                "kv_mgr.past_key_values.8")):
        (root / "hlo" / f"{name}.hlo").write_bytes((lowered / f"{name}.hlo").read_bytes())
        m, ids = _module(lowered, name)
        numbers = sorted(hlo_cost.entry_parameters(m))
        entry = {"submodel": submodel, "bucket": bucket, "batch": 1, "hlo": f"hlo/{name}.hlo", "command": None}
        if params:
            entry["params"] = [{"number": n, "role": "state" if n == ids[0] else "input",
                                "name": cache_name if n == ids[0] else f"in{n}"} for n in numbers]
        graphs_.append(entry)
    man = {"format": 1, "port": port, "layout": {"tp": 2, "ep": 2, "lnc": 1, "world_size": 2, "rank": 0},
           "dtype": "float32", "batch_size": 1, "max_length": 16,
           "model": {k: list(v) if isinstance(v, tuple) else v for k, v in TINY.__dict__.items()}, "graphs": graphs_}
    (root / "dry_run.json").write_text(json.dumps(man))
    return root


def test_analyze_dir_sorts_states_and_writes_graphs_json(lowered, tmp_path):
    d = _dry_dir(tmp_path / "ours", lowered, "minimax-m3", "window_write")
    graphs.analyze_dir(d, write=False)
    assert not (d / "graphs.json").exists()
    rep = graphs.analyze_dir(d)  # what compile --dry-run calls: refreshes graphs.json
    assert json.loads((d / "graphs.json").read_text()) == json.loads(json.dumps(rep))
    tg, cte = (next(g for g in rep["graphs"] if g["submodel"] == s)
               for s in ("token_generation_model", "context_encoding_model"))
    # past_key_values.2 = K of layer 1, a sparse layer of the tiny model: the clone-then-write of the 8-token
    # bucket is one copy of the bucket; attention reads the 8 slots: 1*2*8*4 floats
    assert tg["bytes_read"] == {"weights": 0, "kv_dense": 0, "kv_sparse": 256, "index_k": 0}
    assert tg["state_copies"] == {"kv_dense": 0, "kv_sparse": 1, "index_k": 0}
    assert tg["state_copy_bytes"] == {"kv_dense": 0, "kv_sparse": 1 * 2 * 8 * 4 * 4, "index_k": 0}
    # past_key_values.8 = the first index-K cache (after 2 x 4 K/V): rebuilt by a concatenate
    assert cte["bytes_read"]["index_k"] == 8 * 4 * 4 and cte["state_copies"]["index_k"] == 1
    assert cte["state_copy_bytes"]["index_k"] == 16 * 4 * 4
    assert tg["analytic"]["bytes_read"] == plan.decode_minimum_bytes(TINY, 2, 2, 1, 8, dtype_bytes=4)
    assert cte["analytic"]["flops"] == plan.prefill_flops(TINY, 2, 2, 1, 16)
    assert any("state copies: 1 x scatter f32[1, 2, 8, 4]" in n for n in tg["notes"])


def test_two_ports_side_by_side_and_inferred_roles(lowered, tmp_path, capsys):
    from minimax_m3.cli import main

    ours = _dry_dir(tmp_path / "ours", lowered, "minimax-m3", "window_write")
    theirs = _dry_dir(tmp_path / "theirs", lowered, "contrib", "inplace", params=False)
    assert main(["graphs", str(ours), str(theirs)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "analytic" in line)
    assert header.split() == ["minimax-m3", "contrib", "analytic", "minimax-m3/analytic", "contrib/analytic"]
    tg = out.split("== token_generation_model  bucket 8  batch 1 ==")[1]
    row = next(line for line in tg.splitlines() if line.startswith("state copies: kv sparse"))
    assert row.split()[-5:-3] == ["1", "0"]  # window_write copies the bucket, the in-place write does not
    assert "parameter roles inferred" in out
    assert (theirs / "graphs.json").is_file()
    assert main(["graphs", "--json", str(theirs)]) == 0
    assert json.loads(capsys.readouterr().out)["port"] == "contrib"


@pytest.mark.parametrize("case", ["missing", "empty", "no_module", "bad_json", "bad_module"])
def test_bad_directories_one_clear_error(tmp_path, capsys, case):
    from minimax_m3.cli import main

    d = tmp_path / "d"
    if case != "missing":
        d.mkdir()
    if case == "no_module":
        (d / "dry_run.json").write_text(json.dumps({"format": 1, "layout": {"tp": 1, "ep": 1}, "model": {},
                                                    "graphs": [{"submodel": "token_generation_model", "bucket": 8,
                                                                "hlo": "hlo/x.hlo"}]}))
    if case == "bad_json":
        (d / "dry_run.json").write_text("{")
    if case == "bad_module":
        (d / "x.hlo").write_bytes(b"\xff\xff\xff not a protobuf")
        model = {k: list(v) if isinstance(v, tuple) else v for k, v in TINY.__dict__.items()}
        (d / "dry_run.json").write_text(json.dumps({"format": 1, "layout": {"tp": 1, "ep": 1}, "model": model,
                                                    "graphs": [{"submodel": "context_encoding_model", "bucket": 8,
                                                                "hlo": "x.hlo"}]}))
    assert main(["graphs", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("minimax-m3 graphs: error:") and "Traceback" not in err
    assert "dry_run.json" in err and "minimax-m3 compile --dry-run --compiled DIR" in err
    if case == "no_module":
        assert "hlo/x.hlo is missing" in err and "model config missing" in err
    if case == "bad_module":
        assert "module x.hlo is not a readable HloModuleProto" in err


if __name__ == "__main__":
    _lower_all(Path(sys.argv[1]))
    sys.exit(0)


# ---- a whole model from a few traced layers; collectives beside the planner's ----------------------------------------
def test_layer_fit_by_hand():
    from minimax_m3.graphs import layers

    # fixed 7, dense 100, sparse 1000: 1 + 1 -> 1107, 1 + 3 -> 3107, 2 + 1 -> 1207; 3 + 57 -> 57,307
    terms = layers.fit({(1, 1): 1107, (1, 3): 3107, (2, 1): 1207})
    assert terms == (7.0, 100.0, 1000.0) and layers.project(terms, 3, 57) == 7 + 300 + 57_000
    with pytest.raises(layers.LayerFitError, match="not independent"):
        layers.fit({(1, 1): 1, (2, 2): 2, (3, 3): 3})  # only the layer total varies
    with pytest.raises(layers.LayerFitError, match="three"):
        layers.fit({(1, 1): 1, (1, 3): 2})


def test_collectives_are_matched_to_the_planners_rows():
    from minimax_m3.graphs.table import collective_counts, format_collectives

    kv = [[0, 1], [2, 3]]
    ops = [{"kind": "all-gather", "dtype": "bf16", "shape": [2, 1, 3, 8], "bytes": 96, "group_size": 2,
            "replica_groups": kv, "where": "step.py:attention_step:1"}] * 2 + [
           {"kind": "all-reduce (max)", "dtype": "f32", "shape": [1, 2, 3], "bytes": 24, "group_size": 2,
            "replica_groups": kv, "where": "step.py:attention_step:2"}]
    planner = [dict(name="group queries", kind="all-gather", ranks=2, dtype="bf16", bytes=96, count=2),
               dict(name="softmax maxima", kind="all-reduce (max)", ranks=2, dtype="fp32", bytes=24, count=1),
               dict(name="LM head logits", kind="all-gather", ranks=4, dtype="bf16", bytes=1024, count=1)]
    counts = collective_counts({"collective_ops": ops, "analytic": {"collectives": planner}})
    assert counts == {"all-gather bf16 x2 96 B": [2, 2, "group queries"],
                      "all-reduce (max) f32 x2 24 B": [1, 1, "softmax maxima"],
                      "all-gather bf16 x4 1.02 kB": [0, 1, "LM head logits"]}  # in the plan, not in the graph
    lines = format_collectives({"collective_ops": ops})
    assert lines[1].split() == ["2", "x", "all-gather", "bf16[2,", "1,", "3,", "8]", "groups", "2", "x", "2",
                                "consecutive", "96", "B", "step.py:attention_step:1"]

