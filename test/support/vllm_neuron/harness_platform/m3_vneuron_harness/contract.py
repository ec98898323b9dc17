"""The vLLM Neuron 1.x model contract as the harness serves it: the stand-in ``neuron_config``, the buckets, the model
registry.

Citations (docs/notes/vllm_neuron_runner.md lists them): files of ``jinhuang12/vllm-neuron`` at commit
``ed3580d01e8632897b29986ab7532d8c5925846f`` (version 0.24.0.1.1.0), read through the search index, which serves
them by character offset: ``R@N`` is ``vllm_neuron/vllm/worker/neuron_model_runner.py`` (410,470 characters) in the
16,000-character page starting at offset N, ``S@N`` ``vllm/core/scheduler.py``, ``B@N`` ``utils/bucket_utils.py``,
``C@N`` ``model/neuron_config.py``, ``W@N`` ``vllm/worker/neuron_worker.py``, ``P@N`` ``vllm/platform.py``.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Any

# B@16000: the segment sizes of the segmented-attention NKI kernel; single-shot prefill only up to 16K.
SUPPORTED_KV_SEGMENT_SIZES = (512, 1024, 2048, 4096, 8192)
MAX_MODEL_LEN_SINGLE_SHOT = 16 * 1024
# R@0: write-side padding goes to vLLM's null block 0; the device block table shows it as -1.
NULL_BLOCK_ID = 0
PAD_SLOT_ID = -1


@dataclass
class HarnessNeuronConfig:
    """The fields of vllm-neuron's ``NeuronConfig`` (C@0, dataclass at ed3580d), filled as the runner fills them
    (R@16000: ``NeuronConfig.from_dict(additional_config["neuron_config"])``, then the bucket fields resolved).

    No tensor-parallel degree: the real NeuronConfig has none; models read TP from ``vllm.distributed.get_tp_group()``
    (size 1 in the harness). ``on_device_sampling_config``: None (host sampling through vLLM's sampler) unless the
    test passes a dict (the plugin's ``OnDeviceSamplingConfig`` fields, e.g. ``{}`` for its defaults): then the model
    samples and the runner takes its ids (R@352000 ``_sample``). The real plugin's default is ODS *on* when the key
    is absent (C@0 ``from_dict``); the harness keeps host sampling as its default so that a config meant to behave
    the same on device passes ``"on_device_sampling_config": None`` (or a dict) explicitly.
    """

    ep_degree: int = 1
    attention_dp_size: int = 1
    embedding_dp_size: int = 1
    lm_head_dp_size: int = 1
    mlp_dp_size: int = 1
    on_device_sampling_config: Any = None
    max_logprobs: int = 0
    tensor_capture: Any = None
    tensor_replacement: Any = None
    kv_segment_size_buckets: list[int] | None = None
    debug_logits_dir: str | None = None
    quantization: str | None = None
    all2all_backend: str | None = None
    modules_to_not_convert: list[str] | None = None
    num_batched_tokens_buckets: list[int] | None = None
    num_seqs_buckets: list[int] | None = None
    decode_context_length_buckets: list[int] | None = None
    enable_structured_outputs: bool = False
    fp8_packed_kv: bool = False
    # the harness's own record of where each value came from (not a NeuronConfig field)
    harness_notes: dict = field(default_factory=dict, repr=False)


def _ascending_positive(name: str, buckets: Any) -> list[int]:
    if not isinstance(buckets, list) or not buckets:
        raise ValueError(f"{name} must be a non-empty list, got {buckets!r}")
    if any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in buckets):
        raise ValueError(f"{name} must hold positive integers, got {buckets!r}")
    if any(b <= a for a, b in zip(buckets, buckets[1:])):
        raise ValueError(f"{name} must be strictly ascending, got {buckets!r}")
    return list(buckets)


def powers_of_two_then(start: int, last: int) -> list[int]:
    """B@0: the default buckets, powers of two from ``start`` below ``last``, then ``last`` itself
    (``get_default_num_batched_tokens_buckets``: start 128; ``get_default_num_seqs_buckets``: start 1)."""
    out, b = [], start
    while b < last:
        out.append(b)
        b *= 2
    return out + [last]


def bucket_for(count: int, buckets: list[int]) -> int:
    """B@16000 ``get_bucket_for_count``: the smallest bucket >= count (the largest when none is)."""
    for b in buckets:
        if b >= count:
            return b
    return buckets[-1]


def strict_segments() -> bool:
    """``M3_VNEURON_STRICT_SEGMENTS=1``: refuse segment sizes the device kernel lacks (B@16000), as the plugin does.
    Off by default so toy models can page with small chunks."""
    return os.environ.get("M3_VNEURON_STRICT_SEGMENTS") == "1"


def resolve_neuron_config(vllm_config) -> HarnessNeuronConfig:
    """The runner's ``__init__`` bucket resolution (R@16000..R@32000, B@0..B@16000), re-implemented:

    * ``max_num_batched_tokens`` = min(scheduler's, max_model_len) (``get_max_num_batched_tokens``);
    * segmented prefill is on when ``kv_segment_size_buckets`` is given, or automatically when
      max_num_batched_tokens < max_model_len (``resolve_segmented_prefill_config``: both bucket lists become
      ``[max_num_batched_tokens]``); single-shot prefill otherwise (max_model_len <= 16K), with the power-of-two
      token buckets from 128;
    * prefix caching requires segmented prefill (R@16000 raises);
    * decode batch buckets: powers of two from 1 up to max_num_seqs, or ``num_seqs_buckets`` (last = max_num_seqs);
    * ``decode_context_length_buckets``: ascending, < max_model_len, multiples of 128 (B@16000).
    """
    nc = dict((vllm_config.additional_config or {}).get("neuron_config", {}) or {})
    sched, model_config = vllm_config.scheduler_config, vllm_config.model_config
    max_model_len = model_config.max_model_len
    max_num_seqs = sched.max_num_seqs
    ods = nc.get("on_device_sampling_config")
    if ods is not None and not isinstance(ods, dict):
        raise ValueError(f"on_device_sampling_config must be a dict of OnDeviceSamplingConfig fields or null, got "
                         f"{ods!r}")
    dcp = vllm_config.parallel_config.decode_context_parallel_size
    cfg = HarnessNeuronConfig(
        ep_degree=nc.get("ep_degree", 1), attention_dp_size=nc.get("attention_dp_size", 1),
        embedding_dp_size=nc.get("embedding_dp_size", 1), lm_head_dp_size=nc.get("lm_head_dp_size", 1),
        mlp_dp_size=nc.get("mlp_dp_size", 1), on_device_sampling_config=ods,
        max_logprobs=nc.get("max_logprobs", getattr(model_config, "max_logprobs", 0)),  # R@16000 setdefault
        debug_logits_dir=nc.get("debug_logits_dir"), quantization=nc.get("quantization"),
        all2all_backend=nc.get("all2all_backend"), modules_to_not_convert=nc.get("modules_to_not_convert"),
        enable_structured_outputs=bool(nc.get("enable_structured_outputs", False)),
        fp8_packed_kv=bool(nc.get("fp8_packed_kv", False)))

    mnbt = min(sched.max_num_batched_tokens, max_model_len)
    user_kv, user_nbt = "kv_segment_size_buckets" in nc, "num_batched_tokens_buckets" in nc
    auto_kv = auto_nbt = None
    if not user_kv:
        if mnbt >= max_model_len:
            if max_model_len > MAX_MODEL_LEN_SINGLE_SHOT:
                raise ValueError(f"single-shot prefill needs max_model_len <= {MAX_MODEL_LEN_SINGLE_SHOT}; set "
                                 f"max_num_batched_tokens to one of {SUPPORTED_KV_SEGMENT_SIZES}")
        else:
            if strict_segments() and mnbt not in SUPPORTED_KV_SEGMENT_SIZES:
                raise ValueError(f"max_num_batched_tokens={mnbt} is not a chunk size the device kernel supports "
                                 f"{SUPPORTED_KV_SEGMENT_SIZES}")
            auto_kv = auto_nbt = [mnbt]
    if user_nbt:
        nbt = _ascending_positive("num_batched_tokens_buckets", nc["num_batched_tokens_buckets"])
        if nbt[-1] != mnbt:
            raise ValueError(f"num_batched_tokens_buckets must end at max_num_batched_tokens ({mnbt}), got {nbt}")
    else:
        nbt = auto_nbt if auto_nbt is not None else powers_of_two_then(128, mnbt)
    if "num_seqs_buckets" in nc:
        seqs = _ascending_positive("num_seqs_buckets", nc["num_seqs_buckets"])
        if seqs[-1] != max_num_seqs:
            raise ValueError(f"num_seqs_buckets must end at max_num_seqs ({max_num_seqs}), got {seqs}")
    else:
        seqs = powers_of_two_then(1, max_num_seqs)
    if "decode_context_length_buckets" in nc:
        ctx = _ascending_positive("decode_context_length_buckets", nc["decode_context_length_buckets"])
        if any(c >= max_model_len or c % 128 for c in ctx):
            raise ValueError(f"decode_context_length_buckets must be < max_model_len and multiples of 128: {ctx}")
        cfg.decode_context_length_buckets = ctx
    kv = None
    if user_kv:
        kv = _ascending_positive("kv_segment_size_buckets", nc["kv_segment_size_buckets"])
        if len(kv) != 1:
            raise ValueError(f"one segment size only (B@16000), got {kv}")
        if strict_segments() and kv[0] not in SUPPORTED_KV_SEGMENT_SIZES:
            raise ValueError(f"kv_segment_size {kv[0]} is not one the device kernel supports")
        if user_nbt and nbt != kv:
            raise ValueError(f"num_batched_tokens_buckets must equal kv_segment_size_buckets, {nbt} != {kv}")
        if not user_nbt:
            nbt = list(kv)
        mnbt = max(mnbt, kv[0])
    elif auto_kv is not None:
        kv = auto_kv
    if kv is None and getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        raise ValueError("prefix caching requires segmented prefill (R@16000): disable it, or set "
                         "max_num_batched_tokens below max_model_len")
    lap = dcp * vllm_config.cache_config.block_size
    if dcp > 1 and any(n % lap for n in nbt):  # B@0: DCP prefill buckets are whole laps of dcp blocks
        raise ValueError(f"decode_context_parallel_size {dcp}: prefill token buckets {nbt} must be multiples of "
                         f"dcp x block_size = {lap}")
    cfg.kv_segment_size_buckets, cfg.num_batched_tokens_buckets, cfg.num_seqs_buckets = kv, nbt, seqs
    cfg.harness_notes = {"max_num_batched_tokens": max(mnbt, max(nbt)), "segmented": kv is not None}
    return cfg


def model_registry() -> dict[str, type]:
    """HF architecture name -> the contract's factory class.

    ``M3_VNEURON_MODELS``: ``module:attribute`` (a dict, or a function returning one), several separated by commas,
    merged left to right; by default ``minimax_m3.vllm_neuron.plugin:models`` when that module exists. Read in
    every process vLLM starts.
    """
    spec = os.environ.get("M3_VNEURON_MODELS", "")
    names = [s for s in spec.split(",") if s.strip()] or ["minimax_m3.vllm_neuron.plugin:models"]
    out: dict[str, type] = {}
    for name in names:
        module, _, attr = name.strip().partition(":")
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError:
            if spec:  # named explicitly: its absence is an error
                raise
            continue
        found = getattr(mod, attr or "models", None)
        if found is None and not attr:
            found = mod.MODELS
        out.update(found() if callable(found) else found)
    return out
