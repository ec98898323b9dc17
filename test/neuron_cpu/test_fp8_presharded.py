"""A ``--weights fp8`` build's pre-sharded rank files at TP 2: the streamed writer (``neuron.rank_files.write_sharded``)
against NxD's own ``ModelBuilder.shard_checkpoint`` on the same NxDI application (oracle: NxD), bit for bit; the
routed experts are e4m3 with fp32 ``.scale`` tensors, the gate/up scale split with its weight's columns."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.neuron_cpu
ROOT = Path(__file__).resolve().parents[2]


def _run(mode: str, ckpt: Path, out: Path, tp: int, decode_experts: str = "ep") -> list[dict]:
    from safetensors.torch import load_file

    proc = subprocess.run([sys.executable, "-m", "test.support.neuron.write_presharded_fp8", mode, str(ckpt), str(out),
                           str(tp), decode_experts], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [load_file(str(out / f"tp{r}_sharded_checkpoint.safetensors")) for r in range(tp)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_fp8_rank_files_equal_nxd_shard_checkpoint(tmp_path):
    if "WORLD_SIZE" in os.environ:
        pytest.skip("launches its own subprocesses; not run under torchrun")
    from minimax_m3.checkpoint.synthetic import write_synthetic

    ckpt = write_synthetic(tmp_path / "tiny", "tiny", seed=0)
    got, want = _run("stream", ckpt, tmp_path / "stream", 2), _run("nxd", ckpt, tmp_path / "nxd", 2)
    from minimax_m3.checkpoint.convert import stream_state_dict
    from minimax_m3.checkpoint.fp8_experts import quantize_per_channel

    full = dict(stream_state_dict(ckpt, to="neuron", dtype=torch.bfloat16, tp=2))
    q_full, s_full = quantize_per_channel(full["layers.1.moe.expert_mlps.mlp_op.gate_up_proj.weight"])
    for r in range(2):
        assert set(got[r]) == set(want[r])
        bad = [k for k in want[r] if got[r][k].dtype != want[r][k].dtype or not torch.equal(_bits(got[r][k]),
                                                                                             _bits(want[r][k]))]
        assert not bad, f"rank {r}: {bad}"
        p = "layers.1.moe.expert_mlps.mlp_op."
        assert got[r][p + "gate_up_proj.weight"].dtype == torch.float8_e4m3fn
        assert got[r][p + "down_proj.weight"].dtype == torch.float8_e4m3fn
        # tiny: 8 experts, hidden 128, I 64 -> gate/up [8, 128, 128] split over TP 2; its scale follows the columns
        assert got[r][p + "gate_up_proj.weight"].shape == (8, 128, 64)
        assert got[r][p + "gate_up_proj.scale"].shape == (8, 1, 64)
        # by hand: the stride-2 split gives rank r gate columns [32r, 32r + 32) and up columns 64 + [32r, 32r + 32)
        cols = torch.cat([torch.arange(32 * r, 32 * r + 32), 64 + torch.arange(32 * r, 32 * r + 32)])
        assert torch.equal(got[r][p + "gate_up_proj.scale"], s_full[..., cols])
        assert torch.equal(_bits(got[r][p + "gate_up_proj.weight"]), _bits(q_full)[..., cols])
        down = got[r][p + "down_proj.scale"]
        assert down.shape == (8, 1, 128) and down.dtype == torch.float32  # rows split; per-output scale replicated
        assert got[r]["layers.1.shared_expert.down_proj.weight"].dtype == torch.bfloat16


def test_fp8_decode_copy_carries_its_scales(tmp_path):
    """``--decode-experts tp`` with fp8 experts: NxD's preshard hook copies the expert weights to the decode copy
    (``mlp_op_tkg``) but not their scales; the port's state dict adds them (``nxd_compat.hybrid_expert_scales``).
    At TP 2 (CPU mode's layout: both copies tensor-parallel) every rank file holds the decode copy's e4m3 weights and
    fp32 scales, bit-equal to the prefill copy's, in the streamed writer and in NxD's own ``shard_checkpoint``."""
    if "WORLD_SIZE" in os.environ:
        pytest.skip("launches its own subprocesses; not run under torchrun")
    from minimax_m3.checkpoint.synthetic import write_synthetic

    ckpt = write_synthetic(tmp_path / "tiny", "tiny", seed=0)
    got, want = _run("stream", ckpt, tmp_path / "stream", 2, "tp"), _run("nxd", ckpt, tmp_path / "nxd", 2, "tp")
    p, d = "layers.1.moe.expert_mlps.mlp_op.", "layers.1.moe.expert_mlps.mlp_op_tkg."
    for r in range(2):
        assert set(got[r]) == set(want[r])
        assert all(torch.equal(_bits(got[r][k]), _bits(want[r][k])) for k in want[r])
        for part in ("gate_up_proj.weight", "gate_up_proj.scale", "down_proj.weight", "down_proj.scale"):
            assert torch.equal(_bits(got[r][d + part]), _bits(got[r][p + part])), (r, part)
        assert got[r][d + "gate_up_proj.scale"].shape == (8, 1, 64)
