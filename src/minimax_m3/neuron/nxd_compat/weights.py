"""NxD / NxDI adaptations that run when the weights are read: NxDI's checkpoint loader (the application's
``checkpoint_loader_fn``: CPU mode, a device load without pre-sharded files, a fused-speculation build's draft and
target) and pre-sharding at compile time (the application's ``shard_weights`` and ``neuron/rank_files.py``, which writes
NxD's rank files one unit of the state dict at a time).

Targets Neuron SDK 2.29: NxDI 0.9 (4bcdc54; ``models/application_base.py``) and NxD 0.18 (``trace/model_builder.py``,
``trace/trace.py``); each function and class names the upstream code it works around. ``neuron/rank_files.py`` (which
imports without the SDK) imports them inside its functions.
"""

from __future__ import annotations

import os
from contextlib import ExitStack

import torch
from torch import nn


def checkpoint_path(app) -> str:
    """The checkpoint path NxDI's loader reads: the config's ``_name_or_path``, else the application's model path.

    Targets NxDI 0.9 (``models/application_base.py``: ``NeuronApplicationBase.checkpoint_loader_fn`` reads the
    HF-style private ``_name_or_path`` that ``load_pretrained_config`` sets)."""
    return getattr(app.config, "_name_or_path", None) or app.model_path


def fused_state_dict(fused, target: dict) -> dict:
    """A fused-speculation build's state dict: the draft's (its class's ``get_state_dict`` over the draft path) under
    ``draft_model.``, the target's ``target`` under ``target_model.``.

    Targets NxDI 0.9 (``models/application_base.py``: ``checkpoint_loader_fn`` sets the draft class's
    ``_FUSED_PREFIX`` to ``draft_model`` and calls its ``get_state_dict``, which adds it; the port's own loader keeps
    the target's float32 keys, so it composes the two here the same way)."""
    cls = fused.draft_model_cls
    cls._FUSED_PREFIX = "draft_model"
    return {**cls.get_state_dict(fused.draft_model_path, fused.draft_config),
            **{f"target_model.{k}": v for k, v in target.items()}}


def with_fused_prefix(cls, sd: dict) -> dict:
    """``sd`` under ``cls._FUSED_PREFIX`` when NxDI's fused loader set one, for a class that overrides
    ``get_state_dict``.

    Targets NxDI 0.9 (``models/application_base.py``: ``NeuronApplicationBase.get_state_dict`` adds the prefix as
    its last step)."""
    prefix = getattr(cls, "_FUSED_PREFIX", "")
    return {f"{prefix}.{k}": v for k, v in sd.items()} if prefix else sd


def layout_transformation_requested() -> bool:
    """Whether NxD's weight-layout transformation is asked for, which NxDI's own ``shard_weights`` then runs.

    Targets NxDI 0.9 (``models/application_base.py``: ``NeuronApplicationBase.shard_weights`` transforms the
    sharded weights when ``NXD_LAYOUT_TRANSFORMATION_OPTIONS`` is in the environment; the port then leaves sharding
    to NxDI)."""
    return bool(os.environ.get("NXD_LAYOUT_TRANSFORMATION_OPTIONS"))


# ---- pre-sharding ----------------------------------------------------------------------------------------------


class nxd_sharding_model:
    """The context of NxD's ``ModelBuilder.shard_checkpoint``: ``mock_distributed(world)``, the meta device, NxD's
    model-parallel state, the builder's first submodel built at bucket 0. ``with nxd_sharding_model(builder) as
    model``.

    Targets NxD 0.18 (``trace/model_builder.py``: ``ModelBuilder.shard_checkpoint``, whose set-up is not a function
    of its own: it loads the whole state dict inside it, which ``neuron.rank_files`` replaces by one unit at a time)."""

    def __init__(self, builder):
        self.builder = builder
        self.stack = None

    def __enter__(self):
        from neuronx_distributed.parallel_layers import parallel_state
        from neuronx_distributed.trace.mock_torchdist import mock_distributed
        from neuronx_distributed.utils.model_utils import init_on_device

        b = self.builder
        self.stack = ExitStack()
        self.stack.enter_context(mock_distributed(world_size=b.world_size))
        self.stack.enter_context(init_on_device(torch.device("meta"), force_custom_init_on_device=True))
        torch.distributed.init_process_group(backend="xla", rank=0, world_size=b.world_size)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=b.tp_degree,
                                                 pipeline_model_parallel_size=b.pp_degree,
                                                 expert_model_parallel_size=b.ep_degree,
                                                 skip_collective_init=True, lnc_size=b.logical_nc_config)
        if b.init_custom_process_group_fn:
            b.init_custom_process_group_fn()
        container = b.model_collection[list(b.model_collection)[0]]
        container.model_instance.load_module()
        kwargs = {} if container.bucket_config is None else container.bucket_config.get_func_kwargs_for_bucket_rank(0)
        kwargs.pop("bucket_rank", None)
        model, _ = container.model_instance.get(0, **kwargs)
        return model

    def __exit__(self, *exc):
        from neuronx_distributed.parallel_layers import parallel_state

        try:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
        finally:
            self.stack.close()
        return False


def shard_part(builder, module: nn.Module, part: dict, ranks):
    """``(rank, sharded)`` for each of ``ranks``: NxD's sharding of the state dict ``part`` for ``module`` (which
    holds the submodules ``part`` names), inside :class:`nxd_sharding_model`. ``part`` is preprocessed and cast in
    place.

    Targets NxD 0.18 (``trace/model_builder.py``: ``ModelBuilder.shard_checkpoint`` then
    ``shard_weights_with_cache``): ``preprocess_checkpoint`` (duplicate check, preshard hooks, removal of keys the
    model lacks), ``cast_weights``, then ``get_sharded_checkpoint(..., is_cached=True)`` on a copy per rank, the
    same calls on a part of the state dict instead of all of it."""
    from neuronx_distributed.trace.trace import get_sharded_checkpoint, preprocess_checkpoint

    preprocess_checkpoint(module, part)
    builder.cast_weights(part, module, "")
    for rank in ranks:
        sharded = part.copy()
        get_sharded_checkpoint(sharded, module, rank, builder.tp_degree, is_cached=True)
        yield rank, sharded
        del sharded  # one rank's slices alive at a time (the caller drops its reference too)


def hybrid_expert_scales(pairs):
    """A quantized state-dict stream with each routed expert ``.scale`` also under the decode copy's name
    (``mlp_op_tkg``), for ``--decode-experts tp`` with fp8 experts.

    Targets NxD 0.18 (``modules/moe/expert_mlps_v2.py``: ``ExpertMLPsV2.preshard_hook`` copies ``mlp_op``'s
    ``gate_up_proj`` / ``down_proj`` weight and bias to ``mlp_op_tkg`` under hybrid sharding, but not a quantized
    layer's ``scale``, so the decode copy's scales would be missing from the checkpoint). The copy is a clone of the
    fp32 tensor (safetensors refuses shared storage); NxD shards it with the decode copy's layout."""
    for name, tensor in pairs:
        yield name, tensor
        if ".expert_mlps.mlp_op." in name and name.endswith(".scale"):
            yield name.replace(".expert_mlps.mlp_op.", ".expert_mlps.mlp_op_tkg."), tensor.clone()

