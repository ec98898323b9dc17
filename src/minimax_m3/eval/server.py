"""An OpenAI-compatible completions server as the LongBench runner's engine (``minimax-m3 longbench --server URL``).

The runner drives an engine through ``generate(prompts, gen)``, ``max_seq_len`` and ``config`` (see
:mod:`minimax_m3.eval.runner`); :class:`ServerEngine` gives it those over HTTP, so the whole protocol (prompt
filling, chat wrapping and middle truncation in tokens, per-task lengths and stop tokens, scoring) stays in the
runner and the server only generates. Prompts are sent as token ids and the generated ids come back
(``return_token_ids``, a vLLM extension of the completions API, as are ``stop_token_ids`` and ``top_k``), so the
client decodes exactly as it does for a local engine. The batch of one ``generate`` call goes out as concurrent
requests (``--batch-size``); the server batches them.

The ``openai`` package is optional and imported when a server is used.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Sequence

from ..engine.loop import GenerationConfig, GenerationResult
from ..errors import M3Error


class ServerError(M3Error, ValueError):
    """A server the runner cannot use (package missing, no such model, no token ids in the answer)."""


def _openai():
    try:
        import openai
    except ImportError:
        raise ServerError("--server needs the openai package: pip install openai") from None
    return openai


class ServerEngine:
    """The runner's engine interface over ``base_url`` (e.g. ``http://127.0.0.1:8000/v1``), model ``model`` (default:
    the first the server lists). ``max_seq_len``: the server's ``max_model_len`` when it reports one (vLLM does),
    else ``max_seq_len``. ``eos_token_id``: the model's, as a local engine's ``config`` carries it."""

    def __init__(self, base_url: str, model: str | None = None, *, api_key: str | None = None,
                 max_seq_len: int | None = None, eos_token_id=None, timeout: float = 600.0, client=None):
        openai = _openai() if client is None else None
        self.client = client or openai.OpenAI(base_url=base_url, api_key=api_key or "EMPTY", timeout=timeout)
        self.base_url = base_url
        try:
            listed = list(self.client.models.list())
        except Exception as exc:  # connection refused, bad URL, auth: one message naming the server
            raise ServerError(f"cannot list the models of {base_url}: {exc}") from None
        names = [m.id for m in listed]
        if model is None and not names:
            raise ServerError(f"{base_url} serves no model")
        self.model = model or names[0]
        if names and self.model not in names:
            raise ServerError(f"{base_url} does not serve {self.model!r} (it serves {', '.join(names)}): "
                              "pass --served-model")
        card = listed[names.index(self.model)] if names else None
        reported = getattr(card, "max_model_len", None) or ((getattr(card, "model_extra", None) or {})
                                                           .get("max_model_len"))
        self.max_seq_len = int(reported or max_seq_len or 0)
        if self.max_seq_len < 1:
            raise ServerError(f"{base_url} reports no max_model_len: pass --max-seq-len")
        self.config = SimpleNamespace(eos_token_id=eos_token_id)

    def _one(self, prompt: Sequence[int], gen: GenerationConfig) -> GenerationResult:
        extra = {"return_token_ids": True, "stop_token_ids": list(gen.eos_token_ids)}
        if gen.top_k > 0:
            extra["top_k"] = gen.top_k
        out = self.client.completions.create(
            model=self.model, prompt=list(prompt), max_tokens=gen.max_new_tokens, temperature=gen.temperature,
            top_p=gen.top_p, seed=gen.seed, extra_body=extra)
        choice = out.choices[0]
        tokens = getattr(choice, "token_ids", None)
        if tokens is None:
            tokens = (getattr(choice, "model_extra", None) or {}).get("token_ids")
        if tokens is None:
            raise ServerError(f"{self.base_url} returned no token ids (return_token_ids: a vLLM >= 0.10.2 server "
                              "answers them; the runner needs ids to decode as it does locally)")
        tokens = [int(t) for t in tokens]
        if choice.finish_reason == "length":
            reason = "length"
        else:
            reason = "eos" if tokens and tokens[-1] in gen.eos_token_ids else "stop"
        return GenerationResult(tokens=tokens, finish_reason=reason, prompt_len=len(prompt))

    def generate(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig) -> list[GenerationResult]:
        if gen.stop_sequences or gen.return_logits:
            raise ServerError("stop sequences and logits are not asked of a server by the LongBench runner")
        with ThreadPoolExecutor(max_workers=max(1, len(prompts))) as pool:
            return list(pool.map(lambda p: self._one(p, gen), prompts))

    def prefill_logits(self, prompts):
        raise ServerError("samsum forces the first token off its stop tokens (pred.py's min_length), which needs the "
                          "prompt's logits: a completions server does not return them; run samsum with --backend")
