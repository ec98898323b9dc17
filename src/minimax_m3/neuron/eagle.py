"""The EAGLE3 draft inside the device graph: NxDI's fused speculation (``enable_fused_speculation`` with
``enable_eagle_speculation`` and ``is_eagle3``) over the M3 target.

NxDI runs one graph per step for every row: ``speculation_length - 1`` draft steps (NxDI's Llama EAGLE3 draft
layer, ``models/llama/modeling_llama.py``), the target's verify of ``speculation_length`` tokens at once (the port's
sharded verify step), the draft's catch-up over the verified tokens, and the greedy acceptance (a draft is kept while
it equals the token the target chose after the previous one: with the port's seeded sampler that is the target's own
seeded draw, so the output equals plain decoding's token for token). It returns the accepted tokens (``-1``-padded)
and each row's next position. NxDI 0.9, ``models/model_base.py``: ``NeuronFusedSpecModel``.

What the port adds to NxDI's draft (:class:`M3Eagle3DraftModel`, :class:`M3Eagle3DraftForCausalLM`):

* the draft's tensors from this package's EAGLE3 checkpoints (``checkpoint.draft``: either published config form,
  ``midlayer.`` or ``layers.0.`` naming; the embedding and lm_head a draft stores none of, from the target);
* a reduced draft vocabulary (``d2t``), which NxDI's draft does not know: the ``[Vd, H]`` lm_head is placed at its
  target ids in a ``[V, H]`` head whose bias is the dtype's lowest value off the draft vocabulary, so NxDI's argmax
  over the target vocabulary picks the draft's own argmax, as a target id. Cost: the head reads ``V x H`` instead of
  ``Vd x H`` per draft step (written down in docs/speculative.md).

* prompts prefilled in several calls (``prefill_chunk`` below ``max_context_length``; NxDI's draft prefills a
  whole prompt from cache slot 0, one position behind the target within the call, its last entry a placeholder):
  :class:`M3FusedSpecModel`. A call at ``p0`` feeds the draft the call's own tokens at positions ``p0 - 1 ..`` with
  the target's states shifted by one, the first being the state the previous call left in NxDI's rolling buffer: it
  completes the previous call's last entry and leaves its own to the next call (or the first fused step's
  catch-up). Its cache is written at the call's first position (``kv_cache.DraftKVCacheManager``; a prompt's first
  call, which has no entry ``-1``, rotated so its entry 0 lands on a slot written again before it is read); each
  call's next position and rolling-buffer slot count from ``p0``. The draft has one layer, so an entry's K and V
  depend on that position's token, state and position alone: a prefill's draft attention output is unused (NxDI's
  graph drops it) and the call needs none over the earlier calls' entries.

The target's side (its three states at the draft's aux layer ids in NxDI's EAGLE3 layout) is
``model.NeuronMiniMaxM3Model.get_model_output``.
"""

from __future__ import annotations

import torch

from ..checkpoint.draft import DraftError, open_draft, target_shared
from ..config.draft import DraftConfig
from ..config.m3 import M3Config
from neuronx_distributed.parallel_layers.layers import ColumnParallelLinear
from neuronx_distributed_inference.models.llama.modeling_llama import NeuronLlamaForCausalLM, NeuronLlamaModel
from neuronx_distributed_inference.models.model_base import NeuronFusedSpecModel
from neuronx_distributed_inference.utils.distributed import get_tp_group

from . import nxd_compat
from .config import M3Eagle3DraftConfig, draft_fit_problems, prefill_in_calls
from .kv_cache import DraftKVCacheManager

# canonical draft key (checkpoint.draft) -> NxDI's Llama EAGLE3 draft key, where they differ: the names NxDI's GQA
# modules register (as the target's rule table, checkpoint.nxdi_rules), then the layer prefix
_KEYS = {**{f"layer.self_attn.{n}.weight": f"layer.self_attn.qkv_proj.{n}.weight" for n in ("q_proj", "k_proj",
                                                                                           "v_proj")},
         "layer.self_attn.o_proj.weight": "layer.self_attn.o_proj.o_proj.weight"}


def nxdi_key(canonical: str) -> str:
    key = _KEYS.get(canonical, canonical)
    return "layers.0." + key[len("layer."):] if key.startswith("layer.") else key


class M3Eagle3DraftModel(nxd_compat.OnDeviceSamplingHook, NeuronLlamaModel):
    """NxDI's EAGLE3 draft model; with a reduced draft vocabulary its lm_head is full-vocabulary with a bias that
    keeps the argmax on the draft's tokens (module docstring)."""

    def sample_on_device(self, logits, sampling_params, is_for_context_encoding):
        """The draft's greedy token: NxDI's own step (NxD's distributed argmax) on device, the gathered argmax in
        CPU mode (``nxd_compat.cpu_argmax``)."""
        return nxd_compat.cpu_argmax(logits, get_tp_group(self.config)) if self.neuron_config.on_cpu else None

    def init_inference_optimization(self, config):
        """NxDI's; with prompts prefilled in several calls (``prefill_in_calls``, set by :class:`M3FusedSpecModel`)
        the cache is written at each call's first position."""
        super().init_inference_optimization(config)
        if getattr(config, "prefill_in_calls", False):
            self.kv_mgr = DraftKVCacheManager(config, num_kv_head=self.num_key_value_heads, global_rank=self.rank_util)

    def init_model(self, config):
        super().init_model(config)
        if (getattr(config, "draft_vocab_size", None) or config.vocab_size) < config.vocab_size:
            self.lm_head = ColumnParallelLinear(config.hidden_size, config.vocab_size, bias=True,
                                                gather_output=not self.on_device_sampling,
                                                dtype=config.neuron_config.torch_dtype, pad=True,
                                                tensor_model_parallel_group=get_tp_group(config))


class M3FusedSpecModel(NeuronFusedSpecModel):
    """NxDI's fused speculation model (``NeuronFusedSpecModel``, NxDI 0.9 ``models/model_base.py``); when prompts
    take several prefill calls (:func:`config.prefill_in_calls`) the draft follows them (module docstring): one
    graph for every call, the call's first position ``p0`` an input."""

    def __init__(self, config):
        in_calls = prefill_in_calls(config.neuron_config)
        config.fused_spec_config.draft_config.prefill_in_calls = in_calls  # before NxDI builds the draft (this
        # model's own copy of the config)
        super().__init__(config)
        self.in_calls = in_calls

    def _eagle_context_encoding_forward(self, input_ids, attention_mask, position_ids, seq_ids, sampling_params):
        if not self.in_calls:
            return super()._eagle_context_encoding_forward(input_ids, attention_mask, position_ids, seq_ids,
                                                           sampling_params)
        self.draft_model.n_positions = self.n_positions
        self.target_model.n_positions = self.n_positions
        target = self.target_model(input_ids, attention_mask, position_ids, seq_ids, sampling_params)
        last, states = target[-2], target[-1]  # the last real token's state; every position's [B, T, 3H]
        start, real = position_ids[:, :1], attention_mask.sum(dim=1, keepdim=True)
        # draft entry j: token p0 + j with the target's state at p0 + j - 1, at position p0 + j - 1 (the first state
        # from the rolling buffer, where the previous call left it at its next position p0). Entry 0 completes the
        # previous call's last real entry; this call's own is completed by the next call or the first fused step's
        # catch-up. A prompt's first call has no entry -1: the draft's cache writes its entry 0 (token 0, no state)
        # at the call's end instead (kv_cache.DraftKVCacheManager), a slot written again before it is read.
        prev = self.hidden_state_rolling_buffer.get_state(seq_ids, start)
        hidden = torch.cat([prev.to(states.dtype), states[:, :-1]], dim=1)
        draft = self.draft_model(input_ids, attention_mask, position_ids - 1, seq_ids, sampling_params, hidden)
        # a row whose prompt ended in an earlier call keeps its rolling-buffer state (rewritten with itself)
        kept = self.hidden_state_rolling_buffer.get_state(seq_ids, (start + real).to(start.dtype))
        last = torch.where((real > 0).unsqueeze(-1), last, kept.to(last.dtype))
        n = 2 if self.neuron_config.output_logits else 1  # tokens (and logits), then the caches (NxDI's order)
        heads = [x for i in range(n) for x in (draft[i], target[i])]
        return [*heads, *draft[n:-2], *target[n:-2], last]

    def _cte_postprocessor(self, context_outs, input_ids, attention_mask, position_ids, speculation_length,
                           num_queries=None, computed_context_lens=None):
        """NxDI's, with each row's next position counted from the call's first position (NxDI counts the call's
        real tokens: a prompt's only call)."""
        out = super()._cte_postprocessor(context_outs, input_ids, attention_mask, position_ids, speculation_length,
                                         num_queries, computed_context_lens)
        if not self.in_calls:
            return out
        next_pos = out[3] + position_ids[:, :1].to(out[3].dtype)
        slots = torch.arange(self.neuron_config.seq_len, device=position_ids.device).view(1, -1)
        return [out[0], out[1], (slots < next_pos).to(position_ids.dtype), next_pos]


class M3Eagle3DraftForCausalLM(NeuronLlamaForCausalLM):
    """The draft's NxDI application class: only its state dict is ever used (NxDI's fused loader calls
    :meth:`get_state_dict` with the draft's path and config; ``_model_cls`` builds the traced draft)."""

    _model_cls = M3Eagle3DraftModel

    @classmethod
    def get_config_cls(cls):
        return M3Eagle3DraftConfig

    @classmethod
    def get_state_dict(cls, model_name_or_path: str, config) -> dict:
        target = M3Config.from_fields(config.m3)
        dc, tensors = open_draft(model_name_or_path, target)
        problems = draft_fit_problems(dc, target)  # also where vllm-neuron, not the port, built the fused config
        if problems:
            raise DraftError(problems, f"EAGLE3 draft {model_name_or_path} (fused speculation)")
        tensors.update(target_shared(dc, tensors, config.target_path, target))
        sd = draft_state_dict(dc, tensors, config.neuron_config.torch_dtype)
        return nxd_compat.with_fused_prefix(cls, cls.convert_hf_to_neuron_state_dict(sd, config))


def draft_state_dict(dc: DraftConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """NxDI's EAGLE3 draft state dict (before its own conversion) from the draft's canonical tensors with the shared
    ones filled in: a reduced vocabulary's lm_head placed at its target ids, with the masking bias."""
    sd = {nxdi_key(k): v.to(dtype) for k, v in tensors.items() if k not in ("d2t", "t2d", "lm_head.weight")}
    head = tensors.get("lm_head.weight", tensors["embed_tokens.weight"])
    if dc.draft_vocab_size < dc.vocab_size:
        ids = torch.arange(dc.draft_vocab_size) + tensors["d2t"].long()
        full = torch.zeros(dc.vocab_size, head.shape[1], dtype=dtype)
        full[ids] = head.to(dtype)
        bias = torch.full((dc.vocab_size,), torch.finfo(dtype).min, dtype=dtype)
        bias[ids] = 0
        sd["lm_head.weight"], sd["lm_head.bias"] = full, bias
    else:
        sd["lm_head.weight"] = head.to(dtype)
    return sd
