"""``ops.seeded_sampling``: the per-sequence seeded draw of on-device sampling.

Oracles: the hash by hand in Python integers (uint32 arithmetic, independent of torch's int32 wrap-around); the
inverse CDF of :func:`minimax_m3.ops.sampling.filter_logits`'s distribution (the reference backend's sampler) at the
same uniform; a chi-square test of the draw frequencies against that distribution; hand-computed small cases.
"""

import math

import pytest
import torch

from minimax_m3.ops.sampling import filter_logits
from minimax_m3.ops.seeded_sampling import draw_sorted, seed_words, seeded_sample, uniforms

M32 = 0xFFFFFFFF


def _fmix(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & M32
    return h ^ (h >> 16)


def _uniform_by_hand(seed: int, counter: int) -> float:
    s, c = seed & M32, counter & M32
    h = _fmix(_fmix(s ^ 0x9E3779B9) ^ ((c * 0x9E3779B9) & M32))
    h = _fmix((h + c) & M32)
    return (h >> 8) / (1 << 24)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**31 + 7, 2**32 - 1])
def test_uniforms_equal_the_hash_by_hand(seed):
    lo, hi = seed_words(seed)
    counters = [0, 1, 2, 77, 4095, 131071, 2**31 - 1]
    got = uniforms(torch.full((len(counters),), float(lo)), torch.full((len(counters),), float(hi)),
                   torch.tensor(counters))
    assert got.dtype == torch.float32
    assert got.tolist() == [_uniform_by_hand(seed, c) for c in counters]


def test_a_row_does_not_depend_on_its_batch():
    lo, hi, c = torch.tensor([3.0, 9.0, 40000.0]), torch.tensor([0.0, 1.0, 65535.0]), torch.tensor([5, 6, 7])
    batch = uniforms(lo, hi, c)
    alone = torch.cat([uniforms(lo[i:i + 1], hi[i:i + 1], c[i:i + 1]) for i in range(3)])
    assert torch.equal(batch, alone)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    t, k, p = torch.tensor([0.7, 1.0, 1.3]), torch.tensor([0, 10, 5]), torch.tensor([0.9, 1.0, 0.5])
    full = seeded_sample(logits, t, k, p, lo, hi, c)
    one = torch.cat([seeded_sample(logits[i:i + 1], t[i:i + 1], k[i:i + 1], p[i:i + 1], lo[i:i + 1], hi[i:i + 1],
                                   c[i:i + 1]) for i in range(3)])
    assert torch.equal(full, one)


def test_uniforms_are_uniform():
    n = 200_000
    i = torch.arange(n)
    u = uniforms(torch.full((n,), 7.0), torch.zeros(n), i)  # one sequence, successive positions
    hist = torch.histc(u, bins=20, min=0.0, max=1.0)
    chi2 = float(((hist - n / 20) ** 2 / (n / 20)).sum())
    assert chi2 < 43.8  # chi-square, 19 degrees of freedom, p = 0.001
    v = uniforms(i.float() % 65536, (i // 65536).float(), torch.zeros(n))  # successive seeds, same position
    assert abs(float(v.mean()) - 0.5) < 0.005 and abs(float(v.var()) - 1 / 12) < 0.002


def _oracle(logits, temperature, top_k, top_p, u):
    """Inverse CDF at ``u`` of softmax(filter_logits(...)) over tokens in descending-logit order."""
    probs = torch.softmax(filter_logits(logits[None], temperature, top_k, top_p)[0], dim=-1).double()
    order = torch.argsort(logits, descending=True, stable=True)
    cdf = torch.cumsum(probs[order], 0)
    j = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    return int(order[min(j, len(order) - 1)]), cdf


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 7, 1.0), (1.3, 0, 0.8),
                                                      (0.8, 12, 0.6), (2.0, 3, 0.95)])
def test_same_uniform_gives_the_reference_token(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(1)
    checked = 0
    for trial in range(40):
        logits = torch.randn(40, generator=g) * 2
        values, ids = torch.sort(logits, descending=True)
        for u in torch.rand(25, generator=g).tolist():
            want, cdf = _oracle(logits, temperature, top_k, top_p, u)
            if (cdf - u * float(cdf[-1])).abs().min() < 1e-5:
                continue  # a uniform on a CDF step: float32 vs float64 rounding may pick either side
            idx = draw_sorted(values[None], torch.tensor([temperature]), torch.tensor([top_k]), torch.tensor([top_p]),
                              torch.tensor([u]))
            assert int(ids[idx]) == want, (trial, u)
            checked += 1
    assert checked > 900


def test_hand_cases():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    one = torch.ones(1)
    # top_p 0.7: the mass before token 1 is 0.5 < 0.7, so it stays (ops.filter_logits' rule); token 2 is dropped
    kept = lambda u: int(draw_sorted(logits, one, torch.tensor([0]), torch.tensor([0.7]), torch.tensor([u])))  # noqa
    assert [kept(u) for u in (0.0, 0.6, 0.62, 0.63, 0.99)] == [0, 0, 0, 1, 1]  # 0.5 / 0.8 = 0.625
    # no filtering: plain inverse CDF [0.5, 0.8, 1.0]
    plain = lambda u: int(draw_sorted(logits, one, torch.tensor([0]), one, torch.tensor([u])))  # noqa
    assert [plain(u) for u in (0.49, 0.51, 0.79, 0.81, 0.999)] == [0, 1, 1, 2, 2]
    # top_k 1 or temperature 0: greedy
    assert int(draw_sorted(logits, one, torch.tensor([1]), one, torch.tensor([0.99]))) == 0
    assert int(draw_sorted(logits, torch.zeros(1), torch.tensor([0]), one, torch.tensor([0.99]))) == 0


def test_greedy_rows_take_the_argmax():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    z = torch.zeros(6)
    got = seeded_sample(logits, z, torch.zeros(6, dtype=torch.long), torch.ones(6), z, z, torch.arange(6),
                        candidates=64)
    assert torch.equal(got, logits.argmax(-1))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.5, 0, 0.75)])
def test_draw_frequencies_match_the_reference_distribution(temperature, top_k, top_p):
    v, n = 10, 40_000
    logits = torch.randn(v, generator=torch.Generator().manual_seed(5))
    probs = torch.softmax(filter_logits(logits[None], temperature, top_k, top_p)[0], dim=-1).double()
    seeds = torch.arange(n)
    toks = seeded_sample(logits.expand(n, v), torch.full((n,), temperature), torch.full((n,), top_k),
                         torch.full((n,), top_p), (seeds % 65536).float(), (seeds // 65536).float(),
                         torch.full((n,), 11))
    counts = torch.bincount(toks, minlength=v).double()
    assert counts[probs == 0].sum() == 0  # never a filtered token
    live = probs > 0
    chi2 = float(((counts[live] - n * probs[live]) ** 2 / (n * probs[live])).sum())
    dof = int(live.sum()) - 1
    # chi-square quantile at p = 0.001 (Wilson-Hilferty), a fixed-seed test: fails only on a wrong distribution
    z = 3.09
    bound = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < bound, (chi2, bound)
