"""The reference backend as a step provider of the one generation loop (:class:`minimax_m3.engine.Engine`).

Static batching: a group of up to ``max_batch`` prompts is prefilled together (aligned at position 0, right-padded)
into a cache sized for the group; decode runs every row of the group, finished rows at a dummy position of their
own row, until the group is done and the next one is admitted.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .. import storage
from ..config import parallel
from ..config.m3 import M3Config
from ..engine.loop import Engine, EngineInputError
from ..engine.spec import EngineSpec
from .eagle3 import load_drafter
from .loader import load_model
from .model import M3Model
from .parallel import ShardPlan, init_distributed
from .speculative import Speculation

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


class ReferenceProvider:
    """Prefill and decode steps of an :class:`M3Model` (one group of sequences at a time) with the lengths, batch and
    tile of a validated ``spec``: each group's cache holds ``spec.max_seq_len`` positions, as the neuron backend's."""

    continuous = False
    _taps: tuple[int, ...] | None = None  # target layers whose input states a prefill keeps (a drafter's)

    def __init__(self, model: M3Model, spec: EngineSpec):
        """``spec.prefill_chunk``: tokens per prefill call (its default, ``ops.call_tokens``: 8192 rounded to whole
        blocks); a longer prompt is prefilled in calls of that many tokens, each attending to the cache the earlier
        calls wrote plus itself, so its working memory is one call's."""
        self.model = model
        self.config: M3Config = model.config
        self.device = model.lm_head.weight.device
        self.max_seq_len, self.max_context_len = spec.max_seq_len, spec.max_context_len
        self.max_batch, self.tile = spec.max_batch, spec.tile
        self.prefill_chunk = spec.resolve(self.config).prefill_chunk
        self._cache, self._rows, self._hidden = None, 0, None

    def _forward(self, prompts: list[list[int]], cache_len: int, all_logits: bool):
        """Prefill a batch aligned at position 0 (right-padded) into a new cache of ``cache_len`` positions, in
        calls of at most ``prefill_chunk`` tokens (each row's last logits come from the call holding its last
        token). With ``_taps``, the states entering those layers at every position are kept in ``_hidden``."""
        parallel.check_call(self.prefill_chunk, self.config.index_block_size)
        b, s = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros(b, s, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, :len(p)] = torch.tensor(p)
        ids = ids.to(self.device)
        positions = torch.arange(s, device=self.device).unsqueeze(0).expand(b, s)
        cache = self.model.new_cache(b, cache_len, tile=self.tile)
        last = torch.tensor([len(p) - 1 for p in prompts], device=self.device)
        out, taps, hidden = [], None if all_logits else self._taps, []
        for t0 in range(0, s, self.prefill_chunk):
            t1 = min(s, t0 + self.prefill_chunk)
            at = None if all_logits else (last - t0).clamp(0, t1 - t0 - 1)
            logits = self.model(ids[:, t0:t1], positions[:, t0:t1], cache, t1, decode=False, logits_at=at,
                                hidden_at=taps)
            if taps:
                logits, states = logits
                hidden.append(states)
            if all_logits or not out:
                out.append(logits)
            else:  # the rows whose last token is in this call
                here = ((last >= t0) & (last < t1)).view(b, 1, 1)
                out[0] = torch.where(here, logits, out[0])
        self._hidden = torch.cat(hidden, dim=1) if hidden else None
        return torch.cat(out, dim=1), cache

    def prefill(self, prompts: list[list[int]], slots: list[int], max_len: int) -> torch.Tensor:
        if slots != list(range(len(prompts))):
            raise EngineInputError(f"the reference backend prefills a whole group into slots 0..n-1, got {slots}")
        logits, self._cache = self._forward(prompts, self.max_seq_len, all_logits=False)  # the loop checked the fit
        self._rows = len(prompts)
        self._sync()
        return logits[:, 0]

    def decode(self, tokens: list[int], positions: list[int], slots: list[int]) -> torch.Tensor:
        ids, pos = [0] * self._rows, [0] * self._rows  # finished rows: a dummy token in their own row
        for t, p, r in zip(tokens, positions, slots):
            ids[r], pos[r] = t, p
        positions_t = torch.tensor(pos, device=self.device).unsqueeze(1)
        ids_t = torch.tensor(ids, device=self.device).unsqueeze(1)
        logits = self.model(ids_t, positions_t, self._cache, max(pos) + 1, decode=True)[:, 0]
        self._sync()
        return logits[torch.tensor(slots, device=self.device)]

    def prefill_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        logits, _ = self._forward(prompts, max(len(p) for p in prompts), all_logits=True)
        return [logits[i, :len(p)].float().cpu() for i, p in enumerate(prompts)]

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


class SpeculativeProvider(Speculation, ReferenceProvider):
    """A :class:`ReferenceProvider` that drafts with an EAGLE3 head and verifies (``reference/speculative.py``)."""


class ReferenceEngine(Engine):
    """The generation loop over a :class:`ReferenceProvider` (``engine.model`` is the torch model)."""

    def __init__(self, model: M3Model, max_seq_len: int = 4096, max_batch_size: int = 8, tile: int = 256,
                 spec: EngineSpec | None = None, prefill_chunk: int | None = None, drafter=None,
                 speculative_tokens: int | None = None):
        """``spec``: the validated spec the model was loaded for (:func:`load_reference`); without it (a model built
        by hand) the spec of the other arguments, validated against the model's config. ``drafter``: speculate with
        it (an :class:`~.eagle3.Eagle3Drafter`), ``speculative_tokens`` (default: the spec's) drafts per step."""
        if spec is None:
            w = model.lm_head.weight
            dtype = str(w.dtype).removeprefix("torch.")  # float64: models built by hand for exact comparisons
            spec = EngineSpec(model="", backend="reference", device=str(w.device), max_seq_len=max_seq_len,
                              dtype=dtype if dtype in DTYPES else None, max_batch=max_batch_size,
                              tile=tile, prefill_chunk=prefill_chunk).validate(model.config)
            spec = dataclasses.replace(spec, dtype=dtype)
        k = speculative_tokens or spec.num_speculative_tokens or 3
        provider = ReferenceProvider(model, spec) if drafter is None else SpeculativeProvider(model, spec, drafter, k)
        super().__init__(provider, spec)
        self.model, self.device, self.dtype = model, self.provider.device, model.lm_head.weight.dtype

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | None = None, dtype: str | torch.dtype | None = None,
                        max_seq_len: int = 4096, max_batch_size: int = 8, tile: int = 256,
                        plan: ShardPlan | None = None, prefill_chunk: int | None = None) -> "ReferenceEngine":
        """Keyword form of :func:`load_reference` (``path``: a checkpoint directory or ``s3://``, downloaded once).
        ``plan``: this rank's tensor/expert-parallel slice (every rank of the process group must then make the same
        calls with the same inputs)."""
        if isinstance(dtype, torch.dtype):
            dtype = str(dtype).removeprefix("torch.")
        path = storage.resolve(str(path))
        spec = EngineSpec(model=str(path), backend="reference", device=device, dtype=dtype, max_seq_len=max_seq_len,
                          max_batch=max_batch_size, tile=tile, prefill_chunk=prefill_chunk)
        return load_reference(spec, M3Config.from_pretrained(path), plan=plan)


def load_reference(spec: EngineSpec, config: M3Config, plan: ShardPlan | None = None) -> ReferenceEngine:
    """The reference engine of ``spec`` (a local checkpoint) over the model's parsed ``config`` (config.json is not
    read again), the spec validated against it first. Under ``torchrun`` (``WORLD_SIZE > 1``) without a ``plan``
    the process group is joined here with ``spec.ep`` (whose default is ``$MINIMAX_M3_EP``) and device None/"cuda"
    becomes this rank's GPU."""
    resolved = spec.validate(config)
    if plan is None and resolved.tp > 1:
        plan, rank_device = init_distributed(ep=resolved.ep)
        device = rank_device if spec.device in (None, "cuda") else spec.device
        resolved = dataclasses.replace(resolved, device=device)
    model = load_model(resolved.model, device=resolved.device, config=config, plan=plan,
                       dtype=resolve_dtype(resolved.dtype, resolved.device))
    drafter = None
    if resolved.draft:
        drafter = load_drafter(storage.resolve(resolved.draft, resolved.cache_dir), model)
    return ReferenceEngine(model, spec=resolved, drafter=drafter)
