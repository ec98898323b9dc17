"""``DraftConfig``: the config.json of an EAGLE3 draft head, parsed once (the tensors are :mod:`checkpoint.draft`'s).

An EAGLE3 draft is one Llama decoder layer that predicts the target's next tokens from three of the target's hidden
states (EAGLE-3, arXiv:2503.01840). Two config forms are published, both read here:

* the flat Llama form (``architectures: ["LlamaForCausalLMEagle3"]``, SafeAILab EAGLE / SpecForge, the form vLLM's
  and SGLang's ``llama_eagle3`` models read): Llama fields plus ``draft_vocab_size``, optionally ``target_hidden_size``
  and an ``eagle_config`` object (``eagle_aux_hidden_state_layer_ids``, ``use_aux_hidden_state``);
* the speculators form (``architectures: ["Eagle3Speculator"]``): the Llama fields nested in
  ``transformer_layer_config``, ``speculators_config.proposal_methods[].speculative_tokens``.

``eagle_aux_hidden_state_layer_ids`` (top level, as vLLM reads it; or inside ``eagle_config``) use vLLM's
indexing: id ``j`` is the residual stream ENTERING target layer ``j`` (= the output of layer ``j - 1``; 0 is the
embedding). Without them the target's default is vLLM's ``(2, L // 2, L - 3)`` (NxDI's EAGLE3 target collects the
same states: the outputs of layers ``1, L // 2 - 1, L - 4``). For MiniMax-M3 (L = 60): ids (2, 30, 57).

:func:`parse_draft_config` never raises: it returns the config it could read and every problem, so a bad draft is
reported in ONE error together with its tensors' problems (:func:`minimax_m3.checkpoint.draft.check_draft`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .m3 import M3Config

ROPE_TYPES = ("default", "llama3")


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's default EAGLE3 aux hidden-state ids of a target with ``num_layers`` layers (its indexing)."""
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True)
class DraftConfig:
    """One EAGLE3 draft layer (Llama: plain RMSNorm ``x * rsqrt(mean x^2 + eps) * w``, SiLU MLP, full RoPE)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (drafted ids are target ids)
    draft_vocab_size: int  # the draft lm_head's rows; < vocab_size with a ``d2t`` map
    target_hidden_size: int  # width of each of the three target hidden states fed to ``fc``
    num_layers: int = 1
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    aux_layer_ids: tuple[int, ...] | None = None  # None: the target's default (:func:`default_aux_layers`)
    norm_before_residual: bool = False  # vLLM: the residual is hidden_norm(fc output) instead of the fc output
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    speculative_tokens: int | None = None  # what the draft was trained / published for (speculators form)
    form: str = "llama"  # "llama" | "speculators": which config.json form it was read from

    def aux_layers(self, num_target_layers: int) -> tuple[int, ...]:
        """The target states this draft reads, ascending (the order vLLM concatenates them for ``fc``)."""
        ids = self.aux_layer_ids or default_aux_layers(num_target_layers)
        return tuple(sorted(ids))

    def target_problems(self, target: M3Config) -> list[str]:
        """What does not match ``target`` (hidden size, vocabulary, aux layer ids)."""
        out = []
        if self.target_hidden_size != target.hidden_size:
            out.append(f"the draft reads target hidden states of width {self.target_hidden_size} "
                       f"(target_hidden_size / hidden_size) but the target's hidden_size is {target.hidden_size}: "
                       "this draft was trained for another model")
        if self.vocab_size != target.vocab_size:
            out.append(f"the draft's vocab_size {self.vocab_size} differs from the target's {target.vocab_size}: "
                       "its token ids would not be the target's")
        ids = list(self.aux_layer_ids or default_aux_layers(target.num_layers))
        if len(set(ids)) != 3 or any(not 0 <= i < target.num_layers for i in ids):
            origin = "eagle_aux_hidden_state_layer_ids" if self.aux_layer_ids else \
                f"the default aux layer ids of a {target.num_layers}-layer target"
            out.append(f"{origin} {ids}: EAGLE3 needs three distinct ids in 0..{target.num_layers - 1} (the residual "
                       "stream entering those target layers); write eagle_aux_hidden_state_layer_ids into the draft's "
                       "config.json")
        return out

    def to_dict(self) -> dict:
        """The flat Llama form (``LlamaForCausalLMEagle3``), with the aux ids at the top level (vLLM) and in
        ``eagle_config`` (SpecForge / SGLang)."""
        d = {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": self.hidden_act,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "num_hidden_layers": self.num_layers, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling, "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size, "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": self.tie_word_embeddings, "norm_before_residual": self.norm_before_residual,
            "eagle_config": {"use_aux_hidden_state": True, "use_input_layernorm_in_first_layer": True},
        }
        if self.aux_layer_ids is not None:
            d["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
            d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layer_ids)
        return d

    def replace(self, **kw) -> "DraftConfig":
        return dataclasses.replace(self, **kw)


def is_draft_config(raw: dict) -> bool:
    """Whether a config.json describes an EAGLE3 draft (either form) rather than a target."""
    archs = " ".join(raw.get("architectures") or [])
    return "Eagle" in archs or "eagle_config" in raw or raw.get("speculators_model_type") == "eagle3" or \
        "transformer_layer_config" in raw


def _int(d: dict, key: str, problems: list[str], default=None):
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        problems.append(f"config.json: {key} must be a positive integer, got {v!r}")
        return 1
    return v


def parse_draft_config(raw: dict) -> tuple[DraftConfig | None, list[str]]:
    """The draft config of a config.json (either form) and every problem found; the config is None when the
    fields it needs are missing."""
    problems: list[str] = []
    if not isinstance(raw, dict):
        return None, ["config.json is not a JSON object"]
    form = "speculators" if "transformer_layer_config" in raw else "llama"
    layer = raw.get("transformer_layer_config", raw)
    if not isinstance(layer, dict):
        return None, ["config.json: transformer_layer_config is not an object"]
    eagle = raw.get("eagle_config") or {}
    missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size") if k not in layer]
    if missing:
        return None, [f"config.json: missing {', '.join(missing)} (an EAGLE3 draft's Llama layer fields)"]
    hidden = _int(layer, "hidden_size", problems)
    heads = _int(layer, "num_attention_heads", problems)
    kv = _int(layer, "num_key_value_heads", problems, heads)
    head_dim = _int(layer, "head_dim", problems, hidden // heads if heads else 1)
    vocab = _int(layer, "vocab_size", problems)
    draft_vocab = raw.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab
    target_hidden = raw.get("target_hidden_size") or layer.get("target_hidden_size") or hidden
    if heads % kv:
        problems.append(f"config.json: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    layers = layer.get("num_hidden_layers", 1)
    if layers != 1:
        problems.append(f"config.json: num_hidden_layers {layers}: only one-layer EAGLE3 drafts are supported (the "
                        "published MiniMax-M3 drafts have one)")
    act = layer.get("hidden_act", "silu")
    if act != "silu":
        problems.append(f"config.json: hidden_act {act!r}: an EAGLE3 Llama draft uses silu")
    if eagle.get("use_aux_hidden_state", True) is False:
        problems.append("config.json: eagle_config.use_aux_hidden_state is false (an EAGLE-1/2 draft); only EAGLE3 "
                        "drafts, fed three target hidden states, are supported")
    scaling = layer.get("rope_scaling")
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
        if kind not in ROPE_TYPES:
            problems.append(f"config.json: rope_scaling {scaling!r}: supported rope types are {', '.join(ROPE_TYPES)}")
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    nested = eagle.get("eagle_aux_hidden_state_layer_ids")
    if ids and nested and list(ids) != list(nested):
        problems.append(f"config.json: eagle_aux_hidden_state_layer_ids {list(ids)} (top level) and {list(nested)} "
                        "(eagle_config) differ; keep one")
    ids = ids or nested
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, int) for i in ids)):
        problems.append(f"config.json: eagle_aux_hidden_state_layer_ids must be a list of integers, got {ids!r}")
        ids = None
    k = None
    for method in (raw.get("speculators_config") or {}).get("proposal_methods") or []:
        k = method.get("speculative_tokens", k) if isinstance(method, dict) else k
    cfg = DraftConfig(
        hidden_size=hidden, num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
        intermediate_size=_int(layer, "intermediate_size", problems), vocab_size=vocab,
        draft_vocab_size=int(draft_vocab), target_hidden_size=int(target_hidden), num_layers=int(layers),
        rms_norm_eps=float(layer.get("rms_norm_eps", 1e-6)), rope_theta=float(layer.get("rope_theta", 10000.0)),
        rope_scaling=scaling if isinstance(scaling, dict) else None,
        aux_layer_ids=tuple(ids) if ids else None,
        norm_before_residual=bool(raw.get("norm_before_residual", layer.get("norm_before_residual", False))),
        hidden_act=act, tie_word_embeddings=bool(layer.get("tie_word_embeddings", False)), speculative_tokens=k,
        form=form)
    if cfg.draft_vocab_size > cfg.vocab_size:
        problems.append(f"config.json: draft_vocab_size {cfg.draft_vocab_size} exceeds vocab_size {cfg.vocab_size}")
    return cfg, problems
