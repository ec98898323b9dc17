"""One sharding run of a ``--weights fp8`` build in a fresh interpreter (NxD's mock distribution): ``python -m
test.support.neuron.write_presharded_fp8 stream|nxd CKPT OUT TP [ep|tp]`` (the last: ``--decode-experts``) writes
``OUT/tp{r}_sharded_checkpoint.safetensors`` through ``neuron.rank_files.write_sharded`` (stream) or NxD's
``ModelBuilder.shard_checkpoint`` (nxd)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    mode, ckpt, out, tp = argv[0], argv[1], Path(argv[2]), int(argv[3])
    decode_experts = argv[4] if len(argv) > 4 else "ep"
    out.mkdir(parents=True, exist_ok=True)
    os.environ["BASE_COMPILE_WORK_DIR"] = str(out / "work") + "/"
    from test.support.neuron import standins

    standins.bootstrap()
    os.environ.pop("NXD_CPU_MODE", None)
    from minimax_m3.config import M3Config
    from minimax_m3.neuron.build import application, inference_config
    from minimax_m3.engine.spec import EngineSpec

    m3 = M3Config.from_pretrained(ckpt)
    spec = EngineSpec(ckpt, backend="neuron", tp=tp, ep=1, lnc=1, max_seq_len=256, max_batch=1,
                      context_buckets=(256,), token_buckets=(256,), weights="fp8",
                      decode_experts=decode_experts).resolve(m3)
    config = inference_config(spec, m3, skip_sharding=True)
    app = application(ckpt, config)
    if mode == "nxd":
        app.get_builder().shard_checkpoint(serialize_path=str(out))
    else:
        from minimax_m3.neuron.rank_files import write_sharded

        write_sharded(app, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
