"""``minimax-m3 longbench --server``: the client side without a server (the runs through ``vllm serve`` itself are in
``test/vllm/test_longbench_vllm_serve.py``)."""

import importlib.util
from types import SimpleNamespace as NS

import pytest

from minimax_m3.engine import GenerationConfig
from minimax_m3.eval.server import ServerEngine, ServerError


class FakeClient:
    """Records the requests; answers what a vLLM 0.13 completions server answers (``token_ids`` as an extra)."""

    def __init__(self, answers, models=("m3",), max_model_len=256):
        self.answers, self.sent = list(answers), []
        self.models = NS(list=lambda: [NS(id=m, model_extra={"max_model_len": max_model_len}) for m in models])
        self.completions = NS(create=self._create)

    def _create(self, **kw):
        self.sent.append(kw)
        ids, reason = self.answers.pop(0)
        return NS(choices=[NS(finish_reason=reason, model_extra={"token_ids": ids})])


def test_requests_carry_the_ids_and_the_runner_settings_and_results_map_back():
    client = FakeClient([([5, 6, 2], "stop"), ([7, 8], "length")])
    eng = ServerEngine("http://x/v1", client=client, eos_token_id=2)
    assert (eng.model, eng.max_seq_len, eng.config.eos_token_id) == ("m3", 256, 2)
    gen = GenerationConfig(max_new_tokens=3, temperature=0.0, eos_token_ids=(2, 9))
    res = eng.generate([[1, 2, 3]], gen) + eng.generate([[4]], gen)
    assert [(r.tokens, r.finish_reason, r.prompt_len) for r in res] == [([5, 6, 2], "eos", 3), ([7, 8], "length", 1)]
    assert client.sent[0] == {"model": "m3", "prompt": [1, 2, 3], "max_tokens": 3, "temperature": 0.0, "top_p": 1.0,
                              "seed": None, "extra_body": {"return_token_ids": True, "stop_token_ids": [2, 9]}}


def test_a_server_without_token_ids_or_without_the_model_is_one_error():
    client = FakeClient([])
    client.completions = NS(create=lambda **kw: NS(choices=[NS(finish_reason="stop", model_extra={})]))
    with pytest.raises(ServerError, match="return_token_ids"):
        ServerEngine("http://x/v1", client=client).generate([[1]], GenerationConfig())
    with pytest.raises(ServerError, match="--served-model"):
        ServerEngine("http://x/v1", "other", client=FakeClient([]))


@pytest.mark.skipif(importlib.util.find_spec("openai") is not None, reason="openai is installed here")
def test_without_openai_the_error_names_the_install():
    with pytest.raises(ServerError, match="pip install openai"):
        ServerEngine("http://127.0.0.1:9/v1")
