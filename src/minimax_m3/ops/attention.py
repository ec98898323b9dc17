"""Softmax attention pieces: GQA attention with boolean keep masks (True = attend), and a rank's partial softmax
with the log-sum-exp merge of a KV group's partials.

Queries ``[B, Hq, T, D]``, keys/values ``[B, Hkv, S, D]``; query head ``h`` belongs to KV group
``h // (Hq / Hkv)``. Masks are per KV group ``[B, G, T, S]`` or shared ``[B, 1, T, S]``. The attention step of a
decoder layer is :func:`minimax_m3.ops.step.attention_step`; :func:`masked_attention` serves the EAGLE3 draft and
the reference's FlexAttention checks.
"""

import torch
import torch.nn.functional as F

from .indexer import FEW_ROWS


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor, scale: float,
                     sdpa: bool = False):
    """Softmax attention of ``q [B, Hq, T, D]`` over ``k, v [B, Hkv, S, D]`` where ``keep [B, G|1, T, S]``.

    Scores are computed in the inputs' dtype and the softmax in float32 (like transformers' eager path).
    ``sdpa=True`` runs the same attention through ``F.scaled_dot_product_attention`` (one fused kernel on CPU and
    CUDA; float32: equal up to rounding, tested; bfloat16 accumulates in float32 inside the kernel). The plain
    formula stays the default: it is what the Neuron graph traces. Decode-sized row counts (``r * t <= FEW_ROWS``)
    put the keys on the left of the score product (see ``indexer.FEW_ROWS``). Every query row must keep at least
    one key.
    """
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    r = hq // hkv
    qg = q.reshape(b, hkv, r * t, d)  # a group's query heads stacked as rows: K/V are read once, never copied
    if sdpa:
        g = keep.shape[1]  # decode (t == 1): the mask broadcasts over a group's query rows as it is
        mask = keep if t == 1 else keep.unsqueeze(2).expand(b, g, r, t, s).reshape(b, g, r * t, s)
        return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=scale).view(b, hq, t, d)
    if r * t <= FEW_ROWS:  # decode-sized: keys on the left
        scores = (torch.matmul(k, qg.transpose(-1, -2)).transpose(-1, -2) * scale).view(b, hkv, r, t, s)
    else:
        scores = (torch.matmul(qg, k.transpose(-1, -2)) * scale).view(b, hkv, r, t, s)
    scores = scores.float().masked_fill(~keep.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, hkv, r * t, s)
    return torch.matmul(probs, v).view(b, hq, t, d)


def causal_keep(q_pos: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``[B, 1, T, num_keys]``: key position ``t <= p`` for query position ``p``."""
    k_pos = torch.arange(num_keys, device=q_pos.device).view(1, 1, 1, num_keys)
    return k_pos <= q_pos.view(q_pos.shape[0], 1, q_pos.shape[1], 1)


# ---- a rank's share of the softmax and the group's merge (``step.attention_step``) ---------------------------


def partial_softmax(scores: torch.Tensor, keep: torch.Tensor):
    """Probabilities over this rank's keys, with their max and sum (float32); a row without a key: all zero,
    max ``-inf``, sum 0 (its weight in :func:`combine_weights` is 0)."""
    s = scores.float().masked_fill(~keep, float("-inf"))
    top = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - torch.where(top == float("-inf"), 0.0, top))
    total = e.sum(dim=-1, keepdim=True)
    return e / torch.where(total > 0, total, 1.0), top.squeeze(-1), total.squeeze(-1)


def combine_weights(maxes: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Each rank's weight ``[G, ...]`` from the group's statistics ``maxes, sums [G, ...]``:
    ``exp(max_r - M) sum_r / sum_s exp(max_s - M) sum_s`` with ``M`` the max over ranks (log-sum-exp merge; the
    weights of a row sum to 1). The weighted partial outputs summed over the ranks are the attention."""
    top = maxes.amax(dim=0, keepdim=True)
    w = torch.exp(maxes - torch.where(top == float("-inf"), 0.0, top)) * sums
    total = w.sum(dim=0, keepdim=True)
    return w / torch.where(total > 0, total, 1.0)


def combine(outs: torch.Tensor, maxes: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """The attention ``[B, Hq, Tq, D]`` from every rank's partials ``outs [G, B, Hq, Tq, D]``, ``maxes, sums
    [G, B, Hq, Tq]`` (the all-to-all's parts; summed in float32, returned in ``outs``' dtype)."""
    w = combine_weights(maxes, sums).unsqueeze(-1)
    return (w * outs.float()).sum(dim=0).to(outs.dtype)
