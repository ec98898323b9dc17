"""Per-sequence seeded sampling with static shapes (XLA-safe): the on-device draw of the Neuron port.

The engine's contract is that a sequence samples the same tokens alone or in any batch. A device RNG (NxDI's
``rand_like``, an HLO ``rng`` op, or ``torch.rand_like`` in CPU mode) is one stream for the whole batch, so a
row's draw depends on its batch neighbours and on every earlier call. Here each row's uniform comes from a
counter-based hash of its own ``(seed, counter)`` — the counter is the position of the token the draw follows —
so it depends on nothing else; the token is then the inverse CDF of the filtered distribution at that uniform.

Filtering is :func:`minimax_m3.ops.sampling.filter_logits`'s, on candidates sorted by descending logit: divide by
the temperature, keep the first ``top_k`` (0: all candidates), keep the smallest prefix whose probability mass
reaches ``top_p`` (a token is kept when the mass strictly before it is < ``top_p``); temperature 0 is greedy.
Everything is elementwise, ``cumsum``, ``softmax`` and comparisons on ``[B, K]``: no data-dependent shapes.
"""

from __future__ import annotations

import torch

_M1, _M2 = 0x85EBCA6B - (1 << 32), 0xC2B2AE35 - (1 << 32)  # murmur3 fmix32 constants as int32
_GOLDEN = 0x9E3779B9 - (1 << 32)
_U24 = 1.0 / (1 << 24)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int32 (torch's ``>>`` on int32 is arithmetic)."""
    return (x >> s) & ((1 << (32 - s)) - 1)


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser in int32 arithmetic (multiplication wraps mod 2^32 as uint32 would)."""
    h = h ^ _shr(h, 16)
    h = h * _M1
    h = h ^ _shr(h, 13)
    h = h * _M2
    return h ^ _shr(h, 16)


def seed_words(seed: int) -> tuple[int, int]:
    """A seed (any int; taken mod 2^32) as two 16-bit words, each exact in float32 (NxDI passes float params)."""
    s = int(seed) & 0xFFFFFFFF
    return s & 0xFFFF, s >> 16


def uniforms(seed_lo: torch.Tensor, seed_hi: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """``[B]`` float32 uniforms in [0, 1) (multiples of 2^-24), one per row, a function of that row's seed words
    (integers in [0, 2^16), any dtype) and counter (an integer tensor) only."""
    seed = (seed_lo.to(torch.int32) & 0xFFFF) | (seed_hi.to(torch.int32) << 16)
    c = counter.to(torch.int32)
    h = _fmix32(_fmix32(seed ^ _GOLDEN) ^ (c * _GOLDEN))
    h = _fmix32(h + c)
    return _shr(h, 8).to(torch.float32) * _U24


def draw_sorted(values: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                u: torch.Tensor) -> torch.Tensor:
    """Index ``[B]`` (into the candidate axis) drawn at uniform ``u`` from candidates ``values [B, K]`` sorted by
    descending logit, filtered per row by ``temperature``, ``top_k`` (<= 0: all K) and ``top_p`` ``[B]``;
    ``temperature == 0`` picks index 0 (greedy)."""
    x = values.float()
    k = x.shape[-1]
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    x = x / t[:, None]
    rank = torch.arange(k, device=x.device)[None, :]
    kk = torch.where(top_k <= 0, torch.full_like(top_k, k), top_k).to(torch.int64)
    in_k = rank < kk[:, None]
    x = torch.where(in_k, x, torch.full_like(x, float("-inf")))
    p = torch.softmax(x, dim=-1)
    before = torch.cumsum(p, dim=-1) - p
    keep = in_k & ((before < top_p.float()[:, None]) | (rank == 0))  # the top candidate always (any top_p)
    w = torch.where(keep, p, torch.zeros_like(p))
    cdf = torch.cumsum(w, dim=-1)
    target = u.float()[:, None] * cdf[:, -1:]
    idx = (cdf <= target).sum(dim=-1).clamp(max=k - 1)
    return torch.where(greedy, torch.zeros_like(idx), idx)


def seeded_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  seed_lo: torch.Tensor, seed_hi: torch.Tensor, counter: torch.Tensor,
                  candidates: int | None = None) -> torch.Tensor:
    """Token ids ``[B]`` from ``logits [B, V]``: the top ``candidates`` tokens (default all V; NxDI's
    ``global_topk`` on device) sorted by descending logit, then :func:`draw_sorted` at this row's
    :func:`uniforms`."""
    k = logits.shape[-1] if candidates is None else min(candidates, logits.shape[-1])
    values, ids = torch.topk(logits.float(), k, dim=-1)
    idx = draw_sorted(values, temperature, top_k, top_p, uniforms(seed_lo, seed_hi, counter))
    return ids.gather(-1, idx[:, None]).squeeze(-1)
