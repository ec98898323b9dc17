"""Streaming conversion: layouts checked against direct computation, coverage, fault injection, resume."""

import errno
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from minimax_m3.checkpoint import CheckpointError, open_source
from minimax_m3.checkpoint.audit import coverage
from minimax_m3.checkpoint.commands import inspect, main
from minimax_m3.checkpoint.convert import ConversionError, convert, stream_state_dict, target_table
from minimax_m3.checkpoint.mapping import BF16, REFERENCE
from minimax_m3.checkpoint.synthetic import write_synthetic
from minimax_m3.config import M3Config

LM = "language_model.model"
TINY = M3Config.preset("tiny")


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    return {fmt: write_synthetic(root / fmt, "tiny", seed=3, fmt=fmt) for fmt in ("bf16", "mxfp8", "nvfp4")}


def _load_dir(d: Path) -> dict:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(f))  # safetensors' own reader: an independent check of our writer
    return out


def test_neuron_layout_from_source_tensors(synth, tmp_path):
    out = tmp_path / "nx"
    aud = convert(synth["mxfp8"], out, to="neuron", tp=4, verify=True, progress=False)
    assert aud.ok and aud.unaccounted == [] and aud.missing == [] and aud.unexpected == []
    sd = _load_dir(out)
    src = open_source(synth["mxfp8"])
    L = 2
    p, m = f"{LM}.layers.{L}", f"{LM}.layers.{L}.block_sparse_moe"
    gu = sd[f"layers.{L}.moe.expert_mlps.mlp_op.gate_up_proj.weight"]
    dn = sd[f"layers.{L}.moe.expert_mlps.mlp_op.down_proj.weight"]
    i, h, e = TINY.intermediate_size, TINY.hidden_size, TINY.num_experts
    assert gu.shape == (e, h, 2 * i) and dn.shape == (e, i, h) and gu.dtype == torch.bfloat16
    for x in range(e):
        w1, w2, w3 = (src.get(f"{m}.experts.{x}.{n}.weight").to(torch.bfloat16) for n in ("w1", "w2", "w3"))
        assert torch.equal(gu[x, :, :i], w1.t()) and torch.equal(gu[x, :, i:], w3.t())  # gate first
        assert torch.equal(dn[x], (TINY.routed_scaling_factor * w2.float()).t().to(dn.dtype))  # scale folded
    assert not sd[f"layers.{L}.moe.expert_mlps.mlp_op.gate_up_proj.bias"].any()
    assert sd[f"layers.{L}.moe.router.e_score_correction_bias"].dtype == torch.float32
    assert torch.equal(sd[f"layers.{L}.moe.router.linear_router.weight"], src.get(f"{m}.gate.weight"))
    norm = sd[f"layers.{L}.input_layernorm.weight"]
    assert norm.dtype == torch.float32 and torch.equal(norm, 1.0 + src.get(f"{p}.input_layernorm.weight").float())
    shared = sd[f"layers.{L}.shared_expert.gate_up_proj.weight"]
    assert torch.equal(shared, torch.cat([src.get(f"{m}.shared_experts.gate_proj.weight"),
                                          src.get(f"{m}.shared_experts.up_proj.weight")]).to(torch.bfloat16))
    assert sd["rank_util.rank"].tolist() == [0, 1, 2, 3] and sd["rank_util.rank"].dtype == torch.int32
    # the streaming generator yields exactly what the shards hold
    streamed = dict(stream_state_dict(synth["mxfp8"], "neuron", tp=4))
    assert streamed.keys() == sd.keys() and all(torch.equal(streamed[k], sd[k]) for k in sd)


def test_bf16_twin_of_bf16_is_byte_identical_and_keeps_vision(synth, tmp_path):
    aud = convert(synth["bf16"], tmp_path / "twin", to="bf16", verify=True, progress=False)
    a, b = _load_dir(synth["bf16"]), _load_dir(tmp_path / "twin")
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert aud.skipped_tensors == 0 and aud.consumed_tensors == aud.source_tensors == len(a)
    assert (tmp_path / "twin" / "tokenizer.json").is_file()


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "nvfp4"])
def test_every_key_consumed_or_skipped_with_reason(synth, fmt):
    src = open_source(synth[fmt])
    stored = src.reader.keys()
    vision = [k for k in stored if k.startswith(("vision_tower.", "multi_modal_projector.", "patch_merge_mlp."))]
    inputs = [k for k in stored if k.endswith(".input_scale")]
    for table in (REFERENCE, target_table("neuron", TINY, 2), BF16):
        used, skipped, left = coverage(src, TINY, table)
        assert left == []
        assert set(used) | set(skipped) == set(stored) and not set(used) & set(skipped)
        want_skipped = (0 if table is BF16 else len(vision)) + len(inputs)
        assert len(skipped) == want_skipped and all(skipped.values())
    assert len(inputs) == (3 * 8 * 3 if fmt == "nvfp4" else 0)


# ---- fault injection ---------------------------------------------------------------------------

def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _rewrite_shard(d: Path, edit) -> None:
    """Rewrite the shard holding layer 1 after ``edit(dict)``; the index follows."""
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][f"{LM}.layers.1.input_layernorm.weight"]
    tensors = load_file(d / shard)
    edit(tensors)
    save_file(tensors, d / shard, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard}
    index["weight_map"].update({k: shard for k in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def test_many_faults_one_error_listing_each(synth, tmp_path):
    d = _copy(synth["mxfp8"], tmp_path / "bad")
    k_scale = f"{LM}.layers.1.self_attn.k_proj.weight_scale_inv"

    def edit(t):
        t[k_scale] = t[k_scale].clone()
        t[k_scale][0, 0] = 255  # NaN E8M0
        del t[f"{LM}.layers.1.self_attn.q_norm.weight"]  # missing tensor
        t[f"{LM}.layers.1.block_sparse_moe.gate.weight"] = t[f"{LM}.layers.1.block_sparse_moe.gate.weight"].to(
            torch.int32)  # wrong dtype
        t[f"{LM}.layers.1.self_attn.v_proj.weight_scale_inv"] = torch.zeros(5, 5, dtype=torch.uint8)  # bad shape
        t[f"{LM}.layers.1.self_attn.mystery.weight"] = torch.zeros(3)  # unknown key
    _rewrite_shard(d, edit)
    other = sorted(d.glob("*.safetensors"))[-1]
    raw = other.read_bytes()
    other.write_bytes(raw[: len(raw) - 100])  # truncated
    with pytest.raises(CheckpointError) as err:
        convert(d, tmp_path / "out", to="bf16", progress=False)
    msg = str(err.value)
    for needle in ("255 (NaN)", "q_norm.weight", "stored as I32", "weight_scale_inv: shape [5, 5]",
                   "mystery.weight: unknown key", "truncated"):
        assert needle in msg, needle
    assert len(err.value.problems) >= 6
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_corrupt_header_missing_and_duplicated_shards(synth, tmp_path):
    d = _copy(synth["bf16"], tmp_path / "bad")
    shards = sorted(d.glob("model-*.safetensors"))
    (d / "model-extra.safetensors").write_bytes(shards[0].read_bytes())  # every tensor of shard 1 twice
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = "model-extra.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    shards[1].write_bytes(struct.pack("<Q", 40) + b"{not json" + b" " * 80)
    with pytest.raises(CheckpointError) as err:
        open_source(d)
    msg = str(err.value)
    assert "duplicated" in msg and "unreadable header" in msg
    shards[1].unlink()
    with pytest.raises(CheckpointError, match="missing shard"):
        open_source(d)


def test_quantized_tensor_without_quantization_config(synth, tmp_path):
    d = _copy(synth["mxfp8"], tmp_path / "noqc")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["quantization_config"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no quantization_config"):
        open_source(d)


class _FailingWriter:
    """A file that accepts ``limit`` bytes, then fails like a full disk (or is interrupted)."""

    budget = 0

    def __init__(self, path, exc):
        self.f, self.exc = open(path, "wb"), exc

    def write(self, b):
        n = len(memoryview(b).cast("B"))
        if _FailingWriter.budget - n < 0:
            raise self.exc
        _FailingWriter.budget -= n
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.f.close()


@pytest.mark.parametrize("overlap_limit", [64 << 20, 0])  # 0: every tensor waits for its write (the big-tensor path)
@pytest.mark.parametrize("exc", [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()])
def test_full_disk_or_interrupt_then_resume(synth, tmp_path, exc, overlap_limit, monkeypatch):
    import minimax_m3.checkpoint.pipeline as pipe

    monkeypatch.setattr(pipe, "OVERLAP_LIMIT", overlap_limit)
    clean = tmp_path / "clean"
    convert(synth["nvfp4"], clean, to="neuron", tp=2, progress=False)
    out = tmp_path / "out"
    sizes = sorted(p.stat().st_size for p in clean.glob("*.safetensors"))
    _FailingWriter.budget = sizes[0] + sizes[1] + 1000  # a couple of shards fit, then the "disk" fills
    with pytest.raises((ConversionError, KeyboardInterrupt)) as err:
        convert(synth["nvfp4"], out, to="neuron", tp=2, progress=False,
                opener=lambda p: _FailingWriter(p, exc))
    if isinstance(exc, OSError):
        assert "No space left" in str(err.value) and "rerun the same command to resume" in str(err.value)
    stage = tmp_path / "out.partial"
    assert not out.exists()
    assert list(stage.glob("*.tmp")) == []  # no half-written file anywhere
    kept = sorted(stage.glob("*.safetensors"))
    assert 1 <= len(kept) < len(list(clean.glob("*.safetensors")))
    aud = convert(synth["nvfp4"], out, to="neuron", tp=2, verify=True, progress=False)
    assert aud.ok and aud.resumed_shards == len(kept)
    assert not stage.exists()
    for f in clean.glob("*.safetensors"):
        assert (out / f.name).read_bytes() == f.read_bytes()


def test_resume_redoes_a_tampered_finished_shard(synth, tmp_path):
    clean = tmp_path / "clean"
    convert(synth["bf16"], clean, to="bf16", progress=False)
    sizes = [p.stat().st_size for p in sorted(clean.glob("*.safetensors"))]
    _FailingWriter.budget = sizes[0] + sizes[1] + 10
    out = tmp_path / "out"
    with pytest.raises(ConversionError):
        convert(synth["bf16"], out, to="bf16", progress=False,
                opener=lambda p: _FailingWriter(p, OSError(errno.ENOSPC, "full")))
    stage = tmp_path / "out.partial"
    kept = sorted(stage.glob("*.safetensors"))
    assert len(kept) == 2
    data = bytearray(kept[0].read_bytes())
    data[-1] ^= 0xFF  # bit rot in a finished shard: its CRC no longer matches the journal
    kept[0].write_bytes(bytes(data))
    aud = convert(synth["bf16"], out, to="bf16", verify=True, progress=False)
    assert aud.ok and aud.resumed_shards == 1  # the intact one skipped, the tampered one rewritten
    for f in clean.glob("*.safetensors"):
        assert (out / f.name).read_bytes() == f.read_bytes()


def test_cli_inspect_and_convert(synth, tmp_path, capsys):
    info = inspect(synth["nvfp4"])
    assert info["format"] == "nvfp4" and info["problems"] == []
    assert info["encodings"] == {"plain": 58, "mxfp8": 34, "nvfp4": 72}
    assert info["text_backbone"]["unaccounted"] == []
    rc = main(["convert", str(synth["mxfp8"]), "--to", "bf16", "--out", str(tmp_path / "o"), "--verify",
               "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS" in out and "unaccounted 0" in out and "missing 0, unexpected 0" in out
    with safe_open(str(next((tmp_path / "o").glob("*.safetensors"))), "pt") as f:
        assert all(f.get_tensor(k).dtype in (torch.bfloat16, torch.float32) for k in f.keys())
    bad = _copy(synth["bf16"], tmp_path / "b")
    next(bad.glob("model-*.safetensors")).write_bytes(b"\x00" * 4)
    assert main(["inspect", str(bad), "--json"]) == 1
    assert "too short" in capsys.readouterr().out


def test_buffer_pool_recycles_its_own_buffers_only():
    from minimax_m3.checkpoint.reader import BufferPool

    pool = BufferPool(idle_bytes=3 << 20)
    a = pool.take(1 << 20)
    ptr = a.data_ptr()
    pool.give(a.view(torch.bfloat16).view(16, -1))  # any view of it returns the whole buffer
    assert pool.take(1 << 20).data_ptr() == ptr
    pool.give(torch.empty(1 << 20, dtype=torch.uint8))  # not the pool's: ignored
    assert pool._idle == 0
    big = [pool.take(2 << 20) for _ in range(2)]
    small = pool.take(1 << 20)
    pool.give(small)
    for b in big:  # over the idle budget: buffers of other sizes are freed first
        pool.give(b)
    assert pool._idle == 2 << 20 and [k for k, v in pool._free.items() if v] == [2 << 20]


@pytest.mark.parametrize("slice_bytes", [16 << 20, 1000])  # 1000: every copy / concatenation in row blocks
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8", "nvfp4"])
def test_streamed_pieces_equal_the_rule_transforms(synth, tmp_path, fmt, slice_bytes, monkeypatch):
    """convert writes fused experts slab by slab and large copies / dim-0 concatenations in row blocks (rows read and
    dequantized alone); the bytes equal apply_rule's whole-tensor transforms, for both targets."""
    import minimax_m3.checkpoint.convert as conv

    monkeypatch.setattr(conv, "SLICE", slice_bytes)
    for to in ("neuron", "bf16"):
        out = tmp_path / f"{to}-{slice_bytes}"
        convert(synth[fmt], out, to=to, tp=2, progress=False)
        sd = _load_dir(out)
        streamed = dict(stream_state_dict(synth[fmt], to, tp=2))
        assert streamed.keys() == sd.keys()
        assert all(sd[k].dtype == streamed[k].dtype and torch.equal(sd[k], streamed[k]) for k in sd)


@pytest.mark.parametrize("refuse", [None, "open", "write"])
def test_direct_file_writes_exactly_the_bytes_given(tmp_path, monkeypatch, refuse):
    """O_DIRECT through a small stage (several drains, a carried remainder, an unaligned tail), and the buffered
    fallbacks when the filesystem refuses O_DIRECT at open or at the first write."""
    import os

    from minimax_m3.checkpoint import direct

    if refuse == "open":
        real_open = os.open
        monkeypatch.setattr(direct.os, "open", lambda p, fl, *a: (_ for _ in ()).throw(OSError(errno.EINVAL, "no"))
                            if fl & getattr(os, "O_DIRECT", 0) else real_open(p, fl, *a))
    if refuse == "write":
        real = direct.DirectFile._pwrite_at
        calls = []

        def once(self, mv, pos):
            calls.append(1)
            if len(calls) == 1:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(self, mv, pos)
        monkeypatch.setattr(direct.DirectFile, "_pwrite_at", once)
    g = torch.Generator().manual_seed(0)
    pieces = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (1008, 5000, 3 * 8192 + 3, 4096, 7)]
    path = tmp_path / "f.bin"
    with direct.DirectFile(path, stage_bytes=8192) as f:
        for p in pieces:
            assert f.write(memoryview(p.numpy())) == p.numel()
        f.flush()
        os.fsync(f.fileno())
        assert f.direct is False or refuse is None  # every fallback ends buffered; the tail always is
    assert path.read_bytes() == b"".join(bytes(p.numpy()) for p in pieces)


def test_direct_file_reports_a_failed_background_write(tmp_path, monkeypatch):
    import os

    from minimax_m3.checkpoint import direct

    real, calls = direct.DirectFile._pwrite_at, []

    def second_fails(self, mv, pos):
        calls.append(pos)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, mv, pos)
    monkeypatch.setattr(direct.DirectFile, "_pwrite_at", second_fails)
    data = memoryview(bytes(range(256)) * 200)  # 51200 bytes: several 8 KiB stage loads
    with pytest.raises(OSError, match="No space left"):
        with direct.DirectFile(tmp_path / "f.bin", stage_bytes=8192) as f:
            f.write(data)
            f.flush()
    assert f.fd == -1 and os.path.exists(tmp_path / "f.bin")  # closed; the caller removes the file
