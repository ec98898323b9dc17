"""The NxD Inference (Neuron) backend of MiniMax-M3. The only package that imports the Neuron SDK.

Importing this package needs nothing beyond torch: the NxDI classes are loaded on first use
(``minimax_m3.neuron.NeuronMiniMaxM3ForCausalLM`` etc.), and without the SDK that first use raises one
:class:`NeuronUnavailableError` that says what to install.
"""

from __future__ import annotations

from ._sdk import INSTALL_HINT, NeuronUnavailableError, sdk_available
from ._sdk import import_neuron_module as _import

_EXPORTS = {
    "MiniMaxM3NeuronConfig": "config", "MiniMaxM3InferenceConfig": "config", "load_m3_config": "config",
    "NeuronMiniMaxM3Attention": "attention", "M3Router": "moe", "M3ExpertMLPs": "nxd_compat",
    "initialize_m3_moe_module": "moe", "M3KVCacheManager": "kv_cache", "NeuronMiniMaxM3Model": "model",
    "NeuronMiniMaxM3ForCausalLM": "model", "NeuronMiniMaxM3DecoderLayer": "model",
    "NeuronEngine": "provider", "neuron_config": "build", "inference_config": "build", "application": "build",
    "config_hook": "config",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(_import(_EXPORTS[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def require_sdk() -> None:
    """Nothing when the port's NxDI modules import; else the one :class:`NeuronUnavailableError` saying what to
    install (``load_engine`` asks before reading the model)."""
    _import("provider")


def load_neuron_engine(spec, config, drafter=None):
    """The :class:`minimax_m3.engine.Engine` of an :class:`minimax_m3.engine.spec.EngineSpec` over NxDI, for the
    model's parsed :class:`~minimax_m3.config.M3Config` ``config``: compiled NEFFs (``neuron``, at
    ``spec.artifact_dir()``) or NxDI's CPU mode (``neuron-cpu``, ``to_cpu()``); ``drafter``: the host drafter of
    ``spec.draft`` (``minimax_m3.load`` builds it)."""
    engine = _import("provider")  # without the SDK: one NeuronUnavailableError saying what to install
    return engine.load(spec, config, drafter=drafter)


__all__ = ["INSTALL_HINT", "NeuronUnavailableError", "load_neuron_engine", "require_sdk", "sdk_available",
           *_EXPORTS]
