"""Release keys → backend parameters, as a table of rules (target ← sources, transform).

Each rule names a target template and the source templates it consumes; ``{L}`` is a layer index and
``{E}`` expands over every routed expert. Rules are grouped per layer, so conversion streams one layer at a
time. The reference model stores Gemma norm weights zero-centred (the ``+1`` is applied by ``ops.rms_norm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from ..config import M3Config

LM = "language_model.model"
ATT = LM + ".layers.{L}.self_attn"
MOE = LM + ".layers.{L}.block_sparse_moe"


def _ident(ts: Sequence) -> torch.Tensor:
    return ts[0]


def _cat0(ts: Sequence) -> torch.Tensor:
    return torch.cat(list(ts), dim=0)


def _experts_gate_up(ts: Sequence) -> torch.Tensor:
    """w1 (gate) and w3 (up) per expert ``[I, H]`` → ``[E, H, 2I]`` gate first."""
    gates, ups = ts
    return torch.stack([torch.cat([g, u], dim=0).t() for g, u in zip(gates, ups)])


def _experts_down(ts: Sequence) -> torch.Tensor:
    """w2 per expert ``[H, I]`` → ``[E, I, H]``."""
    return torch.stack([d.t() for d in ts[0]])


@dataclass(frozen=True)
class Rule:
    target: str
    sources: tuple[str, ...]
    transform: Callable[[Sequence], torch.Tensor] = _ident
    when: str = "all"  # all | sparse (sparse-attention layers) | moe | dense (dense-MLP layers)
    keep_fp32: bool = False  # router weight and bias stay float32 whatever the model dtype


GLOBAL_RULES = (
    Rule("embed_tokens.weight", (LM + ".embed_tokens.weight",)),
    Rule("norm.weight", (LM + ".norm.weight",)),
    Rule("lm_head.weight", ("language_model.lm_head.weight",)),
)

LAYER_RULES = (
    Rule("layers.{L}.input_layernorm.weight", (LM + ".layers.{L}.input_layernorm.weight",)),
    Rule("layers.{L}.post_attention_layernorm.weight", (LM + ".layers.{L}.post_attention_layernorm.weight",)),
    *(Rule(f"layers.{{L}}.attn.{n}.weight", (f"{ATT}.{n}.weight",))
      for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")),
    *(Rule(f"layers.{{L}}.attn.{n}.weight", (f"{ATT}.{n}.weight",), when="sparse")
      for n in ("index_q_proj", "index_k_proj", "index_q_norm", "index_k_norm")),
    Rule("layers.{L}.mlp.gate_up_proj.weight",
         (LM + ".layers.{L}.mlp.gate_proj.weight", LM + ".layers.{L}.mlp.up_proj.weight"), _cat0, "dense"),
    Rule("layers.{L}.mlp.down_proj.weight", (LM + ".layers.{L}.mlp.down_proj.weight",), when="dense"),
    Rule("layers.{L}.moe.router.weight", (MOE + ".gate.weight",), when="moe", keep_fp32=True),
    Rule("layers.{L}.moe.e_score_correction_bias", (MOE + ".e_score_correction_bias",), when="moe",
         keep_fp32=True),
    Rule("layers.{L}.moe.experts.gate_up", (MOE + ".experts.{E}.w1.weight", MOE + ".experts.{E}.w3.weight"),
         _experts_gate_up, "moe"),
    Rule("layers.{L}.moe.experts.down", (MOE + ".experts.{E}.w2.weight",), _experts_down, "moe"),
    Rule("layers.{L}.moe.shared.gate_up_proj.weight",
         (MOE + ".shared_experts.gate_proj.weight", MOE + ".shared_experts.up_proj.weight"), _cat0, "moe"),
    Rule("layers.{L}.moe.shared.down_proj.weight", (MOE + ".shared_experts.down_proj.weight",), when="moe"),
)


def _applies(rule: Rule, c: M3Config, layer: int) -> bool:
    return {"all": True, "sparse": c.sparse_layers[layer], "moe": c.moe_layers[layer],
            "dense": not c.moe_layers[layer]}[rule.when]


def _sources(template: str, layer: int | None, c: M3Config) -> list[str] | str:
    key = template.replace("{L}", str(layer)) if layer is not None else template
    if "{E}" in key:
        return [key.replace("{E}", str(e)) for e in range(c.num_experts)]
    return key


def layer_units(c: M3Config) -> list[int | None]:
    """Conversion units in order: ``None`` for the global tensors, then each layer."""
    return [None, *range(c.num_layers)]


def source_keys(c: M3Config, unit: int | None) -> list[str]:
    """Every release key the rules of ``unit`` consume."""
    rules = GLOBAL_RULES if unit is None else [r for r in LAYER_RULES if _applies(r, c, unit)]
    keys: list[str] = []
    for rule in rules:
        for tmpl in rule.sources:
            s = _sources(tmpl, unit, c)
            keys.extend(s if isinstance(s, list) else [s])
    return keys


def convert_unit(get: Callable[[str], torch.Tensor], c: M3Config, unit: int | None,
                 dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Apply the rules of one unit; ``get(key)`` reads a release tensor (already dequantized)."""
    rules = GLOBAL_RULES if unit is None else [r for r in LAYER_RULES if _applies(r, c, unit)]
    for rule in rules:
        srcs = []
        for tmpl in rule.sources:
            s = _sources(tmpl, unit, c)
            srcs.append([get(k) for k in s] if isinstance(s, list) else get(s))
        t = rule.transform(srcs)
        if rule.keep_fp32:
            t = t.float()
        elif dtype is not None:
            t = t.to(dtype)
        yield rule.target.replace("{L}", str(unit)), t.contiguous()
