"""Independent oracles for the attention step: the former per-path formulas, written out plainly.

Before ``ops.step.attention_step`` became the one step every path calls, the reference and the Neuron port ran these
separate functions (prefill in query tiles over a cache written first; decode as the prior cache plus the active
token; dense attention over a written cache). They compute the same attention by other arithmetic (no partial
softmax, no merge, no gather by call and prior), so the tests grade the step against them. Test-only: no backend
imports this module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minimax_m3.ops.attention import causal_keep, masked_attention
from minimax_m3.ops.indexer import FEW_ROWS, index_block_scores, select_blocks
from minimax_m3.ops.prefill import select_tile


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

def attend_blocks(q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, blocks: torch.Tensor,
                  q_pos: torch.Tensor, scale: float) -> torch.Tensor:
    """Each query attends to its own selected blocks only.

    ``q [B, Hq, C, D]`` at positions ``q_pos [C]``; ``k_blocks, v_blocks [B, G, nblk, block, D]`` (the whole caches
    viewed by block); ``blocks [B, G, C, K]`` (``-1`` = empty). Keys of the query's own block past the query are
    masked (causal), as are empty slots. Scores in the inputs' dtype, softmax in float32 (as ``masked_attention``)."""
    b, hq, c, d = q.shape
    g, nblk, bs = k_blocks.shape[1], k_blocks.shape[2], k_blocks.shape[3]
    r, kk = hq // g, blocks.shape[-1]
    base = (torch.arange(b * g, device=q.device) * nblk).view(b, g, 1, 1)
    rows = (base + blocks.clamp(min=0)).reshape(-1)  # one row id per selected block
    kg = k_blocks.reshape(b * g * nblk, bs, d).index_select(0, rows).view(b, g, c, kk * bs, d)
    vg = v_blocks.reshape(b * g * nblk, bs, d).index_select(0, rows).view(b, g, c, kk * bs, d)
    qg = q.reshape(b, g, r, c, d).transpose(2, 3)  # [B, G, C, r, D]: a group's query heads share the gather
    scores = torch.matmul(qg, kg.transpose(-1, -2)) * scale  # [B, G, C, r, K * block]
    # each gathered key's position; an empty (-1) slot starts past the query, so the causal rule drops it
    qp = q_pos.view(1, 1, c, 1)
    first = torch.where(blocks >= 0, blocks * bs, qp + 1)
    key_pos = (first.unsqueeze(-1) + torch.arange(bs, device=q.device)).view(b, g, c, 1, kk * bs)
    scores = scores.float().masked_fill(key_pos > qp.unsqueeze(-1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(vg.dtype)
    return torch.matmul(probs, vg).transpose(2, 3).reshape(b, hq, c, d)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, iq: torch.Tensor | None = None,
    ik: torch.Tensor | None = None, block_size: int = 128, topk: int = 16, init_blocks: int = 0,
    local_blocks: int = 1, tile: int = 256, topk_fn=None, start: int = 0,
) -> torch.Tensor:
    """Causal prefill of the ``S`` queries ``q [B, Hq, S, D]`` at positions ``start .. start+S-1`` in query chunks
    of ``tile``, dense or (with ``iq [B, G, S, Di]`` / ``ik``) block-sparse (see the module). ``k, v`` (and ``ik``)
    hold the keys from position 0, at least ``start + S`` of them (more are never read: a whole cache of whole
    blocks is paged by block without a copy). ``topk_fn(x, k, dim=-1) -> (values, indices)`` replaces
    ``torch.topk`` (the Neuron port passes the SDK's top-k op)."""
    b, _, s, d = q.shape
    g, end = k.shape[1], start + s
    if iq is not None and -(-end // block_size) > topk:  # the caches viewed by block, once (whole blocks)
        nblk = -(-k.shape[2] // block_size)
        pad = nblk * block_size - k.shape[2]
        k_blocks = (F.pad(k, (0, 0, 0, pad)) if pad else k).reshape(b, g, nblk, block_size, d)
        v_blocks = (F.pad(v, (0, 0, 0, pad)) if pad else v).reshape(b, g, nblk, block_size, d)
    outs = []
    for t0 in range(start, end, tile):
        t1 = min(end, t0 + tile)
        q_pos = torch.arange(t0, t1, device=q.device)
        qc = q[:, :, t0 - start:t1 - start]
        if iq is None or -(-t1 // block_size) <= topk:  # dense, or every causal block would be selected
            keep = causal_keep(q_pos.unsqueeze(0).expand(b, -1), t1)
            outs.append(masked_attention(qc, k[:, :, :t1], v[:, :, :t1], keep, scale))
            continue
        blocks = select_tile(iq, ik, t0, t1, block_size, topk, init_blocks, local_blocks, topk_fn, start)
        outs.append(attend_blocks(qc, k_blocks, v_blocks, blocks, q_pos, scale))
    return torch.cat(outs, dim=2)

def select_blocks_for_queries(
    iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk: int, init_blocks: int = 0,
    local_blocks: int = 1,
) -> torch.Tensor:
    """:func:`index_block_scores` then :func:`select_blocks`."""
    scores = index_block_scores(iq, ik, q_pos, block_size)
    return select_blocks(scores, q_pos, block_size, topk, init_blocks, local_blocks)


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
    active = torch.matmul(iq, ik_new.view(b, 1, -1, 1)).float()  # [B, G, 1, 1], as index_block_scores
    nblk = scores.shape[-1]
    own = torch.arange(nblk, device=iq.device).view(1, 1, 1, nblk) == (q_pos // block_size).view(b, 1, 1, 1)
    scores = torch.where(own, torch.maximum(scores, active), scores)
    return select_blocks(scores, q_pos, block_size, topk, init_blocks, local_blocks).view(b, g, -1)

def prefill_step(q, k, v, scale, tile, sel=None, iq=None, ik=None, topk_fn=None, start=0):
    """Causal prefill ``q [B, Hq, S, D]`` at positions ``start ..`` over ``k, v`` holding the keys from position 0
    (written first): block-sparse with ``sel`` (an ``ops.Selection``), dense causal without."""
    if sel is None:
        return prefill_attention(q, k, v, scale, tile=tile, start=start)
    return prefill_attention(q, k, v, scale, iq=iq, ik=ik, tile=tile, topk_fn=topk_fn, start=start, **sel.kwargs())


def decode_step(q, k, v, k_new, v_new, q_pos, scale, sel=None, iq=None, ik=None, ik_new=None):
    """One token per row at ``q_pos [B]`` over the prior caches (slots ``< q_pos``) and the active token; sparse
    with ``sel`` when the scored index keys span more than top-k blocks."""
    s = k.shape[2]
    sparse = sel is not None and -(-ik.shape[1] // sel.block_size) > sel.topk
    if sparse and s % sel.block_size:
        raise ValueError(f"sparse decode needs whole blocks: cache length {s}, index_block_size {sel.block_size}")
    if sparse:
        blocks = select_blocks_prior_active(iq, ik, ik_new, q_pos, **sel.kwargs())
        return decode_sparse_prior_active(q, k, v, k_new, v_new, q_pos, blocks, sel.block_size, scale)
    return decode_dense_prior_active(q, k, v, k_new, v_new, q_pos, scale)
