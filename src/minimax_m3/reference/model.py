"""The reference MiniMax-M3 text backbone in plain PyTorch. Reads top to bottom; all math is in ``ops``.

Cache slot == token position for every sequence (a batch is aligned at position 0 and padded on the
right internally), so block boundaries always follow each sequence's own content.

With a :class:`ShardPlan` of ``world > 1`` every module holds one rank's slice (see ``parallel.py``) and the
model all-reduces after ``o_proj`` and after the MLP, and gathers the vocabulary-parallel logits.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from dataclasses import dataclass

from .. import ops
from ..config.m3 import M3Config
from . import fast
from .cache import KVCache
from .moe import routed_experts
from .parallel import ShardPlan


@dataclass
class FastPaths:
    """Which attention runs a prefill from position 0: ``auto``: FlexAttention where it compiles to a fused kernel
    (CUDA), else the step (``ops.attention_step``, in query tiles); ``flex``: FlexAttention anywhere
    (``flex_compile=None`` compiles on CUDA only); ``plain``: always the step. Every other call (the later calls of a
    chunked prefill, decode, verify) runs the step."""

    prefill: str = "auto"
    flex_compile: bool | None = None

    def flex(self, device: torch.device) -> bool:
        if self.prefill not in ("auto", "flex", "plain"):
            raise ValueError(f"prefill implementation {self.prefill!r}; choose auto, flex or plain")
        return self.prefill == "flex" or (self.prefill == "auto" and fast.flex_default(device))


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))  # zero-centred Gemma weight
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class DenseMLP(nn.Module):
    """Column/row-parallel SwiGLU MLP; returns this rank's partial sum (the caller all-reduces)."""

    def __init__(self, c: M3Config, inter: int, plan: ShardPlan):
        super().__init__()
        inter //= plan.world
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * inter, bias=False)  # [gate; up]
        self.down_proj = nn.Linear(inter, c.hidden_size, bias=False)
        self.alpha, self.limit = c.swiglu_alpha, c.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.swiglu_mlp(x, self.gate_up_proj.weight, self.down_proj.weight, self.alpha, self.limit)


class Experts(nn.Module):
    """This rank's routed experts, ``gate_up [E, H, 2I]`` and ``down [E, I, H]``; fp8 experts
    (``checkpoint.fp8_experts.quantize_experts_``) hold them e4m3 with ``gate_up_scale`` / ``down_scale``."""

    def __init__(self, c: M3Config, plan: ShardPlan):
        super().__init__()
        e, inter = len(plan.experts(c)), c.intermediate_size // plan.moe_tp
        self.gate_up = nn.Parameter(torch.empty(e, c.hidden_size, 2 * inter))
        self.down = nn.Parameter(torch.empty(e, inter, c.hidden_size))

    @property
    def scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """fp8 experts' ``(gate_up_scale [E, 1, 2I], down_scale [E, 1, H])`` parameters, else None."""
        up = getattr(self, "gate_up_scale", None)
        return None if up is None else (up, self.down_scale)


class MoE(nn.Module):
    def __init__(self, c: M3Config, plan: ShardPlan):
        super().__init__()
        self.c, self.first_expert = c, plan.experts(c).start
        self.router = nn.Linear(c.hidden_size, c.num_experts, bias=False, dtype=torch.float32)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(c.num_experts, dtype=torch.float32))
        self.experts = Experts(c, plan)
        self.shared = DenseMLP(c, c.shared_intermediate_size, plan)
        self.strategy: str | None = None  # routed_experts' strategy; None: picked per call (pick_strategy)
        self.ordered = False  # ops.route's experts by descending score (the vLLM Neuron model's, for StableHLO)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = ops.route(x, self.router.weight, self.e_score_correction_bias, self.c.top_k, self.ordered)
        routed = routed_experts(x, weights, experts, self.experts.gate_up, self.experts.down, self.c,
                                self.first_expert, self.strategy, self.experts.scales)
        return (routed * self.c.routed_scaling_factor + self.shared(x)).view(shape)


class Attention(nn.Module):
    """This rank's query heads, its KV heads (a slice, or one replicated head) and their index heads; returns
    the partial ``o_proj`` sum (the caller all-reduces)."""

    def __init__(self, c: M3Config, sparse: bool, plan: ShardPlan, paths: FastPaths):
        super().__init__()
        self.c, self.sparse, self.paths = c, sparse, paths
        self.nq, self.nkv = len(plan.q_heads(c)), len(plan.kv_heads(c))
        h, d = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(h, self.nq * d, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * d, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * d, bias=False)
        self.o_proj = nn.Linear(self.nq * d, h, bias=False)
        self.q_norm, self.k_norm = Norm(d, c.rms_norm_eps), Norm(d, c.rms_norm_eps)
        if sparse:
            self.index_q_proj = nn.Linear(h, self.nkv * c.index_head_dim, bias=False)  # index head g ↔ KV head g
            self.index_k_proj = nn.Linear(h, c.index_head_dim, bias=False)
            self.index_q_norm = Norm(c.index_head_dim, c.rms_norm_eps)
            self.index_k_norm = Norm(c.index_head_dim, c.rms_norm_eps)
        self._parts = [(self.q_proj, self.q_norm, self.nq, d), (self.k_proj, self.k_norm, self.nkv, d)]
        if sparse:
            self._parts += [(self.index_q_proj, self.index_q_norm, self.nkv, c.index_head_dim),
                            (self.index_k_proj, self.index_k_norm, 1, c.index_head_dim)]
        widths = dict.fromkeys(p[3] for p in self._parts)  # q and k first: same-width parts adjoin
        self._groups = [[p for p in self._parts if p[3] == d] for d in widths]  # one per head width, in order
        self._split = [sum(n * w for _, _, n, w in g) for g in self._groups] + [self.nkv * c.head_dim]  # + v
        self._fused, self._fused_ptrs, self._fixed = None, [], False

    def _in_proj(self) -> tuple[torch.Tensor, list[torch.Tensor], list[int]]:
        """This layer's input projections as one weight: rows ``[q; k; (index q; index k;) v]``, so a step runs one
        matmul instead of five; also each head width's per-head norm weights, and the row split.

        The ``nn.Linear`` modules keep their names and shapes (checkpoints, sharding and tests see them as before)
        but their weights become views into the one tensor: it is built on first use and rebuilt whenever a weight
        is no longer such a view (after ``.to()``, ``load_state_dict(assign=True)``, ...), so an in-place update
        stays visible and no weight is held twice. The norm weights (a few hundred numbers) are rebuilt each call."""
        lins = [p[0] for p in self._parts] + [self.v_proj]
        if self._fused is None or not self._fixed and any(lin.weight.data_ptr() != ptr
                                                          for lin, ptr in zip(lins, self._fused_ptrs)):
            with torch.inference_mode(False), torch.no_grad():
                fused, start = torch.cat([lin.weight for lin in lins]), 0
                for lin in lins:
                    rows = lin.weight.shape[0]
                    lin.weight.data = fused[start:start + rows]
                    start += rows
            self._fused, self._fused_ptrs = fused, [lin.weight.data_ptr() for lin in lins]
        norms = [torch.cat([norm.weight.expand(n, d) for _, norm, n, d in g]) for g in self._groups]
        return self._fused, norms, self._split

    def fix_projections(self) -> None:
        """Build the one input-projection weight now and stop checking it for replaced weights (a model whose weights
        no longer change, captured by ``torch.compile``: the check reads data pointers, which a graph cannot)."""
        self._in_proj()
        self._fixed = True

    def _rotary_heads(self, x, rope) -> list[torch.Tensor]:
        """q, k, (sparse layers) the index q, k and v, ``[B, n, S, d]`` each: projected by one matmul, then q, k and
        the index q, k RMS-normed per head and rotated. Heads of one width go through the norm and the rotation
        together (the norm weights laid out per head): same math as one projection at a time, fewer small ops."""
        b, s, _ = x.shape
        weight, norms, split = self._in_proj()
        *ys, v = F.linear(x, weight).split(split, dim=-1)
        out = []
        for y, w, group in zip(ys, norms, self._groups):
            d = group[0][3]
            y = ops.rms_norm(y.view(b, s, -1, d), w, self.c.rms_norm_eps).transpose(1, 2)
            y = ops.apply_rope_tables(y, *rope[d])
            out += y.split([n for _, _, n, _ in group], dim=1)
        return out + [v.view(b, s, self.nkv, self.c.head_dim).transpose(1, 2)]

    def forward(self, x, rope, positions, cache, layer: int, kv_len: int, decode: bool):
        """Project, then let the cache run the step (``cache.attend``: :meth:`KVCache.attend` for the reference's
        contiguous cache, the vLLM Neuron model's paged cache for its pages) and project out."""
        b, s, _ = x.shape
        q, k, *index, v = self._rotary_heads(x, rope)
        iq, ik = (index[0], index[1][:, 0]) if self.sparse else (None, None)
        sel = ops.Selection.of(self.c) if self.sparse else None
        out = cache.attend(layer, q, k, v, iq, ik, positions, kv_len, decode, sel, self.paths)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.nq * self.c.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, c: M3Config, i: int, plan: ShardPlan, paths: FastPaths):
        super().__init__()
        self.input_layernorm = Norm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = Norm(c.hidden_size, c.rms_norm_eps)
        self.attn = Attention(c, c.sparse_layers[i], plan, paths)
        if c.moe_layers[i]:
            self.moe = MoE(c, plan)
        else:
            self.mlp = DenseMLP(c, c.dense_intermediate_size, plan)
        self.i, self.plan = i, plan

    def forward(self, x, rope, positions, cache, kv_len, decode):
        attn = self.attn(self.input_layernorm(x), rope, positions, cache, self.i, kv_len, decode)
        x = x + self.plan.all_reduce(attn)
        h = self.post_attention_layernorm(x)
        return x + self.plan.all_reduce(self.moe(h) if hasattr(self, "moe") else self.mlp(h))


class M3Model(nn.Module):
    def __init__(self, c: M3Config, plan: ShardPlan | None = None):
        super().__init__()
        plan = plan or ShardPlan()
        plan.check(c)
        self.config, self.plan, self.paths = c, plan, FastPaths()
        self.local_kv_heads = len(plan.kv_heads(c))
        vocab = len(plan.vocab(c))
        self.embed_tokens = nn.Embedding(vocab, c.hidden_size)  # vocabulary-parallel rows
        self.layers = nn.ModuleList(DecoderLayer(c, i, plan, self.paths) for i in range(c.num_layers))
        self.norm = Norm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, vocab, bias=False)
        self.register_buffer("inv_freq", ops.rope_inv_freq(c.rotary_dim, c.rope_theta), persistent=False)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, kv_len: int, decode: bool,
                logits_at: torch.Tensor | None = None, hidden_at: tuple[int, ...] | None = None):
        """Hidden states → float32 logits. ``ids, positions [B, S]``; a prefill call covers positions
        ``kv_len - S .. kv_len - 1`` (from 0: a whole prompt, or the first call of a chunked prefill).

        ``logits_at [B]`` picks one position per row (saves the lm_head over the whole prompt).

        ``hidden_at``: target layer ids (an EAGLE3 draft's, vLLM's indexing: id ``j`` is the residual stream entering
        layer ``j``, the output of layer ``j - 1``); the forward then returns ``(logits, hidden [B, S, n x hidden])``,
        the states concatenated in ascending id order at every position. The logits are the same either way."""
        x, kept = self.backbone(ids, positions, cache, kv_len, decode, hidden_at)
        if logits_at is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logits_at].unsqueeze(1)
        logits = self.logits(x)
        return logits if hidden_at is None else (logits, torch.cat(kept, dim=-1))

    def backbone(self, ids, positions, cache, kv_len: int, decode: bool, hidden_at=None):
        """The decoder stack: ``(x [B, S, hidden]`` before the final norm, the residual streams at ``hidden_at``)."""
        c = self.config
        x = self._embed(ids)
        cos, sin = ops.rope_cos_sin(positions, self.inv_freq, x.dtype)
        rope = {d: ops.rope_tables(cos, sin, d) for d in {c.head_dim, c.index_head_dim}}  # per head width, once
        taps = sorted(hidden_at or ())
        kept = []
        for i, layer in enumerate(self.layers):
            if i in taps:
                kept.append(x)
            x = layer(x, rope, positions, cache, kv_len, decode)
        return x, kept

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the final hidden states ``x [..., hidden]`` (vocabulary-parallel ranks gathered)."""
        return self.plan.all_gather_last(F.linear(self.norm(x), self.lm_head.weight).float())

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.plan.world == 1:
            return self.embed_tokens(ids)
        local = ids - self.plan.vocab(self.config).start
        mine = (local >= 0) & (local < self.embed_tokens.num_embeddings)
        x = self.embed_tokens(torch.where(mine, local, 0))
        return self.plan.all_reduce(torch.where(mine.unsqueeze(-1), x, 0.0))

    def new_cache(self, batch: int, max_len: int, tile: int = 256) -> KVCache:
        """An empty cache for this rank's KV heads, on the model's device and dtype."""
        w = self.lm_head.weight
        return KVCache(self.config, batch, max_len, w.dtype, w.device, tile=tile, kv_heads=self.local_kv_heads)
