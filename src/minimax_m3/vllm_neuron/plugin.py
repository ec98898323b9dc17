"""Registration of the vLLM Neuron model in every vLLM process (entry point ``vllm.general_plugins:
minimax_m3_vllm_neuron``; the plugin spawns workers, where an in-process registration would be lost).

vLLM Neuron finds out-of-tree models in vLLM's own ``ModelRegistry`` (the onboarding guide,
``Infinity-AI-Institute/vllm-neuron`` ``docs/model-dev/onboarding-models.md`` at ``9dc5208``, "2. Register the model
with vLLM"): :func:`register` adds MiniMax-M3's architectures there, lazily by name (:data:`FACTORY`), when vLLM
Neuron 1.x is installed — recognised by its ``vllm_neuron/model/kv_cache.py`` without importing it (vllm-neuron
0.4.x, the NxDI-based line, shares the package name and is served by ``minimax_m3.neuron.vllm.plugin``). Elsewhere it
does nothing: vLLM's own GPU MiniMax-M3 stays registered, and the off-device harness reads :func:`models` itself.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from pathlib import Path

from .contract import ARCHITECTURES

log = logging.getLogger(__name__)

FACTORY = "minimax_m3.vllm_neuron.model:MiniMaxM3ForCausalLM"
# the EAGLE3 draft, under the name the plugin's proposer looks up for this package's drafts (``Eagle3`` + the draft
# checkpoint's ``LlamaForCausalLMEagle3``: ``vllm_neuron/vllm/spec_decode/eagle.py`` at ed3580d)
DRAFT_ARCHITECTURE = "Eagle3LlamaForCausalLMEagle3"
DRAFT_FACTORY = "minimax_m3.vllm_neuron.eagle3:MiniMaxM3Eagle3Draft"


def _load(path: str) -> type:
    mod, name = path.split(":")
    return getattr(importlib.import_module(mod), name)


def models() -> dict[str, type]:
    """``{architecture: factory class}`` for every MiniMax-M3 architecture this model serves, and its EAGLE3
    draft's."""
    return {**dict.fromkeys(ARCHITECTURES, _load(FACTORY)), DRAFT_ARCHITECTURE: _load(DRAFT_FACTORY)}


def plugin_1x_installed() -> bool:
    """Whether the installed ``vllm_neuron`` is the 1.x line (its model contract), read from its files."""
    try:
        spec = importlib.util.find_spec("vllm_neuron")
    except (ImportError, ValueError):
        return False
    places = (spec.submodule_search_locations or ()) if spec else ()
    return any((Path(p) / "model" / "kv_cache.py").is_file() for p in places)


def register() -> None:
    """The entry point: MiniMax-M3's architectures → :data:`FACTORY` in vLLM's ``ModelRegistry`` under vLLM
    Neuron 1.x; nothing otherwise."""
    if not plugin_1x_installed():
        log.debug("minimax_m3: vLLM Neuron 1.x not installed; the vLLM Neuron model is not registered")
        return
    from vllm import ModelRegistry

    for arch in ARCHITECTURES:
        ModelRegistry.register_model(arch, FACTORY)
    ModelRegistry.register_model(DRAFT_ARCHITECTURE, DRAFT_FACTORY)
