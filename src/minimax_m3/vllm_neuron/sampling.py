"""On-device sampling of the vLLM Neuron model: vllm-neuron 1.x's contract, the draw of ``ops.seeded_sampling``.

The contract (``jinhuang12/vllm-neuron`` at ``ed3580d``, version 0.24.0.1.1.0):
``neuron_config.on_device_sampling_config`` (``model/neuron_config.py`` ``OnDeviceSamplingConfig``: ``all_greedy``,
``max_top_k`` 256, ``deterministic``, ``sampling_dp_degree`` 1, ``capture_topk``; absent means on, ``null`` means
host sampling) switches it on; the runner then passes ``sampling_params`` float32 ``[rows, 3]`` = (top_k, top_p,
temperature) per request, padded with zero rows (``build_sampling_params_tensor``; top_k <= 0 off, temperature below
1e-5 greedy) and, with structured outputs, a bool ``logit_mask [rows, vocab]``; the forward returns ``(sampled int32
[rows], logits)`` (``(sampled, target states, logits)`` with EAGLE3 taps), and the runner takes the ids as the
step's tokens and the logits for logprobs only (``vllm_neuron/model/llama3/model.py``, ``neuron_model_runner.py``
``_sample``).

The draw: the top ``max_top_k`` candidates by logit, then :func:`minimax_m3.ops.seeded_sampling.draw_sorted` (the
NxDI port's on-device draw too: divide by the temperature, keep the first ``top_k``, keep the smallest prefix whose
mass reaches ``top_p``, vLLM's semantics, then the inverse CDF) at one uniform per row —
``torch.rand`` (the plugin's draw: one device stream, no per-request seed; a request's ``seed`` is not honoured on
device, serve with ``on_device_sampling_config`` null for seeded sampling), or 0.5 with ``deterministic``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ops.seeded_sampling import draw_sorted

GREEDY_BELOW = 1e-5  # the plugin's _SAMPLING_EPS: a temperature below it samples greedily
FIELDS = ("all_greedy", "max_top_k", "deterministic", "sampling_dp_degree", "capture_topk")


@dataclass(frozen=True)
class OnDeviceSampling:
    """The fields of the plugin's ``OnDeviceSamplingConfig`` this model honours."""

    all_greedy: bool = False
    max_top_k: int = 256
    deterministic: bool = False


def _fields(raw) -> dict:
    if isinstance(raw, dict):
        return dict(raw)
    return {k: getattr(raw, k) for k in FIELDS if hasattr(raw, k)}


def config_problems(raw) -> list[str]:
    """What in a neuron config's ``on_device_sampling_config`` this model cannot do (None: host sampling, fine)."""
    if raw is None:
        return []
    f, out = _fields(raw), []
    unknown = sorted(set(f) - set(FIELDS))
    if unknown:
        out.append(f"on_device_sampling_config: unknown field(s) {unknown}; known: {list(FIELDS)}")
    top = f.get("max_top_k", 256)
    if not isinstance(top, int) or isinstance(top, bool) or top < 1:
        out.append(f"on_device_sampling_config.max_top_k {top!r}: a positive number of candidates (default 256)")
    if f.get("sampling_dp_degree", 1) != 1:
        out.append(f"on_device_sampling_config.sampling_dp_degree {f['sampling_dp_degree']!r}: this model samples "
                   "on every rank of its tensor-parallel group; leave it 1")
    if f.get("capture_topk"):
        out.append("on_device_sampling_config.capture_topk: not served by this model; leave it false")
    return out


def config(raw) -> OnDeviceSampling | None:
    """The model's sampler for a neuron config's ``on_device_sampling_config`` (None: host sampling). Call
    :func:`config_problems` first."""
    if raw is None:
        return None
    f = _fields(raw)
    return OnDeviceSampling(all_greedy=bool(f.get("all_greedy", False)), max_top_k=int(f.get("max_top_k", 256)),
                            deterministic=bool(f.get("deterministic", False)))


def sample(logits: torch.Tensor, sampling_params: torch.Tensor | None, cfg: OnDeviceSampling,
           logit_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Token ids int32 ``[rows]`` from ``logits [rows, vocab]`` and the runner's ``sampling_params [rows, 3]``
    (None: every row greedy); ``logit_mask`` (bool, True = allowed) removes tokens first. Static shapes throughout
    (``topk``, elementwise, ``cumsum``): what a captured graph holds."""
    x = logits.float()
    if logit_mask is not None:
        x = x.masked_fill(~logit_mask.bool(), float("-inf"))
    if cfg.all_greedy or sampling_params is None:
        return x.argmax(dim=-1).to(torch.int32)
    sp = sampling_params.float()
    top_k, top_p, temperature = sp[:, 0].to(torch.int64), sp[:, 1], sp[:, 2]
    temperature = torch.where(temperature < GREEDY_BELOW, torch.zeros_like(temperature), temperature)
    values, ids = torch.topk(x, min(cfg.max_top_k, x.shape[-1]), dim=-1)
    rows = x.shape[0]
    u = torch.full((rows,), 0.5, device=x.device) if cfg.deterministic else torch.rand(rows, device=x.device)
    idx = draw_sorted(values, temperature, top_k, top_p, u)
    return ids.gather(-1, idx[:, None]).squeeze(-1).to(torch.int32)


def verify(logits: torch.Tensor, tokens: torch.Tensor, real: torch.Tensor, sampling_params: torch.Tensor | None,
           cfg: OnDeviceSampling, logit_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A verify step's tokens on the device, ``(sampled int32 [rows, 1 + k]`` — the accepted drafts and the target's
    token after them, ``-1`` after it — ``, the last of them int32 [rows])``: the plugin's ODS + EAGLE3 return.

    ``tokens [rows, 1 + k]``: each row's last token and its drafts; ``logits [rows * (1 + k), vocab]`` at each of them;
    ``real`` (bool, like ``tokens``): False where the runner padded a draft slot. The rule is
    ``engine.speculative.verify_chosen``'s, vectorised: the target chooses its own token at every position
    (:func:`sample`, the request's ``sampling_params`` row and ``logit_mask`` row on each of its tokens), and the
    drafts equal to those choices are kept up to the first that is not; so every emitted token is the one plain
    decoding chooses there (greedy: plain greedy's token for token; sampled: plain sampling's distribution, each
    position drawn once)."""
    rows, k1 = tokens.shape

    def each_token(x):  # a row's tensor on each of its tokens (expand + reshape: what torch-mlir lowers)
        return x[:, None].expand(rows, k1, *x.shape[1:]).reshape(rows * k1, *x.shape[1:])

    per_token = None if sampling_params is None else each_token(sampling_params)
    mask = logit_mask if logit_mask is None or logit_mask.shape[0] != rows else each_token(logit_mask)
    chosen = sample(logits, per_token, cfg, mask).view(rows, k1).to(torch.int64)
    agree = (chosen[:, :-1] == tokens[:, 1:].to(torch.int64)) & real[:, 1:]
    run = torch.arange(1, k1, device=logits.device).view(1, k1 - 1)
    accepted = (agree.to(torch.int64).cumsum(dim=1) == run).sum(dim=1)  # drafts kept: up to the first disagreement
    keep = torch.arange(k1, device=logits.device).view(1, k1) <= accepted.view(rows, 1)
    out = torch.where(keep, chosen, torch.full_like(chosen, -1)).to(torch.int32)
    return out, chosen.gather(1, accepted.view(rows, 1)).view(rows).to(torch.int32)


__all__ = ["GREEDY_BELOW", "OnDeviceSampling", "config", "config_problems", "sample", "verify"]
