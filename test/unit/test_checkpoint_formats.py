"""Element codecs against hand-computed bit patterns; MXFP8/NVFP4 against element-by-element oracles."""

import math

import pytest
import torch

from minimax_m3.checkpoint import formats as F


def test_e2m1_all_16_codes_and_nibble_order():
    # sign bit 3, exponent bits 2-1, mantissa bit 0: 0bSEEM; hand-decoded
    want = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    codes = torch.arange(16, dtype=torch.uint8)
    packed = F.e2m1_pack(codes)  # element 2k in the low nibble
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    got = F.e2m1_unpack(packed)
    assert got.tolist() == want
    assert [math.copysign(1, v) for v in got.tolist()] == [math.copysign(1, v) for v in want]  # -0.0 kept
    # one byte 0xA3: low nibble 0x3 -> +1.5 comes first, high nibble 0xA -> -1.0 second
    assert F.e2m1_unpack(torch.tensor([0xA3], dtype=torch.uint8)).tolist() == [1.5, -1.0]
    assert F.e2m1_unpack(torch.tensor([0xA3], dtype=torch.uint8), n=1).tolist() == [1.5]


def test_e2m1_rounding_ties_to_even_and_saturation():
    x = torch.tensor([0.24, 0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 100.0, -0.3, -2.6, -0.1])
    want = [0.0, 0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.5, -3.0, 0.0]
    assert F.e2m1_unpack(F.e2m1_pack(F.e2m1_codes(x)), n=len(x)).tolist() == want


@pytest.mark.parametrize("byte,value", [
    (0x00, 0.0), (0x80, -0.0), (0x01, 2.0**-9), (0x07, 7 * 2.0**-9), (0x08, 2.0**-6), (0x38, 1.0),
    (0x39, 1.125), (0x40, 2.0), (0x7E, 448.0), (0xFE, -448.0), (0xB8, -1.0), (0x81, -(2.0**-9)),
])
def test_e4m3_bit_patterns(byte, value):
    got = float(F.e4m3_to_float(torch.tensor([byte], dtype=torch.uint8))[0])
    assert got == value and math.copysign(1, got) == math.copysign(1, value)


def test_e4m3_nan_codes():
    assert torch.isnan(F.e4m3_to_float(torch.tensor([0x7F, 0xFF], dtype=torch.uint8))).all()


def test_e8m0_extremes_zero_and_negative_exponents():
    s = torch.tensor([0, 1, 126, 127, 128, 200, 254, 255], dtype=torch.uint8)
    got = F.e8m0_to_float(s).tolist()
    assert got[:7] == [2.0**-127, 2.0**-126, 0.5, 1.0, 2.0, 2.0**73, 2.0**127]
    assert math.isnan(got[7])
    assert F.float_to_e8m0(torch.tensor([-200, -127, -1, 0, 127, 500])).tolist() == [0, 0, 126, 127, 254, 254]


def _mx_oracle(q, s):
    """Element by element with math.ldexp: independent of the vectorised code."""
    qf = q.float().tolist()
    out = [[math.ldexp(v, int(s[o][i // 32]) - 127) for i, v in enumerate(row)] for o, row in enumerate(qf)]
    return torch.tensor(out, dtype=torch.float32)


@pytest.mark.parametrize("shape", [(4, 64), (3, 33), (5, 31), (2, 100), (1, 1)])
def test_mxfp8_dequant_matches_ldexp_oracle_including_ragged_tails(shape):
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(shape, generator=g) * 50).to(torch.float8_e4m3fn)
    q = torch.where(torch.isnan(q.float()), torch.zeros_like(q.float()), q.float()).to(torch.float8_e4m3fn)
    s = torch.randint(100, 150, F.mxfp8_scale_shape(shape), generator=g, dtype=torch.uint8)
    ref = _mx_oracle(q, s.tolist())
    assert torch.equal(F.mxfp8_dequantize(q, s, torch.float32), ref)
    assert torch.equal(F.mxfp8_dequantize(q, s, torch.bfloat16), ref.to(torch.bfloat16))


def test_mxfp8_tail_block_uses_its_own_scale():
    q = torch.ones(1, 40).to(torch.float8_e4m3fn)
    s = torch.tensor([[127, 130]], dtype=torch.uint8)  # tail (8 elements) scaled by 8
    d = F.mxfp8_dequantize(q, s)
    assert d[0, :32].tolist() == [1.0] * 32 and d[0, 32:].tolist() == [8.0] * 8


def test_mxfp8_nan_scale_is_an_error():
    q = torch.ones(2, 64).to(torch.float8_e4m3fn)
    s = torch.full((2, 2), 127, dtype=torch.uint8)
    s[1, 1] = 255
    with pytest.raises(F.FormatError, match="255"):
        F.mxfp8_dequantize(q, s)


def test_mxfp8_round_trip_within_e4m3_bound():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(64, 200, generator=g) * torch.logspace(-6, 2, 200)  # wide dynamic range, ragged tail
    q, s = F.mxfp8_quantize(w)
    assert q.shape == w.shape and s.shape == (64, 7) and s.dtype == torch.uint8
    d = F.mxfp8_dequantize(q, s)
    # per element: relative 2^-4 (3 mantissa bits, nearest) or half a subnormal step of its block, whichever larger
    block_e = torch.repeat_interleave(s.int() - 127, 32, dim=1)[:, :200].float()
    bound = torch.maximum(w.abs() * 2.0**-4, torch.exp2(block_e - 10))
    assert ((d - w).abs() <= bound).all()
    assert not torch.isnan(q.float()).any()  # no element overflowed 448
    assert (q.float().abs().amax(-1) > 224).all()  # scales are tight: every row uses the top binade


def _nv_oracle(packed, ws, s2, n):
    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    out = []
    for o in range(packed.shape[0]):
        row = []
        for i in range(n):
            byte = int(packed[o, i // 2])
            code = (byte >> 4) if i % 2 else (byte & 0xF)
            v = table[code & 7] * (-1 if code & 8 else 1)
            row.append(v * float(ws[o, i // 16].float()))
        out.append(row)
    return torch.tensor(out, dtype=torch.float32) * s2  # (e2m1 * ws) exact, one rounding by s2


@pytest.mark.parametrize("n", [32, 40, 35])
def test_nvfp4_dequant_matches_oracle(n):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(6, n, generator=g)
    packed, ws, s2 = F.nvfp4_quantize(w)
    assert packed.shape == (6, math.ceil(n / 2)) and ws.shape == (6, math.ceil(n / 16)) and s2.dtype == torch.float32
    ref = _nv_oracle(packed, ws, s2, n)
    assert torch.equal(F.nvfp4_dequantize(packed, ws, s2, n), ref)


def test_nvfp4_round_trip_within_one_block_unit():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(32, 96, generator=g) * torch.linspace(0.01, 3, 96)
    w[3, :16] = 0  # an all-zero block
    packed, ws, s2 = F.nvfp4_quantize(w)
    assert float(s2) == pytest.approx(float(w.abs().max()) / (6 * 448), rel=1e-6)
    d = F.nvfp4_dequantize(packed, ws, s2, 96)
    unit = torch.repeat_interleave(ws.float() * s2, 16, dim=1)
    assert ((d - w).abs() <= unit).all()  # nearest E2M1 (half-step <= 1 unit) and <= 6.375 units headroom
    assert (d[3, :16] == 0).all()


def test_nvfp4_bad_global_scale_is_an_error():
    packed, ws, _ = F.nvfp4_quantize(torch.randn(2, 32))
    with pytest.raises(F.FormatError, match="weight_scale_2"):
        F.nvfp4_dequantize(packed, ws, torch.tensor(float("nan")), 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("top", [134, 135, 254])  # <= 134: one multiply by 2^(s-7); above: two
def test_mxfp8_native_path_equals_table_for_every_code_and_scale(dtype, top):
    """The bit-manipulation path against the table of exact products, bit for bit, for every finite e4m3 byte under
    every finite scale (a ragged tail included); tensors with NaN codes go to the table and keep its NaN bits."""
    codes = torch.tensor([c for c in range(256) if c % 128 != 127], dtype=torch.uint8)  # 254 finite codes
    n = len(codes) * 32 + 7  # every code in every block, then a 7-element tail with its own scale
    q = torch.cat([codes.repeat_interleave(32), codes[100:107]]).repeat(top + 1, 1).view(torch.float8_e4m3fn)
    s = torch.arange(top + 1, dtype=torch.uint8)[:, None].repeat(1, len(codes) + 1)
    s[:, -1] = s[:, -1].flip(0)
    native, table = torch.empty(top + 1, n, dtype=dtype), torch.empty(top + 1, n, dtype=dtype)
    F._mx_native(q, s, native)
    F._mx_table(q, s, table)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(native.view(bits), table.view(bits))
    if top == 134:  # the public entry (no overflow possible), with and without NaN codes
        assert torch.equal(F.mxfp8_dequantize(q, s, dtype).view(bits), table.view(bits))
        qn = q.view(torch.uint8).clone()
        qn[3, 5], qn[7, 40] = 0x7F, 0xFF
        qn = qn.view(torch.float8_e4m3fn)
        ref = torch.empty(top + 1, n, dtype=dtype)
        F._mx_table(qn, s, ref)
        got = F.mxfp8_dequantize(qn, s, dtype)
        assert torch.isnan(got[3, 5]) and torch.isnan(got[7, 40]) and torch.equal(got.view(bits), ref.view(bits))


def test_mxfp8_dequantize_into_a_given_buffer():
    g = torch.Generator().manual_seed(5)
    q, s = F.mxfp8_quantize(torch.randn(8, 70, generator=g))
    out = torch.full((8, 70), 7.0, dtype=torch.bfloat16)
    assert F.mxfp8_dequantize(q, s, torch.bfloat16, out=out) is not None
    assert torch.equal(out, _mx_oracle(q, s.tolist()).to(torch.bfloat16))
    with pytest.raises(ValueError, match="does not fit"):
        F.mxfp8_dequantize(q, s, torch.float32, out=out)
