"""On-device sampling with per-sequence seeds: only token ids leave the device.

NxDI's ``Sampler`` (``on_device_sampling_config``) draws from one device RNG for the whole batch (an HLO ``rng`` op
through ``rand_like``; ``torch.rand_like`` in CPU mode; ``deterministic=True`` fixes the uniform at 0.5), so a
sequence's tokens depend on its batch neighbours and on every earlier call; its top-p also drops the token that
crosses ``top_p`` (the reference keeps it) and masks with -3000 before dividing by the temperature.
:class:`SeededSampler` keeps NxDI's candidate search (its distributed top-``global_topk`` over the vocabulary
shards, ``nxd_topk``; the full-vocabulary gather then ``torch.topk`` in CPU mode) and greedy path (``nxd_argmax``)
and replaces the draw by :func:`minimax_m3.ops.seeded_sampling.draw_sorted` at a uniform hashed from the row's own
seed and the position of the token it follows: a sequence samples the same tokens alone or in any batch, with the
reference backend's filtering rules. It samples among the top ``global_topk`` tokens (NxDI's default 256):
``top_k = 0`` (no top-k) means those.

Inputs. ``sampling_params`` is ``[B, 5]`` float32: NxDI's ``top_k, top_p, temperature`` then the seed as two 16-bit
words (:func:`params`). The traced graphs take five columns (:class:`SeededModelWrapper`); a call without
``sampling_params`` gets NxDI's defaults and seed 0.

Outputs. ``out.tokens`` ``[B]`` int32 per call; ``out.logits`` too only when ``output_logits=True`` (tests,
golden). A build with ``on_device_sampling_config=OnDeviceSamplingConfig(do_sample=True, dynamic=True,
global_topk=256)`` (see :func:`on_device_sampling_config`) may also set NxDI's ``async_mode``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from neuronx_distributed_inference.models.config import OnDeviceSamplingConfig
from neuronx_distributed_inference.models.model_wrapper import ModelWrapper
from neuronx_distributed_inference.modules.generation.sampling import Sampler, validate_sampling_params

from ..ops.seeded_sampling import draw_sorted, seed_words, uniforms
from . import nxd_compat

SEED_COLUMNS = 2
WIDTH = 3 + SEED_COLUMNS


def on_device_sampling_config(do_sample: bool = True, global_topk: int = 256, **kw) -> OnDeviceSamplingConfig:
    """NxDI's config for this sampler: per-request parameters (``dynamic``, default ``do_sample``), sampling among
    ``global_topk``. A fused-speculation build passes ``do_sample=False, dynamic=True``: NxDI's fused model then
    takes the target's chosen tokens as they are (greedy acceptance) and this sampler draws them, seeded."""
    kw.setdefault("dynamic", do_sample)
    return OnDeviceSamplingConfig(do_sample=do_sample, global_topk=global_topk, **kw)


def params(rows: Sequence[tuple[int, float, float, int | None]], global_topk: int) -> torch.Tensor:
    """``[B, 5]`` sampling params from ``(top_k, top_p, temperature, seed)`` per row, in the engine's terms:
    ``top_k = 0`` is no top-k (``global_topk`` candidates), ``temperature = 0`` greedy, seed None is 0."""
    out = torch.zeros(len(rows), WIDTH, dtype=torch.float32)
    for r, (top_k, top_p, temperature, seed) in enumerate(rows):
        lo, hi = seed_words(0 if seed is None else seed)
        out[r] = torch.tensor([min(top_k, global_topk) if top_k > 0 else global_topk, top_p, temperature, lo, hi])
    return out


def widen(sampling_params: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    """NxDI's three-column params (or its defaults when None) with seed 0 appended; five columns pass through."""
    sp = default if sampling_params is None else sampling_params
    if sp.shape[-1] == WIDTH:
        return sp
    return torch.cat([sp.float(), torch.zeros(sp.shape[0], WIDTH - sp.shape[-1])], dim=1)


def validate(sp: torch.Tensor, config: OnDeviceSamplingConfig) -> None:
    """NxDI's checks on the first three columns; the seed words integers in [0, 2^16). One ValueError."""
    if sp.dim() != 2 or sp.shape[1] != WIDTH:
        raise ValueError(f"sampling_params must be [batch, {WIDTH}] (top_k, top_p, temperature, seed_lo, seed_hi: "
                         f"minimax_m3.neuron.sampling.params), got {list(sp.shape)}")
    validate_sampling_params(sp[:, :3], config)
    seeds = sp[:, 3:].float()
    if not (torch.equal(seeds, seeds.floor()) and bool(((seeds >= 0) & (seeds < 65536)).all())):
        raise ValueError("sampling_params seed columns must be integers in [0, 65536) (the two 16-bit words of "
                         "minimax_m3.ops.seeded_sampling.seed_words)")


class SeededSampler(Sampler):
    """NxDI's ``Sampler`` with the per-row seeded draw; greedy builds (``do_sample=False``) use NxDI's argmax."""

    def forward(self, token_logits, sampling_params, return_values=False, rank_id=None, positions=None):
        if not (self.do_sample or self.dynamic) or positions is None:
            return super().forward(token_logits, sampling_params[:, :3], return_values, rank_id)
        dim = token_logits.dim() - 1
        values, ids = nxd_compat.sampler_global_top_k(self, token_logits, dim, rank_id)
        u = uniforms(sampling_params[:, 3], sampling_params[:, 4], positions)
        idx = draw_sorted(values, sampling_params[:, 2], sampling_params[:, 0], sampling_params[:, 1], u)
        return torch.gather(ids, dim, idx[:, None].to(ids.dtype)).reshape(-1)


def create_m3_sampler(neuron_config, lm_head_tp_degree=None):
    """The port's sampler for an ``on_device_sampling_config`` build."""
    odsc = neuron_config.on_device_sampling_config
    if (odsc.do_sample or odsc.dynamic) and odsc.global_topk <= 0:
        raise ValueError(f"on_device_sampling_config.global_topk must be > 0 (got {odsc.global_topk}): the seeded "
                         "sampler draws among the top global_topk tokens of the whole vocabulary (NxDI's default 256)")
    return SeededSampler(neuron_config)


class SeededModelWrapper(ModelWrapper):
    """NxDI's ``ModelWrapper`` whose example inputs carry :data:`WIDTH` sampling-param columns (the traced graphs
    take the seed words)."""

    def input_generator(self):
        def seeded(sp):
            return torch.cat([sp, torch.zeros(sp.shape[0], WIDTH - sp.shape[1], dtype=sp.dtype)], dim=1)

        return [nxd_compat.map_example_sampling_params(inputs, seeded) for inputs in super().input_generator()]
