"""Needle in a haystack (``minimax-m3 needle``): can the model find one sentence anywhere in a long prompt?

A cell is (length, depth). Its prompt is exactly ``length`` tokens of the model's tokenizer: an instruction, a
haystack of filler sentences, the needle "The special magic number hidden in this text is NNNNNNN." inserted at
``depth`` percent of the haystack's tokens (at the sentence boundary nearest to it), and a question asking for the
number, in the model's chat template when the tokenizer has one (one user turn, as LongBench's ``chat_wrap``).

The prompt is assembled from token ids, piece by piece: the template's head and tail, each filler sentence (encoded
once with its leading space, so pieces join where a byte-level BPE splits words anyway), the needle. So the length is
exact and the needle's token position known. To make the length exact the haystack starts with the tail of a
sentence (an excerpt starting mid-sentence, as in the original test, which cut its haystack in token space); every
other boundary is a sentence boundary, so the needle's start is within half the longest filler sentence of
``depth``% of the haystack (:attr:`NeedleBuilder.tolerance` tokens).

The filler is built in: sentences drawn from fixed word lists by a seeded RNG (no digits, no download); the secret is
a 7-digit number from an RNG seeded by (seed, length, depth). Decoding is greedy. A cell is found when a run of
digits in the decoded output (commas, spaces, apostrophes or underscores between digits ignored) equals the secret.

Results go to ``<out>/needle.json`` after every batch (atomically); cells already there are skipped on a rerun with
the same settings. ``<out>/needle.png`` is the picture: columns = lengths, rows = depths, green found, red not found,
grey not run; written with zlib + struct (no plotting package). Random weights (the synthetic tiny / small
checkpoints) find nothing: there the command tests the mechanics only.
"""

from __future__ import annotations

import json
import random
import re
import struct
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from .._atomic import write_atomic
from ..engine.loop import GenerationConfig
from ..errors import M3Error
from .protocol import chat_wrap

NEEDLE = "The special magic number hidden in this text is {secret}."
INSTRUCTION = "A special magic number is hidden in the text below. Find it.\n\nText: ..."  # an excerpt: see above
QUESTION = "\n\nWhat is the special magic number hidden in the text? Answer with the number only."
PLAIN_ANSWER = "\nAnswer:"  # ends the prompt of a tokenizer without a chat template
_SENTINEL = "@@HAYSTACK@@"
POOL_SIZE = 256
RESULTS, PICTURE = "needle.json", "needle.png"

_SUBJECTS = ("The old lighthouse keeper", "A quiet fisherman", "The village baker", "A young painter",
             "The night gardener", "An elderly librarian", "The travelling musician", "A curious student",
             "The harbour master", "A patient teacher", "The mountain guide", "A careful carpenter",
             "The market vendor", "A wandering poet", "The station clerk", "A tired shepherd")
_VERBS = ("carried", "repaired", "painted", "described", "remembered", "noticed", "collected", "cleaned",
          "borrowed", "measured", "admired", "planted")
_OBJECTS = ("a basket of green apples", "the wooden gate near the river", "a map of the northern hills",
            "the blue door of the chapel", "a bundle of dry firewood", "the lantern by the window",
            "a letter from a distant cousin", "the stone wall of the orchard", "a kettle of mint tea",
            "the sails of a small boat", "a box of old photographs", "the path along the cliffs")
_TAILS = ("before the first snow fell", "while the bells rang in the square", "on a windy afternoon",
          "as the tide came in", "under a sky full of clouds", "after the evening market closed",
          "during the long summer holidays", "while the children were asleep", "in the soft light of dawn",
          "when the rain finally stopped")
_ASIDES = ("and nobody said a word about it", "and the dog watched from the doorstep",
           "but the neighbours hardly noticed", "and the smell of bread filled the street")


class NeedleError(M3Error, ValueError):
    """A needle run that cannot start or go on (lengths, depths, settings of an earlier run)."""


def parse_lengths(text: str) -> list[int]:
    """``"1024,4K,128k,1M"`` -> token counts (K = 1024, M = 1048576), sorted, duplicates dropped."""
    out = set()
    for item in (s.strip() for s in str(text).split(",")):
        m = re.fullmatch(r"(\d+)([kKmM]?)", item)
        if not m or int(m.group(1)) < 1:
            raise NeedleError(f"--lengths: {item!r} is not a positive token count (e.g. 4096, 128K or 1M)")
        out.add(int(m.group(1)) * {"": 1, "k": 1024, "m": 1 << 20}[m.group(2).lower()])
    return sorted(out)


def parse_depths(text: str) -> list[float]:
    """``"0,25,50,75,100"`` -> percentages of the haystack, each within 0..100."""
    out = set()
    for item in (s.strip() for s in str(text).split(",")):
        try:
            d = float(item)
        except ValueError:
            raise NeedleError(f"--depths: {item!r} is not a number (percent, 0..100)") from None
        if not 0.0 <= d <= 100.0:
            raise NeedleError(f"--depths: {item} is outside 0..100 (percent of the haystack)")
        out.add(d)
    return sorted(out)


def filler_sentences(seed: int, n: int = POOL_SIZE) -> list[str]:
    """``n`` distinct filler sentences (no digits), the same for the same seed."""
    rng, out = random.Random(f"needle-filler:{seed}"), {}
    while len(out) < n:
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}"
        if rng.random() < 0.3:
            s += f", {rng.choice(_ASIDES)}"
        out[s + "."] = None
    return list(out)


def secret_for(seed: int, length: int, depth: float) -> str:
    return str(random.Random(f"needle-secret:{seed}:{length}:{depth:g}").randint(1_000_000, 9_999_999))


_BETWEEN_DIGITS = re.compile(r"(?<=\d)[,\s'_](?=\d)")


def score(output: str, secret: str) -> bool:
    """Found: a run of digits of ``output`` (separators between digits removed) equals ``secret``."""
    return secret in re.findall(r"\d+", _BETWEEN_DIGITS.sub("", output))


@dataclass
class NeedlePrompt:
    ids: list[int]
    secret: str
    needle_start: int  # index in ids of the needle's first token
    needle_tokens: int
    haystack_start: int  # index in ids of the haystack's first token
    haystack_tokens: int  # filler tokens (the needle not counted)
    offset: int  # filler tokens before the needle
    target: int  # round(depth / 100 * haystack_tokens): where the depth asks for it


class NeedleBuilder:
    """Needle prompts in ``tokenizer``'s ids; ``chat``: wrap in its chat template (default: when it has one)."""

    def __init__(self, tokenizer, seed: int = 0, chat: bool | None = None):
        self.tokenizer, self.seed = tokenizer, seed
        self.chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
        if self.chat:
            head, sep, tail = chat_wrap(tokenizer, INSTRUCTION + _SENTINEL + QUESTION).partition(_SENTINEL)
            if not sep:
                raise NeedleError("the tokenizer's chat template dropped the user text; run with a plain tokenizer")
            self.head, self.tail = self._enc(head), self._enc(tail)
        else:
            bos = getattr(tokenizer, "bos_token_id", None)
            adds_bos = bos is not None and tokenizer.encode("a", add_special_tokens=True)[:1] == [bos]
            self.head = [bos] * adds_bos + self._enc(INSTRUCTION)
            self.tail = self._enc(QUESTION + PLAIN_ANSWER)
        self.pool = [self._enc(" " + s) for s in filler_sentences(seed)]
        self.tolerance = -(-max(len(s) for s in self.pool) // 2)

    def _enc(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def needle(self, secret: str) -> list[int]:
        return self._enc(" " + NEEDLE.format(secret=secret))

    def min_length(self) -> int:
        """The shortest prompt with room for the longest filler sentence beside the template and the needle."""
        return len(self.head) + len(self.tail) + len(self.needle("9" * 7)) + 2 * self.tolerance

    def build(self, length: int, depth: float) -> NeedlePrompt:
        secret = secret_for(self.seed, length, depth)
        needle = self.needle(secret)
        budget = length - len(self.head) - len(self.tail) - len(needle)
        if length < self.min_length() or budget < 1:
            raise NeedleError(f"length {length} is too short: the template and the needle take "
                              f"{length - budget} tokens; use lengths >= {self.min_length()}")
        rng, pieces, total = random.Random(f"needle-haystack:{self.seed}:{length}"), [], 0
        while total < budget:  # the same haystack for every depth of a length
            pieces.append(self.pool[rng.randrange(len(self.pool))])
            total += len(pieces[-1])
        if total > budget:  # the last sentence's tail opens the haystack, making the length exact
            pieces.insert(0, pieces.pop()[total - budget:])
        starts = [0]
        for p in pieces:
            starts.append(starts[-1] + len(p))
        target = round(depth / 100 * budget)
        k = min(range(len(starts)), key=lambda i: (abs(starts[i] - target), i))
        hay = [t for p in pieces for t in p]
        at = starts[k]
        ids = self.head + hay[:at] + needle + hay[at:] + self.tail
        return NeedlePrompt(ids, secret, len(self.head) + at, len(needle), len(self.head), budget, at, target)


def check_lengths(lengths: Sequence[int], *, max_seq_len: int, max_context_len: int | None, max_new_tokens: int,
                  who: str, min_length: int | None = None) -> None:
    """Every length must fit ``who`` (the engine) with ``max_new_tokens`` to generate; and the template."""
    room = max_seq_len - max_new_tokens
    if max_context_len:
        room = min(room, max_context_len)
    problems = [f"length {n} does not fit {who}: max_seq_len {max_seq_len}"
                + (f", max_context_len {max_context_len}" if max_context_len else "")
                + f", {max_new_tokens} new tokens -> prompts of at most {room} tokens" for n in lengths if n > room]
    if min_length is not None:
        problems += [f"length {n} is too short for the template, needle and one filler sentence: use lengths >= "
                     f"{min_length}" for n in lengths if n < min_length]
    if problems:
        raise NeedleError(problems, heading=f"needle: {len(problems)} length(s) refused:")


def engine_limits(engine) -> tuple[int, int | None]:
    """(max_seq_len, max_context_len or None) of a loaded engine or a ServerEngine."""
    provider = getattr(engine, "provider", engine)
    return int(engine.max_seq_len), getattr(provider, "max_context_len", None)


def _key(length: int, depth: float) -> str:
    return f"{length}@{depth:g}"


def _load_results(path: Path, settings: dict) -> dict:
    if not path.exists():
        return {"settings": settings, "cells": []}
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        cells, before = old["cells"], old["settings"]
    except (ValueError, KeyError, TypeError) as exc:
        raise NeedleError(f"{path} is not a needle result file ({exc}); use a new --out") from None
    diff = [f"{k}: was {before.get(k)!r}, now {v!r}" for k, v in settings.items() if before.get(k) != v]
    if diff:
        raise NeedleError(diff + ["resume with the same settings or use a new --out"],
                          heading=f"{path} holds a run with other settings:")
    return {"settings": settings, "cells": cells}


def run_needle(engine, tokenizer, lengths: Sequence[int], depths: Sequence[float], out_dir, *, seed: int = 0,
               max_new_tokens: int = 32, batch_size: int = 1, meta: dict | None = None,
               log: Callable[[str], None] | None = None) -> dict:
    """Run every (length, depth) cell not yet in ``<out_dir>/needle.json``; write the JSON after each batch and
    the picture at the end; return the results ``{"settings", "cells"}``."""
    if batch_size < 1 or max_new_tokens < 1:
        raise NeedleError(f"--batch-size and --max-new-tokens must be >= 1, got {batch_size} and {max_new_tokens}")
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    builder = NeedleBuilder(tokenizer, seed)
    seq, ctx = engine_limits(engine)
    check_lengths(lengths, max_seq_len=seq, max_context_len=ctx, max_new_tokens=max_new_tokens,
                  who="the engine", min_length=builder.min_length())
    out = Path(out_dir)
    settings = {"seed": seed, "max_new_tokens": max_new_tokens, "chat_template": builder.chat,
                "needle": NEEDLE, "question": QUESTION, **(meta or {})}
    results = _load_results(out / RESULTS, settings)
    done = {_key(c["length"], c["depth"]) for c in results["cells"]}
    todo = [(n, d) for n in lengths for d in depths if _key(n, d) not in done]
    eos = tuple(dict.fromkeys(int(i) for i in (tokenizer.eos_token_id, getattr(engine.config, "eos_token_id", None))
                              if i is not None))
    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, eos_token_ids=eos)
    if len(todo) < len(lengths) * len(depths):
        log(f"needle: {len(lengths) * len(depths) - len(todo)} cell(s) already in {out / RESULTS}: skipped")
    for i in range(0, len(todo), batch_size):
        batch = todo[i : i + batch_size]
        prompts = [builder.build(n, d) for n, d in batch]
        t0 = time.monotonic()
        outs = engine.generate([p.ids for p in prompts], gen)
        dt = time.monotonic() - t0
        for (n, d), p, res in zip(batch, prompts, outs):
            text = tokenizer.decode(res.tokens, skip_special_tokens=True)
            cell = {"length": n, "depth": d, "found": score(text, p.secret), "secret": p.secret, "output": text,
                    "prompt_tokens": len(p.ids), "needle_token": p.needle_start,
                    "depth_actual": round(100 * p.offset / p.haystack_tokens, 2), "gen_tokens": len(res.tokens),
                    "finish_reason": res.finish_reason, "seconds": round(dt / len(batch), 3)}
            results["cells"].append(cell)
            log(f"needle: {n} tokens, depth {d:g}%: {'found' if cell['found'] else 'not found'} "
                f"({dt / len(batch):.2f} s) {text[:60]!r}")
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / RESULTS, json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    write_atomic(out / PICTURE, heatmap_png(results["cells"], lengths, depths))
    return results


def _grid(cells: Sequence[dict], lengths: Sequence[int], depths: Sequence[float]) -> list[list[bool | None]]:
    found = {_key(c["length"], c["depth"]): bool(c["found"]) for c in cells}
    return [[found.get(_key(n, d)) for n in lengths] for d in depths]


def length_label(n: int) -> str:
    if n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n % 1024 == 0 else str(n)


def render_table(cells: Sequence[dict], lengths: Sequence[int], depths: Sequence[float]) -> str:
    """Rows = depth (percent), columns = length (tokens): ``found``, ``miss`` or ``.`` (not run)."""
    grid = _grid(cells, lengths, depths)
    heads = [length_label(n) for n in lengths]
    w = max(5, *(len(h) for h in heads))
    lines = ["depth \\ length " + " ".join(h.rjust(w) for h in heads)]
    for d, row in zip(depths, grid):
        marks = ["." if f is None else "found" if f else "miss" for f in row]
        lines.append(f"{d:>13g}% " + " ".join(m.rjust(w) for m in marks))
    flat = [f for row in grid for f in row if f is not None]
    lines.append(f"found {sum(flat)} of {len(flat)} cell(s) run ({len(lengths) * len(depths)} asked)")
    return "\n".join(lines)


# ---- the picture: an RGB PNG written with zlib + struct --------------------------------------------------------------
GREEN, RED, GREY, WHITE, INK = (46, 160, 67), (207, 34, 46), (200, 200, 200), (255, 255, 255), (0, 0, 0)
_FONT = {  # 3x5 glyphs, one row of 3 bits per entry
    "0": (7, 5, 5, 5, 7), "1": (2, 6, 2, 2, 7), "2": (7, 1, 7, 4, 7), "3": (7, 1, 7, 1, 7), "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7), "6": (7, 4, 7, 5, 7), "7": (7, 1, 1, 1, 1), "8": (7, 5, 7, 5, 7), "9": (7, 5, 7, 1, 7),
    "K": (5, 5, 6, 5, 5), "M": (5, 7, 7, 5, 5), "%": (5, 1, 2, 4, 5), ".": (0, 0, 0, 0, 2),
}
SCALE, GAP = 2, 2  # glyph pixel size; white gap between cells


def png_bytes(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """An 8-bit RGB PNG of ``rgb`` (row-major, 3 bytes a pixel), every row with filter 0."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    stride = 3 * width
    raw = b"".join(b"\x00" + bytes(rgb[y * stride : (y + 1) * stride]) for y in range(height))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def heatmap_layout(lengths: Sequence[int], depths: Sequence[float]) -> dict:
    """Pixel geometry: cell (row r = depth, column c = length) spans x0 + c*cw .. +cw-GAP, y0 + r*ch .. +ch-GAP."""
    glyph = 4 * SCALE  # 3 columns and a space
    labels = [length_label(n) for n in lengths]
    cw = max(48, glyph * max(len(s) for s in labels) + 4 * GAP)
    x0 = glyph * max(len(f"{d:g}%") for d in depths) + 4 * GAP
    y0, ch = 6 * SCALE + 4 * GAP, 32
    return {"x0": x0, "y0": y0, "cw": cw, "ch": ch, "width": x0 + cw * len(lengths), "height": y0 + ch * len(depths)}


def heatmap_png(cells: Sequence[dict], lengths: Sequence[int], depths: Sequence[float]) -> bytes:
    """The grid as a PNG: column labels (lengths) on top, row labels (depth %) on the left."""
    L = heatmap_layout(lengths, depths)
    w, h = L["width"], L["height"]
    img = bytearray(WHITE * (w * h))

    def rect(x: int, y: int, rw: int, rh: int, color) -> None:
        for yy in range(y, y + rh):
            img[3 * (yy * w + x) : 3 * (yy * w + x + rw)] = bytes(color) * rw

    def text(s: str, x: int, y: int) -> None:
        for ch in s:
            for r, bits in enumerate(_FONT.get(ch, (7, 7, 7, 7, 7))):
                for c in range(3):
                    if bits >> (2 - c) & 1:
                        rect(x + c * SCALE, y + r * SCALE, SCALE, SCALE, INK)
            x += 4 * SCALE

    for r, row in enumerate(_grid(cells, lengths, depths)):
        y = L["y0"] + r * L["ch"]
        text(f"{depths[r]:g}%", GAP, y + (L["ch"] - 5 * SCALE) // 2)
        for c, f in enumerate(row):
            rect(L["x0"] + c * L["cw"], y, L["cw"] - GAP, L["ch"] - GAP, GREY if f is None else GREEN if f else RED)
    for c, n in enumerate(lengths):
        text(length_label(n), L["x0"] + c * L["cw"] + GAP, GAP)
    return png_bytes(w, h, img)


__all__ = ["NeedleBuilder", "NeedleError", "NeedlePrompt", "check_lengths", "heatmap_png", "parse_depths",
           "parse_lengths", "render_table", "run_needle", "score"]
