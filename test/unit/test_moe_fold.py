"""The routed scaling factor folded into the NxDI expert down projection (issue 15 item 3), on both conversion
paths (streamed state dict for NxDI's loader, the on-disk converter's per-expert slabs), graded by hand against
the release tensors; the reference backend's own weights stay unscaled."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from minimax_m3.checkpoint import open_source
from minimax_m3.checkpoint.convert import convert, stream_state_dict
from minimax_m3.config import M3Config

LM = "language_model.model"
DOWN = "layers.{L}.moe.expert_mlps.mlp_op.down_proj"


def _moe_layer(c: M3Config) -> int:
    return next(i for i in range(c.num_layers) if c.moe_layers[i])


def _expected(src, c: M3Config, L: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``scale * w2ᵀ`` per expert, the product exact in float64 and rounded once to ``dtype``."""
    m = f"{LM}.layers.{L}.block_sparse_moe"
    w2 = [src.get(f"{m}.experts.{e}.w2.weight").to(dtype).double() for e in range(c.num_experts)]
    return torch.stack([(scale * w).t() for w in w2]).to(dtype)


@pytest.mark.parametrize("scale", [2.0, 2.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_state_dict_folds_the_scale(tiny_ckpt, scale, dtype):
    c = M3Config.from_pretrained(tiny_ckpt).replace(routed_scaling_factor=scale)
    L = _moe_layer(c)
    sd = dict(stream_state_dict(tiny_ckpt, to="neuron", dtype=dtype, tp=2, config=c))
    src = open_source(tiny_ckpt, c)
    want = _expected(src, c, L, scale, dtype)
    got = sd[DOWN.format(L=L) + ".weight"]
    assert got.dtype == dtype and torch.equal(got, want)
    assert not sd[DOWN.format(L=L) + ".bias"].any()  # a zero bias scaled stays zero


@pytest.mark.parametrize("scale", [2.0, 2.5])
def test_disk_converter_slabs_fold_the_scale(tiny_ckpt, tmp_path, scale):
    c = M3Config.from_pretrained(tiny_ckpt).replace(routed_scaling_factor=scale)
    L = _moe_layer(c)
    out = tmp_path / "nx"
    convert(tiny_ckpt, out, to="neuron", tp=2, progress=False, config=c)
    sd = {}
    for f in sorted(out.glob("*.safetensors")):
        sd.update(load_file(f))
    want = _expected(open_source(tiny_ckpt, c), c, L, scale, torch.bfloat16)
    assert torch.equal(sd[DOWN.format(L=L) + ".weight"], want)


def test_reference_weights_are_not_scaled(tiny_ckpt):
    """The reference backend applies the factor at run time: its expert weights are the release's."""
    c = M3Config.from_pretrained(tiny_ckpt)
    L = _moe_layer(c)
    sd = dict(stream_state_dict(tiny_ckpt, to="reference", dtype=torch.float32, config=c))
    src = open_source(tiny_ckpt, c)
    m = f"{LM}.layers.{L}.block_sparse_moe"
    down = sd[f"layers.{L}.moe.experts.down"]
    assert torch.equal(down[0], src.get(f"{m}.experts.0.w2.weight").float().t())
