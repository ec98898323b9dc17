"""MiniMax-M3's vLLM Neuron model (``minimax_m3.vllm_neuron``) under real vLLM 0.24 on CPU, through the harness that
builds its forward calls as vllm-neuron 1.x's runner does (``test/support/vllm_neuron``): vLLM's own scheduler,
KV-cache manager, prefix caching, chunked prefill and sampler, unmodified.

Oracle: the reference backend's greedy tokens (``ReferenceEngine``, float32, one request at a time in contiguous caches;
graded against transformers' ``minimax_m3_vl`` in ``test/integration``). Synthetic tiny checkpoint: 16-token blocks,
top-2, so every prompt here longer than 32 tokens runs with sparse selection active. The harness's trace counts the
tokens each forward ran and the engine step of every sampled token."""

from __future__ import annotations

from collections import defaultdict

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (scripts/test_vllm_neuron_offdevice.sh builds it)")
pytest.importorskip("m3_vneuron_harness", reason="the harness plugin is not installed (test/support/vllm_neuron)")

import torch  # noqa: E402

from test.vllm_neuron.test_harness import drive, ext, forwards_of  # noqa: E402

BLOCK = 16  # the tiny preset's index block: the page size
MODELS = "minimax_m3.vllm_neuron.plugin:models"
ENGINE = dict(max_model_len=320, max_num_seqs=4, max_num_batched_tokens=2 * BLOCK, block_size=BLOCK,
              enable_prefix_caching=True, enable_chunked_prefill=True, num_gpu_blocks_override=128)


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def m3(tmp_path_factory):
    from minimax_m3.checkpoint.synthetic import write_synthetic
    from minimax_m3.checkpoint.toy_tokenizer import CHAT_TEMPLATE
    from minimax_m3.reference.engine import ReferenceEngine

    # the toy chat template: M3's fixed system block alone is ~810 byte tokens, past the served 256-token context
    path = write_synthetic(tmp_path_factory.mktemp("m3") / "tiny", "tiny", seed=0, chat_template=CHAT_TEMPLATE)
    return path, ReferenceEngine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=512)


def reference_greedy(engine, prompt: list[int], n: int) -> list[int]:
    from minimax_m3 import GenerationConfig

    return engine.generate([prompt], GenerationConfig(max_new_tokens=n))[0].tokens


def requests() -> list[dict]:
    long, a = _ids(200, 1), _ids(60, 2)
    return [
        {"id": "early", "prompt": _ids(40, 3), "max_tokens": 24, "arrive": 0},
        {"id": "long", "prompt": long, "max_tokens": 6, "arrive": 2},  # 200 tokens in 32-token segments
        {"id": "a", "prompt": a, "max_tokens": 6, "arrive": 2},
        # after long's prefill: 72 shared tokens (four whole blocks + 8 of the fifth, a prefix ending mid-block)
        {"id": "hit", "prompt": long[:72] + _ids(20, 4), "max_tokens": 6, "arrive": 14},
        {"id": "cold", "prompt": _ids(33, 5), "max_tokens": 6, "arrive": 14},
    ]


@pytest.fixture(scope="module")
def served(m3, tmp_path_factory):
    path, ref = m3
    reqs = requests()
    out, records = drive(tmp_path_factory.mktemp("served"), path, ENGINE, reqs, env={"M3_VNEURON_MODELS": MODELS})
    return reqs, out, records, ref


def test_greedy_tokens_equal_the_reference(served):
    reqs, out, _, ref = served
    for r in reqs:
        assert out["tokens"][r["id"]] == reference_greedy(ref, r["prompt"], r["max_tokens"]), r["id"]


def test_the_index_keys_share_the_block_table(served):
    """Every sparse layer's index-key spec (one head of index_head_dim / 2) is in the one KV-cache group."""
    _, _, records, _ = served
    (kv,) = [r for r in records if r["event"] == "kv_cache"]
    (group,) = kv["groups"]
    n = kv["num_blocks"]
    assert group["layers"]["layers.0.self_attn"] == [n, 2, BLOCK, 32]
    assert all(group["layers"][f"layers.{i}.self_attn.index_k"] == [n, 1, BLOCK, 16] for i in (1, 2, 3))
    assert "layers.0.self_attn.index_k" not in group["layers"]  # layer 0 is dense


def test_a_prefix_hit_runs_only_the_new_tokens(served):
    """hit shares long's first 72 tokens: vLLM's prefix cache serves the four whole blocks (64), the model runs the
    other 28 from position 64 (the shared tokens of the fifth block are recomputed), and its tokens are the cold
    reference's; cold (no shared prefix) runs all 33."""
    _, _, records, _ = served
    for rid, first, ran in (("hit", 64, 92 - 64), ("cold", 0, 33), ("long", 0, 200)):
        pre = forwards_of(records, rid, "prefill")
        assert pre[0]["first_positions"][0] == first and pre[0]["cached_seq_len"] == first, rid
        assert sum(r["num_tokens"][0] for r in pre) == ran, rid


def test_a_long_prompt_is_prefilled_in_segments_while_others_decode(served):
    """max_num_batched_tokens = two blocks: long's 200 tokens run as seven 32-token-bucket forwards on seven steps,
    while early keeps decoding: one token every step, never a step between its tokens."""
    _, out, records, _ = served
    pre = forwards_of(records, "long", "prefill")
    assert len(pre) == 7 and all(r["input_ids_shape"] == [32] for r in pre)
    steps = sorted({r["step"] for r in pre})
    early = out["token_steps"]["early"]
    during = [s for s in early if steps[0] <= s <= steps[-1]]
    assert len(during) >= len(steps)  # early got a token in every step of long's prefill
    assert max(b - a for a, b in zip(early, early[1:])) == 1


def test_preemption_recomputes_the_same_tokens(m3, tmp_path):
    """Too few pages for both requests to finish: vLLM preempts one and later recomputes it (a prefill of prompt +
    the tokens it had); the tokens are the reference's."""
    path, ref = m3
    engine = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=128, block_size=BLOCK,
                  enable_prefix_caching=False, num_gpu_blocks_override=9)
    reqs = [{"id": "x", "prompt": _ids(60, 11), "max_tokens": 12, "arrive": 0},
            {"id": "y", "prompt": _ids(58, 12), "max_tokens": 12, "arrive": 0}]
    out, records = drive(tmp_path, path, engine, reqs, env={"M3_VNEURON_MODELS": MODELS})
    for r in reqs:
        assert out["tokens"][r["id"]] == reference_greedy(ref, r["prompt"], r["max_tokens"]), r["id"]
    prefills = defaultdict(int)
    for r in records:
        if r["event"] == "forward" and r["kind"] == "prefill":
            prefills[r["req_ids"][0]] += 1
    assert max(prefills.values()) >= 2, prefills  # a request prefilled twice: preempted, then recomputed


def test_vllm_serve_answers_completions_and_chat_completions(m3, tmp_path):
    """``vllm serve`` (the OpenAI server, its engine core in a process of its own, where the plugins register again)
    on the harness: a completion and a chat completion, each greedy, each equal to the reference's tokens (the chat
    prompt as vLLM's chat template rendered it)."""
    import os
    import sys

    from test.support.openai_server import free_port, post, serving
    from test.vllm_neuron.test_harness import REPO

    path, ref = m3
    port = free_port()
    env = dict(os.environ, M3_VNEURON_HARNESS="1", VLLM_PLUGINS="m3_vneuron_harness", M3_VNEURON_MODELS=MODELS,
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(path), "--host", "127.0.0.1", "--port",
           str(port), "--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "256",
           "--max-num-seqs", "2", "--max-num-batched-tokens", "64", "--served-model-name", "m3-tiny",
           "--num-gpu-blocks-override", "64"]
    with serving(cmd, port, env, tmp_path / "serve.log", cwd=REPO):
        url = f"http://127.0.0.1:{port}/v1"
        prompt = _ids(50, 21)
        out = post(f"{url}/completions", {"model": "m3-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0.0,
                                          "ignore_eos": True, "return_token_ids": True})
        assert out["choices"][0]["token_ids"] == reference_greedy(ref, prompt, 8)
        chat = post(f"{url}/chat/completions", {
            "model": "m3-tiny", "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True,
            "messages": [{"role": "user", "content": "Where is the needle?"}]})
        choice = chat["choices"][0]
        assert choice["message"]["role"] == "assistant"
        assert choice["token_ids"] == reference_greedy(ref, chat["prompt_token_ids"], 6)


@pytest.mark.parametrize("draft", [False, True], ids=["plain", "eagle3"])
def test_tensor_parallel_2_one_kv_head_per_rank(m3, tmp_path, draft):
    """tensor_parallel_size 2 (vLLM's multiprocess executor, a gloo group of two CPU workers): each rank holds 4 of
    the 8 query heads, one of the 2 KV heads (its pages [N, 1, 16, 32]) and half the vocabulary; the model's
    collectives run on vLLM's TP group. Prefix caching and 32-token segments on; tokens = the reference's. With the
    synthetic EAGLE3 draft, split over the two ranks too (``vllm_neuron.eagle3.shard_draft_``: 2 of its 4 heads and
    their K/V pages, half its MLP and draft vocabulary per rank), the verify steps run on the split heads: the same
    tokens, and every step's drafts equal the reference drafter's (one rank, float32)."""
    path, ref = m3
    engine = dict(ENGINE, max_num_seqs=2, num_gpu_blocks_override=64, tensor_parallel_size=2,
                  distributed_executor_backend="mp")
    if draft:
        from minimax_m3.checkpoint.draft import write_synthetic_draft
        from minimax_m3.config import M3Config

        d = write_synthetic_draft(tmp_path / "draft", M3Config.from_pretrained(path), seed=1)
        engine["speculative_config"] = {"method": "eagle3", "model": str(d), "num_speculative_tokens": 2}
    reqs = [{"id": "x", "prompt": _ids(70, 31), "max_tokens": 6, "arrive": 0},
            {"id": "y", "prompt": _ids(40, 32), "max_tokens": 6, "arrive": 2}]
    env = {"M3_VNEURON_MODELS": MODELS, "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # vLLM's CPU workers would pin threads to one NUMA node each
    out, records = drive(tmp_path, path, engine, reqs, env=env)
    for r in reqs:
        assert out["tokens"][r["id"]] == reference_greedy(ref, r["prompt"], r["max_tokens"]), r["id"]
    (kv,) = [r for r in records if r["event"] == "kv_cache"][:1]
    assert kv["groups"][0]["layers"]["layers.1.self_attn"] == [kv["num_blocks"], 1, BLOCK, 32]
    assert draft == any(r["event"] == "forward" and r["kind"] == "verify" for r in records)
    if draft:
        loaded = [r for r in records if r["event"] == "draft"]
        assert len(loaded) == 2 and all(r["sharded"] and r["kv_spec"] == [["layers.4.self_attn", 2, 32]]
                                        for r in loaded), loaded
        _assert_reference_drafts(records, reqs, d, ref, 2, events=6)


@pytest.mark.parametrize("sampling", ["host", "on device"])
def test_compiled_like_the_plugin_no_recompile(m3, tmp_path, sampling):
    """M3_VNEURON_COMPILE=aot_eager: the harness compiles the model as the plugin does (torch.compile, fullgraph),
    warms every bucket (32-token prefill segments, decode batches 1, 2, 4), then makes any recompile an error. A run
    with segments, a prefix hit and a decode batch compiles nothing more, and its tokens are the reference's; with
    on-device sampling too (the sampler inside the captured graph, ``sampling_params`` an input)."""
    path, ref = m3
    long = _ids(80, 41)
    reqs = [{"id": "p", "prompt": long, "max_tokens": 4, "arrive": 0},
            {"id": "q", "prompt": long[:48] + _ids(5, 42), "max_tokens": 4, "arrive": 4},
            {"id": "s", "prompt": _ids(20, 43), "max_tokens": 3, "arrive": 4}]
    engine = ENGINE if sampling == "host" else dict(
        ENGINE, additional_config={"neuron_config": {"on_device_sampling_config": {}}})
    out, records = drive(tmp_path, path, engine, reqs, env={"M3_VNEURON_MODELS": MODELS,
                                                           "M3_VNEURON_COMPILE": "aot_eager"})
    for r in reqs:
        assert out["tokens"][r["id"]] == reference_greedy(ref, r["prompt"], r["max_tokens"]), r["id"]
    assert {r["input_ids_shape"][0] for r in records if r["event"] == "forward"} <= {32, 1, 2, 4}


def test_fp8_experts_equal_the_reference_on_the_same_fp8_values(m3, tmp_path):
    """``neuron_config.quantization: "fp8"`` (the plugin's knob): the routed experts held as per-channel e4m3 with
    fp32 scales applied to each product's output (``ops.moe.scaled``). Oracle: the reference with the same experts
    dequantized *before* the matmul (``checkpoint.fp8_experts.fp8_twin_``): with power-of-two scales both are exact
    in float32, so the greedy tokens are the reference's token for token, with prefix caching and segments on. A
    value the model does not serve is refused at start-up naming the option."""
    import copy

    from minimax_m3.checkpoint.fp8_experts import fp8_twin_
    from minimax_m3.reference.engine import ReferenceEngine

    path, ref = m3
    twin = copy.deepcopy(ref.model)
    fp8_twin_(twin)
    oracle = ReferenceEngine(twin, max_seq_len=512)
    long = _ids(90, 51)
    reqs = [{"id": "p", "prompt": long, "max_tokens": 8, "arrive": 0},
            {"id": "q", "prompt": long[:64] + _ids(9, 52), "max_tokens": 6, "arrive": 6},
            {"id": "r", "prompt": _ids(35, 53), "max_tokens": 6, "arrive": 6}]
    engine = dict(ENGINE, additional_config={"neuron_config": {"quantization": "fp8"}})
    (tmp_path / "fp8").mkdir()
    (tmp_path / "bad").mkdir()
    out, _ = drive(tmp_path / "fp8", path, engine, reqs, env={"M3_VNEURON_MODELS": MODELS})
    for r in reqs:
        assert out["tokens"][r["id"]] == reference_greedy(oracle, r["prompt"], r["max_tokens"]), r["id"]
    plain = [reference_greedy(ref, r["prompt"], r["max_tokens"]) for r in reqs]
    assert plain != [out["tokens"][r["id"]] for r in reqs]  # the fp8 experts changed something: the oracle matters
    with pytest.raises(AssertionError, match="quantization 'mxfp4'"):
        drive(tmp_path / "bad", path, dict(ENGINE, additional_config={"neuron_config": {"quantization": "mxfp4"}}),
              reqs[:1], env={"M3_VNEURON_MODELS": MODELS})


def test_on_device_sampling_draws_in_the_model(m3, tmp_path):
    """``neuron_config.on_device_sampling_config`` (the plugin's default; ``{}``: its defaults, 256 candidates): the
    forward gets the runner's ``sampling_params`` and returns ``(ids, logits)``, and the runner takes the ids (no host
    sampler). Greedy requests — temperature 0, and top_k 1 at temperature 1 — give the reference's greedy tokens
    with prefix caching and segments on, batched; a temperature-1, top_k 3 request draws every token among the
    reference's 3 most likely at its position (the reference's logits along the drawn sequence) and not all of them
    greedy (the draw happened). A field the model cannot honour is refused at start-up naming it."""
    path, ref = m3
    long = _ids(90, 61)
    reqs = [{"id": "greedy", "prompt": long, "max_tokens": 8, "arrive": 0},
            {"id": "top1", "prompt": long[:64] + _ids(9, 62), "max_tokens": 6, "arrive": 6,
             "sampling": {"temperature": 1.0, "top_k": 1}},
            {"id": "drawn", "prompt": _ids(35, 63), "max_tokens": 16, "arrive": 6,
             "sampling": {"temperature": 1.0, "top_k": 3}}]
    engine = dict(ENGINE, additional_config={"neuron_config": {"on_device_sampling_config": {}}})
    (tmp_path / "ods").mkdir()
    out, _ = drive(tmp_path / "ods", path, engine, reqs, env={"M3_VNEURON_MODELS": MODELS})
    for r in reqs[:2]:
        assert out["tokens"][r["id"]] == reference_greedy(ref, r["prompt"], r["max_tokens"]), r["id"]
    prompt, drawn = reqs[2]["prompt"], out["tokens"]["drawn"]
    logits = ref.prefill_logits([prompt + drawn])[0][len(prompt) - 1:-1]
    top3 = logits.topk(3, dim=-1).indices.tolist()
    assert len(drawn) == 16 and all(tok in top for tok, top in zip(drawn, top3)), (drawn, top3)
    assert [top[0] for top in top3] != drawn  # some token was not the most likely one
    (tmp_path / "bad").mkdir()
    bad = {"neuron_config": {"on_device_sampling_config": {"sampling_dp_degree": 2}}}
    with pytest.raises(AssertionError, match="sampling_dp_degree 2"):
        drive(tmp_path / "bad", path, dict(ENGINE, additional_config=bad), reqs[:1], env={"M3_VNEURON_MODELS": MODELS})


def test_tensor_parallel_2_one_kv_head_split_selection(tmp_path):
    """tensor_parallel_size 2 on a checkpoint with ONE KV head (and index head): both ranks hold its pages, so a
    prefill segment's index selection is split by query between them (``ops.QuerySplit``: each scores 16 of a
    32-token segment's queries, one all-gather of the block ids over vLLM's TP group). Prefix caching and segments
    on; tokens = the reference's (the reference selects every query whole)."""
    from minimax_m3.checkpoint.synthetic import write_synthetic
    from minimax_m3.config import M3Config
    from minimax_m3.reference.engine import ReferenceEngine
    from minimax_m3.vllm_neuron.contract import Layout
    from minimax_m3.vllm_neuron.model import MiniMaxM3ForCausalLM

    config = M3Config.preset("tiny").replace(num_kv_heads=1, index_heads=1)
    path = write_synthetic(tmp_path / "one-kv", config, seed=3)
    ref = ReferenceEngine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=512)
    split = MiniMaxM3ForCausalLM(config, Layout(world=2, rank=1, dtype=torch.float32)).query_split()
    assert (split.parts, split.index) == (2, 1)
    engine = dict(ENGINE, max_num_seqs=2, num_gpu_blocks_override=64, tensor_parallel_size=2,
                  distributed_executor_backend="mp")
    long = _ids(90, 71)
    reqs = [{"id": "x", "prompt": long, "max_tokens": 6, "arrive": 0},
            {"id": "y", "prompt": long[:64] + _ids(11, 72), "max_tokens": 6, "arrive": 4}]
    env = {"M3_VNEURON_MODELS": MODELS, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    (tmp_path / "run").mkdir()
    out, records = drive(tmp_path / "run", path, engine, reqs, env=env)
    for r in reqs:
        assert out["tokens"][r["id"]] == reference_greedy(ref, r["prompt"], r["max_tokens"]), r["id"]
    assert any(r["kind"] == "prefill" and r["input_ids_shape"][0] == 2 * BLOCK
               for r in records if r["event"] == "forward")


def _sequences(records, reqs) -> dict[int, tuple[str, list[int], list[int]]]:
    """Per ``drafts`` event of the trace (by its index): (request, its tokens up to the last sampled one, the
    drafts proposed after it); rank 0's records (every rank of a TP group traces)."""
    seqs = {r["id"]: list(r["prompt"]) for r in reqs}
    out = {}
    for i, rec in enumerate(records):
        if rec.get("rank", 0):
            continue
        if rec["event"] == "sampled":
            for rid, toks in rec["tokens"].items():
                seqs[ext(rid)] += toks
        elif rec["event"] == "drafts":
            for rid, drafts in rec["drafts"].items():
                out[(i, rid)] = (ext(rid), list(seqs[ext(rid)]), drafts)
    return out


def test_eagle3_speculative_config_equals_plain_greedy(m3, tmp_path):
    """``--speculative-config '{"method": "eagle3", "model": DRAFT, "num_speculative_tokens": 3}'`` with the
    synthetic EAGLE3 draft (``minimax-m3 synth --draft eagle3``), batched, a prefix hit and 32-token segments on:
    vLLM's scheduler schedules each request's last token and its drafts, the harness runs them as one verify forward
    (``1 + k`` tokens a row, the plugin's verify graph) and the target's tokens are the reference's plain greedy
    ones. The drafts each step proposes equal the reference drafter's (``reference.eagle3.Eagle3Drafter`` over the
    reference target's states of the same tokens, float32), so the draft under vLLM is the same draft."""
    from minimax_m3.checkpoint.draft import write_synthetic_draft
    from minimax_m3.config import M3Config

    path, ref = m3
    draft = write_synthetic_draft(tmp_path / "draft", M3Config.from_pretrained(path), seed=1)
    long = _ids(70, 81)
    reqs = [{"id": "p", "prompt": long, "max_tokens": 10, "arrive": 0},
            {"id": "q", "prompt": long[:48] + _ids(7, 82), "max_tokens": 8, "arrive": 3},
            {"id": "r", "prompt": _ids(21, 83), "max_tokens": 8, "arrive": 3}]
    engine = dict(ENGINE, speculative_config={"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3})
    (tmp_path / "run").mkdir()
    out, records = drive(tmp_path / "run", path, engine, reqs, env={"M3_VNEURON_MODELS": MODELS})
    for r in reqs:
        assert out["tokens"][r["id"]] == reference_greedy(ref, r["prompt"], r["max_tokens"]), r["id"]
    verify = [r for r in records if r["event"] == "forward" and r["kind"] == "verify"]
    assert verify and all(r["input_ids_shape"][0] in (4, 8, 16) and r["max_query_len"] == 4 for r in verify)
    _assert_reference_drafts(records, reqs, draft, ref, 3, events=8)


def _assert_reference_drafts(records, reqs, draft, ref, k: int, events: int) -> None:
    """The first ``events`` drafts of the trace against the reference drafter's over the reference target's states
    of the same tokens (one rank, float32)."""
    import json

    from minimax_m3.reference.eagle3 import load_drafter

    drafter = load_drafter(draft, ref.model)
    checked = 0
    for rid, seq, drafts in list(_sequences(records, reqs).values())[:events]:
        n = len(seq) - 1  # the target states of positions 0 .. n - 1; the token at n is the last sampled
        cache = ref.model.new_cache(1, n + 8)
        _, states = ref.model(torch.tensor([seq[:n]]), torch.arange(n).unsqueeze(0), cache, n, decode=False,
                              hidden_at=drafter.aux_layers)
        drafter.reset(1, n + 8)
        drafter.extend(0, 0, states[0], seq[1:n])
        want = drafter.propose(0, seq[n], n, k, lambda j, x: int(x.argmax()))
        assert drafts == want, (rid, n, json.dumps(drafts), want)
        checked += 1
    assert checked == events


@pytest.mark.parametrize("sampling,compiled", [("host", False), ("device", False), ("device", True)],
                         ids=["host", "on-device", "on-device-compiled"])
def test_accepted_drafts_give_several_tokens_a_step_and_the_same_tokens(m3, tmp_path, sampling, compiled):
    """A scripted draft (``test/support/vllm_neuron/scripted_draft.py``) proposes the target's own greedy
    continuation where a pattern says so and another token elsewhere, for one request (``s``) while another
    (``t``, off the script: every draft rejected) decodes beside it. vLLM's scheduler then rolls back the rejected
    drafts each step, the pages they were written to are written again before any query reads them, and: both
    requests' tokens are the reference's; ``s`` gets, step by step, exactly the tokens a hand count of the pattern
    gives (accepted drafts + 1), fewer steps than tokens. With on-device sampling the model decides a verify step
    itself (``sampling.verify``: ``(tokens [rows, 1 + k], states, logits, last)``, the plugin's ODS + EAGLE3 return)
    and the runner takes its tokens; compiled as the plugin compiles (``aot_eager``, fullgraph, every bucket warmed:
    with drafts each batch bucket also as a ``1 + k`` verify graph, then no recompile), the same."""
    import json
    import shutil

    from minimax_m3.checkpoint.draft import write_synthetic_draft
    from minimax_m3.config import M3Config

    path, ref = m3
    k, n = 3, 14
    prompt = _ids(40, 91)
    agree = [False, True, True, True, True, False, True, False, False, True, True, True, True, True, True, True,
             True, True, True, True]
    draft = write_synthetic_draft(tmp_path / "draft", M3Config.from_pretrained(path), seed=1)
    gold = reference_greedy(ref, prompt, n + k + 2)
    (draft / "script.json").write_text(json.dumps({"sequence": prompt + gold, "prompt_len": len(prompt),
                                                   "agree": agree}))
    expected, g = [1], 0  # tokens per step: the prefill's, then accepted drafts + the target's next
    while g + 1 < n:
        a = next((j for j in range(k) if not agree[g + 1 + j]), k)
        expected.append(a + 1)
        g += a + 1
    reqs = [{"id": "s", "prompt": prompt, "max_tokens": n, "arrive": 0},
            {"id": "t", "prompt": _ids(30, 92), "max_tokens": 8, "arrive": 0}]
    engine = dict(ENGINE, speculative_config={"method": "eagle3", "model": str(draft), "num_speculative_tokens": k})
    if sampling == "device":
        engine["additional_config"] = {"neuron_config": {"on_device_sampling_config": {}}}
    (tmp_path / "run").mkdir()
    env = {"M3_VNEURON_MODELS": f"{MODELS},test.support.vllm_neuron.scripted_draft:MODELS"}
    out, records = drive(tmp_path / "run", path, engine, reqs,
                         env={**env, "M3_VNEURON_COMPILE": "aot_eager"} if compiled else env)
    shutil.rmtree(draft)
    assert out["tokens"]["s"] == gold[:n]
    assert out["tokens"]["t"] == reference_greedy(ref, reqs[1]["prompt"], 8)
    per_step = [len(r["tokens"][rid]) for r in records if r["event"] == "sampled"
                for rid in r["tokens"] if ext(rid) == "s" and r["tokens"][rid]]
    assert per_step == expected, (per_step, expected)
    assert sum(per_step) >= n > len(per_step)


def test_a_draft_for_another_target_is_refused_at_start_up(m3, tmp_path):
    """An EAGLE3 draft whose widths do not fit the served target fails vLLM's start-up with the draft checker's one
    error (``checkpoint.draft.DraftError``: every problem, naming the field), before any request."""
    from minimax_m3.checkpoint.draft import write_synthetic_draft
    from minimax_m3.config import M3Config

    path, _ = m3
    other = M3Config.from_pretrained(path).replace(hidden_size=96)
    draft = write_synthetic_draft(tmp_path / "draft", other, seed=1)
    engine = dict(ENGINE, speculative_config={"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2})
    (tmp_path / "run").mkdir()
    with pytest.raises(AssertionError, match="(?s)EAGLE3 draft .*1 problem.*the target's hidden_size is 128"):
        drive(tmp_path / "run", path, engine, [{"id": "x", "prompt": _ids(20, 93), "max_tokens": 2, "arrive": 0}],
              env={"M3_VNEURON_MODELS": MODELS})


def test_decode_context_parallel_2_pages_dealt_by_block(tmp_path):
    """tensor_parallel_size 2, decode_context_parallel_size 2 on a checkpoint with ONE KV head: the two ranks (vLLM's
    DCP group) hold every other 16-token page of each request (the plugin's slot mapping, interleave = the block:
    block ``n`` on rank ``n mod 2``, the other rank writing the token to the null page; a prefill segment's slots cut
    to the rank's blocks). Each rank scores its own blocks, the group merges the candidates, each reads the selected
    pages it holds, the all-to-all merges the partial softmaxes. Prefix caching (a 64-token hit: two laps of the
    32-token virtual block vLLM's DCP hashes), 32-token segments, two requests decoding together: tokens = the
    reference's (one rank, contiguous caches); the segments that start on a lap carry half their slots."""
    from minimax_m3.checkpoint.synthetic import write_synthetic
    from minimax_m3.config import M3Config
    from minimax_m3.reference.engine import ReferenceEngine

    config = M3Config.preset("tiny").replace(num_kv_heads=1, index_heads=1)
    path = write_synthetic(tmp_path / "one-kv", config, seed=5)
    ref = ReferenceEngine.from_pretrained(path, device="cpu", dtype="float32", max_seq_len=512)
    engine = dict(ENGINE, max_num_seqs=2, num_gpu_blocks_override=64, tensor_parallel_size=2,
                  decode_context_parallel_size=2, distributed_executor_backend="mp")
    long = _ids(100, 81)
    reqs = [{"id": "x", "prompt": long, "max_tokens": 8, "arrive": 0},
            {"id": "y", "prompt": long[:64] + _ids(30, 82), "max_tokens": 8, "arrive": 6},
            {"id": "z", "prompt": _ids(45, 83), "max_tokens": 6, "arrive": 7}]
    env = {"M3_VNEURON_MODELS": MODELS, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    (tmp_path / "run").mkdir()
    out, records = drive(tmp_path / "run", path, engine, reqs, env=env)
    for r in reqs:
        assert out["tokens"][r["id"]] == reference_greedy(ref, r["prompt"], r["max_tokens"]), r["id"]
    fwd = [r for r in records if r["event"] == "forward" and r.get("rank", 0) == 0]
    (kv,) = [r for r in records if r["event"] == "kv_cache"][:1]
    assert kv["groups"][0]["layers"]["layers.1.self_attn"] == [kv["num_blocks"], 1, BLOCK, 32]
    # vLLM's table counts 32-token virtual blocks: a rank's line is half the context
    assert all(r["block_table_shape"][1] * BLOCK * 2 >= 320 for r in fwd)
    cut = [r for r in fwd if r["kind"] == "prefill" and r["dcp_slots"] * 2 == r["input_ids_shape"][0]]
    assert cut, "no prefill segment carried the plugin's cut slot mapping"
    # z's second segment starts where the decodes of its step left vLLM's scheduler (not on a lap): a slot per token
    assert any(r["kind"] == "prefill" and r["dcp_slots"] == r["input_ids_shape"][0] and r["first_positions"][0] % 32
               for r in fwd)
    hit = [r for r in fwd if r["kind"] == "prefill" and ext(r["req_ids"][0]) == "y"]
    assert hit[0]["first_positions"] == [64] and sum(n for r in hit for n in r["num_tokens"]) == 30
    assert any(r["kind"] == "decode" and len(r["req_ids"]) == 2 for r in fwd)
