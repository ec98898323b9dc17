"""Release keys → backend parameters, as a table of rules (target ← sources, transform).

Each rule names a target template and the source templates it consumes; ``{L}`` is a layer index and
``{E}`` expands over every routed expert. Rules are grouped per layer, so conversion streams one layer at a
time. The reference model stores Gemma norm weights zero-centred (the ``+1`` is applied by ``ops.rms_norm``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..config.m3 import M3Config

LM = "language_model.model"
ATT = LM + ".layers.{L}.self_attn"
MOE = LM + ".layers.{L}.block_sparse_moe"


def _ident(ts: Sequence) -> torch.Tensor:
    return ts[0]


def _cat0(ts: Sequence) -> torch.Tensor:
    return torch.cat(list(ts), dim=0)


def _experts_gate_up(ts: Sequence) -> torch.Tensor:
    """w1 (gate) and w3 (up) per expert ``[I, H]`` → ``[E, H, 2I]`` gate first.

    Fills a preallocated result and releases each expert's sources as soon as they are copied, so the peak is about
    one copy of the experts, not two or three."""
    gates, ups = ts
    e, (i, h) = len(gates), tuple(gates[0].shape)
    out = torch.empty((e, h, 2 * i), dtype=gates[0].dtype, device=gates[0].device)
    scratch = torch.empty((2 * i, h), dtype=out.dtype, device=out.device)  # [gate; up], reused per expert
    for k in range(e):
        scratch[:i].copy_(gates[k])
        scratch[i:].copy_(ups[k])
        out[k].copy_(scratch.t())  # contiguous destination: torch's blocked transpose path
        if isinstance(gates, list):
            gates[k] = ups[k] = None
    return out


def _experts_down(ts: Sequence) -> torch.Tensor:
    """w2 per expert ``[H, I]`` → ``[E, I, H]`` (sources released as they are copied)."""
    downs = ts[0]
    e, (h, i) = len(downs), tuple(downs[0].shape)
    out = torch.empty((e, i, h), dtype=downs[0].dtype, device=downs[0].device)
    for k in range(e):
        out[k].copy_(downs[k].t())
        if isinstance(downs, list):
            downs[k] = None
    return out


# out[k] = cat([source[k] for each source], dim 0).t() for every expert k: convert streams these expert by expert
# (``convert._expert_slabs``) instead of building the whole [E, ...] result; the result is the same bytes.
_experts_gate_up.expert_slabs = True
_experts_down.expert_slabs = True
# out = cat(sources, dim 0): convert streams these in row blocks of each source, in order (the same bytes)
_ident.concat_rows = True
_cat0.concat_rows = True


@dataclass(frozen=True)
class Rule:
    target: str
    sources: tuple[str, ...]
    transform: Callable[[Sequence], torch.Tensor] = _ident
    when: str = "all"  # all | sparse (sparse-attention layers) | moe | dense (dense-MLP layers)
    keep_fp32: bool = False  # router weight and bias stay float32 whatever the model dtype
    fp32_math: bool = False  # sources arrive in float32 and the result is cast once (arithmetic transforms)


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


@dataclass(frozen=True)
class Skip:
    """Release keys a target does not use, and why (reported by the audit, never dropped silently)."""

    pattern: str  # regular expression searched in the release key
    reason: str


SKIPS = (
    Skip(r"^vision_tower\.", "vision tower: the text backbone serves text only"),
    Skip(r"^multi_modal_projector\.", "multimodal projector: feeds vision features, unused by the text backbone"),
    Skip(r"^patch_merge_mlp\.", "patch-merge projector: part of the vision path, unused by the text backbone"),
    Skip(r"^language_model\.model\.mtp\.", "MTP module: multi-token prediction is not served (MiniMax: "
         "'Don't support MTP now')"),
)
# companions of a quantized weight that no target consumes
INPUT_SCALE = Skip(r"\.input_scale$", "NVFP4 activation (input) scale: used only by W4A4 kernels; a dequantized "
                   "weight needs none")


@dataclass(frozen=True)
class RuleTable:
    """A conversion target: global rules, per-layer rules, what it skips, and whether the rest passes through."""

    name: str
    global_rules: tuple[Rule, ...]
    layer_rules: tuple[Rule, ...]
    skips: tuple[Skip, ...] = SKIPS
    passthrough: bool = False  # every unclaimed, unskipped release key is written under its own name


REFERENCE = RuleTable("reference", GLOBAL_RULES, LAYER_RULES)
# the dequantized twin of the release: every tensor under its own name (vision and MTP included)
BF16 = RuleTable("bf16", (), (), skips=(), passthrough=True)

_LAYER_KEY = re.compile(r"^(?:language_model\.model\.)?layers\.(\d+)\.")


def unit_of(key: str) -> int | None:
    """The conversion unit a key belongs to: its decoder layer, or ``None`` (global tensors, vision, MTP). Release
    keys (``language_model.model.layers.{L}.*``) and converted keys (``layers.{L}.*``) alike."""
    m = _LAYER_KEY.match(key)
    return int(m.group(1)) if m else None


def skip_reason(table: RuleTable, key: str) -> str | None:
    for s in (*table.skips, INPUT_SCALE):
        if re.search(s.pattern, key):
            return s.reason
    return None


def _applies(rule: Rule, c: M3Config, layer: int) -> bool:
    return {"all": True, "sparse": c.sparse_layers[layer], "moe": c.moe_layers[layer],
            "dense": not c.moe_layers[layer]}[rule.when]


def _sources(template: str, layer: int | None, c: M3Config) -> list[str] | str:
    key = template.replace("{L}", str(layer)) if layer is not None else template
    if "{E}" in key:
        return [key.replace("{E}", str(e)) for e in range(c.num_experts)]
    return key


def _flat(srcs) -> list[str]:
    return [k for s in srcs for k in (s if isinstance(s, list) else [s])]


def layer_units(c: M3Config) -> list[int | None]:
    """Conversion units in order: ``None`` for the global tensors, then each layer."""
    return [None, *range(c.num_layers)]


def unit_rules(c: M3Config, unit: int | None, table: RuleTable = REFERENCE,
               keys: Sequence[str] | None = None, keep_fp32: Callable[[str], bool] | None = None) -> list[Rule]:
    """The rules of ``unit``; for a passthrough table also one identity rule per unclaimed release key in ``keys``
    (``keep_fp32(key)`` says which of those stay float32)."""
    rules = list(table.global_rules) if unit is None else [r for r in table.layer_rules if _applies(r, c, unit)]
    if table.passthrough:
        if keys is None:
            raise ValueError(f"table {table.name!r} passes keys through: give the checkpoint's keys")
        claimed = set(_flat(_sources(t, unit, c) for r in rules for t in r.sources))
        for k in keys:
            if unit_of(k) == unit and k not in claimed and skip_reason(table, k) is None:
                rules.append(Rule(k, (k,), keep_fp32=bool(keep_fp32 and keep_fp32(k))))
    return rules


def source_keys(c: M3Config, unit: int | None, table: RuleTable = REFERENCE,
                keys: Sequence[str] | None = None) -> list[str]:
    """Every release key the rules of ``unit`` consume."""
    return _flat(_sources(t, unit, c) for r in unit_rules(c, unit, table, keys) for t in r.sources)


def target_name(rule: Rule, unit: int | None) -> str:
    return rule.target.replace("{L}", str(unit)) if unit is not None else rule.target


def apply_rule(rule: Rule, unit: int | None, c: M3Config, get: Callable[..., torch.Tensor],
               dtype: torch.dtype | None = None, cast_get: Callable[[str, torch.dtype], torch.Tensor] | None = None
               ) -> torch.Tensor:
    """Fetch one rule's sources, transform, cast. ``cast_get(key, dtype)`` (optional) reads a source already in the
    output dtype, so a large rule never holds float32 copies of bf16-bound data."""
    wide = rule.keep_fp32 or rule.fp32_math or dtype is None
    if wide or cast_get is None:
        fetch = (lambda k: get(k).float()) if (rule.keep_fp32 or rule.fp32_math) else get
    else:
        fetch = lambda k: cast_get(k, dtype)  # noqa: E731
    srcs = []
    for tmpl in rule.sources:
        s = _sources(tmpl, unit, c)
        srcs.append([fetch(k) for k in s] if isinstance(s, list) else fetch(s))
    t = rule.transform(srcs)
    del srcs
    if t.is_floating_point():  # index tensors (e.g. rank_util.rank) keep their integer dtype
        if rule.keep_fp32:
            t = t.float()
        elif dtype is not None:
            t = t.to(dtype)
    return t.contiguous()


def release_shapes(c: M3Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every text-backbone key of the release for config ``c``: (logical shape, kind) with kind ``linear`` (may be
    quantized), ``fp32`` (router weight/bias, stored float32) or ``plain`` (norms, embeddings, lm_head)."""
    h, hd = c.hidden_size, c.head_dim
    out: dict[str, tuple[tuple[int, ...], str]] = {
        f"{LM}.embed_tokens.weight": ((c.vocab_size, h), "plain"),
        f"{LM}.norm.weight": ((h,), "plain"),
        "language_model.lm_head.weight": ((c.vocab_size, h), "plain"),
    }
    for i in range(c.num_layers):
        p = f"{LM}.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = ((h,), "plain")
        out[f"{p}.post_attention_layernorm.weight"] = ((h,), "plain")
        a = f"{p}.self_attn"
        out[f"{a}.q_proj.weight"] = ((c.num_heads * hd, h), "linear")
        out[f"{a}.k_proj.weight"] = ((c.num_kv_heads * hd, h), "linear")
        out[f"{a}.v_proj.weight"] = ((c.num_kv_heads * hd, h), "linear")
        out[f"{a}.o_proj.weight"] = ((h, c.num_heads * hd), "linear")
        out[f"{a}.q_norm.weight"] = ((hd,), "plain")
        out[f"{a}.k_norm.weight"] = ((hd,), "plain")
        if c.sparse_layers[i]:
            out[f"{a}.index_q_proj.weight"] = ((c.index_heads * c.index_head_dim, h), "linear")
            out[f"{a}.index_k_proj.weight"] = ((c.index_head_dim, h), "linear")
            out[f"{a}.index_q_norm.weight"] = ((c.index_head_dim,), "plain")
            out[f"{a}.index_k_norm.weight"] = ((c.index_head_dim,), "plain")
        if c.moe_layers[i]:
            m, n, s = f"{p}.block_sparse_moe", c.intermediate_size, c.shared_intermediate_size
            out[f"{m}.gate.weight"] = ((c.num_experts, h), "fp32")
            out[f"{m}.e_score_correction_bias"] = ((c.num_experts,), "fp32")
            for e in range(c.num_experts):
                out[f"{m}.experts.{e}.w1.weight"] = ((n, h), "linear")
                out[f"{m}.experts.{e}.w2.weight"] = ((h, n), "linear")
                out[f"{m}.experts.{e}.w3.weight"] = ((n, h), "linear")
            out[f"{m}.shared_experts.gate_proj.weight"] = ((s, h), "linear")
            out[f"{m}.shared_experts.up_proj.weight"] = ((s, h), "linear")
            out[f"{m}.shared_experts.down_proj.weight"] = ((h, s), "linear")
        else:
            d = c.dense_intermediate_size
            out[f"{p}.mlp.gate_proj.weight"] = ((d, h), "linear")
            out[f"{p}.mlp.up_proj.weight"] = ((d, h), "linear")
            out[f"{p}.mlp.down_proj.weight"] = ((h, d), "linear")
    return out
