"""``python -m test.support.hlo.contrib_dry_run ARGS``: the published community port (NxDI
``contrib/models/MiniMax-M3``) traced by the same harness at the same shapes as ``minimax-m3 compile --dry-run ARGS``,
so ``minimax-m3 graphs`` can put both ports side by side.

``M3_CONTRIB_SRC`` names the port's ``src/`` folder (``modeling_minimax_m3.py``) in a checkout of NxDI; it is read from
there and never copied. Its config is built the way its README does (the release's ``text_config`` promoted to the top
level through NxDI's ``load_pretrained_config``). Its MoE gets the same NxD settings as ours (no NKI blockwise kernel,
which cannot be traced here), so the two graphs differ only in the ports' own code. Needs ``NXDI_SRC``/``NXD_SRC``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

from . import standins_trace


def load_contrib():
    src = os.environ.get("M3_CONTRIB_SRC", "")
    if not (Path(src) / "modeling_minimax_m3.py").is_file():
        raise SystemExit(f"M3_CONTRIB_SRC={src!r} must name contrib/models/MiniMax-M3/src of an NxDI checkout")
    sys.path.insert(0, src)
    return importlib.import_module("modeling_minimax_m3")


def main(argv: list[str]) -> int:
    standins_trace.install()
    import torch
    from neuronx_distributed_inference.utils.hf_adapter import load_pretrained_config
    from transformers import PretrainedConfig

    from minimax_m3.config import parallel
    from minimax_m3.neuron import compile as ours
    from minimax_m3.neuron import trace as dry_run

    ap = argparse.ArgumentParser()
    ours.add_args(ap)
    args = ap.parse_args(argv)
    contrib = load_contrib()
    spec, config = ours.check_dry_run(args)  # the same spec, checks and shapes as ``compile --dry-run ARGS``
    ctx, tkg, batch = list(spec.context_buckets), list(spec.token_buckets), spec.max_batch
    nc = contrib.MiniMaxM3NeuronConfig(
        tp_degree=spec.tp, moe_ep_degree=spec.ep, moe_tp_degree=parallel.moe_tp(spec.tp, spec.ep),
        logical_nc_config=spec.lnc, batch_size=batch, max_batch_size=batch, ctx_batch_size=batch,
        tkg_batch_size=batch, seq_len=spec.max_seq_len, max_context_length=spec.max_context_len,
        torch_dtype=getattr(torch, spec.dtype), enable_bucketing=True, context_encoding_buckets=ctx,
        token_generation_buckets=tkg, padding_side="right", router_config={"act_fn": "sigmoid", "dtype": "float32"},
        attn_kernel_enabled=False, output_logits=False,
    )
    raw = json.loads((Path(args.model) / "config.json").read_text())
    text = dict(raw.get("text_config", raw), model_type="minimax_m3", architectures=["MiniMaxM3SparseForCausalLM"])
    hf = PretrainedConfig(**text)
    hf._name_or_path = args.model
    cfg = contrib.MiniMaxM3InferenceConfig(nc, load_config=load_pretrained_config(hf_config=hf))
    cfg._name_or_path = args.model
    app = contrib.NeuronMiniMaxM3ForCausalLM(args.model, cfg)
    path = dry_run.trace(app, args.compiled, "contrib", config)
    print(f"traced the published port -> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
