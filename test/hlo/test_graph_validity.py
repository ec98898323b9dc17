"""What every traced bucket must satisfy before anyone hands it to neuronx-cc (issue 13, item 3).

Each test runs on the three traced shapes (see ``conftest.py``). The modules are the ones ``compile --dry-run`` wrote,
read back from disk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from minimax_m3.config import M3Config
from minimax_m3.graphs import hlo_cost, hlo_schema

# custom-call targets neuronx-cc implements that NxD/NxDI emit (layer markers, NKI kernels, its TopK/ArgMax ops);
# anything else in a graph is a call the compiler cannot lower
ALLOWED_CUSTOM_CALLS = {"AwsNeuronModuleMarkerStartForward", "AwsNeuronModuleMarkerEndForward",
                        "AwsNeuronCustomNativeKernel", "AwsNeuronTopK", "AwsNeuronArgMax"}
HOST_OPS = {"send", "send-done", "recv", "recv-done", "infeed", "outfeed", "host-compute"}


def graphs(out: Path):
    man = json.loads((out / "dry_run.json").read_text())
    cfg = M3Config.from_fields(man["model"])
    for g in man["graphs"]:
        yield g, hlo_schema.parse_module((out / g["hlo"]).read_bytes()), cfg, man


def test_every_submodel_and_bucket_traced(dry):
    man = json.loads((dry / "dry_run.json").read_text())
    seen = {(g["submodel"], g["bucket"]) for g in man["graphs"]}
    assert {s for s, _ in seen} == {"context_encoding_model", "token_generation_model"}
    assert all(sum(1 for s, _ in seen if s == sub) >= 2 for sub in ("context_encoding_model", "token_generation_model"))
    for g in man["graphs"]:
        assert g["command"] and (dry / g["command"]).read_text().startswith("neuronx-cc compile"), g


def test_modules_parse_and_xla_reads_them_back(dry):
    import torch_xla.core.xla_builder as xb

    for g, module, _, _ in graphs(dry):
        data = (dry / g["hlo"]).read_bytes()
        assert module.computations and module.entry_computation_id in {c.id for c in module.computations}
        comp = xb.computation_from_module_proto(f"{g['submodel']}_{g['bucket']}", data)
        assert "ENTRY" in xb.get_computation_hlo(comp)


def test_every_cache_is_aliased_and_updated_in_place(dry):
    for g, module, cfg, _ in graphs(dry):
        states = [p for p in g["params"] if p["role"] == "state"]
        assert len(states) == 2 * cfg.num_layers + sum(cfg.sparse_layers), g["hlo"]
        alias = {e.parameter_number: (list(e.output_shape_index), e.kind) for e in module.input_output_alias.entries}
        mod = hlo_cost.Module(module)
        outputs = mod.operands[mod.root]
        for i, p in enumerate(states):
            assert alias.get(p["number"]) == ([1 + i], hlo_schema.Kind.MUST_ALIAS), (g["hlo"], p)
            chain = hlo_cost._chain(mod, mod.params[p["number"]], outputs[1 + i])
            assert chain, f"{g['hlo']}: {p['name']} is not updated in place (its aliased output is rebuilt)"


def test_static_shapes_no_host_transfers_no_fallbacks(dry):
    for g, module, _, _ in graphs(dry):
        assert not module.is_dynamic
        for comp in module.computations:
            for ins in comp.instructions:
                assert not any(ins.shape.is_dynamic_dimension), (g["hlo"], ins.name)
                assert ins.opcode not in HOST_OPS and not ins.is_host_transfer, (g["hlo"], ins.name)
        checks = g["trace_checks"]
        assert checks["cpu_fallback_ops"] == [], (g["hlo"], checks)
        assert checks["host_reads"] == 0, (g["hlo"], checks)


def test_each_graph_holds_only_its_own_bucket(dry):
    """Buckets of one submodel run the same layers: the same collectives, as many of each kind. (A trace that leaks
    the previous bucket's graph, e.g. through torch-xla's collective token, doubles them.)"""
    from collections import Counter

    by_submodel: dict = {}
    for g, module, _, _ in graphs(dry):
        kinds = Counter(i.opcode for c in module.computations for i in c.instructions
                        if i.opcode in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"))
        by_submodel.setdefault(g["submodel"], []).append((g["bucket"], kinds))
    for sub, rows in by_submodel.items():
        assert len({tuple(sorted(k.items())) for _, k in rows}) == 1, (sub, rows)


def test_custom_calls_only_from_the_allow_list(dry):
    for g, module, _, _ in graphs(dry):
        targets = {i.custom_call_target for c in module.computations for i in c.instructions
                   if i.opcode == "custom-call"}
        assert targets <= ALLOWED_CUSTOM_CALLS, (g["hlo"], targets - ALLOWED_CUSTOM_CALLS)


def test_decode_graph_is_the_same_at_other_positions(dry):
    """One compile per bucket: re-traced with every integer input moved by 3 (positions, tokens), the token-generation
    module is identical once debug metadata and names are dropped."""
    decode = [g for g, *_ in graphs(dry) if g["submodel"] == "token_generation_model"]
    assert decode
    for g in decode:
        assert g["trace_checks"]["same_graph_at_other_positions"] is True, g["hlo"]


@pytest.mark.parametrize("bad", ["model", "bucket", "split"])
def test_bad_layouts_fail_before_tracing_with_every_problem(bad, tmp_path, tiny_ckpt):
    """One message listing every problem, exit code 2, no traceback, nothing written."""
    from test.hlo.conftest import REPO
    import os
    import subprocess
    import sys

    args = {"model": ["--model", str(tmp_path / "nowhere"), "--tp", "3"],
            "bucket": ["--model", str(tiny_ckpt), "--tp", "1", "--ep", "1", "--seq-len", "256",
                       "--context-buckets", "128,512", "--token-buckets", "1024"],
            "split": ["--model", str(tiny_ckpt), "--tp", "3", "--ep", "2", "--seq-len", "256"]}[bad]
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, "-m", "test.support.hlo.dry_run", *args, "--compiled", str(out)], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    assert not out.exists()
    expected = {"model": ["config.json not found"],
                "bucket": ["max_context_len 512 exceeds max_seq_len 256", "token-generation buckets [1024] exceed"],
                "split": ["ep 2 must divide tp 3", "KV heads", "tp 3 does not divide the vocabulary 512"]}[bad]
    for text in expected:
        assert text in p.stderr, (text, p.stderr)
