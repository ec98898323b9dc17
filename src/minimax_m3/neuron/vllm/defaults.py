"""vllm-neuron 0.4.1's neuron config for a ``vllm serve`` command line, through its own functions or, where
vllm-neuron is not importable (compile on a host without vLLM), the same rules written down.

The one home of the port's adaptations of vllm-neuron 0.4.1 (Neuron SDK 2.29), as ``neuron/nxd_compat/`` is of
NxD/NxDI's: a separate module because the vLLM plugin and ``compile --for-vllm`` import it without NxDI (which
``nxd_compat`` imports at module level). Imports neither vLLM nor NxDI at module level.
"""

from __future__ import annotations

from types import SimpleNamespace

# vllm-neuron 0.4.1's custom scheduler (chunked prefill off) with 128K tokens per step; the platform sets the block
# size to --max-model-len when prefix caching is off (vllm_neuron/platform.py check_and_update_config)
_SCHEDULER_TOKENS = 131072


def vllm_neuron_config(*, tp: int, max_num_seqs: int, max_model_len: int, dtype: str, override: dict,
                       use_vllm_neuron: bool = True, speculative_tokens: int | None = None) -> dict:
    """The neuron config (keyword arguments of the port's ``NeuronConfig``) vllm-neuron 0.4.1 builds for
    ``vllm serve --tensor-parallel-size tp --max-num-seqs max_num_seqs --max-model-len max_model_len --dtype dtype
    --no-enable-prefix-caching --additional-config '{"override_neuron_config": override}'`` (with
    ``speculative_tokens``: and ``--speculative-config '{"method": "eagle", "num_speculative_tokens": n, ...}'``).

    Targets vllm-neuron 0.4.1 (``vllm_neuron/worker/neuronx_distributed_model_loader.py``: the private
    ``_get_default_neuron_config`` and ``_get_neuron_config_after_override``, its only path from the vLLM flags to
    the neuron config): called when importable (and ``use_vllm_neuron``), else the same rules written down here
    (``test/vllm/test_compile_for_vllm.py`` checks the two agree)."""
    import torch

    override = dict(override)
    loader = None
    if use_vllm_neuron:
        try:
            from vllm_neuron.worker import neuronx_distributed_model_loader as loader
        except ImportError:
            loader = None
    if loader is not None:
        ns = SimpleNamespace
        d = loader._get_default_neuron_config(
            ns(max_model_len=max_model_len, dtype=getattr(torch, dtype)),
            ns(block_size=max_model_len, num_gpu_blocks_override=None, enable_prefix_caching=False),
            ns(tensor_parallel_size=tp),
            ns(enable_chunked_prefill=False, max_num_seqs=max_num_seqs, max_num_batched_tokens=_SCHEDULER_TOKENS),
            None, None if speculative_tokens is None else ns(num_speculative_tokens=speculative_tokens, method="eagle"))
        return loader._get_neuron_config_after_override(d, override)
    from neuronx_distributed_inference.models.config import OnDeviceSamplingConfig

    d = {"tp_degree": tp, "ctx_batch_size": 1, "batch_size": max_num_seqs, "max_context_length": max_model_len,
         "seq_len": max_model_len, "enable_bucketing": True, "is_continuous_batching": max_num_seqs > 1,
         "quantized": False, "torch_dtype": dtype, "padding_side": "right",
         "on_device_sampling_config": OnDeviceSamplingConfig(dynamic=True, deterministic=False),
         "lora_config": None, "pa_num_blocks": max_num_seqs, "pa_block_size": max_model_len,
         "is_block_kv_layout": False, "is_prefix_caching": False}
    if speculative_tokens is not None:  # NxDI's fused speculation, EAGLE
        d.update(enable_fused_speculation=True, speculation_length=speculative_tokens, enable_eagle_speculation=True)
    d.update(override)
    if "quantized" in override:  # vllm-neuron fills the quantization fields it reads with its defaults
        d.update(quantized_checkpoints_path=override.get("quantized_checkpoints_path"),
                 quantization_type=override.get("quantization_type", "per_tensor_symmetric"),
                 quantization_dtype=override.get("quantization_dtype", "int8"))
    return d
