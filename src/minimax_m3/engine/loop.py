"""The backend-neutral engine: generation settings and results, the step-provider contract every backend
implements, and :class:`Engine`, the ONE generation loop for every backend.

A backend is a *step provider*: it prefills prompts into cache slots and decodes one token for a set of slots,
returning logits (or, with on-device sampling, chosen token ids). The loop here does everything else the same way
on every backend: input checks, batching and continuous admission into free slots, per-sequence seeded sampling,
EOS and stop sequences, ``return_logits`` and the timing fields. :func:`load_engine` builds an engine from an
:class:`~minimax_m3.engine.spec.EngineSpec` (in :mod:`minimax_m3.load`, the one module that knows every backend).

A provider that speculates (``speculative_tokens`` > 0: it drafts k tokens and verifies them in one target forward)
is driven by the same loop: a step drafts, verifies and appends every accepted token plus the one after them, each
through the same stop rules; the choices are :mod:`.speculative`'s (greedy: plain greedy's tokens; sampling:
speculative sampling, plain sampling's distribution, every draw a function of the sequence's seed and position).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol, Sequence, Union

import torch

from .. import ops
from ..config.m3 import M3Config
from ..errors import M3Error
from . import speculative
from .spec import BACKENDS, EngineSpec

__all__ = ["BACKENDS", "Engine", "EngineInputError", "EngineSpec", "GenerationConfig", "GenerationResult",
           "SPEC_TIMING_KEYS", "StepOutput", "StepProvider", "TIMING_KEYS", "unpad"]

# every result's ``timings`` has exactly these keys, on every backend (seconds; ``decode_step_s`` a list)
TIMING_KEYS = ("queue_s", "prefill_s", "ttft_s", "decode_step_s", "total_s")
# with speculative decoding also these (``decode_step_s`` then has one entry per verify step): verify steps, draft
# tokens proposed and accepted, and the mean acceptance length (tokens per verify step: 1 + accepted / steps)
SPEC_TIMING_KEYS = ("spec_steps", "draft_tokens", "accepted_tokens", "acceptance_length")


class EngineInputError(M3Error, ValueError):
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
    timings: dict = field(default_factory=dict)  # TIMING_KEYS


@dataclass
class StepOutput:
    """What a provider's step returns when it does not return plain logits: ``token_ids`` ``[n]`` chosen on the
    device (the loop samples nothing) and/or ``logits`` ``[n, vocab]``."""

    logits: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None


Step = Union[torch.Tensor, StepOutput]


class StepProvider(Protocol):
    """A backend, as the generation loop drives it. Rows of every call are in the order of ``slots``."""

    config: M3Config
    max_batch: int  # cache slots (sequences decoded together)
    max_seq_len: int  # prompt + generated tokens per sequence
    max_context_len: int  # the longest prompt one prefill takes
    continuous: bool  # True: any free slot takes a new prompt; False: a new group only when every slot is free

    def prefill(self, prompts: list[list[int]], slots: list[int], max_len: int) -> Step:
        """Prefill ``prompts`` into cache ``slots`` (static providers: ``slots == range(len(prompts))``, a new
        group); ``max_len``: the most tokens any of them reaches. Last-position logits ``[n, vocab]``."""
        ...

    def decode(self, tokens: list[int], positions: list[int], slots: list[int]) -> Step:
        """One step: token ``tokens[i]`` at ``positions[i]`` of slot ``slots[i]`` (other slots idle). ``[n, vocab]``."""
        ...

    def prefill_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Teacher-forced logits at every position, up to ``max_batch`` prompts: float32 ``[len, vocab]`` each."""
        ...

    # Optional: ``start(gen)``, called once per ``generate`` before any step, for a provider that samples on the
    # device (it then returns :class:`StepOutput` token ids drawn with ``gen``'s settings and seed).
    # Optional, speculative decoding: ``speculative_tokens`` (k > 0) and
    #   ``propose(slots, lasts, positions, ks, choose) -> drafts``: ``ks[i]`` draft tokens per row after the token
    #       ``lasts[i]`` at ``positions[i]``, each picked by ``choose(i, j, logits) -> id``;
    #   ``verify(slots, tokens, positions) -> [logits [len(tokens[i]), vocab]]``: one target forward per row over
    #       ``tokens[i]`` placed at ``positions[i] ..`` (row j: the logits after ``tokens[i][j]``), or per row a
    #       :class:`StepOutput` of the tokens the device chose there (``token_ids [len(tokens[i])]``);
    #   ``accept(slots, accepted)``: row i kept ``accepted[i]`` drafts of the last verify;
    #   or, drafting and verifying in one device call, ``speculate(slots, lasts, positions) -> [tokens]``: per row
    #       the tokens emitted after ``lasts[i]`` (the accepted drafts of ``speculative_tokens``, then the target's).


@dataclass
class _Sequence:
    index: int
    prompt: list[int]
    rng: torch.Generator | None
    queue_s: float
    prefill_s: float = 0.0
    ttft_s: float | None = None
    logits: torch.Tensor | None = None  # the pending step's logits (or None with on-device sampling)
    token: int | None = None  # the pending step's id chosen on the device
    pending: bool = False  # a step's output waits to be chosen from
    tokens: list[int] = field(default_factory=list)
    kept: list[torch.Tensor] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    seed: int | None = None  # speculative sampling: the counter-based draws' seed (``rng`` is then None)
    spec: list[int] | None = None  # speculating: [verify steps, draft tokens, accepted drafts]

    @property
    def pos(self) -> int:  # where the last chosen token goes in decode
        return len(self.prompt) + len(self.tokens) - 1


class Engine:
    """The one generation loop over a :class:`StepProvider`. ``max_seq_len`` bounds prompt + generated tokens."""

    def __init__(self, provider: StepProvider, spec: EngineSpec | None = None):
        self.provider, self.spec = provider, spec
        self.config: M3Config = provider.config
        self.speculative_tokens = int(getattr(provider, "speculative_tokens", 0) or 0)

    @property
    def max_seq_len(self) -> int:
        return self.provider.max_seq_len

    @property
    def max_batch_size(self) -> int:
        return self.provider.max_batch

    # ---- input checks (the same on every backend) ------------------------------------------------------------
    def check(self, prompts: Sequence[Sequence[int]], new_tokens: int = 0) -> list[list[int]]:
        if len(prompts) == 0:
            raise EngineInputError("no prompts given")
        p_max, s_max, vocab = self.provider.max_context_len, self.max_seq_len, self.config.vocab_size
        out = []
        for i, p in enumerate(prompts):
            p = [int(t) for t in p]
            if not p:
                raise EngineInputError(f"prompt {i} is empty; give at least one token (e.g. the BOS id)")
            bad = [t for t in p if not 0 <= t < vocab]
            if bad:
                raise EngineInputError(f"prompt {i} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}")
            if len(p) > p_max:
                raise EngineInputError(f"prompt {i} has {len(p)} tokens, more than max_context_len={p_max}, the "
                                       "longest prompt this engine prefills. Shorten it or raise --max-context-len")
            if len(p) + new_tokens > s_max:
                raise EngineInputError(
                    f"prompt {i} has {len(p)} tokens; with {new_tokens} new tokens that exceeds max_seq_len="
                    f"{s_max}. Shorten the prompt or raise max_seq_len (--max-seq-len)")
            out.append(p)
        return out

    # ---- the Engine interface ---------------------------------------------------------------------------------
    def prefill_logits(self, prompts: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Teacher-forced logits at every prompt position: one float32 ``[len(prompt), vocab]`` per prompt."""
        prompts, b = self.check(prompts), self.provider.max_batch
        out: list[torch.Tensor] = []
        for s in range(0, len(prompts), b):
            out.extend(x.float() for x in self.provider.prefill_logits(prompts[s:s + b]))
        return out

    def generate(self, prompts: Sequence[Sequence[int]], gen: GenerationConfig) -> list[GenerationResult]:
        """Generate for every prompt; each sequence gets exactly the tokens it would get alone (sampling: one
        generator per sequence, seeded with ``gen.seed``)."""
        prompts = self.check(prompts, gen.max_new_tokens)
        start = getattr(self.provider, "start", None)
        if start is not None:
            start(gen)
        t0 = time.perf_counter()
        results: list[GenerationResult | None] = [None] * len(prompts)
        waiting = deque(range(len(prompts)))
        slots: list[_Sequence | None] = [None] * self.provider.max_batch
        while waiting or any(slots):
            self._admit(prompts, gen, waiting, slots, t0)
            for r, seq in enumerate(slots):
                if seq is None or not seq.pending:
                    continue
                reason = self._choose(seq, gen, t0)
                if reason:
                    results[seq.index], slots[r] = self._result(seq, reason, gen, t0), None
            if self._can_admit(waiting, slots):
                continue  # fill the freed slots before the next decode step
            active = [r for r, seq in enumerate(slots) if seq is not None]
            if not active:
                continue
            if self.speculative_tokens:
                self._speculate(active, slots, results, gen, t0)
                continue
            t1 = time.perf_counter()
            out = self.provider.decode([slots[r].tokens[-1] for r in active], [slots[r].pos for r in active], active)
            dt = time.perf_counter() - t1
            for i, r in enumerate(active):
                self._receive(slots[r], out, i)
                slots[r].step_s.append(dt)
        return results

    # ---- the loop's parts -------------------------------------------------------------------------------------
    def _admit(self, prompts, gen: GenerationConfig, waiting: deque, slots: list, t0: float) -> None:
        """Fill free slots with waiting prompts: each free slot with its own prefill (continuous), or a whole group
        in one prefill once every slot is free (static)."""
        if not self._can_admit(waiting, slots):
            return
        free = [r for r, seq in enumerate(slots) if seq is None]
        take = [(r, waiting.popleft()) for r in free[:len(waiting)]]
        groups = [[t] for t in take] if self.provider.continuous else [take]
        for group in groups:
            rows = [prompts[i] for _, i in group]
            t1 = time.perf_counter()
            out = self.provider.prefill(rows, [r for r, _ in group], max(map(len, rows)) + gen.max_new_tokens)
            dt = time.perf_counter() - t1
            for k, (r, i) in enumerate(group):
                rng, seed = None, None
                if not gen.greedy and self.speculative_tokens:
                    seed = 0 if gen.seed is None else gen.seed
                elif not gen.greedy:
                    device = out.logits.device if isinstance(out, StepOutput) and out.logits is not None else \
                        out.device if isinstance(out, torch.Tensor) else "cpu"
                    rng = torch.Generator(device=device).manual_seed(0 if gen.seed is None else gen.seed)
                slots[r] = _Sequence(i, prompts[i], rng, queue_s=t1 - t0, prefill_s=dt, seed=seed,
                                     spec=[0, 0, 0] if self.speculative_tokens else None)
                self._receive(slots[r], out, k)

    def _can_admit(self, waiting: deque, slots: list) -> bool:
        free = sum(seq is None for seq in slots)
        return bool(waiting) and free > 0 and (self.provider.continuous or free == len(slots))

    @staticmethod
    def _receive(seq: _Sequence, out: Step, row: int) -> None:
        seq.pending = True
        if isinstance(out, StepOutput):
            seq.logits = None if out.logits is None else out.logits[row]
            seq.token = None if out.token_ids is None else int(out.token_ids[row])
        else:
            seq.logits, seq.token = out[row], None

    @staticmethod
    def _choose(seq: _Sequence, gen: GenerationConfig, t0: float) -> str | None:
        """Pick the next token of ``seq``; the finish reason once done, else None."""
        seq.pending = False
        if seq.token is not None:  # chosen on the device
            tok = seq.token
        elif seq.logits is None:
            raise EngineInputError("the backend returned neither logits nor token ids")
        elif gen.greedy:
            tok = int(seq.logits.argmax())
        elif seq.seed is not None:
            tok = speculative.sample_at(seq.logits, gen, seq.seed, seq.pos + 1)
        else:
            tok = int(ops.sample(seq.logits[None], gen.temperature, gen.top_k, gen.top_p, seq.rng)[0])
        return Engine._append(seq, tok, gen, t0)

    @staticmethod
    def _append(seq: _Sequence, tok: int, gen: GenerationConfig, t0: float) -> str | None:
        """Add ``tok`` (chosen from ``seq.logits``) to ``seq``; the finish reason once done, else None."""
        if gen.return_logits:
            if seq.logits is None:
                raise EngineInputError("return_logits needs logits, but this engine samples on the device "
                                       "(on_device_sampling): load it without on-device sampling to keep logits")
            seq.kept.append(seq.logits.float().cpu())
        seq.tokens.append(tok)
        if seq.ttft_s is None:
            seq.ttft_s = time.perf_counter() - t0
        if tok in gen.eos_token_ids:
            return "eos"
        if any(s and tuple(seq.tokens[-len(s):]) == tuple(s) for s in gen.stop_sequences):
            return "stop"
        return "length" if len(seq.tokens) == gen.max_new_tokens else None

    def _speculate(self, active: list[int], slots: list, results: list, gen: GenerationConfig, t0: float) -> None:
        """One speculative step of the ``active`` slots: draft, verify in one target forward per row, append the
        accepted drafts and the token after them (fewer drafts where fewer tokens remain to generate)."""
        p, seqs = self.provider, [slots[r] for r in active]
        t1 = time.perf_counter()
        lasts, positions = [s.tokens[-1] for s in seqs], [s.pos for s in seqs]
        if hasattr(p, "speculate"):  # drafted, verified and accepted in one device call (k drafts per row)
            emitted = p.speculate(active, lasts, positions)
            steps = [(self.speculative_tokens, len(e) - 1, e, None) for e in emitted]
        else:
            ks = [min(self.speculative_tokens, gen.max_new_tokens - len(s.tokens) - 1) for s in seqs]
            qs: list[list] = [[] for _ in seqs]

            def choose(i: int, j: int, logits: torch.Tensor) -> int:
                tok, q = speculative.propose(logits, gen, seqs[i].seed, seqs[i].pos + 1 + j)
                qs[i].append(q)
                return tok

            drafts = p.propose(active, lasts, positions, ks, choose)
            verified = p.verify(active, [[t] + d for t, d in zip(lasts, drafts)], positions)
            # per row: logits [k + 1, vocab], or a StepOutput whose token_ids the device chose (on-device sampling)
            outcome = [speculative.verify_chosen(v.token_ids.tolist(), d) if isinstance(v, StepOutput) else
                       speculative.verify(v, d, q, gen, s.seed, s.pos + 1)
                       for v, d, q, s in zip(verified, drafts, qs, seqs)]
            p.accept(active, [a for a, _ in outcome])
            steps = [(len(d), a, d[:a] + [tok], v.logits if isinstance(v, StepOutput) else v)
                     for d, v, (a, tok) in zip(drafts, verified, outcome)]
        dt = time.perf_counter() - t1
        for r, seq, (drafted, a, tokens, lg) in zip(active, seqs, steps):
            seq.step_s.append(dt)
            seq.spec = [seq.spec[0] + 1, seq.spec[1] + drafted, seq.spec[2] + a]
            for j, t in enumerate(tokens):
                seq.logits = None if lg is None else lg[j]
                reason = self._append(seq, t, gen, t0)
                if reason:
                    results[seq.index], slots[r] = self._result(seq, reason, gen, t0), None
                    break

    @staticmethod
    def _result(seq: _Sequence, reason: str, gen: GenerationConfig, t0: float) -> GenerationResult:
        timings = {"queue_s": seq.queue_s, "prefill_s": seq.prefill_s, "ttft_s": seq.ttft_s,
                   "decode_step_s": seq.step_s, "total_s": time.perf_counter() - t0}
        if seq.spec is not None:
            steps, drafted, accepted = seq.spec
            timings.update(spec_steps=steps, draft_tokens=drafted, accepted_tokens=accepted,
                           acceptance_length=(steps + accepted) / steps if steps else None)
        return GenerationResult(tokens=seq.tokens, finish_reason=reason, prompt_len=len(seq.prompt),
                                step_logits=torch.stack(seq.kept) if gen.return_logits else None, timings=timings)


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
