"""Static-graph proof of the router and the all-experts MoE on the XLA CPU device."""

import torch

from test.support import layer_functions as L
from .conftest import run_on_xla

E, K, H, INTER = 8, 2, 32, 24


def _weights(seed: int):
    g = torch.Generator().manual_seed(seed)
    router = torch.randn(E, H, generator=g) * 0.3
    bias = torch.randn(E, generator=g) * 0.5  # non-uniform: it must change the selection
    gate_up = torch.randn(E, H, 2 * INTER, generator=g) * 0.3
    down = torch.randn(E, INTER, H, generator=g) * 0.3
    return router, bias, gate_up, down


def _moe(x, router, bias, gate_up, down):
    return L.routed_moe(x, router, bias, gate_up, down, K)


def _sorted(weights, experts):
    order = experts.argsort(dim=-1)
    return weights.gather(-1, order), experts.gather(-1, order)


def _loop_oracle(x, router, bias, gate_up, down):
    """Token-by-token loop in float64 from the formula (sigmoid scores, bias for selection only, renormalised
    weights of the plain scores, SwiGLU-OAI experts, × 2.0) — no ``ops`` code."""
    x, router, bias, gate_up, down = (t.double() for t in (x, router, bias, gate_up, down))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        s = torch.sigmoid(router @ x[t])
        chosen = sorted(range(E), key=lambda e: -(s[e] + bias[e]).item())[:K]
        wsum = sum(s[e] for e in chosen)
        for e in chosen:
            g, u = (x[t] @ gate_up[e]).split(INTER)
            g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
            out[t] += 2.0 * (s[e] / wsum) * (((u + 1) * g * torch.sigmoid(1.702 * g)) @ down[e])
    return out.float()


def test_router_and_moe_match_eager_one_compile(xla):
    w = _weights(0)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(1))
    want = _moe(x, *w)
    got, n1 = run_on_xla(_moe, x, *w)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-5)
    gw, ge = _sorted(got[1], got[2])
    ww, we = _sorted(want[1], want[2])
    assert torch.equal(ge, we)
    torch.testing.assert_close(gw, ww, rtol=0, atol=1e-6)
    assert n1 == 1

    x2 = torch.randn(12, H, generator=torch.Generator().manual_seed(2))
    got2, n2 = run_on_xla(_moe, x2, *w)
    torch.testing.assert_close(got2[0], _moe(x2, *w)[0], rtol=0, atol=1e-5)
    assert n2 == 0, f"new data recompiled ({n2} graphs)"

    x3 = torch.randn(5, H, generator=torch.Generator().manual_seed(3))  # decode-sized batch: new shape
    _, n3 = run_on_xla(_moe, x3, *w)
    assert n3 == 1


def test_moe_matches_loop_oracle_and_bias_only_selects():
    w = _weights(0)
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_moe(x, *w)[0], _loop_oracle(x, *w), rtol=1e-5, atol=1e-5)
    router, bias, gate_up, down = w
    _, e_bias = _sorted(*_moe(x, *w)[1:])
    _, e_none = _sorted(*_moe(x, router, torch.zeros(E), gate_up, down)[1:])
    assert not torch.equal(e_bias, e_none), "the correction bias should change some selections here"
