"""Pre-sharded checkpoints two ways, each in a fresh interpreter (NxD's process-global sharding state never leaks).

``python -m test.support.neuron.write_presharded MODE CKPT OUT TP EP [DTYPE]`` builds ``NeuronMiniMaxM3ForCausalLM`` for
``CKPT`` at TP / EP (``save_sharded_checkpoint=True``) and writes ``OUT/tp{r}_sharded_checkpoint.safetensors`` for
every rank by

* ``nxd``: NxD's ``ModelBuilder.shard_checkpoint(serialize_path=OUT)``, the path of NxDI's ``shard_weights`` (the
  whole converted state dict in memory, every rank's shard kept until it returns) — the oracle;
* ``stream``: :func:`minimax_m3.neuron.rank_files.write_sharded`, one conversion unit at a time;
* ``hook``: NxDI's ``shard_weights(OUT/compiled)`` as ``compile()`` calls it (the port's override streams), into
  ``OUT/compiled/weights/``.

It writes ``OUT/report.json`` with the seconds taken, the resident memory when the sharding starts and the peak
resident memory during it (``VmHWM`` reset at the start), so the difference is the sharding's own peak.

As ``test/support/hlo/nxd_shard_tp64.py``: NxD's sharding runs outside NxDI's CPU mode (``NXD_CPU_MODE`` unset), as on
a trn2 host.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from . import result_cache


def _status_mb(field: str) -> float:
    """``VmHWM`` (peak resident) or ``VmRSS`` of this process's own address space, in MiB. Not ``ru_maxrss``: after
    fork + exec it starts from the parent's peak (the kernel copies the forked address space's high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _reset_peak() -> None:
    """Reset this process's peak resident size to its current size (Linux ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def build_app(ckpt: str, tp: int, ep: int, dtype: str = "bfloat16", skip_sharding: bool = True):
    from minimax_m3.neuron.build import inference_config
    from minimax_m3.neuron.model import NeuronMiniMaxM3ForCausalLM
    from test.support.neuron.cpu_plugin import nxdi_spec

    spec, m3 = nxdi_spec(ckpt, "neuron", tp=tp, ep=ep, lnc=2 if tp == 64 else 1, dtype=dtype, max_batch=1,
                         max_seq_len=256, context_buckets=(256,), token_buckets=(256,))  # sharded weights saved
    config = inference_config(spec, m3, skip_sharding=skip_sharding, attn_kernel_enabled=False)
    return NeuronMiniMaxM3ForCausalLM(ckpt, config)


def wide_config(layers: int = 3, experts: int = 64, expert_intermediate: int = 256, vocab: int = 32768):
    """MiniMax-M3 at full width (hidden 6144, 64 q / 4 KV / 4 index heads of 128, dense 12288, shared 3072) with
    one dense layer then sparse MoE layers, fewer and narrower experts and a smaller vocabulary (so the checkpoint
    stays a few GB): the per-unit memory of the sharding at real attention and MLP widths."""
    from minimax_m3.config import M3Config

    moe = (False,) + (True,) * (layers - 1)
    return M3Config.preset("m3").replace(num_layers=layers, num_experts=experts, intermediate_size=expert_intermediate,
                                         vocab_size=vocab, moe_layers=moe, sparse_layers=moe, bos_token_id=1,
                                         eos_token_id=2)


def measure(root: Path, tp: int = 64, ep: int = 64) -> dict:
    """Both paths on :func:`wide_config` at TP / EP (one process each, run one after the other)."""
    from minimax_m3.checkpoint.synthetic import write_synthetic

    ckpt = root / "wide"
    if not (ckpt / "config.json").is_file():
        write_synthetic(ckpt, wide_config(), seed=0)
    size = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
    out = {"checkpoint_bytes": size}
    for mode in ("stream", "nxd"):
        out[mode] = run(mode, ckpt, root / mode, tp, ep, timeout=3600, cache=False)
        out[mode]["files_bytes"] = sum(p.stat().st_size for p in (root / mode).glob("tp*.safetensors"))
    out["bit_equal_ranks"] = _equal_ranks(root / "stream", root / "nxd", sorted({0, 1, tp // 2, tp - 1}))
    for mode in ("stream", "nxd"):
        for p in (root / mode).glob("tp*.safetensors"):
            p.unlink()
    return out


def _equal_ranks(a: Path, b: Path, ranks: list[int]) -> list[int]:
    """The ranks among ``ranks`` whose two files hold the same keys and bit-equal tensors."""
    import torch
    from safetensors.torch import load_file

    ok = []
    for r in ranks:
        x, y = (load_file(str(d / f"tp{r}_sharded_checkpoint.safetensors")) for d in (a, b))
        if set(x) == set(y) and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x):
            ok.append(r)
    return ok


def main(argv: list[str]) -> int:
    if argv[0] == "measure":
        print(json.dumps(measure(Path(argv[1])), indent=1))
        return 0
    mode, ckpt, out, tp, ep = argv[0], argv[1], Path(argv[2]), int(argv[3]), int(argv[4])
    dtype = argv[5] if len(argv) > 5 else "bfloat16"
    out.mkdir(parents=True, exist_ok=True)
    os.environ["BASE_COMPILE_WORK_DIR"] = str(out / "work") + "/"

    from test.support.neuron import standins

    standins.bootstrap()
    os.environ.pop("NXD_CPU_MODE", None)
    app = build_app(ckpt, tp, ep, dtype, skip_sharding=mode != "hook")
    _reset_peak()
    before = _status_mb("VmRSS")
    t0 = time.perf_counter()
    if mode == "nxd":
        app.get_builder().shard_checkpoint(serialize_path=str(out))
        extra = {}
    elif mode == "stream":
        from minimax_m3.neuron.rank_files import write_sharded

        extra = write_sharded(app, out)
    elif mode == "hook":  # NxDI's shard_weights as compile() calls it: the port's override streams
        import minimax_m3.neuron.rank_files as rank_files

        calls, real = [], rank_files.write_sharded
        rank_files.write_sharded = lambda *a, **k: calls.append(real(*a, **k))
        app.shard_weights(str(out / "compiled"))
        extra = {"units": calls[0]["units"] if calls else 0, "write_sharded_calls": len(calls)}
    elif mode == "misnamed":  # a converter rule that misnames one key: refused by name, no rank file left
        from minimax_m3.checkpoint import CheckpointError
        from minimax_m3.neuron.rank_files import write_sharded

        stream = app.get_state_dict_stream

        def renamed(*a):
            for name, t in stream(*a):
                yield (name.replace(MISNAMED, MISNAMED + "_typo") if name == MISNAMED else name), t

        app.get_state_dict_stream = renamed
        try:
            write_sharded(app, out)
            extra = {"error": None}
        except CheckpointError as exc:
            extra = {"error": str(exc)}
        extra["files"] = sorted(p.name for p in out.glob("tp*"))
    else:
        raise SystemExit(f"unknown mode {mode!r}: nxd, stream, hook or misnamed")
    report = {"mode": mode, "tp": tp, "ep": ep, "seconds": time.perf_counter() - t0, "rss_before_mb": before,
              "peak_mb": _status_mb("VmHWM"),
              **{k: v for k, v in extra.items() if k in ("units", "keys", "bytes", "max_unit_bytes",
                                                                 "write_sharded_calls", "error", "files")}}
    (out / "report.json").write_text(json.dumps(report))
    return 0


MISNAMED = "layers.1.post_attention_layernorm.weight"  # no NxD preshard hook reads it


def run(mode: str, ckpt: Path, out: Path, tp: int, ep: int, dtype: str = "bfloat16", timeout: float = 900,
        cache: bool = True) -> dict:
    """:func:`main` in a fresh interpreter (this one's); returns ``report.json``.

    A run is a pure function of the checkpoint's files, its arguments and the code: with ``cache`` its output folder
    is kept under a hash of all of them (:mod:`.result_cache`), so the same run again (several tests read one layout;
    a second run of the suite) copies the rank files and the report of the first. The report's seconds and memory
    are then that run's; :func:`measure` always runs."""
    root = Path(__file__).resolve().parents[3]

    def shard() -> str:
        proc = subprocess.run([sys.executable, "-m", "test.support.neuron.write_presharded", mode, str(ckpt), str(out),
                               str(tp), str(ep), dtype], cwd=root, capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"{mode} sharding subprocess failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
        return proc.stdout

    out.mkdir(parents=True, exist_ok=True)
    if cache:
        result_cache.cached("test.support.neuron.write_presharded", [mode, str(tp), str(ep), dtype], [ckpt], out,
                            shard)
    else:
        shard()
    return json.loads((out / "report.json").read_text())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
