"""The one translation from a resolved :class:`~minimax_m3.engine.spec.EngineSpec` to NxDI's configs, and the NxDI
application of a config: used by load, compile, the dry run and ``compile --for-vllm``.
"""

from __future__ import annotations

import torch

from ..checkpoint import fp8_experts
from ..config import sharding
from ..config.m3 import ConfigError
from ..engine.spec import EngineSpec, context_buckets
from . import sampling
from .config import MiniMaxM3InferenceConfig, MiniMaxM3NeuronConfig, load_m3_config
from .model import AllPositionsForCausalLM, NeuronMiniMaxM3ForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_neuron_config(tp_degree: int = 1, batch_size: int = 1, max_seq_len: int = 256,
                        max_context_length: int | None = None, dtype: str = "bfloat16", on_cpu: bool = False,
                        moe_ep_degree: int = 1, continuous_batching: bool | None = None,
                        prefill_all_logits: bool = False, **extra) -> MiniMaxM3NeuronConfig:
    """NxDI's config for this engine. ``continuous_batching`` defaults to ``batch_size > 1``; context buckets to
    :func:`context_buckets` and decode to one bucket of ``max_seq_len`` (``extra`` overrides any of them)."""
    ctx = max_context_length or max_seq_len
    cb = batch_size > 1 if continuous_batching is None else bool(continuous_batching)
    kw = dict(tp_degree=tp_degree, batch_size=batch_size, ctx_batch_size=1 if cb else batch_size,
              tkg_batch_size=batch_size, max_batch_size=batch_size, is_continuous_batching=cb,
              seq_len=max_seq_len, max_context_length=ctx,
              torch_dtype=DTYPES[dtype] if isinstance(dtype, str) else dtype, padding_side="right",
              moe_tp_degree=sharding.moe_tp(tp_degree, moe_ep_degree), moe_ep_degree=moe_ep_degree, on_cpu=on_cpu,
              enable_bucketing=True, context_encoding_buckets=list(context_buckets(ctx)),
              token_generation_buckets=[max_seq_len], output_logits=False, prefill_all_logits=prefill_all_logits)
    if on_cpu:  # the stand-in kernels cannot run; NxDI's native paths (and ours) are used
        kw.update(attn_kernel_enabled=False, qkv_kernel_enabled=False, mlp_kernel_enabled=False,
                  blockwise_matmul_config={"use_torch_block_wise": True})
    kw.update(extra)
    return MiniMaxM3NeuronConfig(**kw)


def neuron_config(spec: EngineSpec, **extra) -> MiniMaxM3NeuronConfig:
    """NxDI's config of a resolved ``spec`` (the one translation, used by load, compile and the dry run)."""
    on_cpu = spec.backend == "neuron-cpu"
    kw = dict(tp_degree=spec.tp, moe_ep_degree=spec.ep, batch_size=spec.max_batch, max_seq_len=spec.max_seq_len,
              max_context_length=spec.max_context_len, dtype=spec.dtype, on_cpu=on_cpu,
              continuous_batching=spec.continuous_batching, prefill_all_logits=spec.all_logits,
              context_encoding_buckets=list(spec.context_buckets), token_generation_buckets=list(spec.token_buckets))
    if not on_cpu:
        # NxDI's CTE flash-attention kernel for the dense layers (sparse layers keep ops.prefill_step)
        kw.update(logical_nc_config=spec.lnc, save_sharded_checkpoint=True, attn_kernel_enabled=True)
    if spec.weights == "fp8":  # NxD's quantized routed experts; the port's state dict then carries e4m3 + .scale
        kw.update(fp8_experts.neuron_config_kwargs(), quantized_checkpoints_path=str(spec.model))
    if spec.on_device_sampling:  # seeded draws among NxDI's global top-256; only token ids leave the device
        kw.update(on_device_sampling_config=sampling.on_device_sampling_config())
    kw.update(extra)
    return build_neuron_config(**kw)


def inference_config(spec: EngineSpec, **extra) -> MiniMaxM3InferenceConfig:
    """The NxDI inference config of a resolved ``spec``; ``validate_config``'s problems as one :class:`ConfigError`
    (the CLI prints it and exits 2)."""
    try:
        return MiniMaxM3InferenceConfig(neuron_config(spec, **extra), load_config=load_m3_config(spec.model))
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError([str(exc)], source=f"engine spec ({spec.backend})") from None


def application(model: str, config: MiniMaxM3InferenceConfig) -> NeuronMiniMaxM3ForCausalLM:
    """The NxDI application for ``config``: all-position prefill logits when ``prefill_all_logits`` is set."""
    cls = AllPositionsForCausalLM if config.neuron_config.prefill_all_logits else NeuronMiniMaxM3ForCausalLM
    return cls(model, config)
