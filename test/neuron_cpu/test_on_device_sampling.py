"""On-device sampling (``neuron.sampling``) in NxDI's CPU mode, at this process's TP degree.

Oracles: the reference engine's greedy tokens (graded against transformers elsewhere) for greedy; for sampling,
the draw of :func:`minimax_m3.ops.seeded_sampling.seeded_sample` (graded in ``test/unit/test_seeded_sampling.py``
against the reference distribution by hand and by chi-square) applied to the same step's logits, which the build
also returns (``output_logits``); the same sequence's tokens in a batch-of-one build. Tokens leave the traced
model as int32 ids, one per row and call.
"""

import dataclasses

import pytest
import torch

from minimax_m3.config import M3Config

pytestmark = pytest.mark.neuron_cpu
STEPS = 6
PROMPTS = [[7, 300, 12, 45, 99, 3, 18, 250, 61, 5] * 3, [3, 4, 5], [400, 2, 90, 61, 11, 260, 19, 8]]
SEEDS = [11, 12345, 2**31 + 5]
GLOBAL_TOPK = 512  # the tiny vocabulary: every token is a candidate, so the draw is exact


def _app(ckpt, batch: int, all_logits: bool = False):
    from minimax_m3.neuron.nxd_compat import to_cpu as _to_cpu
    from minimax_m3.neuron.build import application, inference_config
    from minimax_m3.neuron.sampling import on_device_sampling_config

    from test.support.neuron.cpu_plugin import nxdi_spec

    spec, m3 = nxdi_spec(ckpt, max_batch=batch, max_seq_len=96, max_context_len=80, continuous_batching=False,
                         all_logits=all_logits)
    config = inference_config(spec, m3, output_logits=True,
                              on_device_sampling_config=on_device_sampling_config(global_topk=GLOBAL_TOPK))
    app = application(str(ckpt), config)
    _to_cpu(app)
    return app


@torch.no_grad()
def _run(app, prompts, sp):
    """Static batch: one prefill, then STEPS - 1 decode steps; tokens [B, STEPS] and logits [B, STEPS, V]."""
    b, width = len(prompts), max(len(p) for p in prompts)
    ids, pos, mask = (torch.zeros(b, width, dtype=torch.long) for _ in range(3))
    for r, p in enumerate(prompts):
        ids[r, : len(p)], pos[r, : len(p)], mask[r, : len(p)] = torch.tensor(p), torch.arange(len(p)), 1
    app.reset()
    out = app(input_ids=ids, attention_mask=mask, position_ids=pos, seq_ids=torch.arange(b), sampling_params=sp)
    first = out.logits[:, -1]
    if out.logits.shape[1] > 1:  # an all-logits build: every position, the last real one is the prompt's
        last = torch.tensor([len(p) - 1 for p in prompts]).view(-1, 1, 1).expand(-1, 1, out.logits.shape[-1])
        first = out.logits.gather(1, last)[:, 0]
    toks, logits = [out.tokens.reshape(-1)], [first.float()]
    cur = torch.tensor([len(p) for p in prompts])
    for _ in range(STEPS - 1):
        out = app(input_ids=toks[-1].view(-1, 1).long(), position_ids=cur.view(-1, 1), seq_ids=torch.arange(b),
                  sampling_params=sp)
        toks.append(out.tokens.reshape(-1))
        logits.append(out.logits[:, -1].float())
        cur = cur + 1
    return torch.stack(toks, 1), torch.stack(logits, 1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from minimax_m3.checkpoint.synthetic import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("m3") / "tiny", M3Config.preset("tiny"), seed=0)


@pytest.fixture(scope="module")
def apps(ckpt):
    return _app(ckpt, 3), _app(ckpt, 1)


def _sp(rows):
    from minimax_m3.neuron.sampling import params

    return params(rows, GLOBAL_TOPK)


def test_greedy_tokens_equal_the_golden(apps, ckpt):
    from minimax_m3.engine import GenerationConfig
    from minimax_m3.reference.engine import ReferenceEngine

    ref = ReferenceEngine.from_pretrained(str(ckpt), device="cpu", dtype="float32", max_seq_len=128)
    want = [r.tokens for r in ref.generate(PROMPTS, GenerationConfig(max_new_tokens=STEPS))]
    toks, logits = _run(apps[0], PROMPTS, _sp([(0, 1.0, 0.0, None)] * 3))
    assert toks.dtype == torch.int32 and toks.tolist() == want
    assert torch.equal(toks.long(), logits.argmax(-1))  # the logits returned on request are the step's own


SETTINGS = [(0, 1.0, 1.0), (20, 1.0, 0.8), (0, 0.9, 1.3)]  # (top_k, top_p, temperature) per row


def test_sampled_tokens_are_the_seeded_draw_of_each_steps_logits(apps):
    from minimax_m3.ops.seeded_sampling import seed_words, seeded_sample

    rows = [(*s, seed) for s, seed in zip(SETTINGS, SEEDS)]
    toks, logits = _run(apps[0], PROMPTS, _sp(rows))
    for r, (k, p, t, seed) in enumerate(rows):
        lo, hi = seed_words(seed)
        pos = torch.arange(STEPS) + len(PROMPTS[r]) - 1  # the position of the token each draw follows
        want = seeded_sample(logits[r], torch.full((STEPS,), t), torch.full((STEPS,), k), torch.full((STEPS,), p),
                             torch.full((STEPS,), float(lo)), torch.full((STEPS,), float(hi)), pos)
        assert toks[r].tolist() == want.tolist(), r
    assert toks[0].tolist() != logits[0].argmax(-1).tolist()  # these seeds do sample off the argmax


def test_a_sequence_samples_the_same_tokens_alone_and_in_a_batch_of_3(apps):
    batch, alone = apps
    rows = [(*s, seed) for s, seed in zip(SETTINGS, SEEDS)]
    in_batch, _ = _run(batch, PROMPTS, _sp(rows))
    for r in range(3):
        solo, _ = _run(alone, [PROMPTS[r]], _sp([rows[r]]))
        assert solo[0].tolist() == in_batch[r].tolist(), r
    # other neighbours, other seeds around row 1: row 1 unchanged
    swapped, _ = _run(batch, [PROMPTS[2], PROMPTS[1], PROMPTS[0]], _sp([rows[2], rows[1], (0, 1.0, 1.0, 999)]))
    assert swapped[1].tolist() == in_batch[1].tolist()


def test_an_all_logits_build_samples_after_the_last_real_token(apps, ckpt):
    """A ``prefill_all_logits`` build's prefill returns every position: the draw still follows each prompt's last
    real token (a one-token prompt included), as in the default build."""
    alone = apps[1]
    scoring = _app(ckpt, 1, all_logits=True)
    for prompt, row in (([42], (0, 1.0, 1.0, 7)), (PROMPTS[1], (0, 1.0, 1.0, 8)), (PROMPTS[0], (5, 0.9, 0.7, 9))):
        assert _run(scoring, [prompt], _sp([row]))[0].tolist() == _run(alone, [prompt], _sp([row]))[0].tolist()


def test_bad_sampling_params_are_one_error(apps):
    from minimax_m3.neuron.sampling import WIDTH

    app = apps[1]
    with pytest.raises(ValueError, match="seed columns must be integers"):
        app.validate_sampling_params(torch.tensor([[1.0, 1.0, 1.0, 0.5, 0.0]]))
    with pytest.raises(ValueError, match=rf"\[batch, {WIDTH}\]"):
        app.validate_sampling_params(torch.ones(1, 4))


def test_the_engine_drives_on_device_sampling(ckpt):
    """``--on-device-sampling`` through ``load_engine(spec)`` and the one generation loop: only token ids leave the
    build. Greedy: the reference engine's tokens (graded against transformers elsewhere). Sampled (one seed for every
    sequence, as the loop's contract): each sequence gets the same tokens alone as in a continuous batch of 3 with
    staggered lengths, and the draw does leave the argmax."""
    from minimax_m3.load import load_engine
    from minimax_m3.engine import GenerationConfig, StepOutput
    from minimax_m3.reference.engine import ReferenceEngine
    from minimax_m3.engine.spec import EngineSpec

    from test.support.neuron.cpu_plugin import world_size

    def engine(batch):
        return load_engine(EngineSpec(str(ckpt), backend="neuron-cpu", tp=world_size(), dtype="float32",
                                      max_seq_len=96, max_context_len=80, max_batch=batch, on_device_sampling=True))

    batched, alone = engine(3), engine(1)
    out = batched.provider.decode([5], [3], [0])
    assert isinstance(out, StepOutput) and out.logits is None and out.token_ids.dtype == torch.int32
    ref = ReferenceEngine.from_pretrained(str(ckpt), device="cpu", dtype="float32", max_seq_len=128)
    greedy = GenerationConfig(max_new_tokens=STEPS)
    want = [r.tokens for r in ref.generate(PROMPTS, greedy)]
    assert [r.tokens for r in batched.generate(PROMPTS, greedy)] == want
    sampled = GenerationConfig(max_new_tokens=STEPS, temperature=1.0, top_k=20, seed=1234)
    together = [r.tokens for r in batched.generate(PROMPTS, dataclasses.replace(sampled, max_new_tokens=STEPS))]
    assert together == [alone.generate([p], sampled)[0].tokens for p in PROMPTS]
    assert together != want
    with pytest.raises(Exception, match="return_logits needs logits"):
        batched.generate(PROMPTS[:1], dataclasses.replace(greedy, return_logits=True))
