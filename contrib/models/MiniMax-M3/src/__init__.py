"""NxDI contrib entry point for MiniMax-M3: re-exports the classes of ``minimax_m3.neuron`` (pip install the
``minimax-m3-neuron`` package; its ``neuron`` extra needs the Neuron SDK 2.29)."""

from minimax_m3.neuron import (  # noqa: F401
    MiniMaxM3InferenceConfig,
    MiniMaxM3NeuronConfig,
    NeuronMiniMaxM3ForCausalLM,
    NeuronMiniMaxM3Model,
    load_m3_config,
)

__all__ = ["MiniMaxM3InferenceConfig", "MiniMaxM3NeuronConfig", "NeuronMiniMaxM3ForCausalLM",
           "NeuronMiniMaxM3Model", "load_m3_config"]
