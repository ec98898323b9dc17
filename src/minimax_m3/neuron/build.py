"""The one translation from a resolved :class:`~minimax_m3.engine.spec.EngineSpec` to NxDI's configs, and the NxDI
application of a config: used by load, compile, the dry run and ``compile --for-vllm``. No defaults of its own: the
spec's :meth:`~minimax_m3.engine.spec.EngineSpec.resolve` fills every one.

A fused-speculation build's ``FusedSpecNeuronConfig`` is built here too (the port's, :func:`fused_spec_config`, and
the one vllm-neuron attaches, :func:`vllm_fused_spec_config`): it names the draft's application class
(``eagle.M3Eagle3DraftForCausalLM``, imported by these functions only), so it cannot live in ``config.py``, which
``eagle.py`` imports. The draft's own config class and neuron config are in ``config.py``.
"""

from __future__ import annotations

import torch
from neuronx_distributed_inference.models.config import FusedSpecNeuronConfig

from ..checkpoint import fp8_experts
from ..checkpoint.draft import DraftError, draft_config
from ..config import parallel
from ..config.draft import DraftConfig
from ..config.m3 import M3Config
from ..engine.spec import EngineSpec
from . import sampling
from .config import (M3Eagle3DraftConfig, MiniMaxM3InferenceConfig, MiniMaxM3NeuronConfig, config_hook,
                     draft_fit_problems, draft_inference_config)
from .model import AllPositionsForCausalLM, NeuronMiniMaxM3ForCausalLM, NeuronMiniMaxM3Model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _listed(buckets) -> list[int] | None:
    return None if buckets is None else list(buckets)


def neuron_config(spec: EngineSpec, **extra) -> MiniMaxM3NeuronConfig:
    """NxDI's config of a resolved ``spec``; ``extra``: NxDI-only fields the spec does not carry (they win)."""
    on_cpu, batch, cb = spec.backend == "neuron-cpu", spec.max_batch, spec.continuous_batching
    kw = dict(tp_degree=spec.tp, moe_ep_degree=spec.ep, moe_tp_degree=parallel.moe_tp(spec.tp, spec.ep),
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
    if spec.decode_experts == "tp":  # NxD's hybrid sharding: prefill keeps the EP shards, decode a TP copy
        kw.update(hybrid_sharding_config=parallel.decode_tp_experts(spec.tp, spec.ep))
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
                                   aux_hidden_layers=aux, kv_layout=spec.kv_layout)
    if spec.fused_speculation:
        out.fused_spec_config = fused_spec_config(dc, config, out, spec.model, spec.draft, NeuronMiniMaxM3Model)
    return out


def application(model: str, config: MiniMaxM3InferenceConfig) -> NeuronMiniMaxM3ForCausalLM:
    """The NxDI application for ``config``: all-position prefill logits when ``prefill_all_logits`` is set."""
    cls = AllPositionsForCausalLM if config.neuron_config.prefill_all_logits else NeuronMiniMaxM3ForCausalLM
    return cls(model, config)


def fused_spec_config(dc: DraftConfig, target: M3Config, target_cfg, target_path: str, draft_path: str, worker_cls):
    """NxDI's ``FusedSpecNeuronConfig`` for the draft at ``draft_path`` over the target checkpoint at
    ``target_path`` (one :class:`DraftError` when NxDI's draft cannot run it)."""
    from .eagle import M3Eagle3DraftForCausalLM  # NxDI's Llama EAGLE3 modules: imported for a fused build only

    problems = draft_fit_problems(dc, target)
    if problems:
        raise DraftError(problems, f"EAGLE3 draft {draft_path} (fused speculation)")
    return FusedSpecNeuronConfig(worker_cls, draft_config=draft_inference_config(dc, target_cfg, target_path),
                                 draft_model_path=str(draft_path), draft_model_cls=M3Eagle3DraftForCausalLM)


def vllm_fused_spec_config(target_cfg, draft_path: str, worker_cls):
    """The ``FusedSpecNeuronConfig`` vllm-neuron 0.4.1 attaches for an EAGLE3 draft (its private
    ``_init_fused_spec_config``: a copy of the target's neuron config, the draft class resolved from
    ``LlamaForCausalLMEagle3``, NxDI's ``load_pretrained_config`` of the draft's config.json), for ``compile
    --for-vllm``."""
    import copy

    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config

    from .eagle import M3Eagle3DraftForCausalLM

    nc = copy.deepcopy(target_cfg.neuron_config)
    nc.enable_fused_speculation, nc.is_eagle_draft = False, True
    draft = M3Eagle3DraftConfig(nc, load_config=load_pretrained_config(str(draft_path)))
    return FusedSpecNeuronConfig(worker_cls, draft_config=draft, draft_model_path=str(draft_path),
                                 draft_model_cls=M3Eagle3DraftForCausalLM)
