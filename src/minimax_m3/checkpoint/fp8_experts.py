"""FP8 routed experts in the layout NxD's quantized MoE layers load: expert-wise per-channel e4m3 with fp32 scales.

**The layout.** NxD 0.18's ``QuantizedExpertFusedColumnParallel`` / ``QuantizedExpertFusedRowParallel``
(``neuronx_distributed/quantization/quantization_layers.py:1013-1420``) with
``QuantizationType.EXPERT_WISE_PER_CHANNEL_SYMMETRIC`` (NxD's default qconfig for it is ``F8E4M3``,
``quantization_config.py:206-212``) hold the weight as ``float8_e4m3fn [E, in, out]`` (the bf16 layout of
``ExpertFusedLinear``) and a ``scale`` parameter ``float32 [E, 1, out]`` (``_setup_for_scale``,
``quantization_layers.py:244-254``: per-channel axis 2, dim 0 set to the local experts). The forward multiplies
the matmul's *output* by the scale (``scale_dequantize`` after ``direct_cast_dequantize``,
``quantization_layers.py:1163-1168``), so a step reads one byte per weight and ``4 x out`` bytes of scale per
expert, and the gate/up scale is sharded along with the weight's output columns (partition dim 2 == the channel
axis, ``quantization_layers.py:256-265``). State-dict keys: ``<layer>.weight`` and ``<layer>.scale``
(``get_scale_from_state_dict``, ``quantization_layers.py:439-443``).

Why not the other types: ``PER_CHANNEL_SYMMETRIC`` shares one scale per output channel across all experts
(``scale_shape[0]`` stays 1), far coarser than the release's per-32 blocks; ``BLOCKWISE_SYMMETRIC`` dequantizes
the whole weight to the activation dtype *before* the matmul (``blockwise_scale_dequantize``,
``quantization_layers.py:1159-1160``), a bf16 copy of every local expert per step, and its OCP-MX form
(E8M0 scales, ``is_ocp_mx_quantized``) needs the swizzled ``[E, in/4, tiles, 4 out]`` layout that only NxD's NKI
kernels read (``blockwise_scale_dequantize`` raises on ``mx_swizzle``). Limits of the chosen type stated by NxD:
its blockwise NKI kernel path requires LNC=2 (``expert_mlps_v2.py:875-876``; the port runs LNC=2) and
"lnc=2 blockwise kernel does not support multi expert per token" (``quantization_config.py:230-236``), which
awaits hardware to check against M3's top-k 4 in prefill.

**Rules** (one home; the converter, the reference accuracy twin and the tests call these):

* from bf16/fp32 (and from NVFP4, through its exact float32 dequantization): per expert and output channel the
  smallest power of two ``scale`` with ``amax / scale <= 448``, ``q = e4m3(w / scale)`` rounding to nearest even.
  NxD's own rule (``quantize_fp8_per_channel``, ``quantization_utils.py:126-142``: ``scale = amax / 448``) rounds
  the same for normal values but re-rounds every value of an already-fp8 row (below).
* from MXFP8 (``W = e4m3(q) x 2^(s_b - 127)`` per 1x32 block ``b`` of a row): the row's scale is the power of two
  of its largest block exponent, ``scale = 2^(max_b s_b - 127)``, and ``q' = e4m3(q x 2^(s_b - max_b s_b))``. The
  blocks holding the row's largest scale keep their bytes; a value of another block is exact unless
  ``|q'| < 2^-6`` (e4m3's subnormal range), where it rounds to the multiple of ``2^-9`` nearest to it. The bf16
  rule on the exact dequantized row picks the same power of two or half of it, so the port's path (release → bf16,
  exact → fp8) is at least as exact (test); NxD's amax/448 rule would round every element of the row.
"""

from __future__ import annotations

import torch

from .formats import E4M3_MAX, MX_BLOCK, FormatError, e8m0_to_float

QUANTIZATION_TYPE = "expert_wise_per_channel_symmetric"
QUANTIZATION_DTYPE = "f8e4m3"
# NxD's convert() leaves a ColumnParallel/RowParallel module alone when any of these is a substring of its dotted
# path (quantize.py:121-122): everything but the routed experts (``moe.expert_mlps.mlp_op.*``) stays bf16. ".mlp."
# (dense MLPs) does not match ".mlp_op." or "expert_mlps".
MODULES_TO_NOT_CONVERT = ("self_attn", ".mlp.", "shared_expert", "router", "lm_head", "embed_tokens")
EXPERT_WEIGHTS = ("moe.expert_mlps.mlp_op.gate_up_proj.weight", "moe.expert_mlps.mlp_op.down_proj.weight")


def neuron_config_kwargs() -> dict:
    """NxDI ``NeuronConfig`` fields that turn on NxD's quantized MoE for the routed experts only."""
    return {"quantized": True, "quantization_type": QUANTIZATION_TYPE, "quantization_dtype": QUANTIZATION_DTYPE,
            "modules_to_not_convert": list(MODULES_TO_NOT_CONVERT)}


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., in, out]`` (bf16/fp32) → (``float8_e4m3fn [..., in, out]``, ``float32 [..., 1, out]``): one scale per
    output channel (per expert with a leading expert axis), the smallest power of two with ``amax / scale <= 448``
    (an all-zero channel gets 1); values round to nearest even. On the exact dequantization of an MXFP8 row it picks
    :func:`requantize_mxfp8`'s power of two (or half of it, where the release's largest value rounded down to 224 x
    its block scale), so the release passes through bf16 without loss but below e4m3's normal range."""
    if w.dim() < 2 or not w.is_floating_point():
        raise FormatError(f"per-channel fp8 needs a floating [.., in, out] weight, got {w.dtype}{list(w.shape)}")
    x = w.float()
    amax = x.abs().amax(dim=-2, keepdim=True)
    safe = torch.where(amax > 0, amax, torch.full_like(amax, E4M3_MAX))
    e = torch.ceil(torch.log2(safe / E4M3_MAX))
    e = torch.where(torch.ldexp(torch.tensor(E4M3_MAX), e) < safe, e + 1, e)  # log2 may land one off: fix exactly
    e = torch.where(torch.ldexp(torch.tensor(E4M3_MAX), e - 1) >= safe, e - 1, e)
    scale = torch.ldexp(torch.ones_like(e), e)
    q = (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q x scale`` in float32 (what NxD's layer computes: fp8 weight, output times fp32 scale), cast to dtype."""
    return (q.float() * scale.float()).to(dtype)


def requantize_mxfp8(q: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One MXFP8 matrix ``q [out, in]`` e4m3 with E8M0 ``s [out, ceil(in/32)]`` → (``q' [out, in]`` e4m3,
    ``scale [out]`` fp32) by the power-of-two row rule of the module docstring. Rows of the release layout are the
    output channels (``w1``/``w3``: the intermediate rows, ``w2``: the hidden rows)."""
    if q.dtype != torch.float8_e4m3fn or s.dtype != torch.uint8 or q.dim() != 2 \
            or tuple(s.shape) != (q.shape[0], -(-q.shape[1] // MX_BLOCK)):
        raise FormatError(f"MXFP8 requantization needs e4m3 [out, in] and uint8 [out, ceil(in/32)] scales, got "
                          f"{q.dtype}{list(q.shape)} and {s.dtype}{list(s.shape)}")
    if bool((s == 255).any()):
        raise FormatError("an E8M0 scale is 255 (NaN): the checkpoint is corrupt; re-download it")
    top = s.amax(dim=1, keepdim=True)
    shift = e8m0_to_float((s.to(torch.int32) - top.to(torch.int32) + 127).clamp_min(0).to(torch.uint8))
    shift = torch.where(s.to(torch.int32) - top.to(torch.int32) < -127, torch.zeros_like(shift), shift)
    n = q.shape[1]
    per_elem = shift.repeat_interleave(MX_BLOCK, dim=1)[:, :n]
    q2 = (q.float() * per_elem).to(torch.float8_e4m3fn)  # a power-of-two product: rounds only below 2^-6
    return q2, e8m0_to_float(top[:, 0])


def mxfp8_experts(qs: list[torch.Tensor], ss: list[torch.Tensor], fold: float = 1.0) -> tuple[torch.Tensor,
                                                                                               torch.Tensor]:
    """Per-expert release matrices ``[out, in]`` (MXFP8) → NxD ``weight [E, in, out]`` e4m3 and ``scale [E, 1, out]``
    fp32; ``fold`` (the routed scaling factor of ``down_proj``) multiplies the scale, exactly for powers of two."""
    pairs = [requantize_mxfp8(q, s) for q, s in zip(qs, ss, strict=True)]
    weight = torch.stack([p[0].view(torch.uint8).t() for p in pairs]).contiguous().view(torch.float8_e4m3fn)
    scale = torch.stack([p[1] for p in pairs]).unsqueeze(1) * fold
    return weight, scale


def quantize_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A converted NxDI state dict with bf16/fp32 routed experts → the same dict with each
    ``moe.expert_mlps.mlp_op.{gate_up,down}_proj.weight`` e4m3 plus its ``.scale`` (fp32 ``[E, 1, out]``); the zero
    expert biases, routers, shared experts, attention and norms are untouched."""
    return dict(quantize_pairs(sd.items()))


def quantize_pairs(pairs):
    """:func:`quantize_state_dict` over a ``(name, tensor)`` stream (the converter's, one rule at a time): each routed
    expert weight is followed by its ``.scale``."""
    for name, t in pairs:
        if name.endswith(EXPERT_WEIGHTS) and t.is_floating_point() and t.dtype != torch.float8_e4m3fn:
            q, scale = quantize_per_channel(t)
            yield name, q
            yield name[: -len("weight")] + "scale", scale
        else:
            yield name, t


def error(approx: torch.Tensor, exact: torch.Tensor) -> dict[str, float]:
    """Max abs and relative Frobenius error of ``approx`` against ``exact`` (both taken in float64)."""
    a, e = approx.detach().double(), exact.detach().double()
    d = a - e
    return {"max_abs": float(d.abs().max()), "rel_fro": float(d.norm() / e.norm().clamp_min(1e-300))}


def fp8_twin_(model) -> None:
    """Replace a reference model's routed experts (``Experts.gate_up`` ``[E, H, 2I]``, ``down`` ``[E, I, H]``, the
    NxD layouts) in place by their dequantized fp8 values: what NxD's layers compute, for measuring accuracy."""
    for name, p in model.named_parameters():
        if name.endswith(("experts.gate_up", "experts.down")):
            with torch.no_grad():
                p.copy_(dequantize(*quantize_per_channel(p.detach()), dtype=p.dtype))


def quantize_experts_(model) -> int:
    """Hold a reference model's routed experts as fp8, in place: each ``Experts`` module's ``gate_up`` / ``down``
    become e4m3 (:func:`quantize_per_channel`) and its ``gate_up_scale`` / ``down_scale`` parameters their fp32
    scales (parameters, like the weights: a captured graph takes them as inputs, not constants), which
    ``ops.moe.scaled`` applies to each product's output (NxD's layers' rule). What the vLLM Neuron
    model serves with ``expert_weights: fp8``; its logits equal :func:`fp8_twin_`'s (the dequantized weights) to
    the activation dtype's rounding. Returns the number of modules converted."""
    n = 0
    for module in model.modules():
        if not (hasattr(module, "gate_up") and hasattr(type(module), "scales")):
            continue
        with torch.no_grad():
            for name in ("gate_up", "down"):
                q, scale = quantize_per_channel(getattr(module, name).detach())
                setattr(module, name, torch.nn.Parameter(q, requires_grad=False))
                setattr(module, f"{name}_scale", torch.nn.Parameter(scale, requires_grad=False))
        n += 1
    return n


def mxfp8_twin_(model, source) -> None:
    """Replace a reference model's routed experts, loaded from an MXFP8 checkpoint (``source``: its
    :class:`~minimax_m3.checkpoint.source.Source`), in place by their per-channel requantized values (what NxD's
    layers compute from the converter's output); checks each expert first holds the exact dequantized release."""
    from .formats import mxfp8_dequantize

    c = model.config
    key = "language_model.model.layers.{L}.block_sparse_moe.experts.{E}.{w}.weight"
    for L in (i for i in range(c.num_layers) if c.moe_layers[i]):
        ex = model.layers[L].moe.experts
        for e in range(ex.gate_up.shape[0]):
            exact, fp8 = {}, {}
            for w in ("w1", "w2", "w3"):
                k = key.format(L=L, E=e, w=w)
                q, s = source.reader.get(k), source.reader.get(k.replace("weight", "weight_scale_inv"))
                exact[w] = mxfp8_dequantize(q, s).t()
                q2, sc = requantize_mxfp8(q, s)
                fp8[w] = (q2.float() * sc[:, None]).t()
            gate_up = torch.cat([exact["w1"], exact["w3"]], 1).to(ex.gate_up.dtype)
            if not (torch.equal(ex.gate_up[e], gate_up) and torch.equal(ex.down[e], exact["w2"].to(ex.down.dtype))):
                raise FormatError(f"layer {L} expert {e}: the model does not hold the checkpoint's MXFP8 experts")
            with torch.no_grad():
                ex.gate_up[e] = torch.cat([fp8["w1"], fp8["w3"]], 1)
                ex.down[e] = fp8["w2"]


__all__ = ["EXPERT_WEIGHTS", "MODULES_TO_NOT_CONVERT", "QUANTIZATION_DTYPE", "QUANTIZATION_TYPE", "dequantize",
           "error", "fp8_twin_", "mxfp8_experts", "mxfp8_twin_", "neuron_config_kwargs", "quantize_pairs",
           "quantize_per_channel", "quantize_state_dict", "requantize_mxfp8"]
