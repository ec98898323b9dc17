"""A sparse decoder layer's attention, and the routed MoE, written the way the Neuron graph runs them.

Pure functions of tensors and ints around the step that ships (``ops.attention_step``, through :func:`prefill_step` /
:func:`decode_step` below, which the
reference model and the Neuron attention call): the same code runs eagerly on the CPU (the oracle) and traced on the
XLA device. Caches are inputs and outputs (the graph aliases them on Neuron), written after the step as the backends
write them.
"""

import torch

from minimax_m3 import ops
from test.support import oracles

# A small geometry in which the indexer really drops blocks: 96 tokens = 6 blocks of 16, top-2 kept.
HQ, HKV, D, ROT, DI, BS, TOPK, TILE, EPS, THETA = 4, 2, 16, 8, 16, 16, 2, 32, 1e-6, 10000.0
HID = 32
SEL = ops.Selection(BS, TOPK)


def prefill_step(q, k, v, scale, tile, sel=None, iq=None, ik=None):
    """A prefill from position 0 through the step that ships: the call's own keys, no prior, one rank."""
    b, t = q.shape[0], q.shape[2]
    start = torch.zeros(b, dtype=torch.int64, device=q.device)
    q_pos = torch.arange(t, device=q.device).view(1, t).expand(b, t)
    act = ops.call_active(k, v, ik, start, 0, 1)
    return ops.attention_step(q, None, None, act, q_pos, start, 0, ops.Alone(), scale, sel, iq, None, tile=tile)


def decode_step(q, k_cache, v_cache, k, v, pos, scale, sel=None, iq=None, ik_cache=None, ik=None):
    """One token per row at ``pos [B]`` through the step that ships: the prior caches plus the active token."""
    q_pos = pos.view(-1, 1).to(torch.int64)
    act = ops.token_active(k, v, ik, q_pos, 0, 1)
    return ops.attention_step(q, k_cache, v_cache, act, q_pos, q_pos[:, 0], 0, ops.Alone(), scale, sel, iq,
                              ik_cache)


def make_params(gen: torch.Generator) -> dict:
    def w(*shape, scale=0.2):
        return torch.randn(*shape, generator=gen) * scale

    return {
        "wq": w(HQ * D, HID), "wk": w(HKV * D, HID), "wv": w(HKV * D, HID), "wo": w(HID, HQ * D),
        "q_norm": w(D, scale=0.1), "k_norm": w(D, scale=0.1),
        "wiq": w(HKV * DI, HID), "wik": w(DI, HID), "iq_norm": w(DI, scale=0.1), "ik_norm": w(DI, scale=0.1),
        "inv_freq": ops.rope_inv_freq(ROT, THETA),
    }


def _heads(x, w, norm, n, d, cos, sin):
    """``x [B, T, H]`` → normed, rotated heads ``[B, n, T, d]``."""
    b, t, _ = x.shape
    h = (x @ w.t()).view(b, t, n, d)
    h = ops.rms_norm(h, norm, EPS).transpose(1, 2)
    return ops.apply_rope(h, cos, sin)


def project(p: dict, x: torch.Tensor, pos: torch.Tensor):
    """Queries, keys, values, index queries ``[B, G, T, Di]`` and index keys ``[B, T, Di]`` at ``pos [B, T]``."""
    b, t, _ = x.shape
    cos, sin = ops.rope_cos_sin(pos, p["inv_freq"], x.dtype)
    q = _heads(x, p["wq"], p["q_norm"], HQ, D, cos, sin)
    k = _heads(x, p["wk"], p["k_norm"], HKV, D, cos, sin)
    v = (x @ p["wv"].t()).view(b, t, HKV, D).transpose(1, 2)
    iq = _heads(x, p["wiq"], p["iq_norm"], HKV, DI, cos, sin)
    ik = _heads(x, p["wik"], p["ik_norm"], 1, DI, cos, sin)[:, 0]
    return q, k, v, iq, ik


def sparse_prefill(p: dict, x: torch.Tensor, k_cache, v_cache, ik_cache):
    """Prefill ``x [B, S, H]`` from position 0: block-sparse attention in query chunks of ``TILE`` (each query reads
    its gathered top-k blocks); the caches ``[B, G, Smax, D]`` / ``[B, Smax, Di]`` come back with positions
    ``0..S-1`` written."""
    b, s, _ = x.shape
    pos = torch.arange(s, device=x.device).unsqueeze(0).expand(b, s)
    q, k, v, iq, ik = project(p, x, pos)
    attn = prefill_step(q, k, v, D ** -0.5, TILE, SEL, iq, ik)
    out = attn.transpose(1, 2).reshape(b, s, HQ * D) @ p["wo"].t()
    k_cache = ops.write_positions(k_cache, k, pos, seq_dim=2)
    v_cache = ops.write_positions(v_cache, v, pos, seq_dim=2)
    ik_cache = ops.write_positions(ik_cache, ik, pos, seq_dim=1)
    return out, k_cache, v_cache, ik_cache


def sparse_decode(p: dict, x: torch.Tensor, pos: torch.Tensor, k_cache, v_cache, ik_cache):
    """One decode step for ``x [B, 1, H]`` at positions ``pos [B]``: select the top-k blocks per KV group on the prior
    index keys plus the active one, attend to those blocks of the prior caches plus the active K/V, then write K/V
    and the index key. Returns ``(out [B, 1, H], blocks [B, G, K], k_cache, v_cache, ik_cache)`` (``blocks``: the
    selection the step made, for the tests)."""
    b = x.shape[0]
    pos2 = pos.view(b, 1)
    q, k, v, iq, ik = project(p, x, pos2)
    attn = decode_step(q, k_cache, v_cache, k, v, pos, D ** -0.5, SEL, iq, ik_cache, ik)
    blocks = oracles.select_blocks_prior_active(iq, ik_cache, ik, pos, BS, TOPK)
    out = attn.transpose(1, 2).reshape(b, 1, HQ * D) @ p["wo"].t()
    k_cache = ops.write_positions(k_cache, k, pos2, seq_dim=2)
    v_cache = ops.write_positions(v_cache, v, pos2, seq_dim=2)
    ik_cache = ops.write_positions(ik_cache, ik, pos2, seq_dim=1)
    return out, blocks, k_cache, v_cache, ik_cache


def dense_decode(p: dict, x, pos, k_cache, v_cache):
    """The same step attending to every cached key (to show the sparse step really differs)."""
    b = x.shape[0]
    q, k, v, _, _ = project(p, x, pos.view(b, 1))
    attn = decode_step(q, k_cache, v_cache, k, v, pos, D ** -0.5)
    return attn.transpose(1, 2).reshape(b, 1, HQ * D) @ p["wo"].t()


def routed_moe(x, router_w, bias, gate_up, down, top_k: int, scale: float = 2.0):
    """Router (fp32 sigmoid, selection-only bias) and all-experts routed MLP × the routed scaling factor."""
    weights, experts = ops.route(x, router_w, bias, top_k)
    return scale * ops.moe_all_experts(x, weights, experts, gate_up, down), weights, experts
