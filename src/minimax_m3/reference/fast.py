"""Device fast paths of the reference backend; each computes what an ``ops`` function computes, tested equal to it.

**Sparse prefill through FlexAttention** (on CUDA by default; any device when asked). The indexer's per-query block
selection comes from ``ops.prefill_blocks`` (in query tiles, so the index scores never exceed
``tile x S`` per KV group), and ``ops.block_keep_mask`` turns it into a per-query *block* keep table. FlexAttention
skips whole ``(query block, key block)`` tiles through a ``BlockMask``:

* a tile is visited when **any** query of the query block selected the key block (the union);
* a tile is *full* (no mask evaluated) when **every** query selected it and it lies strictly in the past;
* inside partial tiles the ``mask_mod`` applies what a block mask cannot say: this query's own selection and the
  token-level causal rule ``key <= query`` of ``ops.causal_keep``.

The selection semantics therefore come from ``ops``; only the lookup inside ``mask_mod`` is written here.
"""

from __future__ import annotations

import torch

from .. import ops

try:  # torch >= 2.5
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - old torch: the plain path is used
    BlockMask = flex_attention = None

Q_BLOCK = 128  # FlexAttention's query tile
_COMPILED: dict[str, object] = {}


def flex_default(device: torch.device) -> bool:
    """FlexAttention is the default sparse prefill where it is compiled to a fused kernel: CUDA."""
    return flex_attention is not None and device.type == "cuda"


def _flex(device: torch.device, compiled: bool):
    if not compiled:
        return flex_attention
    if device.type not in _COMPILED:
        _COMPILED[device.type] = torch.compile(flex_attention)  # dynamic after the first recompile
    return _COMPILED[device.type]


def select_prefill_blocks(iq: torch.Tensor, ik: torch.Tensor, block_size: int, topk: int, init_blocks: int,
                          local_blocks: int, tile: int = 256) -> torch.Tensor:
    """Each query's selected key blocks ``[B, G, S, topk]`` (``-1`` = empty slot) for a prefill from position 0:
    ``ops.prefill_blocks`` over query chunks of ``tile`` (keys up to each chunk's end)."""
    return ops.prefill_blocks(iq, ik, block_size, topk, init_blocks, local_blocks, tile=tile)


def sparse_block_mask(blocks: torch.Tensor, seq_len: int, block_size: int, q_per_kv: int) -> "BlockMask":
    """The FlexAttention ``BlockMask`` of per-query selections ``blocks [B, G, S, K]`` over ``seq_len`` keys.

    Key tiles are the indexer's blocks (``block_size``), query tiles ``Q_BLOCK`` queries; heads are query heads
    (``G * q_per_kv``, query head ``h`` reads KV group ``h // q_per_kv``)."""
    b, g, s, _ = blocks.shape
    nblk = -(-seq_len // block_size)
    sel = ops.block_keep_mask(blocks, nblk, 1)  # [B, G, S, nblk]: query selected key block
    nqb = -(-s // Q_BLOCK)
    padded = torch.nn.functional.pad(sel, (0, 0, 0, nqb * Q_BLOCK - s))
    tiles = padded.view(b, g, nqb, Q_BLOCK, nblk)
    any_sel = tiles.any(dim=3)
    # rows past the sequence end are padding: they must not make a tile partial
    real = (torch.arange(nqb * Q_BLOCK, device=blocks.device) < s).view(1, 1, nqb, Q_BLOCK, 1)
    all_sel = (tiles | ~real).all(dim=3)
    q_first = torch.arange(nqb, device=blocks.device).view(nqb, 1) * Q_BLOCK
    k_last = torch.arange(nblk, device=blocks.device).view(1, nblk) * block_size + block_size - 1
    full = all_sel & (k_last <= q_first)  # every query selected it and every key is in every query's past
    partial = any_sel & ~full

    def pack(m: torch.Tensor):
        m = m.repeat_interleave(q_per_kv, dim=1)
        return m.sum(-1).to(torch.int32), torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)

    kv_num, kv_idx = pack(partial)
    full_num, full_idx = pack(full)

    def mask_mod(bi, h, qi, ki):
        return sel[bi, h // q_per_kv, qi, ki // block_size] & (ki <= qi)

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=(Q_BLOCK, block_size),
                                    mask_mod=mask_mod, seq_lengths=(s, seq_len))


def flex_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, blocks: torch.Tensor | None,
                 block_size: int, compiled: bool | None = None) -> torch.Tensor:
    """Causal prefill ``q [B, Hq, S, D]`` over ``k, v [B, Hkv, S, D]``: sparse with ``blocks [B, G, S, K]``, dense
    causal without. Equal to ``ops.attention_step`` (tested)."""
    compiled = q.device.type == "cuda" if compiled is None else compiled
    s, r = q.shape[2], q.shape[1] // k.shape[1]
    if blocks is None:
        blocks = _causal_blocks(q.shape[0], k.shape[1], s, block_size, q.device)
    mask = sparse_block_mask(blocks, s, block_size, r)
    out = _flex(q.device, compiled)(q, k, v, block_mask=mask, scale=scale, enable_gqa=r > 1)
    return out


def _causal_blocks(b: int, g: int, s: int, block_size: int, device) -> torch.Tensor:
    """Every causal block selected: the dense layers' mask expressed as a selection."""
    nblk = -(-s // block_size)
    q_blk = torch.arange(s, device=device) // block_size
    blk = torch.arange(nblk, device=device)
    return torch.where(blk.view(1, nblk) <= q_blk.view(s, 1), blk, -1).expand(b, g, s, nblk)
