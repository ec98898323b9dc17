"""Every adaptation of NxD / NxDI that the port needs beyond their hooks, in one package with one import surface.

Callers write ``from . import nxd_compat`` and ``nxd_compat.X`` (or ``from .nxd_compat import X``); every public name
of the modules below is re-exported here. The modules split the adaptations by when their code runs:

* ``forward``: in the model and the application: while NxDI builds the model (the MoE's router and expert MLPs),
  inside its forward (the KV group's collectives, the expert dispatch, the sampling hook, the sampler's candidate
  search) and around each call of the application (the inferred attention mask, a speculation build's outputs);
* ``cpu_mode``: in NxDI's CPU mode only (``to_cpu`` and fused speculation's CPU-mode state sink, the draft's argmax
  without NxD's device kernel);
* ``compile_time``: while NxDI compiles the application (NxD's compiler work directory, the dry run's command
  files, the sampling parameters of the example inputs NxD traces each bucket with);
* ``weights``: when the weights are read (NxDI's checkpoint loader, a fused build's state dict) or pre-sharded
  (NxD's sharding context and steps, for ``neuron/sharded.py``).

Each entry names the SDK version it targets (Neuron SDK 2.29: NxDI 0.9 at 4bcdc54, NxD 0.18 "Release 2.29") and the
upstream file and function whose behaviour it works around, so a newer SDK is checked here first. The model files
(``model.py``, ``chunk_loop.py``, ``attention.py``, ``moe.py``, ``kv_cache.py``, ``layers.py``, ``sampling.py``,
``eagle.py``) override NxDI's hooks only, as NxDI's in-tree ``qwen3_moe`` and ``gpt_oss`` do, and call these by
name; ``test/unit/test_port_hooks.py`` keeps them that way (no ``__class__`` assignment, no environment variables, no
private NxD/NxDI attribute).

Importing the package imports NxD (``forward``'s module-level imports). ``sharded.py`` and ``trace.py``, which
import without the SDK, import it inside their functions. The vllm-neuron 0.4.1 adaptations live in
``neuron/vllm/defaults.py`` (the vLLM plugin imports without NxDI).
"""

from __future__ import annotations

from .compile_time import SAMPLING_PARAMS_INPUT, compiler_workdir, map_example_sampling_params, own_commands
from .cpu_mode import cpu_argmax, to_cpu
from .forward import (KVGroupOps, M3ExpertMLPs, OnDeviceSamplingHook, SpeculationOutputs, dispatch_ep_at_any_batch,
                      infer_attention_mask, is_context_encoding, kv_group, replace_router, sampler_global_top_k)
from .weights import (checkpoint_path, fused_state_dict, layout_transformation_requested, nxd_sharding_model,
                      shard_part, with_fused_prefix)

__all__ = [
    "KVGroupOps", "M3ExpertMLPs", "OnDeviceSamplingHook", "SAMPLING_PARAMS_INPUT", "SpeculationOutputs",
    "checkpoint_path", "compiler_workdir", "cpu_argmax", "dispatch_ep_at_any_batch", "fused_state_dict",
    "infer_attention_mask", "is_context_encoding", "kv_group", "layout_transformation_requested",
    "map_example_sampling_params", "nxd_sharding_model", "own_commands", "replace_router", "sampler_global_top_k",
    "shard_part", "to_cpu", "with_fused_prefix",
]
