"""Serving the port through vLLM (vllm-neuron): ``plugin`` (vLLM's general plugin: registers the M3 architectures,
refuses what the port cannot serve), ``artifact`` (``minimax-m3 compile --for-vllm``: the directory vllm-neuron
loads), ``defaults`` (the neuron config vllm-neuron 0.4.1 builds: the port's vllm-neuron adaptations) and ``parsers``
(M3's ``minimax_m3`` tool-call and reasoning parsers on vLLM's interfaces). None but ``parsers`` imports vLLM at
module level (the plugin imports it only where vLLM is importable); none imports NxDI at module level.
"""
