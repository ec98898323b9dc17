"""Serving the port through vLLM (vllm-neuron): ``plugin`` (vLLM's general plugin: registers the M3 architectures,
refuses what the port cannot serve), ``artifact`` (``minimax-m3 compile --for-vllm``: the directory vllm-neuron
loads) and ``defaults`` (the neuron config vllm-neuron 0.4.1 builds: the port's vllm-neuron adaptations). None
imports vLLM or NxDI at module level.
"""
