"""The one translation from a resolved :class:`~minimax_m3.engine.spec.EngineSpec` to NxDI's configs, and the NxDI
application of a config: used by load, compile, the dry run and ``compile --for-vllm``. No defaults of its own: the
spec's :meth:`~minimax_m3.engine.spec.EngineSpec.resolve` fills every one.
"""

from __future__ import annotations

import torch

from ..checkpoint import fp8_experts
from ..checkpoint.draft import draft_config
from ..config import sharding
from ..config.m3 import M3Config
from ..engine.spec import EngineSpec
from . import sampling
from .config import MiniMaxM3InferenceConfig, MiniMaxM3NeuronConfig, config_hook
from .model import AllPositionsForCausalLM, NeuronMiniMaxM3ForCausalLM, NeuronMiniMaxM3Model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _listed(buckets) -> list[int] | None:
    return None if buckets is None else list(buckets)


def neuron_config(spec: EngineSpec, **extra) -> MiniMaxM3NeuronConfig:
    """NxDI's config of a resolved ``spec``; ``extra``: NxDI-only fields the spec does not carry (they win)."""
    on_cpu, batch, cb = spec.backend == "neuron-cpu", spec.max_batch, spec.continuous_batching
    kw = dict(tp_degree=spec.tp, moe_ep_degree=spec.ep, moe_tp_degree=sharding.moe_tp(spec.tp, spec.ep),
              batch_size=batch, ctx_batch_size=1 if cb else batch, tkg_batch_size=batch, max_batch_size=batch,
              is_continuous_batching=cb, seq_len=spec.max_seq_len, max_context_length=spec.max_context_len,
              torch_dtype=DTYPES[spec.dtype], padding_side="right", on_cpu=on_cpu, enable_bucketing=True,
              context_encoding_buckets=_listed(spec.context_buckets),
              token_generation_buckets=_listed(spec.token_buckets), output_logits=False,
              prefill_all_logits=bool(spec.all_logits), prefill_chunk=spec.prefill_chunk)
    if on_cpu:  # the stand-in kernels cannot run; NxDI's native paths (and ours) are used
        kw.update(attn_kernel_enabled=False, qkv_kernel_enabled=False, mlp_kernel_enabled=False,
                  blockwise_matmul_config={"use_torch_block_wise": True})
    else:
        # NxDI's CTE flash-attention kernel for the dense layers (sparse layers keep ops.attention_step)
        kw.update(logical_nc_config=spec.lnc, save_sharded_checkpoint=True, attn_kernel_enabled=True)
    if spec.weights == "fp8":  # NxD's quantized routed experts; the port's state dict then carries e4m3 + .scale
        kw.update(fp8_experts.neuron_config_kwargs(), quantized_checkpoints_path=str(spec.model))
    if spec.on_device_sampling:  # seeded draws among NxDI's global top-256; only token ids leave the device
        kw.update(on_device_sampling_config=sampling.on_device_sampling_config())
    if spec.draft:  # NxDI's speculation graph verifies k drafts in one step of k + 1 tokens per row
        kw.update(speculation_length=spec.num_speculative_tokens + 1)
    if spec.fused_speculation:  # the draft in the graph too (neuron.eagle): NxDI accepts greedily, on the device
        kw.update(enable_fused_speculation=True, enable_eagle_speculation=True, is_eagle3=True,
                  disable_kv_cache_tiling=True,
                  on_device_sampling_config=sampling.on_device_sampling_config(do_sample=False, dynamic=True))
    kw.update(extra)
    return MiniMaxM3NeuronConfig(**kw)


def inference_config(spec: EngineSpec, config: M3Config, **extra) -> MiniMaxM3InferenceConfig:
    """The NxDI inference config of a resolved ``spec`` over the model's parsed ``config`` (config.json is not read
    again); with a draft (``spec.draft``, a local directory whose ``config.json`` is read and checked against the
    model here: one ``DraftError``) every call also returns the target states the draft reads.
    ``validate_config``'s problems as one :class:`~minimax_m3.errors.ServingError`."""
    dc = draft_config(spec.draft, config) if spec.draft else None
    aux = dc.aux_layers(config.num_layers) if dc else ()
    out = MiniMaxM3InferenceConfig(neuron_config(spec, **extra), load_config=config_hook(config, spec.model),
                                   aux_hidden_layers=aux)
    if spec.fused_speculation:
        from . import eagle

        out.fused_spec_config = eagle.fused_spec_config(dc, config, out, spec.model, spec.draft,
                                                       NeuronMiniMaxM3Model)
    return out


def application(model: str, config: MiniMaxM3InferenceConfig) -> NeuronMiniMaxM3ForCausalLM:
    """The NxDI application for ``config``: all-position prefill logits when ``prefill_all_logits`` is set."""
    cls = AllPositionsForCausalLM if config.neuron_config.prefill_all_logits else NeuronMiniMaxM3ForCausalLM
    return cls(model, config)
