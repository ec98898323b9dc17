"""Synthetic checkpoints in the release's exact layout (key names, dtypes, sharding, config form).

``write_synthetic(out, "tiny", seed=0)`` writes ``model-0000k-of-0000n.safetensors`` shards, the index JSON,
a release-form ``config.json``, ``generation_config.json`` and a toy byte-level tokenizer with M3's special tokens
and chat template (``chat_template.jinja``, written from the release's format: ``chat_template.py``). Weights are
deterministic by seed, scaled so activations stay O(1), with randomised Gemma norm weights and routing bias
(zero defaults would hide a missing ``(1 + w)`` or a missing bias).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from .._atomic import staged_directory
from ..config.m3 import M3Config
from . import formats as F
from .mapping import release_shapes
from .chat_template import M3_CHAT_TEMPLATE
from .toy_tokenizer import write_toy_tokenizer

LM = "language_model.model"
EXPERT = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")
TINY_VISION = {
    "model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2,
    "image_size": 56, "layer_norm_eps": 1e-5,
}


class _Rng:
    def __init__(self, seed: int):
        self.g = torch.Generator().manual_seed(seed)

    def normal(self, shape, std: float, dtype=torch.bfloat16) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.g) * std).to(dtype)

    def linear(self, out_f: int, in_f: int, gain: float = 1.0, dtype=torch.bfloat16) -> torch.Tensor:
        return self.normal((out_f, in_f), gain / math.sqrt(in_f), dtype)


def text_tensors(c: M3Config, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Every text-backbone tensor of the release layout, in order, for config ``c``."""
    r = _Rng(seed)
    h = c.hidden_size
    yield f"{LM}.embed_tokens.weight", r.normal((c.vocab_size, h), 1.0)
    for i in range(c.num_layers):
        p = f"{LM}.layers.{i}"
        yield f"{p}.input_layernorm.weight", r.normal((h,), 0.2)
        yield f"{p}.post_attention_layernorm.weight", r.normal((h,), 0.2)
        yield f"{p}.self_attn.q_proj.weight", r.linear(c.num_heads * c.head_dim, h)
        yield f"{p}.self_attn.k_proj.weight", r.linear(c.num_kv_heads * c.head_dim, h)
        yield f"{p}.self_attn.v_proj.weight", r.linear(c.num_kv_heads * c.head_dim, h)
        yield f"{p}.self_attn.o_proj.weight", r.linear(h, c.num_heads * c.head_dim)
        yield f"{p}.self_attn.q_norm.weight", r.normal((c.head_dim,), 0.2)
        yield f"{p}.self_attn.k_norm.weight", r.normal((c.head_dim,), 0.2)
        if c.sparse_layers[i]:
            yield f"{p}.self_attn.index_q_proj.weight", r.linear(c.index_heads * c.index_head_dim, h, 2.0)
            yield f"{p}.self_attn.index_k_proj.weight", r.linear(c.index_head_dim, h, 2.0)
            yield f"{p}.self_attn.index_q_norm.weight", r.normal((c.index_head_dim,), 0.2)
            yield f"{p}.self_attn.index_k_norm.weight", r.normal((c.index_head_dim,), 0.2)
        if c.moe_layers[i]:
            m = f"{p}.block_sparse_moe"
            yield f"{m}.gate.weight", r.linear(c.num_experts, h, 1.0, torch.float32)
            yield f"{m}.e_score_correction_bias", r.normal((c.num_experts,), 0.1, torch.float32)
            for e in range(c.num_experts):
                yield f"{m}.experts.{e}.w1.weight", r.linear(c.intermediate_size, h, 2.0)
                yield f"{m}.experts.{e}.w2.weight", r.linear(h, c.intermediate_size)
                yield f"{m}.experts.{e}.w3.weight", r.linear(c.intermediate_size, h, 2.0)
            s = c.shared_intermediate_size
            yield f"{m}.shared_experts.gate_proj.weight", r.linear(s, h, 2.0)
            yield f"{m}.shared_experts.up_proj.weight", r.linear(s, h, 2.0)
            yield f"{m}.shared_experts.down_proj.weight", r.linear(h, s)
        else:
            d = c.dense_intermediate_size
            yield f"{p}.mlp.gate_proj.weight", r.linear(d, h, 2.0)
            yield f"{p}.mlp.up_proj.weight", r.linear(d, h, 2.0)
            yield f"{p}.mlp.down_proj.weight", r.linear(h, d)
    yield f"{LM}.norm.weight", r.normal((h,), 0.2)
    yield "language_model.lm_head.weight", r.linear(c.vocab_size, h, 4.0)


def vision_tensors(c: M3Config, v: dict, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """The vision tower and projectors (present in every release; skipped by the text backbone)."""
    r = _Rng(seed + 1)
    hv, iv, pt = v["hidden_size"], v["intermediate_size"], v["patch_size"]
    vm = "vision_tower.vision_model"
    yield f"{vm}.embeddings.patch_embedding.weight", r.normal((hv, 3, v["temporal_patch_size"], pt, pt), 0.02,
                                                              torch.float32)
    yield f"{vm}.pre_layrnorm.weight", r.normal((hv,), 0.02)
    yield f"{vm}.pre_layrnorm.bias", r.normal((hv,), 0.02)
    for i in range(v["num_hidden_layers"]):
        lp = f"{vm}.encoder.layers.{i}"
        for name, (o, n) in {"self_attn.q_proj": (hv, hv), "self_attn.k_proj": (hv, hv),
                             "self_attn.v_proj": (hv, hv), "self_attn.out_proj": (hv, hv),
                             "mlp.fc1": (iv, hv), "mlp.fc2": (hv, iv)}.items():
            yield f"{lp}.{name}.weight", r.linear(o, n)
            yield f"{lp}.{name}.bias", r.normal((o,), 0.02)
        for ln in ("layer_norm1", "layer_norm2"):
            yield f"{lp}.{ln}.weight", r.normal((hv,), 0.02)
            yield f"{lp}.{ln}.bias", r.normal((hv,), 0.02)
    h, merged = c.hidden_size, c.hidden_size * v["spatial_merge_size"] ** 2
    for name, (o, n) in {"multi_modal_projector.linear_1": (h, hv), "multi_modal_projector.linear_2": (h, h),
                         "patch_merge_mlp.linear_1": (h, merged), "patch_merge_mlp.linear_2": (h, h)}.items():
        yield f"{name}.weight", r.linear(o, n)
        yield f"{name}.bias", r.normal((o,), 0.02)


def _shard_plan(items: list[tuple[str, torch.Tensor]], num_shards: int) -> list[list[tuple[str, torch.Tensor]]]:
    total = sum(t.numel() * t.element_size() for _, t in items)
    target = total / num_shards
    shards: list[list] = [[]]
    acc = 0
    for key, t in items:
        if acc >= target * len(shards) and len(shards) < num_shards:
            shards.append([])
        shards[-1].append((key, t))
        acc += t.numel() * t.element_size()
    return shards


def write_checkpoint_dir(out: Path, config_dict: dict, tensors: list[tuple[str, torch.Tensor]], num_shards: int,
                         extra_files: dict[str, str] | None = None, force: bool = False,
                         finish=None) -> Path:
    """Write ``tensors`` as a sharded safetensors checkpoint into ``out`` atomically (temp dir, then rename)."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not force:
        raise FileExistsError(f"{out} exists and is not empty; choose another --out or pass --force")
    with staged_directory(out) as tmp:
        shards = _shard_plan(tensors, max(1, num_shards))
        n = len(shards)
        weight_map, total = {}, 0
        for k, shard in enumerate(shards, start=1):
            name = f"model-{k:05d}-of-{n:05d}.safetensors"
            save_file({key: t.contiguous() for key, t in shard}, str(tmp / name), metadata={"format": "pt"})
            for key, t in shard:
                weight_map[key] = name
                total += t.numel() * t.element_size()
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(config_dict, indent=2) + "\n")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text)
        if finish is not None:
            finish(tmp)
    return out


def quantize_items(c: M3Config, items: list[tuple[str, torch.Tensor]], fmt: str) -> tuple[list, dict, dict]:
    """Quantize release tensors the way the published producers do; returns (items, quantization_config,
    extra files). ``mxfp8``: every text Linear except routers (NVIDIA's MiniMax-M3-MXFP8). ``nvfp4``: routed experts
    NVFP4 (w1/w3 of an expert share ``weight_scale_2``, ``input_scale`` = 1.0), everything else as MXFP8 (ModelOpt
    ``MIXED_PRECISION``)."""
    if fmt == "bf16":
        return items, {}, {}
    if fmt not in ("mxfp8", "nvfp4"):
        raise ValueError(f"unknown format {fmt!r}; choose bf16, mxfp8 or nvfp4")
    kinds = release_shapes(c)
    tensors = dict(items)
    gates = sorted(f"{LM}.layers.{i}.block_sparse_moe.gate" for i in range(c.num_layers) if c.moe_layers[i])
    head = ["lm_head", "model.embed_tokens", "vision_tower", "multi_modal_projector", "patch_merge_mlp"]
    out, layers = [], {}
    for key, t in items:
        if kinds.get(key, (None, ""))[1] != "linear":
            out.append((key, t))
            continue
        module = key[: -len(".weight")]
        if fmt == "nvfp4" and EXPERT.search(key):
            partner = {"w1": "w3", "w3": "w1", "w2": "w2"}[key.rsplit(".", 2)[-2]]
            s2 = F.nvfp4_global_scale(t, tensors[module[:-2] + partner + ".weight"])
            packed, ws, s2 = F.nvfp4_quantize(t, s2)
            out += [(key, packed), (module + ".weight_scale", ws), (module + ".weight_scale_2", s2),
                    (module + ".input_scale", torch.tensor(1.0, dtype=torch.float32))]
            layers[module] = {"quant_algo": "NVFP4", "group_size": F.NV_BLOCK}
        else:
            q, sc = F.mxfp8_quantize(t)
            out += [(key, q), (module + ".weight_scale_inv", sc)]
            layers[module] = {"quant_algo": "MXFP8"}
    if fmt == "mxfp8":
        qc = {"quant_method": "mxfp8", "activation_scheme": "dynamic", "weight_block_size": [1, F.MX_BLOCK],
              "ignored_layers": head + gates}
        return out, qc, {}
    quant = {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "exclude_modules": head + gates,
             "quantized_layers": layers}
    hf = {"producer": {"name": "modelopt", "version": "synthetic"}, "quantization": quant}
    return out, {**quant, "quant_method": "modelopt"}, {"hf_quant_config.json": json.dumps(hf, indent=2) + "\n"}


def write_synthetic(out: str | Path, preset: str | M3Config = "tiny", seed: int = 0, num_shards: int | None = None,
                    force: bool = False, fmt: str = "bf16", chat_template: str = M3_CHAT_TEMPLATE) -> Path:
    """Write a synthetic checkpoint in the release layout (``fmt``: bf16, mxfp8 or nvfp4); returns its directory.
    ``chat_template``: M3's (its fixed system block is ~810 ids in the byte-level toy tokenizer); a test that needs
    short chat prompts may pass ``toy_tokenizer.CHAT_TEMPLATE``."""
    c = M3Config.preset(preset) if isinstance(preset, str) else preset
    if c.num_layers * c.hidden_size > 64 * 4096:
        raise ValueError("synthetic checkpoints are for CPU-sized presets (tiny, small); not the full model")
    items = list(text_tensors(c, seed)) + list(vision_tensors(c, TINY_VISION, seed))
    items, qc, extra = quantize_items(c, items, fmt)
    if num_shards is None:
        num_shards = 2 if c.num_layers > 1 else 1
    gen = {"bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id, "do_sample": False}
    config = c.to_release_dict(vision_config=dict(TINY_VISION))
    if qc:
        config["quantization_config"] = qc
    return write_checkpoint_dir(
        Path(out), config, items, num_shards,
        {"generation_config.json": json.dumps(gen, indent=2) + "\n", **extra}, force=force,
        finish=lambda d: write_toy_tokenizer(d, vocab_size=c.vocab_size, bos_token_id=c.bos_token_id,
                                             eos_token_id=c.eos_token_id, chat_template=chat_template),
    )
