"""NxD / NxDI adaptations that run in the model and the application: while NxDI builds the model (the MoE's router
and expert MLPs), inside its forward (the KV group's collectives, the expert dispatch, the context-encoding test, the
on-device sampling hook and the sampler's candidate search) and in the application's ``forward`` around each call
(its positional arguments by name, the attention mask NxDI infers, a speculation build's outputs).

Targets Neuron SDK 2.29: NxDI 0.9 (4bcdc54) and NxD 0.18 ("Release 2.29"); each function and class names the version
and the upstream file and function whose behaviour it works around. :class:`SpeculationOutputs` also holds the copy of
a CPU-mode call's caches back into the submodels (``_copy_past_key_values``): NxDI calls it as a method of the
application. Imports NxD and NxDI at module level (:class:`M3ExpertMLPs` subclasses NxD's ``ExpertMLPsV2``;
:func:`forward_kwargs` reads the signature of NxDI's ``NeuronBaseForCausalLM.forward``).
"""

from __future__ import annotations

import inspect

import torch
from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2
from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM
from torch import nn


# ---- the KV group (sequence-sharded caches) --------------------------------------------------------------------


def kv_process_group(size: int):
    """NxD's KV-shared process group of this rank: the ``size`` consecutive ranks that hold one KV head.

    Targets NxD 0.18 (``parallel_layers/parallel_state.py``: ``initialize_kv_group`` / ``get_kv_shared_group``).
    On device NxD's ``ModelBuilder.trace`` builds it when the config's ``num_cores_per_group > 1``
    (``trace/model_builder.py``, with ``sequential_ranks_in_group=True``); NxDI's ``to_cpu`` never does, so in CPU
    mode the first layer's call builds it (every rank runs the same layers in the same order, as ``new_group``
    needs) and a model with another group size rebuilds it (NxD keeps one size per process)."""
    from neuronx_distributed.parallel_layers import parallel_state as ps

    try:
        if ps.get_kv_shared_group_size() == size:
            return ps.get_kv_shared_group()
    except AssertionError:  # not initialised
        pass
    ps.destroy_kv_group()
    ps.initialize_kv_group(size, sequential_ranks_in_group=True)
    return ps.get_kv_shared_group()


class KVGroupOps:
    """``ops.step.Group`` on the KV group: NxD's all-gather wrapper, and an all-to-all NxD has only for its
    expert-parallel group (and without a CPU branch): ``torch.distributed.all_to_all_single`` on gloo in CPU mode,
    ``xm.all_to_all`` over the group's replica groups on device.

    Targets NxD 0.18 (``parallel_layers/mappings.py``: ``_gather_along_dim``, and
    ``_all_to_all_in_expert_parallel_region``, whose ``xm.all_to_all`` call this mirrors on the KV group)."""

    def __init__(self, size: int):
        self.size, self.group = size, kv_process_group(size)

    def all_gather(self, x, dim):
        from neuronx_distributed.parallel_layers import mappings

        return mappings._gather_along_dim(x, dim, process_group=self.group)

    def exchange(self, x):
        from neuronx_distributed.parallel_layers import parallel_state as ps
        from neuronx_distributed.utils import cpu_mode

        if cpu_mode():
            out = torch.empty_like(x)
            torch.distributed.all_to_all_single(out, x.contiguous(), group=self.group)
            return out
        from torch_xla.core import xla_model as xm

        return xm.all_to_all(x, split_dimension=0, concat_dimension=0, split_count=self.size,
                             groups=ps.get_kv_shared_group(as_list=True), pin_layout=False)


# ---- MoE -------------------------------------------------------------------------------------------------------


def replace_router(moe: nn.Module, router_cls: type) -> None:
    """Give the ``MoE`` that NxDI's factory built a router of class ``router_cls``, constructed with the factory
    router's ``num_experts``, ``top_k``, ``hidden_size``, ``sequence_parallel_enabled`` and ``sequence_dimension``.

    Targets NxDI 0.9 (``modules/moe_v2.py``: ``initialize_moe_module`` builds NxD's ``RouterTopK`` itself and
    takes no router class; NxD 0.18's ``MoE`` calls ``self.router``). ``router_cls`` keeps NxD's router contract
    ``(router_logits, expert_affinities, expert_index)``."""
    old = moe.router
    moe.router = router_cls(
        num_experts=old.num_experts, top_k=old.top_k, hidden_size=old.hidden_size,
        sequence_parallel_enabled=old.sequence_parallel_enabled, sequence_dimension=old.sequence_dimension,
    )


class M3ExpertMLPs(ExpertMLPsV2):
    """``ExpertMLPsV2`` whose inference dispatch never takes selective loading with expert parallelism.

    Targets NxD 0.18 (``modules/moe/expert_mlps_v2.py``: ``ExpertMLPsV2.forward``): it picks selective loading
    when ``tokens * top_k / num_experts < 1`` and raises NotImplementedError for it under EP>1 (batch < 32 at
    E=128, k=4). With EP each rank holds only E/EP experts, so running every local expert on every token
    (``forward_all_experts_EP``) is both exact and cheap; it is used for those cases (and for a prefill with fewer
    token-expert pairs than a block)."""

    def forward(self, hidden_states, expert_affinities, expert_index, seq_len, padding_mask=None,
                expert_affinities_masked_full=None):
        if not self.training and self.moe_expert_model_parallel_group.size() > 1:
            cfg = self.routed_experts_mlp_config
            few = hidden_states.shape[0] * cfg.top_k / cfg.num_experts < 1.0
            if few or (seq_len > 1 and hidden_states.shape[0] * cfg.top_k < self.blockwise_matmul_config.block_size):
                return self.forward_all_experts_EP(hidden_states, expert_affinities, expert_index)
        return super().forward(hidden_states, expert_affinities, expert_index, seq_len, padding_mask=padding_mask,
                               expert_affinities_masked_full=expert_affinities_masked_full)


def one_clamp_shift(moe: nn.Module) -> None:
    """Give the decode copy of a hybrid-sharded ``MoE`` (``mlp_op_tkg``) the prefill copy's clamp limits, in place.

    Targets NxD 0.18 (``modules/moe/expert_mlps_v2.py``: ``ExpertMLPsV2.initialize_mlp_op`` adds
    ``hidden_act_bias`` to the shared config's up-clamp limits on every call, so the second copy, built after the
    first, clamps at ``limit + 2`` where the preshard hook moved the up bias by 1). Both copies must clamp the same
    biased up projection at ``limit + hidden_act_bias``: the first copy's values."""
    experts = moe.expert_mlps
    tkg = getattr(experts, "mlp_op_tkg", None)
    if tkg is None:
        return
    for name in ("gate_clamp_upper_limit", "gate_clamp_lower_limit", "up_clamp_upper_limit", "up_clamp_lower_limit"):
        setattr(tkg, name, getattr(experts.mlp_op, name))


def dispatch_ep_at_any_batch(moe: nn.Module) -> None:
    """Make the ``MoE``'s expert MLPs :class:`M3ExpertMLPs`, in place.

    Targets NxDI 0.9 (``modules/moe_v2.py``: ``initialize_moe_module`` constructs ``ExpertMLPsV2`` itself, with its
    process groups, and takes no class for it) and the NxD 0.18 dispatch :class:`M3ExpertMLPs` works around. The
    subclass adds only a dispatch rule, so the instance's class is changed after construction: its parameters,
    process groups and preshard hooks stay NxD's own."""
    moe.expert_mlps.__class__ = M3ExpertMLPs


# ---- the traced model ------------------------------------------------------------------------------------------


def is_context_encoding(model, input_ids: torch.Tensor) -> bool:
    """Whether NxDI's ``NeuronBaseModel.forward`` treats this call as context encoding.

    Targets NxDI 0.9 (``models/model_base.py``: ``NeuronBaseModel._is_context_encoding``, private: more than one
    token and not the speculation length)."""
    return model._is_context_encoding(input_ids)


class OnDeviceSamplingHook:
    """Mixin for a ``NeuronBaseModel`` subclass: NxDI's on-device sampling step through the model's public
    ``sample_on_device(logits, sampling_params, is_for_context_encoding)``, which returns the ``[B]`` int32 token
    ids (``[B, k + 1]`` in a speculative verify step) or None for NxDI's own step.

    Targets NxDI 0.9 (``models/model_base.py``: ``NeuronBaseModel._sample_on_device``, private, the only place
    ``forward`` samples): it hands the sampler ``logits[:, -1, :]`` and the rank only, so a sampler cannot learn each
    row's position, and an all-position prefill's last column is a padding slot."""

    def _sample_on_device(self, logits, sampling_params, is_for_speculation, is_for_context_encoding):
        tokens = self.sample_on_device(logits, sampling_params, is_for_context_encoding)
        if tokens is not None:
            return tokens
        return super()._sample_on_device(logits, sampling_params, is_for_speculation, is_for_context_encoding)


def sampler_global_top_k(sampler, logits: torch.Tensor, dim: int, rank_id):
    """The top ``sampler.global_topk`` logits (descending) of the whole vocabulary and their vocabulary ids: on
    device through NxDI's own candidate search with no per-row top-k mask; in CPU mode ``torch.topk`` of the
    gathered logits.

    Targets NxDI 0.9 (``modules/generation/sampling.py``: ``Sampler._top_k_masked``, private: on device ``nxd_topk``
    over the vocabulary shards with NxDI's stage and kernel choice, then a mask at each row's ``top_k``, which a
    ``top_k`` of ``global_topk`` leaves empty; in CPU mode it takes ``torch.topk`` of this rank's vocabulary shard
    alone, so with TP > 1 the shards are gathered first, over gloo)."""
    if sampler.neuron_config.on_cpu:
        from neuronx_distributed.parallel_layers import parallel_state
        from neuronx_distributed.parallel_layers.mappings import gather_from_tensor_model_parallel_region

        if parallel_state.get_tensor_model_parallel_size() > 1:  # CPU mode: vocab-sharded logits, gloo
            logits = gather_from_tensor_model_parallel_region(logits)
        k = min(sampler.global_topk, logits.shape[dim]) if sampler.global_topk > 0 else logits.shape[dim]
        return torch.topk(logits, k, dim=dim)
    no_mask = torch.full((logits.shape[0], 1), max(sampler.global_topk, 1), device=logits.device)
    return sampler._top_k_masked(logits, no_mask, dim, rank_id)


# ---- the application -------------------------------------------------------------------------------------------


# NxDI's forward arguments in order (positional calls are bound to their names before the chunk loop slices them)
_FORWARD_ARGS = tuple(inspect.signature(NeuronBaseForCausalLM.forward).parameters)[1:]


def forward_kwargs(args: tuple) -> dict:
    """The application ``forward``'s positional ``args`` by their names (the chunk loop slices its inputs by name).

    Targets NxDI 0.9 (``models/model_base.py``: ``NeuronBaseForCausalLM.forward``, whose parameter order is read
    from its signature once, at import: ``input_ids, seq_ids, attention_mask, position_ids, past_key_values, ...``)."""
    return dict(zip(_FORWARD_ARGS, args))


def infer_attention_mask(app, position_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask NxDI infers for a call without one (vllm-neuron passes none): ``position_ids >= column``
    style, from the positions; a one-token prompt's is ``[B, 1]`` of ones (NxDI's is ``[B, 0]``, which its fused
    speculation reads as a prompt of length 0).

    Targets NxDI 0.9 (``models/model_base.py``: ``NeuronBaseForCausalLM._infer_attention_mask``, private, which its
    ``forward`` calls when ``attention_mask`` is None); the chunk loop slices it per call."""
    mask = app._infer_attention_mask(position_ids)
    return torch.ones_like(position_ids) if mask.shape[-1] == 0 else mask


class SpeculationOutputs:
    """Mixin for the application (``NeuronBaseForCausalLM``): the outputs of a build with the speculation graph
    (``speculation_length > 0``: context encoding + speculation, no one-token graph) and of a traced model that
    appends the draft's target states after its caches (``aux_states``).

    Targets NxDI 0.9 (``models/model_base.py``: ``NeuronBaseForCausalLM._copy_past_key_values`` and
    ``_get_constructed_outputs``, private). In CPU mode NxDI copies every output after the first back into
    ``token_generation_model``'s and ``context_encoding_model``'s caches: the first does not exist in a speculation
    build and a trailing state output is not a cache. Here the caches go to every submodel's cache manager and the
    states to the output's ``aux_states``; on device NxDI keeps the aliased caches and returns the rest."""

    FUSED_OUTPUTS = 4  # NxDI's fused model: accepted tokens, next input ids, next attention mask, next positions

    def _copy_past_key_values(self, outputs):
        if self.neuron_config.enable_fused_speculation:
            return self._copy_fused_states(outputs[self.FUSED_OUTPUTS:])
        first = 1 + (1 if self.neuron_config.output_logits and self.neuron_config.on_device_sampling_config else 0)
        if self.neuron_config.tensor_capture_config:
            first += self.neuron_config.tensor_capture_config.get_offset()
        caches = outputs[first:len(outputs) - (1 if self.config.aux_hidden_layers else 0)]
        for wrapper in self.models:
            for i, cache in enumerate(caches):
                wrapper.model.kv_mgr.past_key_values[i].data = cache

    def _copy_fused_states(self, states):
        """CPU mode, fused speculation: the draft's caches, the target's, then the rolling buffer of target states
        (NxDI's order after its four outputs), into every submodel. NxDI's own copy reads attributes its model
        wrappers do not have in CPU mode (NxDI 0.9 ``_copy_past_key_values``)."""
        for wrapper in self.models:
            m = wrapper.model
            draft, target = m.draft_model.kv_mgr.past_key_values, m.target_model.kv_mgr.past_key_values
            if len(states) != len(draft) + len(target) + 1:
                raise RuntimeError(f"fused speculation returned {len(states)} states, expected {len(draft)} draft "
                                   f"caches + {len(target)} target caches + the rolling buffer")
            for param, value in zip([*draft, *target, m.hidden_state_rolling_buffer.hidden_states], states):
                param.data = value

    def forward(self, *args, **kwargs):
        self._call_seq_ids = kwargs.get("seq_ids")  # the rows of a call NxDI pads to the compiled batch (below)
        return super().forward(*args, **kwargs)

    def _get_constructed_outputs(self, outputs, is_run_on_neuron):
        if self.neuron_config.enable_fused_speculation and not is_run_on_neuron:
            # as on device (the states stay aliased there): fused_outputs = NxDI's four outputs, each of the call's
            # rows (NxDI's CPU path selects them in the first output only when it padded the batch)
            fused = list(outputs[:self.FUSED_OUTPUTS])
            rows = fused[0].shape[0]
            if any(o.shape[0] != rows for o in fused):
                seq_ids = self._call_seq_ids.reshape(-1).to(torch.long)
                fused = [o if o.shape[0] == rows else torch.index_select(o, 0, seq_ids) for o in fused]
            return self._construct_output(fused)
        aux = None
        if self.config.aux_hidden_layers:  # on device: [tokens or logits, states] (the caches stay aliased)
            outputs, aux = list(outputs[:-1]), outputs[-1]
            if is_run_on_neuron and len(outputs) == 1:
                outputs = outputs[0]
        out = super()._get_constructed_outputs(outputs, is_run_on_neuron)
        out.aux_states = aux
        return out
