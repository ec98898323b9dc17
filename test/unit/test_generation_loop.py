"""The one generation loop (:class:`minimax_m3.engine.Engine`) over a fake step provider whose logits are computed by
hand: after token t the next token is (t + 1) mod V, by a margin of 10. So every expected token list below is
written out by hand; the provider records every call so batching and admission can be checked too."""

from types import SimpleNamespace

import pytest
import torch

from minimax_m3.engine import TIMING_KEYS, Engine, EngineInputError, GenerationConfig, StepOutput

V = 16


class Fake:
    """A provider: cache slots hold each sequence's last token; logits favour (last + 1) % V."""

    def __init__(self, max_batch=2, continuous=True, max_seq_len=64, max_context_len=32, flat=False, ids=False):
        self.config = SimpleNamespace(vocab_size=V)
        self.max_batch, self.continuous = max_batch, continuous
        self.max_seq_len, self.max_context_len = max_seq_len, max_context_len
        self.flat, self.ids = flat, ids  # flat: equal logits (sampling decides); ids: return chosen ids only
        self.calls = []

    def _logits(self, last: list[int], pos: list[int]) -> torch.Tensor:
        x = torch.zeros(len(last), V)
        for i, (t, p) in enumerate(zip(last, pos)):
            x[i] = 0.01 * ((torch.arange(V) * (p + 3)) % 7) if self.flat else 0.0
            if not self.flat:
                x[i, (t + 1) % V] = 10.0
        if self.ids:
            return StepOutput(token_ids=x.argmax(-1))
        return x

    def prefill(self, prompts, slots, max_len):
        self.calls.append(("prefill", list(slots), [len(p) for p in prompts]))
        return self._logits([p[-1] for p in prompts], [len(p) - 1 for p in prompts])

    def decode(self, tokens, positions, slots):
        self.calls.append(("decode", list(slots), list(positions)))
        return self._logits(tokens, positions)

    def prefill_logits(self, prompts):
        self.calls.append(("prefill_logits", len(prompts)))
        return [torch.zeros(len(p), V) for p in prompts]


def test_greedy_tokens_follow_the_logits_by_hand():
    eng = Engine(Fake())
    res = eng.generate([[3], [14, 15]], GenerationConfig(max_new_tokens=4))
    assert [r.tokens for r in res] == [[4, 5, 6, 7], [0, 1, 2, 3]]
    assert [r.finish_reason for r in res] == ["length", "length"]
    assert [r.prompt_len for r in res] == [1, 2]


def test_eos_and_stop_sequences_end_each_sequence_and_keep_the_token():
    eng = Engine(Fake())
    a, b = eng.generate([[3], [9]], GenerationConfig(max_new_tokens=8, eos_token_ids=(6,), stop_sequences=((11, 12),)))
    assert (a.tokens, a.finish_reason) == ([4, 5, 6], "eos")
    assert (b.tokens, b.finish_reason) == ([10, 11, 12], "stop")


def test_continuous_admission_refills_a_free_slot_while_the_other_decodes():
    fake = Fake(max_batch=2, continuous=True)
    res = Engine(fake).generate([[1], [3], [7]], GenerationConfig(max_new_tokens=5, eos_token_ids=(3,)))
    assert [r.tokens for r in res] == [[2, 3], [4, 5, 6, 7, 8], [8, 9, 10, 11, 12]]
    assert fake.calls == [
        ("prefill", [0], [1]), ("prefill", [1], [1]),
        ("decode", [0, 1], [1, 1]),  # token 2 at position 1 of slot 0; token 4 at position 1 of slot 1
        ("prefill", [0], [1]),  # the first request ended with 3: its slot takes the third prompt
        ("decode", [0, 1], [1, 2]), ("decode", [0, 1], [2, 3]), ("decode", [0, 1], [3, 4]),
        ("decode", [0], [4]),  # slot 1 is done: only slot 0 decodes
    ]


def test_static_provider_admits_a_new_group_only_when_every_slot_is_free():
    fake = Fake(max_batch=2, continuous=False)
    Engine(fake).generate([[1], [3], [7]], GenerationConfig(max_new_tokens=3, eos_token_ids=(3,)))
    assert fake.calls == [("prefill", [0, 1], [1, 1]), ("decode", [0, 1], [1, 1]), ("decode", [1], [2]),
                          ("prefill", [0], [1]), ("decode", [0], [1]), ("decode", [0], [2])]


def test_seeded_sampling_is_the_same_alone_or_in_any_batch():
    gen = GenerationConfig(max_new_tokens=12, temperature=1.0, seed=5)
    prompts = [[1, 2], [3], [4, 5, 6]]
    alone = [Engine(Fake(flat=True)).generate([p], gen)[0].tokens for p in prompts]
    for batch, continuous in ((2, True), (3, False), (1, True)):
        got = Engine(Fake(max_batch=batch, continuous=continuous, flat=True)).generate(prompts, gen)
        assert [r.tokens for r in got] == alone
    assert len({tuple(t) for t in alone}) > 1  # the logits differ by position, so the draws do too
    other = Engine(Fake(flat=True)).generate([prompts[0]], GenerationConfig(max_new_tokens=12, temperature=1.0,
                                                                             seed=6))[0].tokens
    assert other != alone[0]


def test_return_logits_and_the_same_timing_fields_for_every_result():
    res = Engine(Fake(max_batch=1)).generate([[3], [5]], GenerationConfig(max_new_tokens=3, return_logits=True))
    for r, first in zip(res, (3, 5)):
        assert r.step_logits.shape == (3, V) and r.step_logits.dtype == torch.float32
        assert r.step_logits.argmax(-1).tolist() == [(first + k) % V for k in (1, 2, 3)]
        assert tuple(r.timings) == TIMING_KEYS
        assert len(r.timings["decode_step_s"]) == 2  # tokens 2 and 3 come from decode steps
        t = r.timings
        assert 0 <= t["queue_s"] <= t["ttft_s"] <= t["total_s"] and t["prefill_s"] <= t["ttft_s"]
    assert res[1].timings["queue_s"] >= res[0].timings["total_s"] - 1e-3  # one slot: the second waited


def test_on_device_sampling_ids_are_taken_as_chosen():
    res = Engine(Fake(ids=True)).generate([[3]], GenerationConfig(max_new_tokens=3, temperature=1.0, seed=0))
    assert res[0].tokens == [4, 5, 6]
    with pytest.raises(EngineInputError, match="return_logits needs logits"):
        Engine(Fake(ids=True)).generate([[3]], GenerationConfig(max_new_tokens=2, return_logits=True))


@pytest.mark.parametrize("prompts,new,match", [
    ([], 1, "no prompts given"),
    ([[1], []], 1, "prompt 1 is empty"),
    ([[1, V]], 1, r"outside the vocabulary \[0, 16\): \[16\]"),
    ([[1] * 33], 1, "33 tokens, more than max_context_len=32"),
    ([[1] * 30], 40, "with 40 new tokens that exceeds max_seq_len=64"),
])
def test_input_checks(prompts, new, match):
    eng = Engine(Fake())
    with pytest.raises(EngineInputError, match=match):
        eng.generate(prompts, GenerationConfig(max_new_tokens=new))
    if new == 1:
        with pytest.raises(EngineInputError, match=match):
            eng.prefill_logits(prompts)


def test_prefill_logits_in_groups_of_max_batch():
    fake = Fake(max_batch=2)
    out = Engine(fake).prefill_logits([[1], [2, 3], [4, 5, 6]])
    assert [o.shape for o in out] == [(1, V), (2, V), (3, V)]
    assert fake.calls == [("prefill_logits", 2), ("prefill_logits", 1)]
