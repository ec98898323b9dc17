"""``--decode-experts tp`` (issue 34 item 3) in NxDI's CPU mode, at this process's TP (1, or torchrun's 2 and 4): NxD's
hybrid sharding gives the decode graph its own copy of the routed experts (``mlp_op_tkg``, made by NxD's preshard
hook from the checkpoint's one set), split over every rank and read by selected expert (NxD's selective loading:
``weight[expert_index]``); prefill keeps the prefill layout. CPU mode runs no expert parallelism, so both copies
are tensor-parallel here: what this suite proves is that the decode graph runs on the copy (a copy whose values
are changed changes decode and nothing else), with the clamp of the first copy (NxD shifts the second's twice:
``nxd_compat.one_clamp_shift``), and that prefill and continuous-batching decode on it equal the golden logits.

Both cache layouts (``--kv-layout``): the sequence-sharded caches (the default) and NxDI's GQA copies
(``replicated``: every rank of a KV head's group holds its caches whole, no group collectives), whose pairing with
the copy is what the planner's fastest batch-1 decode assumes (``minimax-m3 plan --layout replicated
--decode-experts tp``).

Golden: the reference engine in float64, as ``test_sharded_caches.py`` (bound 2e-5, or 1.5x the float32
reference's own distance from the golden where float32 cannot reach it). Batch 2 of the tiny model (8 experts,
top 2): 4 token-expert pairs < 8 experts, so decode takes NxD's selective loading.
"""

import copy

import pytest
import torch

from minimax_m3.config import M3Config
from minimax_m3.engine import GenerationConfig
from test.conftest import random_ids

pytestmark = pytest.mark.neuron_cpu
TOL, FLOOR = 2e-5, 1.5
SLOTS, SEQ, CHUNK, CONTEXT, STEPS = 2, 160, 32, 128, 12
PROMPTS = [random_ids(70, seed=51), random_ids(37, seed=52), random_ids(20, seed=53)]


def _tp() -> int:
    from test.support.neuron.cpu_plugin import world_size

    return world_size()


@pytest.fixture(scope="module", params=["sharded", "replicated"])
def engines(request, tmp_path_factory):
    from minimax_m3.checkpoint.synthetic import write_synthetic
    from minimax_m3.load import load_engine
    from minimax_m3.reference.engine import ReferenceEngine

    from test.support.neuron.cpu_plugin import neuron_cpu_engine_kwargs

    config = M3Config.preset("tiny").replace(num_kv_heads=1, index_heads=1)
    ck = write_synthetic(tmp_path_factory.mktemp("tkg") / "tiny", config, seed=0)
    port = load_engine(str(ck), backend="neuron-cpu", **neuron_cpu_engine_kwargs(
        batch_size=SLOTS, max_seq_len=SEQ, max_context_length=CONTEXT, prefill_chunk=CHUNK, decode_experts="tp",
        kv_layout=request.param))
    ref = ReferenceEngine.from_pretrained(ck, device="cpu", dtype="float32", max_seq_len=256)
    golden = ReferenceEngine(copy.deepcopy(ref.model).double(), max_seq_len=256, max_batch_size=SLOTS)
    return port, ref, golden


def _experts(wrapper, layer: int = 1):
    return wrapper.model.layers[layer].moe.expert_mlps


def _err(got, want) -> float:
    return max((g.double() - w).abs().max().item() for g, w in zip(got, want))


def _bound(ref_err: float) -> float:
    return max(TOL, FLOOR * ref_err)


def test_caches_follow_the_layout(engines):
    """Sharded: each rank holds 1/G of the KV head's cache lines (G = TP here: one KV head); replicated: every rank
    holds them whole and the group is 1 (no group collectives)."""
    port, _, _ = engines
    app, tp = port.app, _tp()
    g = tp if app.config.kv_layout == "sharded" else 1
    assert app.config.num_cores_per_group == g and app.config.prefill_chunk == CHUNK
    for wrapper in (app.context_encoding_model, app.token_generation_model):
        mgr = wrapper.model.kv_mgr
        k, v = mgr.kv_lines(0)
        assert k.shape[2] == v.shape[2] == SEQ // g
        for layer in mgr.sparse_layers:
            assert mgr.index_k_cache(layer).shape[1] == SEQ // g


def test_decode_runs_on_its_own_copy_with_the_first_copys_clamp(engines):
    port, _, _ = engines
    app, tp = port.app, _tp()
    h = app.neuron_config.hybrid_sharding_config
    assert (h.moe_tkg_tp_degree, h.moe_tkg_ep_degree) == (tp, 1)
    cte, tkg = _experts(app.context_encoding_model), _experts(app.token_generation_model)
    assert cte.get_mlp_op() is cte.mlp_op and tkg.get_mlp_op() is tkg.mlp_op_tkg
    for name in ("gate_clamp_upper_limit", "up_clamp_upper_limit", "up_clamp_lower_limit"):
        assert getattr(tkg.mlp_op_tkg, name) == getattr(tkg.mlp_op, name)
    assert tkg.mlp_op.up_clamp_upper_limit == app.config.m3_config().swiglu_limit + 1  # NxD's +1 once
    # each rank holds 1/tp of every expert's intermediate width in the decode copy (gate and up: 2x)
    c = app.config.m3_config()
    w = tkg.mlp_op_tkg.gate_up_proj.weight
    assert w.shape[0] == c.num_experts and w.shape[-1] * tp == 2 * c.intermediate_size


def test_prefill_and_decode_equal_the_golden(engines):
    port, ref, golden = engines
    got, want = port.prefill_logits(PROMPTS[:2]), golden.prefill_logits(PROMPTS[:2])
    diff, ref_err = _err(got, want), _err(ref.prefill_logits(PROMPTS[:2]), want)
    assert diff <= _bound(ref_err)
    plain = golden.generate(PROMPTS[:1], GenerationConfig(max_new_tokens=STEPS))[0].tokens
    gen = GenerationConfig(max_new_tokens=STEPS, return_logits=True, eos_token_ids=(plain[2],))
    got, want, ref32 = port.generate(PROMPTS, gen), golden.generate(PROMPTS, gen), ref.generate(PROMPTS, gen)
    assert [(g.tokens, g.finish_reason) for g in got] == [(w.tokens, w.finish_reason) for w in want]
    diff = _err([g.step_logits for g in got], [w.step_logits for w in want])
    ref_err = _err([r.step_logits for r in ref32], [w.step_logits for w in want])
    print(f"\ndecode experts tp, {port.app.config.kv_layout} caches, TP {_tp()}: {STEPS} decode steps, "
          f"max |port - golden64| {diff:.2e} (float32 reference: {ref_err:.2e})")
    assert diff <= _bound(ref_err)


def test_decode_reads_the_copy_not_the_prefill_experts(engines):
    """In the decode model, zeroing the prefill copy's down projection (``mlp_op``) leaves the decode logits exactly
    as they were; zeroing the decode copy's (``mlp_op_tkg``) moves them (each restored after)."""
    port, _, _ = engines
    experts = [_experts(port.app.token_generation_model, i) for i in (1, 2, 3)]
    gen = GenerationConfig(max_new_tokens=3, return_logits=True)
    before = port.generate(PROMPTS[1:2], gen)[0].step_logits

    def zeroed(copy_name):
        weights = [getattr(e, copy_name).down_proj.weight for e in experts]
        saved = [w.detach().clone() for w in weights]
        try:
            with torch.no_grad():
                for w in weights:
                    w.zero_()
            return port.generate(PROMPTS[1:2], gen)[0].step_logits
        finally:
            with torch.no_grad():
                for w, s in zip(weights, saved):
                    w.copy_(s)

    prefill_copy, decode_copy = zeroed("mlp_op"), zeroed("mlp_op_tkg")
    assert all(torch.equal(a, b) for a, b in zip(before[1:], prefill_copy[1:]))  # step 0 is the prefill's
    assert (before[1] - decode_copy[1]).abs().max() > 1e-3


@pytest.mark.parametrize("kv_layout", ["sharded", "replicated"])
def test_fused_eagle3_on_the_copy_decodes_as_plain(tmp_path, kv_layout):
    """Fused EAGLE3 speculation (the draft in the graph, k = 3) with the decode copy, on either cache layout: the
    fused step's target reads ``mlp_op_tkg``, and its greedy tokens equal plain on-device decoding of the same
    checkpoint without the copy, on the default (sharded) caches (the fused suite's oracle,
    ``test_fused_speculation.py``). The issue's fused ITL projections assume these builds."""
    from minimax_m3.load import load_engine

    from test.support.neuron.cpu_plugin import neuron_cpu_engine_kwargs, tiny_target_and_draft

    _, ck, draft = tiny_target_and_draft(tmp_path)
    kw = neuron_cpu_engine_kwargs(batch_size=SLOTS, max_seq_len=192, max_context_length=CONTEXT,
                                  prefill_chunk=CONTEXT, on_device_sampling=True)
    fused = load_engine(str(ck), backend="neuron-cpu", draft=str(draft), num_speculative_tokens=3,
                        fused_speculation=True, decode_experts="tp", kv_layout=kv_layout, **kw)
    assert fused.app.config.kv_layout == kv_layout
    plain = load_engine(str(ck), backend="neuron-cpu", **kw)
    target = fused.app.fused_spec_model.model.target_model
    experts = target.layers[1].moe.expert_mlps
    assert experts.get_mlp_op() is experts.mlp_op_tkg
    gen = GenerationConfig(max_new_tokens=20)
    got = [r.tokens for r in fused.generate(PROMPTS[:2], gen)]
    assert got == [r.tokens for r in plain.generate(PROMPTS[:2], gen)]
