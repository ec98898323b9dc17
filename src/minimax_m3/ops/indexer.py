"""The lightning indexer: per query and KV group, pick the top-k key blocks to attend to.

Semantics (see docs/notes/m3_model_and_formats.md §6.1): index head g serves KV head g. The token score
``iq_g(p) . ik(t)`` (float32, no scale) is masked causally at token level (``t <= p``), max-pooled over blocks
of ``block_size`` absolute positions, the ``init`` blocks and the query's own ``local`` blocks are forced in,
and the top-k blocks win. Slots that only found future/empty blocks are ``-1``.

Every shape depends only on input shapes; there is no host synchronisation (XLA-safe).
"""

import torch
import torch.nn.functional as F

# At most this many query rows per product ("decode-sized"), the keys go on the left of a score product: a
# tall-skinny product streams a cold cache faster on CPU (measured: 8K index keys 141 -> 117 us); same dot products.
FEW_ROWS = 16


def index_block_scores(iq: torch.Tensor, ik, q_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block scores ``[B, G, Tq, ceil(Sk / block_size)]`` (float32).

    ``iq [B, G, Tq, D]`` index queries; ``ik [B, Sk, D]`` index keys of positions ``0..Sk-1``, or a tuple of parts
    ``[B, Sk, D_i]`` that split ``D`` in order (paged caches hold a key in two halves: their products are summed in
    float32, never the keys concatenated); ``q_pos [B, Tq]`` the queries' positions. Future keys (``t > p``) score
    ``-inf`` before pooling.
    """
    b, g, tq, _ = iq.shape
    parts = tuple(ik) if isinstance(ik, (tuple, list)) else (ik,)
    sk = parts[0].shape[1]
    # the G index heads stacked as rows of one product: the shared index keys are read once, never copied. The
    # product runs in the inputs' dtype (bf16 on device: TensorE's full rate, fp32 accumulation), the scores are
    # then float32; measured against transformers' fp32 products in bf16 runs: the same greedy agreement
    # (docs/results.md "Reference accuracy")
    rows, scores, d0 = iq.reshape(b, g * tq, -1), None, 0
    for part in parts:
        r = rows[..., d0:d0 + part.shape[-1]] if len(parts) > 1 else rows
        d0 += part.shape[-1]
        if g * tq <= FEW_ROWS:
            s = torch.matmul(part, r.transpose(-1, -2)).transpose(-1, -2).reshape(b, g, tq, sk).float()
        else:
            s = torch.matmul(r, part.transpose(-1, -2)).view(b, g, tq, sk).float()
        scores = s if scores is None else scores + s
    k_pos = torch.arange(sk, device=iq.device)
    future = k_pos.view(1, 1, 1, sk) > q_pos.view(b, 1, tq, 1)
    scores = scores.masked_fill(future, float("-inf"))
    nblk = -(-sk // block_size)
    pad = nblk * block_size - sk
    if pad:
        scores = F.pad(scores, (0, pad), value=float("-inf"))
    return scores.view(b, g, tq, nblk, block_size).amax(dim=-1)


def force_blocks(block_scores: torch.Tensor, q_pos: torch.Tensor, block_size: int, init_blocks: int = 0,
                 local_blocks: int = 1) -> torch.Tensor:
    """The selection rule before the top-k: future blocks (``b > p // block_size``) score ``-inf``, the init blocks
    (``b < init_blocks``) and the query's own ``local_blocks`` most recent blocks ``+inf`` (when not in the future).
    ``block_scores [B, G, Tq, nblk]``, ``q_pos [B, Tq]``; a partial (one rank's) score table follows the same rule."""
    b, g, tq, nblk = block_scores.shape
    blk = torch.arange(nblk, device=block_scores.device).view(1, 1, 1, nblk)
    q_block = (q_pos // block_size).view(b, 1, tq, 1)
    valid = blk <= q_block
    forced = ((blk < init_blocks) | (blk > q_block - local_blocks)) & valid
    return block_scores.masked_fill(~valid, float("-inf")).masked_fill(forced, float("inf"))


def top_blocks(scores: torch.Tensor, k: int, topk_fn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best blocks of ``scores [..., nblk]`` (float32) as ``(values, ids)``, ids int64 and ``-1`` where the
    value is ``-inf`` (nothing to attend). **Ties: of equal scores the lower block id wins**, whatever the top-k op.

    ``topk_fn(x, k, dim=-1) -> (values, indices)`` replaces ``torch.topk`` (the Neuron port passes the SDK's top-k,
    whose tie order is unspecified); only its VALUES are used, so any order and index dtype work. Two top-k passes,
    no sort: the first finds the k-th best score ``s_k``; the second ranks the exact integer key ``2n - id`` for
    blocks scoring above ``s_k``, ``n - id`` for blocks scoring ``s_k`` and ``0`` below (``n = nblk``; exact in
    float32 for ``n < 2**23``), so every block above ``s_k`` wins and the lowest ids of the ties fill the rest. The
    ids come back (in the order the op returns them; ``torch.topk``: above ``s_k`` by id, then the ties by id) from
    the key's values."""
    topk_fn = topk_fn or torch.topk
    nblk = scores.shape[-1]
    kth = topk_fn(scores, k, dim=-1)[0].amin(dim=-1, keepdim=True)
    blk = torch.arange(nblk, device=scores.device, dtype=torch.float32)
    key = torch.where(scores > kth, 2 * nblk - blk, torch.where(scores == kth, nblk - blk, torch.zeros_like(blk)))
    won = topk_fn(key, k, dim=-1)[0]
    ids = torch.where(won > nblk, 2 * nblk - won, nblk - won).to(torch.int64)
    vals = torch.gather(scores, -1, ids)
    return vals, ids.masked_fill(vals == float("-inf"), -1)


def select_blocks(
    block_scores: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk: int, init_blocks: int = 0,
    local_blocks: int = 1, topk_fn=None,
) -> torch.Tensor:
    """Top-k block ids ``[B, G, Tq, min(topk, nblk)]`` (int64, ``-1`` for an empty slot).

    Future blocks never win. Init blocks (``b < init_blocks``) and the query's own ``local_blocks`` most recent
    blocks are forced in (as long as they are not in the future): :func:`force_blocks`. Equal scores: the lower
    block id wins (:func:`top_blocks`, also with ``topk_fn``, e.g. the Neuron port's SDK top-k). The selection over
    sequence-sharded caches (:func:`local_candidates`, :func:`merge_candidates`) returns the same ids."""
    scores = force_blocks(block_scores, q_pos, block_size, init_blocks, local_blocks)
    return top_blocks(scores, min(topk, scores.shape[-1]), topk_fn)[1]



def block_keep_mask(block_idx: torch.Tensor, num_keys: int, block_size: int) -> torch.Tensor:
    """Expand block ids ``[B, G, Tq, K]`` to a boolean keep mask ``[B, G, Tq, num_keys]`` (True = attend)."""
    b, g, tq, _ = block_idx.shape
    nblk = -(-num_keys // block_size)
    safe = block_idx.masked_fill(block_idx < 0, nblk)  # -1 lands in a throwaway column
    sel = torch.zeros(b, g, tq, nblk + 1, dtype=torch.bool, device=block_idx.device)
    sel = sel.scatter(-1, safe, True)[..., :nblk]
    keep = sel.unsqueeze(-1).expand(b, g, tq, nblk, block_size).reshape(b, g, tq, nblk * block_size)
    return keep[..., :num_keys]


# ---- selection over a KV group's sequence-sharded index keys (``ops.layout``) ----------------------------------
# Each rank max-pools ITS keys of each block (``-inf`` where it has no key of the block the query may see), applies
# the forced/causal rule and keeps its local top-K candidates (score, id); the group all-gathers them and every rank
# takes the global top-K of the G x K candidates, a block's score the max over the ranks that proposed it. Exact: a
# block of the global top-K has at most K - 1 better blocks, so the rank holding its maximum proposes it with its
# true score; a block outside is never over-scored. Ties: the lower block id wins on every rank, in the merge and in
# ``select_blocks``, so the ids equal ``select_blocks(index_block_scores(...))`` on the unsharded cache (tested).


def local_candidates(partial: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk: int, init_blocks: int = 0,
                     local_blocks: int = 1, topk_fn=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A rank's candidates ``(scores, ids)``, ``[B, H, Tq, min(topk, nblk)]`` each: the forced/causal rule of
    :func:`select_blocks` on its partial scores, then its top-k (equal scores: lower id first; ``-1`` for ``-inf``).
    On a group of one rank the ids are :func:`select_blocks`'."""
    scores = force_blocks(partial, q_pos, block_size, init_blocks, local_blocks)
    return top_blocks(scores, min(topk, scores.shape[-1]), topk_fn)


def merge_candidates(scores: torch.Tensor, ids: torch.Tensor, nblk: int, topk: int, topk_fn=None,
                     disjoint: bool = False) -> torch.Tensor:
    """The global top-k block ids ``[B, H, Tq, min(topk, nblk)]`` from every rank's candidates (the all-gather,
    ``[G, B, H, Tq, K]`` each): a block's score is the max over the ranks that proposed it (one scatter-max into
    ``nblk`` columns), then :func:`top_blocks` (lower id first on ties, ``-1`` for an empty slot). ``disjoint``:
    ranks that hold whole blocks (``ops.layout`` by block) propose a block only from its one owner, or forced
    (``+inf`` on every rank): a plain scatter places the same table (torch-mlir lowers no scatter-max)."""
    s = scores.movedim(0, -2).flatten(-2).float()
    i = ids.movedim(0, -2).flatten(-2).to(torch.int64)
    i = torch.where(i < 0, nblk, i)  # empty candidates land in a throwaway column
    table = torch.full((*s.shape[:-1], nblk + 1), float("-inf"), device=s.device)
    if disjoint:
        table = table.scatter(-1, i, s)[..., :nblk]
    else:
        table = table.scatter_reduce(-1, i, s, reduce="amax", include_self=True)[..., :nblk]
    return top_blocks(table, min(topk, nblk), topk_fn)[1]
