"""Test-only vLLM platform plugin: a model written to the vLLM Neuron 1.x contract, run under vLLM 0.24 on CPU.

``register`` (entry point ``vllm.platform_plugins: m3_vneuron_harness``) is active only with
``M3_VNEURON_HARNESS=1``; it returns :class:`.platform.HarnessPlatform` (vLLM's CpuPlatform with the worker of
:mod:`.worker` and the runner of :mod:`.runner`). It also registers every architecture of the contract registry
(:func:`.contract.model_registry`, ``M3_VNEURON_MODELS``) with vLLM's ``ModelRegistry`` (as a stub vLLM accepts,
:mod:`.stub`) so vLLM accepts the model path: from the platform's ``pre_register_and_update``, which vLLM calls
before it builds the ModelConfig (``engine/arg_utils.py``), the hook the plugin uses too (P@0). The runner builds
the contract model itself. vLLM calls platform plugins in every process it starts.
"""

from __future__ import annotations

import os


def register():
    if os.environ.get("M3_VNEURON_HARNESS") != "1":
        return None
    return "m3_vneuron_harness.platform.HarnessPlatform"
