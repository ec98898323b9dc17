"""Pre-sharded NxD checkpoints written one conversion unit at a time (host memory near one layer's tensors).

NxDI's ``shard_weights`` (``save_sharded_checkpoint=True``) calls NxD's ``ModelBuilder.shard_checkpoint``, which
loads the whole converted state dict (``checkpoint_loader_fn``: ~856 GB for bf16 M3) and keeps every rank's shard
in a list until it returns (another ~856 GB at TP 64). :func:`write_sharded` produces the same files —
``tp{r}_sharded_checkpoint.safetensors`` for every rank r, the names, dtypes, shapes and bytes NxD writes — from
the checkpoint reader's stream (``convert.stream_state_dict``, one rule at a time), one unit (the global tensors,
then each layer) at a time:

1. the unit's converted tensors are collected (one layer: its attention, indexer, router and expert tensors);
2. NxD's own sharding runs on them: ``preprocess_checkpoint`` (duplicate check, the modules' preshard hooks — KV
   head replication, the expert hooks' rank tensors and ``+1`` bias — and removal of keys the model lacks),
   ``ModelBuilder.cast_weights``, then ``get_sharded_checkpoint(..., is_cached=True)`` per rank, exactly the calls
   of ``shard_checkpoint`` / ``shard_weights_with_cache``, on a module holding only that unit's submodules (the
   same module objects, so the same names, hooks and per-rank shapes);
3. each rank's slices are appended to that rank's open output file and released before the next unit is read.

A safetensors file starts with its header (names, dtypes, shapes, offsets), so each file reserves room for a
header that bounds every key the model can hold (``reserve``) and the real header, padded with spaces as the
format allows, is written there at the end; files are written under a temporary name and renamed when complete.

NxDI then loads them as it loads its own pre-sharded weights (``load_weights``: ``load_file`` per rank): build
with ``save_sharded_checkpoint=True`` and ``skip_sharding=True`` (NxDI then skips its own sharding in ``compile``)
and call :func:`write_sharded` into ``<compiled>/weights/``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
from torch import nn

from .._atomic import move_into_place
from ..checkpoint.mapping import unit_of
from ..checkpoint.pipeline import bytes_view
from ..checkpoint.reader import DTYPE_NAMES, CheckpointError

log = logging.getLogger(__name__)

FILE = "tp{rank}_sharded_checkpoint.safetensors"
_ENTRY_BOUND = 200  # bytes of header JSON per tensor beyond its name: dtype, up to 6 dims, two 20-digit offsets


RUNTIME_STATE = ("kv_mgr.past_key_values.",)  # the caches: zeros from NxDI, never in a checkpoint


def unfilled_parameters(module: nn.Module, keys) -> list[str]:
    """Names of ``module``'s parameters and buffers that no key in ``keys`` fills, the caches excepted. A tensor
    registered under several names (NxDI shares ``rank_util`` with the KV manager) is filled through any."""
    names: dict[int, list[str]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        names.setdefault(id(t), []).append(name)
    keys = set(keys)
    return sorted(ns[0] for ns in names.values()
                  if keys.isdisjoint(ns) and not all(n.startswith(RUNTIME_STATE) for n in ns))


def units(pairs):
    """Group the converter's ``(name, tensor)`` stream into ``(unit, {name: tensor})`` of consecutive keys of one
    unit (:func:`~minimax_m3.checkpoint.mapping.unit_of`: a layer index, None for the global tensors; the stream
    goes unit by unit: the global tensors, then each layer)."""
    cur, part = None, {}
    for name, t in pairs:
        u = unit_of(name)
        if part and u != cur:
            yield cur, part
            part = {}
        cur = u
        part[name] = t
    if part:
        yield cur, part


def submodule_for(model: nn.Module, unit: int | None) -> nn.Module:
    """A module whose state-dict names are ``model``'s for ``unit`` only: layer ``unit``'s ``layers.{L}.*`` (the
    same layer module under the same name) or, for None, every top-level child but ``layers`` (the global
    tensors)."""
    view = nn.Module()
    if unit is None:
        for name, child in model.named_children():
            if name != "layers":
                view.add_module(name, child)
        for name, p in model.named_parameters(recurse=False):
            view.register_parameter(name, p)
    else:
        view.add_module("layers", nn.ModuleDict({str(unit): model.layers[unit]}))
    if hasattr(model, "config"):
        view.config = model.config  # get_sharded_checkpoint reads config.torch_dtype
    return view


class RankFile:
    """One rank's output file: a reserved header region, tensors appended after it, the header written last."""

    def __init__(self, path: Path, reserve: int):
        self.path, self.tmp = path, path.with_name(path.name + ".partial")
        self.reserve = reserve + (-reserve % 8)
        self.entries: dict[str, dict] = {}
        self.offset = 0
        self.f = open(self.tmp, "wb")
        self.f.write(b"\0" * (8 + self.reserve))

    def add(self, name: str, t: torch.Tensor) -> None:
        if name in self.entries:
            raise ValueError(f"{name}: written twice to {self.path.name}")
        mv = bytes_view(t)
        self.f.write(mv)
        self.entries[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [self.offset, self.offset + len(mv)]}
        self.offset += len(mv)

    def close(self) -> None:
        hdr = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        if len(hdr) > self.reserve:
            self.f.close()
            self.tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{self.path.name}: header of {len(hdr)} bytes exceeds the {self.reserve} reserved "
                               "(a tensor name or rank beyond the bound of reserve())")
        self.f.seek(0)
        self.f.write(self.reserve.to_bytes(8, "little") + hdr + b" " * (self.reserve - len(hdr)))
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        move_into_place(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def reserve(model: nn.Module) -> int:
    """Header bytes that hold any subset of ``model``'s state-dict keys."""
    return 64 + sum(len(json.dumps(k)) + _ENTRY_BOUND for k in model.state_dict(keep_vars=True))


def shard_units(builder, model: nn.Module, pairs, ranks, sink) -> dict:
    """NxD's sharding of each unit of ``pairs`` for ``ranks``; ``sink(rank, name, tensor)`` receives every slice.
    Returns ``{"units": n, "keys": k, "max_unit_bytes": b}`` (b: the largest unit as converted). Must run inside
    NxD's sharding context (``nxd_compat.nxd_sharding_model``)."""
    from .nxd_compat import shard_part

    n_units = n_keys = largest = 0
    for unit, part in units(pairs):
        largest = max(largest, sum(t.numel() * t.element_size() for t in part.values()))
        for rank, sharded in shard_part(builder, submodule_for(model, unit), part, ranks):
            for name, t in sharded.items():
                sink(rank, name, t)
            del sharded
        n_units, n_keys = n_units + 1, n_keys + len(part)
        del part
    return {"units": n_units, "keys": n_keys, "max_unit_bytes": largest}


def write_sharded(app, out_dir: str | Path, model_dir: str | Path | None = None) -> dict:
    """Write ``tp{r}_sharded_checkpoint.safetensors`` for this host's ranks (``start_rank_id`` ..
    ``+ local_ranks_size``) of NxDI application ``app`` (a ``NeuronMiniMaxM3ForCausalLM``, not yet loaded) into
    ``out_dir`` (NxDI reads ``<compiled>/weights/``), converting ``model_dir`` (default: the app's model path) one
    unit at a time. Returns a small report (ranks, units, keys, bytes, seconds)."""
    from .nxd_compat import checkpoint_path, nxd_sharding_model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    nc = app.neuron_config
    ranks = list(range(nc.start_rank_id, nc.start_rank_id + nc.local_ranks_size))
    src = str(model_dir or checkpoint_path(app))
    builder = app.get_builder()
    t0 = time.perf_counter()
    files: dict[int, RankFile] = {}
    try:
        with nxd_sharding_model(builder) as model:
            room = reserve(model)
            files = {r: RankFile(out / FILE.format(rank=r), room) for r in ranks}
            written: set[str] = set()

            def sink(rank: int, name: str, t: torch.Tensor) -> None:
                files[rank].add(name, t)
                written.add(name)

            stats = shard_units(builder, model, app.get_state_dict_stream(src, app.config), ranks, sink)
            # NxD loads rank files by name: a parameter no key fills would keep its initial value on device
            missing = unfilled_parameters(model, written)
            if missing:
                raise CheckpointError([f"{k}: a parameter of the NxDI model that the converted state dict does not "
                                       "fill" for k in missing], source=f"pre-sharded weights for {out}")
        for f in files.values():
            f.close()
    except BaseException:
        for f in files.values():
            if not f.f.closed:
                f.abort()
        raise
    total = sum(f.offset for f in files.values())
    log.info("wrote %d rank file(s), %d units, %.1f GB in %.0f s", len(ranks), stats["units"], total / 1e9,
             time.perf_counter() - t0)
    return {"ranks": ranks, **stats, "bytes": total, "seconds": time.perf_counter() - t0, "dir": str(out)}
