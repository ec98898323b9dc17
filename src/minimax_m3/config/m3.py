"""`M3Config`: the one description of a MiniMax-M3 text backbone.

Parsed from a checkpoint's ``config.json`` in either form found in the wild:

* the release's own (``MiniMaxAI/MiniMax-M3``): a nested ``text_config`` with ``sparse_attention_config``
  (``sparse_*`` keys), ``moe_layer_freq``, ``rotary_dim``/``partial_rotary_factor``, ``rope_theta`` and
  ``hidden_act: swigluoai``;
* the form transformers writes: flat ``layer_types``, ``mlp_layer_types``, ``index_*`` and ``rope_parameters``.

Every contradictory or unsupported setting is collected and reported in one :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import M3Error


class ConfigError(M3Error, ValueError):
    """A config.json that cannot describe a MiniMax-M3 backbone this package runs."""

    def __init__(self, problems: list[str], source: str = "config"):
        problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__(problems, f"{source}: {len(problems)} problem(s) in the model config:")


@dataclass(frozen=True)
class M3Config:
    vocab_size: int = 200064
    hidden_size: int = 6144
    num_layers: int = 60
    num_heads: int = 64
    num_kv_heads: int = 4
    head_dim: int = 128
    rotary_dim: int = 64
    rope_theta: float = 5_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 1_048_576
    # MLPs
    intermediate_size: int = 3072  # per routed expert
    dense_intermediate_size: int = 12288
    shared_intermediate_size: int = 3072
    num_experts: int = 128
    top_k: int = 4
    routed_scaling_factor: float = 2.0
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    moe_layers: tuple[bool, ...] = field(default_factory=lambda: (False,) * 3 + (True,) * 57)
    # MiniMax Sparse Attention (lightning indexer)
    sparse_layers: tuple[bool, ...] = field(default_factory=lambda: (False,) * 3 + (True,) * 57)
    index_heads: int = 4
    index_head_dim: int = 128
    index_block_size: int = 128
    index_topk: int = 16
    index_init_blocks: int = 0
    index_local_blocks: int = 1
    # tokens
    bos_token_id: int | None = 200034
    eos_token_id: int | None = 200020
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        problems = _validate(self)
        if problems:
            raise ConfigError(problems)

    # ---- derived -------------------------------------------------------------------------
    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)

    @property
    def dense_attention_span(self) -> int:
        """Tokens below which sparse attention keeps every causal block (exactly dense)."""
        return self.index_topk * self.index_block_size

    def replace(self, **changes: Any) -> "M3Config":
        return dataclasses.replace(self, **changes)

    def fields_dict(self) -> dict:
        """The fields as a JSON-friendly dict (tuples become lists); :meth:`from_fields` reads it back."""
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}

    @classmethod
    def from_fields(cls, fields: dict) -> "M3Config":
        """The inverse of :meth:`fields_dict`; unknown keys are ignored (newer writers)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in fields.items() if k in known})

    # ---- parsing -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict, source: str = "config") -> "M3Config":
        """Parse either config.json form (release nested / transformers flat)."""
        try:
            kwargs, problems = _parse(raw)
        except (TypeError, ValueError, KeyError) as exc:  # malformed values (e.g. a string for a number)
            raise ConfigError([f"malformed value: {exc}"], source) from None
        try:
            config = cls(**kwargs)
        except ConfigError as exc:  # report parse and consistency problems together
            raise ConfigError(problems + exc.problems, source) from None
        except TypeError as exc:
            raise ConfigError(problems + [f"malformed value: {exc}"], source) from None
        if problems:
            raise ConfigError(problems, source)
        return config

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "M3Config":
        """Read ``config.json`` from a checkpoint directory (or the file itself)."""
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError([f"no config.json at {p}; point at a checkpoint directory that has one"], str(path))
        try:
            raw = json.loads(p.read_text())
        except json.JSONDecodeError as exc:
            raise ConfigError([f"not valid JSON ({exc}); re-download or regenerate the file"], str(p)) from None
        if not isinstance(raw, dict):
            raise ConfigError(["top level is not a JSON object"], str(p))
        return cls.from_dict(raw, source=str(p))

    @classmethod
    def preset(cls, name: str) -> "M3Config":
        if name not in PRESETS:
            raise ConfigError([f"unknown preset {name!r}; choose one of {sorted(PRESETS)}"], "preset")
        return PRESETS[name]

    # ---- writing -------------------------------------------------------------------------
    def to_release_dict(self, vision_config: dict | None = None) -> dict:
        """The release's own config.json form (nested text_config, sparse_attention_config)."""
        n = self.num_layers
        text = {
            "architectures": ["MiniMaxM3SparseForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": n,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "use_gemma_norm": True,
            "use_qk_norm": True,
            "qk_norm_type": "per_head",
            "attention_output_gate": False,
            "rope_theta": self.rope_theta,
            "rotary_dim": self.rotary_dim,
            "partial_rotary_factor": self.rotary_dim / self.head_dim,
            "hidden_act": "swigluoai",
            "swiglu_alpha": self.swiglu_alpha,
            "swiglu_limit": self.swiglu_limit,
            "intermediate_size": self.intermediate_size,
            "dense_intermediate_size": self.dense_intermediate_size,
            "shared_intermediate_size": self.shared_intermediate_size,
            "n_shared_experts": 1,
            "num_local_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "scoring_func": "sigmoid",
            "use_routing_bias": True,
            "routed_scaling_factor": self.routed_scaling_factor,
            "moe_layer_freq": [int(x) for x in self.moe_layers],
            "num_mtp_modules": 0,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "sparse_attention_config": {
                "use_sparse_attention": any(self.sparse_layers),
                "sparse_index_dim": self.index_head_dim,
                "sparse_num_index_heads": self.index_heads,
                "sparse_topk_blocks": self.index_topk,
                "sparse_block_size": self.index_block_size,
                "sparse_score_type": "max",
                "sparse_init_block": self.index_init_blocks,
                "sparse_local_block": self.index_local_blocks,
                "sparse_attention_freq": [int(x) for x in self.sparse_layers],
                "sparse_disable_index_value": [int(x) for x in self.sparse_layers],
            },
        }
        out = {
            "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
            "model_type": "minimax_m3_vl",
            "torch_dtype": "bfloat16",
            "text_config": text,
            "tie_word_embeddings": self.tie_word_embeddings,
            "image_token_index": 200025,
            "video_token_index": 200026,
            "projector_hidden_size": self.hidden_size,
        }
        if self.bos_token_id is not None:
            out["bos_token_id"] = self.bos_token_id
        if self.eos_token_id is not None:
            out["eos_token_id"] = self.eos_token_id
        if vision_config is not None:
            out["vision_config"] = vision_config
        return out


# ---- parsing helpers ---------------------------------------------------------------------

def _flag_list(value: Any, n: int, name: str, problems: list[str]) -> tuple[bool, ...] | None:
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):  # e.g. moe_layer_freq: 1 → every layer
        return (bool(value),) * n
    if not isinstance(value, (list, tuple)):
        problems.append(f"{name} must be a list of per-layer flags, got {type(value).__name__}")
        return None
    if len(value) != n:
        problems.append(f"{name} has {len(value)} entries but num_hidden_layers is {n}; give one entry per layer")
        return None
    return tuple(bool(v) for v in value)


def _type_list(value: Any, n: int, name: str, true_word: str, false_word: str, problems: list[str]):
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != n:
        got = len(value) if isinstance(value, (list, tuple)) else type(value).__name__
        problems.append(f"{name} must list one entry per layer ({n}), got {got}")
        return None
    bad = sorted({v for v in value if v not in (true_word, false_word)})
    if bad:
        problems.append(f"{name} has unknown entries {bad}; expected {true_word!r} or {false_word!r}")
        return None
    return tuple(v == true_word for v in value)


def _parse(raw: dict) -> tuple[dict, list[str]]:
    problems: list[str] = []
    text = raw.get("text_config", raw)
    if text is None or not isinstance(text, dict):
        return {}, ["text_config must be an object"]
    top = raw if "text_config" in raw else {}
    d = dict(text)
    kw: dict[str, Any] = {}

    simple = {
        "vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_layers": "num_hidden_layers",
        "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
        "rms_norm_eps": "rms_norm_eps", "max_position_embeddings": "max_position_embeddings",
        "intermediate_size": "intermediate_size", "dense_intermediate_size": "dense_intermediate_size",
        "shared_intermediate_size": "shared_intermediate_size", "num_experts": "num_local_experts",
        "top_k": "num_experts_per_tok", "routed_scaling_factor": "routed_scaling_factor",
        "swiglu_alpha": "swiglu_alpha", "swiglu_limit": "swiglu_limit",
        "tie_word_embeddings": "tie_word_embeddings",
    }
    for ours, theirs in simple.items():
        if theirs in d and d[theirs] is not None:
            kw[ours] = d[theirs]
    if "head_dim" not in kw and "hidden_size" in kw and "num_heads" in kw:
        kw["head_dim"] = kw["hidden_size"] // kw["num_heads"]
    for tok in ("bos_token_id", "eos_token_id"):
        val = d.get(tok, top.get(tok))
        if isinstance(val, list):
            val = val[0] if val else None
        if tok in d or tok in top:
            kw[tok] = val
    if "shared_intermediate_size" not in kw and "intermediate_size" in kw:
        kw["shared_intermediate_size"] = kw["intermediate_size"] * int(d.get("n_shared_experts", 1) or 1)

    # unsupported architecture switches
    act = d.get("hidden_act", "swigluoai")
    if act not in ("swigluoai", "silu"):
        problems.append(f"hidden_act {act!r} is not supported; MiniMax-M3 uses 'swigluoai'")
    if d.get("use_gemma_norm", True) is False:
        problems.append("use_gemma_norm=false is not supported; MiniMax-M3 norms scale by (1 + w)")
    if d.get("use_qk_norm", True) is False:
        problems.append("use_qk_norm=false is not supported; MiniMax-M3 normalises q and k per head")
    if d.get("qk_norm_type", "per_head") != "per_head":
        problems.append(f"qk_norm_type {d.get('qk_norm_type')!r} is not supported; expected 'per_head'")
    if d.get("attention_output_gate", False):
        problems.append("attention_output_gate=true is not supported by MiniMax-M3")
    if d.get("scoring_func", "sigmoid") != "sigmoid":
        problems.append(f"scoring_func {d.get('scoring_func')!r} is not supported; MiniMax-M3 routes with 'sigmoid'")
    if d.get("use_routing_bias", True) is False:
        problems.append("use_routing_bias=false is not supported; the router needs e_score_correction_bias")
    if int(d.get("n_shared_experts", 1) or 1) != 1:
        problems.append(f"n_shared_experts={d.get('n_shared_experts')} is not supported; expected 1")

    # RoPE
    rope = d.get("rope_parameters") or {}
    if rope and rope.get("rope_type", "default") != "default":
        problems.append(f"rope_type {rope.get('rope_type')!r} is not supported; expected 'default'")
    if d.get("rope_scaling"):
        problems.append("rope_scaling is not supported by MiniMax-M3")
    theta = rope.get("rope_theta", d.get("rope_theta"))
    if theta is not None:
        kw["rope_theta"] = float(theta)
    head_dim = kw.get("head_dim", M3Config.head_dim)
    factor = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    rdim = d.get("rotary_dim")
    if rdim is not None:
        kw["rotary_dim"] = int(rdim)
        if factor is not None and not math.isclose(float(factor) * head_dim, int(rdim)):
            problems.append(
                f"rotary_dim={rdim} contradicts partial_rotary_factor={factor} x head_dim={head_dim}; make them agree"
            )
    elif factor is not None:
        kw["rotary_dim"] = int(round(float(factor) * head_dim))

    n = int(kw.get("num_layers", M3Config.num_layers))
    # layer kinds: release form first, then transformers form
    sparse_cfg = d.get("sparse_attention_config")
    if sparse_cfg is not None and not isinstance(sparse_cfg, dict):
        problems.append("sparse_attention_config must be an object")
        sparse_cfg = None
    moe = _flag_list(d.get("moe_layer_freq"), n, "moe_layer_freq", problems)
    if moe is None:
        moe = _type_list(d.get("mlp_layer_types"), n, "mlp_layer_types", "sparse", "dense", problems)
    if moe is not None:
        kw["moe_layers"] = moe
    elif n != M3Config.num_layers:
        kw["moe_layers"] = (True,) * n

    sparse = None
    if sparse_cfg is not None:
        sc = sparse_cfg
        mapping = {
            "index_head_dim": "sparse_index_dim", "index_heads": "sparse_num_index_heads",
            "index_topk": "sparse_topk_blocks", "index_block_size": "sparse_block_size",
            "index_init_blocks": "sparse_init_block", "index_local_blocks": "sparse_local_block",
        }
        for ours, theirs in mapping.items():
            if theirs in sc:
                kw[ours] = int(sc[theirs])
        if sc.get("sparse_score_type", "max") != "max":
            problems.append(
                f"sparse_score_type {sc.get('sparse_score_type')!r} is not supported; only 'max' block scoring is"
            )
        sparse = _flag_list(sc.get("sparse_attention_freq"), n, "sparse_attention_freq", problems)
        if sc.get("use_sparse_attention", True) is False:
            sparse = (False,) * n
        dis = _flag_list(sc.get("sparse_disable_index_value"), n, "sparse_disable_index_value", problems)
        if sparse is not None and dis is not None:
            bad = [i for i in range(n) if sparse[i] and not dis[i]]
            if bad:
                problems.append(
                    f"sparse_disable_index_value is 0 on sparse layer(s) {bad}: the index value/output branch is "
                    "not supported (MiniMax-M3 disables it on every sparse layer)"
                )
    if sparse is None:
        sparse = _type_list(d.get("layer_types"), n, "layer_types", "minimax_m3_sparse", "full_attention", problems)
    for ours, theirs in {
        "index_heads": "index_n_heads", "index_head_dim": "index_head_dim", "index_block_size": "index_block_size",
        "index_topk": "index_topk_blocks", "index_local_blocks": "index_local_blocks",
    }.items():
        if theirs in d and ours not in kw:
            kw[ours] = int(d[theirs])
    if sparse is not None:
        kw["sparse_layers"] = sparse
    elif n != M3Config.num_layers:
        kw["sparse_layers"] = (False,) * n
    return kw, problems


def _validate(c: M3Config) -> list[str]:
    p: list[str] = []
    positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size", "dense_intermediate_size", "shared_intermediate_size", "num_experts",
                "top_k", "index_heads", "index_head_dim", "index_block_size", "index_topk")
    for name in positive:
        v = getattr(c, name)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            p.append(f"{name} must be a positive integer, got {v!r}")
    if p:
        return p
    if c.num_heads % c.num_kv_heads:
        p.append(f"num_attention_heads={c.num_heads} is not a multiple of num_key_value_heads={c.num_kv_heads}")
    if c.rotary_dim <= 0 or c.rotary_dim > c.head_dim or c.rotary_dim % 2:
        p.append(f"rotary_dim={c.rotary_dim} must be even and within (0, head_dim={c.head_dim}]")
    if c.rotary_dim > c.index_head_dim:
        p.append(f"rotary_dim={c.rotary_dim} exceeds index_head_dim={c.index_head_dim}")
    if c.top_k > c.num_experts:
        p.append(f"num_experts_per_tok={c.top_k} exceeds num_local_experts={c.num_experts}")
    if len(c.moe_layers) != c.num_layers:
        p.append(f"moe layer list has {len(c.moe_layers)} entries for {c.num_layers} layers")
    if len(c.sparse_layers) != c.num_layers:
        p.append(f"sparse layer list has {len(c.sparse_layers)} entries for {c.num_layers} layers")
    if any(c.sparse_layers) and c.index_heads != c.num_kv_heads:
        p.append(
            f"index heads ({c.index_heads}) differ from KV heads ({c.num_kv_heads}); MiniMax Sparse Attention "
            "selects blocks per KV group and needs one index head per KV head"
        )
    if c.index_local_blocks < 0 or c.index_init_blocks < 0:
        p.append("sparse_local_block and sparse_init_block must be >= 0")
    elif c.index_init_blocks + c.index_local_blocks > c.index_topk:
        p.append(
            f"init ({c.index_init_blocks}) + local ({c.index_local_blocks}) blocks exceed topk ({c.index_topk})"
        )
    if c.rms_norm_eps <= 0:
        p.append(f"rms_norm_eps must be > 0, got {c.rms_norm_eps}")
    if c.rope_theta <= 0:
        p.append(f"rope_theta must be > 0, got {c.rope_theta}")
    return p


def _tiny() -> M3Config:
    return M3Config(
        vocab_size=512, hidden_size=128, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=32, rotary_dim=16,
        max_position_embeddings=4096, intermediate_size=64, dense_intermediate_size=256,
        shared_intermediate_size=64, num_experts=8, top_k=2, moe_layers=(False, True, True, True),
        sparse_layers=(False, True, True, True), index_heads=2, index_head_dim=32, index_block_size=16,
        index_topk=2, index_local_blocks=1, bos_token_id=1, eos_token_id=2,
    )


def _small() -> M3Config:
    return M3Config(
        vocab_size=2048, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=64, rotary_dim=32,
        max_position_embeddings=65536, intermediate_size=128, dense_intermediate_size=512,
        shared_intermediate_size=128, num_experts=16, top_k=4, moe_layers=(False, True, True, True),
        sparse_layers=(False, True, True, True), index_heads=2, index_head_dim=64, index_block_size=256,
        index_topk=4, index_local_blocks=1, bos_token_id=1, eos_token_id=2,
    )


PRESETS: dict[str, M3Config] = {"tiny": _tiny(), "small": _small(), "m3": M3Config()}
