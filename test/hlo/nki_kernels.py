"""Stand-ins for the NKI kernels NxD calls from the traced graph (test code, like ``scribe.py``).

The kernels live in the closed ``nkilib`` package; here each one becomes one custom call with the operands NxD hands
it and the result shape NxD reads back, so the graph has the shape a neuronx-cc build would see. The call's
``custom_call_target`` is ``AwsNeuronCustomNativeKernel`` (how NKI kernels reach neuronx-cc) and its backend config is
a small JSON naming the kernel and its static parameters, from which ``minimax_m3.neuron.hlo_cost`` counts the
kernel's FLOPs analytically (``minimax_m3.neuron.nki_cost``).

* ``nkilib.core.moe.moe_cte.bwmm_shard_on_I.blockwise_mm_baseline_shard_intermediate_hybrid``: NxD's
  shard-on-intermediate dynamic-while blockwise MoE kernel (``modules/moe/blockwise.py``
  ``_call_shard_on_intermediate_kernel``): returns the ``[T + 1, H]`` output (the padding row included; NxD slices
  ``[:T]``).
"""

from __future__ import annotations

import json

TARGET = "AwsNeuronCustomNativeKernel"
SHARD_ON_I = "blockwise_mm_baseline_shard_intermediate_hybrid"


class _Kernel:
    """``kernel[grid](**kwargs)`` as NKI kernels are launched."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __getitem__(self, grid):
        return lambda **kwargs: self.fn(**kwargs)


def _custom_call(operands, out_shape, dtype, config: dict):
    import torch_xla

    ops = [t for t in operands if t is not None]
    return torch_xla._XLAC._xla_custom_call(ops, TARGET, [list(out_shape)], [dtype], False,
                                            json.dumps(config, sort_keys=True), 1, {})[0]


def shard_on_intermediate(*, conditions, hidden_states, expert_affinities_masked, gate_up_proj_weight,
                          down_proj_weight, gate_and_up_proj_bias=None, down_proj_bias=None, block_size,
                          num_static_block, token_position_to_id, block_to_expert, gate_up_proj_scale=None,
                          down_proj_scale=None, **_):
    if gate_up_proj_scale is not None or down_proj_scale is not None:
        raise NotImplementedError("nki stand-in: quantized experts are not traced here")
    config = {"nki_kernel": SHARD_ON_I, "block_size": int(block_size), "num_static_block": int(num_static_block),
              "num_blocks": int(block_to_expert.shape[0])}
    operands = [conditions, hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                gate_and_up_proj_bias, down_proj_bias, token_position_to_id, block_to_expert]
    return _custom_call(operands, hidden_states.shape, hidden_states.dtype, config)


def _bwmm_shard_on_i(m):
    m.blockwise_mm_baseline_shard_intermediate_hybrid = _Kernel(SHARD_ON_I, shard_on_intermediate)


def _nki(m):
    """``nki.jit(kernel, mode="torchxla")`` (NxD's ``import_nki_beta2``) returns the kernel itself."""
    m.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)


VALUES = {"nki": _nki, "nkilib.core.moe.moe_cte.bwmm_shard_on_I": _bwmm_shard_on_i}
