"""NxD / NxDI adaptations that run in NxDI's CPU mode only (the ``neuron-cpu`` backend: ``to_cpu()`` instead of
compiled NEFFs): loading the application (:func:`to_cpu`: into a process group that already exists, with a speculation
graph, with fused speculation's draft process group, its prefill positions and its state sink) and an EAGLE draft's
greedy token without NxD's device argmax (:func:`cpu_argmax`).

Targets Neuron SDK 2.29: NxDI 0.9 (4bcdc54; ``models/application_base.py``, ``models/model_wrapper.py``,
``models/model_base.py``) and NxD 0.18 (``parallel_layers/mappings.py``); each function names the upstream code it
works around. Copying a CPU-mode call's caches back is :class:`~.forward.SpeculationOutputs`' part (a method NxDI
calls on the application).
"""

from __future__ import annotations

import os
from contextlib import ExitStack

import torch

from .forward import SpeculationOutputs


def to_cpu(app) -> None:
    """``app.to_cpu()``, joining a process group that already exists in this process.

    Targets NxDI 0.9 (``models/application_base.py``: ``NeuronApplicationBase.to_cpu``, SDK 2.29).
    Under torchrun NxDI's ``to_cpu`` calls ``init_process_group("gloo")`` unconditionally, which fails when
    another engine (e.g. the reference golden in the same pytest) already joined; hiding ``WORLD_SIZE`` for the
    call makes NxDI reuse the existing group after we check that it has the size NxDI would have asserted."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and "WORLD_SIZE" in os.environ):
        _to_cpu(app)
        return
    want = app.neuron_config.world_size
    if dist.get_world_size() != want or dist.get_backend() != "gloo":
        raise RuntimeError(f"existing process group ({dist.get_backend()}, world {dist.get_world_size()}) cannot "
                           f"host NxDI's CPU mode (gloo, world {want})")
    world = os.environ.pop("WORLD_SIZE")
    try:
        _to_cpu(app)
    finally:
        os.environ["WORLD_SIZE"] = world


def _to_cpu(app) -> None:
    """NxDI's ``to_cpu`` refuses any ``speculation_length`` ("not yet supported for CPU inference") before it builds
    anything; the flag is read there only (the submodels were built with their own configs in ``__init__``), so a
    build with the speculation graph is loaded with it hidden for the call. Copying the caches back after a call is
    :class:`SpeculationOutputs`' part."""
    from unittest import mock

    from neuronx_distributed_inference.models import application_base

    spec = app.neuron_config.speculation_length
    app.neuron_config.speculation_length = 0
    with ExitStack() as stack:
        fused = getattr(app.config, "fused_spec_config", None) if app.neuron_config.enable_fused_speculation else None
        if fused is not None:
            # on device NxD builds the draft's process group (application_base.init_custom_process_group_fn, given
            # to NxD's ModelBuilder); CPU mode builds the models right after initialize_model_parallel: add it there
            init = application_base.initialize_model_parallel

            def init_with_draft_group(*args, **kwargs):
                init(*args, **kwargs)
                application_base.init_custom_process_group_fn(app.config)

            stack.enter_context(mock.patch.object(application_base, "initialize_model_parallel", init_with_draft_group))
        if app.neuron_config.hybrid_sharding_config is not None:  # --decode-experts tp: NxD's MoE groups on gloo
            init_model_parallel = application_base.initialize_model_parallel

            def init_with_moe_groups(*args, **kwargs):
                init_model_parallel(*args, **kwargs)
                _gloo_moe_groups(app.neuron_config.hybrid_sharding_config)

            stack.enter_context(mock.patch.object(application_base, "initialize_model_parallel",
                                                  init_with_moe_groups))
        try:
            app.to_cpu()
        finally:
            app.neuron_config.speculation_length = spec
    if fused is not None:
        # on device each context-encoding bucket is traced with n_positions = the bucket (ModelWrapper.get); CPU mode
        # runs one module whose n_positions is the cache length, and NxDI's draft builds its prefill mask from it
        app.context_encoding_model.model.register_forward_pre_hook(_prefill_positions)
        for wrapper in app.models:
            wrapper.model.kv_mgr = _FusedStateSink(wrapper.model)


def _gloo_moe_groups(h) -> None:
    """NxD's four hybrid-sharding MoE process groups (decode and prefill, tensor- and expert-parallel) as gloo groups
    this rank belongs to.

    Targets NxD 0.18 (``modules/moe/moe_process_group.py``: ``init_tensor_expert_parallel_moe_process_groups``, which
    NxDI's ``initialize_moe_module`` calls). It builds each group as ``new_group(mesh[0], pg_options={"xla_pg_options":
    {"mesh": mesh}})``, an XLA SPMD mesh; under gloo that is the first group only, and any rank outside it gets
    torch's non-member marker (an ``int``), which the expert MLPs then call ``.size()`` on. It builds nothing when
    its globals are set, so they are set here first: every rank creates every group of each mesh (torch requires all
    ranks in each ``new_group``) and keeps its own."""
    from neuronx_distributed.modules.moe import moe_process_group as mpg
    from neuronx_distributed.parallel_layers.parallel_state import initialize_model_parallel

    dist = torch.distributed
    rank = dist.get_rank() if dist.is_initialized() else 0

    def own(meshes):
        mine = None
        for ranks in meshes:
            group = dist.new_group(ranks, backend="gloo")
            mine = group if rank in ranks else mine
        return mine

    def meshes(tp, ep):
        groups = initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep,
                                           mesh_only=True, lnc_size=1)
        return groups.tp_groups, groups.ep_model_groups

    tkg_tp, tkg_ep = meshes(h.moe_tkg_tp_degree, h.moe_tkg_ep_degree)
    cte_tp, cte_ep = meshes(h.moe_cte_tp_degree, h.moe_cte_ep_degree)
    mpg._MOE_TKG_TENSOR_MODEL_PARALLEL_GROUP = own(tkg_tp)
    mpg._MOE_TKG_EXPERT_MODEL_PARALLEL_GROUP = own(tkg_ep)
    mpg._MOE_CTE_TENSOR_MODEL_PARALLEL_GROUP = own(cte_tp)
    mpg._MOE_CTE_EXPERT_MODEL_PARALLEL_GROUP = own(cte_ep)


class _FusedStateSink:
    """CPU mode, fused speculation: where NxDI's ModelWrapper writes the states of a call it padded to the compiled
    batch (NxDI 0.9 ``models/model_wrapper.py`` ``ModelWrapper.forward``: ``logits, *kv_caches = outputs`` then
    ``self.model.kv_mgr.past_key_values[i].data = ...``; a fused model has no cache manager): the three fused outputs
    after the first are dropped, then the draft's caches, the target's and the rolling buffer
    (:meth:`SpeculationOutputs._copy_fused_states`' order)."""

    def __init__(self, model):
        from types import SimpleNamespace

        self.past_key_values = [SimpleNamespace(data=None) for _ in range(SpeculationOutputs.FUSED_OUTPUTS - 1)] + [
            *model.draft_model.kv_mgr.past_key_values, *model.target_model.kv_mgr.past_key_values,
            model.hidden_state_rolling_buffer.hidden_states]


def _prefill_positions(module, args):
    module.n_positions = args[0].shape[-1]  # the padded input_ids: the bucket


def cpu_argmax(logits: torch.Tensor, group) -> torch.Tensor:
    """``[B, S]`` int32: the argmax over the vocabulary of logits sharded over ``group`` (vocabulary-parallel, as
    an LM head without gather_output leaves them), in CPU mode.

    Targets NxDI 0.9 (``models/model_base.py``: ``NeuronBaseModel._sample_on_device``): an EAGLE draft's greedy token
    is NxD's distributed ``argmax`` operator, a device kernel; CPU mode gathers the shards over gloo instead."""
    if group is not None and torch.distributed.get_world_size(group) > 1:
        from neuronx_distributed.parallel_layers.mappings import _gather_along_dim

        logits = _gather_along_dim(logits, partition_dim=2, process_group=group)
    return torch.argmax(logits, dim=2).to(torch.int32)
