"""lm-evaluation-harness (0.4.13) model ``minimax-m3``: generation through any minimax_m3 engine.

    python -m minimax_m3.eval.lm_eval_adapter run --model minimax-m3 \
        --model_args pretrained=DIR,backend=reference,max_seq_len=32768 \
        --tasks local_longbench_hotpotqa --include_path MY_LOCAL_TASKS --apply_chat_template

(the module runs lm_eval's own CLI after registering the model; from Python, importing this module is
enough for ``lm_eval.simple_evaluate(model="minimax-m3", ...)``). ``generate_until`` middle-truncates the context ids
to ``max_length - max_gen_toks``
and cuts the text at the first ``until`` string itself (the harness does not). Loglikelihood requests are not
served: LongBench v2's official protocol is generative (``minimax-m3 longbench --tasks v2``).
"""

from __future__ import annotations

from lm_eval.api.model import LM
from lm_eval.api.registry import register_model

from ..engine.loop import GenerationConfig
from ..errors import M3Error
from .protocol import middle_truncate_v1


def cut_at_stop(text: str, until) -> str:
    """Cut ``text`` at the earliest occurrence of any stop string."""
    cut = len(text)
    for s in until:
        if s:
            i = text.find(s)
            if 0 <= i < cut:
                cut = i
    return text[:cut]


def middle_truncate(ids: list[int], budget: int) -> list[int]:
    """LongBench v1's middle truncation (:func:`minimax_m3.eval.protocol.middle_truncate_v1`) as one id list."""
    cut = middle_truncate_v1(ids, budget)
    return list(ids) if cut is None else cut[0] + cut[1]


class LmEvalError(M3Error, ValueError):
    """``model_args`` or request settings the adapter cannot run (no checkpoint, no room for the generation)."""


class LmEvalRequestError(M3Error, NotImplementedError):
    """A request type the adapter does not serve (lm-eval's own signal for it is ``NotImplementedError``)."""


@register_model("minimax-m3")
class MiniMaxM3LM(LM):
    """``engine``/``tokenizer`` objects may be passed directly (tests, notebooks); otherwise ``pretrained``
    (checkpoint dir) is loaded on ``backend`` with the optional ``max_seq_len``, ``dtype`` and ``device``."""

    def __init__(self, pretrained: str | None = None, backend: str = "reference", tokenizer=None, engine=None,
                 max_length: int | None = None, batch_size: int | str = 1, max_seq_len: int | None = None,
                 dtype: str | None = None, device: str | None = None, **_ignored):  # fmt: skip
        super().__init__()
        if engine is None:
            if pretrained is None:
                raise LmEvalError("minimax-m3 needs model_args pretrained=<checkpoint dir> (or an engine object)")
            given = (("max_seq_len", max_seq_len), ("dtype", dtype), ("device", device))
            kw = {k: v for k, v in given if v is not None}
            if kw.get("max_seq_len") is not None:
                kw["max_seq_len"] = int(kw["max_seq_len"])
            from ..load import load_engine

            engine = load_engine(str(pretrained), backend=backend, **kw)
        if tokenizer is None or isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer or pretrained)
        self.engine, self.tokenizer = engine, tokenizer
        self.max_length = int(max_length) if max_length else engine.max_seq_len
        self.batch_size = max(1, int(batch_size)) if str(batch_size).isdigit() else 1
        self._name = str(pretrained or type(engine).__name__)
        self._chat_applied = False
        eos = [tokenizer.eos_token_id, getattr(engine.config, "eos_token_id", None)]
        self.eos_ids = tuple(dict.fromkeys(int(e) for e in eos if e is not None))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None):
        # lm-eval adds its own batch_size/device (often None): model_args win, Nones are dropped
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @property
    def tokenizer_name(self) -> str:
        return self._name.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        self._chat_applied = True  # the templated text carries its own special tokens
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def _gen_config(self, kw: dict) -> tuple[GenerationConfig, list[str]]:
        until = kw.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_gen = int(kw.get("max_gen_toks", 256))
        greedy = not kw.get("do_sample", False) or float(kw.get("temperature", 0.0)) == 0.0
        stops = tuple(tuple(self.tokenizer.encode(s, add_special_tokens=False)) for s in until if s)
        gen = GenerationConfig(max_new_tokens=max_gen, temperature=0.0 if greedy else float(kw["temperature"]),
                               eos_token_ids=self.eos_ids, stop_sequences=tuple(s for s in stops if s),
                               seed=0)
        return gen, until

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out: list[str | None] = [None] * len(requests)
        groups: dict = {}
        for i, req in enumerate(requests):
            context, kw = req.args
            gen, until = self._gen_config(dict(kw))
            budget = self.max_length - gen.max_new_tokens
            if budget < 2:
                raise LmEvalError(f"max_length {self.max_length} leaves no room for max_gen_toks "
                                  f"{gen.max_new_tokens}")
            ids = list(self.tokenizer.encode(context, add_special_tokens=not self._chat_applied))
            groups.setdefault((gen, tuple(until)), []).append((i, middle_truncate(ids, budget), context, kw))
        for (gen, until), items in groups.items():
            for s in range(0, len(items), self.batch_size):
                chunk = items[s : s + self.batch_size]
                results = self.engine.generate([ids for _, ids, _, _ in chunk], gen)
                for (i, _, context, kw), res in zip(chunk, results):
                    text = cut_at_stop(self.tokenizer.decode(res.tokens, skip_special_tokens=True), until)
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", (context, kw), text)
        return out  # type: ignore[return-value]

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise LmEvalRequestError(
            "minimax-m3 serves generate_until only; lm-eval's longbench2_* tasks are loglikelihood-based and not "
            "the official protocol - run LongBench v2 with `minimax-m3 longbench --tasks v2`"
        )

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise LmEvalRequestError("minimax-m3 serves generate_until only (no perplexity tasks)")


def main() -> None:
    """``python -m minimax_m3.eval.lm_eval_adapter <lm_eval arguments>``: lm_eval's CLI with ``minimax-m3``
    registered (the plain ``lm_eval`` command does not import this package)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
