"""MiniMax-M3's EAGLE3 draft on vLLM Neuron's draft contract: the factory the plugin's ``EagleProposer`` builds.

The contract as read in ``jinhuang12/vllm-neuron`` at ``ed3580d`` (``vllm_neuron/vllm/spec_decode/eagle.py``, the
proposer; ``vllm_neuron/model/llama3/eagle3_model.py``, the plugin's own Llama draft; see
``docs/notes/vllm_neuron_runner.md``):

* ``from_configs(config=<the draft's hf_config>, start_layer_idx=<target layers>, neuron_config=...)`` on the meta
  device, then ``num_speculative_tokens`` set, ``load_weights(path, device, cache_dir)``, ``.to(device)``;
* the draft layer's K/V pages are a spec of their own, ``layers.{start_layer_idx}.self_attn`` (:meth:`get_kv_spec`),
  in the target's KV cache group: one block table, so a prefix-cache hit restores the draft's entries with the
  target's;
* ``forward(input_ids, positions, initial_target_hidden_states, attn_metadata, sampling_positions, rank,
  raw_sampled_token_ids, ...)`` is one fused propose: ``input_ids`` are the target call's tokens shifted by one (the
  last repeated), ``raw_sampled_token_ids [rows, 1]`` after a prompt segment or a plain decode, ``[rows, 1 + k]`` after
  a verify step (the accepted tokens and the bonus, ``-1`` after them). The draft puts each row's last valid token at
  its sampling position (moved back past the rejected drafts), writes its K/V for every token of the call (the
  entry at position ``t`` reads the target's states at ``t`` and the token at ``t + 1``), proposes from the
  sampling position, then chains ``k - 1`` one-token steps whose slots it computes from the block table. It returns
  ``(stacked [rows, 1 + k] = the bonus then the drafts, or [rows, k] with no bonus; drafts_only [rows, k]; None)``,
  int32.

The layer math is the reference draft's (:class:`minimax_m3.reference.eagle3.Eagle3Draft`, the same module and
weights); only its cache is vLLM's pages (:class:`PagedDraftCall`): dense over the row's pages up to each query,
written first. Over vLLM's tensor-parallel group the layer is split as the plugin's Llama draft is
(:func:`shard_draft_`: heads, MLP width and draft vocabulary per rank; two all-reduces and the logits' all-gather
per draft step), else whole on every rank. Drafted tokens are the argmax of the draft's logits over the target
vocabulary (greedy drafting, as the plugin's proposer asks).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from .. import ops
from ..config.m3 import M3Config
from ..errors import ServingError
from ..ops.paged import Pages, slot_mapping, write_slots
from ..reference.parallel import ShardPlan
from .contract import KVSpec, LayerSpec
from .model import _dtype, _tp_group


@dataclass
class PagedDraftCall:
    """The draft layer's pages as one call sees them: K/V ``[N, kv, P, d]``, ``slots [T]`` (negative: padding, to the
    null page) and the rows' block tables ``table [B, W]``."""

    k: torch.Tensor
    v: torch.Tensor
    slots: torch.Tensor
    table: torch.Tensor

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Write ``k, v [B, kv, T, d]`` at the call's slots, then each query of ``q [B, heads, T, d]`` at
        ``positions [B, T]`` attends to its row's entries ``<=`` its position: ``ops.attention_step``'s dense layer
        over pages written first (the target's paged step, ``paged_cache.Call``, with no selection)."""
        b, h, t, d = k.shape
        write_slots(self.k, k.transpose(1, 2).reshape(b * t, h, d), self.slots)
        write_slots(self.v, v.transpose(1, 2).reshape(b * t, h, d), self.slots)
        q_pos = positions.to(torch.int64)
        return ops.attention_step(q, Pages(self.k, self.table), Pages(self.v, self.table), None, q_pos, q_pos[:, 0],
                                  0, ops.Alone(), scale)


def draft_split_problems(dc, world: int) -> list[str]:
    """Why the draft layer does not split over ``world`` tensor-parallel ranks (empty: it does)."""
    sizes = {"num_attention_heads": dc.num_heads, "num_key_value_heads": dc.num_kv_heads,
             "intermediate_size": dc.intermediate_size, "draft_vocab_size": dc.draft_vocab_size}
    return [f"{k} {v} is not a multiple of {world} ranks" for k, v in sizes.items() if v % world]


def shard_draft_(draft, plan: ShardPlan) -> bool:
    """Split a built draft layer (:class:`~minimax_m3.reference.eagle3.Eagle3Draft`) over ``plan``'s ranks, in place,
    as the plugin's Llama draft is split: this rank's query and K/V heads (q, k, v rows; o_proj columns, summed over
    the ranks), its slice of the MLP width (gate, up rows; down columns, summed), its rows of the draft vocabulary
    (lm_head, the ranks' logits side by side); fc, the norms and the embedding whole on every rank. False (the layer
    left whole on every rank, its K/V heads all local) on one rank or where the widths do not split
    (:func:`draft_split_problems`)."""
    dc, w, r = draft.dc, plan.world, plan.rank
    if w == 1 or draft_split_problems(dc, w):
        return False
    d = dc.head_dim

    def rows(lin, n):  # this rank's n-th share of a weight's rows (outputs)
        lin.weight = nn.Parameter(lin.weight.detach()[r * n:(r + 1) * n].clone(), requires_grad=False)

    rows(draft.q_proj, dc.num_heads // w * d)
    rows(draft.k_proj, dc.num_kv_heads // w * d)
    rows(draft.v_proj, dc.num_kv_heads // w * d)
    rows(draft.gate_proj, dc.intermediate_size // w)
    rows(draft.up_proj, dc.intermediate_size // w)
    rows(draft.lm_head, dc.draft_vocab_size // w)
    for lin, n in ((draft.o_proj, dc.num_heads // w * d), (draft.down_proj, dc.intermediate_size // w)):
        lin.weight = nn.Parameter(lin.weight.detach()[:, r * n:(r + 1) * n].clone(), requires_grad=False)
    draft.dc = replace(dc, num_heads=dc.num_heads // w, num_kv_heads=dc.num_kv_heads // w,
                       intermediate_size=dc.intermediate_size // w)
    draft.reduce, draft.gather = plan.all_reduce, plan.all_gather_last
    return True


def accepted_tokens(ids: torch.Tensor, last: torch.Tensor, raw: torch.Tensor, vocab: int, k: int):
    """``(ids, last, bonus)``: each row's last valid token of ``raw [rows, 1 | 1 + k]`` (``-1`` or out of the
    vocabulary: not valid; a row with none: 0) put into ``ids [T]`` at its sampling position ``last [rows]``, which a
    verify step's rejected drafts move back by their count."""
    valid = (raw >= 0) & (raw < vocab)
    count = valid.sum(1)
    bonus = raw.long().gather(1, (count - 1).clamp(min=0).view(-1, 1)).view(-1)
    bonus = torch.where(count > 0, bonus, torch.zeros_like(bonus))
    if raw.shape[1] > 1:
        last = (last - (k + 1 - count)).clamp(min=0)
    return ids.scatter(0, last, bonus), last, bonus


class MiniMaxM3Eagle3Draft(nn.Module):
    """The vLLM Neuron draft factory and model (see the module)."""

    def __init__(self, hf_config, start_layer_idx: int, dtype: torch.dtype):
        super().__init__()
        self.hf_config, self.start_layer_idx, self.dtype = hf_config, int(start_layer_idx), dtype
        self.layer_name = f"layers.{self.start_layer_idx}.self_attn"
        self.num_speculative_tokens = 1  # the proposer sets it after from_configs
        self.draft = None  # the reference draft layer, built by load_weights
        self.k = self.v = None

    @classmethod
    def from_configs(cls, config=None, start_layer_idx: int = 0, neuron_config=None) -> MiniMaxM3Eagle3Draft:
        return cls(config, start_layer_idx, _dtype(config, neuron_config))

    # ---- weights ------------------------------------------------------------------------------------------------
    def load_weights(self, checkpoint_path: str, device=None, cache_dir: str | None = None, *,
                     target: tuple[M3Config, str] | None = None) -> None:
        """The draft from its checkpoint (``checkpoint.draft``: every problem in one error), the tensors it shares
        with the target (embedding, lm_head) from the target's checkpoint; ``target``: ``(config, path)`` of the
        target, else vLLM's current model config (the proposer loads under it)."""
        from ..checkpoint.draft import open_draft, target_shared
        from ..reference.eagle3 import build_draft
        from ..storage import resolve

        config, target_path = target or _current_target()
        dc, tensors = open_draft(resolve(checkpoint_path, cache_dir), config)
        shared = target_shared(dc, tensors, resolve(target_path, cache_dir), config)
        self.draft = build_draft(dc, tensors, shared, self.dtype, device or "cpu")
        self.vocab_size = config.vocab_size
        world, rank, group = _tp_group()
        self.sharded = shard_draft_(self.draft, ShardPlan(world=world, rank=rank, group=group))

    # ---- caches -------------------------------------------------------------------------------------------------
    def get_kv_spec(self) -> KVSpec:
        dc = self._dc()
        return KVSpec(layers=[LayerSpec(self.layer_name, dc.num_kv_heads, dc.head_dim, self.dtype)])

    def bind_kv_cache(self, kv_caches: dict) -> None:
        if self.layer_name not in kv_caches:
            raise ServingError(f"no KV cache bound for the draft layer {self.layer_name}: allocate the draft's "
                               "get_kv_spec() beside the target's")
        self.k, self.v = kv_caches[self.layer_name]
        if self.k.dtype != self.dtype:
            raise ServingError(f"draft KV cache dtype {self.k.dtype}, draft dtype {self.dtype}: serve with "
                               "--kv-cache-dtype auto")

    def _dc(self):
        if self.draft is None:
            raise ServingError("the draft is used before load_weights: the proposer loads it first")
        return self.draft.dc

    # ---- the fused propose ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, initial_target_hidden_states: torch.Tensor,
                attn_metadata: dict | None = None, sampling_positions: torch.Tensor | None = None, rank=None,
                raw_sampled_token_ids: torch.Tensor | None = None, prev_sampled_token_ids=None,
                prev_num_draft_tokens=None, req_indices_per_token=None, **kw):
        if self.k is None:
            raise ServingError("the draft's forward before bind_kv_cache: the runner binds the draft's pages first")
        meta = attn_metadata[self.layer_name]
        table, block = meta["block_table_tensor"], int(meta["block_size"])
        if self.k.shape[2] != block:
            raise ServingError(f"the draft's pages hold {self.k.shape[2]} slots, the metadata says {block}")
        b, t = table.shape[0], input_ids.shape[0]
        if t % b:
            raise ServingError(f"{t} tokens do not split into the block table's {b} rows")
        ids, pos = input_ids.reshape(-1).long(), positions.reshape(-1).long()
        last = sampling_positions.reshape(-1).long()
        bonus = None
        if raw_sampled_token_ids is not None:
            ids, last, bonus = accepted_tokens(ids, last, raw_sampled_token_ids, self.vocab_size,
                                               self.num_speculative_tokens)
        draft = self.draft
        hidden = draft.combine(initial_target_hidden_states.to(draft.fc.weight.dtype))
        call = PagedDraftCall(self.k, self.v, meta["slot_mapping"].reshape(-1), table)
        logits, out = draft(ids.view(b, t // b), hidden.view(b, t // b, -1), pos.view(b, t // b), call)
        logits, out, cur = logits.reshape(t, -1)[last], out.reshape(t, -1)[last], pos[last]
        token = logits.argmax(-1)
        drafts = [token]
        for _ in range(self.num_speculative_tokens - 1):  # one-token steps on the draft's own state
            cur = cur + 1
            step = PagedDraftCall(self.k, self.v, slot_mapping(table, cur, block), table)
            logits, out = draft(token.view(-1, 1), out.unsqueeze(1), cur.view(-1, 1), step)
            logits, out = logits[:, 0], out[:, 0]
            token = logits.argmax(-1)
            drafts.append(token)
        drafts_only = torch.stack(drafts, 1).to(torch.int32)
        stacked = drafts_only if bonus is None else torch.cat([bonus.view(-1, 1).to(torch.int32), drafts_only], 1)
        return stacked, drafts_only, None


def _current_target() -> tuple[M3Config, str]:
    """The target's config and checkpoint path from vLLM's current config (the proposer loads under it)."""
    try:
        from vllm.config import get_current_vllm_config

        mc = get_current_vllm_config().model_config
    except Exception as e:  # no vLLM, or no config set
        raise ServingError("the EAGLE3 draft needs its target: load it under vLLM's config, or pass "
                           "target=(M3Config, checkpoint path)") from e
    hf = mc.hf_config
    raw = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
    return M3Config.from_dict(raw, source="the target's hf_config"), mc.model

__all__ = ["MiniMaxM3Eagle3Draft", "PagedDraftCall", "accepted_tokens"]
