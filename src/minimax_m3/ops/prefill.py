"""How a prompt is cut: prompts into prefill CALLS, a call's queries into TILES; and the tiled block selection of a
prefill from position 0 (the reference's FlexAttention path, ``reference/fast.py``).

* A **call** (or "chunk": ``--prefill-chunk``, ``EngineSpec.prefill_chunk``) is what one forward pass of the model
  prefills: a prompt longer than one call takes several, each attending to the cache the earlier ones wrote
  (:func:`call_tokens`; its size rule, a multiple of ``layout.call_unit``, is ``layout.check_call``).
* A **tile** is a slice of one call's queries whose index scores and gathered keys are live at once
  (``step.attention_step(tile=...)``): :func:`tile_for` is the rule the Neuron port runs and ``minimax-m3 plan``
  models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .indexer import index_block_scores, select_blocks

# The tile rule the Neuron port runs and ``minimax-m3 plan`` models (its one home): up to PREFILL_TILES x
# PREFILL_MAX_TILE tokens (32K) a call takes PREFILL_TILES tiles, so the context-encoding graph's size does not grow
# with the bucket up to 32K (the tile loop is unrolled: docs/neuron.md "Sparse prefill in query tiles"); longer ones
# take tiles of PREFILL_MAX_TILE queries. 4096 is the largest cap whose tile (4.57 GiB per rank at 32K: gathered K/V,
# scores, index scores) keeps 32K at batch 1 within a trn2 rank's HBM by the planner (23.39 of 24 GiB).
PREFILL_TILES = 8
PREFILL_MAX_TILE = 4096
# A prompt is prefilled in CALLS of at most this many tokens by default (each call attends to the cache the earlier
# calls wrote plus itself, so a long prompt's working memory is one call's): the reference backend's default, rounded
# down to whole index blocks (``call_tokens``); the Neuron port's call size is the planner's choice.
MAX_PREFILL_CALL = 8192


def call_tokens(block_size: int, max_call: int | None = None) -> int:
    """Tokens per prefill call: ``max_call`` (default :data:`MAX_PREFILL_CALL`) rounded down to whole blocks."""
    return max(block_size, (max_call or MAX_PREFILL_CALL) // block_size * block_size)


def tile_for(seq_len: int, tiles: int, block_size: int, max_tile: int | None = None) -> int:
    """Queries per tile so that a call of ``seq_len`` tokens takes at most ``tiles`` tiles (a graph whose size does
    not grow with the prompt), rounded up to whole blocks; ``max_tile`` caps it (bounding the gathered K/V of one
    tile), so calls longer than ``tiles x max_tile`` take more tiles. The port passes ``PREFILL_TILES`` and
    ``PREFILL_MAX_TILE`` unless its config sets ``prefill_tiles`` / ``prefill_max_tile``."""
    c = -(-seq_len // max(1, tiles))
    if max_tile:
        c = min(c, max_tile)
    return max(block_size, -(-c // block_size) * block_size)


def select_tile(iq: torch.Tensor, ik: torch.Tensor, t0: int, t1: int, block_size: int, topk: int,
                init_blocks: int = 0, local_blocks: int = 1, topk_fn=None, start: int = 0) -> torch.Tensor:
    """Selected blocks ``[B, G, t1 - t0, min(topk, ceil(t1 / block))]`` of the queries at positions ``t0..t1-1``
    (``-1`` = empty slot), scored against the keys ``< t1`` only. ``iq`` holds the queries of a call starting at
    position ``start`` (0: a prefill from position 0), ``ik`` the index keys from position 0."""
    b = iq.shape[0]
    q_pos = torch.arange(t0, t1, device=iq.device).unsqueeze(0).expand(b, -1)
    scores = index_block_scores(iq[:, :, t0 - start:t1 - start], ik[:, :t1], q_pos, block_size)
    return select_blocks(scores, q_pos, block_size, topk, init_blocks, local_blocks, topk_fn=topk_fn)


def prefill_blocks(iq: torch.Tensor, ik: torch.Tensor, block_size: int, topk: int, init_blocks: int = 0,
                   local_blocks: int = 1, tile: int = 256, topk_fn=None) -> torch.Tensor:
    """Every query's selected blocks ``[B, G, S, topk]`` (``-1`` = empty slot) for a prefill from position 0, in query
    tiles of ``tile`` (the index scores of one tile live at once)."""
    s = iq.shape[2]
    out = []
    for t0 in range(0, s, tile):
        blk = select_tile(iq, ik, t0, min(s, t0 + tile), block_size, topk, init_blocks, local_blocks, topk_fn)
        out.append(F.pad(blk, (0, topk - blk.shape[-1]), value=-1))
    return torch.cat(out, dim=2)
