"""The notes the code and README cite live in the repository (``docs/``), not beside it.

Oracle: the files on disk. Every ``docs/NAME.md`` named in src/, test/, scripts/ or README.md must exist, and no
reference to the old location outside the repository (``shared/docs``, ``../shared/ARCHITECTURE.md``) may remain.
(``../shared/third_party``, where the test scripts look for the pinned NxDI/NxD sources, is not a note.)
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CITE = re.compile(r"docs/([A-Za-z0-9_]+\.md)")
OUTSIDE = re.compile(r"shared/docs|shared/ARCHITECTURE")


def _texts():
    for root in ("src", "test", "scripts"):
        for p in (REPO / root).rglob("*"):
            if p.suffix in (".py", ".sh", ".md", ".toml", ".txt") and p.name != "test_docs.py":
                yield p
    yield REPO / "README.md"


def test_docs_directory_holds_the_architecture_and_notes():
    names = {p.name for p in (REPO / "docs").glob("*.md")}
    assert {"ARCHITECTURE.md", "m3_model_and_formats.md", "nxdi_api.md", "longbench_protocol.md", "oracle_notes.md",
            "hlo_gate.md", "trn2_port_review.md", "vllm_neuron.md", "perf_anchors.md"} <= names


def test_every_cited_note_exists_and_none_points_outside():
    missing, outside = [], []
    for p in _texts():
        text = p.read_text(errors="replace")
        rel = p.relative_to(REPO)
        missing += [f"{rel}: docs/{m}" for m in CITE.findall(text) if not (REPO / "docs" / m).is_file()]
        outside += [f"{rel}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert not missing, "cited notes missing from docs/:\n" + "\n".join(missing)
    assert not outside, "notes cited outside the repository (use docs/...):\n" + "\n".join(outside)


def test_architecture_cites_only_notes_that_exist():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`([a-z0-9_]+\.md)`", text))
    assert named and all((REPO / "docs" / n).is_file() for n in named), sorted(named)
