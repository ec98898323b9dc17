"""A prompt longer than one prefill chunk through vLLM 0.13 + vllm-neuron 0.4.1, off-device (issue 23): vllm-neuron
hands the model each whole prompt, and the port's application ``forward`` prefills it in calls of ``prefill_chunk``
tokens (``override_neuron_config``), the context buckets ending at the chunk while ``--max-model-len`` (NxDI's
``max_context_length``) is longer. ``vllm serve`` in its own process (one NxDI CPU-mode model per process).

Oracle: the golden file of ``test_vllm_smoke`` (the reference backend's one-shot prefill, float32); greedy tokens must
equal it exactly. Needs the port's attention to read the prior cache in context encoding."""

from __future__ import annotations

import pytest

from .conftest import vllm_missing
from .test_vllm_smoke import MAX_LEN, PROMPTS, STEPS, _post, golden, model, vllm_serve  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")
CHUNK = 32
CHUNKED = {"context_encoding_buckets": [16, CHUNK], "token_generation_buckets": [MAX_LEN], "prefill_chunk": CHUNK}


def test_prompts_longer_than_one_chunk_give_the_golden_greedy_tokens(model, golden, tmp_path):  # noqa: F811
    """40 and 56 tokens: two calls each (32 + 8, 32 + 24; the 40-token prompt has 3 blocks of 16, top 2 kept); 12
    tokens: one call."""
    long = [i for i, p in enumerate(PROMPTS) if len(p) > CHUNK]
    assert [len(PROMPTS[i]) for i in long] == [40, 56] and MAX_LEN > CHUNK
    with vllm_serve(model, tmp_path / "serve.log", MAX_LEN, CHUNKED) as port:
        for i in [*long, 2]:
            body = {"model": "m3-tiny", "prompt": PROMPTS[i], "max_tokens": STEPS, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            out = _post(f"http://127.0.0.1:{port}/v1/completions", body)
            assert out["choices"][0]["token_ids"] == golden[i], i
