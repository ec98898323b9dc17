"""The backend-neutral engine interface every user of the package talks to.

An :class:`Engine` takes token ids (lists of ints, no padding) and returns logits or generated tokens. The
reference backend (pure PyTorch, CPU/CUDA) and the neuron backends implement it; ``load_engine`` picks one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence, runtime_checkable

import torch

from .config import M3Config

BACKENDS = ("reference", "neuron", "neuron-cpu")


class EngineInputError(ValueError):
    """A request the engine cannot serve (empty prompt, prompt too long, ids outside the vocabulary...)."""


@dataclass(frozen=True)
class GenerationConfig:
    """How to pick tokens. ``temperature == 0`` means greedy decoding."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filtering
    top_p: float = 1.0  # 1.0: no nucleus filtering
    seed: int | None = None  # seeds sampling; identical seeds give identical samples
    eos_token_ids: tuple[int, ...] = ()  # stop after emitting one of these (the token is kept)
    stop_sequences: tuple[tuple[int, ...], ...] = ()  # stop once the output ends with one (kept)
    return_logits: bool = False  # keep the logits of every generated step (float32, [N, vocab])

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise EngineInputError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise EngineInputError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise EngineInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise EngineInputError(f"top_k must be >= 0 (0 = off), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class GenerationResult:
    tokens: list[int]  # generated ids only (prompt excluded)
    finish_reason: str  # "eos" | "stop" | "length"
    step_logits: torch.Tensor | None = None  # [len(tokens), vocab] float32 when requested
    prompt_len: int = 0
    timings: dict = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    """What every backend provides."""

    config: M3Config
    max_seq_len: int  # prompt + generated tokens per sequence

    def prefill_logits(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Teacher-forced logits at every prompt position: one float32 ``[len(prompt), vocab]`` per prompt."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig) -> list[GenerationResult]:
        """Generate for a batch; each sequence gets exactly the tokens it would get alone."""
        ...


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Turn a padded batch (left or right padding, mask 1 = real token) into plain token lists."""
    if input_ids.shape != attention_mask.shape:
        raise EngineInputError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ in shape"
        )
    out = []
    for row, (ids, m) in enumerate(zip(input_ids.tolist(), attention_mask.tolist())):
        ones = [j for j, keep in enumerate(m) if keep]
        if ones and ones[-1] - ones[0] + 1 != len(ones):
            raise EngineInputError(
                f"attention_mask row {row} has holes; only left or right padding (one run of 1s) is supported"
            )
        out.append([ids[j] for j in ones])
    return out


def load_engine(model: str, backend: str = "reference", **kwargs) -> Engine:
    """Load ``model`` (a checkpoint directory, or an ``s3://`` URI where supported) on ``backend``.

    Reference keyword arguments: ``device`` ("cpu" | "cuda" | None for the best local one), ``dtype``
    ("float32" | "bfloat16"), ``max_seq_len``, ``max_batch_size``.
    """
    if backend == "reference":
        from .reference.engine import ReferenceEngine

        return ReferenceEngine.from_pretrained(model, **kwargs)
    if backend in ("neuron", "neuron-cpu"):
        from .neuron import load_neuron_engine  # raises one clear error without the Neuron SDK

        return load_neuron_engine(model, on_cpu=(backend == "neuron-cpu"), **kwargs)
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
