"""Serving the port through vLLM (vllm-neuron): ``plugin`` (vLLM's general plugin: registers the M3 architectures,
refuses what the port cannot serve) and ``artifact`` (``minimax-m3 compile --for-vllm``: the directory vllm-neuron
loads). Neither imports vLLM or NxDI at module level.
"""
