"""``vllm serve --speculative-config`` with an EAGLE3 draft through vLLM 0.13 + vllm-neuron 0.4.1, off-device (issue
24): vllm-neuron builds NxDI's fused speculation (``enable_fused_speculation``), resolves the draft's class from its
architecture (``LlamaForCausalLMEagle3``: the port's ``neuron.eagle`` draft, registered by the plugin) and reads the
fused graph's accepted tokens each step. ``vllm serve`` in its own process, NxDI CPU mode, the tiny synthetic target
with a synthetic draft (reduced vocabulary).

vLLM 0.13 accepts ``"method": "eagle3"`` only for Llama / Qwen / MiniCPM / gpt-oss targets, so the draft is named
with ``"method": "eagle"`` and NxDI's EAGLE3 switches come through ``override_neuron_config`` (README, 'Speculative
decoding'); ``num_speculative_tokens`` is NxDI's ``speculation_length`` (drafts + 1).

Oracle: the golden file of ``test_vllm_smoke`` (the reference backend, float32); greedy tokens must equal it."""

from __future__ import annotations

import json

import pytest

from minimax_m3.config import M3Config

from .conftest import vllm_missing
from .test_vllm_smoke import BUCKETS, MAX_LEN, PROMPTS, STEPS, _post, golden, model, vllm_serve  # noqa: F401

pytestmark = pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or "")
EAGLE3 = {"is_eagle3": True, "disable_kv_cache_tiling": True}  # the draft config sets its own input norm
CHUNK = 16  # the chunked server's prefill calls


def test_speculative_config_serves_the_golden_greedy_tokens(model, golden, tmp_path):  # noqa: F811
    from minimax_m3.checkpoint.draft import write_synthetic_draft

    draft = write_synthetic_draft(tmp_path / "draft", M3Config.from_pretrained(model), seed=1)
    spec = json.dumps({"method": "eagle", "model": str(draft), "num_speculative_tokens": 4})
    log = tmp_path / "serve.log"
    with vllm_serve(model, log, MAX_LEN, {**BUCKETS, **EAGLE3}, extra=["--speculative-config", spec]) as port:
        for i in (1, 3, 0, 2):  # 5, 40 (sparse blocks dropped), 1 (vllm-neuron passes no mask) and 12 tokens
            body = {"model": "m3-tiny", "prompt": PROMPTS[i], "max_tokens": STEPS, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            out = _post(f"http://127.0.0.1:{port}/v1/completions", body)
            assert out["choices"][0]["token_ids"] == golden[i], i
    text = log.read_text()
    assert "Successfully resolved to Neuron model class: M3Eagle3DraftForCausalLM" in text, text[-3000:]
    assert "Fused speculation config initialized successfully" in text


def test_speculative_config_with_a_prefill_chunk_serves_the_golden_greedy_tokens(model, golden, tmp_path):  # noqa: F811
    """``prefill_chunk`` 16 in the override with the draft: the 40- and 23-token prompts take three and two fused
    prefill calls (the draft follows them, ``neuron.eagle.M3FusedSpecModel``), the 12-token one a single call. (vLLM
    stops a speculating request at ``--max-model-len`` minus ``num_speculative_tokens``: the 56-token prompt gets 4
    of its 8 tokens with or without chunks, so it is not asked here.)"""
    from minimax_m3.checkpoint.draft import write_synthetic_draft

    draft = write_synthetic_draft(tmp_path / "draft", M3Config.from_pretrained(model), seed=1)
    spec = json.dumps({"method": "eagle", "model": str(draft), "num_speculative_tokens": 4})
    chunked = {"context_encoding_buckets": [CHUNK], "token_generation_buckets": [MAX_LEN], "prefill_chunk": CHUNK}
    asked = [3, 5, 2]
    assert [-(-len(PROMPTS[i]) // CHUNK) for i in asked] == [3, 2, 1]
    with vllm_serve(model, tmp_path / "serve.log", MAX_LEN, {**chunked, **EAGLE3},
                    extra=["--speculative-config", spec]) as port:
        for i in asked:
            body = {"model": "m3-tiny", "prompt": PROMPTS[i], "max_tokens": STEPS, "temperature": 0.0,
                    "ignore_eos": True, "return_token_ids": True}
            out = _post(f"http://127.0.0.1:{port}/v1/completions", body)
            assert out["choices"][0]["token_ids"] == golden[i], i
