"""``minimax-m3 compile`` then ``minimax-m3 generate`` with the same engine options: the same NxDI config (built by
NxDI's own classes in CPU mode), the same compiled directory on the neuron backend, and the same timing fields
printed by generate on neuron-cpu as on the reference backend.

One NxDI model per file (TP 2 and 4 rerun this folder under torchrun)."""

import json

import pytest

from minimax_m3.config import M3Config

pytestmark = pytest.mark.neuron_cpu

OPTS = ["--seq-len", "160", "--max-context-len", "128", "--context-buckets", "32,64,128", "--batch", "2",
        "--dtype", "float32"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from minimax_m3.checkpoint.synthetic import write_synthetic

    return str(write_synthetic(tmp_path_factory.mktemp("spec") / "tiny", M3Config.preset("tiny"), seed=0))


def _spec(argv):
    from minimax_m3.cli import build_parser
    from minimax_m3.engine.spec import spec_from_args

    return spec_from_args(build_parser().parse_args(argv))


def test_compile_and_generate_options_give_the_same_nxdi_config(ckpt, neuron_cpu_tp):
    from minimax_m3.neuron.build import inference_config

    tp = ["--tp", str(neuron_cpu_tp)]
    config = M3Config.from_pretrained(ckpt)
    comp = _spec(["compile", "--backend", "neuron-cpu", "--model", ckpt, *OPTS, *tp]).validate(config)
    gen = _spec(["generate", "--backend", "neuron-cpu", "--model", ckpt, "--prompt-ids", "1", *OPTS, *tp])
    gen = gen.validate(config)
    ca, cb = inference_config(comp, config), inference_config(gen, config)
    assert ca.to_json_string() == cb.to_json_string()  # NxDI's own serialisation, neuron_config included
    a = ca.neuron_config
    assert (a.tp_degree, a.batch_size, a.seq_len, a.max_context_length, a.is_continuous_batching) == \
        (neuron_cpu_tp, 2, 160, 128, True)
    assert a.context_encoding_buckets == [32, 64, 128]
    assert a.token_generation_buckets == [160]  # CPU mode: one decode module as long as the cache


class _Stop(Exception):
    pass


def test_generate_on_neuron_finds_what_compile_wrote(ckpt, monkeypatch, tmp_path):
    """The device path with NxDI's compile and load recorded (no NEFFs off-device): compile writes to
    ``spec.artifact_dir()``, generate with the same options loads from it without compiling, and with other options
    it is refused once the record says they differ."""
    from pathlib import Path

    from minimax_m3.cli import main
    from minimax_m3.neuron.model import NeuronMiniMaxM3ForCausalLM

    log = []

    def compile(self, path, *a, **k):
        log.append(("compile", path))
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.pt").write_bytes(b"")

    def load(self, path, *a, **k):
        log.append(("load", path))
        raise _Stop

    monkeypatch.setattr(NeuronMiniMaxM3ForCausalLM, "compile", compile)
    monkeypatch.setattr(NeuronMiniMaxM3ForCausalLM, "load", load)
    layout = ["--tp", "2", "--ep", "1", "--lnc", "1", *OPTS]
    with pytest.raises(_Stop):
        main(["compile", "--backend", "neuron", "--model", ckpt, *layout])
    parses, real = [], M3Config.from_dict.__func__
    monkeypatch.setattr(M3Config, "from_dict", classmethod(lambda cls, raw, source="config": (
        parses.append(source), real(cls, raw, source))[1]))
    with pytest.raises(_Stop):
        main(["generate", "--backend", "neuron", "--model", ckpt, "--prompt-ids", "1,2", *layout])
    assert len(parses) == 1, parses  # config.json parsed once per load (load_engine), handed down as M3Config
    where = log[0][1]
    assert log == [("compile", where), ("load", where), ("load", where)]
    assert Path(where).parent == Path(ckpt) and Path(where).name.startswith("neuron-tp2-ep1-lnc1-fp32-b2-s160-")
    assert json.loads((Path(where) / "minimax-m3-spec.json").read_text())["token_buckets"] == [128, 160]
    # the same directory named explicitly, but asked with another batch: refused before loading
    rc = main(["generate", "--backend", "neuron", "--model", ckpt, "--prompt-ids", "1", *layout, "--batch", "1",
               "--compiled", where])
    assert rc == 2 and len(log) == 3


def test_cli_generate_prints_the_same_timing_fields_on_neuron_cpu_and_reference(ckpt, capsys, neuron_cpu_tp):
    from minimax_m3.cli import main

    out = {}
    for backend, extra in (("neuron-cpu", ["--tp", str(neuron_cpu_tp), *OPTS]), ("reference", ["--device", "cpu"])):
        assert main(["generate", "--backend", backend, "--model", ckpt, "--prompt-ids", "5,6,7",
                     "--max-new-tokens", "4", *extra]) == 0
        out[backend] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["neuron-cpu"].keys() == out["reference"].keys()
    assert {"queue_ms", "prefill_ms", "ttft_ms", "total_ms", "decode_ms_per_token_median"} <= out["reference"].keys()
    assert out["neuron-cpu"]["decode_steps"] == 3 and out["neuron-cpu"]["ttft_ms"] > 0
    assert out["neuron-cpu"]["tokens"] == out["reference"]["tokens"]  # float32 both: the same greedy tokens
