"""Analytic cost of the NKI kernels NxD calls from a traced graph (their FLOPs cannot be read from the HLO).

A kernel reaches the graph as one ``AwsNeuronCustomNativeKernel`` custom call whose backend config is a small JSON
``{"nki_kernel": name, ...static parameters}`` (what the graph harness's stand-ins write,
``test/support/hlo/nki_kernels.py``); ``hlo_cost`` adds ``NKI_KERNEL_COST[name]`` of its operand shapes to the named
FLOP class.
"""

from __future__ import annotations

import json
import math


# NKI kernels whose cost is counted analytically from the custom call's operand shapes and the static parameters in
# its backend config (JSON {"nki_kernel": name, ...}, what the graph harness's kernel stand-ins write,
# test/support/hlo/nki_kernels.py): name -> (FLOP class, function(operand shapes, config) -> FLOPs, what the count
# assumes).
def _shard_on_i_flops(shapes, cfg: dict) -> int:
    """NxD's shard-on-intermediate dynamic-while blockwise MoE kernel (operands: conditions, hidden [T+1, H],
    affinities, gate_up [E_l, H, 2, I], down [E_l, I, H], ...). It computes ``num_static_block`` blocks, then loops
    over the blocks whose condition says they hold routed tokens; with routing balanced as NxD's static-block count
    assumes (``S = ceil(T*k/EP / B)`` blocks of rows per rank, ``S*B/E_l`` rows per local expert), each local expert
    fills ``ceil(S / E_l)`` blocks: ``E_l * ceil(S / E_l) * B`` rows through gate/up and down, ``6 * H * I`` each."""
    e_local, h, _, i = (int(d) for d in shapes[3].dimensions)
    b, s = int(cfg["block_size"]), int(cfg["num_static_block"])
    rows = e_local * math.ceil(s / e_local) * b
    return rows * 6 * h * i


# the flash kernel's tiles (nki-library ``core/attention/attention_cte.py``): queries in groups of 128, QK^T (MM1)
# over 512-key tiles, PV (MM2) over 128-key tiles
_Q_GROUP, _QK_TILE, _PV_TILE = 128, 512, 128


def _attention_cte_flops(shapes, cfg: dict) -> int:
    """NxDI's context-encoding flash-attention kernel ``attention_cte`` (operands q, k, v; layouts from the config's
    ``tp_q``/``tp_k``: q ``[B, Sq, D]`` or ``[B, D, Sq]``, k ``[B_kv, Sk, D]`` or ``[B_kv, D, Sk]``). Its two matmuls
    as the kernel issues them, per query row of a batch item (heads folded into the batch, GQA reading a shared K/V):
    MM1 ``2 * D`` per key over 512-key tiles, MM2 ``2 * D`` per key over 128-key tiles. With ``causal_mask`` the
    kernel SKIPS every tile whose first key comes after the last query of the 128-query group
    (``_has_any_compute_causal``: ``q_grp*128 + 127 >= k_start``, checked per MM1/MM2 tile and per 8K flash
    section), so a group computes all keys of the tiles that start at or before its last query: at ``S = 512 T``,
    ``2 T (T + 1)`` MM1 tiles and ``S/128 (S/128 + 1) / 2`` MM2 tiles per head, 1.04x the exact causal
    ``2 S^2 D`` at 8K. Softmax (exp, max, sum) is not a matmul and is not counted, as for the traced dots; the LNC 2
    grid splits the same tiles over the two cores of a rank (FLOPs per rank unchanged)."""
    q, k = (tuple(int(d) for d in s.dimensions) for s in shapes[:2])
    bs, sq, d = q if cfg["tp_q"] else (q[0], q[2], q[1])
    sk = k[1] if cfg["tp_k"] else k[2]
    total = 0
    for g0 in range(0, sq, _Q_GROUP):
        last_q = g0 + _Q_GROUP - 1  # the kernel's group bound, also for a partial last group
        rows = min(_Q_GROUP, sq - g0)
        for tile in (_QK_TILE, _PV_TILE):
            keys = min(sk, (last_q // tile + 1) * tile) if cfg["causal_mask"] else sk
            total += 2 * rows * keys * d
    return bs * total


NKI_KERNEL_COST = {
    "blockwise_mm_baseline_shard_intermediate_hybrid": (
        "routed_experts", _shard_on_i_flops, "routing balanced as NxD's static-block count assumes"),
    "attention_cte": ("attention", _attention_cte_flops, "the kernel's causal tile skipping, matmuls only"),
}


def nki_kernel(ins) -> dict | None:
    """The backend config of an NKI custom call naming a kernel of ``NKI_KERNEL_COST``, else None."""
    raw = bytes(ins.backend_config or b"")
    if ins.custom_call_target != "AwsNeuronCustomNativeKernel" or not raw.startswith(b"{"):
        return None
    try:
        cfg = json.loads(raw)
    except ValueError:
        return None
    return cfg if cfg.get("nki_kernel") in NKI_KERNEL_COST else None
