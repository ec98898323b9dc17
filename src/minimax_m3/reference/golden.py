"""Golden logits: the portable reference every other backend is graded against.

For the i-th prompt (file order) the output safetensors file holds ``{i}.prefill_logits`` float32
``[L_i, vocab]`` (teacher-forced logits at every prompt position), ``{i}.step_logits`` float32 ``[N, vocab]``
and ``{i}.tokens`` int64 ``[N]``: ``step_logits[0]`` is the last prompt position's logits,
``tokens[j] = argmax(step_logits[j])`` and ``step_logits[j]`` for ``j >= 1`` comes from a cached decode step
fed ``tokens[j-1]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from .._atomic import atomic_path
from ..engine.loop import Engine, EngineInputError, GenerationConfig


def read_prompts(path: str | Path) -> list[list[int]]:
    """PROMPTS.jsonl: one ``{"input_ids": [...]}`` per line."""
    prompts = []
    p = Path(path)
    if not p.is_file():
        raise EngineInputError(f"prompts file {p} does not exist")
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            ids = obj["input_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise TypeError("input_ids must be a list of integers")
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise EngineInputError(
                f"{p}:{n}: expected a JSON object {{\"input_ids\": [ints]}} ({type(exc).__name__}: {exc})"
            ) from None
        prompts.append(ids)
    if not prompts:
        raise EngineInputError(f"{p} holds no prompts")
    return prompts


def compute_golden(engine: Engine, prompts: list[list[int]], decode_steps: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    prefill = engine.prefill_logits(prompts)
    gen = GenerationConfig(max_new_tokens=decode_steps, temperature=0.0, return_logits=True)
    for i, (pl, res) in enumerate(zip(prefill, engine.generate(prompts, gen))):
        out[f"{i}.prefill_logits"] = pl.float().contiguous()
        out[f"{i}.step_logits"] = res.step_logits.float().contiguous()
        out[f"{i}.tokens"] = torch.tensor(res.tokens, dtype=torch.int64)
    return out


def write_golden(tensors: dict[str, torch.Tensor], out: str | Path, metadata: dict[str, str]) -> Path:
    out = Path(out)
    with atomic_path(out) as tmp:
        save_file(tensors, tmp, metadata=metadata)
    return out
