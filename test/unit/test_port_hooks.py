"""The NxDI port reads like NxDI's own models (issue 22 item 3) and names every upstream private it uses in one place
(issue 31): its model files override NxDI's hooks only, as the in-tree ``qwen3_moe`` and ``gpt_oss`` ports do; every
version-pinned adaptation of NxD/NxDI lives in the ``neuron/nxd_compat/`` package (vllm-neuron's in
``neuron/vllm/defaults.py``), each naming the version it targets; and ``nxd_compat.PRIVATES`` lists every private
name of NxD / NxDI (and torch, transformers, vllm-neuron) that any file under ``neuron/`` uses.

Read from the source with ``ast`` (nothing is imported: runs without the Neuron SDK; :data:`PRIVATES` is read from
``nxd_compat/privates.py`` with ``ast.literal_eval``). A *private use* is a name with one leading underscore read,
called or assigned as an attribute, defined as a method or class attribute, imported from an absolute module, or
given as a string literal to ``getattr``/``setattr``/``hasattr``/``delattr``; the names the port's own classes
introduce are :data:`OWN`.

In the model files (:data:`MODEL_FILES`):

* no ``__class__`` assignment (``x.__class__ = ...`` or ``setattr(x, "__class__", ...)``);
* no environment variables (``os.environ``, ``os.getenv``, ...);
* no positional index into a ``*args`` (NxDI's argument order: ``args[4]`` is whatever NxDI puts fifth);
* no private use other than :data:`OWN` and the ``"hook"`` entries of :data:`PRIVATES` that list the file.

In every file under ``neuron/`` (``nxd_compat/`` and ``vllm/`` included): every private use is in :data:`OWN` or is
an entry of :data:`PRIVATES` that lists the file, and :data:`PRIVATES` lists no more than that (each listed file uses
the name). With the pinned sources (``NXDI_SRC``/``NXD_SRC``): no :data:`OWN` name occurs upstream, and every NxD /
NxDI entry of :data:`PRIVATES` does.

The ``nxd_compat`` package: each module's docstring says when its code runs and which versions it targets, each
public function and class names its version and upstream file, and ``__init__`` re-exports every public name of its
modules (one import surface).

The oracle for the checker itself is :data:`NEGATIVE`, source text with one of each forbidden pattern.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

NEURON = Path(__file__).resolve().parents[2] / "src" / "minimax_m3" / "neuron"
COMPAT = NEURON / "nxd_compat"
MODEL_FILES = ("model.py", "chunk_loop.py", "attention.py", "moe.py", "kv_cache.py", "layers.py", "sampling.py",
               "eagle.py")

OWN = {  # private names the port's own classes introduce (none is an NxD/NxDI name: test_names_against_upstream)
    "_fp32_params",  # layers.KeepFP32, moe.M3Router
    "_index", "_index_heads",  # attention.NeuronMiniMaxM3Attention
    "_last_real", "_positions", "_mask", "_aux", "_keep_aux",  # model.NeuronMiniMaxM3Model
    "_derive_prefill_chunk",  # config.MiniMaxM3InferenceConfig
    "_copy_fused_states", "_call_seq_ids",  # nxd_compat.SpeculationOutputs
    "_sampling_params", "_step", "_call", "_static", "_states", "_verified", "_prompt_states",  # provider
    "_MSG",  # vllm.plugin.VllmArchitectureStub
}
ENV = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
REFLECT = {"getattr", "setattr", "hasattr", "delattr"}
KINDS = {"hook", "internal"}
UPSTREAM = re.compile(r"^(NxDI 0\.9|NxD 0\.18|torch 2\.9|transformers 4\.57|vllm-neuron 0\.4\.1) .*\b[\w/]+\.py\b")


def privates_table(path: Path = COMPAT / "privates.py") -> dict:
    """``PRIVATES`` as written in ``path`` (a literal: read, not imported)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["PRIVATES"]:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path}: no 'PRIVATES = {{...}}' at module level")


PRIVATES = privates_table()

NEGATIVE = '''
import os
from os import environ
from neuronx_distributed_inference.models.model_base import _private_helper

class M(Base):
    _private_flag = True

    def _sample_on_device(self, logits, *args):
        args = (*args[:4], None)
        self.expert_mlps.__class__ = Other
        setattr(self.router, "__class__", Other)
        if os.environ.get("X") or os.getenv("Y"):
            return self._is_context_encoding(logits)
        return getattr(self, "_name_or_path", None)
'''
NEGATIVE_FINDINGS = 11  # one per forbidden pattern in NEGATIVE


def _private(name: str) -> bool:
    return name.startswith("_") and name != "_" and not (name.startswith("__") and name.endswith("__"))


def private_uses(source: str) -> list[tuple[int, str, str]]:
    """``(line, name, how)`` of every private use in ``source`` (module docstring)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in REFLECT \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str) and _private(node.args[1].value):
            out.append((node.lineno, node.args[1].value, node.func.id))
        elif isinstance(node, ast.Attribute) and _private(node.attr):
            out.append((node.lineno, node.attr, "attribute"))
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            out += [(node.lineno, a.name, f"imported from {node.module}") for a in node.names if _private(a.name)]
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(stmt.name):
                    out.append((stmt.lineno, stmt.name, f"method of {node.name}"))
                elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    out += [(stmt.lineno, t.id, f"class attribute of {node.name}") for t in targets
                            if isinstance(t, ast.Name) and _private(t.id)]
    return out


def hooks_for(rel: str) -> set[str]:
    """The ``"hook"`` entries of PRIVATES that list ``rel`` (a path relative to ``neuron/``)."""
    return {name for name, e in PRIVATES.items() if e["kind"] == "hook" and rel in e["used_in"]}


def violations(source: str, where: str = "<source>", allowed: set[str] = frozenset()) -> list[str]:
    """Every breach of the model files' rule in ``source``, as ``where:line: what``; ``allowed``: the upstream
    private names it may use (besides OWN)."""
    out = []

    def bad(node, what):
        out.append(f"{where}:{node.lineno}: {what}")

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for leaf in ast.walk(t):
                    if isinstance(leaf, ast.Attribute) and leaf.attr == "__class__":
                        bad(node, "__class__ assignment (an instance's class swapped: nxd_compat/)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and node.args[1].value == "__class__":
            bad(node, "__class__ assignment through setattr (nxd_compat/)")
        elif isinstance(node, ast.Attribute) and node.attr in ENV and isinstance(node.value, ast.Name) \
                and node.value.id == "os":
            bad(node, f"os.{node.attr}: environment variables are read or set in nxd_compat/")
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in ENV:
                    bad(node, f"from os import {alias.name}: environment variables belong in nxd_compat/")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.vararg is not None:
            star = node.args.vararg.arg
            for sub in ast.walk(node):
                if isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Name) and sub.value.id == star:
                    bad(sub, f"positional index into *{star} (NxDI's argument order): a keyword, or nxd_compat/")
    for line, name, how in private_uses(source):
        if name not in allowed and name not in OWN:
            out.append(f"{where}:{line}: private attribute {name!r} ({how}): an NxD/NxDI internal belongs in "
                       "nxd_compat/; a name of the port's own, in OWN; an upstream hook, in nxd_compat/privates.py "
                       "(kind 'hook', with its reason and this file)")
    return sorted(set(out), key=lambda s: (s.split(":")[0], int(s.split(":")[1]), s))


def neuron_files() -> dict[str, Path]:
    """Every ``.py`` file under ``neuron/``, by its path relative to it."""
    return {p.relative_to(NEURON).as_posix(): p for p in sorted(NEURON.rglob("*.py"))}


@pytest.mark.parametrize("name", MODEL_FILES)
def test_model_file_uses_hooks_only(name):
    found = violations((NEURON / name).read_text(), f"neuron/{name}", hooks_for(name))
    assert not found, "\n".join(found)


def test_the_checker_finds_each_forbidden_pattern():
    found = violations(NEGATIVE)
    assert len(found) == NEGATIVE_FINDINGS, "\n".join(found)
    text = "\n".join(found)
    for what in ("__class__ assignment (", "through setattr", "os.environ", "os.getenv", "from os import environ",
                 "'_private_helper'", "'_private_flag'", "'_sample_on_device' (method", "'_is_context_encoding'",
                 "'_name_or_path' (getattr", "positional index into *args"):
        assert what in text, what
    # a hook listed for the file is allowed there; an internal never is
    assert not any("_sample_on_device" in f for f in violations(NEGATIVE, allowed={"_sample_on_device"}))


def test_every_upstream_private_in_neuron_is_listed():
    """Each private use in each file under ``neuron/`` is OWN or a PRIVATES entry that names the file."""
    bad = []
    for rel, path in neuron_files().items():
        for line, name, how in private_uses(path.read_text()):
            if name in OWN:
                continue
            if name not in PRIVATES:
                bad.append(f"neuron/{rel}:{line}: {name!r} ({how}) is not in nxd_compat/privates.py (nor OWN)")
            elif rel not in PRIVATES[name]["used_in"]:
                bad.append(f"neuron/{rel}:{line}: {name!r} ({how}): PRIVATES[{name!r}]['used_in'] does not list "
                           f"{rel!r}")
    assert not bad, "\n".join(bad)


def test_privates_lists_only_what_is_used():
    """Every entry is well formed and each file it lists uses the name: a stale entry would let a later use through
    unexamined."""
    files = neuron_files()
    used = {rel: {name for _, name, _ in private_uses(p.read_text())} for rel, p in files.items()}
    bad = []
    for name, e in PRIVATES.items():
        if set(e) != {"kind", "upstream", "why", "used_in"} or e["kind"] not in KINDS or not e["why"] \
                or not UPSTREAM.search(e["upstream"]) or not e["used_in"] or not _private(name) or name in OWN:
            bad.append(f"{name}: malformed entry {e}")
            continue
        bad += [f"{name}: listed for {rel}, which does not use it" for rel in e["used_in"] if name not in
                used.get(rel, ())]
    assert not bad, "\n".join(bad)


def test_own_names_are_used():
    used = {name for p in neuron_files().values() for _, name, _ in private_uses(p.read_text())}
    assert OWN <= used, sorted(OWN - used)


def test_names_against_upstream():
    """OWN holds the port's names only: none is defined or used as an attribute in the pinned NxDI/NxD sources;
    every PRIVATES entry of NxDI / NxD occurs in them (``NXDI_SRC``/``NXD_SRC``; skipped without them)."""
    roots = {v: Path(os.environ[v]) for v in ("NXDI_SRC", "NXD_SRC") if os.environ.get(v)}
    if len(roots) < 2 or not all(r.is_dir() for r in roots.values()):
        pytest.skip("set NXDI_SRC and NXD_SRC to the pinned NxDI / NxD source trees")
    texts = {v: "\n".join(p.read_text() for p in r.rglob("*.py")) for v, r in roots.items()}
    pattern = re.compile(r"(?:\bdef\s+|\.)(" + "|".join(sorted(OWN)) + r")\b")
    hits = [f"{v}: {m.group(1)}" for v, text in texts.items() for m in pattern.finditer(text)]
    assert not hits, hits[:10]
    for name, e in PRIVATES.items():
        project = {"NxDI": "NXDI_SRC", "NxD": "NXD_SRC"}.get(e["upstream"].split(" ")[0])
        if project:
            assert re.search(rf"(?:\bdef\s+|\bclass\s+|\.|^\s*){name}\b", texts[project], re.M), (name, project)


def _top_level_docs(path: Path) -> dict[str, str]:
    tree = ast.parse(path.read_text())
    return {n.name: ast.get_docstring(n) or "" for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")}


ADAPTATION_MODULES = ("forward.py", "cpu_mode.py", "compile_time.py", "weights.py")


def test_each_adaptation_names_its_version_and_upstream_file():
    """Each module of the nxd_compat package says when its code runs and which versions it targets; every public
    function and class says which SDK it targets and which upstream file."""
    assert sorted(p.name for p in COMPAT.glob("*.py")) == sorted(ADAPTATION_MODULES + ("__init__.py", "privates.py"))
    docs = {}
    for name in ADAPTATION_MODULES:
        doc = ast.get_docstring(ast.parse((COMPAT / name).read_text())) or ""
        assert doc.startswith("NxD / NxDI adaptations that run "), f"{name}: its docstring says when its code runs"
        assert re.search(r"NxDI 0\.9|NxD 0\.18", doc), f"{name}: no version named"
        docs.update(_top_level_docs(COMPAT / name))
    assert len(docs) >= 10, sorted(docs)  # to_cpu, the MoE pair, sampling, the dry run, sharding...
    for name, doc in docs.items():
        assert re.search(r"Targets (NxDI 0\.9|NxD 0\.18)", doc), f"{name}: no 'Targets NxDI 0.9 / NxD 0.18'"
        assert re.search(r"``[\w/]+\.py``", doc), f"{name}: no upstream file named"
    for name, doc in _top_level_docs(NEURON / "vllm" / "defaults.py").items():
        assert "Targets vllm-neuron 0.4.1" in doc and re.search(r"``[\w/]+\.py``", doc), name


def _public_names(path: Path) -> set[str]:
    out = set()
    for n in ast.parse(path.read_text()).body:
        if isinstance(n, (ast.FunctionDef, ast.ClassDef)):
            out.add(n.name)
        elif isinstance(n, ast.Assign):
            out |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    return {n for n in out if not n.startswith("_")}


def test_nxd_compat_has_one_import_surface():
    """``nxd_compat/__init__.py`` re-exports every public name of every module of the package, and ``__all__`` is
    exactly those (callers write ``nxd_compat.X``)."""
    tree = ast.parse((COMPAT / "__init__.py").read_text())
    imported = {(n.module, a.name) for n in tree.body if isinstance(n, ast.ImportFrom) and n.level == 1
                for a in n.names}
    want = {(p.stem, name) for p in COMPAT.glob("*.py") if p.name != "__init__.py" for name in _public_names(p)}
    assert imported == want, (sorted(want - imported), sorted(imported - want))
    exported = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and [getattr(t, "id", None) for t in n.targets] == ["__all__"])
    assert sorted(exported) == sorted(name for _, name in want)
