"""The NxDI port reads like NxDI's own models (issue 22 item 3): its model files override NxDI's hooks only, as the
in-tree ``qwen3_moe`` and ``gpt_oss`` ports do, and every version-pinned adaptation of NxD/NxDI lives in
the ``neuron/nxd_compat/`` package (vllm-neuron's in ``neuron/vllm/defaults.py``), each naming the version it targets.

Read from the source with ``ast`` (nothing is imported: runs without the Neuron SDK). In the model files:

* no ``__class__`` assignment (``x.__class__ = ...`` or ``setattr(x, "__class__", ...)``);
* no environment variables (``os.environ``, ``os.getenv``, ...);
* no positional index into a ``*args`` (NxDI's argument order: ``args[4]`` is whatever NxDI puts fifth);
* no private attribute (one leading underscore) read, called, assigned or defined as a method or class attribute,
  other than :data:`HOOKS` (upstream names the port overrides, each with its reason) and :data:`OWN` (names the
  port's own classes introduce); ``getattr``/``setattr``/``hasattr`` with a private name literal count too.

The oracle for the checker itself is :data:`NEGATIVE`, source text with one of each forbidden pattern.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

NEURON = Path(__file__).resolve().parents[2] / "src" / "minimax_m3" / "neuron"
MODEL_FILES = ("model.py", "chunk_loop.py", "attention.py", "moe.py", "kv_cache.py", "layers.py", "sampling.py",
               "eagle.py")

HOOKS = {  # private names of NxD / NxDI / torch that the model files may use, and why
    "_model_cls": "NxDI's application -> traced model class attribute (qwen3_moe and gpt_oss set it too)",
    "_init_kv_shape": "NxDI's KVCacheManager shape hook (kv_cache_manager.py), called from its constructor: the "
                      "sharded layout's line length (max_len / G)",
    "_is_prefill": "NxDI's routing of a call to context encoding or token generation (model_base.py), overridden so "
                   "a chunk of a chunked prefill at p0 > 0 runs the context-encoding graph",
    "_eagle_context_encoding_forward": "NxDI's fused EAGLE prefill (model_base.py NeuronFusedSpecModel), overridden "
                                       "so the draft follows a prompt prefilled in several calls (eagle.py)",
    "_cte_postprocessor": "NxDI's fused prefill outputs (model_base.py NeuronFusedSpecModel): a call's next position "
                          "counted from its first position when a prompt takes several calls",
    "_apply": "torch.nn.Module's cast entry, which NxDI's cast policy and to_cpu's .bfloat16() go through "
              "(layers.KeepFP32, moe.M3Router keep their fp32 parameters there)",
}
OWN = {  # private names the port's own classes introduce (none is an NxD/NxDI name: test_own_names_are_not_upstream)
    "_fp32_params", "_index", "_index_heads", "_last_real", "_positions", "_mask", "_aux", "_keep_aux",
}
ENV = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
REFLECT = {"getattr", "setattr", "hasattr", "delattr"}

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


def violations(source: str, where: str = "<source>") -> list[str]:
    """Every breach of the rule in ``source`` (a model file's text), as ``where:line: what``."""
    allowed = set(HOOKS) | OWN
    out = []

    def bad(node, what):
        out.append(f"{where}:{node.lineno}: {what}")

    def private_use(node, name, how):
        if _private(name) and name not in allowed:
            bad(node, f"private attribute {name!r} ({how}): an NxD/NxDI internal belongs in nxd_compat/; "
                      "a name of the port's own, in OWN; an upstream hook, in HOOKS with its reason")

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for leaf in ast.walk(t):
                    if isinstance(leaf, ast.Attribute) and leaf.attr == "__class__":
                        bad(node, "__class__ assignment (an instance's class swapped: nxd_compat/)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in REFLECT \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            name = node.args[1].value
            if name == "__class__" and node.func.id == "setattr":
                bad(node, "__class__ assignment through setattr (nxd_compat/)")
            private_use(node, name, f"{node.func.id}")
        elif isinstance(node, ast.Attribute):
            if node.attr in ENV and isinstance(node.value, ast.Name) and node.value.id == "os":
                bad(node, f"os.{node.attr}: environment variables are read or set in nxd_compat/")
            else:
                private_use(node, node.attr, "attribute")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if node.module == "os" and alias.name in ENV:
                    bad(node, f"from os import {alias.name}: environment variables belong in nxd_compat/")
                elif node.level == 0 and _private(alias.name):
                    private_use(node, alias.name, f"imported from {node.module}")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.vararg is not None:
            star = node.args.vararg.arg
            for sub in ast.walk(node):
                if isinstance(sub, ast.Subscript) and isinstance(sub.value, ast.Name) and sub.value.id == star:
                    bad(sub, f"positional index into *{star} (NxDI's argument order): a keyword, or nxd_compat/")
        if isinstance(node, ast.ClassDef):
            for stmt in node.body:
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    private_use(stmt, stmt.name, f"method of {node.name}")
                elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                    for t in targets:
                        if isinstance(t, ast.Name):
                            private_use(stmt, t.id, f"class attribute of {node.name}")
    return sorted(set(out), key=lambda s: (s.split(":")[0], int(s.split(":")[1]), s))


@pytest.mark.parametrize("name", MODEL_FILES)
def test_model_file_uses_hooks_only(name):
    found = violations((NEURON / name).read_text(), f"neuron/{name}")
    assert not found, "\n".join(found)


def test_the_checker_finds_each_forbidden_pattern():
    found = violations(NEGATIVE)
    assert len(found) == NEGATIVE_FINDINGS, "\n".join(found)
    text = "\n".join(found)
    for what in ("__class__ assignment (", "through setattr", "os.environ", "os.getenv", "from os import environ",
                 "'_private_helper'", "'_private_flag'", "'_sample_on_device' (method", "'_is_context_encoding'",
                 "'_name_or_path' (getattr", "positional index into *args"):
        assert what in text, what


def test_hook_and_own_lists_hold_only_used_names():
    """A name listed but no longer used would let a future use through unexamined."""
    used = set()
    for name in MODEL_FILES:
        for node in ast.walk(ast.parse((NEURON / name).read_text())):
            if isinstance(node, ast.Attribute):
                used.add(node.attr)
            elif isinstance(node, ast.Name):
                used.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                used.add(node.name)
    assert set(HOOKS) | OWN <= used, sorted((set(HOOKS) | OWN) - used)


def test_own_names_are_not_upstream():
    """OWN holds the port's names only: none is defined or used as an attribute in the pinned NxDI/NxD sources
    (``NXDI_SRC``/``NXD_SRC``; skipped without them)."""
    roots = [Path(os.environ[v]) for v in ("NXDI_SRC", "NXD_SRC") if os.environ.get(v)]
    if not roots or not all(r.is_dir() for r in roots):
        pytest.skip("set NXDI_SRC and NXD_SRC to the pinned NxDI / NxD source trees")
    pattern = re.compile(r"(?:\bdef\s+|\.)(" + "|".join(sorted(OWN)) + r")\b")
    hits = [f"{p}:{m.group(1)}" for r in roots for p in r.rglob("*.py") for m in pattern.finditer(p.read_text())]
    assert not hits, hits[:10]


def _top_level_docs(path: Path) -> dict[str, str]:
    tree = ast.parse(path.read_text())
    return {n.name: ast.get_docstring(n) or "" for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and not n.name.startswith("_")}


def test_each_adaptation_names_its_version_and_upstream_file():
    """Every public function and class of the nxd_compat package says which SDK it targets and which upstream file."""
    docs = {}
    for path in sorted((NEURON / "nxd_compat").glob("*.py")):
        docs.update(_top_level_docs(path))
    assert len(docs) >= 10, sorted(docs)  # to_cpu, the MoE pair, sampling, the dry run, sharding...
    for name, doc in docs.items():
        assert re.search(r"Targets (NxDI 0\.9|NxD 0\.18)", doc), f"{name}: no 'Targets NxDI 0.9 / NxD 0.18'"
        assert re.search(r"``[\w/]+\.py``", doc), f"{name}: no upstream file named"
    for name, doc in _top_level_docs(NEURON / "vllm" / "defaults.py").items():
        assert "Targets vllm-neuron 0.4.1" in doc and re.search(r"``[\w/]+\.py``", doc), name
