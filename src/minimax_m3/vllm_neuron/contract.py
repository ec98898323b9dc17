"""The vLLM Neuron model contract's types, and what a MiniMax-M3 deployment on it must satisfy.

The contract as read in vllm-neuron 0.24.0.1.1.0 (``jinhuang12/vllm-neuron`` at ``ed3580d``; see
``docs/notes/vllm_neuron_runner.md``): ``get_kv_spec() -> KVSpec(layers=[LayerSpec(name, num_kv_heads,
head_size, dtype, sliding_window_size, chunk_size)])`` (``vllm_neuron/model/kv_cache.py``); the runner allocates K and
V per spec, each ``[num_blocks, num_kv_heads, block_size, head_size]``, and hands them to ``bind_kv_cache``. Where the
plugin is installed its classes are used; elsewhere (tests, the off-device harness) these stand-ins with the same
fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import parallel
from ..config.m3 import M3Config
from ..errors import ServingError
from . import sampling

try:  # the plugin's own types where it is installed
    from vllm_neuron.model.kv_cache import KVSpec, LayerSpec  # type: ignore[import-not-found]
except Exception:  # not installed (or its binary dependencies absent): the same fields

    @dataclass
    class LayerSpec:  # type: ignore[no-redef]
        name: str
        num_kv_heads: int
        head_size: int
        dtype: torch.dtype
        sliding_window_size: int | None = None
        chunk_size: int | None = None

    @dataclass
    class KVSpec:  # type: ignore[no-redef]
        layers: list = field(default_factory=list)


ARCHITECTURES = ("MiniMaxM3SparseForConditionalGeneration", "MiniMaxM3SparseForCausalLM")
# the plugin's ``neuron_config.quantization`` values this model serves: None / "bf16" (every checkpoint format
# dequantized to the serving dtype) or "fp8" (the routed experts held as per-channel e4m3, the NxDI port's
# --weights fp8: ``checkpoint.fp8_experts``)
QUANTIZATION = {None: "bf16", "bf16": "bf16", "fp8": "fp8"}
DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}


def attention_spec(i: int) -> str:
    """The K/V spec (and ``attn_metadata`` key) of layer ``i``: the plugin's models name theirs so."""
    return f"layers.{i}.self_attn"


def index_spec(i: int) -> str:
    """Sparse layer ``i``'s index-key spec: the keys' two halves in its K and V pages (no page left unused)."""
    return f"layers.{i}.self_attn.index_k"


@dataclass(frozen=True)
class Layout:
    """One rank's serving layout: tensor-parallel ``world`` ranks (``rank`` this one; ``group`` its process group,
    None for one rank), experts over ``ep`` expert-parallel groups (``world / ep`` tensor-parallel ranks each),
    ``dtype`` of weights and caches, ``tile`` queries per attention tile, ``experts`` the routed experts' format
    (``bf16``: the serving dtype; ``fp8``: per-channel e4m3, from the plugin's ``quantization``); ``dcp`` vLLM's
    ``decode_context_parallel_size`` (the ranks of a KV head's caches, each holding every ``dcp``-th block of its
    pages; ``dcp_rank`` this rank's place, ``tp_rank mod dcp``; ``dcp_group`` their collectives, an ``ops.Group``),
    ``speculative``: a draft serves beside this model."""

    world: int = 1
    rank: int = 0
    ep: int = 1
    dtype: torch.dtype = torch.bfloat16
    tile: int = 256
    experts: str = "bf16"
    dcp: int = 1
    dcp_rank: int = 0
    speculative: bool = False
    group: object = field(default=None, compare=False, repr=False)
    dcp_group: object = field(default=None, compare=False, repr=False)


def check_serving(c: M3Config, hf_config, layout: Layout, neuron_config=None) -> None:
    """Every reason this deployment cannot be served, in one :class:`ServingError` naming the option to change."""
    problems = []
    problems += sampling.config_problems(getattr(neuron_config, "on_device_sampling_config", None))
    archs = tuple(getattr(hf_config, "architectures", None) or ())
    if archs and not set(archs) & set(ARCHITECTURES):
        problems.append(f"architectures {list(archs)}: this model serves {' or '.join(ARCHITECTURES)}")
    if layout.dtype not in DTYPES:
        problems.append(f"dtype {layout.dtype}: serve with --dtype bfloat16 (or float32 for tests)")
    quant = getattr(neuron_config, "quantization", None)
    if quant not in QUANTIZATION:
        problems.append(f"quantization {quant!r}: this model serves bf16 (the default) or \"fp8\" (routed experts "
                        "in per-channel e4m3, dequantized from any checkpoint format); set neuron_config.quantization "
                        "to one of them")
    if getattr(neuron_config, "modules_to_not_convert", None):
        problems.append("modules_to_not_convert: quantization \"fp8\" converts the routed experts only, always; "
                        "leave it unset")
    if c.index_head_dim % 2:
        problems.append(f"index_head_dim {c.index_head_dim} is odd: the index keys are paged as two halves")
    problems += [f"{p} (--tensor-parallel-size {layout.world}, expert parallel {layout.ep})"
                 for p in parallel.parallel_layout_problems(c, layout.world, layout.ep, even_vocab=True)]
    problems += dcp_problems(c, layout)
    if problems:
        raise ServingError(problems)


def dcp_problems(c: M3Config, layout: Layout) -> list[str]:
    """Why vLLM's ``decode_context_parallel_size`` cannot serve this model (empty: it can): the sharding rule
    (``parallel.dcp_problems``), and no draft beside a DCP group."""
    if layout.dcp == 1:
        return []
    out = parallel.dcp_problems(c, layout.world, layout.dcp)
    if layout.speculative:
        out.append(f"--decode-context-parallel-size {layout.dcp} with --speculative-config: the EAGLE3 draft's pages "
                   "are not sharded by sequence; serve the draft without decode context parallelism")
    return out


def check_block_size(c: M3Config, block_size: int) -> None:
    """The cache pages must be the index blocks: a selected block is one page."""
    if block_size != c.index_block_size:
        raise ServingError(f"KV cache block size {block_size}: MiniMax-M3's sparse attention selects "
                           f"{c.index_block_size}-token blocks, one page each; serve with "
                           f"--block-size {c.index_block_size}")
