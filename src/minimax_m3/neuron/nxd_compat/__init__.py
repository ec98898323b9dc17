"""The port's adaptations of NxD / NxDI beyond their hooks, and the table of every upstream private name the
``neuron`` package uses.

One import surface: callers write ``from . import nxd_compat`` and ``nxd_compat.X`` (or ``from .nxd_compat import
X``); every public name of the modules below is re-exported here. The modules split the adaptations by when their
code runs:

* ``forward``: in the model and the application: while NxDI builds the model (the MoE's router and expert MLPs),
  inside its forward (the KV group's collectives, the expert dispatch, the sampling hook, the sampler's candidate
  search) and around each call of the application (its positional arguments by name, the inferred attention mask,
  a speculation build's outputs);
* ``cpu_mode``: in NxDI's CPU mode only (``to_cpu`` and fused speculation's CPU-mode state sink, the draft's argmax
  without NxD's device kernel);
* ``compile_time``: while NxDI compiles the application (NxD's compiler work directory, the dry run's command
  files, the sampling parameters of the example inputs NxD traces each bucket with);
* ``weights``: when the weights are read (NxDI's checkpoint loader, a fused build's state dict) or pre-sharded
  (NxD's sharding context and steps, for ``neuron/rank_files.py``).

``privates`` runs nothing: it holds :data:`PRIVATES`, every private name of NxD / NxDI (and torch, transformers,
vllm-neuron) that a file under ``neuron/`` uses, with where upstream defines it, why, and the files that use it.

Each adaptation names the SDK version it targets (Neuron SDK 2.29: NxDI 0.9 at 4bcdc54, NxD 0.18 "Release 2.29") and
the upstream file and function whose behaviour it works around, so a newer SDK is checked here first. The model
files (``model.py``, ``chunk_loop.py``, ``attention.py``, ``moe.py``, ``kv_cache.py``, ``layers.py``,
``sampling.py``, ``eagle.py``) override NxDI's hooks only, as NxDI's in-tree ``qwen3_moe`` and ``gpt_oss`` do, and
call these by name. ``test/unit/test_port_hooks.py`` keeps them that way (no ``__class__`` assignment, no
environment variables, no positional index into ``*args``, no private name other than the port's own and the
``"hook"`` entries of :data:`PRIVATES` that list the file) and checks :data:`PRIVATES` against every file under
``neuron/`` both ways. The ``"internal"`` entries are used in this package, except ``_name_or_path``, which
``config.config_hook`` sets, and vllm-neuron's two loader functions, which ``neuron/vllm/defaults.py`` calls (the
home of the vllm-neuron 0.4.1 adaptations, a module of its own because the vLLM plugin imports it without NxDI).

Importing the package imports NxD and NxDI (``forward``'s module-level imports). ``sharded.py`` and ``trace.py``,
which import without the SDK, import it inside their functions.
"""

from __future__ import annotations

from .compile_time import SAMPLING_PARAMS_INPUT, compiler_workdir, map_example_sampling_params, own_commands
from .cpu_mode import cpu_argmax, to_cpu
from .forward import (KVGroupOps, M3ExpertMLPs, OnDeviceSamplingHook, SpeculationOutputs, dispatch_ep_at_any_batch,
                      forward_kwargs, infer_attention_mask, is_context_encoding, kv_process_group, one_clamp_shift,
                      replace_router, sampler_global_top_k)
from .privates import PRIVATES
from .weights import (checkpoint_path, fused_state_dict, hybrid_expert_scales, layout_transformation_requested,
                      nxd_sharding_model, shard_part, with_fused_prefix)

__all__ = [
    "KVGroupOps", "M3ExpertMLPs", "OnDeviceSamplingHook", "PRIVATES", "SAMPLING_PARAMS_INPUT", "SpeculationOutputs",
    "checkpoint_path", "compiler_workdir", "cpu_argmax", "dispatch_ep_at_any_batch", "forward_kwargs",
    "fused_state_dict", "hybrid_expert_scales", "infer_attention_mask", "is_context_encoding", "kv_process_group",
    "layout_transformation_requested", "map_example_sampling_params", "nxd_sharding_model", "one_clamp_shift",
    "own_commands",
    "replace_router", "sampler_global_top_k", "shard_part", "to_cpu", "with_fused_prefix",
]
