"""The build rules an engine spec and NxDI's config share, one home each (``EngineSpec`` checks its spec with them;
``neuron.config``'s ``validate_config`` checks the configs vllm-neuron builds with them): the default buckets, the
bucket rules and how they apply to a prefill chunk (:func:`chunk_problems`: the chunk's size rule itself is
``config.parallel.check_call``, its one home; this module adds what the neuron backends' buckets and cache need of
it). Imports only :mod:`minimax_m3.config`.
"""

from __future__ import annotations

from ..config import parallel
from ..config.m3 import M3Config

# prefill buckets: powers of two from 128, cut below the context length, which is added (NxDI's generate_buckets)
DEFAULT_CONTEXT_BUCKETS = tuple(2 ** i for i in range(7, 21))


def default_buckets(limit: int, candidates) -> list[int]:
    """``candidates`` below ``limit``, then ``limit`` itself."""
    return sorted({b for b in candidates if b < limit} | {limit})


def context_buckets(max_context_len: int) -> list[int]:
    """The default context-encoding (prefill) buckets for prompts of up to ``max_context_len`` tokens."""
    return default_buckets(max_context_len, DEFAULT_CONTEXT_BUCKETS)


def token_buckets(seq_len: int, block_size: int) -> list[int]:
    """The default decode buckets: ``block_size`` times powers of two from the first multiple of it >= 128 (NxDI's
    smallest token-generation bucket), those below ``seq_len``, and ``seq_len``: every one a multiple of the
    indexer block when ``seq_len`` is."""
    out, b = [], block_size * -(-128 // block_size)
    while b < seq_len:
        out.append(b)
        b *= 2
    return out + [seq_len]


# the bucket rules' names: what, the length it serves, the options (engine; vLLM) that set buckets and length
_BUCKETS = (("context-encoding", "max_context_len", "--context-buckets (vLLM: context_encoding_buckets)",
             "--max-context-len (vLLM: --max-model-len)"),
            ("token-generation", "max_seq_len", "--token-buckets (vLLM: token_generation_buckets)",
             "--max-seq-len (vLLM: --max-model-len)"))


_CHUNK = ("context-encoding", "prefill_chunk", "--context-buckets (vLLM: context_encoding_buckets)",
          "--prefill-chunk (vLLM: prefill_chunk in override_neuron_config)")


def bucket_problems(context_buckets, token_buckets, max_context_len: int, max_seq_len: int,
                    config: M3Config | None = None, prefill_chunk: int | None = None) -> list[str]:
    """The rules a neuron build's buckets follow, one home (the spec's checks and NxDI's ``validate_config``, which
    vLLM's configs pass through): each kind of bucket within its length and the largest reaching it (a longer
    request would fit no bucket), decode buckets whole indexer blocks (``config``'s). A prefill call is at most
    ``prefill_chunk`` tokens wide: with a chunk below ``max_context_len`` the context buckets end at the chunk (every
    call but a prompt's last is one chunk wide). ``None``: no buckets given."""
    out = []
    rules = _BUCKETS
    if prefill_chunk is not None and 0 < prefill_chunk < max_context_len:
        rules, max_context_len = (_CHUNK, _BUCKETS[1]), prefill_chunk
    for (what, length, option, length_option), buckets, limit in zip(
            rules, (context_buckets, token_buckets), (max_context_len, max_seq_len)):
        buckets = sorted(buckets or ())
        if [b for b in buckets if b > limit]:
            out.append(f"{what} buckets {[b for b in buckets if b > limit]} exceed {length} {limit}: drop them or "
                       f"raise {length_option}")
        elif buckets and buckets[-1] < limit:
            longer = "a whole chunk" if length == "prefill_chunk" else "a longer request"
            out.append(f"the largest {what} bucket {buckets[-1]} is below {length} {limit}, so {longer} "
                       f"would fit no bucket: add {limit} to {option} or lower {length_option} to {buckets[-1]}")
    tkg = sorted(token_buckets or ())
    if config is not None and any(config.sparse_layers) and [b for b in tkg if b % config.index_block_size]:
        out.append(f"token-generation buckets {tkg} must be multiples of index_block_size {config.index_block_size} "
                   "(sparse decode reads the caches by whole blocks): choose such --token-buckets and --max-seq-len "
                   "(vLLM: token_generation_buckets and --max-model-len)")
    return out


def chunk_problems(chunk: int | None, config: M3Config, tp: int, *, neuron: bool = True,
                   max_context_len: int = 0, max_seq_len: int = 0, kv_layout: str = parallel.KV_LAYOUTS[0]
                   ) -> list[str]:
    """The rules a prefill chunk follows (the spec's checks and NxDI's ``validate_config`` call this). The layout's
    (``parallel.check_call``): a multiple of the index block and, on the neuron backends, of the KV group
    (``parallel.kv_group_size`` of ``kv_layout``: its ranks share the chunk's cache writes). Neuron: a prompt longer
    than one chunk is prefilled in calls at ``0, C, 2C, ...``, the last one padded on to its bucket (at most C) and
    written whole, so the cache must hold ``max_context_len`` rounded up to whole chunks. (Its buckets:
    :func:`bucket_problems`.)"""
    if chunk is None:
        return []
    if chunk < 1:
        return [f"prefill_chunk (--prefill-chunk) must be >= 1, got {chunk}"]
    try:
        group = parallel.kv_group_size(config, tp, kv_layout) if neuron else 1
        parallel.check_call(chunk, config.index_block_size, group)
    except parallel.LayoutError as e:
        return [f"{p}: set --prefill-chunk (vLLM: prefill_chunk in override_neuron_config) to one of them"
                for p in e.problems]
    whole = -(-max_context_len // chunk) * chunk
    if neuron and max_context_len > chunk and whole > max_seq_len:
        return [f"prompts of up to max_context_len {max_context_len} tokens are prefilled in calls of prefill_chunk "
                f"{chunk}, the last one written up to position {whole - 1}, past the cache of max_seq_len "
                f"{max_seq_len}: raise --max-seq-len to {whole} or lower --max-context-len to "
                f"{max_seq_len // chunk * chunk}"]
    return []
