"""Decode as the PRIOR cache plus the ACTIVE token (NxDI's token-generation decomposition), XLA-safe.

One new token per row at position ``p``: the caches hold the prior tokens at slots ``0..p-1`` (slot ``p`` and
beyond are stale or empty and are never read as keys); the active token's K/V/index-K arrive as tensors of
their own. Nothing here writes a cache: the caller's cache manager writes the active entries once, in place,
after the step. Equal, up to rounding, to writing the active token into the cache first and attending causally
(:func:`~minimax_m3.ops.attention.decode_attention_dense`, :func:`~minimax_m3.ops.attention.decode_attention_sparse`,
:func:`~minimax_m3.ops.indexer.select_blocks_for_queries`); block selection is identical.

Queries ``q [B, Hq, 1, D]``; prior caches ``[B, Hkv, S, D]`` (index-K ``[B, S, Di]``), ``S`` the bucket length,
which must exceed every ``p``; active ``k_new, v_new [B, Hkv, 1, D]`` (index key ``[B, 1, Di]``).
"""

import torch

from .attention import block_rows, gather_blocks
from .indexer import FEW_ROWS, index_block_scores, select_blocks


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


def select_blocks_prior_active(iq: torch.Tensor, ik: torch.Tensor, ik_new: torch.Tensor, q_pos: torch.Tensor,
                               block_size: int, topk: int, init_blocks: int = 0,
                               local_blocks: int = 1) -> torch.Tensor:
    """Top-k blocks ``[B, G, K]`` for the index queries ``iq [B, G, 1, Di]`` at ``q_pos [B]``, from the prior index
    keys ``ik [B, S, Di]`` (slots ``< q_pos``) and the active index key ``ik_new [B, 1, Di]``.

    The block scores are those of the written cache: every block before the query's own is complete in the prior
    cache, and the own block's max-pool takes the active score in (it is also forced in whenever
    ``local_blocks >= 1``), so :func:`select_blocks` returns the same blocks."""
    b, g = iq.shape[0], iq.shape[1]
    q_pos = q_pos.view(b, 1)
    scores = index_block_scores(iq, ik, q_pos - 1, block_size)  # [B, G, 1, nblk], keys t <= p - 1
    active = torch.matmul(iq.float(), ik_new.float().view(b, 1, -1, 1))  # [B, G, 1, 1]
    nblk = scores.shape[-1]
    own = torch.arange(nblk, device=iq.device).view(1, 1, 1, nblk) == (q_pos // block_size).view(b, 1, 1, 1)
    scores = torch.where(own, torch.maximum(scores, active), scores)
    return select_blocks(scores, q_pos, block_size, topk, init_blocks, local_blocks).view(b, g, -1)


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
