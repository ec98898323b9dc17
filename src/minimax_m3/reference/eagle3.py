"""The EAGLE3 draft head in plain PyTorch, and the drafter the speculative provider drives.

The draft layer, as vLLM's and SGLang's ``llama_eagle3`` run it (Llama RMSNorm ``x * rsqrt(mean x^2 + eps) * w``
= ``ops.rms_norm(offset=0)``, full-width NeoX RoPE, SiLU MLP):

    hidden  = fc(cat(target states))  at the first step of a chain, else the draft's own pre-norm output
    residual, h = hidden, hidden_norm(hidden)         (norm_before_residual: residual = h)
    a       = attn(cat(input_layernorm(embed(token)), h))        q/k/v take 2 x hidden, causal over the draft cache
    residual = residual + o_proj(a);  m = mlp(post_attention_layernorm(residual))
    out     = residual + m           (the pre-norm state the next chain step reads)
    logits  = lm_head(norm(out))     over the draft vocabulary, placed at target ids (d2t); others -inf

Positions follow the target's: the draft entry at position ``t`` reads the target's states at ``t`` and the token at
``t + 1`` and predicts the token at ``t + 2``. The draft cache holds slot == position, like the target's, so the
entries a rejected chain wrote are overwritten by the next catch-up before any query reads them (reads are causal).

:class:`Eagle3Drafter` keeps, per cache row, the target states not yet fed to the draft (the prompt after prefill,
the verified prefix after a verify step) and their next tokens; :meth:`Eagle3Drafter.propose` feeds them in one
catch-up forward whose last position proposes the first draft token, then chains ``k - 1`` one-token steps.
"""

from __future__ import annotations

import copy
import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops
from ..checkpoint.draft import open_draft, target_shared
from ..config.draft import DraftConfig
from ..config.m3 import M3Config
from .model import M3Model

Choose = Callable[[int, torch.Tensor], int]  # (draft index j, logits [vocab]) -> the drafted token id


def rope_inv_freq(dc: DraftConfig) -> torch.Tensor:
    """The draft's inverse frequencies over its whole head: ``ops.rope_inv_freq``, with Llama-3 scaling when
    ``rope_scaling.rope_type == "llama3"`` (long wavelengths divided by ``factor``, short ones kept, a smooth blend
    between ``original_max_position_embeddings / low_freq_factor`` and ``.. / high_freq_factor``)."""
    inv = ops.rope_inv_freq(dc.head_dim, dc.rope_theta)
    s = dc.rope_scaling or {}
    if s.get("rope_type", s.get("type")) != "llama3":
        return inv
    factor, lo, hi = float(s["factor"]), float(s.get("low_freq_factor", 1.0)), float(s.get("high_freq_factor", 4.0))
    old = float(s.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    smooth = ((old / wavelen - lo) / (hi - lo)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv / factor + smooth * inv
    return torch.where(wavelen > old / lo, inv / factor, torch.where(wavelen < old / hi, inv, blended))


def _whole(x: torch.Tensor) -> torch.Tensor:
    return x


class DraftCache:
    """The draft layer's K/V ``[B, kv_heads, max_len, head_dim]`` (slot == position)."""

    def __init__(self, dc: DraftConfig, batch: int, max_len: int, dtype: torch.dtype, device):
        shape = (batch, dc.num_kv_heads, max_len, dc.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def row(self, r: int) -> "DraftCache":
        view = copy.copy(self)
        view.k, view.v = self.k[r:r + 1], self.v[r:r + 1]  # views: writes land in the whole cache
        return view

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Write ``k, v [B, kv, T, d]`` at ``positions [B, T]``, then each query of ``q [B, heads, T, d]`` attends to
        the slots ``<=`` its position."""
        ops.write_positions(self.k, k, positions, seq_dim=2)
        ops.write_positions(self.v, v, positions, seq_dim=2)
        end = int(positions.max()) + 1
        return ops.masked_attention(q, self.k[:, :, :end], self.v[:, :, :end], ops.causal_keep(positions, end), scale)


class Eagle3Draft(nn.Module):
    """One EAGLE3 draft layer with its fc, norms, embedding and lm_head (module docstring)."""

    def __init__(self, dc: DraftConfig):
        super().__init__()
        self.dc = dc
        h, d = dc.hidden_size, dc.head_dim
        self.fc = nn.Linear(3 * dc.target_hidden_size, h, bias=False)
        self.input_layernorm, self.hidden_norm = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.post_attention_layernorm, self.norm = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(2 * h, dc.num_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, dc.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, dc.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(dc.num_heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, dc.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, dc.intermediate_size, bias=False)
        self.down_proj = nn.Linear(dc.intermediate_size, h, bias=False)
        self.embed_tokens = nn.Embedding(dc.vocab_size, h)
        self.lm_head = nn.Linear(h, dc.draft_vocab_size, bias=False)
        self.register_buffer("target_ids", torch.arange(dc.draft_vocab_size), persistent=False)  # draft -> target
        self.register_buffer("inv_freq", rope_inv_freq(dc), persistent=False)
        # tensor parallel (minimax_m3.vllm_neuron.eagle3.shard_draft_): the sum of the ranks' o_proj and down_proj
        # partial outputs, the ranks' lm_head rows side by side; identities on one rank
        self.reduce = self.gather = _whole

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, w, self.dc.rms_norm_eps, offset=0.0)

    @torch.inference_mode()
    def combine(self, states: torch.Tensor) -> torch.Tensor:
        """The target's three states ``[..., 3 x Ht]`` (ascending layer ids) as the draft's hidden ``[..., H]``."""
        return self.fc(states)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache):
        """``ids, positions [B, T]``, ``hidden [B, T, H]`` → (float32 logits ``[B, T, vocab]`` over the TARGET
        vocabulary (-inf where the draft cannot propose), the pre-norm output ``[B, T, H]``). ``cache.attend`` writes
        K/V at ``positions`` and lets each query attend to the entries ``<=`` its position (:class:`DraftCache`, or
        vLLM's pages: ``minimax_m3.vllm_neuron.eagle3``)."""
        dc = self.dc
        b, t = ids.shape
        embeds = self._norm(self.embed_tokens(ids), self.input_layernorm)
        h = self._norm(hidden, self.hidden_norm)
        residual = h if dc.norm_before_residual else hidden
        x = torch.cat([embeds, h], dim=-1)
        q = self.q_proj(x).view(b, t, dc.num_heads, dc.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, dc.num_kv_heads, dc.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, dc.num_kv_heads, dc.head_dim).transpose(1, 2)
        cos, sin = ops.rope_cos_sin(positions, self.inv_freq, q.dtype)
        q, k = ops.apply_rope(q, cos, sin), ops.apply_rope(k, cos, sin)
        a = cache.attend(q, k, v, positions, dc.head_dim ** -0.5)
        residual = residual + self.reduce(self.o_proj(a.transpose(1, 2).reshape(b, t, -1)))
        m = self._norm(residual, self.post_attention_layernorm)
        out = residual + self.reduce(self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m)))
        draft_logits = self.gather(F.linear(self._norm(out, self.norm), self.lm_head.weight).float())
        logits = draft_logits.new_full((b, t, dc.vocab_size), float("-inf"))
        logits[..., self.target_ids] = draft_logits
        return logits, out


# canonical checkpoint key (checkpoint.draft) -> parameter of Eagle3Draft, where they differ
_PARAMS = {**{f"layer.{n}.weight": n for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")},
           "norm.weight": "norm",
           **{f"layer.self_attn.{n}.weight": f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
           **{f"layer.mlp.{n}.weight": f"{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}}


def build_draft(dc: DraftConfig, tensors: dict[str, torch.Tensor], shared: dict[str, torch.Tensor],
                dtype: torch.dtype, device) -> Eagle3Draft:
    """The draft module from its canonical tensors (:func:`minimax_m3.checkpoint.draft.open_draft`); the embedding
    and lm_head the draft stores none of come from ``shared`` (the target's, by the draft's names)."""
    with torch.device("meta"):
        draft = Eagle3Draft(dc)
    state = {_PARAMS.get(k, k): v for k, v in tensors.items() if k not in ("d2t", "t2d")}
    state.setdefault("embed_tokens.weight", shared.get("embed_tokens.weight"))
    if "lm_head.weight" not in state:
        state["lm_head.weight"] = state["embed_tokens.weight"] if dc.tie_word_embeddings else shared["lm_head.weight"]
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    draft.load_state_dict(state, strict=True, assign=True)
    ids = torch.arange(dc.draft_vocab_size)
    draft.target_ids = (ids + tensors["d2t"].long() if "d2t" in tensors else ids).to(device)
    draft.inv_freq = rope_inv_freq(dc).to(device)
    return draft.requires_grad_(False).eval()


class Eagle3Drafter:
    """Per-row drafting state over one :class:`Eagle3Draft` (module docstring)."""

    def __init__(self, draft: Eagle3Draft, aux_layers: tuple[int, ...]):
        self.draft, self.aux_layers = draft, tuple(aux_layers)
        self.cache: DraftCache | None = None
        self._pending: dict[int, tuple[int, torch.Tensor, list[int]]] = {}

    def reset(self, batch: int, max_len: int) -> None:
        """A new group of ``batch`` rows, positions below ``max_len``."""
        w = self.draft.fc.weight
        self.cache, self._pending = DraftCache(self.draft.dc, batch, max_len, w.dtype, w.device), {}

    def extend(self, row: int, start: int, states: torch.Tensor, tokens: list[int]) -> None:
        """The target's states ``[m, 3 x Ht]`` at positions ``start .. start + m - 1`` of ``row`` and the tokens at
        ``start + 1 .. start + m - 1`` (the one at ``start + m`` comes with :meth:`propose`)."""
        self._pending[row] = (start, states, list(tokens))

    @torch.inference_mode()
    def propose(self, row: int, last: int, position: int, k: int, choose: Choose) -> list[int]:
        """``k`` draft tokens for positions ``position + 1 ..`` of ``row``, whose token at ``position`` is ``last``:
        the catch-up forward over the pending states (its last output proposes the first), then one-token steps on
        the draft's own state. ``k = 0`` only catches up."""
        start, states, tokens = self._pending.pop(row)
        if start + states.shape[0] != position or len(tokens) + 1 != states.shape[0]:
            raise ValueError(f"draft row {row}: pending states at {start}..{start + states.shape[0] - 1} do not end "
                             f"before position {position}")
        cache, dev = self.cache.row(row), states.device
        ids = torch.tensor([tokens + [last]], device=dev)
        pos = torch.arange(start, position, device=dev).unsqueeze(0)
        logits, out = self.draft(ids, self.draft.combine(states.unsqueeze(0).to(self.draft.fc.weight.dtype)), pos,
                                 cache)
        drafted: list[int] = []
        for j in range(k):
            if j:
                logits, out = self.draft(torch.tensor([[drafted[-1]]], device=dev), out[:, -1:],
                                         torch.tensor([[position + j - 1]], device=dev), cache)
            drafted.append(int(choose(j, logits[0, -1])))
        return drafted


def load_drafter(path, target: M3Model) -> Eagle3Drafter:
    """The drafter of the EAGLE3 checkpoint at ``path`` for ``target`` (one :class:`DraftError` listing every
    problem of a draft that does not fit), in the target's dtype and device."""
    dc, tensors = open_draft(path, target.config)
    w = target.lm_head.weight
    shared = {"embed_tokens.weight": target.embed_tokens.weight, "lm_head.weight": w}
    return Eagle3Drafter(build_draft(dc, tensors, shared, w.dtype, w.device), dc.aux_layers(target.config.num_layers))


def load_host_drafter(path, target_path, target: M3Config, dtype: torch.dtype = torch.float32) -> Eagle3Drafter:
    """The drafter of the EAGLE3 checkpoint at ``path`` on the host CPU, for a target held elsewhere (the Neuron
    port): the tensors the draft shares are read from the target checkpoint at ``target_path``."""
    dc, tensors = open_draft(path, target)
    shared = target_shared(dc, tensors, target_path, target)
    return Eagle3Drafter(build_draft(dc, tensors, shared, dtype, "cpu"), dc.aux_layers(target.num_layers))
