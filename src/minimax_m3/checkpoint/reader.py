"""Lazy access to a safetensors checkpoint: a sharded directory (index JSON + shards) or a single file."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointReader:
    """Opens shards on demand with ``safe_open``; reads one tensor at a time."""

    def __init__(self, path: str | Path):
        self.root = Path(path)
        index = self.root / "model.safetensors.index.json"
        if self.root.is_file():
            self.root, files = self.root.parent, [self.root.name]
            self.weight_map = {}
            with safe_open(str(self.root / files[0]), "pt") as f:
                self.weight_map = {k: files[0] for k in f.keys()}
        elif index.is_file():
            self.weight_map = dict(json.loads(index.read_text())["weight_map"])
        elif (self.root / "model.safetensors").is_file():
            with safe_open(str(self.root / "model.safetensors"), "pt") as f:
                self.weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.root}: no model.safetensors.index.json or model.safetensors; point at a checkpoint directory"
            )
        self._handles: dict[str, object] = {}

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, key: str) -> bool:
        return key in self.weight_map

    def _handle(self, key: str):
        shard = self.weight_map[key]
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.root / shard), "pt")
        return self._handles[shard]

    def get(self, key: str) -> torch.Tensor:
        if key not in self.weight_map:
            raise KeyError(f"tensor {key!r} is not in the checkpoint at {self.root}")
        return self._handle(key).get_tensor(key)

    def shape(self, key: str) -> list[int]:
        return list(self._handle(key).get_slice(key).get_shape())

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
