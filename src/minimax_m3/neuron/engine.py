"""The :class:`minimax_m3.engine.Engine` protocol over ``NeuronMiniMaxM3ForCausalLM`` (compiled or ``to_cpu()``).

Shapes. A prefill call is as wide as its longest prompt (right padding, padding positions 0 so NxDI's
last-token pick ``argmax(position_ids)`` lands on each row's last real token); NxDI's ``ModelWrapper`` pads it on
to the smallest context-encoding bucket that holds it (``get_target_bucket``, first fit; NxDI's test is strict,
so a prompt exactly one bucket long takes the next bucket unless it is the largest). Buckets are on by default:
powers of two from 128 below ``max_context_length``, and that length itself (``compile.context_buckets``).

Batching. With ``batch_size > 1`` the engine batches continuously, as NxDI does for vLLM
(``is_continuous_batching``, ``ctx_batch_size=1``): each request is prefilled alone into its own cache row
(``seq_ids=[slot]``, K/V and index-K alike), decode runs every row together (``seq_ids = arange(batch)``: batch
row r is cache row r) with each row at its own position, and a finished request's slot takes the next waiting
prompt. ``continuous_batching=False`` keeps static batching (``ctx_batch_size = batch``, up to ``batch`` prompts
prefilled together, the next group after the whole group is done).

Logits. A ``prefill_all_logits`` build's context-encoding graph returns every position of its bucket
(:class:`AllPositionsModel`): ``prefill_logits`` is one prefill per prompt. It is on by default in CPU mode and
off on device, where it costs a ``bucket x vocab`` fp32 output per call (a scoring build: ``minimax-m3 compile
--all-logits``).
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from .. import ops
from ..config import M3Config
from ..engine import EngineInputError, GenerationConfig, GenerationResult
from .compile import context_buckets
from .config import MiniMaxM3InferenceConfig, MiniMaxM3NeuronConfig, load_m3_config
from .model import NeuronMiniMaxM3ForCausalLM, NeuronMiniMaxM3Model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_neuron_config(tp_degree: int = 1, batch_size: int = 1, max_seq_len: int = 256,
                        max_context_length: int | None = None, dtype: str = "bfloat16", on_cpu: bool = False,
                        moe_ep_degree: int = 1, continuous_batching: bool | None = None,
                        prefill_all_logits: bool = False, **extra) -> MiniMaxM3NeuronConfig:
    """NxDI's config for this engine. ``continuous_batching`` defaults to ``batch_size > 1``; context buckets to
    :func:`context_buckets` and decode to one bucket of ``max_seq_len`` (``extra`` overrides any of them)."""
    ctx = max_context_length or max_seq_len
    cb = batch_size > 1 if continuous_batching is None else bool(continuous_batching)
    kw = dict(tp_degree=tp_degree, batch_size=batch_size, ctx_batch_size=1 if cb else batch_size,
              tkg_batch_size=batch_size, max_batch_size=batch_size, is_continuous_batching=cb,
              seq_len=max_seq_len, max_context_length=ctx,
              torch_dtype=DTYPES[dtype] if isinstance(dtype, str) else dtype, padding_side="right",
              moe_tp_degree=tp_degree // moe_ep_degree, moe_ep_degree=moe_ep_degree, on_cpu=on_cpu,
              enable_bucketing=True, context_encoding_buckets=context_buckets(ctx),
              token_generation_buckets=[max_seq_len], output_logits=False, prefill_all_logits=prefill_all_logits)
    if on_cpu:  # the stand-in kernels cannot run; NxDI's native paths (and ours) are used
        kw.update(attn_kernel_enabled=False, qkv_kernel_enabled=False, mlp_kernel_enabled=False,
                  blockwise_matmul_config={"use_torch_block_wise": True})
    kw.update(extra)
    return MiniMaxM3NeuronConfig(**kw)


class AllPositionsModel(NeuronMiniMaxM3Model):
    """The traced model of a ``prefill_all_logits`` build: NxDI's ``NeuronBaseModel.forward`` gathers the last
    real token's hidden state before the LM head unless ``sliced_hidden`` says a sequence-parallel gather already
    did; set from the start, the LM head runs on every position of the bucket (one position in decode, as
    before)."""

    def __init__(self, config, optimize_inference: bool = True):
        super().__init__(config, optimize_inference)
        self.sliced_hidden = True


class AllPositionsForCausalLM(NeuronMiniMaxM3ForCausalLM):
    _model_cls = AllPositionsModel


def application(model: str, config: MiniMaxM3InferenceConfig) -> NeuronMiniMaxM3ForCausalLM:
    """The NxDI application for ``config``: all-position prefill logits when ``prefill_all_logits`` is set."""
    cls = AllPositionsForCausalLM if config.neuron_config.prefill_all_logits else NeuronMiniMaxM3ForCausalLM
    return cls(model, config)


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


@dataclass
class _Request:
    """One prompt being generated: its next-token logits, position and what it produced so far."""

    index: int
    prompt: list[int]
    logits: torch.Tensor
    rng: torch.Generator | None
    t_admit: float
    ttft: float
    tokens: list[int] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)

    @property
    def pos(self) -> int:  # where the last chosen token goes in decode
        return len(self.prompt) + len(self.tokens) - 1

    def choose(self, gen: GenerationConfig) -> str | None:
        """Pick the next token from ``logits``; the finish reason once done, else None."""
        tok = int(self.logits.argmax()) if gen.greedy else \
            int(ops.sample(self.logits[None], gen.temperature, gen.top_k, gen.top_p, self.rng)[0])
        self.tokens.append(tok)
        if gen.return_logits:
            self.steps.append(self.logits)
        if tok in gen.eos_token_ids:
            return "eos"
        if any(s and tuple(self.tokens[-len(s):]) == tuple(s) for s in gen.stop_sequences):
            return "stop"
        return "length" if len(self.tokens) == gen.max_new_tokens else None

    def result(self, reason: str, gen: GenerationConfig) -> GenerationResult:
        return GenerationResult(tokens=self.tokens, finish_reason=reason, prompt_len=len(self.prompt),
                                step_logits=torch.stack(self.steps) if gen.return_logits else None,
                                timings={"ttft_s": self.ttft, "total_s": time.perf_counter() - self.t_admit})


class NeuronEngine:
    def __init__(self, app: NeuronMiniMaxM3ForCausalLM, config: M3Config):
        self.app, self.config = app, config
        nc = app.neuron_config
        self.batch, self.ctx_len, self.max_seq_len = nc.batch_size, nc.max_context_length, nc.seq_len
        self.continuous = bool(nc.is_continuous_batching)

    @classmethod
    def from_pretrained(cls, model: str, on_cpu: bool = False, compiled_path: str | None = None, **kwargs):
        kwargs.pop("device", None)
        if "max_batch_size" in kwargs:
            kwargs["batch_size"] = kwargs.pop("max_batch_size")
        kwargs.setdefault("prefill_all_logits", on_cpu)
        nc = build_neuron_config(on_cpu=on_cpu, **kwargs)
        config = MiniMaxM3InferenceConfig(nc, load_config=load_m3_config(model))
        app = application(model, config)
        if on_cpu:
            _to_cpu(app)
        else:
            path = compiled_path or str(Path(model) / "neuron-compiled")
            if not (Path(path) / "model.pt").is_file():
                app.compile(path)
            app.load(path)
        return cls(app, config.m3_config())

    # ---- NxDI calls ------------------------------------------------------------------------------
    # no autograd: in CPU mode the weights require grad and the caches chain every step's graph (~250 MB
    # per tiny-model prefill kept alive, unbounded); on device the traced graph has none.
    @torch.no_grad()
    def _context(self, rows: Sequence[Sequence[int]], seq_ids: torch.Tensor) -> list[torch.Tensor]:
        """One context-encoding call writing cache rows ``seq_ids``; per row, the logits ``[L, V]`` of its every
        position (all-position builds) or ``[1, V]`` of its last token."""
        width = max(len(r) for r in rows)  # NxDI pads on to the smallest bucket that holds it
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        pos = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, : len(row)] = torch.tensor(row)
            pos[r, : len(row)] = torch.arange(len(row))
            mask[r, : len(row)] = 1
        self.app.reset()
        logits = self.app(input_ids=ids, attention_mask=mask, position_ids=pos, seq_ids=seq_ids).logits.float()
        if logits.shape[1] == 1:
            return list(logits)
        return [logits[r, : len(row)] for r, row in enumerate(rows)]

    def _prefill(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """Last-token logits ``[len(rows), V]`` of up to ``batch`` rows, row r written to cache row r: one call
        per row with continuous batching, one call for all (padded to ``batch``) without."""
        if self.continuous:
            out = [self._context([row], torch.tensor([r]))[0] for r, row in enumerate(rows)]
        else:
            padded = list(rows) + [rows[0]] * (self.batch - len(rows))
            out = self._context(padded, torch.arange(self.batch))[: len(rows)]
        return torch.stack([x[-1] for x in out])

    @torch.no_grad()
    def _decode(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.app(input_ids=tokens.view(-1, 1), position_ids=positions.view(-1, 1),
                       seq_ids=torch.arange(self.batch))
        return out.logits[:, -1].float()

    def _check(self, prompts, new_tokens: int = 0):
        if not prompts:
            raise EngineInputError("give at least one prompt")
        for p in prompts:
            if not 0 < len(p) <= self.ctx_len:
                raise EngineInputError(f"prompt length {len(p)} outside 1..{self.ctx_len} (max_context_length)")
            if len(p) + new_tokens > self.max_seq_len:
                raise EngineInputError(f"prompt ({len(p)}) + max_new_tokens ({new_tokens}) exceeds max_seq_len "
                                       f"{self.max_seq_len}")

    # ---- Engine protocol -------------------------------------------------------------------------
    def prefill_logits(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Teacher-forced prefill logits at every position: one prefill per prompt (per ``batch`` prompts with
        static batching) on a ``prefill_all_logits`` build."""
        self._check(prompts)
        if not self.app.neuron_config.prefill_all_logits:
            raise EngineInputError("this build's prefill returns the last position only; score prompts on a "
                                   "build with prefill_all_logits=True (minimax-m3 compile --all-logits)")
        if self.continuous:
            return [self._context([p], torch.tensor([0]))[0] for p in prompts]
        out: list[torch.Tensor] = []
        for i in range(0, len(prompts), self.batch):
            rows = list(prompts[i:i + self.batch])
            padded = rows + [rows[0]] * (self.batch - len(rows))
            out.extend(self._context(padded, torch.arange(self.batch))[: len(rows)])
        return out

    def generate(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig) -> list[GenerationResult]:
        """Greedy or sampled generation; each sequence gets the tokens it would get alone (sampling: one
        generator per sequence, seeded alike, as the reference backend)."""
        self._check(prompts, gen.max_new_tokens)
        results: list[GenerationResult | None] = [None] * len(prompts)
        waiting = deque(range(len(prompts)))
        slots: list[_Request | None] = [None] * self.batch
        while waiting or any(slots):
            self._admit(prompts, gen, waiting, slots)
            for r, req in enumerate(slots):
                reason = req.choose(gen) if req else None
                if reason:
                    results[req.index], slots[r] = req.result(reason, gen), None
            if not any(slots):
                continue
            idle = 1  # idle rows decode a dummy token at position 1 of their own cache row (never 0: prefill)
            feed = torch.tensor([req.tokens[-1] if req else 0 for req in slots])
            pos = torch.tensor([req.pos if req else idle for req in slots])
            logits = self._decode(feed, pos)
            for r, req in enumerate(slots):
                if req:
                    req.logits = logits[r]
        return results

    def _admit(self, prompts, gen: GenerationConfig, waiting: deque, slots: list) -> None:
        """Fill free slots with waiting prompts: every free slot, one prefill each (continuous batching), or a
        whole group once every slot is free (static batching)."""
        free = [r for r, req in enumerate(slots) if req is None]
        if not waiting or (not self.continuous and len(free) < self.batch):
            return
        take = [(r, waiting.popleft()) for r in free[: len(waiting)]]
        t0 = time.perf_counter()
        if self.continuous:
            for r, i in take:
                t1 = time.perf_counter()
                logits = self._context([prompts[i]], torch.tensor([r]))[0][-1]
                slots[r] = self._request(i, prompts[i], logits, gen, t1)
        else:
            logits = self._prefill([prompts[i] for _, i in take])
            for (r, i), row in zip(take, logits):
                slots[r] = self._request(i, prompts[i], row, gen, t0)

    @staticmethod
    def _request(i: int, prompt, logits: torch.Tensor, gen: GenerationConfig, t0: float) -> _Request:
        rng = None if gen.greedy else torch.Generator().manual_seed(0 if gen.seed is None else gen.seed)
        return _Request(i, list(prompt), logits, rng, t0, time.perf_counter() - t0)
