"""Static-graph proof of decode as prior cache + active token (``ops.attention_step`` with ``ops.token_active``, the
step that ships) on the XLA CPU device.

One decode step of a sparse layer (selection on the prior index keys plus the active index key, block gather,
attention to the blocks and the active key) and of a dense layer: outputs equal the eager CPU run (float32,
<= 1e-5), one compilation for a new shape, none for new data or other positions (the graph
does not depend on where the token sits), and no op falls back to the CPU (fixture ``xla``).
"""

import torch

from minimax_m3 import ops

from .conftest import run_on_xla
from test.support import layer_functions as L

TOL = dict(rtol=0, atol=1e-5)
B, HQ, HKV, D, DI, BS, TOPK, S = 2, 8, 2, 16, 8, 16, 3, 128


def _inputs(seed: int, pos: list[int]):
    g = torch.Generator().manual_seed(seed)
    t = [torch.randn(B, HQ, 1, D, generator=g), torch.randn(B, HKV, S, D, generator=g),
         torch.randn(B, HKV, S, D, generator=g), torch.randn(B, HKV, 1, D, generator=g),
         torch.randn(B, HKV, 1, D, generator=g), torch.randn(B, HKV, 1, DI, generator=g),
         torch.randn(B, S, DI, generator=g), torch.randn(B, 1, DI, generator=g)]
    return (*t, torch.tensor(pos))


def _step(q, kc, vc, k_new, v_new, iq, ikc, ik_new, q_pos):
    sparse = L.decode_step(q, kc, vc, k_new, v_new, q_pos, 0.25, ops.Selection(BS, TOPK), iq, ikc, ik_new)
    dense = L.decode_step(q, kc, vc, k_new, v_new, q_pos, 0.25)
    return sparse, dense


def test_prior_active_decode_matches_eager_one_graph_for_every_position(xla):
    args = _inputs(0, [40, 127])
    want = _step(*args)
    got, n1 = run_on_xla(_step, *args)
    torch.testing.assert_close(got[0], want[0], **TOL)
    torch.testing.assert_close(got[1], want[1], **TOL)
    assert n1 == 1, f"first call at a new shape compiled {n1} graphs, expected 1"

    args2 = _inputs(1, [3, 77])  # new data and new positions, same shapes
    want2 = _step(*args2)
    got2, n2 = run_on_xla(_step, *args2)
    torch.testing.assert_close(got2[0], want2[0], **TOL)
    torch.testing.assert_close(got2[1], want2[1], **TOL)
    assert n2 == 0, f"new data / positions recompiled ({n2} graphs)"
    assert not torch.allclose(got2[0], got[0])  # the new data reached the graph
