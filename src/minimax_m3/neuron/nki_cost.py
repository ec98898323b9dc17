"""Analytic cost of the NKI kernels NxD calls from a traced graph (their FLOPs cannot be read from the HLO).

A kernel reaches the graph as one ``AwsNeuronCustomNativeKernel`` custom call whose backend config is a small JSON
``{"nki_kernel": name, ...static parameters}`` (what the graph harness's stand-ins write, ``test/hlo/nki_kernels.py``);
``hlo_cost`` adds ``NKI_KERNEL_COST[name]`` of its operand shapes to the named FLOP class.
"""

from __future__ import annotations

import json
import math


# NKI kernels whose cost is counted analytically from the custom call's operand shapes and the static parameters in
# its backend config (JSON {"nki_kernel": name, ...}, what the graph harness's kernel stand-ins write, test/hlo/
# nki_kernels.py): name -> (FLOP class, function(operand shapes, config) -> FLOPs).
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


NKI_KERNEL_COST = {"blockwise_mm_baseline_shard_intermediate_hybrid": ("routed_experts", _shard_on_i_flops)}


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
