"""The vLLM Neuron model's on-device sampling (``minimax_m3.vllm_neuron.sampling``), graded against exact hand
computations on a five-token vocabulary: the filtered distribution (top-k, then the smallest prefix whose mass
reaches top-p, vLLM's semantics) written out with ``math.exp``, the token a given uniform selects (inverse CDF), and
20,000 seeded draws whose frequencies stay within 5 standard deviations of those probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from minimax_m3.errors import ServingError
from minimax_m3.vllm_neuron import sampling
from minimax_m3.vllm_neuron.contract import Layout, check_serving

LOGITS = [1.0, 3.0, -1.0, 0.0, 2.0]  # by descending logit: token 1, 4, 0, 3, 2


def _probs(temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """By hand: the top ``top_k`` tokens' softmax at ``temperature``, cut to the smallest prefix whose mass reaches
    ``top_p`` (a token stays when the mass before it is < top_p), renormalised."""
    order = sorted(range(5), key=lambda i: -LOGITS[i])[:top_k]
    w = [math.exp(LOGITS[i] / temperature) for i in order]
    p = [x / sum(w) for x in w]
    kept, before = [], 0.0
    for tok, q in zip(order, p):
        if before < top_p:
            kept.append((tok, q))
        before += q
    z = sum(q for _, q in kept)
    return {tok: q / z for tok, q in kept}


def _row(top_k: float, top_p: float, temperature: float) -> torch.Tensor:
    return torch.tensor([[top_k, top_p, temperature]])


@pytest.mark.parametrize("top_k,top_p,temperature", [(3, 0.9, 1.0), (-1, 1.0, 0.7), (4, 0.5, 2.0), (2, 1.0, 1.0)])
def test_the_uniform_selects_the_inverse_cdf_token(monkeypatch, top_k, top_p, temperature):
    probs = _probs(temperature, top_k if top_k > 0 else 5, top_p)
    cdf, acc = [], 0.0
    for tok, q in probs.items():
        acc += q
        cdf.append((acc, tok))
    for u in (0.0, 0.1, 0.3, 0.5, 0.77, 0.95, 0.999):
        want = next(tok for edge, tok in cdf if u < edge - 1e-6 or edge == cdf[-1][0])
        monkeypatch.setattr(torch, "rand", lambda n, device=None, u=u: torch.full((n,), u))
        got = sampling.sample(torch.tensor([LOGITS]), _row(top_k, top_p, temperature), sampling.OnDeviceSampling())
        assert got.dtype == torch.int32 and int(got[0]) == want, (u, probs)


def test_frequencies_match_the_hand_probabilities():
    torch.manual_seed(0)
    n, rows = 20_000, torch.tensor([LOGITS]).expand(20_000, 5)
    got = sampling.sample(rows, _row(4, 0.9, 1.3).expand(n, 3), sampling.OnDeviceSampling())
    probs = _probs(1.3, 4, 0.9)
    counts = torch.bincount(got.long(), minlength=5).tolist()
    for tok in range(5):
        p = probs.get(tok, 0.0)
        assert abs(counts[tok] / n - p) <= 5 * math.sqrt(max(p * (1 - p), 1e-12) / n), (tok, counts, probs)
    # token 2 cut by top-k (the 5th), token 3 by top-p (0.944 of the mass before it, >= 0.9)
    assert counts[2] == counts[3] == 0 and len(probs) == 3


def test_greedy_rows_padding_rows_and_the_switches():
    logits = torch.tensor([LOGITS] * 4)
    sp = torch.tensor([[4, 1.0, 0.0], [4, 1.0, 5e-6], [0, 0.0, 0.0], [-1, 1.0, 0.0]])  # greedy, eps, padding, greedy
    assert sampling.sample(logits, sp, sampling.OnDeviceSampling()).tolist() == [1, 1, 1, 1]
    hot = torch.tensor([[-1, 1.0, 50.0]]).expand(200, 3)  # nearly uniform draws: greedy switches must win
    assert set(sampling.sample(logits[:1].expand(200, 5), hot, sampling.OnDeviceSampling(all_greedy=True)).tolist()) \
        == {1}
    assert sampling.sample(logits, None, sampling.OnDeviceSampling()).tolist() == [1, 1, 1, 1]
    # deterministic: the uniform is 0.5 (hand: top-2 at T=1 puts 0.731 on token 1)
    assert int(sampling.sample(logits[:1], _row(2, 1.0, 1.0), sampling.OnDeviceSampling(deterministic=True))[0]) == 1
    # max_top_k caps the candidates below a request's top_k
    capped = sampling.sample(logits[:1].expand(200, 5), hot, sampling.OnDeviceSampling(max_top_k=2))
    assert set(capped.tolist()) == {1, 4}


def test_the_logit_mask_removes_tokens_before_the_draw():
    mask = torch.tensor([[True, False, True, True, True]])  # token 1 (the best) not allowed
    assert int(sampling.sample(torch.tensor([LOGITS]), _row(-1, 1.0, 0.0), sampling.OnDeviceSampling(), mask)[0]) == 4
    torch.manual_seed(1)
    many = sampling.sample(torch.tensor([LOGITS]).expand(2000, 5), _row(-1, 1.0, 1.0).expand(2000, 3),
                           sampling.OnDeviceSampling(), mask.expand(2000, 5))
    assert 1 not in set(many.tolist())


def test_config_problems_name_the_field():
    assert sampling.config_problems(None) == [] and sampling.config(None) is None
    assert sampling.config({}) == sampling.OnDeviceSampling()
    bad = sampling.config_problems({"max_top_k": 0, "sampling_dp_degree": 2, "capture_topk": True, "top_n": 3})
    assert len(bad) == 4 and all(p.startswith("on_device_sampling_config") for p in bad)
    from minimax_m3.config import M3Config

    class NC:
        on_device_sampling_config = {"deterministic": True}

    c = M3Config.preset("tiny")
    check_serving(c, None, Layout(dtype=torch.float32), NC())  # served
    NC.on_device_sampling_config = {"capture_topk": True}
    with pytest.raises(ServingError, match="capture_topk"):
        check_serving(c, None, Layout(dtype=torch.float32), NC())


def _onehot_logits(best: list[int], vocab: int = 5) -> torch.Tensor:
    x = torch.zeros(len(best), vocab)
    x[torch.arange(len(best)), torch.tensor(best)] = 8.0
    return x


def test_verify_keeps_the_drafts_equal_to_the_targets_choices():
    """Greedy rows (temperature 0), k = 3, by hand: the target's argmax after each token of ``[last, d1, d2, d3]``;
    row 0 accepts 2 drafts then takes the target's token, row 1 all 3 then the bonus, row 2 none; row 3's second
    draft equals the target's choice but the runner padded that slot (not real): not accepted."""
    best = [[1, 2, 3, 4], [0, 1, 2, 3], [4, 4, 4, 4], [2, 3, 0, 0]]
    tokens = torch.tensor([[9, 1, 2, 0], [9, 0, 1, 2], [9, 3, 4, 4], [9, 2, 3, 0]])
    real = torch.ones(4, 4, dtype=torch.bool)
    real[3, 2:] = False
    logits = _onehot_logits(sum(best, []))
    out, last = sampling.verify(logits, tokens, real, torch.zeros(4, 3), sampling.OnDeviceSampling())
    assert out.tolist() == [[1, 2, 3, -1], [0, 1, 2, 3], [4, -1, -1, -1], [2, 3, -1, -1]]
    assert last.tolist() == [3, 3, 4, 3] and out.dtype == last.dtype == torch.int32


def test_verify_samples_each_position_from_the_targets_distribution():
    """Temperature 1, k = 1, a 5-token vocabulary: the first emitted token is the target's draw at position 0
    (accepted draft or not), so it follows the target's softmax there whatever the draft (20,000 rows within 5σ of
    the hand probabilities); the draft (token 0) is accepted exactly when the draw hits it."""
    rows = 20000
    logits = torch.tensor([LOGITS, [0.0] * 5]).repeat(rows, 1)
    tokens = torch.tensor([[7, 0]]).repeat(rows, 1)
    params = _row(-1, 1.0, 1.0).expand(rows, 3)
    out, last = sampling.verify(logits, tokens, torch.ones(rows, 2, dtype=torch.bool), params,
                                sampling.OnDeviceSampling())
    p = torch.softmax(torch.tensor(LOGITS), -1)
    freq = torch.bincount(out[:, 0].long(), minlength=5).float() / rows
    assert ((freq - p).abs() <= 5 * (p * (1 - p) / rows).sqrt()).all(), (freq, p)
    accepted = out[:, 1] >= 0
    assert torch.equal(accepted, out[:, 0] == 0) and torch.equal(last, torch.where(accepted, out[:, 1], out[:, 0]))
