"""The reference backend behind the `Engine` interface: batched prefill, cached decode, sampling."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import torch

from .. import ops
from ..config import M3Config
from ..engine import EngineInputError, GenerationConfig, GenerationResult
from .loader import load_model
from .model import M3Model
from .parallel import ShardPlan, init_distributed

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def best_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str | torch.dtype, device: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise EngineInputError(f"unknown dtype {dtype!r}; choose float32 or bfloat16")
    if dtype == "bfloat16" and device.startswith("cuda") and not torch.cuda.is_bf16_supported():
        raise EngineInputError(
            f"bfloat16 requested on {torch.cuda.get_device_name()} which has no bfloat16 support; use --dtype float32"
        )
    return DTYPES[dtype]


class ReferenceEngine:
    """Pure-PyTorch engine. ``max_seq_len`` bounds prompt + generated tokens per sequence."""

    def __init__(self, model: M3Model, max_seq_len: int = 4096, max_batch_size: int = 8, tile: int = 256):
        self.model = model
        self.config: M3Config = model.config
        self.device = model.lm_head.weight.device
        self.dtype = model.lm_head.weight.dtype
        self.max_seq_len = min(max_seq_len, self.config.max_position_embeddings)
        self.max_batch_size = max_batch_size
        self.tile = tile

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | None = None, dtype: str | torch.dtype = "float32",
                        max_seq_len: int = 4096, max_batch_size: int = 8, tile: int = 256,
                        plan: ShardPlan | None = None) -> "ReferenceEngine":
        """``plan``: this rank's tensor/expert-parallel slice; every rank of the process group must then make the same
        calls with the same inputs. Under ``torchrun`` (``WORLD_SIZE > 1``) without a plan, the process group is
        joined here with ``ep = $MINIMAX_M3_EP`` (default 1) and ``device`` None/"cuda" becomes this rank's GPU."""
        if plan is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            plan, rank_device = init_distributed(ep=int(os.environ.get("MINIMAX_M3_EP", "1")))
            device = rank_device if device in (None, "cuda") else device
        device = device or best_device()
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineInputError("device 'cuda' requested but no CUDA device is available; use --device cpu")
        model = load_model(path, device=device, dtype=resolve_dtype(dtype, device), plan=plan)
        return cls(model, max_seq_len=max_seq_len, max_batch_size=max_batch_size, tile=tile)

    # ---- input checks --------------------------------------------------------------------
    def _check(self, prompts: Sequence[Sequence[int]], extra: int) -> list[list[int]]:
        if len(prompts) == 0:
            raise EngineInputError("no prompts given")
        out = []
        for i, p in enumerate(prompts):
            p = [int(t) for t in p]
            if not p:
                raise EngineInputError(f"prompt {i} is empty; give at least one token (e.g. the BOS id)")
            bad = [t for t in p if not 0 <= t < self.config.vocab_size]
            if bad:
                raise EngineInputError(
                    f"prompt {i} has token ids outside the vocabulary [0, {self.config.vocab_size}): {bad[:5]}"
                )
            if len(p) + extra > self.max_seq_len:
                raise EngineInputError(
                    f"prompt {i} has {len(p)} tokens; with {extra} new tokens that exceeds max_seq_len="
                    f"{self.max_seq_len}. Shorten the prompt or raise max_seq_len (--max-seq-len)"
                )
            out.append(p)
        return out

    def _batches(self, prompts: list[list[int]]):
        for s in range(0, len(prompts), self.max_batch_size):
            yield prompts[s:s + self.max_batch_size]

    def _prefill(self, prompts: list[list[int]], cache_len: int, all_logits: bool):
        """Prefill a batch aligned at position 0 (right-padded internally)."""
        b, s = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(b, s, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p)
        ids = ids.to(self.device)
        positions = torch.arange(s, device=self.device).unsqueeze(0).expand(b, s)
        cache = self.model.new_cache(b, cache_len, tile=self.tile)
        last = None if all_logits else torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        logits = self.model(ids, positions, cache, s, decode=False, logits_at=last)
        return logits, cache

    # ---- Engine interface ----------------------------------------------------------------
    def prefill_logits(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        prompts = self._check(prompts, 0)
        out: list[torch.Tensor] = []
        for batch in self._batches(prompts):
            logits, _ = self._prefill(batch, max(len(p) for p in batch), all_logits=True)
            out.extend(logits[i, :len(p)].cpu() for i, p in enumerate(batch))
        return out

    def generate(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig) -> list[GenerationResult]:
        prompts = self._check(prompts, gen.max_new_tokens)
        results: list[GenerationResult] = []
        for batch in self._batches(prompts):
            results.extend(self._generate_batch(batch, gen))
        return results

    def _generate_batch(self, prompts: list[list[int]], gen: GenerationConfig):
        b = len(prompts)
        lens = [len(p) for p in prompts]
        cache_len = max(lens) + gen.max_new_tokens
        gens = None
        if not gen.greedy:  # one generator per sequence, all seeded alike: a sequence samples the same
            seed = 0 if gen.seed is None else gen.seed  # tokens alone or in any batch
            gens = [torch.Generator(device=self.device).manual_seed(seed) for _ in range(b)]
        t0 = time.perf_counter()
        logits, cache = self._prefill(prompts, cache_len, all_logits=False)
        logits = logits[:, 0]
        self._sync()
        prefill_s = time.perf_counter() - t0
        tokens: list[list[int]] = [[] for _ in range(b)]
        kept: list[list[torch.Tensor]] = [[] for _ in range(b)]
        finish = [None] * b
        step_s: list[float] = []
        for step in range(gen.max_new_tokens):
            nxt = self._choose(logits, gen, gens)
            for i in range(b):
                if finish[i] is not None:
                    continue
                if gen.return_logits:
                    kept[i].append(logits[i].float().cpu())
                tokens[i].append(nxt[i])
                finish[i] = _finished(tokens[i], gen)
            if all(f is not None for f in finish) or step == gen.max_new_tokens - 1:
                break
            t1 = time.perf_counter()
            pos = [lens[i] + step for i in range(b)]
            positions = torch.tensor(pos, device=self.device).unsqueeze(1)
            ids = torch.tensor(nxt, device=self.device).unsqueeze(1)
            logits = self.model(ids, positions, cache, max(pos) + 1, decode=True)[:, 0]
            self._sync()
            step_s.append(time.perf_counter() - t1)
        out = []
        for i in range(b):
            out.append(GenerationResult(
                tokens=tokens[i], finish_reason=finish[i] or "length", prompt_len=lens[i],
                step_logits=torch.stack(kept[i]) if gen.return_logits else None,
                timings={"prefill_s": prefill_s, "decode_step_s": step_s},
            ))
        return out

    def _choose(self, logits: torch.Tensor, gen: GenerationConfig, gens) -> list[int]:
        if gens is None:
            return logits.argmax(dim=-1).tolist()
        return [int(ops.sample(logits[i:i + 1], gen.temperature, gen.top_k, gen.top_p, gens[i])[0])
                for i in range(logits.shape[0])]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def _finished(tokens: list[int], gen: GenerationConfig) -> str | None:
    if tokens[-1] in gen.eos_token_ids:
        return "eos"
    for stop in gen.stop_sequences:
        if stop and len(tokens) >= len(stop) and tuple(tokens[-len(stop):]) == tuple(stop):
            return "stop"
    return None
