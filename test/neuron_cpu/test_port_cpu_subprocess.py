"""The NxDI port run for real in NxDI's CPU mode (TP 1), against the reference backend.

Needs the NxDI/NxD sources (``NXDI_SRC``, ``NXD_SRC``) and a Python with NxDI's pins (torch 2.9, torch-xla 2.9,
transformers 4.57): ``NXDI_PYTHON`` (default: this interpreter). The checks run in a subprocess of their own (TP 1,
its own process group on a free port; the Neuron stand-ins: ``test/support/neuron/standins.py``), apart from the
NxDI state of this session.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test.support.neuron.cpu_plugin import free_port

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-4  # float32


def _reason() -> str | None:
    if not (os.environ.get("NXDI_SRC") and os.environ.get("NXD_SRC")):
        return "NxDI CPU mode needs NXDI_SRC and NXD_SRC (the src/ folders of NxDI 0.9 and NxD 0.18)"
    return None


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if _reason():
        pytest.skip(_reason())
    ck = tmp_path_factory.mktemp("ck") / "tiny"
    py = os.environ.get("NXDI_PYTHON", sys.executable)
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}", MASTER_PORT=str(free_port()))
    r = subprocess.run([py, __file__, str(ck)], capture_output=True, text=True, env=env, timeout=1800)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads(line[-1][len("RESULT "):])


def test_prefill_matches_reference_with_sparse_blocks_dropped(results):
    assert results["blocks_dropped_prefill"]
    assert results["prefill_max_abs"] <= TOL, results


def test_decode_matches_reference_with_sparse_blocks_dropped(results):
    assert results["blocks_dropped_decode"]
    assert results["decode_max_abs"] <= TOL and results["tokens_equal"], results


def test_fp32_parameters_survive_the_bf16_cast(results):
    assert results["bf16_fp32_kept"] == [], results
    assert results["bf16_values_exact"], results


def test_index_head_replication_hook(results):
    assert results["index_hook_ok"], results


def test_config_reload_is_idempotent_and_reads_raw_config_json(results):
    assert results["config_reload_idempotent"] and results["config_from_raw"], results


def _main(ck: str) -> None:  # runs inside the NxDI interpreter
    from test.support.neuron import standins

    standins.bootstrap()
    import torch

    from minimax_m3 import ops
    from minimax_m3.checkpoint import open_source
    from minimax_m3.checkpoint.synthetic import write_synthetic
    from minimax_m3.config import M3Config
    from minimax_m3.engine import GenerationConfig
    from minimax_m3.neuron.attention import IndexQProjection
    from minimax_m3.neuron.provider import NeuronEngine
    from minimax_m3.reference.engine import ReferenceEngine

    write_synthetic(ck, "tiny", seed=0)
    c = M3Config.from_pretrained(ck)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, c.vocab_size, (40,), generator=g).tolist(),
               torch.randint(3, c.vocab_size, (33,), generator=g).tolist()]
    steps = 20
    span = c.index_topk * c.index_block_size  # beyond it the indexer must drop blocks
    out = {"blocks_dropped_prefill": max(map(len, prompts)) > span,
           "blocks_dropped_decode": max(map(len, prompts)) + steps > span + c.index_block_size}
    eng = NeuronEngine.from_pretrained(ck, on_cpu=True, tp_degree=1, batch_size=2, max_seq_len=128,
                                       max_context_length=64, dtype="float32")
    ref = ReferenceEngine.from_pretrained(ck, device="cpu", dtype="float32", max_seq_len=256)
    a, b = eng.prefill_logits(prompts), ref.prefill_logits(prompts)
    out["prefill_max_abs"] = max((x - y).abs().max().item() for x, y in zip(a, b))
    gen = GenerationConfig(max_new_tokens=steps, return_logits=True)
    ra, rb = eng.generate(prompts, gen), ref.generate(prompts, gen)
    out["decode_max_abs"] = max((x.step_logits - y.step_logits).abs().max().item() for x, y in zip(ra, rb))
    out["tokens_equal"] = all(x.tokens == y.tokens for x, y in zip(ra, rb))

    # bf16 model: folded norms, router weight and routing bias stay float32 and exact
    bf = NeuronEngine.from_pretrained(ck, on_cpu=True, tp_degree=1, batch_size=1, max_seq_len=64, dtype="bfloat16")
    model = bf.app.models[0].model
    src = open_source(ck, c)
    kept, exact = [], True
    for name, p in model.named_parameters():
        if name.endswith(("layernorm.weight", "norm.weight", "e_score_correction_bias", "linear_router.weight")):
            if p.dtype != torch.float32:
                kept.append(name)
    lm = "language_model.model.layers.1"
    exact &= torch.equal(model.layers[1].moe.router.e_score_correction_bias,
                         src.get(f"{lm}.block_sparse_moe.e_score_correction_bias").float())
    exact &= torch.equal(model.layers[1].input_layernorm.weight, 1.0 + src.get(f"{lm}.input_layernorm.weight").float())
    exact &= torch.equal(model.layers[1].self_attn.index_k_norm.weight,
                         1.0 + src.get(f"{lm}.self_attn.index_k_norm.weight").float())
    out["bf16_fp32_kept"], out["bf16_values_exact"] = kept, bool(exact)

    # index-q heads replicated like K/V heads when tp > index heads
    fake = type("P", (), {"tp": 4, "src_heads": 2, "head_dim_": 3})()
    w = torch.arange(6.0).view(6, 1)
    sd = {"x.weight": w.clone()}
    IndexQProjection.preshard_hook(fake, sd, "x.weight")
    expect = [0, 1, 2, 0, 1, 2, 3, 4, 5, 3, 4, 5]  # ranks 0,1 → head 0; ranks 2,3 → head 1
    out["index_hook_ok"] = sd["x.weight"].flatten().int().tolist() == expect
    # NxDI reloads neuron_config.json by calling the constructor again: same config; raw config.json works
    import tempfile

    from minimax_m3.engine.spec import EngineSpec
    from minimax_m3.neuron.build import neuron_config
    from minimax_m3.neuron.config import MiniMaxM3InferenceConfig, load_m3_config

    spec = EngineSpec(ck, backend="neuron", tp=1, ep=1, lnc=1, max_seq_len=256).resolve(c)
    c1 = MiniMaxM3InferenceConfig(neuron_config(spec), load_config=load_m3_config(ck))
    d = Path(tempfile.mkdtemp())
    c1.save(d)
    c2 = MiniMaxM3InferenceConfig.load(d)
    c2.save(d / "again")
    out["config_reload_idempotent"] = (json.loads((d / "neuron_config.json").read_text())
                                       == json.loads((d / "again" / "neuron_config.json").read_text()))
    raw = json.loads((Path(ck) / "config.json").read_text())
    out["config_from_raw"] = MiniMaxM3InferenceConfig(neuron_config(spec), **raw).m3_config() == c
    del ops
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    _main(sys.argv[1])
