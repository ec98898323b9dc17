"""The package's imports: no cycles, and every import points down the layers of ``docs/ARCHITECTURE.md``.

The graph is read from the source with ``ast`` (nothing is imported). An edge A -> B is any ``import``/``from ...
import`` of a ``minimax_m3`` module B written anywhere in A: at module level AND inside functions. A function-level
import only defers the work; the two modules still depend on each other (the ``checkpoint.audit`` <->
``checkpoint.convert`` cycle of issue 16 was made of two function-level imports), so both kinds count.
``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to ``pkg`` itself.

The rule ("upward" defined):

* a **unit** is a top-level module or package (folder) of ``minimax_m3``: ``engine/`` (spec + loop), ``storage/``,
  ``config/`` (M3Config + sharding), ``graphs/``, ``planner``, ``load``, ...;
* a module may import modules of its own unit, the leaves (``errors``, ``_atomic``: they import nothing of the
  package), and the units that ``MAY_IMPORT`` lists for its unit, transitively (the table of ARCHITECTURE.md);
  anything else is an upward import;
* a module never imports a package that contains it (``from .. import name`` resolving to the package's
  ``__init__``): the package root stands above its modules;
* ``cli`` and the package root may import every unit.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
ROOT = "minimax_m3"
LEAVES = {"errors", "_atomic"}
MAY_IMPORT = {  # unit -> the units below it (ARCHITECTURE.md, "Packages"); closed transitively by _allowed()
    "config": set(),
    "storage": set(),
    "ops": set(),
    "checkpoint": {"config", "storage"},
    "engine": {"config", "ops", "storage"},
    "reference": {"engine", "ops", "checkpoint", "config", "storage"},
    "planner": {"config", "ops"},  # the port's rules (chunk, sharding) read from their one home; no NxDI
    "graphs": {"planner", "config"},  # the report sets the traced cost beside the planner's minimum
    "neuron": {"engine", "ops", "checkpoint", "config", "storage", "graphs", "planner"},
    # the vLLM Neuron model: the reference's layers (parameters, TP/EP slicing, the loader) over paged caches
    "vllm_neuron": {"reference", "ops", "config", "storage", "graphs"},  # graphs: its dry run's StableHLO reader
    "eval": {"engine", "config", "load"},  # its longbench command and lm-eval adapter load engines
    "load": {"engine", "reference", "neuron", "config", "storage"},
}
TOP = {"cli", ""}  # "" is the package root: both may import everything


def modules(src: Path = SRC) -> dict[str, Path]:
    out = {}
    for p in (src / ROOT).rglob("*.py"):
        parts = list(p.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _targets(mod: str, path: Path, node: ast.stmt, known: dict) -> list[str]:
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        if node.level:
            pkg = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
            base = ".".join(pkg[: len(pkg) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = []
    for n in names:
        if n == ROOT or n.startswith(ROOT + "."):
            while n not in known:  # `import minimax_m3.x.y` of a name inside a module -> that module
                n = n.rsplit(".", 1)[0]
            out.append(n)
    return out


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    known = modules(src)
    graph = {}
    for mod, path in known.items():
        nodes = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, (ast.Import, ast.ImportFrom))]
        graph[mod] = {t for n in nodes for t in _targets(mod, path, n, known)} - {mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def unit(mod: str) -> str:
    parts = mod.split(".")
    name = parts[1] if len(parts) > 1 else ""
    return name


def _allowed(u: str) -> set[str]:
    seen, todo = set(), list(MAY_IMPORT.get(u, ()))
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo += MAY_IMPORT.get(v, ())
    return seen | LEAVES | {u}


def upward(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for a, targets in graph.items():
        ua = unit(a)
        for b in sorted(targets):
            if a.startswith(b + "."):
                bad.append(f"{a} -> {b} (imports a package that contains it)")
            elif ua in LEAVES:
                bad.append(f"{a} -> {b} (a leaf imports nothing of the package)")
            elif ua not in TOP and unit(b) not in _allowed(ua):
                bad.append(f"{a} -> {b} (unit {ua!r} may import {sorted(_allowed(ua) - {ua})})")
    return sorted(bad)


def test_the_walk_sees_the_package():
    g = import_graph()
    assert len(g) > 40 and "minimax_m3.checkpoint.convert" in g
    assert "minimax_m3.checkpoint.pipeline" in g["minimax_m3.checkpoint.convert"]
    assert "minimax_m3.ops" in g["minimax_m3.reference.model"]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (move the shared piece to a module both can import):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_imports_point_down_the_layers():
    bad = upward(import_graph())
    assert not bad, "upward imports (see docs/ARCHITECTURE.md, 'Packages'):\n" + "\n".join(bad)


# ---- the checker itself, on graphs whose answer is written by hand ----------------------------------------------

def test_cycle_finder_on_hand_graphs():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"c"}}) == [["a", "b"], ["c", "d"]]


def test_upward_rule_on_hand_edges():
    g = {
        "minimax_m3.ops.mlp": {"minimax_m3.config"},  # ops: torch only
        "minimax_m3.checkpoint.reader": {"minimax_m3.checkpoint", "minimax_m3.errors"},  # its own package root
        "minimax_m3.engine": {"minimax_m3.reference.engine", "minimax_m3.engine.spec"},  # engine below the backends
        "minimax_m3.eval.runner": {"minimax_m3.ops", "minimax_m3.engine"},  # ops reached through engine: fine
        "minimax_m3.errors": {"minimax_m3.config"},  # a leaf
        "minimax_m3.cli": {"minimax_m3.neuron.compile"},
    }
    assert upward(g) == sorted([
        "minimax_m3.ops.mlp -> minimax_m3.config (unit 'ops' may import ['_atomic', 'errors'])",
        "minimax_m3.checkpoint.reader -> minimax_m3.checkpoint (imports a package that contains it)",
        "minimax_m3.engine -> minimax_m3.reference.engine (unit 'engine' may import "
        "['_atomic', 'config', 'errors', 'ops', 'storage'])",
        "minimax_m3.errors -> minimax_m3.config (a leaf imports nothing of the package)",
    ])


def test_walk_counts_function_level_imports(tmp_path):
    pkg = tmp_path / ROOT / "checkpoint"
    pkg.mkdir(parents=True)
    (tmp_path / ROOT / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "audit.py").write_text("def f():\n    from .convert import file_crc\n")
    (pkg / "convert.py").write_text("def g():\n    from .audit import audit\n")
    g = import_graph(tmp_path)
    assert cycles(g) == [["minimax_m3.checkpoint.audit", "minimax_m3.checkpoint.convert"]]


# ---- the house plan's tree is the package's tree -------------------------------------------------------------------

ARCHITECTURE = SRC.parent / "docs" / "ARCHITECTURE.md"


def architecture_tree(text: str) -> dict[str, set[str]]:
    """The ``src/minimax_m3/`` tree drawn in ARCHITECTURE.md: folder ('' = the package root) -> the entries it lists.

    A line's names are its leading words up to a run of two spaces (``errors.py _atomic.py   M3Error ...``); two
    spaces of indent is the package root, four a file of the folder named last. A folder whose files are not drawn
    lists nothing below itself and is only checked to exist."""
    block = text.split("```\nsrc/minimax_m3/\n", 1)[1].split("```", 1)[0]
    tree: dict[str, set[str]] = {"": set()}
    folder = ""
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        names = [n for n in line.strip().split("  ", 1)[0].split(" ") if n.endswith((".py", "/"))]
        if not names or indent not in (2, 4):
            continue  # a wrapped description
        if indent == 2:
            tree[""].update(names)
            folder = names[-1] if names[-1].endswith("/") else ""
        elif folder:
            tree.setdefault(folder, set()).update(names)
    return tree


def package_tree(folder: Path) -> set[str]:
    return {p.name + "/" if p.is_dir() else p.name for p in folder.iterdir()
            if p.name != "__pycache__" and (p.is_dir() or p.suffix == ".py") and p.name != "__init__.py"}


def test_the_architecture_tree_is_the_package_tree():
    drawn = architecture_tree(ARCHITECTURE.read_text())
    pkg = SRC / ROOT
    problems = []
    for folder, names in drawn.items():
        have = package_tree(pkg / folder) | ({"__init__.py"} if folder == "" else set())
        missing, undrawn = sorted(names - have), sorted(have - names)
        problems += [f"{folder or 'src/minimax_m3/'}: drawn but absent: {missing}"] if missing else []
        problems += [f"{folder or 'src/minimax_m3/'}: present but not drawn: {undrawn}"] if undrawn else []
    assert not problems, "docs/ARCHITECTURE.md's tree differs from the package:\n" + "\n".join(problems)


def test_architecture_tree_reader_on_a_hand_drawing():
    text = ("```\nsrc/minimax_m3/\n  cli.py       the command\n  neuron/      the port:\n    a.py b.py    two\n"
            "                 a wrapped line\n  errors.py _atomic.py   leaves\n```\n")
    assert architecture_tree(text) == {"": {"cli.py", "neuron/", "errors.py", "_atomic.py"},
                                       "neuron/": {"a.py", "b.py"}}
