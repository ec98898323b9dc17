"""Pre-sharded checkpoints streamed one unit at a time (``neuron.rank_files.write_sharded``) at TP 2 and 4.

Oracle 1: NxD's own ``ModelBuilder.shard_checkpoint`` (what NxDI's ``shard_weights`` writes with
``save_sharded_checkpoint``), run on the same tiny synthetic checkpoint: every rank file must hold the same keys,
dtypes, shapes and bytes. Oracle 2: NxDI's CPU mode under ``torchrun``, the port loaded the normal way (whole state
dict, NxD's per-rank sharding) and from the streamed rank files (``load_file`` per rank, as NxDI's ``load_weights``):
prefill logits, decode-step logits and greedy tokens must be identical (same weights, same computation).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test.support.neuron import write_presharded
from test.support.neuron.cpu_plugin import free_port

pytestmark = pytest.mark.neuron_cpu
ROOT = Path(__file__).resolve().parents[2]
FILE = "tp{}_sharded_checkpoint.safetensors"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    if "WORLD_SIZE" in os.environ:
        pytest.skip("launches its own subprocesses; not run under torchrun")
    from minimax_m3.checkpoint.synthetic import write_synthetic

    return write_synthetic(tmp_path_factory.mktemp("m3") / "tiny", "tiny", seed=0)


def _files(d: Path, tp: int) -> list[dict]:
    from safetensors.torch import load_file

    return [load_file(str(d / FILE.format(r))) for r in range(tp)]


@pytest.mark.parametrize("tp,ep,dtype", [(2, 1, "bfloat16"), (4, 2, "bfloat16"), (4, 1, "float32")])
def test_streamed_rank_files_equal_nxd_shard_checkpoint(ckpt, tmp_path, tp, ep, dtype):
    nxd = write_presharded.run("nxd", ckpt, tmp_path / "nxd", tp, ep, dtype)
    streamed = write_presharded.run("stream", ckpt, tmp_path / "stream", tp, ep, dtype)
    assert streamed["units"] == 1 + 4  # the global tensors, then each of the tiny model's 4 layers
    want, got = _files(tmp_path / "nxd", tp), _files(tmp_path / "stream", tp)
    assert {p.name for p in (tmp_path / "stream").glob("tp*")} == {FILE.format(r) for r in range(tp)}
    for r in range(tp):
        assert set(got[r]) == set(want[r]), f"rank {r}: {set(got[r]) ^ set(want[r])}"
        bad = [k for k in want[r] if got[r][k].dtype != want[r][k].dtype or got[r][k].shape != want[r][k].shape
               or not torch.equal(got[r][k], want[r][k])]
        assert not bad, f"rank {r}: differs from NxD's shard for {bad}"
    # the per-rank files hold the expert hooks' rank tensors (at EP > 1) and sliced tensors
    assert any(".spmd_rank.local_expert_indices" in k for k in got[0]) == (ep > 1)
    q = got[0]["layers.1.self_attn.qkv_proj.q_proj.weight"]
    assert q.shape == (8 * 32 // tp, 128)  # 8 q heads of 32, hidden 128
    assert nxd["peak_mb"] >= nxd["rss_before_mb"] > 0 and streamed["bytes"] == sum(
        sum(t.numel() * t.element_size() for t in f.values()) for f in got)


def test_compile_hook_streams_the_same_files(ckpt, tmp_path):
    """NxDI's ``shard_weights`` (what ``compile()`` calls with ``save_sharded_checkpoint``) goes through the port's
    override to ``write_sharded``: the same files in ``<compiled>/weights/``."""
    write_presharded.run("stream", ckpt, tmp_path / "stream", 2, 1)
    assert write_presharded.run("hook", ckpt, tmp_path / "hook", 2, 1)["write_sharded_calls"] == 1
    a, b = _files(tmp_path / "stream", 2), _files(tmp_path / "hook" / "compiled" / "weights", 2)
    for r in range(2):
        assert set(a[r]) == set(b[r]) and all(torch.equal(a[r][k], b[r][k]) for k in a[r])


def test_a_parameter_no_key_fills_is_refused_by_name(ckpt, tmp_path):
    """The device path loads rank files by name (NxDI's strict=False load on CPU): a converter key that misses its
    parameter must fail while sharding, naming the parameter, and leave no rank file behind."""
    got = write_presharded.run("misnamed", ckpt, tmp_path / "bad", 2, 1)
    assert got["error"] is not None and write_presharded.MISNAMED in got["error"], got
    assert got["files"] == []


def test_header_reservation_is_padding_only(ckpt, tmp_path):
    """The reserved header region ends in spaces (the safetensors format's padding), data starts 8-aligned, and
    the offsets cover the data exactly (safetensors' own loader checks that; read back above)."""
    write_presharded.run("stream", ckpt, tmp_path, 2, 1)
    raw = (tmp_path / FILE.format(0)).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    hdr = json.loads(raw[8:8 + n])
    assert n % 8 == 0 and raw[8:8 + n].rstrip(b" ").endswith(b"}")
    end = max(v["data_offsets"][1] for k, v in hdr.items() if k != "__metadata__")
    assert 8 + n + end == len(raw)


@pytest.mark.parametrize("tp", [2, 4])
def test_cpu_mode_logits_from_streamed_shards(ckpt, tmp_path, tp):
    write_presharded.run("stream", ckpt, tmp_path / "w", tp, 1, "float32")
    out = tmp_path / "report.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={tp}", f"--master-port={free_port()}",
           "-m", "test.support.neuron.load_presharded_rank", str(ckpt), str(tmp_path / "w"), str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    rep = json.loads(out.read_text())
    assert rep["tp"] == tp
    assert rep["prefill_equal"] and rep["prefill_max_abs"] == 0.0
    assert rep["steps_max_abs"] == 0.0
    assert rep["tokens_presharded"] == rep["tokens_normal"] and all(len(t) == 6 for t in rep["tokens_normal"])
