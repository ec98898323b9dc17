"""Attention over GQA groups with boolean keep masks (True = attend), and decode (also as prior cache + active token).

Queries ``[B, Hq, T, D]``, keys/values ``[B, Hkv, S, D]``; query head ``h`` belongs to KV group
``h // (Hq / Hkv)``. Masks are per KV group ``[B, G, T, S]`` or shared ``[B, 1, T, S]``. Prefill (query chunks,
block-sparse) is in :mod:`.prefill`, the composed step in :mod:`.step`.
"""

import torch
import torch.nn.functional as F

from .indexer import FEW_ROWS


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float,
                     sdpa: bool = False):
    """Softmax attention of ``q [B, Hq, T, D]`` over ``k, v [B, Hkv, S, D]`` where ``keep [B, G|1, T, S]``.

    Scores are computed in the inputs' dtype and the softmax in float32 (like transformers' eager path).
    ``sdpa=True`` runs the same attention through ``F.scaled_dot_product_attention`` (one fused kernel on CPU and
    CUDA; float32: equal up to rounding, tested; bfloat16 accumulates in float32 inside the kernel). The plain
    formula stays the default: it is what the Neuron graph traces. Decode-sized row counts (``r * t <= FEW_ROWS``)
    put the keys on the left of the score product (see ``indexer.FEW_ROWS``). Every query row must keep at least
    one key.
    """
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    r = hq // hkv
    qg = q.reshape(b, hkv, r * t, d)  # a group's query heads stacked as rows: K/V are read once, never copied
    if sdpa:
        g = keep.shape[1]  # decode (t == 1): the mask broadcasts over a group's query rows as it is
        mask = keep if t == 1 else keep.unsqueeze(2).expand(b, g, r, t, s).reshape(b, g, r * t, s)
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale).view(b, hq, t, d)
    if r * t <= FEW_ROWS:  # decode-sized: keys on the left
        scores = (torch.matmul(k, qg.transpose(-1, -2)).transpose(-1, -2) * scale).view(b, hkv, r, t, s)
    else:
        scores = (torch.matmul(qg, k.transpose(-1, -2)) * scale).view(b, hkv, r, t, s)
    scores = scores.float().masked_fill(~keep.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, hkv, r * t, s)
    return torch.matmul(probs, v).view(b, hq, t, d)


def causal_keep(q_pos: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[B, 1, T, num_keys]``: key position ``t <= p`` for query position ``p``."""
    k_pos = torch.arange(num_keys, device=q_pos.device).view(1, 1, 1, num_keys)
    return k_pos <= q_pos.view(q_pos.shape[0], 1, q_pos.shape[1], 1)


def decode_attention_dense(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_pos: torch.Tensor,
                           scale: float, sdpa: bool = False) -> torch.Tensor:
    """One new token per row: ``q [B, Hq, 1, D]`` at positions ``q_pos [B]`` over the whole cache."""
    keep = causal_keep(q_pos.view(-1, 1), k_cache.shape[2])
    return masked_attention(q, k_cache, v_cache, keep, scale, sdpa)


def block_rows(blocks: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Row ids into a cache viewed as ``[B * G * num_blocks, block_size, D]`` for ``blocks [B, G, K]``, flat.

    ``-1`` slots read block 0 (their keys are masked by the caller)."""
    b, g, _ = blocks.shape
    base = torch.arange(b * g, device=blocks.device).view(b, g, 1) * num_blocks
    return (base + blocks.clamp(min=0)).reshape(-1)  # one index per selected block, not per element


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, block_size: int,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """Read only the selected blocks: ``cache [B, G, S, D]``, ``blocks [B, G, K]`` → ``[B, G, K*bs, D]``.

    ``rows``: :func:`block_rows` computed once for several caches of the same shape. Pass the whole cache, not a
    slice of it: a slice is not contiguous, and the reshape below would copy all of it on every step."""
    b, g, s, d = cache.shape
    nblk = s // block_size
    rows = block_rows(blocks, nblk) if rows is None else rows
    return cache.reshape(b * g * nblk, block_size, d).index_select(0, rows).view(b, g, -1, d)


def decode_attention_sparse(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_pos: torch.Tensor, blocks: torch.Tensor,
    block_size: int, scale: float, sdpa: bool = False,
) -> torch.Tensor:
    """Sparse decode: each KV group reads only its selected blocks ``blocks [B, G, K]`` from the caches
    (``[B, G, S, D]``, S a multiple of ``block_size``) and attends causally within them."""
    rows = block_rows(blocks, k_cache.shape[2] // block_size)
    kg = gather_blocks(k_cache, blocks, block_size, rows)
    vg = gather_blocks(v_cache, blocks, block_size, rows)
    b, g, kk = blocks.shape
    # each gathered key's position; an empty (-1) slot starts past the query, so the causal rule drops it
    first = torch.where(blocks >= 0, blocks * block_size, q_pos.view(b, 1, 1) + 1)
    key_pos = (first.unsqueeze(-1) + torch.arange(block_size, device=q.device)).view(b, g, 1, kk * block_size)
    return masked_attention(q, kg, vg, key_pos <= q_pos.view(b, 1, 1, 1), scale, sdpa)


# ---- decode as the PRIOR cache plus the ACTIVE token (NxDI's token-generation decomposition) -------------
# One new token per row at position p: the caches hold the prior tokens at slots 0..p-1 (slot p and beyond are
# stale or empty and never read as keys); the active token's K/V arrive as tensors of their own. Nothing here
# writes a cache: the caller's cache manager writes the active entries once, in place, after the step. Equal, up
# to rounding, to writing the active token first and attending causally (decode_attention_dense / _sparse).


def attend_prior_active(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, k_new: torch.Tensor,
                        v_new: torch.Tensor, scale: float) -> torch.Tensor:
    """One softmax over the prior keys ``k, v [B, Hkv, S, D]`` kept by ``keep [B, G|1, 1, S]`` and the active key
    ``k_new, v_new [B, Hkv, 1, D]`` (always kept). Scores in the inputs' dtype, softmax in float32 (as
    :func:`~minimax_m3.ops.attention.masked_attention`); the two parts share one running max and one denominator,
    so no tensor concatenates the prior keys with the active one."""
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    r = hq // hkv
    qg = q.reshape(b, hkv, r * t, d)
    if r * t <= FEW_ROWS:  # decode-sized: keys on the left (see indexer.FEW_ROWS)
        prior = torch.matmul(k, qg.transpose(-1, -2)).transpose(-1, -2)
    else:
        prior = torch.matmul(qg, k.transpose(-1, -2))
    prior = (prior * scale).view(b, hkv, r, t, s).float().masked_fill(~keep.unsqueeze(2), float("-inf"))
    active = (torch.matmul(qg, k_new.transpose(-1, -2)) * scale).view(b, hkv, r, t, 1).float()
    top = torch.maximum(prior.amax(dim=-1, keepdim=True), active)  # finite: the active key is always kept
    e_prior, e_active = torch.exp(prior - top), torch.exp(active - top)
    denom = e_prior.sum(dim=-1, keepdim=True) + e_active
    p_prior = (e_prior / denom).to(v.dtype).view(b, hkv, r * t, s)
    p_active = (e_active / denom).to(v.dtype).view(b, hkv, r * t, 1)
    out = torch.matmul(p_prior, v) + p_active * v_new
    return out.view(b, hq, t, d)


def decode_dense_prior_active(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor,
                              v_new: torch.Tensor, q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal decode over the whole prior cache: prior keys at slots ``< q_pos [B]``, plus the active key."""
    s = k.shape[2]
    keep = torch.arange(s, device=q.device).view(1, 1, 1, s) < q_pos.view(-1, 1, 1, 1)
    return attend_prior_active(q, k, v, keep, k_new, v_new, scale)


def decode_sparse_prior_active(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor,
                               v_new: torch.Tensor, q_pos: torch.Tensor, blocks: torch.Tensor, block_size: int,
                               scale: float) -> torch.Tensor:
    """Sparse decode: each KV group reads only its selected blocks ``blocks [B, G, K]`` of the prior caches (``S``
    a multiple of ``block_size``), keeps their slots ``< q_pos``, and attends to them and the active key."""
    rows = block_rows(blocks, k.shape[2] // block_size)
    kg = gather_blocks(k, blocks, block_size, rows)
    vg = gather_blocks(v, blocks, block_size, rows)
    b, g, kk = blocks.shape
    # each gathered key's position; an empty (-1) slot starts at the query, so the strict rule drops it
    first = torch.where(blocks >= 0, blocks * block_size, q_pos.view(b, 1, 1))
    key_pos = (first.unsqueeze(-1) + torch.arange(block_size, device=q.device)).view(b, g, 1, kk * block_size)
    return attend_prior_active(q, kg, vg, key_pos < q_pos.view(b, 1, 1, 1), k_new, v_new, scale)

