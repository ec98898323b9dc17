"""Conversion throughput and peak memory on a multi-GB synthetic checkpoint (a script, not a test).

Builds a bf16 checkpoint (wide hidden size, few layers) and its MXFP8 quantization in a temporary directory, then
times, each in a fresh subprocess: a plain copy of the source shards (``shutil.copyfile`` = copy_file_range, then
fsync), ``convert --to neuron`` from bf16 and ``convert --to bf16`` from MXFP8. Prints GB/s beside the copy's and peak
RSS beside the largest layer. Page cache: before each timed step the source shards are read once (untimed), so the
copy and the conversion both read the same bytes from a warm cache; both end with every output byte fsynced.
For information it also times a copy through the converter's own writer (O_DIRECT, ``checkpoint.direct``), since the
conversion writes that way and a plain copy does not.

    .venv/bin/python scripts/bench_convert.py [--hidden 4096] [--experts 32] [--layers 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from minimax_m3.checkpoint.synthetic import TINY_VISION, quantize_items, text_tensors, vision_tensors
from minimax_m3.checkpoint.mapping import unit_of
from minimax_m3.config import M3Config


def bench_config(hidden: int, experts: int, layers: int) -> M3Config:
    return M3Config(
        vocab_size=32768, hidden_size=hidden, num_layers=layers, num_heads=32, num_kv_heads=4, head_dim=128,
        rotary_dim=64, intermediate_size=hidden // 2, dense_intermediate_size=2 * hidden,
        shared_intermediate_size=hidden // 2, num_experts=experts, top_k=4,
        moe_layers=(False,) + (True,) * (layers - 1),
        sparse_layers=(False,) + (True,) * (layers - 1), index_heads=4, index_head_dim=128, index_block_size=128,
        index_topk=16, bos_token_id=1, eos_token_id=2)


def write_streamed(out: Path, c: M3Config, fmt: str) -> None:
    """One shard per layer (plus globals), generated and quantized unit by unit to bound memory."""
    out.mkdir(parents=True)
    glob, layer, cur = [], [], None
    for key, t in text_tensors(c, 0):
        u = unit_of(key)
        if layer and u != cur:
            _flush(out, c, fmt, cur, layer)
            layer = []
        if u is None:
            glob.append((key, t))
        else:
            cur = u
            layer.append((key, t))
    if layer:
        _flush(out, c, fmt, cur, layer)
    _flush(out, c, fmt, None, glob + list(vision_tensors(c, TINY_VISION, 0)))
    weight_map = {}
    for f in sorted(out.glob("*.safetensors")):
        from safetensors import safe_open
        with safe_open(str(f), "pt") as h:
            weight_map.update({k: f.name for k in h.keys()})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    cfg = c.to_release_dict(vision_config=dict(TINY_VISION))
    _, qc, extra = quantize_items(c, [], fmt)
    if qc:
        cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg))


def _flush(out: Path, c: M3Config, fmt: str, unit, items) -> None:
    items, _, _ = quantize_items(c, items, fmt)
    name = "model-globals.safetensors" if unit is None else f"model-layer-{unit:03d}.safetensors"
    save_file({k: t.contiguous() for k, t in items}, str(out / name), metadata={"format": "pt"})


def _child(code: str, *args: str) -> tuple[float, int]:
    """Run ``code`` in a fresh python; it times its own work (imports excluded). Returns (seconds, peak RSS)."""
    r = subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True, text=True)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return out["seconds"], out["rss"]


# VmHWM (peak resident set of this process image; reset by exec, unlike ru_maxrss which a child inherits from
# the parent that forked it)
_TAIL = """
import json
dt = time.perf_counter() - t0
hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0].split()[1]
print(json.dumps({"seconds": dt, "rss": int(hwm) * 1024}))
"""
COPY = """
import os, shutil, sys, time
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
t0 = time.perf_counter()
for n in sorted(os.listdir(src)):
    if n.endswith('.safetensors'):
        shutil.copyfile(os.path.join(src, n), os.path.join(dst, n))
        fd = os.open(os.path.join(dst, n), os.O_RDONLY); os.fsync(fd); os.close(fd)
""" + _TAIL
CONVERT = """
import sys, time, torch
from minimax_m3.checkpoint.convert import convert
torch.empty(2, device="meta").float() + 1.0  # warm torch's lazy meta-kernel imports
t0 = time.perf_counter()
convert(sys.argv[1], sys.argv[2], to=sys.argv[3], progress=False)
""" + _TAIL
DIRECT_COPY = """
import os, sys, time
from minimax_m3.checkpoint.direct import DirectFile
src, dst = sys.argv[1], sys.argv[2]
os.makedirs(dst)
buf = bytearray(32 << 20)
t0 = time.perf_counter()
for n in sorted(os.listdir(src)):
    if n.endswith('.safetensors'):
        with open(os.path.join(src, n), 'rb', buffering=0) as f, DirectFile(os.path.join(dst, n)) as g:
            while k := f.readinto(buf):
                g.write(memoryview(buf)[:k])
            g.flush(); os.fsync(g.fileno())
""" + _TAIL
IDLE = """
import time, torch, minimax_m3.checkpoint.convert
t0 = time.perf_counter()
""" + _TAIL


def _size(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


def warm(d: Path) -> None:
    """Read every shard once so that the timed step that follows reads from the page cache."""
    buf = bytearray(64 << 20)
    for p in sorted(d.glob("*.safetensors")):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def largest_layer(out: Path) -> int:
    """Bytes of the largest unit (one shard per unit) of a converted checkpoint."""
    return max(p.stat().st_size for p in out.glob("*.safetensors"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--keep", default=None, help="build (or reuse) the checkpoints here and keep them")
    a = ap.parse_args()
    c = bench_config(a.hidden, a.experts, a.layers)
    tmp = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="bench-convert-", dir=a.dir))
    try:
        t = time.perf_counter()
        for fmt in ("bf16", "mxfp8"):
            if not (tmp / fmt / "config.json").is_file():
                shutil.rmtree(tmp / fmt, ignore_errors=True)
                write_streamed(tmp / fmt, c, fmt)
        print(f"built checkpoints in {time.perf_counter() - t:.0f} s: bf16 {_size(tmp / 'bf16') / 1e9:.2f} GB, "
              f"mxfp8 {_size(tmp / 'mxfp8') / 1e9:.2f} GB ({tmp})")
        _, idle = _child(IDLE)
        load0 = os.getloadavg()
        rows = []
        for name, src, to in (("bf16 -> neuron", "bf16", "neuron"), ("mxfp8 -> bf16", "mxfp8", "bf16")):
            warm(tmp / src)
            copy_s, _ = _child(COPY, str(tmp / src), str(tmp / "copy"))
            shutil.rmtree(tmp / "copy")
            warm(tmp / src)
            direct_s, _ = _child(DIRECT_COPY, str(tmp / src), str(tmp / "copy"))
            shutil.rmtree(tmp / "copy")
            warm(tmp / src)
            conv_s, rss = _child(CONVERT, str(tmp / src), str(tmp / "out"), to)
            src_b, out_b = _size(tmp / src), _size(tmp / "out")
            layer = largest_layer(tmp / "out")
            # plain copy of the same bytes: the larger side of the conversion, at the measured copy rate
            copy_gbs = src_b / copy_s / 1e9
            moved = max(src_b, out_b)
            conv_gbs = moved / conv_s / 1e9
            rows.append((name, src_b, out_b, conv_s, conv_gbs, copy_s, copy_gbs, rss, layer, src_b / direct_s / 1e9))
            shutil.rmtree(tmp / "out")
        load1 = os.getloadavg()
        print(f"machine: {os.cpu_count()} cores, torch {torch.__version__}, load avg (1/5/15 min) "
              f"{'/'.join(f'{x:.1f}' for x in load0)} before, {'/'.join(f'{x:.1f}' for x in load1)} after; "
              f"idle python+torch RSS {idle / 1e9:.2f} GB; source read once before each timed step (warm cache)")
        for name, sb, ob, cs, cg, ks, kg, rss, layer, dg in rows:
            print(f"{name}: source {sb / 1e9:.2f} GB -> output {ob / 1e9:.2f} GB in {cs:.1f} s = {cg:.3f} GB/s "
                  f"(larger side) | plain copy {sb / 1e9:.2f} GB in {ks:.1f} s = {kg:.3f} GB/s | ratio "
                  f"{cg / kg:.2f} (target >= 0.60)")
            print(f"{'':>{len(name)}}  [info] copy through the converter's O_DIRECT writer {dg:.3f} GB/s: "
                  f"conversion at {cg / dg:.2f} of it")
            print(f"{'':>{len(name)}}  peak RSS {rss / 1e9:.2f} GB vs largest layer {layer / 1e9:.2f} GB = "
                  f"{rss / layer:.2f}x (target <= 1.5); above idle {(rss - idle) / layer:.2f}x")
    finally:
        for d in ("copy", "out") if a.keep else ():
            shutil.rmtree(tmp / d, ignore_errors=True)
        if not a.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    main()
