"""A scripted checkpoint: the tiny synthetic checkpoint (M3's chat template, the toy tokenizer) with weights that make
each token predict a fixed successor, so that a served model writes a known reply — thinking, an answer, a tool call —
from random weights (issue 35's end-to-end tests of ``vllm serve``).

How: every projection that writes into the residual stream (attention ``o_proj``, the dense MLPs' and every expert's
``down``) is zero, so the last hidden state is the last token's embedding exactly, whatever the attention, the
indexer and the router compute. The LM head's row for a token ``s`` is the sum of the unit vectors of
``final_norm(embedding[t])`` over the tokens ``t`` whose successor is ``s`` (``SUCCESSOR``), scaled; every other row is
zero. :func:`write_scripted` checks, in the stored dtype, that the argmax of every scripted token is its successor.

The reply's pieces are tokens of their own (byte-level strings added to the toy tokenizer's vocabulary, so they
decode to the text below): M3's tool marker ``]<]minimax[>[`` occurs many times in a call, each time with another
successor, so each piece of the call carries the marker with its tag. The thinking markers are M3's special tokens
(one id each, as the reasoning parser reads them).

What the prompt's last token starts (M3's generation prompt ends ``<mm:think>``, ``</mm:think>`` or ``\\n`` for
``thinking_mode`` enabled, disabled, adaptive):

* ``\\n`` -> ``<mm:think>`` -> ``THOUGHT`` -> ``</mm:think>`` -> ``ANSWER`` -> the call's pieces -> EOS
* so ``enabled`` writes ``THOUGHT</mm:think>ANSWER CALL``; ``disabled`` writes ``ANSWER CALL``; ``adaptive`` writes
  ``<mm:think>THOUGHT</mm:think>ANSWER CALL``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

THINK, END_THINK, NS = "<mm:think>", "</mm:think>", "]<]minimax[>["
THOUGHT = "The user asks for the weather in Paris."
ANSWER = "Let me check.\n"
CALL_PIECES = (f"{NS}<tool_call>\n", f'{NS}<invoke name="get_weather">', f"{NS}<city>", "Paris", f"{NS}</city>",
               f"{NS}<units>", f"{NS}<item>", "Celsius", f"{NS}</item>", f"{NS}</units>", f"{NS}</invoke>\n",
               f"{NS}</tool_call>")
CALL = "".join(CALL_PIECES)
# the reply's tool, as an OpenAI tools entry, and the call the parser must return
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "units": {"type": "array", "items": {"type": "string"}}},
                   "required": ["city"]}}}
CALL_ARGS = ("get_weather", {"city": "Paris", "units": ["Celsius"]})
# the chain, as texts: the prompt's last token (a byte token or a thinking marker) and the pieces after it
CHAIN = ("\n", THINK, THOUGHT, END_THINK, ANSWER, *CALL_PIECES)
# what a reply is, per thinking_mode: (reasoning, content before the call); then the call, then EOS
REPLY = {"enabled": (THOUGHT, ANSWER), "disabled": (None, ANSWER), "adaptive": (THOUGHT, ANSWER)}
RAW = {"enabled": THOUGHT + END_THINK + ANSWER + CALL, "disabled": ANSWER + CALL,
       "adaptive": THINK + THOUGHT + END_THINK + ANSWER + CALL}
_SCALE = 30.0
_LM = "language_model.model"


def _byte_level(text: str) -> str:
    from tokenizers import pre_tokenizers

    (piece, _), = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    return piece


def _add_words(out: Path, words, vocab_size: int) -> dict[str, int]:
    """The words as byte-level vocabulary entries of the toy tokenizer (tokenizer.json's BPE vocab: decode gives the
    text back; encode never produces them, which nothing here needs). Returns every chain text's id."""
    spec = json.loads((out / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    added = {t["content"]: t["id"] for t in spec["added_tokens"]}
    ids = {}
    for w in words:
        if w in added:
            ids[w] = added[w]
            continue
        key = _byte_level(w)
        if key not in vocab:
            vocab[key] = max(max(vocab.values()), max(added.values())) + 1
        ids[w] = vocab[key]
    if max(ids.values()) >= vocab_size:
        raise ValueError(f"the script needs ids up to {max(ids.values())}: past vocab_size {vocab_size}")
    (out / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))
    return ids


def write_scripted(out) -> tuple[Path, dict[str, int]]:
    """The scripted tiny checkpoint in ``out``; returns its directory and the id of every text of ``CHAIN``."""
    from safetensors.torch import load_file, save_file

    from minimax_m3.checkpoint.synthetic import write_synthetic
    from minimax_m3.config import M3Config
    from minimax_m3.ops.norm import rms_norm

    c = M3Config.preset("tiny")
    out = write_synthetic(Path(out), c, seed=0, num_shards=1)
    ids = _add_words(out, CHAIN, c.vocab_size)
    successor = {ids[a]: ids[b] for a, b in zip(CHAIN, CHAIN[1:])} | {ids[CHAIN[-1]]: c.eos_token_id}
    (shard,) = sorted(out.glob("*.safetensors"))
    t = load_file(shard)
    for name in t:
        if name.startswith(_LM) and name.endswith(("o_proj.weight", "down_proj.weight", ".w2.weight")):
            t[name] = torch.zeros_like(t[name])
    emb = t[f"{_LM}.embed_tokens.weight"].float()
    normed = rms_norm(emb, t[f"{_LM}.norm.weight"].float(), c.rms_norm_eps)
    unit = normed / normed.norm(dim=-1, keepdim=True)
    head = torch.zeros(c.vocab_size, c.hidden_size)
    for a, b in successor.items():
        head[b] += _SCALE * unit[a]
    dtype = t["language_model.lm_head.weight"].dtype
    t["language_model.lm_head.weight"] = head.to(dtype)
    logits = normed @ head.to(dtype).float().T
    wrong = {a: int(logits[a].argmax()) for a, b in successor.items() if int(logits[a].argmax()) != b}
    if wrong:
        raise AssertionError(f"scripted head: tokens {wrong} do not predict their successors")
    save_file(t, shard, metadata={"format": "pt"})
    return out, ids
