"""Static-graph proof of a sparse layer on the XLA CPU device, through the step that ships (``ops.attention_step``, via
``layer_functions``): prefill (query chunks, each query's top-k blocks gathered) and a decode step (scoring the prior
index keys and the active one, top-k, block gather, then the K/V and index-K cache writes).

Each graph: outputs equal the eager CPU run (float32, ≤ 1e-5; block ids identical), exactly one compilation for
a new input shape, none on a second call with new data, and no op falls back to the CPU (fixture ``xla``).
"""

import torch

from test.support import layer_functions as L
from .conftest import run_on_xla

TOL = dict(rtol=0, atol=1e-5)


def _inputs(seed: int, b: int, s: int, smax: int):
    g = torch.Generator().manual_seed(seed)
    p = L.make_params(torch.Generator().manual_seed(0))
    x = torch.randn(b, s, L.HID, generator=g)
    caches = (torch.zeros(b, L.HKV, smax, L.D), torch.zeros(b, L.HKV, smax, L.D), torch.zeros(b, smax, L.DI))
    return p, x, caches


def _prefill(p, x, kc, vc, ic):
    return L.sparse_prefill(p, x, kc, vc, ic)


def test_sparse_prefill_matches_eager_one_compile_per_shape(xla):
    b, s, smax = 2, 96, 128
    p, x, caches = _inputs(1, b, s, smax)
    want = _prefill(p, x, *[c.clone() for c in caches])
    got, n1 = run_on_xla(_prefill, p, x, *caches)
    for w, o in zip(want, got):
        torch.testing.assert_close(o, w, **TOL)
    assert n1 == 1, f"first call at a new shape compiled {n1} graphs, expected 1"

    _, x2, caches2 = _inputs(2, b, s, smax)  # new data, same shapes
    want2 = _prefill(p, x2, *[c.clone() for c in caches2])
    got2, n2 = run_on_xla(_prefill, p, x2, *caches2)
    torch.testing.assert_close(got2[0], want2[0], **TOL)
    assert n2 == 0, f"second call with new data recompiled ({n2} graphs)"
    assert not torch.allclose(got2[0], got[0])  # the new data reached the graph

    _, x3, caches3 = _inputs(3, b, s - 16, smax)  # a new prefill length is a new graph
    _, n3 = run_on_xla(_prefill, p, x3, *caches3)
    assert n3 == 1


def test_prefill_really_is_sparse():
    """The geometry drops blocks: sparse prefill differs from dense causal prefill in the last blocks only."""
    p, x, _ = _inputs(1, 2, 96, 128)
    pos = torch.arange(96).unsqueeze(0).expand(2, 96)
    q, k, v, iq, ik = L.project(p, x, pos)
    sparse = L.prefill_step(q, k, v, L.D ** -0.5, L.TILE, L.SEL, iq, ik)
    dense = L.prefill_step(q, k, v, L.D ** -0.5, L.TILE)
    exact = L.BS * L.TOPK  # positions whose causal blocks all fit in the top-k
    torch.testing.assert_close(sparse[:, :, :exact], dense[:, :, :exact], rtol=0, atol=1e-6)
    assert (sparse[:, :, exact:] - dense[:, :, exact:]).abs().max() > 1e-3


def _decode(p, x, pos, kc, vc, ic):
    return L.sparse_decode(p, x, pos, kc, vc, ic)


def test_sparse_decode_step_matches_eager_one_compile(xla):
    b, s, smax = 2, 95, 128
    p, x, caches = _inputs(4, b, s + 2, smax)
    _, kc, vc, ic = L.sparse_prefill(p, x[:, :s], *caches)  # caches filled eagerly, positions 0..94
    pos = torch.tensor([s, s - 7])  # ragged: row 1 overwrites its position 88 (static shapes either way)

    want = _decode(p, x[:, s:s + 1], pos, kc.clone(), vc.clone(), ic.clone())
    got, n1 = run_on_xla(_decode, p, x[:, s:s + 1], pos, kc, vc, ic)
    assert torch.equal(got[1], want[1]), "XLA picked other blocks than eager"
    for i in (0, 2, 3, 4):
        torch.testing.assert_close(got[i], want[i], **TOL)
    assert n1 == 1, f"first decode step compiled {n1} graphs, expected 1"
    # the indexer dropped blocks: 6 causal blocks at position 95, only TOPK kept per group
    assert want[1].shape[-1] == L.TOPK and int((want[1] >= 0).sum(-1).min()) == L.TOPK

    got2, n2 = run_on_xla(_decode, p, x[:, s + 1:s + 2], pos + 1, *got[2:])  # next step, new data, same shape
    want2 = _decode(p, x[:, s + 1:s + 2], pos + 1, *[t.clone() for t in want[2:]])
    torch.testing.assert_close(got2[0], want2[0], **TOL)
    assert torch.equal(got2[1], want2[1])
    assert n2 == 0, f"second decode step recompiled ({n2} graphs)"


def test_decode_step_equals_prefill_last_row():
    """Independent of XLA: a decode step after prefilling S tokens equals row S of prefilling S+1 tokens
    (two code paths: tile masks over the full sequence vs. gathered cache blocks), and differs from dense."""
    b, s, smax = 2, 95, 128
    p, x, caches = _inputs(5, b, s + 1, smax)
    full = L.sparse_prefill(p, x, *[c.clone() for c in caches])[0]
    _, kc, vc, ic = L.sparse_prefill(p, x[:, :s], *caches)
    pos = torch.full((b,), s)
    out = L.sparse_decode(p, x[:, s:], pos, kc.clone(), vc.clone(), ic.clone())[0]
    torch.testing.assert_close(out, full[:, s:], rtol=0, atol=1e-5)
    dense = L.dense_decode(p, x[:, s:], pos, kc, vc)
    assert (dense - out).abs().max() > 1e-3
