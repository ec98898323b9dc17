"""``minimax-m3 needle``: prompt lengths and needle depths in tokens, the scorer, the PNG, a fake engine that finds the
needle (so "found" can be scored), resume, refusals, and an end-to-end run on the tiny synthetic checkpoint."""

import json
import re
import struct
import zlib
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from minimax_m3.checkpoint.toy_tokenizer import write_toy_tokenizer
from minimax_m3.cli import main
from minimax_m3.engine import GenerationResult
from minimax_m3.eval import needle as N

NEEDLE_RE = re.compile(r" The special magic number hidden in this text is (\d{7})\.")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    d = tmp_path_factory.mktemp("toy-tok")
    write_toy_tokenizer(d, 512)
    return AutoTokenizer.from_pretrained(d)


@pytest.fixture(scope="module")
def bpe():
    """A byte-level BPE with merges (several bytes a token, GPT-2's pre-tokenizer regex) and no chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = N.filler_sentences(0) + [N.INSTRUCTION, N.QUESTION, N.NEEDLE.format(secret="1234567")]
    tok.train_from_iterator(text, trainer)
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[bos])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def _check_prompt(tok, b, length, depth):
    p = b.build(length, depth)
    assert len(p.ids) == length  # exact, by construction from token pieces
    text = tok.decode(p.ids)
    assert re.findall(r"\d+", text) == [p.secret]  # the filler has no digits: the needle is the only number
    assert NEEDLE_RE.fullmatch(tok.decode(p.ids[p.needle_start : p.needle_start + p.needle_tokens]))
    before = tok.decode(p.ids[: p.needle_start])
    after = tok.decode(p.ids[p.needle_start + p.needle_tokens :])
    if not before.endswith("Text: ..."):  # else at the haystack's start; otherwise between two sentences:
        assert before.endswith(".") and re.match(r" [A-Z]|\n\nWhat is", after), (before[-30:], after[:30])
    return p, before, after


@pytest.mark.parametrize("depth", [0, 10, 25, 50, 75, 90, 100])
@pytest.mark.parametrize("length", [420, 1000, 3000])
def test_toy_prompt_is_exact_and_the_needle_at_its_depth(toy, length, depth):
    """Toy tokenizer: one token per byte, so the haystack in tokens is measured on the decoded text in characters."""
    b = N.NeedleBuilder(toy, seed=0)
    p, before, after = _check_prompt(toy, b, length, depth)
    assert toy.encode(toy.decode(p.ids), add_special_tokens=False) == p.ids  # the pieces are the text's own ids
    text = toy.decode(p.ids)
    start = text.index("Text: ...") + len("Text: ...")
    end = text.index("\n\nWhat is the special")
    m = NEEDLE_RE.search(text)
    hay = (end - start) - len(m.group(0))  # filler tokens
    assert hay == p.haystack_tokens and text.startswith("<s><|user|>A special magic number")
    longest = max(len(" " + s) for s in N.filler_sentences(0))  # tokens == bytes (ASCII)
    tolerance = -(-longest // 2)
    assert abs((m.start() - start) - depth / 100 * hay) <= tolerance + 0.5, (m.start() - start, hay)
    assert text.endswith("Answer with the number only.<|end|><|assistant|>")  # the chat template's generation turn


@pytest.mark.parametrize("depth", [0, 33, 50, 100])
@pytest.mark.parametrize("length", [300, 2048, 20000])
def test_bpe_prompt_is_exact_and_the_needle_at_its_depth(bpe, length, depth):
    """A tokenizer with merges and no chat template: the plain prompt (BOS, instruction, haystack, question)."""
    b = N.NeedleBuilder(bpe, seed=3)
    assert not b.chat and b.tolerance < 20  # sentences are a few tokens here, so the depth is finer
    p, before, after = _check_prompt(bpe, b, length, depth)
    assert before.startswith("<s>A special magic number") and after.endswith("number only.\nAnswer:")
    hay = length - p.haystack_start - p.needle_tokens - len(bpe.encode(N.QUESTION + N.PLAIN_ANSWER,
                                                                      add_special_tokens=False))
    assert hay == p.haystack_tokens
    assert abs((p.needle_start - p.haystack_start) - depth / 100 * hay) <= b.tolerance + 0.5
    # re-encoding the decoded text: the same ids except where the cut sentence opens the haystack
    assert abs(len(bpe.encode(bpe.decode(p.ids), add_special_tokens=False)) - length) <= 3


def test_same_haystack_for_every_depth_and_too_short_refused(toy):
    b = N.NeedleBuilder(toy, seed=0)
    a, c = b.build(800, 0), b.build(800, 100)
    strip = lambda p: p.ids[: p.needle_start] + p.ids[p.needle_start + p.needle_tokens :]  # noqa: E731
    assert strip(a) == strip(c) and a.secret != c.secret
    with pytest.raises(N.NeedleError, match=f"use lengths >= {b.min_length()}"):
        b.build(b.min_length() - 1, 50)


@pytest.mark.parametrize("out,secret,found", [
    ("4729163", "4729163", True), ("The number is 4,729,163.", "4729163", True), ("4729 163", "4729163", True),
    ("It is 4729163. Yes", "4729163", True), ("x4729163y", "4729163", True), ("47291630", "4729163", False),
    ("472916", "4729163", False), ("4729164", "4729163", False), ("", "4729163", False),
    ("47.29163", "4729163", False), ("1 4729163 2", "4729163", False),
])  # fmt: skip
def test_scorer_on_hand_made_outputs(out, secret, found):
    assert N.score(out, secret) is found


def test_lengths_and_depths_parsing_and_refusals():
    assert N.parse_lengths("4096, 1K,128k,1M,1024") == [1024, 4096, 131072, 1048576]
    assert N.parse_depths("100,0,12.5") == [0.0, 12.5, 100.0]
    for bad, opt in (("0", "lengths"), ("4x", "lengths"), ("", "lengths")):
        with pytest.raises(N.NeedleError, match=f"--{opt}"):
            N.parse_lengths(bad)
    for bad in ("101", "-1", "x"):
        with pytest.raises(N.NeedleError, match="--depths"):
            N.parse_depths(bad)
    with pytest.raises(N.NeedleError, match="max_seq_len 4096, max_context_len 2048") as e:
        N.check_lengths([1024, 2048, 4096], max_seq_len=4096, max_context_len=2048, max_new_tokens=32, who="x")
    assert len(e.value.problems) == 1 and "at most 2048 tokens" in str(e.value)


def _png_pixels(data: bytes):
    """Parse an 8-bit RGB PNG (filter 0 rows) back: (width, height, rows of (r, g, b)); every CRC checked."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        tag, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n : pos + 12 + n])[0] == zlib.crc32(tag + body)
        chunks.append((tag, body))
        pos += 12 + n
    assert [t for t, _ in chunks][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    w, h, depth, ctype, _, _, _ = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, ctype) == (8, 2)
    raw = zlib.decompress(b"".join(b for t, b in chunks if t == b"IDAT"))
    assert len(raw) == h * (1 + 3 * w)
    rows = []
    for y in range(h):
        line = raw[y * (1 + 3 * w) : (y + 1) * (1 + 3 * w)]
        assert line[0] == 0
        rows.append([tuple(line[1 + 3 * x : 4 + 3 * x]) for x in range(w)])
    return w, h, rows


def test_png_heatmap_parses_back_with_the_cells_colours():
    lengths, depths = [1024, 131072, 1048576], [0, 50, 100]
    cells = [{"length": 1024, "depth": 0, "found": True}, {"length": 131072, "depth": 0, "found": False},
             {"length": 1048576, "depth": 50, "found": True}, {"length": 1024, "depth": 100, "found": False},
             {"length": 7, "depth": 0, "found": True}]  # a cell outside the grid is not drawn
    w, h, rows = _png_pixels(N.heatmap_png(cells, lengths, depths))
    L = N.heatmap_layout(lengths, depths)
    assert (w, h) == (L["x0"] + 3 * L["cw"], L["y0"] + 3 * L["ch"])
    want = {(0, 0): N.GREEN, (0, 1): N.RED, (1, 2): N.GREEN, (2, 0): N.RED}
    for r in range(3):
        for c in range(3):
            x, y = L["x0"] + c * L["cw"] + L["cw"] // 2, L["y0"] + r * L["ch"] + L["ch"] // 2
            assert rows[y][x] == want.get((r, c), N.GREY), (r, c)
    area = (L["cw"] - N.GAP) * (L["ch"] - N.GAP)
    count = lambda color: sum(px == color for row in rows for px in row)  # noqa: E731
    assert (count(N.GREEN), count(N.RED), count(N.GREY)) == (2 * area, 2 * area, 5 * area)
    assert count(N.INK) > 0  # the labels


class NeedleFinder:
    """Answers "The number is <secret>." when it reads the needle in the prompt's first ``sees`` fraction, else a
    wrong number; counts the prompts it was given."""

    def __init__(self, tok, sees=1.0, max_seq_len=4096):
        self.tok, self.sees, self.max_seq_len, self.prompts, self.gens = tok, sees, max_seq_len, [], []
        self.config = SimpleNamespace(eos_token_id=tok.eos_token_id)

    def generate(self, prompts, gen):
        out = []
        for ids in prompts:
            self.prompts.append(ids)
            self.gens.append(gen)
            m = NEEDLE_RE.search(self.tok.decode(ids[: int(len(ids) * self.sees)]))
            reply = self.tok.encode(f"The number is {m.group(1) if m else '1000000'}.", add_special_tokens=False)
            reply = (reply + [self.tok.eos_token_id])[: gen.max_new_tokens]
            out.append(GenerationResult(reply, "eos", len(ids)))
        return out


def test_a_model_that_reads_the_needle_is_scored_found(toy, tmp_path):
    eng = NeedleFinder(toy, sees=0.6)  # reads only the first 60% of each prompt
    res = N.run_needle(eng, toy, [600, 900], [0, 50, 100], tmp_path, max_new_tokens=24, batch_size=4,
                       meta={"model": "fake"}, log=lambda m: None)
    found = {(c["length"], c["depth"]): c["found"] for c in res["cells"]}
    assert found == {(600, 0): True, (600, 50): True, (600, 100): False,
                     (900, 0): True, (900, 50): True, (900, 100): False}
    assert [len(p) for p in eng.prompts] == [600, 600, 600, 900, 900, 900]
    assert all(g.greedy and g.max_new_tokens == 24 and toy.eos_token_id in g.eos_token_ids for g in eng.gens)
    table = N.render_table(res["cells"], [600, 900], [0, 50, 100]).splitlines()
    assert table[1].split() == ["0%", "found", "found"] and table[3].split() == ["100%", "miss", "miss"]
    assert table[-1].startswith("found 4 of 6")
    saved = json.loads((tmp_path / N.RESULTS).read_text())
    assert saved == res and saved["settings"]["model"] == "fake"
    _png_pixels((tmp_path / N.PICTURE).read_bytes())


def test_resume_skips_done_cells_and_refuses_other_settings(toy, tmp_path):
    first = NeedleFinder(toy)
    N.run_needle(first, toy, [600], [0, 50], tmp_path, log=lambda m: None)
    again = NeedleFinder(toy)
    res = N.run_needle(again, toy, [600], [0, 50, 100], tmp_path, log=lambda m: None)
    assert len(first.prompts) == 2 and len(again.prompts) == 1  # only the new cell ran
    assert NEEDLE_RE.search(toy.decode(again.prompts[0])).group(1) == N.secret_for(0, 600, 100)
    assert sorted(c["depth"] for c in res["cells"]) == [0, 50, 100] and all(c["found"] for c in res["cells"])
    with pytest.raises(N.NeedleError, match="seed: was 0, now 1"):
        N.run_needle(NeedleFinder(toy), toy, [600], [0], tmp_path, seed=1, log=lambda m: None)
    with pytest.raises(N.NeedleError, match="length 4000 does not fit the engine: max_seq_len 4000"):
        N.run_needle(NeedleFinder(toy, max_seq_len=4000), toy, [4000], [0], tmp_path / "x", log=lambda m: None)


def _fails(capsys, argv, *messages):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for m in messages:
        assert m in err, err


def test_cli_refusals_name_the_limit_before_loading(tiny_ckpt, tmp_path, capsys):
    base = ["needle", "--model", str(tiny_ckpt), "--device", "cpu", "--out", str(tmp_path / "o")]
    _fails(capsys, base + ["--lengths", "2048,8K", "--max-seq-len", "4096"],
           "minimax-m3 needle: error: needle: 1 length(s) refused", "length 8192 does not fit the reference engine: "
           "max_seq_len 4096, max_context_len 4096, 32 new tokens -> prompts of at most 4064 tokens")
    _fails(capsys, base + ["--lengths", "1024", "--depths", "0,150"], "--depths: 150 is outside 0..100")
    _fails(capsys, base + ["--lengths", "64"], "length 64 is too short")
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit) as e:  # argparse's usage error, as for every command: exit 2, one line
        main(base + ["--lengths", "1024", "--needle-colour", "blue"])
    assert e.value.code == 2 and "unrecognized arguments: --needle-colour" in capsys.readouterr().err


def test_end_to_end_on_the_tiny_checkpoint(tiny_ckpt, tmp_path, capsys):
    """Reference backend, random weights: the mechanics (exact lengths, table, JSON, PNG); 4 new byte tokens cannot
    hold a 7-digit number, so nothing is found, and the command says why."""
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    lo = N.NeedleBuilder(tok).min_length()
    lengths = [lo, lo + 64]
    out = tmp_path / "run"
    argv = ["needle", "--model", str(tiny_ckpt), "--device", "cpu", "--lengths", f"{lengths[0]},{lengths[1]}",
            "--depths", "0,100", "--out", str(out), "--max-new-tokens", "4", "--batch-size", "4"]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    table = stdout.splitlines()
    assert table[0].split()[-2:] == [str(n) for n in lengths]
    assert table[1].split() == ["0%", "miss", "miss"] and table[2].split() == ["100%", "miss", "miss"]
    assert "found 0 of 4" in stdout and "random weights" in stdout
    res = json.loads((out / N.RESULTS).read_text())
    assert sorted((c["length"], c["prompt_tokens"], c["depth"]) for c in res["cells"]) == [
        (lengths[0], lengths[0], 0), (lengths[0], lengths[0], 100), (lengths[1], lengths[1], 0),
        (lengths[1], lengths[1], 100)]
    assert all(c["gen_tokens"] == 4 and not c["found"] for c in res["cells"])
    assert res["settings"]["backend"] == "reference" and res["settings"]["chat_template"] is True
    w, h, rows = _png_pixels((out / N.PICTURE).read_bytes())
    L = N.heatmap_layout(lengths, [0, 100])
    assert (w, h) == (L["width"], L["height"])
    assert rows[L["y0"] + L["ch"] // 2][L["x0"] + L["cw"] // 2] == N.RED
    assert main(argv) == 0  # resumed: every cell skipped, nothing generated
    err = capsys.readouterr().err
    assert "needle: 4 cell(s) already in" in err and "not found (" not in err


def test_through_a_server_engine(toy, tmp_path):
    """``--server``: the same run through eval/server.py's ServerEngine (a fake OpenAI client that answers the
    needle's number from the prompt ids it is sent); the server's max_model_len is the limit."""
    from minimax_m3.eval.server import ServerEngine

    sent = []

    def create(**kw):
        sent.append(kw)
        m = NEEDLE_RE.search(toy.decode(kw["prompt"]))
        ids = toy.encode(f"It is {m.group(1)}.", add_special_tokens=False) + [toy.eos_token_id]
        return SimpleNamespace(choices=[SimpleNamespace(finish_reason="stop", model_extra={"token_ids": ids})])

    card = SimpleNamespace(id="m3", model_extra={"max_model_len": 700})
    client = SimpleNamespace(models=SimpleNamespace(list=lambda: [card]), completions=SimpleNamespace(create=create))
    eng = ServerEngine("http://x/v1", client=client, eos_token_id=toy.eos_token_id)
    res = N.run_needle(eng, toy, [600], [0, 100], tmp_path, batch_size=2, log=lambda m: None)
    assert [c["found"] for c in res["cells"]] == [True, True] and [len(k["prompt"]) for k in sent] == [600, 600]
    assert all(k["temperature"] == 0.0 and k["max_tokens"] == 32 for k in sent)
    with pytest.raises(N.NeedleError, match="max_seq_len 700, 32 new tokens -> prompts of at most 668"):
        N.run_needle(eng, toy, [669], [0], tmp_path / "y", log=lambda m: None)


def test_cli_server_takes_no_backend(tiny_ckpt, tmp_path, capsys):
    _fails(capsys, ["needle", "--model", str(tiny_ckpt), "--server", "http://127.0.0.1:9/v1", "--backend", "neuron",
                    "--lengths", "1024", "--out", str(tmp_path / "o")], "--server generates on the server")
