"""Number formats of the published checkpoints and their exact, vectorised (de)quantization.

* E8M0 (``uint8``): a biased power-of-two exponent, value ``2^(s-127)``; 255 is NaN.
* E4M3 (``float8_e4m3fn``): 1 sign, 4 exponent (bias 7), 3 mantissa bits; max 448; 0x7F/0xFF NaN.
* E2M1 (FP4, packed two per ``uint8``, element ``2k`` in the LOW nibble): magnitudes
  ``[0, 0.5, 1, 1.5, 2, 3, 4, 6]``, bit 3 the sign.

MXFP8 (MiniMaxAI/MiniMax-M3-MXFP8): ``W[o, i] = e4m3(Wq[o, i]) * 2^(S[o, i // 32] - 127)`` — a product by a power
of two, so exact in float32 (and in bf16 for every value bf16 can hold). A last block narrower than 32 (``in % 32``)
uses its own scale; nothing assumes ``in`` divides evenly.

NVFP4 (ModelOpt): ``W[o, i] = (e2m1(nib(o, i)) * e4m3(weight_scale[o, i // 16])) * weight_scale_2`` — the first
product is exact in float32 (at most 6 significant bits), the second rounds once, so the float32 result is the
correctly rounded value of the exact real product.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import M3Error

MX_BLOCK = 32
NV_BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1_LUT = torch.tensor(E2M1_VALUES, dtype=torch.float32)
# rows processed per step when dequantizing: bounds the float32 temporaries to a few MiB
_CHUNK_ELEMS = 1 << 22


_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16}
_LUTS: dict = {}


def _mx_lut(dtype: torch.dtype) -> np.ndarray:
    """All 256 x 256 products ``e4m3(q) * 2^(s-127)`` (exact in float32), cast once to ``dtype``; index
    ``s << 8 | q``. A lookup gives bit-for-bit what the element-wise formula gives, without float8 arithmetic."""
    if dtype not in _LUTS:
        q = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        s = e8m0_to_float(torch.arange(256, dtype=torch.uint8))
        t = (s[:, None] * q[None, :]).to(dtype).reshape(-1)
        _LUTS[dtype] = t.view(_INT_VIEW.get(dtype, dtype)).numpy().copy()
    return _LUTS[dtype]


class FormatError(M3Error, ValueError):
    """Quantized data that cannot be decoded (NaN scales, wrong dtypes or shapes)."""


# ---- element codecs ------------------------------------------------------------------------------

def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 codes → float32 ``2^(s-127)`` (exact; code 0 is the subnormal 2^-127); 255 → NaN."""
    if s.dtype != torch.uint8:
        raise FormatError(f"E8M0 scales must be uint8, got {s.dtype}")
    bits = s.to(torch.int32) << 23  # float32 exponent field; s=0 gives +0 here, fixed below
    out = bits.view(torch.float32)
    out = torch.where(s == 0, torch.tensor(2.0**-127, dtype=torch.float32), out)
    return torch.where(s == 255, torch.tensor(float("nan")), out)


def float_to_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents e (scale 2^e) → uint8 codes ``e + 127``, clamped to the finite range [0, 254]."""
    return (exponent.to(torch.int32) + 127).clamp(0, 254).to(torch.uint8)


def e4m3_to_float(q: torch.Tensor) -> torch.Tensor:
    if q.dtype == torch.uint8:
        q = q.view(torch.float8_e4m3fn)
    if q.dtype != torch.float8_e4m3fn:
        raise FormatError(f"E4M3 data must be float8_e4m3fn, got {q.dtype}")
    return q.to(torch.float32)


def e2m1_unpack(packed: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """``uint8 [..., m]`` holding two E2M1 codes per byte (low nibble first) → float32 ``[..., n]`` (n ≤ 2m)."""
    if packed.dtype != torch.uint8:
        raise FormatError(f"packed E2M1 data must be uint8, got {packed.dtype}")
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
    vals = _E2M1_LUT[codes.to(torch.int32)]
    return vals if n is None else vals[..., :n]


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float → E2M1 codes (round to nearest, ties to the even code; |x| > 6 saturates to 6)."""
    a = x.abs().float()
    # code = number of thresholds passed; ties go to the even neighbour
    down = (0.25, 1.25, 2.5, 5.0)  # tie → lower (even) code
    up = (0.75, 1.75, 3.5)  # tie → upper (even) code
    code = sum((a > t).to(torch.uint8) for t in down) + sum((a >= t).to(torch.uint8) for t in up)
    sign = (torch.signbit(x) & (code > 0)).to(torch.uint8) << 3
    return code | sign


def e2m1_pack(codes: torch.Tensor) -> torch.Tensor:
    """codes ``[..., n]`` → ``uint8 [..., ceil(n/2)]``, element 2k in the low nibble (odd n padded with 0)."""
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    pairs = codes.unflatten(-1, (-1, 2))
    return (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)


# ---- MXFP8 --------------------------------------------------------------------------------------

def mxfp8_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (*shape[:-1], math.ceil(shape[-1] / MX_BLOCK))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``[..., n]`` → ``[..., ceil(n/block), block]``, zero-padding a ragged tail."""
    pad = -x.shape[-1] % block
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.unflatten(-1, (-1, block))


def mxfp8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16/fp32 ``[out, in]`` → (e4m3 weight, uint8 E8M0 scale ``[out, ceil(in/32)]``).

    Scale exponent per 1×32 block: the smallest e with ``amax / 2^e ≤ 448`` (OCP ``ceil(log2(amax/448))``), so no
    element saturates; elements round to nearest-even E4M3. All-zero blocks get code 0.
    """
    x = w.float()
    n = x.shape[-1]
    amax = _blocks(x.abs(), MX_BLOCK).amax(-1)
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    e = torch.ceil(torch.log2(safe / E4M3_MAX)).to(torch.int32)
    # log2 in float can land one off either side of an exact power of two: fix up exactly
    e = torch.where(torch.ldexp(torch.tensor(E4M3_MAX), e.float()) < safe, e + 1, e)
    e = torch.where(torch.ldexp(torch.tensor(E4M3_MAX), (e - 1).float()) >= safe, e - 1, e)
    e = torch.where(amax > 0, e, torch.full_like(e, -127))
    scale = float_to_e8m0(e)
    q = (_blocks(x, MX_BLOCK) / e8m0_to_float(scale).unsqueeze(-1)).flatten(-2)[..., :n]
    return q.to(torch.float8_e4m3fn), scale


def mxfp8_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                     name: str = "tensor", out: torch.Tensor | None = None) -> torch.Tensor:
    """Exact ``e4m3(q) * 2^(scale - 127)`` per 1×32 block, processed in row chunks; returns ``dtype`` (into ``out``,
    a contiguous tensor of ``q``'s size, when given)."""
    if q.dtype != torch.float8_e4m3fn:
        raise FormatError(f"{name}: MXFP8 weight must be float8_e4m3fn, got {q.dtype}")
    if scale.dtype != torch.uint8:
        raise FormatError(f"{name}: weight_scale_inv must be uint8 E8M0, got {scale.dtype}")
    if tuple(scale.shape) != mxfp8_scale_shape(tuple(q.shape)):
        raise FormatError(f"{name}: weight_scale_inv shape {list(scale.shape)} should be "
                          f"{list(mxfp8_scale_shape(tuple(q.shape)))} for weight {list(q.shape)}")
    smax = int(scale.max()) if scale.numel() else 0
    if smax == 255:
        bad = int((scale == 255).sum())
        raise FormatError(f"{name}: {bad} E8M0 scale(s) are 255 (NaN); the checkpoint is corrupt — re-download it")
    n = q.shape[-1]
    q2 = q.reshape(-1, n)
    s2 = scale.reshape(-1, scale.shape[-1])
    if out is None:
        out = torch.empty(q2.shape, dtype=dtype)
    elif out.dtype != dtype or out.numel() != q2.numel() or not out.is_contiguous():
        raise ValueError(f"{name}: output buffer {out.dtype}{list(out.shape)} does not fit {dtype}{list(q.shape)}")
    o2 = out.view(q2.shape)
    qu = q2.view(torch.uint8)
    nan = q2.numel() and (int(qu.max()) == 0xFF or int(qu.view(torch.int8).max()) == 0x7F)  # e4m3fn NaN codes
    if dtype in (torch.bfloat16, torch.float32) and not nan:
        _mx_native(q2, s2, o2)
    else:
        _mx_table(q2, s2, o2)
    if smax >= 247 and not torch.isfinite(o2).all():
        raise FormatError(f"{name}: dequantized values overflow {dtype}; scales up to {smax} are "
                          "outside any real checkpoint's range — the file is corrupt")
    return out.view(q.shape)


# e4m3 byte → the bits of e4m3 · 2^-120 in bf16 / fp32: sign-extend the byte, shift its 7 exponent+mantissa bits
# under the wider exponent field, keep sign | those bits. (exponent e, mantissa m) lands as exponent field e, so a
# normal code reads 2^(e-127)·1.m = value·2^-120, and a subnormal code (e = 0) reads the subnormal 0.m·2^-126 — also
# value·2^-120. Multiplying by 2^(s-7) then gives value · 2^(s-127) exactly.
_RAW = {torch.bfloat16: (torch.int16, 4, -0x7810), torch.float32: (torch.int32, 20, -0x78100000)}


def _mx_native(q: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
    """bf16/fp32 output by bit manipulation plus one multiply by a power of two per block; equal to the table
    (``test_mxfp8_native_path_equals_table_for_every_code_and_scale`` checks all 256 codes x 255 scales).

    Exact: e4m3 · 2^-120 is a bf16/fp32 number (above); 2^(s-7) is one for s ≤ 134; torch multiplies bf16 in
    float32, where the product (a 4-bit significand times a power of two, at least 2^-136) is exact, and rounds once
    to ``out``'s dtype — the table's ``(e4m3 · 2^(s-127) in fp32).to(dtype)``. Larger scales take two multiplies
    (by 2^120, exact, then by 2^(s-127)). NaN codes (0x7F, 0xFF) are not handled: tensors holding one take the
    table (``mxfp8_dequantize`` checks), so even NaN bits agree."""
    rows, n = q.shape
    full = (n // MX_BLOCK) * MX_BLOCK
    nb = full // MX_BLOCK
    ity, shift, mask = _RAW[out.dtype]
    two_step = int(s.max()) > 134 if s.numel() else False
    pw = e8m0_to_float(s) if two_step else e8m0_to_float(s) * 2.0**120  # 2^(s-7), exact in fp32
    pw = pw.to(out.dtype)
    qu = q.view(torch.uint8)
    oi = out.view(ity)
    step = max(1, (1 << 18) // max(1, n))  # ~256k elements per step: every pass stays in cache
    for r0 in range(0, rows, step):
        r1 = min(r0 + step, rows)
        o, x = out[r0:r1], qu[r0:r1]
        raw = oi[r0:r1]
        raw.copy_(x.view(torch.int8))
        raw.bitwise_left_shift_(shift).bitwise_and_(mask)
        if two_step:
            o.mul_(2.0**120)
        if full:
            o[:, :full].unflatten(-1, (nb, MX_BLOCK)).mul_(pw[r0:r1, :nb, None])
        if full < n:
            o[:, full:].mul_(pw[r0:r1, -1:])


def _mx_table(q: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
    """Any other dtype: one lookup per element in the table of all products (index ``scale << 8 | e4m3 byte``)."""
    qv = q.view(torch.uint8).numpy()
    sv = s.numpy()
    n = q.shape[-1]
    lut = _mx_lut(out.dtype)
    ov = out.view(_INT_VIEW.get(out.dtype, out.dtype)).numpy()
    rows = max(1, _CHUNK_ELEMS // max(1, n))
    full = (n // MX_BLOCK) * MX_BLOCK
    nb = full // MX_BLOCK
    for r0 in range(0, qv.shape[0], rows):
        r1 = min(r0 + rows, qv.shape[0])
        if full:
            idx = (sv[r0:r1, :nb, None].astype(np.uint16) << 8) | qv[r0:r1, :full].reshape(r1 - r0, nb, MX_BLOCK)
            np.take(lut, idx, out=ov[r0:r1, :full].reshape(r1 - r0, nb, MX_BLOCK), mode="clip")
        if full < n:
            idx = (sv[r0:r1, -1:].astype(np.uint16) << 8) | qv[r0:r1, full:]
            ov[r0:r1, full:] = np.take(lut, idx)


# ---- NVFP4 --------------------------------------------------------------------------------------

def nvfp4_shapes(shape: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """Logical ``[out, in]`` → (packed weight shape, per-16 scale shape)."""
    o, i = shape
    return (o, math.ceil(i / 2)), (o, math.ceil(i / NV_BLOCK))


def nvfp4_global_scale(*ws: torch.Tensor) -> torch.Tensor:
    """ModelOpt ``weight_scale_2 = amax / (6 * 448)`` over all given tensors (w1 and w3 share one)."""
    amax = max(float(w.float().abs().max()) for w in ws)
    return torch.tensor(amax / (E2M1_MAX * E4M3_MAX) if amax > 0 else 1.0, dtype=torch.float32)


def nvfp4_quantize(w: torch.Tensor, scale_2: torch.Tensor | None = None):
    """``[out, in]`` → (packed uint8 ``[out, ceil(in/2)]``, e4m3 ``weight_scale [out, ceil(in/16)]``, fp32 scale_2)."""
    x = w.float()
    n = x.shape[-1]
    s2 = nvfp4_global_scale(x) if scale_2 is None else scale_2.float()
    blocks = _blocks(x, NV_BLOCK)
    ws = (blocks.abs().amax(-1) / (E2M1_MAX * s2)).to(torch.float8_e4m3fn)
    denom = ws.float() * s2
    scaled = torch.where(denom.unsqueeze(-1) > 0, blocks / denom.unsqueeze(-1).clamp_min(1e-38),
                         torch.zeros_like(blocks))
    codes = e2m1_codes(scaled.flatten(-2)[..., :n])
    return e2m1_pack(codes), ws, s2


def nvfp4_dequantize(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor, in_features: int,
                     dtype: torch.dtype = torch.float32, name: str = "tensor") -> torch.Tensor:
    """``(e2m1 * e4m3(scale)) * scale_2`` per 16 elements, row-chunked; returns ``[out, in_features]`` ``dtype``."""
    problems = []
    if packed.dtype != torch.uint8:
        problems.append(f"packed weight must be uint8, got {packed.dtype}")
    if scale.dtype != torch.float8_e4m3fn:
        problems.append(f"weight_scale must be float8_e4m3fn, got {scale.dtype}")
    if scale_2.dtype != torch.float32 or scale_2.numel() != 1:
        problems.append(f"weight_scale_2 must be one float32, got {scale_2.dtype} {list(scale_2.shape)}")
    want_p, want_s = nvfp4_shapes((packed.shape[0], in_features))
    if tuple(packed.shape) != want_p or tuple(scale.shape) != want_s:
        problems.append(f"shapes {list(packed.shape)}/{list(scale.shape)} do not pack [{packed.shape[0]}, "
                        f"{in_features}]; expected {list(want_p)}/{list(want_s)}")
    if problems:
        raise FormatError(f"{name}: " + "; ".join(problems))
    s2 = float(scale_2)
    if not math.isfinite(s2) or s2 <= 0:
        raise FormatError(f"{name}: weight_scale_2 is {s2}; it must be a finite positive number")
    sf = scale.to(torch.float32)
    if torch.isnan(sf).any():
        raise FormatError(f"{name}: {int(torch.isnan(sf).sum())} NaN weight_scale value(s); the file is corrupt")
    o = packed.shape[0]
    out = torch.empty((o, in_features), dtype=dtype)
    rows = max(1, _CHUNK_ELEMS // max(1, in_features))
    nb = want_s[1]
    for r0 in range(0, o, rows):
        v = e2m1_unpack(packed[r0:r0 + rows])  # [r, 2*ceil(in/2)]
        pad = nb * NV_BLOCK - v.shape[-1]
        if pad > 0:
            v = torch.nn.functional.pad(v, (0, pad))
        v = v[:, : nb * NV_BLOCK].unflatten(-1, (nb, NV_BLOCK)).mul_(sf[r0:r0 + rows, :, None]).mul_(s2)
        out[r0:r0 + rows] = v.flatten(-2)[:, :in_features]
    return out
