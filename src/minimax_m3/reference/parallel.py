"""Tensor and expert parallelism on ``torch.distributed``: the sharding plan, the slicing rules, the collectives.

Layout (NxD's semantics, so the reference proves what the Neuron port relies on):

* **Attention, dense MLP, shared expert, vocabulary** are tensor-parallel over all ``world`` ranks. Rank ``r`` holds
  query heads ``[r*Hq/W, (r+1)*Hq/W)``. With ``W <= Hkv`` it holds KV heads ``[r*Hkv/W, (r+1)*Hkv/W)``; with
  ``W > Hkv`` the KV heads are replicated (NxD ``GQA.REPLICATE_TO_TP_DEGREE``) and rank ``r`` uses KV head
  ``r // (W/Hkv)``. Index head ``g`` serves KV head ``g``, so the indexer's query heads follow the KV heads; the
  single index-K projection is replicated.
* Fused ``[gate | up]`` weights are split with stride 2 exactly like NxD's ``create_local_weight``: the tensor is cut
  into ``2W`` chunks along the split dim and rank ``r`` takes chunks ``r`` and ``r+W``, i.e. ``[gate_r | up_r]``.
* **Routed experts** use ``ep`` expert-parallel groups times ``moe_tp = W / ep`` tensor-parallel ranks, TP innermost
  (NxD's ``[EP, TP]`` expert-region order): ``ep_rank = r // moe_tp``, ``moe_tp_rank = r % moe_tp``. EP group ``e``
  holds the contiguous experts ``[e*E/ep, (e+1)*E/ep)`` (NxD ``get_experts_for_expert_parallel_rank``); each
  expert's intermediate dim is split across the ``moe_tp`` ranks with the same stride-2 rule.
* Collectives: one all-reduce after ``o_proj``, one after the MLP (routed + shared summed first), one for the
  vocabulary-parallel embedding, one all-gather of the vocabulary-parallel logits. Nothing else.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..config import parallel
from ..config.m3 import M3Config
from ..errors import M3Error


class ShardPlanError(M3Error, ValueError):
    """A tensor/expert-parallel layout the model (or one of its tensors) does not split into, every problem listed."""

    def __init__(self, problems):
        super().__init__(problems, "sharding plan does not fit the model:")


def create_local_weight(full: torch.Tensor, dim: int, rank: int, world: int, stride: int = 1) -> torch.Tensor:
    """NxD's shard rule: split ``full`` along ``dim`` into chunks of ``size / world / stride`` and concatenate
    chunks ``rank, rank + world, ...`` (stride 1: the contiguous ``rank``-th slice)."""
    size = full.shape[dim]
    if size % (world * stride):
        raise ShardPlanError(f"dim {dim} of size {size} does not split into {world} ranks x stride {stride}")
    chunks = torch.split(full, size // (world * stride), dim=dim)
    return torch.cat(chunks[rank::world], dim=dim).contiguous()


def experts_for_rank(ep_rank: int, num_experts: int, ep: int) -> range:
    """The contiguous expert range of one expert-parallel rank."""
    if num_experts % ep:
        raise ShardPlanError(f"{num_experts} experts do not split into ep={ep} groups")
    n = parallel.local_experts(num_experts, ep)
    return range(ep_rank * n, (ep_rank + 1) * n)


@dataclass(frozen=True)
class ShardPlan:
    """One rank's view of the layout. ``world=1`` is the single-process model (nothing is split)."""

    world: int = 1
    rank: int = 0
    ep: int = 1
    group: Any = field(default=None, compare=False, repr=False)  # process group of all ``world`` ranks

    # ---- derived ---------------------------------------------------------------------------------------------
    @property
    def moe_tp(self) -> int:
        return parallel.moe_tp(self.world, self.ep)

    @property
    def ep_rank(self) -> int:
        return self.rank // self.moe_tp

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.moe_tp

    def q_heads(self, c: M3Config) -> range:
        n = c.num_heads // self.world
        return range(self.rank * n, (self.rank + 1) * n)

    def kv_heads(self, c: M3Config) -> range:
        """Local KV heads (also the local index heads): a slice, or one replicated head."""
        first = self.rank * c.num_kv_heads // self.world
        return range(first, first + max(1, c.num_kv_heads // self.world))

    def experts(self, c: M3Config) -> range:
        return experts_for_rank(self.ep_rank, c.num_experts, self.ep)

    def vocab(self, c: M3Config) -> range:
        n = c.vocab_size // self.world
        return range(self.rank * n, (self.rank + 1) * n)

    def check(self, c: M3Config) -> None:
        """Raise one :class:`ShardPlanError` listing every degree that does not fit the model (``sharding``'s
        rules; the reference splits the vocabulary in equal slices)."""
        p = [] if 0 <= self.rank < self.world else [f"rank {self.rank} outside world size {self.world}"]
        p += parallel.parallel_layout_problems(c, self.world, self.ep, even_vocab=True)
        if p:
            raise ShardPlanError(p)

    # ---- collectives -------------------------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim (rank order)."""
        if self.world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def all_gather_stack(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` stacked along a new first dim ``[world, ...]`` (rank order)."""
        if self.world == 1:
            return x.unsqueeze(0)
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    # ---- slicing of full (single-process) parameters ---------------------------------------------------------
    def shard(self, c: M3Config, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full parameter ``name`` (a key of the world-size-1 model)."""
        if re.search(r"experts\.(gate_up|down)$", name):
            e = self.experts(c)
            return self.shard_experts(c, name, full[e.start:e.stop])
        for pattern, fn in _RULES:
            if re.search(pattern, name):
                return fn(self, c, full)
        return full  # replicated: norms, router, correction bias, index-K projection

    def shard_experts(self, c: M3Config, name: str, local_experts: torch.Tensor) -> torch.Tensor:
        """The moe-TP part of an expert tensor that already holds only this rank's experts."""
        if name.endswith("experts.gate_up"):  # [E_local, H, 2I]
            return create_local_weight(local_experts, 2, self.moe_tp_rank, self.moe_tp, stride=2)
        return create_local_weight(local_experts, 1, self.moe_tp_rank, self.moe_tp)  # down [E_local, I, H]


def _rows(idx: Callable[[ShardPlan, M3Config], range], per: Callable[[M3Config], int], dim: int = 0):
    def fn(p: ShardPlan, c: M3Config, full: torch.Tensor) -> torch.Tensor:
        r = idx(p, c)
        return full.narrow(dim, r.start * per(c), len(r) * per(c)).contiguous()
    return fn


def _split(dim: int, stride: int = 1):
    return lambda p, c, full: create_local_weight(full, dim, p.rank, p.world, stride)


_RULES: tuple[tuple[str, Callable], ...] = (
    (r"attn\.q_proj\.weight$", _rows(ShardPlan.q_heads, lambda c: c.head_dim)),
    (r"attn\.[kv]_proj\.weight$", _rows(ShardPlan.kv_heads, lambda c: c.head_dim)),
    (r"attn\.index_q_proj\.weight$", _rows(ShardPlan.kv_heads, lambda c: c.index_head_dim)),
    (r"attn\.o_proj\.weight$", _rows(ShardPlan.q_heads, lambda c: c.head_dim, dim=1)),
    (r"(mlp|shared)\.gate_up_proj\.weight$", _split(0, stride=2)),
    (r"(mlp|shared)\.down_proj\.weight$", _split(1)),
    (r"^(embed_tokens|lm_head)\.weight$", _rows(ShardPlan.vocab, lambda c: 1)),
)


@dataclass(frozen=True)
class SequenceGroup:
    """The ranks that share one KV head's caches by sequence, on ``torch.distributed``: the ``ops.Group`` the
    attention step's collectives run on (its all-gather and its all-to-all) — vLLM's decode-context-parallel group
    for the vLLM Neuron model. ``group`` the process group of exactly these ``size`` ranks, in group order."""

    size: int
    group: Any = field(default=None, compare=False, repr=False)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        out = torch.empty((self.size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x.contiguous(), group=self.group)  # [G * x0, ...], ranks in order
        if dim == 0:
            return out
        return torch.cat(out.chunk(self.size, dim=0), dim=dim)

    def exchange(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=self.group)  # part j to rank j, along dim 0
        return out


def init_distributed(ep: int = 1, backend: str | None = None) -> tuple[ShardPlan, str]:
    """Join the process group ``torchrun`` describes (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``); returns the plan and
    the device this rank uses (``cuda:LOCAL_RANK`` with NCCL when GPUs are present, else ``cpu`` with gloo)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and not dist.is_initialized():
        return ShardPlan(), "cuda" if torch.cuda.is_available() else "cpu"
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = f"cuda:{local}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"))
    return ShardPlan(world=dist.get_world_size(), rank=dist.get_rank(), ep=ep), device
