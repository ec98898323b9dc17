"""Dequantization graded by transformers' own MXFP8 loading; reference logits from quantized checkpoints graded
against their dequantized twins (exact in float32)."""

import pytest
import torch

from minimax_m3.checkpoint import open_source
from minimax_m3.checkpoint.convert import convert
from minimax_m3.checkpoint.synthetic import write_synthetic
from minimax_m3.reference.cache import KVCache
from minimax_m3.reference.loader import load_model

LM = "language_model.model"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    return {fmt: write_synthetic(root / fmt, "tiny", seed=7, fmt=fmt) for fmt in ("mxfp8", "nvfp4")}, root


def _tf_name(key: str) -> str:
    """Release key → transformers' parameter name (conversion_mapping['minimax_m3_vl'] renames)."""
    k = key.replace(LM + ".", "model.language_model.")
    k = k.replace(".self_attn.index_q_proj.", ".self_attn.indexer.q_proj.")
    k = k.replace(".self_attn.index_k_proj.", ".self_attn.indexer.k_proj.")
    return k.replace(".block_sparse_moe.shared_experts.", ".mlp.shared_experts.")


def test_mxfp8_dequant_equals_transformers_loading(ckpts):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    dirs, _ = ckpts
    model = transformers.MiniMaxM3SparseForConditionalGeneration.from_pretrained(dirs["mxfp8"], dtype=torch.float32)
    tf = model.state_dict()
    src = open_source(dirs["mxfp8"])
    quantized = [k for k, lg in src.logical.items() if lg.encoding == "mxfp8"]
    compared = 0
    for key in quantized:
        mine = src.get(key)
        if ".experts." in key and ".shared_experts." not in key:
            layer, e, w = key.split(".layers.")[1].split(".")[0], int(key.split(".experts.")[1].split(".")[0]), \
                key.split(".")[-2]
            base = f"model.language_model.layers.{layer}.mlp.experts."
            if w == "w2":
                theirs = tf[base + "down_proj"][e]
            else:
                gu = tf[base + "gate_up_proj"][e]  # [2I, H], gate first
                half = gu.shape[0] // 2
                theirs = gu[:half] if w == "w1" else gu[half:]
        elif key.endswith(("gate_proj.weight", "up_proj.weight")):
            fused = tf[_tf_name(key).rsplit(".", 2)[0] + ".gate_up_proj.weight"]
            half = fused.shape[0] // 2
            theirs = fused[:half] if "gate_proj" in key else fused[half:]
        else:
            theirs = tf[_tf_name(key)]
        assert theirs.dtype == torch.float32 and torch.equal(mine, theirs), key
        compared += 1
    # every quantized tensor of the tiny checkpoint: 4 layers x (q,k,v,o) + 3 x index q/k + dense 3
    # + 3 MoE layers x (8 experts x 3 + shared 3)
    assert compared == len(quantized) == 16 + 6 + 3 + 3 * (24 + 3)


def _logits(model, ids):
    s = ids.shape[1]
    cache = KVCache(model.config, 1, s, torch.float32, "cpu")
    pos = torch.arange(s).unsqueeze(0)
    return model(ids, pos, cache, s, decode=False)


@pytest.mark.parametrize("fmt,twin_dtype", [("mxfp8", torch.bfloat16), ("nvfp4", torch.float32)])
def test_reference_logits_equal_dequantized_twin(ckpts, fmt, twin_dtype):
    dirs, root = ckpts
    twin = root / f"twin-{fmt}"
    aud = convert(dirs[fmt], twin, to="bf16", dtype=twin_dtype, verify=True, progress=False)
    assert aud.ok
    assert "quantization_config" not in (twin / "config.json").read_text()
    q_model, t_model = load_model(dirs[fmt]), load_model(twin)
    ids = torch.randint(0, 512, (1, 70), generator=torch.Generator().manual_seed(0))
    a, b = _logits(q_model, ids), _logits(t_model, ids)
    assert torch.equal(a, b)
    assert a.abs().max() > 0.1  # a live model, not zeros
    # and the quantized model really differs from the bf16 weights it was quantized from
    bf = load_model(write_synthetic(root / f"bf16-{fmt}", "tiny", seed=7))
    assert not torch.equal(_logits(bf, ids), a)
