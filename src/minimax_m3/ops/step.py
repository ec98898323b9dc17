"""The attention step of a decoder layer, composed once: select the key blocks (sparse layers), then attend.

Called by the reference model, the Neuron port's attention and the XLA proofs (``test/xla``), so the proofs cover the
code that ships. Caches are read, never written, here: each backend's cache writes the step's new entries once, in
place, after the step (the reference's ``KVCache``, NxDI's cache manager), at slot = position.

* prefill: :func:`prefill_step` (query chunks, block-sparse through the indexer; ``ops.prefill``), from position 0 or,
  for a later call of a chunked prefill, over the cache the earlier calls wrote plus the call's own tokens;
* decode, one token per row at position ``p``: :func:`decode_step` attends to the PRIOR caches (slots ``< p``) plus
  the ACTIVE token's K/V, and selects blocks on the prior index keys plus the active index key (the blocks that
  writing first would give; ``ops.select_blocks_prior_active``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import (
    block_rows, decode_dense_prior_active, decode_sparse_prior_active, gather_blocks, masked_attention,
)
from .indexer import select_blocks_prior_active
from .prefill import prefill_attention


@dataclass(frozen=True)
class Selection:
    """The indexer's block selection rule (``M3Config.index_*``)."""

    block_size: int
    topk: int
    init_blocks: int = 0
    local_blocks: int = 1

    @classmethod
    def of(cls, c) -> Selection:
        return cls(c.index_block_size, c.index_topk, c.index_init_blocks, c.index_local_blocks)

    def kwargs(self) -> dict:
        return dict(block_size=self.block_size, topk=self.topk, init_blocks=self.init_blocks,
                    local_blocks=self.local_blocks)


def prefill_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, chunk: int,
                 sel: Selection | None = None, iq: torch.Tensor | None = None, ik: torch.Tensor | None = None,
                 topk_fn=None, start: int = 0) -> torch.Tensor:
    """Causal prefill ``q [B, Hq, S, D]`` at positions ``start .. start+S-1`` over ``k, v [B, G, >= start+S, D]``
    (from position 0: this call's own keys; a later call of a chunked prefill: the cache the earlier calls wrote
    plus this call's keys, written first); block-sparse with ``sel`` and the index queries ``iq [B, G, S, Di]`` /
    keys ``ik [B, >= start+S, Di]``, dense causal without."""
    if sel is None:
        return prefill_attention(q, k, v, scale, tile=chunk, start=start)
    return prefill_attention(q, k, v, scale, iq=iq, ik=ik, tile=chunk, topk_fn=topk_fn, start=start, **sel.kwargs())


def decode_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                q_pos: torch.Tensor, scale: float, sel: Selection | None = None, iq: torch.Tensor | None = None,
                ik: torch.Tensor | None = None, ik_new: torch.Tensor | None = None, sdpa: bool = False) -> torch.Tensor:
    """One token per row: ``q [B, Hq, 1, D]`` at ``q_pos [B]`` over the prior caches ``k, v [B, G, S, D]`` (slots
    ``< q_pos``) and the active ``k_new, v_new [B, G, 1, D]``.

    Sparse (``sel`` with ``iq [B, G, 1, Di]``, prior index keys ``ik [B, S', Di]`` for ``S' <= S`` slots,
    ``ik_new [B, 1, Di]``; ``S`` a multiple of the block) reads only the top-k blocks; index keys of at most top-k
    blocks are attended densely (the indexer would select every block). ``sdpa=True`` runs the attention through
    ``F.scaled_dot_product_attention`` over ``[prior | active]`` (the reference backend's fused kernel on CUDA; equal
    up to rounding, tested)."""
    s = k.shape[2]
    sparse = sel is not None and -(-ik.shape[1] // sel.block_size) > sel.topk  # scored slots, whole blocks
    if sparse and s % sel.block_size:
        raise ValueError(f"sparse decode needs whole blocks: cache length {s}, index_block_size {sel.block_size}")
    blocks = select_blocks_prior_active(iq, ik, ik_new, q_pos, **sel.kwargs()) if sparse else None
    if not sdpa:
        if sparse:
            return decode_sparse_prior_active(q, k, v, k_new, v_new, q_pos, blocks, sel.block_size, scale)
        return decode_dense_prior_active(q, k, v, k_new, v_new, q_pos, scale)
    b = q.shape[0]
    if sparse:
        rows = block_rows(blocks, s // sel.block_size)
        k, v = gather_blocks(k, blocks, sel.block_size, rows), gather_blocks(v, blocks, sel.block_size, rows)
        kk, bs = blocks.shape[-1], sel.block_size
        first = torch.where(blocks >= 0, blocks * bs, q_pos.view(b, 1, 1))  # empty slots start at the query
        key_pos = (first.unsqueeze(-1) + torch.arange(bs, device=q.device)).view(b, blocks.shape[1], 1, kk * bs)
    else:
        key_pos = torch.arange(s, device=q.device).view(1, 1, 1, s)
    keep = key_pos < q_pos.view(b, 1, 1, 1)
    keep = torch.cat([keep.expand(b, -1, 1, -1), torch.ones_like(keep[..., :1]).expand(b, keep.shape[1], 1, 1)], -1)
    return masked_attention(q, torch.cat([k, k_new], 2), torch.cat([v, v_new], 2), keep, scale, sdpa=True)
