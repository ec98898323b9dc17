"""Offline data loading and its error messages."""

import json

import pytest

from minimax_m3.eval import data as D


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def row(i, **kw):
    return {"input": f"q{i}", "context": "c", "answers": ["a"], "length": 10, "all_classes": None, "_id": f"id{i}",
            **kw}


def test_load_v1_task_and_nested_layout(tmp_path):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "hotpotqa.jsonl", [row(0), row(1)])
    assert [r["_id"] for r in D.load_v1_task(tmp_path / "data", "hotpotqa")] == ["id0", "id1"]
    assert len(D.load_v1_task(tmp_path, "hotpotqa")) == 2  # the folder above data/ works too


def test_malformed_line_names_file_and_line(tmp_path):
    p = tmp_path / "trec.jsonl"
    p.write_text(json.dumps(row(0)) + "\n\n" + '{"input": "broken"\n', encoding="utf-8")
    with pytest.raises(D.LongBenchDataError, match=r"trec\.jsonl:3: not valid JSON"):
        D.load_v1_task(tmp_path, "trec")
    write_jsonl(p, [row(0), {"input": "x"}])
    with pytest.raises(D.LongBenchDataError, match=r"trec\.jsonl:2: record lacks field\(s\) context, answers"):
        D.load_v1_task(tmp_path, "trec")
    write_jsonl(p, [row(0), row(0)])
    with pytest.raises(D.LongBenchDataError, match="duplicate _id 'id0'"):
        D.load_v1_task(tmp_path, "trec")
    write_jsonl(p, [row(0, answers="a")])
    with pytest.raises(D.LongBenchDataError, match="answers must be a list"):
        D.load_v1_task(tmp_path, "trec")


def test_wrong_layout_errors(tmp_path):
    with pytest.raises(D.LongBenchDataError, match="does not exist"):
        D.load_v1_task(tmp_path / "nope", "trec")
    write_jsonl(tmp_path / "qasper.jsonl", [row(0)])
    with pytest.raises(D.LongBenchDataError, match=r"no trec\.jsonl in .*it holds qasper.*data\.zip unzipped"):
        D.load_v1_task(tmp_path, "trec")
    with pytest.raises(D.LongBenchDataError, match="no data.json"):
        D.load_v2(tmp_path)


def test_longbench_config(tmp_path):
    with pytest.raises(D.LongBenchDataError, match="no config/dataset2prompt.json.*--longbench-dir"):
        D.load_v1_config(tmp_path)
    cfg = tmp_path / "LongBench" / "config"
    cfg.mkdir(parents=True)
    (cfg / "dataset2prompt.json").write_text(json.dumps({"trec": "{context}\n{input}"}))
    with pytest.raises(D.LongBenchDataError, match="missing .*dataset2maxlen.json"):
        D.load_v1_config(tmp_path)
    (cfg / "dataset2maxlen.json").write_text(json.dumps({"trec": 64}))
    prompts, maxlens = D.load_v1_config(tmp_path)  # repo root: config found under LongBench/
    assert D.task_protocol("trec_e", prompts, maxlens) == ("{context}\n{input}", 64)
    with pytest.raises(D.LongBenchDataError, match="no entry for 'lcc'"):
        D.task_protocol("lcc", prompts, maxlens)
    with pytest.raises(D.LongBenchDataError, match=r"no prompts/0shot\.txt"):
        D.load_v2_template(tmp_path / "LongBench")
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "0shot.txt").write_text("$DOC$ $Q$")
    assert D.load_v2_template(tmp_path / "LongBench") == "$DOC$ $Q$"  # found next to LongBench/


def test_load_v2(tmp_path):
    item = {"_id": "v0", "difficulty": "easy", "length": "short", "question": "q", "answer": "A", "context": "c",
            **{f"choice_{k}": k for k in "ABCD"}}
    (tmp_path / "data.json").write_text(json.dumps([item]))
    assert D.load_v2(tmp_path)[0]["_id"] == "v0"
    (tmp_path / "data.json").write_text(json.dumps([{"_id": "v0"}]))
    with pytest.raises(D.LongBenchDataError, match="item 0 lacks field"):
        D.load_v2(tmp_path)
    (tmp_path / "data.json").write_text("[{")
    with pytest.raises(D.LongBenchDataError, match=r"data\.json:1: not valid JSON"):
        D.load_v2(tmp_path)
