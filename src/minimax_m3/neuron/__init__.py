"""The NxD Inference (Neuron) backend of MiniMax-M3. The only package that imports the Neuron SDK.

Importing this package needs nothing beyond torch: the NxDI classes are loaded on first use
(``minimax_m3.neuron.NeuronMiniMaxM3ForCausalLM`` etc.), and without the SDK that first use raises one
:class:`NeuronUnavailableError` that says what to install.
"""

from __future__ import annotations

import importlib

from ..errors import M3Error

INSTALL_HINT = (
    "the neuron backend needs the AWS Neuron SDK 2.29 Python packages: neuronx-distributed-inference 0.9 "
    "(NxDI), neuronx-distributed 0.18 (NxD) and torch-neuronx 2.9 with neuronx-cc, installed from the Neuron "
    "pip repository (https://pip.repos.neuron.amazonaws.com) on a Trainium/Inferentia host, e.g. "
    "`pip install --extra-index-url https://pip.repos.neuron.amazonaws.com neuronx-distributed-inference`; "
    "to run NxDI's CPU mode off-device see the README section 'NxDI CPU mode'"
)

_EXPORTS = {
    "MiniMaxM3NeuronConfig": "config", "MiniMaxM3InferenceConfig": "config", "load_m3_config": "config",
    "NeuronMiniMaxM3Attention": "attention", "M3Router": "moe", "M3ExpertMLPs": "moe",
    "initialize_m3_moe_module": "moe", "M3KVCacheManager": "kv_cache", "NeuronMiniMaxM3Model": "model",
    "NeuronMiniMaxM3ForCausalLM": "model", "NeuronMiniMaxM3DecoderLayer": "model",
    "NeuronEngine": "engine", "build_neuron_config": "engine",
}


class NeuronUnavailableError(M3Error, ImportError):
    """The Neuron SDK (NxDI/NxD) is not importable here."""


def sdk_available() -> bool:
    try:
        importlib.import_module("neuronx_distributed_inference.models.config")
        return True
    except Exception:
        return False


def _import(module: str):
    try:
        return importlib.import_module(f"{__name__}.{module}")
    except ImportError as exc:
        missing = getattr(exc, "name", "") or ""
        if missing.split(".")[0] in ("neuronx_distributed_inference", "neuronx_distributed", "torch_neuronx",
                                     "neuronxcc", "nki", "nkilib", "libneuronxla", "torch_xla"):
            raise NeuronUnavailableError(f"{INSTALL_HINT} (missing module: {missing})") from exc
        raise


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(_import(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_neuron_engine(spec):
    """The :class:`minimax_m3.engine.Engine` of an :class:`minimax_m3.spec.EngineSpec` over NxDI: compiled NEFFs
    (``neuron``, at ``spec.artifact_dir()``) or NxDI's CPU mode (``neuron-cpu``, ``to_cpu()``)."""
    engine = _import("engine")  # without the SDK: one NeuronUnavailableError saying what to install
    from ..config import M3Config

    return engine.load(spec.validate(M3Config.from_pretrained(spec.model)))


__all__ = ["INSTALL_HINT", "NeuronUnavailableError", "load_neuron_engine", "sdk_available", *_EXPORTS]
