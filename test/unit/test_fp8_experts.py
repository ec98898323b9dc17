"""FP8 routed experts (issue 15 item 5): NxD's expert-wise per-channel e4m3 layout, graded by hand computation and
against the exact dequantized MXFP8 weights; the fp8-expert reference model against the bf16 one."""

from __future__ import annotations

import pytest
import torch

from minimax_m3.checkpoint import open_source
from minimax_m3.checkpoint.formats import FormatError, mxfp8_dequantize, mxfp8_quantize
from minimax_m3.checkpoint.fp8_experts import (MODULES_TO_NOT_CONVERT, dequantize, error, fp8_twin_, mxfp8_experts,
                                               mxfp8_twin_,
                                               neuron_config_kwargs, quantize_per_channel, quantize_state_dict,
                                               requantize_mxfp8)
from minimax_m3.checkpoint.synthetic import write_synthetic
from minimax_m3.config import M3Config
from minimax_m3.reference.engine import ReferenceEngine

E4 = torch.float8_e4m3fn


def test_per_channel_scales_and_values_by_hand():
    # [in=3, out=2]; channel 0 amax 4: the smallest power of two >= 4/448 is 2^-6; channel 1 amax 448: scale 1
    w = torch.tensor([[1.0, 17.0], [4.0, 19.0], [-2.0, -448.0]])
    q, s = quantize_per_channel(w)
    assert q.dtype == E4 and s.dtype == torch.float32 and s.shape == (1, 2)
    assert s.tolist() == [[2.0**-6, 1.0]]
    # channel 0: 1 * 64, 4 * 64, -2 * 64 (e4m3 values). Channel 1 at scale 1: 17 is a tie between 16 (mantissa 000,
    # even) and 18 -> 16; 19 ties 18 and 20 (mantissa 010, even) -> 20
    assert q.float().tolist() == [[64.0, 16.0], [256.0, 20.0], [-128.0, -448.0]]


def test_zero_channel_and_expert_axis_is_per_expert():
    w = torch.zeros(2, 4, 3)
    w[1, 2, 0] = 0.896  # expert 1, channel 0: 0.896 / 448 = 0.002 -> scale 2^-8; 0.896 * 256 = 229.4 -> e4m3 224
    w[1, 1, 0] = 0.5 ** 20  # far below 2^-6 * 2^-8 * 2^-3 (the smallest subnormal step times the scale): -> 0
    q, s = quantize_per_channel(w)
    assert s.shape == (2, 1, 3)
    assert (s[0] == 1.0).all() and s[1, 0, 0].item() == 2.0**-8
    assert q[1, 2, 0].float().item() == 224.0 and q.float().abs().sum().item() == 224.0
    assert torch.equal(dequantize(q, s), q.float() * s)


def test_power_of_two_rule_at_exact_powers():
    # amax exactly 448 * 2^k must give scale 2^k (q = 448), one ulp above gives 2^(k+1)
    for k in (-20, -3, 0, 5):
        w = torch.tensor([[448.0 * 2.0**k], [1.0 * 2.0**k]])
        q, s = quantize_per_channel(w)
        assert s.item() == 2.0**k and q[0, 0].float().item() == 448.0
        q2, s2 = quantize_per_channel(torch.nextafter(w, torch.tensor(float("inf"))))
        assert s2.item() == 2.0 ** (k + 1)


def test_bad_input_is_one_format_error():
    with pytest.raises(FormatError, match="floating"):
        quantize_per_channel(torch.ones(4, dtype=torch.int32))
    with pytest.raises(FormatError, match="MXFP8 requantization"):
        requantize_mxfp8(torch.zeros(2, 64, dtype=E4), torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(FormatError, match="corrupt"):
        requantize_mxfp8(torch.zeros(1, 32, dtype=E4), torch.full((1, 1), 255, dtype=torch.uint8))


def test_mxfp8_requantization_by_hand():
    q = torch.zeros(1, 64)
    q[0, 0] = 3.0                 # block 0, scale 2^0
    q[0, 32] = 3.0                # block 1, scale 2^-2: 0.75, exact
    q[0, 33] = 0.0625             # 2^-4 * 2^-2 = 2^-6, still normal: exact
    q[0, 34] = 0.017578125        # 1.125 * 2^-6 -> 2.25 * 2^-9 (subnormal): rounds to 2 * 2^-9
    s = torch.tensor([[127, 125]], dtype=torch.uint8)
    qe = q.to(E4)
    q2, scale = requantize_mxfp8(qe, s)
    assert scale.tolist() == [1.0]
    want = torch.zeros(1, 64)
    want[0, 0], want[0, 32], want[0, 33], want[0, 34] = 3.0, 0.75, 0.015625, 2 * 2.0**-9
    assert torch.equal(q2.float(), want)
    exact = mxfp8_dequantize(qe, s)
    err = (q2.float() * scale[:, None] - exact).abs()
    assert err.max().item() == 0.017578125 / 4 - 2 * 2.0**-9 == 2.0**-11 and int((err > 0).sum()) == 1


def test_mxfp8_experts_layout_and_fold():
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(6, 64, generator=g) * 0.05 for _ in range(3)]  # 3 experts, [out=6, in=64]
    qs, ss = zip(*(mxfp8_quantize(w) for w in ws), strict=True)
    weight, scale = mxfp8_experts(list(qs), list(ss), fold=2.0)
    assert weight.dtype == E4 and weight.shape == (3, 64, 6) and scale.shape == (3, 1, 6)
    for e in range(3):
        q2, s2 = requantize_mxfp8(qs[e], ss[e])
        assert torch.equal(weight[e].view(torch.uint8), q2.view(torch.uint8).t())
        assert torch.equal(scale[e, 0], 2.0 * s2)


def test_quantize_state_dict_adds_scales_for_routed_experts_only():
    g = torch.Generator().manual_seed(1)
    gu = torch.randn(4, 8, 10, generator=g)
    sd = {"layers.1.moe.expert_mlps.mlp_op.gate_up_proj.weight": gu,
          "layers.1.moe.expert_mlps.mlp_op.gate_up_proj.bias": torch.zeros(4, 10),
          "layers.1.moe.expert_mlps.mlp_op.down_proj.weight": torch.randn(4, 5, 8, generator=g),
          "layers.1.shared_expert.gate_up_proj.weight": torch.randn(10, 8, generator=g)}
    out = quantize_state_dict(sd)
    assert sorted(set(out) - set(sd)) == ["layers.1.moe.expert_mlps.mlp_op.down_proj.scale",
                                          "layers.1.moe.expert_mlps.mlp_op.gate_up_proj.scale"]
    w = out["layers.1.moe.expert_mlps.mlp_op.gate_up_proj.weight"]
    s = out["layers.1.moe.expert_mlps.mlp_op.gate_up_proj.scale"]
    assert w.dtype == E4 and s.shape == (4, 1, 10)
    amax = gu.abs().amax(1, keepdim=True)  # by hand: the smallest power of two >= amax over the input axis / 448
    assert torch.equal(s, 2.0 ** torch.ceil(torch.log2(amax / 448))) and (amax / s <= 448).all()
    for k in ("layers.1.moe.expert_mlps.mlp_op.gate_up_proj.bias", "layers.1.shared_expert.gate_up_proj.weight"):
        assert out[k] is sd[k]


def test_neuron_config_keeps_everything_but_routed_experts_bf16():
    kw = neuron_config_kwargs()
    assert kw["quantized"] and kw["quantization_type"] == "expert_wise_per_channel_symmetric"
    assert kw["quantization_dtype"] == "f8e4m3"
    # NxD's convert() skips a module when any entry is a substring of its dotted path (quantize.py:121-122)
    skipped = lambda path: any(k in path for k in MODULES_TO_NOT_CONVERT)  # noqa: E731
    for path in ("layers.0.self_attn.qkv_proj.q_proj", "layers.0.self_attn.o_proj.o_proj", "layers.0.mlp.gate_up_proj",
                 "layers.3.shared_expert.down_proj", "layers.3.moe.router.linear_router", "lm_head"):
        assert skipped(path), path
    for path in ("layers.3.moe.expert_mlps.mlp_op.gate_up_proj", "layers.3.moe.expert_mlps.mlp_op.down_proj"):
        assert not skipped(path), path


def test_engine_spec_weights_option(tmp_path):
    import json

    from minimax_m3.engine.spec import EngineSpec, SpecError

    with pytest.raises(SpecError, match="weights fp8 applies to the neuron backends"):
        EngineSpec("/ckpt", backend="reference", weights="fp8").validate(M3Config.preset("tiny"))
    with pytest.raises(SpecError, match="unknown weights 'int4'"):
        EngineSpec("/ckpt", backend="neuron", weights="int4").validate(M3Config.preset("m3"))
    bf16 = EngineSpec("/ckpt", backend="neuron").resolve(M3Config.preset("m3"))
    fp8 = EngineSpec("/ckpt", backend="neuron", weights="fp8").resolve(M3Config.preset("m3"))
    assert bf16.artifact_dir() != fp8.artifact_dir()
    # a record written before the option existed was compiled with bf16 experts: it loads as bf16, not as fp8
    key = bf16.artifact_key()
    del key["weights"]
    (tmp_path / "minimax-m3-spec.json").write_text(json.dumps(key))
    bf16.check_artifact(str(tmp_path))
    with pytest.raises(SpecError, match="weights: compiled for 'bf16', asked for 'fp8'"):
        fp8.check_artifact(str(tmp_path))


def test_mxfp8_release_requantization_error_vs_exact(tmp_path):
    """Every routed expert of a synthetic MXFP8 checkpoint: the power-of-two rule against the exact dequantized
    weights, identical to the per-channel rule on those weights (the port's path), and better than NxD's amax/448."""
    path = write_synthetic(tmp_path / "mx", "tiny", fmt="mxfp8")
    c = M3Config.from_pretrained(path)
    src = open_source(path, c)
    m = "language_model.model.layers.{L}.block_sparse_moe.experts.{E}.{w}.weight"
    num = den = num_nxd = 0.0
    worst = 0.0
    for L in (i for i in range(c.num_layers) if c.moe_layers[i]):
        for e in range(c.num_experts):
            for w in ("w1", "w2", "w3"):
                key = m.format(L=L, E=e, w=w)
                q, s = src.reader.get(key), src.reader.get(key.replace("weight", "weight_scale_inv"))
                exact = mxfp8_dequantize(q, s)
                q2, sc = requantize_mxfp8(q, s)
                approx = q2.float() * sc[:, None]
                # the port's path (exact dequantization, then the per-channel rule) picks the same power of two, or
                # half of it where the release's largest value rounded down to 224 x its block scale: as exact
                qp, sp = quantize_per_channel(exact.t())
                assert ((sp[0] == sc) | (sp[0] == sc / 2)).all()
                port = dequantize(qp, sp).t()
                assert float((port - exact).norm()) <= float((approx - exact).norm())
                amax = exact.abs().amax(1, keepdim=True)  # NxD's quantize_fp8_per_channel rule, for comparison
                nxd = (exact / (amax / 448)).clamp(-448, 448).to(E4).float() * (amax / 448)
                num += float((approx - exact).double().norm() ** 2)
                num_nxd += float((nxd - exact).double().norm() ** 2)
                den += float(exact.double().norm() ** 2)
                worst = max(worst, error(approx, exact)["max_abs"])
    rel, rel_nxd = (num / den) ** 0.5, (num_nxd / den) ** 0.5
    assert rel < 1e-6 and worst < 1e-5 and rel_nxd > 100 * rel, (rel, rel_nxd, worst)


def _logits_and_tokens(engine, prompts):
    from minimax_m3.engine import GenerationConfig

    logits = torch.cat(engine.prefill_logits(prompts))
    tokens = [r.tokens for r in engine.generate(prompts, GenerationConfig(max_new_tokens=24, temperature=0.0))]
    return logits, tokens


def _prompts(vocab):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (16, 40, 64)]


def test_fp8_expert_model_vs_bf16_checkpoint_model(tmp_path):
    """bf16 source: the float32 reference model with its routed experts replaced by their dequantized fp8 values
    (exactly what NxD's layers multiply) against the same model unquantized. The random synthetic model amplifies
    weight error ~6x into the logits (its bf16-weight twin already moves them 1.5 %), so the bounds are loose;
    measured: weights 2.7 % rel. Frobenius, logits 16.5 %, top-1 87 % (HISTORY 2026-11-30)."""
    path = write_synthetic(tmp_path / "tiny", "tiny")
    ref = ReferenceEngine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=256)
    fp8 = ReferenceEngine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=256)
    experts = fp8.model.layers[fp8.config.moe_layers.index(True)].moe.experts
    before = experts.gate_up.detach().clone()
    fp8_twin_(fp8.model)
    assert 0.005 < error(experts.gate_up, before)["rel_fro"] < 0.04  # e4m3: 3 mantissa bits
    prompts = _prompts(ref.config.vocab_size)
    (la, ta), (lb, tb) = _logits_and_tokens(ref, prompts), _logits_and_tokens(fp8, prompts)
    top1 = float((la.argmax(-1) == lb.argmax(-1)).float().mean())
    assert top1 >= 0.75 and error(lb, la)["rel_fro"] < 0.25, (top1, error(lb, la))
    assert [t[0] for t in ta] == [t[0] for t in tb]  # greedy: first divergence measured at tokens 1, 4, 3


def test_requantized_mxfp8_model_matches_the_release_model(tmp_path):
    """MXFP8 source: the model the release defines (exact dequantization) against its experts requantized to
    NxD's per-channel layout: the power-of-two rule moves only sub-2^-6 values, so logits agree to float32 noise
    and greedy tokens are identical (measured: weights 5.8e-8 rel. Frobenius, logits max 8.6e-6)."""
    path = write_synthetic(tmp_path / "mx", "tiny", fmt="mxfp8")
    mx = ReferenceEngine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=256)
    rq = ReferenceEngine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=256)
    mxfp8_twin_(rq.model, open_source(path, rq.config))
    prompts = _prompts(mx.config.vocab_size)
    (la, ta), (lb, tb) = _logits_and_tokens(mx, prompts), _logits_and_tokens(rq, prompts)
    assert not torch.equal(la, lb)  # the twin did change the weights somewhere
    assert error(lb, la)["max_abs"] < 1e-4 and ta == tb


@pytest.mark.parametrize("strategy", ["gather", "dense", "blocks", "loop", "static"])
def test_held_fp8_experts_equal_the_dequantized_twin(tmp_path, strategy):
    """``quantize_experts_`` (what the vLLM Neuron model serves with ``quantization: "fp8"``): e4m3 weights with
    fp32 per-channel scales applied to each product's output (``ops.moe.scaled``). Oracle: ``fp8_twin_``, the same
    values dequantized before the matmul. With power-of-two scales both are exact in float32: equal logits, for every
    MoE formulation; the experts really are held as one byte per weight."""
    import copy

    from minimax_m3.checkpoint.fp8_experts import fp8_twin_, quantize_experts_
    from minimax_m3.checkpoint.synthetic import write_synthetic
    from minimax_m3.reference.engine import ReferenceEngine

    ck = write_synthetic(tmp_path / "tiny", M3Config.preset("tiny"), seed=0)
    ref = ReferenceEngine.from_pretrained(ck, device="cpu", dtype="float32", max_seq_len=256)
    twin, held = copy.deepcopy(ref.model), copy.deepcopy(ref.model)
    fp8_twin_(twin)
    assert quantize_experts_(held) == 3  # the tiny model's MoE layers
    for m in (twin, held):
        for layer in m.layers:
            if hasattr(layer, "moe"):
                layer.moe.strategy = strategy
    experts = held.layers[1].moe.experts
    assert experts.gate_up.dtype == experts.down.dtype == torch.float8_e4m3fn
    assert experts.gate_up_scale.shape == (8, 1, 128) and experts.down_scale.shape == (8, 1, 128)
    prompt = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    want = ReferenceEngine(twin, max_seq_len=256).prefill_logits([prompt])[0]
    got = ReferenceEngine(held, max_seq_len=256).prefill_logits([prompt])[0]
    plain = ref.prefill_logits([prompt])[0]
    assert torch.equal(got, want) and not torch.equal(got, plain)
