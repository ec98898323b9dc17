"""Every adaptation of NxD / NxDI that the port needs beyond their hooks, in one place.

Each entry names the SDK version it targets (Neuron SDK 2.29: NxDI 0.9 at 4bcdc54, NxD 0.18 "Release 2.29") and
the upstream file and function whose behaviour it works around, so a newer SDK is checked here first. The model files
(``model.py``, ``chunk_loop.py``, ``attention.py``, ``moe.py``, ``kv_cache.py``, ``layers.py``, ``sampling.py``,
``eagle.py``) override NxDI's hooks only, as NxDI's in-tree ``qwen3_moe`` and ``gpt_oss`` do, and call these by
name; ``test/unit/test_port_hooks.py`` keeps them that way (no ``__class__`` assignment, no environment variables, no
private NxD/NxDI attribute).

Needs NxD (module-level imports). ``sharded.py`` and ``trace.py``, which import without the SDK, import it inside
their functions. The vllm-neuron 0.4.1 adaptations live in ``neuron/vllm/defaults.py`` (the vLLM plugin imports
without NxDI).
"""

from __future__ import annotations

import os
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from neuronx_distributed.modules.moe.expert_mlps_v2 import ExpertMLPsV2
from torch import nn

from .._atomic import write_atomic

# ---- CPU mode -------------------------------------------------------------------------------------------------


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


# ---- the KV group (sequence-sharded caches) ----------------------------------------------------------------------


def kv_group(size: int):
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
        self.size, self.group = size, kv_group(size)

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


def infer_attention_mask(app, position_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask NxDI infers for a call without one (vllm-neuron passes none): ``position_ids >= column``
    style, from the positions; a one-token prompt's is ``[B, 1]`` of ones (NxDI's is ``[B, 0]``, which its fused
    speculation reads as a prompt of length 0).

    Targets NxDI 0.9 (``models/model_base.py``: ``NeuronBaseForCausalLM._infer_attention_mask``, private, which its
    ``forward`` calls when ``attention_mask`` is None); the chunk loop slices it per call."""
    mask = app._infer_attention_mask(position_ids)
    return torch.ones_like(position_ids) if mask.shape[-1] == 0 else mask


# ---- MoE ------------------------------------------------------------------------------------------------------


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


def dispatch_ep_at_any_batch(moe: nn.Module) -> None:
    """Make the ``MoE``'s expert MLPs :class:`M3ExpertMLPs`, in place.

    Targets NxDI 0.9 (``modules/moe_v2.py``: ``initialize_moe_module`` constructs ``ExpertMLPsV2`` itself, with its
    process groups, and takes no class for it) and the NxD 0.18 dispatch :class:`M3ExpertMLPs` works around. The
    subclass adds only a dispatch rule, so the instance's class is changed after construction: its parameters,
    process groups and preshard hooks stay NxD's own."""
    moe.expert_mlps.__class__ = M3ExpertMLPs


# ---- the traced model and the application ---------------------------------------------------------------------


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


def cpu_argmax(logits: torch.Tensor, group) -> torch.Tensor:
    """``[B, S]`` int32: the argmax over the vocabulary of logits sharded over ``group`` (vocabulary-parallel, as
    an LM head without gather_output leaves them), in CPU mode.

    Targets NxDI 0.9 (``models/model_base.py``: ``NeuronBaseModel._sample_on_device``): an EAGLE draft's greedy token
    is NxD's distributed ``argmax`` operator, a device kernel; CPU mode gathers the shards over gloo instead."""
    if group is not None and torch.distributed.get_world_size(group) > 1:
        from neuronx_distributed.parallel_layers.mappings import _gather_along_dim

        logits = _gather_along_dim(logits, partition_dim=2, process_group=group)
    return torch.argmax(logits, dim=2).to(torch.int32)


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


SAMPLING_PARAMS_INPUT = 4  # the position of sampling_params in NeuronBaseModel.forward's inputs


def map_example_sampling_params(inputs, fn) -> tuple:
    """One bucket's example inputs with ``fn`` applied to their ``sampling_params``.

    Targets NxDI 0.9 (``models/model_wrapper.py``: ``ModelWrapper.input_generator`` returns each bucket's example
    inputs as a positional tuple in ``NeuronBaseModel.forward``'s order: ``input_ids, attention_mask,
    position_ids, seq_ids, sampling_params, ...``; the traced graph takes the shapes it is given)."""
    inputs = list(inputs)
    inputs[SAMPLING_PARAMS_INPUT] = fn(inputs[SAMPLING_PARAMS_INPUT])
    return tuple(inputs)


def checkpoint_path(app) -> str:
    """The checkpoint path NxDI's loader reads: the config's ``_name_or_path``, else the application's model path.

    Targets NxDI 0.9 (``models/application_base.py``: ``NeuronApplicationBase.checkpoint_loader_fn`` reads the
    HF-style private ``_name_or_path`` that ``load_pretrained_config`` sets)."""
    return getattr(app.config, "_name_or_path", None) or app.model_path


def layout_transformation_requested() -> bool:
    """Whether NxD's weight-layout transformation is asked for, which NxDI's own ``shard_weights`` then runs.

    Targets NxDI 0.9 (``models/application_base.py``: ``NeuronApplicationBase.shard_weights`` transforms the
    sharded weights when ``NXD_LAYOUT_TRANSFORMATION_OPTIONS`` is in the environment; the port then leaves sharding
    to NxDI)."""
    return bool(os.environ.get("NXD_LAYOUT_TRANSFORMATION_OPTIONS"))


# ---- compile and the dry run ----------------------------------------------------------------------------------


@contextmanager
def compiler_workdir(path: str | Path):
    """NxD's compiler work directory set to ``path`` for the ``with`` block (the environment restored after).

    Targets NxDI 0.9 (``models/application_base.py``: ``NeuronApplicationBase.get_builder``, and
    ``models/model_wrapper.py``: ``ModelWrapper.__init__``), which read it from ``BASE_COMPILE_WORK_DIR`` only
    (default ``/tmp/nxd_model/``), with no argument."""
    old = os.environ.get("BASE_COMPILE_WORK_DIR")
    os.environ["BASE_COMPILE_WORK_DIR"] = str(path) + "/"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("BASE_COMPILE_WORK_DIR", None)
        else:
            os.environ["BASE_COMPILE_WORK_DIR"] = old


def own_commands(builder) -> int:
    """Rewrite each non-priority bucket's ``command.txt`` with its own submodel's compiler arguments; returns how
    many were rewritten.

    Targets NxD 0.18 (``trace/model_builder.py``: ``ModelBuilder.compile`` with ``dry_run=True``): the dry run writes
    them with the *priority* model's arguments, a variable left over from its priority compile (``:699`` passes
    ``compiler_args`` from ``:642-645``), while a real compile uses each submodel's own (``:720-722``: its
    ``compiler_args`` plus ``--logfile`` in its work directory). A command that does not contain the leaked
    arguments is left as NxD wrote it."""
    from neuronx_distributed.trace.model_builder import LOG_FILE_DEFAULT_NAME as LOG

    def workdir(key, i):
        return Path(builder.compiler_workdir, key, f"_tp0_bk{i}").absolute()

    prio = [(k, a) for k, a in builder.model_collection.items() if a.priority_model_idx is not None]
    if not prio:
        return 0
    key, art = prio[0]
    log = workdir(key, art.priority_model_idx) / LOG
    leaked_t, n = f"{art.compiler_args} --logfile={log} --enable-internal-neff-wrapper".split(), 0
    for key, art in builder.model_collection.items():
        for i in range(len(art.hlo_artifact_collection)):
            path = workdir(key, i) / "command.txt"
            if i == art.priority_model_idx or not path.is_file():
                continue
            tokens = path.read_text().split()
            at = next((j for j in range(len(tokens)) if tokens[j:j + len(leaked_t)] == leaked_t), None)
            if at is None:
                continue
            own = f"{art.compiler_args} --logfile={workdir(key, i) / LOG}".split()
            write_atomic(path, (" ".join(tokens[:at] + own + tokens[at + len(leaked_t):]) + "\n").encode())
            n += 1
    return n


# ---- pre-sharding ---------------------------------------------------------------------------------------------


class nxd_sharding_model:
    """The context of NxD's ``ModelBuilder.shard_checkpoint``: ``mock_distributed(world)``, the meta device, NxD's
    model-parallel state, the builder's first submodel built at bucket 0. ``with nxd_sharding_model(builder) as
    model``.

    Targets NxD 0.18 (``trace/model_builder.py``: ``ModelBuilder.shard_checkpoint``, whose set-up is not a function
    of its own: it loads the whole state dict inside it, which ``neuron.sharded`` replaces by one unit at a time)."""

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
