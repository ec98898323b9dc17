"""The lm-eval adapter: registered as ``minimax-m3``, stop strings cut, middle truncation, and a run of
lm-eval's own longbench_hotpotqa / longbench_trec definitions over local handmade JSONL files."""

import json
import os
from types import SimpleNamespace

import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer  # noqa: E402

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

from minimax_m3.checkpoint.toy_tokenizer import write_toy_tokenizer  # noqa: E402
from minimax_m3.engine import GenerationResult  # noqa: E402
from minimax_m3.eval.lm_eval_adapter import MiniMaxM3LM, cut_at_stop, middle_truncate  # noqa: E402

REPLIES = {"KEY1": " Paris, France\nmore", "KEY2": "Shakespeare", "KEY3": " City\nType: Country"}


class FakeEngine:
    """Replies REPLIES[key] for the key in the prompt; honours max_new_tokens and eos ids only (not the stop
    sequences), so the text cut in the adapter is what is tested."""

    def __init__(self, tok, max_seq_len=4096):
        self.tok, self.max_seq_len = tok, max_seq_len
        self.config = SimpleNamespace(eos_token_id=tok.eos_token_id)
        self.prompts, self.gens = [], []

    def generate(self, prompts, gen):
        out = []
        for p in prompts:
            self.prompts.append(list(p))
            self.gens.append(gen)
            text = self.tok.decode(p)
            key = next((k for k in REPLIES if k in text), None)
            ids = (self.tok.encode(REPLIES[key], add_special_tokens=False) if key else []) + [self.tok.eos_token_id]
            out.append(GenerationResult(ids[: gen.max_new_tokens], "eos"))
        return out


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    write_toy_tokenizer(d, 512)
    return AutoTokenizer.from_pretrained(d)


def test_helpers():
    assert cut_at_stop("City\nType: X", ["\n"]) == "City"
    assert cut_at_stop("a.b\nc", ["\n", "."]) == "a"  # earliest stop wins
    assert cut_at_stop("abc", []) == "abc" and cut_at_stop("abc", [""]) == "abc"
    assert middle_truncate(list(range(10)), 5) == [0, 1, 8, 9] and middle_truncate([1, 2], 5) == [1, 2]
    assert middle_truncate(list(range(10)), 1) == list(range(10))  # pred.py: half = 0 and ids[-0:] is all ids


def test_registered_and_generate_until(tok):
    assert get_model("minimax-m3") is MiniMaxM3LM
    eng = FakeEngine(tok, max_seq_len=40)
    lm = MiniMaxM3LM(engine=eng, tokenizer=tok)
    reqs = [
        Instance("generate_until", {},
                 ("x" * 50 + "KEY3" + "y" * 50, {"until": ["\n"], "max_gen_toks": 30, "do_sample": False}), 0),
        Instance("generate_until", {},
                 ("KEY2 question", {"until": [], "max_gen_toks": 4, "temperature": 1, "do_sample": False}), 0),
    ]
    out = lm.generate_until(reqs)
    # 1st: 104-byte context over budget 40 - 30 = 10 -> 5 + 5 ids kept; the key is cut away, so the engine
    # replies "" + EOS -> "". 2nd: "Shakespeare" cut by max_gen_toks 4 -> "Shak"
    assert out == ["", "Shak"]
    assert [len(p) for p in eng.prompts] == [10, 13] and tok.decode(eng.prompts[0]) == "xxxxxyyyyy"
    assert all(g.temperature == 0.0 and tok.eos_token_id in g.eos_token_ids for g in eng.gens)
    with pytest.raises(NotImplementedError, match="generate_until only"):
        lm.loglikelihood([])


def write_local_tasks(tmp_path):
    """Recipe A: include lm-eval's own task YAML, point it at local JSONL, map THUDM's `input` -> `question`."""
    tasks_dir = os.path.join(os.path.dirname(lm_eval.__file__), "tasks", "longbench")
    (tmp_path / "local_utils.py").write_text(
        "def add_question(ds):\n    return ds.map(lambda d: {'question': d['input']})\n"
    )
    data = {
        "hotpotqa": [{"input": "Where? KEY1", "context": "c1", "answers": ["Paris"], "all_classes": None, "length": 9,
                      "_id": "a"},
                     {"input": "Who? KEY2", "context": "c2", "answers": ["William Shakespeare"], "all_classes": None,
                      "length": 9, "_id": "b"}],
        "trec": [{"input": "What? KEY3\nType:", "context": "c3", "answers": ["City"],
                  "all_classes": ["City", "Country"], "length": 9, "_id": "c"}],
    }
    for task, rows in data.items():
        (tmp_path / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / f"local_{task}.yaml").write_text(
            f"include: {tasks_dir}/{task}.yaml\ntask: local_longbench_{task}\ntag: []\ndataset_path: json\n"
            f"dataset_name: null\ndataset_kwargs:\n  data_files:\n    test: {tmp_path}/{task}.jsonl\n"
            "process_docs: !function local_utils.add_question\n"
        )


def test_simple_evaluate_on_local_longbench_tasks(tok, tmp_path):
    write_local_tasks(tmp_path)
    eng = FakeEngine(tok)
    res = lm_eval.simple_evaluate(
        model=MiniMaxM3LM(engine=eng, tokenizer=tok), tasks=["local_longbench_hotpotqa", "local_longbench_trec"],
        task_manager=TaskManager(include_path=str(tmp_path)), bootstrap_iters=0, log_samples=False,
    )
    r = res["results"]
    # hotpotqa (until []): "Paris, France\nmore" (stripped) vs Paris -> P = 1/3, R = 1 -> 0.5;
    # "Shakespeare" vs "William Shakespeare" -> P = 1, R = 1/2 -> 2/3; mean 7/12 = 0.58333
    assert r["local_longbench_hotpotqa"]["score,none"] == pytest.approx(7 / 12)
    # trec (until ["\n"]): the adapter cuts " City\nType: Country" to " City" -> 1.0 (uncut it would be 0.5)
    assert r["local_longbench_trec"]["score,none"] == 1.0
    assert {g.max_new_tokens for g in eng.gens} == {32, 64}  # each task's own max_gen_toks
