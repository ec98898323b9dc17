"""Capacity planner: per-rank HBM, decode floor and TTFT of a TP x EP layout, before anyone spends two hours
compiling.

``minimax-m3 plan --tp 64 --ep 64 --batch 1 --seq 1048576 [--layout sharded|replicated|paged] [--chunk C]
[--weights bf16|fp8]`` prints, for one rank (a logical NeuronCore; trn2.48xlarge at LNC=2 has 64 of them with 24 GiB
HBM each): the bytes of weights, KV and index-K caches, prefill working memory and a runtime reserve
(:mod:`.memory`, which lists each term); the decode HBM floor and a TTFT estimate (:mod:`.cost`: FLOP, HBM and link
time per prefill call, plus a fixed latency per collective); the sharded layout's collectives per layer
(:func:`collectives`); the layouts side by side for contexts 4K..1M; the largest context and batch that fit
(:mod:`.fit`, which also holds :func:`require_fit`, the check a compile runs first); with ``--speculative K``
the projection of speculative decoding with an EAGLE3 draft (:mod:`.speculative`).

Layouts: ``sharded`` (the sequence-sharded caches, docs/long_context_port.md) is what the port runs (``PORT_LAYOUT``,
the library's default; caches split over the G ranks of a KV group, prompts prefilled in calls of C tokens);
``replicated`` is NxDI's GQA layout (each KV head's caches copied on its G ranks, a prompt in one call), the port's
``kv_layout="replicated"``; ``paged`` is the vLLM Neuron model's (:mod:`minimax_m3.vllm_neuron`: vLLM's pages,
replicated per KV group like ``replicated``, prompts prefilled in segments of C tokens, ``--chunk`` the segment,
``--dcp N`` vLLM's decode context parallelism: each request's pages dealt by block over N ranks; bf16 pages only).
Arithmetic from the config, not a measurement: nothing here has run on Trainium. Pure Python; it imports nothing from
NxDI. """

from .cli import add_arguments, format_plan, main, register, run
from .cost import (COLLECTIVE_LATENCY_S, LINK_BYTES_PER_S, PEAK_FLOPS_PER_S, Ttft, chunk_bytes, chunk_flops,
                   collectives, decode_floor_ms, decode_minimum_bytes, link_seconds, prefill_flops, ttft,
                   weights_read)
from .fit import FitError, largest_batch, largest_context, require_fit
from .speculative import (ACCEPTANCE, M3_DRAFT, Projection, StepCost, draft_heads, draft_part, draft_reads,
                          format_projection, project, step_flops, target_step)
from .base import (BF16, FP32, FP8, GIB, HBM_BYTES_PER_S, HBM_PER_RANK_GIB, INT64, LAYOUTS, MAX_CHUNK, PAGED,
                   PAGED_SEGMENTS, PAGED_SINGLE_SHOT, PAGED_TILE, PORT_LAYOUT, SHARD_ON_I_MULTIPLE, cache_multiple,
                   cache_tokens, ChunkError, PlanError)
from .memory import (cache_bytes, chunk_choices, chunk_problems, MemoryPlan, plan, segment_problems, segment_tokens,
                     weight_bytes)
from .working import (attention_tile_bytes, dense_tile, moe_bytes, paged_line_bytes, prefill_persistent_bytes,
                      prefill_phases, prefill_tile, sharded_attention_bytes, static_moe_bytes)

__all__ = [
    "ACCEPTANCE", "M3_DRAFT", "Projection", "StepCost", "draft_heads", "draft_part", "draft_reads",
    "format_projection", "project", "step_flops", "target_step", "BF16", "COLLECTIVE_LATENCY_S", "FP8", "FP32", "GIB",
    "HBM_BYTES_PER_S", "HBM_PER_RANK_GIB", "INT64", "LAYOUTS", "LINK_BYTES_PER_S", "MAX_CHUNK", "PAGED",
    "PAGED_SEGMENTS", "PAGED_SINGLE_SHOT", "PAGED_TILE", "PEAK_FLOPS_PER_S", "PORT_LAYOUT", "SHARD_ON_I_MULTIPLE",
    "ChunkError", "FitError", "MemoryPlan", "PlanError", "Ttft", "add_arguments", "attention_tile_bytes",
    "cache_bytes", "cache_multiple", "cache_tokens", "chunk_bytes", "chunk_choices", "chunk_flops", "chunk_problems",
    "collectives", "decode_floor_ms", "decode_minimum_bytes", "dense_tile", "format_plan", "largest_batch",
    "largest_context", "link_seconds", "main", "moe_bytes", "paged_line_bytes", "plan", "prefill_tile",
    "prefill_flops", "prefill_persistent_bytes", "prefill_phases", "register", "require_fit", "run",
    "segment_problems", "segment_tokens", "sharded_attention_bytes", "static_moe_bytes", "ttft", "weight_bytes",
    "weights_read",
]
