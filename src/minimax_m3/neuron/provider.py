"""The :class:`minimax_m3.engine.Engine` protocol over ``NeuronMiniMaxM3ForCausalLM`` (compiled or ``to_cpu()``).

Shapes. A prefill call is as wide as its longest prompt (right padding, padding positions 0 so NxDI's
last-token pick ``argmax(position_ids)`` lands on each row's last real token); NxDI's ``ModelWrapper`` pads it on
to the smallest context-encoding bucket that holds it (``get_target_bucket``, first fit; NxDI's test is strict,
so a prompt exactly one bucket long takes the next bucket unless it is the largest). Buckets are on by default:
powers of two from 128 below ``max_context_length`` (or the prefill chunk, when shorter), and that length itself
(``spec.context_buckets``). A call wider than the prefill chunk (``spec.prefill_chunk``) is run by the application's
``forward`` as successive calls of at most one chunk (``neuron.chunk_loop.prefill_in_chunks``; vllm-neuron's
whole-prompt calls take the same loop), each reading the cache the earlier ones wrote.

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

from pathlib import Path
from typing import Sequence

import torch

from ..config.m3 import ConfigError, M3Config
from ..engine.loop import Engine, EngineInputError, GenerationConfig, StepOutput
from ..engine.speculative import HostDrafter
from ..engine.spec import EngineSpec, spec_from_kwargs
from . import sampling
from .build import application, inference_config
from .model import NeuronMiniMaxM3ForCausalLM
from .nxd_compat import to_cpu

def _tokens(out) -> torch.Tensor:
    """The token ids a call chose ``[B, n]``: NxDI's ``tokens``, or a fused-speculation build's accepted tokens
    (the first of its ``fused_outputs``, ``-1`` after each row's last)."""
    fused = getattr(out, "fused_outputs", None)
    tokens = fused[0] if fused is not None else out.tokens
    return tokens.reshape(tokens.shape[0], -1)


class NeuronProvider:
    """Prefill and decode steps of an NxDI application (compiled, or ``to_cpu()``), for the one generation loop."""

    def __init__(self, app: NeuronMiniMaxM3ForCausalLM, config: M3Config):
        self.app, self.config = app, config
        nc = app.neuron_config
        self.max_batch, self.max_context_len, self.max_seq_len = nc.batch_size, nc.max_context_length, nc.seq_len
        self.continuous = bool(nc.is_continuous_batching)
        self.odsc = nc.on_device_sampling_config  # sampling on the device: steps return token ids
        self.gen = GenerationConfig()

    def start(self, gen: GenerationConfig) -> None:
        """The settings every row samples with until the next ``generate`` (on-device sampling only)."""
        self.gen = gen

    def _sampling_params(self, n: int) -> dict:
        """``sampling_params`` of a call with ``n`` rows: every row draws with ``gen``'s settings at its own
        (seed, position); none without on-device sampling."""
        if self.odsc is None:
            return {}
        g = self.gen
        row = (g.top_k, g.top_p, g.temperature, 0 if g.seed is None else g.seed)
        return {"sampling_params": sampling.params([row] * n, self.odsc.global_topk)}

    def _step(self, out, rows: list[int]):
        """Logits ``[n, V]`` of ``rows`` (last position), or their on-device token ids (with the logits when the
        build outputs them)."""
        if self.odsc is None:
            return out.logits[:, -1].float()[rows]
        logits = out.logits[:, -1].float()[rows] if getattr(out, "logits", None) is not None else None
        return StepOutput(logits=logits, token_ids=out.tokens.reshape(-1)[rows])

    # no autograd: in CPU mode the weights require grad and the caches chain every step's graph (~250 MB
    # per tiny-model prefill kept alive, unbounded); on device the traced graph has none.
    @torch.no_grad()
    def _call(self, rows: Sequence[Sequence[int]], seq_ids: torch.Tensor):
        """One context-encoding call writing cache rows ``seq_ids``: per row, the logits ``[L, V]`` of its every
        position (all-position builds) or ``[1, V]`` of its last token (None when an on-device-sampling build
        outputs no logits), and the on-device token ids ``[rows]`` (None without on-device sampling)."""
        width = max(len(r) for r in rows)  # NxDI pads on to the smallest bucket that holds it
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        pos = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, : len(row)] = torch.tensor(row)
            pos[r, : len(row)] = torch.arange(len(row))
            mask[r, : len(row)] = 1
        self.app.reset()
        out = self.app(input_ids=ids, attention_mask=mask, position_ids=pos, seq_ids=seq_ids,
                       **self._sampling_params(len(rows)))
        self._states = getattr(out, "aux_states", None)  # a draft's target states, every position (with a draft)
        tokens = _tokens(out)[:, 0] if self.odsc is not None else None
        if getattr(out, "logits", None) is None:
            return [None] * len(rows), tokens
        logits = out.logits.float()
        if logits.shape[1] == 1:
            return list(logits), tokens
        return [logits[r, : len(row)] for r, row in enumerate(rows)], tokens

    def _static(self, rows: Sequence[Sequence[int]]):
        """One call for up to ``batch`` rows (padded to ``batch``), row r written to cache row r."""
        padded = list(rows) + [rows[0]] * (self.max_batch - len(rows))
        logits, tokens = self._call(padded, torch.arange(self.max_batch))
        return logits[: len(rows)], None if tokens is None else tokens[: len(rows)]

    def prefill(self, prompts: list[list[int]], slots: list[int], max_len: int = 0):
        """Last-token logits ``[n, V]`` (on-device sampling: a :class:`StepOutput` of the chosen ids): one call per
        prompt into its slot (continuous batching), or one call for the whole group into slots ``0..n-1``."""
        if self.continuous:
            calls = [self._call([row], torch.tensor([r])) for row, r in zip(prompts, slots)]
            logits = [c[0][0] for c in calls]
            tokens = None if self.odsc is None else torch.cat([c[1][:1] for c in calls])
        else:
            if slots != list(range(len(prompts))):
                raise EngineInputError(f"static batching prefills a whole group into slots 0..n-1, got {slots}")
            logits, tokens = self._static(prompts)
        last = None if logits[0] is None else torch.stack([x[-1] for x in logits])
        return last if self.odsc is None else StepOutput(logits=last, token_ids=tokens)

    @torch.no_grad()
    def decode(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        """Every cache row decodes (row r = slot r); idle rows a dummy token at position 1 of their own row (never
        0: prefill). Hook for on-device sampling: return a :class:`minimax_m3.engine.StepOutput` with token ids."""
        feed, pos = torch.zeros(self.max_batch, dtype=torch.long), torch.ones(self.max_batch, dtype=torch.long)
        feed[slots], pos[slots] = torch.tensor(tokens), torch.tensor(positions)
        out = self.app(input_ids=feed.view(-1, 1), position_ids=pos.view(-1, 1), seq_ids=torch.arange(self.max_batch),
                       **self._sampling_params(self.max_batch))
        return self._step(out, slots)

    def prefill_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Every position's logits: one prefill per prompt (per group with static batching) on a
        ``prefill_all_logits`` build."""
        if not self.app.neuron_config.prefill_all_logits:
            raise EngineInputError("this build's prefill returns the last position only; score prompts on a "
                                   "build with prefill_all_logits=True (minimax-m3 compile --all-logits)")
        if self.continuous:
            return [self._call([p], torch.tensor([0]))[0][0] for p in prompts]
        return self._static(prompts)[0]


class SpeculativeNeuronProvider(HostDrafter, NeuronProvider):
    """A :class:`NeuronProvider` of a build with a draft (``speculation_length = k + 1``: NxDI's context-encoding and
    speculation graphs, no one-token graph) speculating with a drafter on the host (an
    :class:`~minimax_m3.reference.eagle3.Eagle3Drafter`, or any object with its ``aux_layers``, ``reset``,
    ``extend`` and ``propose``): the one generation loop calls ``propose`` and ``accept`` (``engine.speculative.
    HostDrafter``) and ``verify``.

    ``verify`` is ONE call of the speculation graph for every cache row: row ``r`` feeds ``[last, drafts...]`` at its
    own positions ``p .. p + k`` (padding tokens after fewer drafts; idle rows a dummy step at positions ``1 ..``),
    which writes the ``k + 1`` cache entries and attends causally; the call also returns the target states the
    draft reads (``aux_states``). Entries past the accepted prefix are never read (every read is causal and the next
    verify writes its positions before it attends), so a verify step may write up to ``k`` positions past the last
    token: ``max_seq_len`` is the cache length less ``k``."""

    def __init__(self, app: NeuronMiniMaxM3ForCausalLM, config: M3Config, drafter):
        super().__init__(app, config)
        self.width = app.neuron_config.speculation_length  # k + 1: the build's verify graph fixes k
        if self.width < 2:
            raise EngineInputError(f"speculating needs a build with a draft (speculation_length >= 2, this one: "
                                   f"{self.width}): load the spec with its draft")
        self.drafter, self.speculative_tokens = drafter, self.width - 1
        self.max_seq_len = self.max_seq_len - self.speculative_tokens
        self._verified: dict[int, tuple[int, list[int], torch.Tensor | None]] = {}
        self._prompt_states: dict[int, torch.Tensor] = {}  # prefilled rows' target states, for the drafter

    def start(self, gen: GenerationConfig) -> None:
        super().start(gen)
        self.drafter.reset(self.max_batch, self.app.neuron_config.seq_len)

    def prefill(self, prompts: list[list[int]], slots: list[int], max_len: int = 0):
        self._prompt_states.clear()
        out = super().prefill(prompts, slots, max_len)
        for p, r in zip(prompts, slots):
            self.drafter.extend(r, 0, self._prompt_states.pop(r, None), p[1:])
        return out

    def _call(self, rows, seq_ids):
        out = super()._call(rows, seq_ids)  # also prefill_logits' calls: their states are dropped at the next prefill
        if self._states is not None:
            for i, (row, slot) in enumerate(zip(rows, seq_ids.tolist())):
                self._prompt_states.setdefault(slot, self._states[i, :len(row)].float())
        return out

    @torch.no_grad()
    def verify(self, slots: list[int], tokens: list[list[int]], positions: list[int]) -> list:
        """Per row: float32 logits ``[len(tokens[i]), vocab]`` of ``tokens[i]`` at ``positions[i] ..``, one call; with
        on-device sampling a :class:`StepOutput` of the token the device chose after each (at its own position's
        seeded draw, as plain decoding)."""
        n, w = self.max_batch, self.width
        ids = torch.zeros(n, w, dtype=torch.long)
        pos = (1 + torch.arange(w)).expand(n, w).clone()
        for r, toks, p in zip(slots, tokens, positions):
            ids[r, :len(toks)] = torch.tensor(toks)
            pos[r] = p + torch.arange(w)
        out = self.app(input_ids=ids, position_ids=pos, seq_ids=torch.arange(n), **self._sampling_params(n))
        states = getattr(out, "aux_states", None)
        for r, toks, p in zip(slots, tokens, positions):
            self._verified[r] = (p, toks, None if states is None else states[r].float())
        logits = out.logits.float() if getattr(out, "logits", None) is not None else None
        if self.odsc is None:
            return [logits[r, :len(toks)] for r, toks in zip(slots, tokens)]
        chosen = out.tokens.reshape(n, w)
        return [StepOutput(logits=None if logits is None else logits[r, :len(toks)], token_ids=chosen[r, :len(toks)])
                for r, toks in zip(slots, tokens)]


class FusedNeuronProvider(NeuronProvider):
    """A :class:`NeuronProvider` of a fused-speculation build (``neuron.eagle``: the EAGLE3 draft inside the graph):
    ``speculate`` is ONE call of NxDI's fused graph for every cache row, which drafts ``k`` tokens, verifies them
    with the target, accepts on the device and returns each row's emitted tokens (the accepted drafts and the
    target's token after them). The loop's other steps are :class:`NeuronProvider`'s (a prefill also primes the
    draft: NxDI runs both models' context encoding). As with the host drafter a step may write up to ``k``
    positions past the last token: ``max_seq_len`` is the cache length less ``k``."""

    def __init__(self, app: NeuronMiniMaxM3ForCausalLM, config: M3Config):
        super().__init__(app, config)
        self.speculative_tokens = app.neuron_config.speculation_length - 1
        self.max_seq_len = self.max_seq_len - self.speculative_tokens

    @torch.no_grad()
    def speculate(self, slots: list[int], lasts: list[int], positions: list[int]) -> list[list[int]]:
        """Per row: the tokens after ``lasts[i]`` (at ``positions[i]``) that one fused step emits (1 to ``k + 1``).
        Idle rows run a dummy step at position 1 of their own row (never 0: prefill)."""
        feed, pos = torch.zeros(self.max_batch, dtype=torch.long), torch.ones(self.max_batch, dtype=torch.long)
        feed[slots], pos[slots] = torch.tensor(lasts), torch.tensor(positions)
        out = self.app(input_ids=feed.view(-1, 1), position_ids=pos.view(-1, 1), seq_ids=torch.arange(self.max_batch),
                       **self._sampling_params(self.max_batch))
        accepted = _tokens(out).tolist()
        return [[t for t in accepted[r] if t >= 0] for r in slots]


class NeuronEngine(Engine):
    """The generation loop over a :class:`NeuronProvider` (``engine.app`` is the NxDI application)."""

    def __init__(self, app: NeuronMiniMaxM3ForCausalLM, config: M3Config, spec: EngineSpec | None = None,
                 drafter=None):
        if app.neuron_config.enable_fused_speculation:
            provider = FusedNeuronProvider(app, config)
        elif drafter is not None:
            provider = SpeculativeNeuronProvider(app, config, drafter)
        else:
            provider = NeuronProvider(app, config)
        super().__init__(provider, spec)
        self.app = app

    @classmethod
    def from_pretrained(cls, model: str, on_cpu: bool = False, **kwargs) -> "NeuronEngine":
        """Keyword form of :func:`load` (spec fields or their older NxDI-style names: ``tp_degree``...)."""
        spec = spec_from_kwargs(model, "neuron-cpu" if on_cpu else "neuron", **kwargs)
        return load(spec, M3Config.from_pretrained(spec.model))


def load(spec: EngineSpec, config: M3Config, compile_missing: bool = True, drafter=None) -> NeuronEngine:
    """The neuron engine of ``spec`` (validated here against the model's parsed ``config``; config.json is not read
    again): NxDI's CPU mode (``neuron-cpu``), or the NEFFs at ``spec.artifact_dir()`` (compiled there first when
    missing and ``compile_missing``). With ``spec.draft``, ``drafter`` drafts on the host (an
    :class:`~minimax_m3.reference.eagle3.Eagle3Drafter`: ``minimax_m3.load_engine`` builds it)."""
    if spec.draft and drafter is None and not spec.fused_speculation:
        raise EngineInputError(f"a spec with a draft ({spec.draft}) needs its drafter: load it with "
                               "minimax_m3.load_engine, which builds the host drafter")
    spec = spec.validate(config)
    app = application(spec.model, inference_config(spec, config))
    if spec.backend == "neuron-cpu":
        to_cpu(app)
    else:
        path = spec.artifact_dir()
        spec.check_artifact(path)
        if not (Path(path) / "model.pt").is_file():
            if not compile_missing:
                raise ConfigError([f"no compiled model at {path}: run `minimax-m3 compile` with the same options "
                                   "(or pass --compiled DIR)"], source="neuron")
            print(f"neuron: no compiled model at {path}; compiling it (minimax-m3 compile does this ahead of time)")
            app.compile(path)
            spec.write_artifact(path)
        app.load(path)
    return NeuronEngine(app, config, spec, drafter)
