"""Stand-ins for the NKI kernels NxD calls from the traced graph (test code, like ``scribe.py``).

The kernels live in the closed ``nkilib`` package; here each one becomes one custom call with the operands NxD hands
it and the result shape NxD reads back, so the graph has the shape a neuronx-cc build would see. The call's
``custom_call_target`` is ``AwsNeuronCustomNativeKernel`` (how NKI kernels reach neuronx-cc) and its backend config is
a small JSON naming the kernel and its static parameters, from which ``minimax_m3.graphs.hlo_cost`` counts the
kernel's FLOPs analytically (``minimax_m3.graphs.nki_cost``).

* ``nkilib.core.moe.moe_cte.bwmm_shard_on_I.blockwise_mm_baseline_shard_intermediate_hybrid``: NxD's
  shard-on-intermediate dynamic-while blockwise MoE kernel (``modules/moe/blockwise.py``
  ``_call_shard_on_intermediate_kernel``): returns the ``[T + 1, H]`` output (the padding row included; NxD slices
  ``[:T]``).
* ``nkilib.core.attention.attention_cte.attention_cte``: the context-encoding flash-attention kernel NxDI's
  ``NeuronAttentionBase.perform_prefill`` launches (``_flash_fwd_call_nki``, ``nki.jit(attention_cte)``) when
  ``get_flash_attention_strategy`` picks a kernel: ``kernel[lnc](q, k, v, 1.0, causal_mask=..., tp_out=True, tp_q=True,
  tp_k=True)`` (sharded, LNC 2) or ``kernel(...)`` (unsharded). Operands q ``[B*H, S, D]``, k and v ``[B*KV, S, D]``
  (trn2: native GQA, no K/V replication; q already divided by NxDI's ``softmax_scale``); returns ``[B*H, D, S]``
  with ``tp_out`` (else ``[B*H, S, D]``), in q's dtype (nki-library ``_check_input_and_return_shape``).
"""

from __future__ import annotations

import json

TARGET = "AwsNeuronCustomNativeKernel"
SHARD_ON_I = "blockwise_mm_baseline_shard_intermediate_hybrid"
ATTENTION_CTE = "attention_cte"


class _Kernel:
    """``kernel[grid](...)`` (SPMD launch) or ``kernel(...)`` as NKI kernels are launched; the stand-in gets
    ``grid``."""

    def __init__(self, name, fn):
        self.name, self.fn = name, fn

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.fn(*args, grid=grid, **kwargs)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, grid=None, **kwargs)


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


def attention_cte(q, k, v, scale=1.0, causal_mask=True, k_prior=None, v_prior=None, prior_used_len=None, sink=None,
                  sliding_window=None, tp_q=True, tp_k=False, tp_out=False, cache_softmax=False, grid=None,
                  cp_offset=None, global_cp_deg=None, bound_min=None, bound_max=None, **_):
    extras = {"k_prior": k_prior, "v_prior": v_prior, "prior_used_len": prior_used_len, "sink": sink,
              "sliding_window": sliding_window or None, "cache_softmax": cache_softmax or None, "cp_offset": cp_offset,
              "global_cp_deg": global_cp_deg, "bound_min": bound_min, "bound_max": bound_max}
    used = sorted(name for name, value in extras.items() if value is not None)
    if used:
        raise NotImplementedError(f"nki stand-in: attention_cte with {', '.join(used)} is not traced here")
    bs, sq, d = q.shape if tp_q else (q.shape[0], q.shape[2], q.shape[1])
    bs_kv, sk = k.shape[0], k.shape[1] if tp_k else k.shape[2]
    want_k = (bs_kv, sk, d) if tp_k else (bs_kv, d, sk)
    if tuple(k.shape) != want_k or tuple(v.shape) != (bs_kv, sk, d) or bs % bs_kv or d > 128:
        raise ValueError(f"nki stand-in: attention_cte shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"(tp_q={tp_q}, tp_k={tp_k}) break the kernel's contract")
    config = {"nki_kernel": ATTENTION_CTE, "causal_mask": bool(causal_mask), "scale": float(scale), "tp_q": bool(tp_q),
              "tp_k": bool(tp_k), "tp_out": bool(tp_out), "grid": None if grid is None else int(grid)}
    return _custom_call([q, k, v], (bs, d, sq) if tp_out else (bs, sq, d), q.dtype, config)


def _attention_cte(m):
    m.attention_cte = _Kernel(ATTENTION_CTE, attention_cte)


def _bwmm_shard_on_i(m):
    m.blockwise_mm_baseline_shard_intermediate_hybrid = _Kernel(SHARD_ON_I, shard_on_intermediate)


def _nki(m):
    """``nki.jit(kernel, mode="torchxla")`` (NxD's ``import_nki_beta2``) returns the kernel itself."""
    m.jit = lambda fn=None, **_: fn if fn is not None else (lambda f: f)


VALUES = {"nki": _nki, "nkilib.core.moe.moe_cte.bwmm_shard_on_I": _bwmm_shard_on_i,
          "nkilib.core.attention.attention_cte": _attention_cte}
