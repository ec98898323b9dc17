"""The planner's units and shared rules: trn2's figures, the cache layouts' names, the plugin's prefill sizes, the
planner's errors, heads per rank and the context bucket (what :mod:`.memory`, :mod:`.working`, :mod:`.cost` and the
CLI all read)."""

from __future__ import annotations

from ..config import parallel
from ..config.m3 import M3Config
from ..errors import M3Error

GIB = 1024 ** 3
HBM_PER_RANK_GIB = 24.0  # trn2 at LNC=2: one logical core's share of HBM
BF16, FP32 = 2, 4
INT64 = 8  # block ids of the selection
FP8 = 1  # e4m3 routed-expert weight; plus an fp32 scale per expert and output channel (checkpoint.fp8_experts)
HBM_BYTES_PER_S = 725e9  # one logical core's share of trn2 HBM bandwidth at LNC=2 (docs/notes/perf_anchors.md)
SHARD_ON_I_MULTIPLE = 256  # NxDI SHARD_ON_INTERMEDIATE_DIMENSION_PER_TP (pads I/moe_tp with shard-on-I kernels)
LAYOUTS = ("replicated", "sharded", "paged")
PORT_LAYOUT = "sharded"  # what the port runs (neuron.config's kv_layout default): the library's default
PAGED = "paged"  # the vLLM Neuron model's layout (minimax_m3.vllm_neuron): vLLM's paged caches
# The vLLM Neuron model's prefill: the plugin's segment sizes and single-shot limit (docs/notes/vllm_neuron_runner.md,
# "Buckets"; their home: vllm_neuron.dry_run imports them) and a copy of the model's attention tile (the planner may
# not import vllm_neuron.contract.Layout.tile; test/unit/test_plan_paged.py holds the two equal).
PAGED_SEGMENTS = (512, 1024, 2048, 4096, 8192)
PAGED_SINGLE_SHOT = 16384
PAGED_TILE = 256
MAX_CHUNK = parallel.MAX_PREFILL_CHUNK  # the default prefill chunk's cap (chunk_choices)


class PlanError(M3Error, ValueError):
    """A layout the model cannot be sharded into."""


class ChunkError(PlanError):
    """A prefill chunk the sharded cache layout cannot use; the message names the sizes that would work."""


def _heads(c: M3Config, heads: int, tp: int) -> int:
    """Heads per rank (``parallel.heads_per_rank``); a split that does not fit is one PlanError with every problem."""
    n = parallel.heads_per_rank(heads, tp)
    if not n:
        raise PlanError(parallel.model_problems(c, tp, 1) or [f"{heads} heads do not fit tp {tp}"])
    return n


def cache_multiple(c: M3Config, tp: int, layout: str, dcp: int = 1) -> int:
    """What a context bucket (and, sharded, a prefill chunk) is a multiple of: the index block, and with the
    sharded caches ``lcm(block, G)`` (``parallel.chunk_unit``: every rank writes C / G tokens, chunks start on block
    boundaries); paged with ``dcp`` > 1, vLLM's virtual block ``block x dcp``."""
    if layout == PAGED:
        return c.index_block_size * dcp
    return parallel.chunk_unit(c, tp) if layout == "sharded" else c.index_block_size


def cache_tokens(c: M3Config, tp: int, seq: int, layout: str, dcp: int = 1) -> int:
    """The context bucket: ``seq`` rounded up to :func:`cache_multiple`."""
    m = cache_multiple(c, tp, layout, dcp)
    return -(-seq // m) * m


def dcp_tokens(c: M3Config, seq: int, dcp: int) -> int:
    """The tokens of a ``seq``-token request one rank of a paged DCP group holds (its own blocks): ``seq`` in whole
    virtual blocks of ``block x dcp``, ``1 / dcp`` of them (``seq`` itself, rounded to whole pages, for ``dcp`` 1)."""
    return cache_tokens(c, 0, seq, PAGED, dcp) // dcp
