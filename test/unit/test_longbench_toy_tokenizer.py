"""The toy byte-level tokenizer: loads with AutoTokenizer, ids stay in range, text round-trips."""

import json

import pytest
from transformers import AutoTokenizer

from minimax_m3.checkpoint.toy_tokenizer import write_toy_tokenizer

TEXTS = [
    "",
    "plain ascii, with punctuation!?",
    "  leading and trailing spaces  \n\ttabs\r\n",
    "北京是中国的首都。今天天气很好！",
    "emoji 🚀 and accents: café naïve Ωμέγα",
    "def f(x):\n    return x + 1  # comment\n",
]


@pytest.mark.parametrize("vocab_size", [512, 2048])
def test_roundtrip_and_id_range(tmp_path, vocab_size):
    write_toy_tokenizer(tmp_path, vocab_size)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=True)
        # one token per UTF-8 byte, no BOS added by the tokenizer itself
        assert len(ids) == len(text.encode("utf-8"))
        assert all(0 <= i < vocab_size for i in ids)
        assert tok.decode(ids) == text


def test_chat_template_and_custom_ids(tmp_path):
    write_toy_tokenizer(tmp_path, 300, bos_token_id=7, eos_token_id=299, pad_token_id=3)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (3, 7, 299)
    text = tok.apply_chat_template([{"role": "user", "content": "问 q"}], tokenize=False, add_generation_prompt=True)
    assert text == "<s><|user|>问 q<|end|><|assistant|>"
    ids = tok.encode(text, add_special_tokens=False)
    # <s> + <|user|> + bytes of "问 q" (3 + 1 + 1) + <|end|> + <|assistant|> = 1 + 1 + 5 + 1 + 1 = 9
    assert len(ids) == 9 and ids[0] == 7
    assert tok.decode(ids, skip_special_tokens=True) == "问 q"
    # beside the tokenizer as chat_template.jinja (the release's layout), not inside tokenizer_config.json
    assert (tmp_path / "chat_template.jinja").read_text() == tok.chat_template
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 100 is too small"):
        write_toy_tokenizer(tmp_path, 100)
    with pytest.raises(ValueError, match="eos_token_id 600 is outside"):
        write_toy_tokenizer(tmp_path, 512, eos_token_id=600)
    with pytest.raises(ValueError, match="distinct"):
        write_toy_tokenizer(tmp_path, 512, bos_token_id=2)
