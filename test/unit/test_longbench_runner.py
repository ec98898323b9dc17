"""The runner against a deterministic fake engine: protocol per task, scores, batching, resume after a crash."""

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from minimax_m3.checkpoint.toy_tokenizer import write_toy_tokenizer
from minimax_m3.engine import GenerationResult
from minimax_m3.eval.data import LongBenchDataError
from minimax_m3.eval.protocol import LongBenchTaskError
from minimax_m3.eval.runner import LongBenchRunError
from minimax_m3.eval.runner import run_longbench

# Handmade prompt table (our own wording) in the layout of a LongBench checkout.
PROMPTS = {"hotpotqa": "Docs:\n{context}\nQ: {input}\nA:", "trec": "{context}\n{input}",
           "samsum": "{context}\n\n{input}",
           "qasper": "{context} {input}"}
MAXLEN = {"hotpotqa": 16, "trec": 4, "samsum": 8, "qasper": 8}
REPLIES = {"KEY-h0": "Paris", "KEY-h1": "Paris, France", "KEY-h2": "", "KEY-t0": "City\nType: Date", "KEY-t1": "Date",
           "KEY-s0": "\nHi there"}  # fmt: skip


def sample(key, answers, classes=None, context=None):
    return {"input": "question?", "context": context or f"text {key} text", "answers": answers, "length": 50,
            "all_classes": classes, "_id": key, "dataset": "x", "language": "en"}  # fmt: skip


class FakeEngine:
    """Replies with REPLIES[key] for the key found in the prompt, then EOS; honours max_new_tokens and eos ids.
    ``fail_after``: raise once that many samples were generated (a crash mid-run)."""

    def __init__(self, tok, max_seq_len=400, fail_after=None):
        self.tok, self.max_seq_len, self.fail_after = tok, max_seq_len, fail_after
        self.config = SimpleNamespace(eos_token_id=tok.eos_token_id, vocab_size=512)
        self.calls, self.n = [], 0

    def _reply_ids(self, prompt):
        text = self.tok.decode(prompt)
        key = next(k for k in REPLIES if k in text)
        return self.tok.encode(REPLIES[key], add_special_tokens=False) + [self.tok.eos_token_id]

    def generate(self, prompts, gen):
        self.calls.append(([list(p) for p in prompts], gen))
        out = []
        for p in prompts:
            if self.fail_after is not None and self.n >= self.fail_after:
                raise RuntimeError("simulated crash")
            self.n += 1
            toks = []
            for t in self._reply_ids(p):
                if len(toks) == gen.max_new_tokens:
                    break
                toks.append(t)
                if t in gen.eos_token_ids:
                    break
            out.append(GenerationResult(toks, "eos" if toks and toks[-1] in gen.eos_token_ids else "length"))
        return out

    def prefill_logits(self, prompts):
        # next-token preference: the reply's first token, then "H"
        out = []
        for p in prompts:
            logits = torch.zeros(len(p), 512)
            logits[-1, self._reply_ids(p)[0]] = 2.0
            logits[-1, self.tok.convert_tokens_to_ids("H")] = 1.0
            out.append(logits)
        return out


@pytest.fixture()
def env(tmp_path):
    write_toy_tokenizer(tmp_path / "tok", 512)
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    lb = tmp_path / "LongBench" / "config"
    lb.mkdir(parents=True)
    (lb / "dataset2prompt.json").write_text(json.dumps(PROMPTS))
    (lb / "dataset2maxlen.json").write_text(json.dumps(MAXLEN))
    data = tmp_path / "data"
    data.mkdir()
    files = {
        "hotpotqa": [sample("KEY-h0", ["Paris"]), sample("KEY-h1", ["Paris"]), sample("KEY-h2", ["Rome"])],
        "trec": [sample("KEY-t0", ["City"], ["City", "Date"]), sample("KEY-t1", ["City"], ["City", "Date"])],
        "samsum": [sample("KEY-s0", ["H"])],
    }
    for task, rows in files.items():
        (data / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return SimpleNamespace(tok=tok, lb=tmp_path, data=data, out=tmp_path / "out")


def run(env, engine, **kw):
    return run_longbench(engine, env.tok, env.data, env.lb, kw.pop("tasks", "hotpotqa,trec,samsum"), env.out,
                         progress=False, **kw)


def test_full_run_protocol_and_scores(env):
    eng = FakeEngine(env.tok)
    report = run(env, eng, batch_size=2)
    t = report["tasks"]
    # hotpotqa: "Paris" 1, "Paris, France" vs "Paris" 2/3, "" 0 -> 100 * (5/3)/3 = 55.56
    assert t["hotpotqa"] == {"metric": "qa_f1", "n": 3, "score": 55.56}
    # trec: max_gen 4 cuts "City\nType: Date" to "City" -> 1; "Date" -> 0 -> 50.0
    assert t["trec"]["score"] == 50.0
    # samsum: free first token "\n" is banned (min_length), best allowed is "H"; then "\n" (extra EOS) ends it
    # -> pred "H\n" -> first line "H" vs "H": ROUGE-L 1.0
    assert t["samsum"]["score"] == 100.0
    preds = [json.loads(x) for x in (env.out / "pred" / "samsum.jsonl").read_text().splitlines()]
    assert preds[0]["pred"] == "H\n"
    # the protocol the engine saw
    by_task = {}
    for prompts, gen in eng.calls:
        text = env.tok.decode(prompts[0])
        task = "hotpotqa" if "KEY-h" in text else "trec" if "KEY-t" in text else "samsum"
        by_task.setdefault(task, []).append((prompts, gen))
    assert [len(p) for p, _ in by_task["hotpotqa"]] == [2, 1]  # batches of 2
    for task, calls in by_task.items():
        for prompts, gen in calls:
            assert gen.temperature == 0.0 and env.tok.eos_token_id in gen.eos_token_ids
            assert env.tok.decode(prompts[0]).startswith("<s><|user|>") == (task == "hotpotqa")  # chat rule
    assert by_task["hotpotqa"][0][1].max_new_tokens == 16 and by_task["trec"][0][1].max_new_tokens == 4
    newline = env.tok.encode("\n", add_special_tokens=False)[-1]
    assert newline in by_task["samsum"][0][1].eos_token_ids and newline not in by_task["trec"][0][1].eos_token_ids
    first = env.tok.decode(by_task["hotpotqa"][0][0][0])
    assert first == "<s><|user|>Docs:\ntext KEY-h0 text\nQ: question?\nA:<|end|><|assistant|>"
    assert (env.out / "report.json").exists()
    assert "| hotpotqa | qa_f1 | 3 | 55.56 |" in (env.out / "report.md").read_text()


def test_resume_after_crash_loses_nothing(env):
    with pytest.raises(RuntimeError, match="simulated crash"):
        run(env, FakeEngine(env.tok, fail_after=3), batch_size=1)
    done = (env.out / "pred" / "hotpotqa.jsonl").read_text().splitlines()
    assert len(done) == 3 and not (env.out / "pred" / "trec.jsonl").exists()
    # a crash in the middle of a write leaves a partial line: it is dropped and regenerated
    with open(env.out / "pred" / "trec.jsonl", "a") as f:
        f.write('{"_id": "KEY-t0", "pr')
    eng = FakeEngine(env.tok)
    report = run(env, eng, batch_size=1)
    seen = {k for prompts, _ in eng.calls for p in prompts for k in REPLIES if k in env.tok.decode(p)}
    assert seen == {"KEY-t0", "KEY-t1", "KEY-s0"}  # the 3 finished hotpotqa ids were skipped
    assert report["tasks"]["hotpotqa"]["score"] == 55.56 and report["tasks"]["trec"]["score"] == 50.0
    assert len((env.out / "pred" / "trec.jsonl").read_text().splitlines()) == 2
    # a third run has nothing to do and reproduces the report
    eng3 = FakeEngine(env.tok)
    assert run(env, eng3, batch_size=1)["tasks"] == report["tasks"] and eng3.calls == []


def test_truncation_limit_and_settings_guard(env):
    long_ctx = "x" * 300 + " KEY-h0 " + "y" * 300  # the key sits in the middle and is cut away...
    row = sample("KEY-h0", ["Paris"], context="KEY-h0 " + long_ctx)
    (env.data / "hotpotqa.jsonl").write_text(json.dumps(row) + "\n")
    report = run(env, FakeEngine(env.tok), tasks="hotpotqa", max_input_tokens=40)
    rec = json.loads((env.out / "pred" / "hotpotqa.jsonl").read_text())
    # ...but the head survives: 20 + 20 text ids + 4 chat-template ids
    assert rec["truncated"] and rec["prompt_tokens"] == 44 and rec["raw_prompt_tokens"] > 600
    assert report["tasks"]["hotpotqa"]["score"] == 100.0
    with pytest.raises(LongBenchRunError, match="other settings.*max_input_tokens: was 40, now 50"):
        run(env, FakeEngine(env.tok), tasks="hotpotqa", max_input_tokens=50)


def test_limit_and_bad_input_fail_before_generating(env):
    eng = FakeEngine(env.tok)
    report = run(env, eng, tasks="hotpotqa", limit=1)
    assert report["tasks"]["hotpotqa"]["n"] == 1 and sum(len(p) for p, _ in eng.calls) == 1
    eng = FakeEngine(env.tok)
    with pytest.raises(LongBenchDataError, match=r"no qasper\.jsonl"):
        run(env, eng, tasks="hotpotqa,qasper")
    with pytest.raises(LongBenchTaskError, match="unknown LongBench task 'hotpot'"):
        run(env, eng, tasks="hotpot")
    (env.data / "trec.jsonl").write_text("{bad\n")
    with pytest.raises(LongBenchDataError, match=r"trec\.jsonl:1"):
        run(env, eng, tasks="hotpotqa,trec")
    assert eng.calls == []


def test_v2_run(env):
    REPLIES.update({"KEY-v0": "**The correct answer is (B)**",
                    "KEY-v1": "<think>The correct answer is (B)</think>The correct answer is (C)",
                    "KEY-v2": ""})
    (env.lb / "prompts").mkdir()
    (env.lb / "prompts" / "0shot.txt").write_text("Text: $DOC$\nQ: $Q$\n(A) $C_A$ (B) $C_B$ (C) $C_C$ (D) $C_D$")
    items = [{"_id": f"v{i}", "domain": "d", "difficulty": diff, "length": length, "question": f"KEY-v{i}?",
              "answer": "B", "context": " ctx ", **{f"choice_{k}": k.lower() for k in "ABCD"}}
             for i, (diff, length) in enumerate([("easy", "short"), ("hard", "short"), ("hard", "long")])]  # fmt: skip
    (env.data / "data.json").write_text(json.dumps(items))
    eng = FakeEngine(env.tok)
    report = run(env, eng, tasks="v2")
    # Official protocol: v0 '*' removed -> "(B)" right. v1: no think stripping, the regex's first match is the
    # "(B)" inside the thinking -> right. v2: empty output -> pred.py writes no line, so it is not counted.
    # Over the 2 counted items: overall 2/2, easy 1/1, hard 1/1, short 2/2, no medium or long item.
    assert report["tasks"]["v2"] == {"overall": 100.0, "easy": 100.0, "hard": 100.0, "short": 100.0, "medium": None,
                                     "long": None, "n": 2, "n_unextracted": 0, "n_empty_output": 1}  # fmt: skip
    recs = {r["_id"]: r for r in map(json.loads, (env.out / "pred" / "v2.jsonl").read_text().splitlines())}
    assert recs["v2"]["empty_output"] and recs["v2"]["response"] == "" and not recs["v0"]["empty_output"]
    prompts, gen = eng.calls[0]
    assert env.tok.decode(prompts[0]) == "<s><|user|>Text: ctx\nQ: KEY-v0?\n(A) a (B) b (C) c (D) d<|end|><|assistant|>"
    assert gen.max_new_tokens == 128 and gen.temperature == 0.1
    # a resume may not switch the option: the stored answers depend on it
    with pytest.raises(LongBenchRunError, match="strip_thinking: was False, now True"):
        run(env, FakeEngine(env.tok), tasks="v2", strip_thinking=True)
    # --strip-thinking (opt-in): v1's answer is taken after the thinking block -> C, wrong: hard 0/1, overall 1/2
    env.out = env.lb / "out_think"
    report = run(env, FakeEngine(env.tok), tasks="v2", strip_thinking=True)
    assert report["tasks"]["v2"] == {"overall": 50.0, "easy": 100.0, "hard": 0.0, "short": 50.0, "medium": None,
                                     "long": None, "n": 2, "n_unextracted": 0, "n_empty_output": 1}  # fmt: skip


def test_bad_input_budget(env):
    with pytest.raises(LongBenchRunError, match="max_input_tokens must be >= 1, got 0"):
        run(env, FakeEngine(env.tok), tasks="hotpotqa", max_input_tokens=0)
