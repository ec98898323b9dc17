"""End to end: the tiny synthetic model through the reference engine, the CLI command, a crash and a resume."""

import argparse
import json

import pytest
from transformers import AutoTokenizer

from minimax_m3.checkpoint.synthetic import write_synthetic
from minimax_m3.load import load_engine
from minimax_m3.eval.commands import register
from minimax_m3.eval.runner import run_longbench

# Our own handmade prompt table and samples, laid out like a LongBench checkout.
PROMPTS = {"hotpotqa": "Read the notes.\n\n{context}\n\nQuestion: {input}\nAnswer:",
           "trec": "Label it.\n\n{context}\n{input}"}
MAXLEN = {"hotpotqa": 8, "trec": 6}
MAX_LEN = 1280


def rows(task):
    filler = " ".join(f"note{i} the river flows past the mill" for i in range(30))  # long enough to be truncated
    if task == "hotpotqa":
        return [{"input": f"Where is mill {i}?", "context": f"Mill {i} stands in Avonford. {filler}",
                 "answers": ["Avonford"], "length": 300, "all_classes": None, "_id": f"h{i}"} for i in range(3)]
    return [{"input": f"Question {i}: who built it?\nType:", "context": "Q: where?\nType: Location",
             "answers": ["Person"], "length": 20, "all_classes": ["Location", "Person"], "_id": f"t{i}"}
            for i in range(2)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lb")
    model = write_synthetic(root / "model", preset="tiny", seed=0)
    (root / "LongBench" / "config").mkdir(parents=True)
    (root / "LongBench" / "config" / "dataset2prompt.json").write_text(json.dumps(PROMPTS))
    (root / "LongBench" / "config" / "dataset2maxlen.json").write_text(json.dumps(MAXLEN))
    data = root / "LongBench" / "data"
    data.mkdir()
    for task in PROMPTS:
        (data / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(task)))
    # M3's chat template (the synthetic checkpoint's) adds ~810 ids around a prompt: its fixed system block
    engine = load_engine(str(model), backend="reference", device="cpu", max_seq_len=MAX_LEN)
    return root, model, data, engine, AutoTokenizer.from_pretrained(model)


class CrashAfter:
    """Wraps an engine and raises once ``n`` samples were generated."""

    def __init__(self, engine, n):
        self.engine, self.n, self.config, self.max_seq_len = engine, n, engine.config, engine.max_seq_len

    def generate(self, prompts, gen):
        if self.n < len(prompts):
            raise KeyboardInterrupt("killed")
        self.n -= len(prompts)
        return self.engine.generate(prompts, gen)


def preds(out, task):
    return {r["_id"]: r for r in map(json.loads, (out / "pred" / f"{task}.jsonl").read_text().splitlines())}


def test_longbench_end_to_end_with_resume(setup, tmp_path):
    root, model, data, engine, tok = setup
    lb = root / "LongBench"
    # 1) one uninterrupted run, batches of 2
    full = run_longbench(engine, tok, data, lb, "hotpotqa,trec", tmp_path / "a", batch_size=2, max_input_tokens=200,
                         progress=False)
    assert full["tasks"]["hotpotqa"]["n"] == 3 and full["tasks"]["trec"]["n"] == 2
    a = {**preds(tmp_path / "a", "hotpotqa"), **preds(tmp_path / "a", "trec")}
    assert all(r["truncated"] for k, r in a.items() if k.startswith("h"))  # ~1400-byte prompts cut to 200 ids
    chat = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": ""}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False))
    assert all(r["prompt_tokens"] <= 200 + chat + 4 and 1 <= r["gen_tokens"] <= 8
               for k, r in a.items() if k.startswith("h"))
    assert all(not r["truncated"] and r["gen_tokens"] <= 6 for k, r in a.items() if k.startswith("t"))

    # 2) a run killed after 2 samples keeps them; the CLI resumes it one sample at a time
    out = tmp_path / "b"
    with pytest.raises(KeyboardInterrupt):
        run_longbench(CrashAfter(engine, 2), tok, data, lb, "hotpotqa,trec", out, max_input_tokens=200, progress=False,
                      meta={"model": str(model), "backend": "reference"})  # what the CLI records
    kept = (out / "pred" / "hotpotqa.jsonl").read_text()
    assert len(kept.splitlines()) == 2
    ap = argparse.ArgumentParser()
    register(ap.add_subparsers(dest="command"))
    args = ap.parse_args(["longbench", "--model", str(model), "--data", str(data), "--tasks", "hotpotqa,trec",
                          "--out", str(out), "--max-input-tokens", "200", "--max-seq-len", str(MAX_LEN),
                          "--device", "cpu", "--no-progress"])
    args.func(args)
    assert (out / "pred" / "hotpotqa.jsonl").read_text().startswith(kept)  # finished lines untouched
    b = {**preds(out, "hotpotqa"), **preds(out, "trec")}
    # every sample gets the same greedy prediction whether batched, alone, or after a resume
    assert {k: r["pred"] for k, r in b.items()} == {k: r["pred"] for k, r in a.items()}
    report = json.loads((out / "report.json").read_text())
    assert report["tasks"] == full["tasks"]
    assert "| hotpotqa | qa_f1 | 3 |" in (out / "report.md").read_text()


def test_cli_errors_are_one_line(setup, tmp_path, capsys):
    root, model, data, _, _ = setup
    from minimax_m3.cli import main

    rc = main(["longbench", "--model", str(model), "--data", str(data), "--tasks", "hotpot", "--out", str(tmp_path),
               "--max-seq-len", str(MAX_LEN), "--device", "cpu"])  # the package error, mapped once by the CLI
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "unknown LongBench task 'hotpot'" in err
