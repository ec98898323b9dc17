"""The pages and notes the code and README cite live in the repository (``docs/``, background notes in
``docs/notes/``), not beside it.

Oracle: the files on disk. Every ``docs/NAME.md`` or ``docs/notes/NAME.md`` named in src/, test/, scripts/,
contrib/, docs/, README.md or HISTORY.md must exist, and no reference to the old location outside the repository
(``shared/docs``, ``../shared/ARCHITECTURE.md``) may remain. (``../shared/third_party``, where the test scripts look
for the pinned NxDI/NxD sources, is not a note.) The relative links of the entry pages, of every page in ``docs/``
and of every note in ``docs/notes/`` name files that exist and headings they hold (GitHub's anchor rule). Every note
opens with a dated header naming the commits it describes and was checked against.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CITE = re.compile(r"(?<![\w./-])docs/((?:notes/)?[A-Za-z0-9_]+\.md)")  # not another repository's .../docs/x.md
OUTSIDE = re.compile(r"shared/docs|shared/ARCHITECTURE")
PAGES = {"ARCHITECTURE.md", "neuron.md", "reference.md", "workflows.md", "long_context.md", "long_context_port.md",
         "speculative.md", "results.md", "vllm_neuron_model.md"}
NOTES = {"m3_model_and_formats.md", "nxdi_api.md", "longbench_protocol.md", "oracle_notes.md", "hlo_gate.md",
         "trn2_port_review.md", "vllm_neuron.md", "perf_anchors.md", "peer_port_review.md"}


def _texts():
    for root in ("src", "test", "scripts", "contrib", "docs"):
        for p in (REPO / root).rglob("*"):
            if p.suffix in (".py", ".sh", ".md", ".toml", ".txt") and p.name != "test_docs.py":
                yield p
    yield REPO / "README.md"
    yield REPO / "HISTORY.md"


def test_docs_holds_the_pages_and_docs_notes_the_notes():
    assert PAGES <= {p.name for p in (REPO / "docs").glob("*.md")}
    assert NOTES <= {p.name for p in (REPO / "docs" / "notes").glob("*.md")}
    assert not NOTES & {p.name for p in (REPO / "docs").glob("*.md")}, "a note left in docs/ beside its copy"


def test_every_note_opens_with_its_date_and_the_tree_it_describes():
    """The first lines after a note's title: a date (YYYY-MM-DD) and at least one commit (7+ hex digits)."""
    bad = []
    for p in sorted((REPO / "docs" / "notes").glob("*.md")):
        head = "\n".join(p.read_text().splitlines()[1:8])
        if not (re.search(r"\b20\d\d-\d\d-\d\d\b", head) and re.search(r"\b(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b", head)):
            bad.append(p.name)
    assert not bad, f"notes without a dated header naming their tree: {bad}"


def test_every_cited_note_exists_and_none_points_outside():
    missing, outside = [], []
    for p in _texts():
        text = p.read_text(errors="replace")
        rel = p.relative_to(REPO)
        missing += [f"{rel}: docs/{m}" for m in CITE.findall(text) if not (REPO / "docs" / m).is_file()]
        outside += [f"{rel}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert not missing, "cited notes missing from docs/:\n" + "\n".join(missing)
    assert not outside, "notes cited outside the repository (use docs/...):\n" + "\n".join(outside)


def test_architecture_cites_only_pages_and_notes_that_exist():
    text = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    named = set(re.findall(r"`((?:notes/)?[a-z0-9_]+\.md)`", text))
    assert {n for n in named if n.startswith("notes/")}, "ARCHITECTURE names no note"
    missing = sorted(n for n in named if not (REPO / "docs" / n).is_file())
    assert not missing, missing


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


def test_every_relative_link_of_the_entry_pages_and_notes_resolves():
    """README, HISTORY, the contrib README, every page of ``docs/`` and every note of ``docs/notes/``: every relative
    link names a file that exists and, with ``#anchor``, a heading of it."""
    pages = [REPO / "README.md", REPO / "HISTORY.md", REPO / "contrib/models/MiniMax-M3/README.md",
             *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "notes").glob("*.md"))]
    assert len(pages) >= 3 + len(PAGES) + len(NOTES)
    problems = [p for md in pages for p in _link_problems(md)]
    assert not problems, "\n".join(problems)


def test_the_link_check_fails_on_a_missing_heading(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    (tmp_path / "a.md").write_text("# Top\n\n## Two words\n\n[ok](#two-words) [bad](#three) [gone](b.md) "
                                   "[twice](#top-1)\n\n# Top\n")
    assert _link_problems(tmp_path / "a.md") == ["a.md: #three: no heading #three", "a.md: b.md: no such file"]
