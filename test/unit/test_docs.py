"""The notes the code and README cite live in the repository (``docs/``), not beside it.

Oracle: the files on disk. Every ``docs/NAME.md`` named in src/, test/, scripts/ or README.md must exist, and no
reference to the old location outside the repository (``shared/docs``, ``../shared/ARCHITECTURE.md``) may remain.
(``../shared/third_party``, where the test scripts look for the pinned NxDI/NxD sources, is not a note.) The entry
pages' relative links name files that exist and headings they hold (GitHub's anchor rule).
"""

from __future__ import annotations

import re
import sys
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


LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCED = re.compile(r"^```.*?^```", re.M | re.S)


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (word characters, spaces and hyphens kept), spaces
    to hyphens; a repeated heading gets -1, -2, ..."""
    count: dict[str, int] = {}
    anchors = set()
    for line in FENCED.sub("", text).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = count.get(slug, 0)
            count[slug] = n + 1
            anchors.add(f"{slug}-{n}" if n else slug)
    return anchors


def _link_problems(md: Path) -> list[str]:
    out = []
    for target in LINK.findall(FENCED.sub("", md.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        dest = (md.parent / file).resolve() if file else md
        rel = md.relative_to(REPO)
        if not dest.exists():
            out.append(f"{rel}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            out.append(f"{rel}: {target}: no heading #{anchor}")
    return out


def test_every_relative_link_of_the_entry_pages_resolves():
    """README, HISTORY, the contrib README and the project's own docs pages: every relative link names a file that
    exists and, with ``#anchor``, a heading of it."""
    pages = [REPO / "README.md", REPO / "HISTORY.md", REPO / "contrib/models/MiniMax-M3/README.md",
             *(REPO / "docs" / n for n in ("neuron.md", "reference.md", "workflows.md", "results.md"))]
    problems = [p for md in pages for p in _link_problems(md)]
    assert not problems, "\n".join(problems)


def test_the_link_check_fails_on_a_missing_heading(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "a.md").write_text("# Top\n\n## Two words\n\n[ok](#two-words) [bad](#three) [gone](b.md) "
                                   "[twice](#top-1)\n\n# Top\n")
    assert _link_problems(tmp_path / "a.md") == ["a.md: #three: no heading #three", "a.md: b.md: no such file"]
