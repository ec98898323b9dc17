"""Paged caches (vLLM's layout): what :func:`.step.attention_step` reads when a row's keys live in pages.

A paged cache is ``cache [N, H, P, D]``: ``N`` physical pages of ``P`` slots for ``H`` KV heads (vLLM Neuron's
``[num_blocks, num_kv_heads, block_size, head_size]``). Row ``b`` of a batch owns the pages of its block table
``table [B, W]`` (``-1`` past its last page): its page ``j`` holds positions ``j*P .. j*P + P - 1``, so the row's
*line* (slot == position, the layout of every other cache here) is ``cache[table[b]]`` laid end to end. With ``P``
the index block size (M3's 128: a page is an index block) a selected block is one page, read where it lies: no copy
of the line is ever made for a sparse layer.

Writes go to ``slot = page * P + offset`` (vLLM's ``slot_mapping``; a negative slot is padding and lands in page 0,
vLLM's null page, which no request owns).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Pages:
    """A paged cache ``cache [N, H, P, D]`` read through ``table [B, W]`` (int: a row's pages in position order):
    to the step it is a prior of shape ``[B, H, W*P, D]`` that is never materialised for a block-sparse read."""

    cache: torch.Tensor
    table: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int, int]:
        _, h, p, d = self.cache.shape
        return (self.table.shape[0], h, self.table.shape[1] * p, d)

    def _pages(self) -> torch.Tensor:
        """The table as page ids, its padding (``-1``: vLLM Neuron's runner pads block tables so) read as page 0."""
        return self.table.to(torch.int64).clamp(min=0)

    def lines(self) -> torch.Tensor:
        """``[B, H, W*P, D]``: every page of every row (what a dense read needs)."""
        b, w = self.table.shape
        _, h, p, d = self.cache.shape
        rows = self.cache.index_select(0, self._pages().reshape(-1))  # [B*W, H, P, D]
        return rows.view(b, w, h, p, d).transpose(1, 2).reshape(b, h, w * p, d)

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids [B, H, T, K]`` logical block ids (``0 .. W-1``) → ``[B, H, T, K*P, D]``: the selected pages of each
        query's row and KV head, one row of ``P`` slots per page."""
        b, h, t, k = ids.shape
        n, _, p, d = self.cache.shape
        page = self._pages().gather(1, ids.reshape(b, -1)).view(b, h, t, k)
        rows = (page * h + torch.arange(h, device=ids.device).view(1, h, 1, 1)).reshape(-1)
        return self.cache.reshape(n * h, p, d).index_select(0, rows).view(b, h, t, k * p, d)


def slot_mapping(table: torch.Tensor, positions: torch.Tensor, page_size: int, dcp: int = 1,
                 dcp_rank: int = 0) -> torch.Tensor:
    """vLLM's slots of each row's ``positions [B, T]`` (or ``[B]``) through ``table [B, W]``: ``page * P + offset``,
    page ``table[row, position // P]``; ``-1`` (padding: written to the null page) where the row has no page there
    (past its table, or ``-1`` in it). Under decode context parallelism (``dcp`` ranks, vLLM Neuron's interleave =
    the page) the table counts virtual blocks of ``P x dcp`` tokens: block ``n = position // P`` lives on rank ``n
    mod dcp`` in page ``table[row, n // dcp]``; a token another rank holds gets slot 0 (the null page), as the
    plugin's ``_compute_slot_mapping_cpu`` writes it."""
    shape = positions.shape
    pos = positions.reshape(shape[0], -1).to(torch.int64)
    block = pos // (page_size * dcp)
    page = table.to(torch.int64).gather(1, block.clamp(max=table.shape[1] - 1))
    slot = page * page_size + pos % page_size
    slot = torch.where((block < table.shape[1]) & (page >= 0), slot, torch.full_like(slot, -1))
    if dcp > 1:
        slot = torch.where(pos // page_size % dcp == dcp_rank, slot, torch.zeros_like(slot))
    return slot.view(shape)


def write_slots(cache: torch.Tensor, new: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Write ``new [T, H, D]`` (token ``i``'s heads) into ``cache [N, H, P, D]`` at ``slots [T]`` (page * P + offset;
    negative: padding, written to page 0, the null page), in place; returns ``cache``."""
    p = cache.shape[2]
    slots = slots.to(torch.int64).clamp(min=0)
    h = cache.shape[1]
    page = (slots // p).repeat_interleave(h)
    off = (slots % p).repeat_interleave(h)
    head = torch.arange(h, device=cache.device).repeat(slots.shape[0])
    cache.index_put_((page, head, off), new.reshape(-1, new.shape[-1]).to(cache.dtype))
    return cache
