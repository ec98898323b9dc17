"""A tiny byte-level tokenizer for synthetic checkpoints and tests.

Every UTF-8 string (Chinese included) encodes to one token per byte, so encode/decode round-trips exactly.
Special tokens (pad, bos, eos and four chat markers) take the lowest free ids; the 256 byte tokens follow, then
MiniMax-M3's single tokens (``chat_template.SPECIAL_TOKENS``: ``]~!b[``, ``]~b]``, ``[e~[``, ``]<]minimax[>[``,
``<mm:think>``...), one id each; special except the markers the parsers read in the text (``TEXT_MARKERS``). All
ids are below ``vocab_size``. The chat template is written beside the tokenizer as ``chat_template.jinja``, as the
release does. The result loads with ``transformers.AutoTokenizer.from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

from .._atomic import atomic_path, write_atomic
from .chat_template import SPECIAL_TOKENS as M3_SPECIAL_TOKENS
from .chat_template import TEXT_MARKERS

# A single-user-turn chat format for protocol tests (synthetic checkpoints carry M3's own, chat_template.py); the
# markers are special tokens, so truncation can never split them.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_ROLE_MARKERS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
_N_BYTES = 256


def _write_json_atomic(path: Path, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, ensure_ascii=False, indent=2))


def write_toy_tokenizer(
    out_dir,
    vocab_size: int,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    pad_token_id: int = 0,
    chat_template: str = CHAT_TEMPLATE,
) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json and chat_template.jinja into ``out_dir``.

    Layout: ``pad``/``bos``/``eos`` at the given ids; the chat markers ``<|system|> <|user|> <|assistant|>
    <|end|>`` at the lowest remaining ids; then the 256 byte tokens; then M3's special tokens. Needs
    ``vocab_size >= 271`` and the three given ids distinct and below ``vocab_size``. The tokenizer adds no BOS by
    itself; ``CHAT_TEMPLATE`` starts with it (M3's template writes ``]~!b[`` instead).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    named = {"pad": pad_token_id, "bos": bos_token_id, "eos": eos_token_id}
    n_special = len(named) + len(_ROLE_MARKERS) + len(M3_SPECIAL_TOKENS)
    if vocab_size < _N_BYTES + n_special:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for the toy tokenizer: it needs {_N_BYTES} byte tokens + "
            f"{n_special} special tokens = {_N_BYTES + n_special}; pass vocab_size >= {_N_BYTES + n_special}"
        )
    for name, tid in named.items():
        if not 0 <= tid < vocab_size:
            raise ValueError(f"{name}_token_id {tid} is outside [0, {vocab_size}); pick an id below vocab_size")
    if len(set(named.values())) != len(named):
        raise ValueError(f"pad/bos/eos token ids must be distinct, got {named}")

    special_text = {"pad": "<pad>", "bos": "<s>", "eos": "</s>"}
    id_to_token: dict[int, str] = {tid: special_text[name] for name, tid in named.items()}
    free = (i for i in range(vocab_size) if i not in id_to_token)
    for marker in _ROLE_MARKERS:
        id_to_token[next(free)] = marker
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        id_to_token[next(free)] = ch
    for marker in M3_SPECIAL_TOKENS:
        id_to_token[next(free)] = marker
    vocab = {tok: i for i, tok in id_to_token.items()}

    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    m3_special = [s for s in M3_SPECIAL_TOKENS if s not in TEXT_MARKERS]
    specials = [special_text[k] for k in ("pad", "bos", "eos")] + list(_ROLE_MARKERS) + m3_special
    from tokenizers import AddedToken

    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    # single ids, never split, but kept in decoded text when special tokens are skipped (chat_template.TEXT_MARKERS)
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in TEXT_MARKERS])

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "tokenizer.json") as tmp:
        tok.save(str(tmp))

    special_map = {
        "bos_token": special_text["bos"],
        "eos_token": special_text["eos"],
        "pad_token": special_text["pad"],
        "additional_special_tokens": list(_ROLE_MARKERS) + m3_special,
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        **special_map,
    }
    write_atomic(out / "chat_template.jinja", chat_template)
    _write_json_atomic(out / "special_tokens_map.json", special_map)
    _write_json_atomic(out / "tokenizer_config.json", config)
