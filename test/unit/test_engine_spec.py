"""``EngineSpec``: per-backend defaults (one place), every problem listed at once before any work, the compiled
artifact's location as a function of the options, and the shared command-line options (pure Python, no SDK)."""

import json

import pytest

from minimax_m3.cli import build_parser
from minimax_m3.config import ConfigError, M3Config
from minimax_m3.engine.spec import ARTIFACT_FIELDS, EngineSpec, SpecError, spec_from_args, spec_from_kwargs

M3 = M3Config()  # the release: 64 heads, 4 KV heads, 128 experts, indexer block 128
TINY = M3Config.preset("tiny")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("MINIMAX_M3_EP", raising=False)


def test_defaults_per_backend(monkeypatch):
    monkeypatch.setattr("minimax_m3.engine.spec._cuda_available", lambda: False)
    ref = EngineSpec("m").resolve(M3)
    assert (ref.device, ref.dtype, ref.max_batch, ref.tp, ref.ep, ref.lnc, ref.max_context_len) == \
        ("cpu", "float32", 8, 1, 1, 1, 4096)
    assert ref.context_buckets is None and ref.token_buckets is None and ref.all_logits is None
    neuron = EngineSpec("m", backend="neuron", max_seq_len=8192).resolve(M3)
    assert (neuron.dtype, neuron.tp, neuron.ep, neuron.lnc, neuron.max_batch) == ("bfloat16", 64, 64, 2, 1)
    assert neuron.continuous_batching is False and neuron.all_logits is False
    assert neuron.context_buckets == (128, 256, 512, 1024, 2048, 4096, 8192)
    assert neuron.token_buckets == (128, 256, 512, 1024, 2048, 4096, 8192)  # block-aligned, not one of 8192
    cpu = EngineSpec("m", backend="neuron-cpu", max_batch=2, max_seq_len=300).resolve(TINY)
    assert (cpu.dtype, cpu.tp, cpu.ep, cpu.lnc, cpu.continuous_batching, cpu.all_logits) == \
        ("float32", 1, 1, 1, True, True)
    assert cpu.token_buckets == (300,)  # CPU mode: one decode module, as long as the cache
    assert EngineSpec("m", backend="neuron", max_seq_len=300).resolve(TINY).token_buckets == (128, 256, 300)
    # (tiny's block is 16: 128 is its first multiple >= 128)
    monkeypatch.setattr("minimax_m3.engine.spec._cuda_available", lambda: True)
    assert EngineSpec("m").resolve().dtype == "bfloat16"  # reference on CUDA
    # explicit context buckets set the longest prompt; --tp alone sets --ep on neuron
    s = EngineSpec("m", backend="neuron", context_buckets=(1024, 2048), tp=32).resolve(M3)
    assert (s.max_context_len, s.ep) == (2048, 32)


def test_ep_from_the_environment_only_under_torchrun(monkeypatch):
    monkeypatch.setenv("MINIMAX_M3_EP", "2")
    assert EngineSpec("m").resolve().ep == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (EngineSpec("m").resolve().tp, EngineSpec("m").resolve().ep) == (4, 2)
    assert EngineSpec("m", ep=4).resolve().ep == 4  # the field wins


def test_every_problem_is_listed_at_once(monkeypatch):
    monkeypatch.setattr("minimax_m3.engine.spec._cuda_available", lambda: False)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)  # no NxDI here
    problems = EngineSpec("m", backend="neuron-cpu", tp=3, ep=4, max_seq_len=500, max_context_len=600,
                          token_buckets=(100, 500), lnc=3).problems(TINY)
    want = ["max_context_len 600 exceeds max_seq_len 500", "ep 4 must divide tp 3", "lnc must be 1 or 2",
            "ep 4: expert parallelism cannot run in NxDI's CPU mode",
            "token buckets [100, 500]: NxDI's CPU mode runs one decode module",
            "backend neuron-cpu needs NxD Inference importable: set NXDI_SRC and NXD_SRC",
            "token-generation buckets [100, 500] must be multiples of index_block_size 16",
            "tp 3 does not divide the 8 attention heads", "tp 3 and 2 KV heads: one must divide the other",
            "tp 3 does not divide dense_intermediate_size", "tp 3 does not divide shared_intermediate_size"]
    assert len(problems) == len(want), problems
    for w, p in zip(want, problems):
        assert p.startswith(w), (w, p)
    ref = EngineSpec("m", device="cuda", dtype="float16", context_buckets=(128,), tp=2).problems(TINY)
    assert [p.split(" ")[0] for p in ref] == ["unknown", "context_buckets", "reference", "device"], ref
    with pytest.raises(SpecError) as exc:
        EngineSpec("m", device="cuda", dtype="float16").validate(TINY)
    assert isinstance(exc.value, ConfigError) and len(exc.value.problems) == 2
    assert "2 problem(s)" in str(exc.value) and "no CUDA device is available; use --device cpu" in str(exc.value)


def test_a_valid_spec_validates_to_its_resolved_form():
    s = EngineSpec("m", backend="reference", device="cpu").validate(TINY)
    assert s == EngineSpec("m", device="cpu").resolve(TINY) and s.dtype == "float32"


def _dir(**kw):
    return EngineSpec("/ckpt", backend="neuron", **kw).artifact_dir(M3)


def test_artifact_dir_is_named_by_every_field_that_changes_the_neffs():
    base = _dir(max_seq_len=8192, max_batch=8)
    assert base.startswith("/ckpt/neuron-tp64-ep64-lnc2-bf16-b8-s8192-")
    # the same options (defaults spelled out or not) meet the same directory
    assert _dir(max_seq_len=8192, max_batch=8, tp=64, ep=64, lnc=2, dtype="bfloat16",
                context_buckets=(128, 256, 512, 1024, 2048, 4096, 8192), continuous_batching=True) == base
    changed = dict(tp=32, ep=32, lnc=1, dtype="float32", max_batch=4, max_seq_len=4096, max_context_len=4096,
                   context_buckets=(1024, 8192), token_buckets=(4096, 8192), continuous_batching=False,
                   all_logits=True, on_device_sampling=True, weights="fp8", prefill_chunk=4096,
                   draft="/drafts/eagle3", num_speculative_tokens=3,  # a draft: the speculation graph, its states
                   fused_speculation=True,  # the draft inside the graph
                   decode_experts="tp",  # a decode copy of the routed experts
                   kv_layout="replicated")  # NxDI's GQA copies of the caches
    assert set(changed) == set(ARTIFACT_FIELDS)
    dirs = {_dir(**{"max_seq_len": 8192, "max_batch": 8, **{k: v}}) for k, v in changed.items()}
    assert base not in dirs and len(dirs) == len(changed)
    assert _dir(compiled="/data/m3-tp64") == "/data/m3-tp64"  # --compiled names it exactly


def test_artifact_record_refuses_other_options(tmp_path):
    a = EngineSpec(str(tmp_path), backend="neuron", max_batch=8).resolve(M3)
    a.write_artifact(str(tmp_path / "c"))
    assert json.loads((tmp_path / "c" / "minimax-m3-spec.json").read_text())["max_batch"] == 8
    a.check_artifact(str(tmp_path / "c"))
    with pytest.raises(SpecError, match="max_batch: compiled for 8, asked for 4"):
        EngineSpec(str(tmp_path), backend="neuron", max_batch=4).resolve(M3).check_artifact(str(tmp_path / "c"))


ENGINE_OPTS = ["--model", "/ckpt", "--tp", "16", "--ep", "8", "--batch", "4", "--seq-len", "8192",
               "--context-buckets", "2048,8192", "--token-buckets", "4096,8192", "--all-logits"]


def test_compile_and_generate_with_the_same_options_meet_the_same_artifact():
    p = build_parser()
    comp = spec_from_args(p.parse_args(["compile", *ENGINE_OPTS]))
    gen = spec_from_args(p.parse_args(["generate", "--backend", "neuron", "--prompt-ids", "1", *ENGINE_OPTS]))
    assert comp == gen
    assert comp.artifact_dir(M3) == gen.artifact_dir(M3)
    assert (comp.tp, comp.ep, comp.max_batch, comp.max_seq_len, comp.context_buckets, comp.token_buckets,
            comp.all_logits) == (16, 8, 4, 8192, (2048, 8192), (4096, 8192), True)
    # golden and longbench take the same options, with the same meaning
    lb = p.parse_args(["longbench", "--backend", "neuron", "--data", "d", "--out", "o", *ENGINE_OPTS])
    gold = p.parse_args(["golden", "--backend", "neuron", "--prompts", "p", "--out", "o", *ENGINE_OPTS])
    assert spec_from_args(lb) == spec_from_args(gold) == gen


def test_keyword_form_and_bad_option_values():
    s = spec_from_kwargs("m", "neuron-cpu", tp_degree=2, batch_size=3, max_context_length=80,
                         context_encoding_buckets=[32, 64])
    assert (s.tp, s.max_batch, s.max_context_len, s.context_buckets) == (2, 3, 80, (32, 64))
    with pytest.raises(SpecError, match="unknown engine option 'batchsize'"):
        spec_from_kwargs("m", batchsize=3)
    with pytest.raises(SystemExit):  # argparse's own usage error for a malformed list
        build_parser().parse_args(["generate", "--model", "m", "--prompt-ids", "1", "--token-buckets", "1,x"])


def test_kv_layout_is_a_neuron_option_with_its_own_group_rule(monkeypatch):
    """``--kv-layout``: sharded (the default) or replicated, on the neuron backends; the replicated caches have no
    KV group, so a prefill chunk need only be a multiple of the index block (the tiny model at TP 4 with one KV head:
    block 16, G 4, both 16) and the default chunk is the context in whole blocks."""
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())  # NxDI importable: its rules only
    one_kv = TINY.replace(num_kv_heads=1, index_heads=1)
    ok = EngineSpec("m", backend="neuron-cpu", tp=4, kv_layout="replicated", max_seq_len=160, max_context_len=70)
    assert ok.problems(one_kv) == [] and ok.resolve(one_kv).prefill_chunk == 80
    bad = EngineSpec("m", backend="neuron-cpu", kv_layout="paged").problems(one_kv)
    assert [p for p in bad if p.startswith("unknown kv_layout 'paged': choose sharded")] and \
        all("--kv-layout" in p for p in bad if "kv_layout" in p)
    (ref,) = [p for p in EngineSpec("m", device="cpu", kv_layout="replicated").problems(TINY) if "kv_layout" in p]
    assert ref.startswith("kv_layout replicated applies to the neuron backends") and "drop --kv-layout" in ref
    args = build_parser().parse_args(["compile", "--model", "m", "--kv-layout", "replicated"])
    assert spec_from_args(args).kv_layout == "replicated"
    assert spec_from_args(build_parser().parse_args(["compile", "--model", "m"])).kv_layout == "sharded"


def test_on_device_sampling_is_a_neuron_option():
    problems = EngineSpec("m", backend="neuron", on_device_sampling=True).problems(M3)
    assert not any("on_device_sampling" in p for p in problems), problems
    assert any(p.startswith("on_device_sampling applies to the neuron backend only")
               for p in EngineSpec("m", on_device_sampling=True).problems(M3))


def test_bucket_rules_one_home_for_the_spec_and_nxdi():
    """``bucket_problems`` (also what NxDI's validate_config calls on vLLM's configs): every bucket within its length,
    the largest reaching it, decode buckets whole indexer blocks (tiny: 16)."""
    from minimax_m3.engine.spec import bucket_problems

    assert bucket_problems((128, 256), (128, 512), 256, 512, TINY) == []
    assert bucket_problems(None, None, 256, 512, TINY) == []  # NxDI's own buckets
    short = bucket_problems((128,), (64, 256), 256, 512, TINY)
    assert [p.split(",")[0] for p in short] == [
        "the largest context-encoding bucket 128 is below max_context_len 256",
        "the largest token-generation bucket 256 is below max_seq_len 512"]
    assert "--max-model-len" in short[0] and "add 512 to --token-buckets" in short[1]
    long = bucket_problems((128, 512), (520,), 256, 512, TINY)
    assert [p.split(":")[0] for p in long] == [
        "context-encoding buckets [512] exceed max_context_len 256",
        "token-generation buckets [520] exceed max_seq_len 512",
        "token-generation buckets [520] must be multiples of index_block_size 16 (sparse decode reads the caches by "
        "whole blocks)"]
    spec = EngineSpec("m", backend="neuron", max_seq_len=512, max_context_len=256, context_buckets=(128,),
                      token_buckets=(64, 256))
    assert [p for p in spec.problems(TINY) if "bucket" in p] == short


def test_prefill_chunk_defaults_one_rule_for_the_spec_and_the_planner():
    """Reference: ``ops.call_tokens`` (8192 in whole blocks) whatever the context. Neuron: the longest prompt rounded
    up to whole ``lcm(block, G)`` units when that is at most 8192 (one call per prompt, as before chunking), else 8192;
    the default context buckets end at the chunk; the planner's first candidate is the same number."""
    from minimax_m3.planner import chunk_choices

    assert EngineSpec("m", device="cpu", max_seq_len=300).resolve(TINY).prefill_chunk == 8192
    assert EngineSpec("m", device="cpu").resolve().prefill_chunk is None  # no model: nothing to round to
    cases = [  # (config, tp, max_seq_len, max_context_len) -> (chunk, context buckets)
        ((M3, 64, 8192, None), (8192, (128, 256, 512, 1024, 2048, 4096, 8192))),
        ((M3, 64, 1 << 20, None), (8192, (128, 256, 512, 1024, 2048, 4096, 8192))),
        ((M3, 64, 8192, 5000), (5120, (128, 256, 512, 1024, 2048, 4096, 5000))),  # bucket 5000: NxDI's cap
        ((TINY, 1, 128, 100), (112, (100,))),
    ]
    for (c, tp, seq, ctx), (chunk, buckets) in cases:
        s = EngineSpec("m", backend="neuron", tp=tp, max_seq_len=seq, max_context_len=ctx).resolve(c)
        assert (s.prefill_chunk, s.context_buckets, s.max_context_len) == (chunk, buckets, ctx or seq)
        assert chunk_choices(c, tp, ctx or seq)[0] == chunk
    # an explicit chunk: buckets end at it, and the largest bucket no longer caps the prompt
    s = EngineSpec("m", backend="neuron-cpu", max_seq_len=128, prefill_chunk=32).resolve(TINY)
    assert (s.prefill_chunk, s.context_buckets, s.max_context_len) == (32, (32,), 128)
    s = EngineSpec("m", backend="neuron-cpu", max_seq_len=128, prefill_chunk=32, context_buckets=(16, 32)).resolve(TINY)
    assert (s.context_buckets, s.max_context_len) == ((16, 32), 128)
    assert not [p for p in s.problems(TINY) if "chunk" in p or "bucket" in p]


def test_prefill_chunk_refusals_name_the_sizes_that_work(monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object())  # NxDI "importable": only our rules

    def problems(backend="neuron-cpu", config=TINY, **kw):
        return [p for p in EngineSpec("m", backend=backend, **kw).problems(config) if "chunk" in p]

    assert problems(max_seq_len=128, max_context_len=112, prefill_chunk=32) == []
    assert problems(max_seq_len=128, prefill_chunk=40) == [
        "prefill chunk of 40 tokens: it must be a multiple of 16 (the lcm of the index block, 16, and the KV group "
        "size, 1); nearest that work: [32, 48]: set --prefill-chunk (vLLM: prefill_chunk in override_neuron_config) "
        "to one of them"]
    assert problems("neuron", M3, tp=64, max_seq_len=8192, prefill_chunk=1000)[0].startswith(
        "prefill chunk of 1000 tokens: it must be a multiple of 128 (the lcm of the index block, 128, and the KV group "
        "size, 16); nearest that work: [896, 1024]")
    assert problems("reference", device="cpu", prefill_chunk=40)[0].startswith("prefill chunk of 40 tokens")
    assert problems(max_seq_len=128, prefill_chunk=0) == ["prefill_chunk (--prefill-chunk) must be >= 1, got 0"]
    assert problems(max_seq_len=128, prefill_chunk=32, context_buckets=(32, 64)) == [
        "context-encoding buckets [64] exceed prefill_chunk 32: drop them or raise --prefill-chunk (vLLM: "
        "prefill_chunk in override_neuron_config)"]
    assert problems(max_seq_len=128, prefill_chunk=32, context_buckets=(16,)) == [
        "the largest context-encoding bucket 16 is below prefill_chunk 32, so a whole chunk would fit no bucket: add "
        "32 to --context-buckets (vLLM: context_encoding_buckets) or lower --prefill-chunk (vLLM: prefill_chunk in "
        "override_neuron_config) to 16"]
    # the last call of a 112-token prompt starts at 96 and is written 32 wide (NxDI pads it to its bucket)
    assert problems(max_seq_len=112, max_context_len=112, prefill_chunk=32) == [
        "prompts of up to max_context_len 112 tokens are prefilled in calls of prefill_chunk 32, the last one written "
        "up to position 127, past the cache of max_seq_len 112: raise --max-seq-len to 128 or lower --max-context-len "
        "to 96"]
    with pytest.raises(SpecError, match="nearest that work"):
        EngineSpec("m", device="cpu", prefill_chunk=24).validate(TINY)


def test_prefill_chunk_is_an_engine_option_of_every_command():
    p = build_parser()
    runs = [["compile", *ENGINE_OPTS], ["generate", "--backend", "neuron", "--prompt-ids", "1", *ENGINE_OPTS],
            ["golden", "--backend", "neuron", "--prompts", "p", "--out", "o", *ENGINE_OPTS],
            ["longbench", "--backend", "neuron", "--data", "d", "--out", "o", *ENGINE_OPTS]]
    for argv in runs:
        assert spec_from_args(p.parse_args(argv)).prefill_chunk is None  # the backend's default
        assert spec_from_args(p.parse_args([*argv, "--prefill-chunk", "2048"])).prefill_chunk == 2048
    assert spec_from_kwargs("m", "neuron-cpu", prefill_chunk=32).prefill_chunk == 32
