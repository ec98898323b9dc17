"""Release keys → the NxDI state dict of ``minimax_m3.neuron`` (``NeuronMiniMaxM3ForCausalLM``), as rules.

Same ``Rule`` style as :mod:`.mapping`; the targets are the names NxDI/NxD modules register (checked in
their sources, NxDI 0.9 / NxD 0.18):

* attention: ``self_attn.qkv_proj.{q,k,v}_proj.weight`` (``GroupQueryAttention_QKV``; or ``qkv_proj.Wqkv.weight``
  with ``fused_qkv``), ``self_attn.o_proj.o_proj.weight`` (``GroupQueryAttention_O``; the attention names it as
  its ``o_proj_layer_name``, so the O hook's rename is an identity and NxD removes no key); the QKV preshard hook
  replicates K/V heads to the TP degree. Per-head norms ``self_attn.{q,k}_layernorm.weight``.
* every parameter of the NxDI model must be a target here: loading fails naming any that is not
  (``NeuronMiniMaxM3Model.load_state_dict``; NxDI itself loads with ``strict=False``).
* indexer (sparse layers): ``self_attn.index_{q,k}_proj.weight``, ``self_attn.index_{q,k}_norm.weight``
  (our modules; the index-q preshard hook replicates index heads exactly like K/V heads).
* MoE (NxD ``MoE``/``RouterTopK``/``ExpertMLPsV2``): ``moe.router.linear_router.weight`` (fp32),
  ``moe.router.e_score_correction_bias`` (fp32), ``moe.expert_mlps.mlp_op.gate_up_proj.{weight,bias}``
  ``[E, H, 2I]`` gate first / ``[E, 2I]`` zeros, ``moe.expert_mlps.mlp_op.down_proj.{weight,bias}`` ``[E, I, H]`` /
  ``[E, H]`` zeros (``bias=True`` is what makes NxD add SwiGLU-OAI's ``+1``; the biases themselves are zero).
  The routed scaling factor is folded into ``down_proj.weight`` (``routed_scaling_factor * w2ᵀ``; the zero bias
  stays zero), so the port adds the routed and shared partial sums before one all-reduce with no multiply in the
  graph. Computed in the target dtype's arithmetic, one rounding: exact for M3's factor 2.0 (a power of two) in
  bf16 and fp32 while no weight overflows; for other factors in bf16 at most half a bf16 ulp per weight.
* our SwiGLU-OAI MLPs (dense layers, shared expert): ``{mlp,shared_expert}.gate_up_proj.weight`` ``[gate; up]``
  for a stride-2 ``ColumnParallelLinear``, ``{mlp,shared_expert}.down_proj.weight``.
* every Gemma norm gets its ``+1`` folded in float32 and stays float32 (input, post-attention, q/k, index q/k,
  final); ``rank_util.rank`` / ``layers.{L}.self_attn.rank_util.rank`` are ``arange(tp)`` int32.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..config.m3 import M3Config
from .mapping import ATT, LM, MOE, Rule, _applies, _cat0, _experts_down, _experts_gate_up, _ident

FP32 = True


def _fold_gemma(ts: Sequence) -> torch.Tensor:
    """Zero-centred Gemma weight ``w`` → ``1 + w`` computed in float32 (kept float32)."""
    return 1.0 + ts[0].float()


def _scaled_experts_down(scale: float):
    """``_experts_down`` times ``scale`` (the routed scaling factor), streamable expert by expert like it: the
    converter's slab path multiplies each slab by ``slab_scale``."""
    scale = float(scale)

    def down(ts: Sequence) -> torch.Tensor:
        out = _experts_down(ts)
        return out.mul_(scale) if scale != 1.0 else out

    down.expert_slabs = True
    down.slab_scale = scale
    return down


def _cat_qkv(ts: Sequence) -> torch.Tensor:
    return torch.cat([ts[0], ts[1], ts[2]], dim=0)


def nxdi_rules(c: M3Config, tp_degree: int, fused_qkv: bool = False) -> tuple[tuple[Rule, ...], tuple[Rule, ...]]:
    """``(global_rules, layer_rules)`` for config ``c`` at ``tp_degree``."""
    e, i_, h = c.num_experts, c.intermediate_size, c.hidden_size
    rank = lambda _: torch.arange(tp_degree, dtype=torch.int32)  # noqa: E731
    glob = (
        Rule("embed_tokens.weight", (LM + ".embed_tokens.weight",)),
        Rule("norm.weight", (LM + ".norm.weight",), _fold_gemma, keep_fp32=FP32),
        Rule("lm_head.weight", ("language_model.lm_head.weight",)),
        Rule("rank_util.rank", (), rank),
    )
    qkv = (
        (Rule("layers.{L}.self_attn.qkv_proj.Wqkv.weight",
              (f"{ATT}.q_proj.weight", f"{ATT}.k_proj.weight", f"{ATT}.v_proj.weight"), _cat_qkv),)
        if fused_qkv else
        tuple(Rule(f"layers.{{L}}.self_attn.qkv_proj.{n}.weight", (f"{ATT}.{n}.weight",))
              for n in ("q_proj", "k_proj", "v_proj"))
    )
    layer = (
        Rule("layers.{L}.input_layernorm.weight", (LM + ".layers.{L}.input_layernorm.weight",), _fold_gemma,
             keep_fp32=FP32),
        Rule("layers.{L}.post_attention_layernorm.weight", (LM + ".layers.{L}.post_attention_layernorm.weight",),
             _fold_gemma, keep_fp32=FP32),
        *qkv,
        Rule("layers.{L}.self_attn.o_proj.o_proj.weight", (f"{ATT}.o_proj.weight",)),
        Rule("layers.{L}.self_attn.q_layernorm.weight", (f"{ATT}.q_norm.weight",), _fold_gemma, keep_fp32=FP32),
        Rule("layers.{L}.self_attn.k_layernorm.weight", (f"{ATT}.k_norm.weight",), _fold_gemma, keep_fp32=FP32),
        Rule("layers.{L}.self_attn.rank_util.rank", (), rank),
        Rule("layers.{L}.self_attn.index_q_proj.weight", (f"{ATT}.index_q_proj.weight",), when="sparse"),
        Rule("layers.{L}.self_attn.index_k_proj.weight", (f"{ATT}.index_k_proj.weight",), when="sparse"),
        Rule("layers.{L}.self_attn.index_q_norm.weight", (f"{ATT}.index_q_norm.weight",), _fold_gemma, "sparse",
             keep_fp32=FP32),
        Rule("layers.{L}.self_attn.index_k_norm.weight", (f"{ATT}.index_k_norm.weight",), _fold_gemma, "sparse",
             keep_fp32=FP32),
        Rule("layers.{L}.mlp.gate_up_proj.weight",
             (LM + ".layers.{L}.mlp.gate_proj.weight", LM + ".layers.{L}.mlp.up_proj.weight"), _cat0, "dense"),
        Rule("layers.{L}.mlp.down_proj.weight", (LM + ".layers.{L}.mlp.down_proj.weight",), when="dense"),
        Rule("layers.{L}.moe.router.linear_router.weight", (MOE + ".gate.weight",), when="moe", keep_fp32=FP32),
        Rule("layers.{L}.moe.router.e_score_correction_bias", (MOE + ".e_score_correction_bias",), when="moe",
             keep_fp32=FP32),
        Rule("layers.{L}.moe.expert_mlps.mlp_op.gate_up_proj.weight",
             (MOE + ".experts.{E}.w1.weight", MOE + ".experts.{E}.w3.weight"), _experts_gate_up, "moe"),
        Rule("layers.{L}.moe.expert_mlps.mlp_op.gate_up_proj.bias", (), lambda _: torch.zeros(e, 2 * i_), "moe"),
        Rule("layers.{L}.moe.expert_mlps.mlp_op.down_proj.weight", (MOE + ".experts.{E}.w2.weight",),
             _scaled_experts_down(c.routed_scaling_factor), "moe"),
        Rule("layers.{L}.moe.expert_mlps.mlp_op.down_proj.bias", (), lambda _: torch.zeros(e, h), "moe"),
        Rule("layers.{L}.shared_expert.gate_up_proj.weight",
             (MOE + ".shared_experts.gate_proj.weight", MOE + ".shared_experts.up_proj.weight"), _cat0, "moe"),
        Rule("layers.{L}.shared_expert.down_proj.weight", (MOE + ".shared_experts.down_proj.weight",), when="moe"),
    )
    return glob, layer


def _unit_rules(c: M3Config, unit: int | None, tp_degree: int, fused_qkv: bool) -> list[Rule]:
    glob, layer = nxdi_rules(c, tp_degree, fused_qkv)
    return list(glob) if unit is None else [r for r in layer if _applies(r, c, unit)]


def fp32_targets(c: M3Config, tp_degree: int = 1) -> set[str]:
    """Every converted key that must stay float32 whatever the model dtype."""
    out: set[str] = set()
    for unit in [None, *range(c.num_layers)]:
        for r in _unit_rules(c, unit, tp_degree, False):
            if r.keep_fp32:
                out.add(r.target if unit is None else r.target.replace("{L}", str(unit)))
    return out


__all__ = ["fp32_targets", "nxdi_rules", "_ident"]
