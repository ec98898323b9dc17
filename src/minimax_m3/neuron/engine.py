"""The :class:`minimax_m3.engine.Engine` protocol over ``NeuronMiniMaxM3ForCausalLM`` (compiled or ``to_cpu()``).

Batches are right-padded to the model's fixed batch and context length; padding slots get position 0 so NxDI's
last-token pick (``argmax(position_ids)``) lands on each row's last real token. Decode feeds one token per row
at its own position. The caches are NxDI's (K/V plus our index-K), reset before every request.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Sequence

import torch

from .. import ops
from ..config import M3Config
from ..engine import EngineInputError, GenerationConfig, GenerationResult
from .config import MiniMaxM3InferenceConfig, MiniMaxM3NeuronConfig, load_m3_config
from .model import NeuronMiniMaxM3ForCausalLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_neuron_config(tp_degree: int = 1, batch_size: int = 1, max_seq_len: int = 256,
                        max_context_length: int | None = None, dtype: str = "bfloat16", on_cpu: bool = False,
                        moe_ep_degree: int = 1, **extra) -> MiniMaxM3NeuronConfig:
    ctx = max_context_length or max_seq_len
    kw = dict(tp_degree=tp_degree, batch_size=batch_size, ctx_batch_size=batch_size, tkg_batch_size=batch_size,
              max_batch_size=batch_size, seq_len=max_seq_len, max_context_length=ctx,
              torch_dtype=DTYPES[dtype] if isinstance(dtype, str) else dtype, padding_side="right",
              moe_tp_degree=tp_degree // moe_ep_degree, moe_ep_degree=moe_ep_degree, on_cpu=on_cpu,
              enable_bucketing=False, output_logits=False)
    if on_cpu:  # the stand-in kernels cannot run; NxDI's native paths (and ours) are used
        kw.update(attn_kernel_enabled=False, qkv_kernel_enabled=False, mlp_kernel_enabled=False,
                  blockwise_matmul_config={"use_torch_block_wise": True})
    kw.update(extra)
    return MiniMaxM3NeuronConfig(**kw)


def _to_cpu(app) -> None:
    """``app.to_cpu()``, joining a process group that already exists in this process.

    Under torchrun NxDI's ``to_cpu`` calls ``init_process_group("gloo")`` unconditionally, which fails when
    another engine (e.g. the reference golden in the same pytest) already joined; hiding ``WORLD_SIZE`` for the
    call makes NxDI reuse the existing group after we check that it has the size NxDI would have asserted."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and "WORLD_SIZE" in os.environ):
        app.to_cpu()
        return
    want = app.neuron_config.world_size
    if dist.get_world_size() != want or dist.get_backend() != "gloo":
        raise RuntimeError(f"existing process group ({dist.get_backend()}, world {dist.get_world_size()}) cannot "
                           f"host NxDI's CPU mode (gloo, world {want})")
    world = os.environ.pop("WORLD_SIZE")
    try:
        app.to_cpu()
    finally:
        os.environ["WORLD_SIZE"] = world


class NeuronEngine:
    def __init__(self, app: NeuronMiniMaxM3ForCausalLM, config: M3Config):
        self.app, self.config = app, config
        nc = app.neuron_config
        self.batch, self.ctx_len, self.max_seq_len = nc.batch_size, nc.max_context_length, nc.seq_len

    @classmethod
    def from_pretrained(cls, model: str, on_cpu: bool = False, compiled_path: str | None = None, **kwargs):
        kwargs.pop("device", None)
        if "max_batch_size" in kwargs:
            kwargs["batch_size"] = kwargs.pop("max_batch_size")
        nc = build_neuron_config(on_cpu=on_cpu, **kwargs)
        config = MiniMaxM3InferenceConfig(nc, load_config=load_m3_config(model))
        app = NeuronMiniMaxM3ForCausalLM(model, config)
        if on_cpu:
            _to_cpu(app)
        else:
            path = compiled_path or str(Path(model) / "neuron-compiled")
            if not (Path(path) / "model.pt").is_file():
                app.compile(path)
            app.load(path)
        return cls(app, config.m3_config())

    # ---- one NxDI call ---------------------------------------------------------------------------
    # no autograd: in CPU mode the weights require grad and the caches chain every step's graph (~250 MB
    # per tiny-model prefill kept alive, unbounded); on device the traced graph has none.
    @torch.no_grad()
    def _prefill(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Prefill up to ``batch`` rows (cache reset first); returns last-token logits ``[len(rows), V]``."""
        ids = torch.zeros(self.batch, self.ctx_len, dtype=torch.long)
        pos = torch.zeros(self.batch, self.ctx_len, dtype=torch.long)
        mask = torch.zeros(self.batch, self.ctx_len, dtype=torch.long)
        for r, row in enumerate(list(rows) + [rows[0]] * (self.batch - len(rows))):
            ids[r, : len(row)] = torch.tensor(row)
            pos[r, : len(row)] = torch.arange(len(row))
            mask[r, : len(row)] = 1
        self.app.reset()
        out = self.app(input_ids=ids, attention_mask=mask, position_ids=pos,
                       seq_ids=torch.arange(self.batch))
        return out.logits[: len(rows), -1].float()

    @torch.no_grad()
    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.app(input_ids=tokens.view(-1, 1), position_ids=positions.view(-1, 1),
                       seq_ids=torch.arange(self.batch))
        return out.logits[:, -1].float()

    def _check(self, prompts):
        if not prompts:
            raise EngineInputError("give at least one prompt")
        for p in prompts:
            if not 0 < len(p) <= self.ctx_len:
                raise EngineInputError(f"prompt length {len(p)} outside 1..{self.ctx_len} (max_context_length)")

    # ---- Engine protocol -------------------------------------------------------------------------
    def prefill_logits(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Teacher-forced prefill logits at every position: each prefix is one prefill row (its last token's
        logits), ``batch`` prefixes per call — prefill only, no decode step is involved."""
        self._check(prompts)
        out = []
        for p in prompts:
            prefixes = [list(p[: t + 1]) for t in range(len(p))]
            chunks = [self._prefill(prefixes[i:i + self.batch]) for i in range(0, len(prefixes), self.batch)]
            out.append(torch.cat(chunks))
        return out

    def generate(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig) -> list[GenerationResult]:
        """Greedy or sampled generation, ``batch`` prompts per NxDI batch."""
        self._check(prompts)
        out: list[GenerationResult] = []
        for i in range(0, len(prompts), self.batch):
            out.extend(self._generate(prompts[i:i + self.batch], gen))
        return out

    def _generate(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig) -> list[GenerationResult]:
        n = len(prompts)
        if max(len(p) for p in prompts) + gen.max_new_tokens > self.max_seq_len:
            raise EngineInputError(f"prompt + max_new_tokens exceeds max_seq_len {self.max_seq_len}")
        gen_rng = torch.Generator().manual_seed(gen.seed) if gen.seed is not None else None
        t0 = time.perf_counter()
        logits = self._prefill(prompts)
        ttft = time.perf_counter() - t0
        pos = torch.tensor([len(p) for p in prompts] + [len(prompts[0])] * (self.batch - n))
        toks: list[list[int]] = [[] for _ in range(n)]
        steps: list[list[torch.Tensor]] = [[] for _ in range(n)]
        done = [None] * n
        for step in range(gen.max_new_tokens):
            nxt = ops.sample(logits, gen.temperature, gen.top_k, gen.top_p, gen_rng) if not gen.greedy \
                else logits.argmax(-1)
            for r in range(n):
                if done[r] is None:
                    toks[r].append(int(nxt[r]))
                    if gen.return_logits:
                        steps[r].append(logits[r])
                    if toks[r][-1] in gen.eos_token_ids:
                        done[r] = "eos"
                    elif any(tuple(toks[r][-len(s):]) == tuple(s) for s in gen.stop_sequences if s):
                        done[r] = "stop"
            if all(d is not None for d in done) or step == gen.max_new_tokens - 1:
                break
            feed = torch.zeros(self.batch, dtype=torch.long)
            feed[:n] = nxt[:n]
            logits = self._decode(feed, pos)
            pos = pos + 1
        total = time.perf_counter() - t0
        return [GenerationResult(tokens=toks[r], finish_reason=done[r] or "length",
                                 step_logits=torch.stack(steps[r]) if gen.return_logits else None,
                                 prompt_len=len(prompts[r]), timings={"ttft_s": ttft, "total_s": total})
                for r in range(n)]
