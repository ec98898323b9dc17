"""Routed experts for the reference backend: tokens sorted by expert, then grouped matrix multiplies.

``torch._grouped_mm`` (CPU, and CUDA on Hopper+ in bfloat16) runs every local expert in one call per projection
with the group offsets computed on the device: no Python loop over experts and no host synchronisation, so a
decode step stays capturable in a CUDA graph. On CPU, decode-sized batches instead gather their chosen experts'
weights and run one batched product (CPU's grouped_mm copies every expert's weights per call). Where the device has
no grouped_mm, a loop over the used experts (with one ``.tolist()``) computes the same sums. Under expert
parallelism a rank holds the contiguous experts ``first_expert .. first_expert + E_local - 1``; tokens routed
elsewhere contribute zero here (their rank adds them in the layer's all-reduce).
"""

from __future__ import annotations

import torch

from .. import ops
from ..config.m3 import M3Config
from ..ops.moe import blocks_capacity, static_strategy

_GROUPED_OK: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs on this device and dtype (probed once, then cached)."""
    key = (device.type, dtype)
    if key not in _GROUPED_OK:
        ok = hasattr(torch, "_grouped_mm")
        if ok:
            try:
                x = torch.zeros(32, 16, device=device, dtype=dtype)
                w = torch.zeros(2, 16, 16, device=device, dtype=dtype)
                torch._grouped_mm(x, w, offs=torch.tensor([16, 32], device=device, dtype=torch.int32))
            except (RuntimeError, NotImplementedError, TypeError):
                ok = False
        _GROUPED_OK[key] = ok
    return _GROUPED_OK[key]


STRATEGIES = ("grouped", "gather", "loop", "dense", "blocks")


def _pick(scale, ids):
    """The fp8 scales of the experts ``ids`` (None without fp8 experts)."""
    return None if scale is None else scale.index_select(0, ids)


def _blocks(x, weights, key, gate_up, down, c: M3Config, wide, scales=(None, None)) -> torch.Tensor:
    """Static shapes, no sort: each (token, slot) row placed in its expert's run of blocks (its rank within the
    expert from a one-hot running count), one batched product per block with that block's expert's weights gathered,
    rows read back in (token, slot) order. ``key [T, K]``: the local expert, ``E_local`` for rows routed elsewhere
    (weight 0). What a graph compiler lowers (StableHLO has no grouped matmul); FLOPs: the capacity of
    :func:`blocks_capacity`, not every expert on every token."""
    t, k = key.shape
    n_local, rows = gate_up.shape[0], t * k
    n_blocks, block = blocks_capacity(rows, n_local)
    cap = n_blocks * block
    key = key.reshape(-1)
    onehot = torch.nn.functional.one_hot(key, n_local + 1)  # [rows, E + 1]
    within = ((onehot.cumsum(0) - 1) * onehot).sum(1)  # the row's rank among its expert's rows
    padded = (onehot[:, :n_local].sum(0) + block - 1) // block * block
    ends = padded.cumsum(0)
    dest = torch.where(key < n_local, (ends - padded)[key.clamp(max=n_local - 1)] + within, cap)  # else a spare row
    xs = x.new_zeros(cap + 1, x.shape[-1]).index_copy(0, dest, x.repeat_interleave(k, dim=0))
    block_expert = ((torch.arange(n_blocks, device=x.device) * block).unsqueeze(1) >= ends).sum(1)
    block_expert = block_expert.clamp(max=n_local - 1)  # blocks past the last expert's: zero rows, any weights
    ys = ops.expert_ffn(xs[:cap].view(n_blocks, block, -1), gate_up.index_select(0, block_expert),
                        down.index_select(0, block_expert), c.swiglu_alpha, c.swiglu_limit,
                        gate_up_scale=_pick(scales[0], block_expert),
                        down_scale=_pick(scales[1], block_expert)).reshape(cap, -1)
    mine = (key < n_local).unsqueeze(-1)
    w = torch.where(key < n_local, weights.reshape(-1), 0.0)
    contrib = (ys.index_select(0, dest.clamp(max=cap - 1)).to(wide) * w[:, None]).to(x.dtype)
    return torch.where(mine, contrib, 0.0).view(t, k, -1).sum(dim=1)


def pick_strategy(device: torch.device, dtype: torch.dtype, rows: int, n_local: int) -> str:
    """``grouped`` (torch._grouped_mm), ``gather`` (each (token, slot) row multiplies its expert's weights, gathered:
    reads exactly the chosen experts) or ``loop`` (over the used experts; one host read). Never picked here:
    ``dense`` (every local expert on every token) and ``blocks`` (static blocks per expert), what a graph compiler
    lowers; ``static`` picks ``gather`` for decode-sized calls, else ``blocks`` (the vLLM Neuron model's)."""
    if device.type == "cpu" and rows <= n_local:  # CPU's grouped_mm copies every group's weights per call
        return "gather"
    return "grouped" if grouped_mm_available(device, dtype) else "loop"


def routed_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
                   down: torch.Tensor, c: M3Config, first_expert: int = 0, strategy: str | None = None,
                   scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Sum over each token's chosen (local) experts of ``weight * expert(x)`` (before routed scaling), ``[T, H]``.

    ``gate_up [E_local, H, 2I_local]`` (gate first), ``down [E_local, I_local, H]``. Each expert's contribution is
    rounded to the activation dtype before the ``k`` contributions of a token are summed, like transformers.
    ``strategy=None`` picks one with :func:`pick_strategy`; all give the same sums (tested). ``scales``: fp8
    experts (``gate_up``/``down`` e4m3) with their per-channel scales ``([E_local, 1, 2I], [E_local, 1, H])``
    (``ops.moe.scaled``: each product's output times its scale; ``checkpoint.fp8_experts.quantize_experts_``).
    """
    su, sd = scales or (None, None)
    t, k = experts.shape
    n_local = gate_up.shape[0]
    strategy = strategy or pick_strategy(x.device, x.dtype, t * k, n_local)
    if strategy == "static":
        strategy = static_strategy(t, k, n_local)
    if strategy not in STRATEGIES:
        raise ValueError(f"MoE strategy {strategy!r}; choose one of {', '.join(STRATEGIES)} or static")
    wide = torch.promote_types(x.dtype, torch.float32)  # float32 math for bf16; float64 stays float64
    every = first_expert == 0 and n_local == c.num_experts  # no expert parallelism: every slot is local
    local = experts if every else experts - first_expert
    mine = None if every else (local >= 0) & (local < n_local)
    if strategy == "blocks":
        return _blocks(x, weights, local if every else torch.where(mine, local, n_local), gate_up, down, c, wide,
                       (su, sd))
    if strategy == "dense":  # every local expert on every token, unchosen ones weighted 0: no sort, static shapes
        w = weights if every else torch.where(mine, weights, 0.0)
        return ops.moe_all_experts(x, w, local.clamp(0, n_local - 1), gate_up, down, c.swiglu_alpha, c.swiglu_limit,
                                   gate_up_scale=su, down_scale=sd)
    if strategy == "gather":  # rows in (token, slot) order: no sorting at all
        ids = (local if every else local.clamp(0, n_local - 1)).reshape(-1)
        xs = x.unsqueeze(1).expand(t, k, x.shape[-1]).reshape(t * k, 1, x.shape[-1])
        ys = ops.expert_ffn(xs, gate_up.index_select(0, ids), down.index_select(0, ids), c.swiglu_alpha,
                            c.swiglu_limit, gate_up_scale=_pick(su, ids),
                            down_scale=_pick(sd, ids)).squeeze(1)  # index_select: ~3x faster than advanced indexing
        contrib = (ys.to(wide) * weights.reshape(-1, 1)).to(x.dtype)
        if not every:
            contrib = torch.where(mine.reshape(-1, 1), contrib, 0.0)
        return contrib.view(t, k, -1).sum(dim=1)
    key = (local if every else torch.where(mine, local, n_local)).reshape(-1)  # other ranks' tokens sort last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(n_local + 1, dtype=torch.long, device=x.device).scatter_add_(0, key, torch.ones_like(key))
    xs = x[order // k]
    if strategy == "grouped":
        offs = counts[:n_local].cumsum(0).to(torch.int32)
        rows = key[order].clamp(max=n_local - 1)  # each sorted row's expert: its scales
        ys = ops.expert_ffn(xs, gate_up, down, c.swiglu_alpha, c.swiglu_limit,
                            matmul=lambda a, w: torch._grouped_mm(a, w, offs=offs),
                            gate_up_scale=None if su is None else su.index_select(0, rows).squeeze(1),
                            down_scale=None if sd is None else sd.index_select(0, rows).squeeze(1))
    else:  # loop
        ys = torch.zeros(t * k, x.shape[-1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts[:n_local].tolist()):  # host read: the fallback only
            if n:
                ys[start:start + n] = ops.expert_ffn(xs[start:start + n], gate_up[e], down[e], c.swiglu_alpha,
                                                     c.swiglu_limit, gate_up_scale=None if su is None else su[e],
                                                     down_scale=None if sd is None else sd[e])
            start += n
    w_sorted = (weights if every else torch.where(mine, weights, 0.0)).reshape(-1)[order]
    contrib = (ys.to(wide) * w_sorted[:, None]).to(x.dtype)
    if not every:  # rows past the last group's end are not written by grouped_mm: select, never multiply, them away
        contrib = torch.where((key[order] < n_local).unsqueeze(-1), contrib, 0.0)
    unsorted = torch.empty_like(contrib).index_copy_(0, order, contrib)  # back to (token, slot) order
    return unsorted.view(t, k, -1).sum(dim=1)
