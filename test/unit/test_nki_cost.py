"""The analytic FLOPs of NxDI's context-encoding flash-attention kernel (``nki_cost``, ``attention_cte``), by hand.

The kernel (nki-library ``core/attention/attention_cte.py``) takes queries in groups of 128 and issues QK^T over
512-key tiles and PV over 128-key tiles, skipping a tile under the causal mask when its first key comes after the
group's last query. Per head at ``S = 512 T`` that is ``2 T (T + 1)`` QK tiles of ``2 * 128 * 512 * D`` FLOPs and
``G (G + 1) / 2`` PV tiles of ``2 * 128 * 128 * D`` (``G = S / 128``); the numbers below are that sum worked out.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from minimax_m3.graphs.nki_cost import NKI_KERNEL_COST

CFG = {"nki_kernel": "attention_cte", "causal_mask": True, "scale": 1.0, "tp_q": True, "tp_k": True, "tp_out": True,
       "grid": 2}


def _flops(q, k, v, **cfg):
    cls, cost, _ = NKI_KERNEL_COST["attention_cte"]
    assert cls == "attention"
    return cost([SimpleNamespace(dimensions=list(s)) for s in (q, k, v)], {**CFG, **cfg})


def test_causal_8k_head_dim_128_by_hand():
    # T = 16: 544 QK tiles x 16,777,216 + G = 64: 2,080 PV tiles x 4,194,304
    assert 544 * 16_777_216 + 2_080 * 4_194_304 == 17_850_957_824
    assert _flops((1, 8192, 128), (1, 8192, 128), (1, 8192, 128)) == 17_850_957_824
    # 1.039x the exact causal product count 2 * S^2 * D (two matmuls over half the square)
    assert 17_850_957_824 / (2 * 8192**2 * 128) == pytest.approx(1.0391, abs=1e-4)


def test_without_the_mask_every_tile_is_computed():
    assert _flops((1, 8192, 128), (1, 8192, 128), (1, 8192, 128), causal_mask=False) == 4 * 8192**2 * 128


def test_a_bucket_shorter_than_one_key_tile():
    # S = 256, D = 8: both query groups see the one 256-key QK tile whole (2 x 2*128*256*8 = 1,048,576); PV: group 0
    # the first 128 keys, group 1 all 256 (2*128*384*8 = 786,432)
    assert _flops((1, 256, 8), (1, 256, 8), (1, 256, 8)) == 1_835_008


def test_heads_in_the_batch_and_gqa_and_layouts():
    one = _flops((1, 2048, 128), (1, 2048, 128), (1, 2048, 128))
    # T = 4: 40 QK tiles x 16,777,216; G = 16: 136 PV tiles x 4,194,304
    assert one == 40 * 16_777_216 + 136 * 4_194_304
    # 4 query heads over 1 shared K/V head (native GQA): four times one head
    assert _flops((4, 2048, 128), (1, 2048, 128), (1, 2048, 128)) == 4 * one
    # q as [B, D, S] and k as [B, D, S] (tp_q / tp_k off): the same work
    assert _flops((1, 128, 2048), (1, 128, 2048), (1, 2048, 128), tp_q=False, tp_k=False) == one
