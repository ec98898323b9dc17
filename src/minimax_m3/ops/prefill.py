"""Causal prefill in query chunks: dense, or block-sparse reading only the selected key blocks.

Queries ``[B, Hq, S, D]``, keys/values ``[B, G, S, D]`` (query head ``h`` in KV group ``h // (Hq / G)``); index
queries ``[B, G, S, Di]`` and index keys ``[B, S, Di]`` switch on MiniMax Sparse Attention. A prefill CALL starts at
position 0 (a whole prompt) or, with ``start``, at a later position: a chunked prefill's later call, whose queries
``start .. start+S-1`` attend to the cache the earlier calls wrote plus themselves (keys ``[B, G, >= start+S, D]``,
written first). The call is walked in query chunks of ``chunk`` queries (a static Python loop over ``ceil(S /
chunk)`` chunks; the Neuron port picks ``chunk`` so that their number is a constant, :func:`chunk_for`). In chunk
``[t0, t1)``:

* the indexer scores the chunk's queries against the keys ``< t1`` only, max-pools per block and takes the top-k
  (``indexer.select_blocks``); a chunk whose queries see at most ``topk`` blocks skips it (every causal block would
  be selected: the chunk is dense causal);
* attention gathers, per query, its ``K`` selected blocks of K and V (``[B, G, C, K * block, D]``, one gather per
  cache, the group's query heads share it) and attends to them with the causal rule inside the query's own block:
  ``S x K x block x D x 4`` FLOPs per query head, the block-sparse minimum, never a product with an unselected key.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .attention import causal_keep, masked_attention
from .indexer import index_block_scores, select_blocks


# The chunk rule the Neuron port runs and ``minimax-m3 plan`` models (its one home): up to PREFILL_CHUNKS x
# PREFILL_MAX_CHUNK tokens (32K) a prefill takes PREFILL_CHUNKS chunks, so the context-encoding graph's size does not
# grow with the bucket up to 32K (the chunk loop is unrolled: docs/neuron.md "Sparse prefill in query chunks"); longer
# ones take chunks of PREFILL_MAX_CHUNK queries. 4096 is the largest cap whose chunk (4.57 GiB per rank at 32K:
# gathered K/V, scores, index scores) keeps 32K at batch 1 within a trn2 rank's HBM by the planner (23.39 of 24 GiB).
PREFILL_CHUNKS = 8
PREFILL_MAX_CHUNK = 4096
# A prompt is prefilled in CALLS of at most this many tokens by default (issue 23: each call attends to the cache
# the earlier calls wrote plus itself, so a long prompt's working memory is one call's): the reference backend's
# default, rounded down to whole index blocks (``call_tokens``); the Neuron port's call size is the planner's choice.
MAX_PREFILL_CALL = 8192


def call_tokens(block_size: int, max_call: int | None = None) -> int:
    """Tokens per prefill call: ``max_call`` (default :data:`MAX_PREFILL_CALL`) rounded down to whole blocks."""
    return max(block_size, (max_call or MAX_PREFILL_CALL) // block_size * block_size)


def chunk_for(seq_len: int, chunks: int, block_size: int, max_chunk: int | None = None) -> int:
    """Queries per chunk so that a prefill of ``seq_len`` tokens takes at most ``chunks`` chunks (a graph whose size
    does not grow with the prompt), rounded up to whole blocks; ``max_chunk`` caps it (bounding the gathered K/V of
    one chunk), so prompts longer than ``chunks x max_chunk`` take more chunks. The port passes
    ``PREFILL_CHUNKS`` and ``PREFILL_MAX_CHUNK`` unless its config sets ``prefill_chunks`` / ``prefill_max_chunk``."""
    c = -(-seq_len // max(1, chunks))
    if max_chunk:
        c = min(c, max_chunk)
    return max(block_size, -(-c // block_size) * block_size)


def select_chunk(iq: torch.Tensor, ik: torch.Tensor, t0: int, t1: int, block_size: int, topk: int,
                 init_blocks: int = 0, local_blocks: int = 1, topk_fn=None, start: int = 0) -> torch.Tensor:
    """Selected blocks ``[B, G, t1 - t0, min(topk, ceil(t1 / block))]`` of the queries at positions ``t0..t1-1``
    (``-1`` = empty slot), scored against the keys ``< t1`` only. ``iq`` holds the queries of a call starting at
    position ``start`` (0: a prefill from position 0), ``ik`` the index keys from position 0."""
    b = iq.shape[0]
    q_pos = torch.arange(t0, t1, device=iq.device).unsqueeze(0).expand(b, -1)
    scores = index_block_scores(iq[:, :, t0 - start:t1 - start], ik[:, :t1], q_pos, block_size)
    return select_blocks(scores, q_pos, block_size, topk, init_blocks, local_blocks, topk_fn=topk_fn)


def prefill_blocks(iq: torch.Tensor, ik: torch.Tensor, block_size: int, topk: int, init_blocks: int = 0,
                   local_blocks: int = 1, chunk: int = 256, topk_fn=None) -> torch.Tensor:
    """Every query's selected blocks ``[B, G, S, topk]`` (``-1`` = empty slot) for a prefill from position 0."""
    s = iq.shape[2]
    out = []
    for t0 in range(0, s, chunk):
        blk = select_chunk(iq, ik, t0, min(s, t0 + chunk), block_size, topk, init_blocks, local_blocks, topk_fn)
        out.append(F.pad(blk, (0, topk - blk.shape[-1]), value=-1))
    return torch.cat(out, dim=2)


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
        blocks = select_chunk(iq, ik, t0, t1, block_size, topk, init_blocks, local_blocks, topk_fn, start)
        outs.append(attend_blocks(qc, k_blocks, v_blocks, blocks, q_pos, scale))
    return torch.cat(outs, dim=2)
