"""Speculative decoding in the one generation loop, over a fake provider whose logits are written by hand (after
token t the target's next token is (t + 1) mod V) and whose drafts agree with the target where a pattern says: every
expected token list, draft count and acceptance below is worked out by hand. Sampling: the output distribution of
speculative sampling is the target's own (the oracle: the target's distribution, by counting over many seeds), and a
sequence's tokens depend on its seed alone."""

from types import SimpleNamespace

import pytest
import torch

from minimax_m3.engine import SPEC_TIMING_KEYS, TIMING_KEYS, Engine, GenerationConfig
from minimax_m3.engine import speculative

V = 16


class FakeSpec:
    """Target: (last + 1) % V by a margin of 10 (``flat``: fixed logits ``target`` whatever the token). Drafter:
    proposes the target's token where ``agree(position)``, the one after it elsewhere (``flat``: logits ``draft``)."""

    def __init__(self, agree=lambda pos: True, k=3, target=None, draft=None):
        self.config = SimpleNamespace(vocab_size=V)
        self.max_batch, self.continuous, self.max_seq_len, self.max_context_len = 2, True, 64, 32
        self.speculative_tokens, self.agree, self.target, self.draft = k, agree, target, draft
        self.calls = []

    def _row(self, last: int) -> torch.Tensor:
        if self.target is not None:
            return self.target.clone()
        x = torch.zeros(V)
        x[(last + 1) % V] = 10.0
        return x

    def prefill(self, prompts, slots, max_len):
        self.calls.append(("prefill", list(slots)))
        return torch.stack([self._row(p[-1]) for p in prompts])

    def decode(self, tokens, positions, slots):
        raise AssertionError("a speculating engine verifies; it never decodes one token")

    def prefill_logits(self, prompts):
        return [torch.zeros(len(p), V) for p in prompts]

    def propose(self, slots, lasts, positions, ks, choose):
        out = []
        for i, (last, pos, k) in enumerate(zip(lasts, positions, ks)):
            drafted, prev = [], last
            for j in range(k):
                if self.draft is not None:
                    logits = self.draft.clone()
                else:
                    want = (prev + 1) % V
                    logits = torch.zeros(V)
                    logits[want if self.agree(pos + 1 + j) else (want + 1) % V] = 5.0
                drafted.append(choose(i, j, logits))
                prev = drafted[-1]
            out.append(drafted)
        self.calls.append(("propose", list(slots), list(positions), list(ks)))
        return out

    def verify(self, slots, tokens, positions):
        self.calls.append(("verify", list(slots), [list(t) for t in tokens], list(positions)))
        return [torch.stack([self._row(t) for t in toks]) for toks in tokens]

    def accept(self, slots, accepted):
        self.calls.append(("accept", list(slots), list(accepted)))


def test_all_drafts_agree_by_hand():
    fake = FakeSpec()
    res = Engine(fake).generate([[3]], GenerationConfig(max_new_tokens=8))[0]
    # prefill: 4 (position 1). Step 1: drafts 5, 6, 7 accepted + 8. Step 2: 3 tokens left, so 2 drafts (9, 10) + 11.
    assert res.tokens == list(range(4, 12)) and res.finish_reason == "length"
    assert [c for c in fake.calls if c[0] == "verify"] == [("verify", [0], [[4, 5, 6, 7]], [1]),
                                                           ("verify", [0], [[8, 9, 10]], [5])]
    assert [c for c in fake.calls if c[0] == "accept"] == [("accept", [0], [3]), ("accept", [0], [2])]
    t = res.timings
    assert tuple(t) == TIMING_KEYS + SPEC_TIMING_KEYS and len(t["decode_step_s"]) == 2
    assert (t["spec_steps"], t["draft_tokens"], t["accepted_tokens"], t["acceptance_length"]) == (2, 5, 5, 3.5)


def test_a_rejected_draft_ends_the_chain_and_the_target_token_follows():
    fake = FakeSpec(agree=lambda pos: pos != 3)
    res = Engine(fake).generate([[3]], GenerationConfig(max_new_tokens=8))[0]
    # step 1 at position 1: drafts 5 (ok), 7 (position 3: wrong), 8 -> 1 accepted, then the target's 6.
    # step 2 at position 3: 7, 8, 9 accepted + 10. Step 3: one token left: no draft, the target's 11.
    assert res.tokens == list(range(4, 12))
    assert [c[2] for c in fake.calls if c[0] == "verify"] == [[[4, 5, 7, 8]], [[6, 7, 8, 9]], [[10]]]
    t = res.timings
    assert (t["spec_steps"], t["draft_tokens"], t["accepted_tokens"]) == (3, 6, 4)
    assert t["acceptance_length"] == pytest.approx(7 / 3)


def test_eos_and_stops_inside_accepted_drafts():
    eng = Engine(FakeSpec())
    a, b = eng.generate([[3], [9]], GenerationConfig(max_new_tokens=10, eos_token_ids=(6,),
                                                     stop_sequences=((11, 12),)))
    assert (a.tokens, a.finish_reason) == ([4, 5, 6], "eos")  # 7 and 8 were accepted but come after the EOS
    assert (b.tokens, b.finish_reason) == ([10, 11, 12], "stop")


def test_return_logits_are_the_verified_rows():
    res = Engine(FakeSpec(agree=lambda pos: pos % 2 == 0)).generate([[3]], GenerationConfig(max_new_tokens=6,
                                                                                          return_logits=True))[0]
    assert res.tokens == [4, 5, 6, 7, 8, 9]
    assert [int(x.argmax()) for x in res.step_logits] == res.tokens


def test_greedy_verify_by_hand():
    rows = torch.zeros(4, V)
    for j, tok in enumerate((5, 6, 9, 2)):
        rows[j, tok] = 1.0
    greedy = GenerationConfig()
    assert speculative.verify(rows, [5, 6, 7], [None] * 3, greedy, 0, 10) == (2, 9)
    assert speculative.verify(rows, [5, 6, 9], [None] * 3, greedy, 0, 10) == (3, 2)
    assert speculative.verify(rows[:1], [], [], greedy, 0, 10) == (0, 5)


def test_device_chosen_tokens_by_hand():
    """On-device sampling: the verify step returns the target's own choice after each token; drafts are kept while
    they equal it, then its choice follows (whatever the sampling settings: the draws were the device's)."""
    assert speculative.verify_chosen([5, 6, 9, 2], [5, 6, 7]) == (2, 9)
    assert speculative.verify_chosen([5, 6, 9, 2], [5, 6, 9]) == (3, 2)
    assert speculative.verify_chosen([4, 6, 9, 2], [5, 6, 9]) == (0, 4)
    assert speculative.verify_chosen([5], []) == (0, 5)


def test_the_loop_takes_token_ids_from_a_device_that_samples():
    """A provider whose verify returns StepOutput token ids (the target: (t + 1) % V as chosen ids) gives the same
    tokens and acceptance as the logits path, sampling settings notwithstanding."""
    from minimax_m3.engine import StepOutput

    class Chosen(FakeSpec):
        def verify(self, slots, tokens, positions):
            rows = super().verify(slots, tokens, positions)
            return [StepOutput(logits=None, token_ids=r.argmax(-1)) for r in rows]

    agree = lambda pos: pos % 3 != 0  # noqa: E731
    want = Engine(FakeSpec(agree)).generate([[1, 2, 3]], GenerationConfig(max_new_tokens=10))[0]
    got = Engine(Chosen(agree)).generate([[1, 2, 3]], GenerationConfig(max_new_tokens=10, temperature=0.7,
                                                                      seed=3))[0]
    assert got.tokens == want.tokens == [(4 + i) % V for i in range(10)]
    assert got.timings["accepted_tokens"] == want.timings["accepted_tokens"] > 0


def test_a_provider_that_speculates_in_one_call():
    """A fused provider (``speculate``: drafting, verifying and accepting in one device call, k drafts per row):
    the loop appends what it emits through the same stop rules and counts k drafts per step, by hand."""

    class Fused(FakeSpec):
        def speculate(self, slots, lasts, positions):
            self.calls.append(("speculate", list(slots), list(lasts), list(positions)))
            out = []
            for last, pos in zip(lasts, positions):
                n = next((j for j in range(self.speculative_tokens) if not self.agree(pos + 1 + j)),
                         self.speculative_tokens)
                out.append([(last + 1 + j) % V for j in range(n + 1)])  # accepted drafts, then the target's
            return out

    fake = Fused(agree=lambda pos: pos != 3)
    res = Engine(fake).generate([[3]], GenerationConfig(max_new_tokens=8))[0]
    # prefill: 4 at position 1. Step at 1: drafts for positions 2 (ok), 3 (wrong): 1 accepted -> 5, 6.
    # step at 3: 3 accepted -> 7, 8, 9, 10. Step at 7: 3 accepted -> 11 (and 12, 13, 14 past the 8 asked for).
    assert res.tokens == list(range(4, 12)) and res.finish_reason == "length"
    assert [c for c in fake.calls if c[0] == "speculate"] == [("speculate", [0], [4], [1]),
                                                              ("speculate", [0], [6], [3]),
                                                              ("speculate", [0], [10], [7])]
    t = res.timings
    assert (t["spec_steps"], t["draft_tokens"], t["accepted_tokens"]) == (3, 9, 7)
    eos = Engine(Fused()).generate([[3]], GenerationConfig(max_new_tokens=10, eos_token_ids=(6,)))[0]
    assert (eos.tokens, eos.finish_reason) == ([4, 5, 6], "eos")


def _dist(logits: torch.Tensor, gen) -> torch.Tensor:
    return speculative.distribution(logits, gen)


@pytest.mark.slow
def test_speculative_sampling_keeps_the_targets_distribution():
    """Over 800 seeds, the frequency of each token at each generated position (from the prefill, accepted drafts,
    residual draws after a rejection and the token after two accepted drafts) is the target's filtered probability
    within 4 standard deviations (the seeds are fixed: the test is deterministic). The draft favours two of the
    target's tokens; two wrong rules give distributions outside that band at the first drafted position (the test
    can tell them apart): accepting every draft (the draft's q), and redrawing from p instead of max(0, p - q)."""
    gen = GenerationConfig(max_new_tokens=4, temperature=0.8, top_k=6, top_p=0.95)
    target = torch.full((V,), -1.0)
    target[:6] = torch.tensor([2.0, 2.0, 1.5, 1.5, 1.0, 0.5])
    draft = torch.full((V,), -2.0)
    draft[:2] = torch.tensor([4.0, 3.0])
    n = 800
    counts = torch.zeros(4, V)
    for seed in range(n):
        fake = FakeSpec(k=2, target=target, draft=draft)
        toks = Engine(fake).generate([[3]], GenerationConfig(**{**gen.__dict__, "seed": seed}))[0].tokens
        counts[torch.arange(4), torch.tensor(toks)] += 1
    p, q = _dist(target, gen), _dist(draft, gen)
    band = 4 * (p * (1 - p) / n).sqrt() + 1e-3
    assert ((counts / n - p).abs() <= band).all(), (counts / n - p).abs().max()
    redraw_from_p = torch.minimum(p, q) + (1 - torch.minimum(p, q).sum()) * p
    for wrong in (q, redraw_from_p):
        assert ((wrong - p).abs() > band).any()


def test_sampled_tokens_depend_on_the_seed_alone():
    g = torch.Generator().manual_seed(1)
    target, draft = torch.randn(V, generator=g), torch.randn(V, generator=g)
    gen = GenerationConfig(max_new_tokens=12, temperature=1.0, seed=7)
    alone = Engine(FakeSpec(target=target, draft=draft)).generate([[3]], gen)[0].tokens
    batched = Engine(FakeSpec(target=target, draft=draft)).generate([[5, 6], [3]], gen)[1].tokens
    assert alone == batched
    other = Engine(FakeSpec(target=target, draft=draft)).generate([[3]], GenerationConfig(
        max_new_tokens=12, temperature=1.0, seed=8))[0].tokens
    assert other != alone
    assert speculative.uniform(7, 40, speculative.ACCEPT) == speculative.uniform(7, 40, speculative.ACCEPT)
    assert speculative.uniform(7, 40, speculative.ACCEPT) != speculative.uniform(7, 40, speculative.DRAFT)
