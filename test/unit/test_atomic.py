"""The one atomic-write helper (``minimax_m3._atomic``) and that no other module renames files by hand.

Oracles: the bytes read back from disk, the directory listing (no temporary left), and the source text (``ast``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from minimax_m3._atomic import atomic_path, move_into_place, write_atomic

SRC = Path(__file__).resolve().parents[2] / "src" / "minimax_m3"
PENDING: set[str] = set()  # files allowed to rename by hand while they move to the helper (none left)


def test_write_atomic_bytes_and_text(tmp_path):
    p = tmp_path / "sub" / "a.json"
    assert write_atomic(p, b"\x00\x01") == p
    assert p.read_bytes() == b"\x00\x01"
    write_atomic(p, "é\n")  # str is written as UTF-8, replacing the old file
    assert p.read_bytes() == b"\xc3\xa9\n"
    assert sorted(x.name for x in p.parent.iterdir()) == ["a.json"]


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    p = tmp_path / "golden.safetensors"
    p.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="writer died"):
        with atomic_path(p) as tmp:
            tmp.write_bytes(b"half")
            assert tmp.parent == p.parent and tmp.name.endswith(".tmp") and tmp != p
            raise RuntimeError("writer died")
    assert p.read_bytes() == b"old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["golden.safetensors"]


def test_atomic_path_replaces_on_success(tmp_path):
    p = tmp_path / "tokenizer.json"
    with atomic_path(p) as tmp:
        tmp.write_text("{}")
        assert not p.exists()  # nothing visible until the block ends
    assert p.read_text() == "{}" and not tmp.exists()


def test_move_into_place_directory(tmp_path):
    stage = tmp_path / "out.partial"
    stage.mkdir()
    (stage / "x").write_text("1")
    out = move_into_place(stage, tmp_path / "deep" / "out")
    assert (out / "x").read_text() == "1" and not stage.exists()


def _renames(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("replace", "rename") and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            lines.append(node.lineno)
    return lines


def test_only_the_helper_renames_files():
    found = {p.relative_to(SRC).as_posix(): _renames(p) for p in SRC.rglob("*.py")}
    assert found["_atomic.py"], "the walk must see the helper's own os.replace"
    bad = sorted(f"{f}:{lines}" for f, lines in found.items() if lines and f != "_atomic.py" and f not in PENDING)
    assert not bad, "use minimax_m3._atomic (write_atomic / atomic_path / move_into_place) instead of os.replace:\n" + \
        "\n".join(bad)
