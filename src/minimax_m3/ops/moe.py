"""Sigmoid router with selection-only correction bias, and routed experts with static shapes."""

import torch
import torch.nn.functional as F

from .mlp import swiglu_oai


def route(
    x: torch.Tensor, router_weight: torch.Tensor, correction_bias: torch.Tensor, top_k: int, ordered: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per token. Returns ``(weights [T, k] float32, experts [T, k] int64)``.

    Scores are ``sigmoid(x @ W^T)`` in float32; ``correction_bias`` only decides *which* experts win; the
    weights are the winners' plain scores renormalised to sum to 1. ``ordered``: the k experts by descending score
    (``torch.topk(sorted=True)``: torch-mlir lowers only that to StableHLO), else in the order the top-k op gives.
    """
    logits = F.linear(x.float(), router_weight.float())
    scores = torch.sigmoid(logits)
    _, experts = torch.topk(scores + correction_bias.float(), top_k, dim=-1, sorted=ordered)
    weights = scores.gather(-1, experts)
    return weights / weights.sum(dim=-1, keepdim=True), experts


def combine_matrix(weights: torch.Tensor, experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Dense ``[T, E]`` routing matrix: ``weights`` scattered to their experts, zero elsewhere."""
    out = torch.zeros(weights.shape[0], num_experts, dtype=weights.dtype, device=weights.device)
    return out.scatter_add(1, experts, weights)


def scaled(product: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A product with fp8 weights times their per-output-channel scale (``None``: weights in the activation dtype).
    The one home of the fp8 experts' rule (NxD's ``QuantizedExpertFused*``: the matmul's *output* times the fp32
    scale, ``checkpoint.fp8_experts``): in float32, rounded back to the product's dtype."""
    if scale is None:
        return product
    return (product.float() * scale.float()).to(product.dtype)


def _w(weight: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A weight in the activation's dtype: e4m3 experts are widened exactly (a graph reads their bytes)."""
    return weight if weight.dtype == like.dtype else weight.to(like.dtype)


def expert_ffn(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, alpha: float = 1.702, limit: float = 7.0,
    matmul=torch.matmul, gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """One expert on rows ``x [N, H]``; ``gate_up [H, 2I]`` (gate first), ``down [I, H]``.

    ``matmul`` lets a caller run the same formula through another product, e.g. a grouped matmul over
    tokens sorted by expert (then ``gate_up``/``down`` are ``[E, H, 2I]``/``[E, I, H]``). fp8 experts: e4m3
    ``gate_up``/``down`` with their ``[.., 1, 2I]`` / ``[.., 1, H]`` scales (:func:`scaled`)."""
    gate, up = scaled(matmul(x, _w(gate_up, x)), gate_up_scale).chunk(2, dim=-1)
    h = swiglu_oai(gate, up, alpha, limit)
    return scaled(matmul(h, _w(down, h)), down_scale)


def moe_all_experts(
    x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
    alpha: float = 1.702, limit: float = 7.0, gate_up_scale: torch.Tensor | None = None,
    down_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed-expert output ``[T, H]`` with static shapes: every expert runs on every token and the routing
    matrix zeroes what was not chosen. ``gate_up [E, H, 2I]``, ``down [E, I, H]`` (fp8: with their scales, as
    :func:`expert_ffn`). Exact, XLA-traceable, and O(E/k) more compute than needed: for decode-sized T, for graphs,
    and as the oracle of faster paths."""
    gate, upv = scaled(torch.einsum("th,ehi->eti", x, _w(gate_up, x)), gate_up_scale).chunk(2, dim=-1)
    h = swiglu_oai(gate, upv, alpha, limit)
    y = scaled(torch.einsum("eti,eih->eth", h, _w(down, h)), down_scale)
    comb = combine_matrix(weights, experts, gate_up.shape[0]).to(y.dtype)
    return torch.einsum("te,eth->th", comb, y)


# The static formulations' shapes (no sort, no grouped matmul: what a graph compiler lowers), one home: the
# reference's ``static`` strategy runs them, the planner sizes them (``planner.working.static_moe_bytes``).

def moe_block(rows: int, n_local: int) -> int:
    """Rows per block of the ``blocks`` formulation: the largest power of two <= rows / (4 x local experts), within
    8 .. 128, so the padding bound (one part-filled block per expert) stays about a quarter of the rows."""
    b = 8
    while b < 128 and 2 * b <= rows // (4 * n_local):
        b *= 2
    return b


def blocks_capacity(rows: int, n_local: int) -> tuple[int, int]:
    """(blocks, rows per block) the ``blocks`` formulation computes for ``rows`` (token, slot) rows: at most
    ``ceil(rows / block)`` full blocks plus one part-filled block per local expert, whatever the routing."""
    block = moe_block(rows, n_local)
    return -(-rows // block) + n_local, block


def static_strategy(t: int, k: int, n_local: int) -> str:
    """The ``static`` choice for a call of ``t`` tokens (a shape, so a compiled graph fixes it): ``gather`` while
    the ``t x k`` rows are no more than the local experts (each row reads only its expert), else whichever of
    ``dense`` (``t x E_local`` rows) and ``blocks`` (:func:`blocks_capacity`) computes fewer rows."""
    if t * k <= n_local:
        return "gather"
    n_blocks, block = blocks_capacity(t * k, n_local)
    return "dense" if t * n_local <= n_blocks * block else "blocks"
