"""Every command the README's ```bash blocks show is exercised here, so a renamed or misspelt option fails a test
(the docs pages the README links to get the same checks).

Oracles, per command head:

* ``minimax-m3 SUB ...`` (also under ``torchrun``): the package's own argument parser (``minimax_m3.cli.
  build_parser``); an option that does not exist, a bad choice or a missing required option fails. ``plan`` is cheap
  and runs for real. Lines that need hardware (``compile`` on trn2) are parsed only.
* ``torchrun``: torch's own parser (``torch.distributed.run.get_args_parser``).
* ``python scripts/X.py ...``: the script runs up to its own ``parse_args`` (which is stopped there).
* ``bash scripts/X.sh ...``: the file exists and ``bash -n`` reads it; every ``NAME=value`` put before it is a
  variable the script (or a script it sources) reads; ``scripts/test.sh``'s pytest arguments name existing paths
  and a ``--backend`` of the suite's own choices.
* ``pip install``: the extras exist in pyproject.toml.
* ``vllm serve`` (hardware): its ``--additional-config`` is JSON and it is the line
  ``test/vllm/test_compile_for_vllm.py`` hands to vLLM's own parser and vllm-neuron's config builder.
* ``curl``: the request body is JSON. ``export``: assignments only.

A head with no check fails, so a new kind of command needs one here. ```python blocks: every ``from X import
names`` resolves. The checker itself is tested on lines it must refuse (a misspelt option, a missing script, ...).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import json
import re
import runpy
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```", re.M | re.S)
ASSIGN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
RUN_FOR_REAL = {"plan"}  # minimax-m3 sub-commands cheap enough to run, not only parse


def blocks(text: str, lang: str) -> list[tuple[int, str]]:
    """(first line number, body) of every fenced block of ``lang``."""
    return [(text.count("\n", 0, m.start(2)) + 1, m.group(2)) for m in FENCE.finditer(text) if m.group(1) == lang]


def commands(text: str) -> list[tuple[int, list[str]]]:
    """(line, words) of every shell command in the ```bash blocks: ``\\`` continuations joined, quotes spanning lines
    kept (vLLM's JSON), comments dropped, ``$(which minimax-m3)`` read as ``minimax-m3``."""
    out = []
    for first, body in blocks(text, "bash"):
        buf, start = "", None
        for i, raw in enumerate(body.replace("$(which minimax-m3)", "minimax-m3").split("\n")):
            start = first + i if start is None else start
            cont = raw.endswith("\\")
            buf += raw[:-1] + " " if cont else raw + "\n"
            if cont:
                continue
            try:
                words = shlex.split(buf, comments=True)
            except ValueError:  # a quote still open: the command goes on
                continue
            if words:
                out.append((start, words))
            buf, start = "", None
        if buf.strip():
            out.append((start, ["<unterminated>", buf]))
    return out


# ---- checks per command head -------------------------------------------------------------------------------------
@cache
def _cli_parser() -> argparse.ArgumentParser:
    from minimax_m3.cli import build_parser

    return build_parser()


def _argparse_error(parse) -> str | None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parse()
    except SystemExit as e:
        lines = err.getvalue().strip().splitlines()
        return lines[-1] if lines else f"exit {e.code}"
    return None


def check_cli(argv: list[str]) -> str | None:
    problem = _argparse_error(lambda: _cli_parser().parse_args(argv))
    if problem or argv[0] not in RUN_FOR_REAL:
        return problem
    from minimax_m3.cli import main

    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = main(argv)
    return None if rc == 0 and out.getvalue() else f"minimax-m3 {argv[0]} exited {rc}"


def check_torchrun(argv: list[str]) -> str | None:
    from torch.distributed.run import get_args_parser

    ns = argparse.Namespace()
    problem = _argparse_error(lambda: ns.__dict__.update(vars(get_args_parser().parse_args(argv))))
    if problem:
        return f"torchrun: {problem}"
    if ns.training_script != "minimax-m3":
        return f"torchrun runs {ns.training_script!r}: only minimax-m3 has a check"
    return check_cli(ns.training_script_args)


class _Parsed(Exception):
    pass


def check_python(argv: list[str]) -> str | None:
    if not argv or not argv[0].startswith("scripts/") or not (REPO / argv[0]).is_file():
        return f"python {' '.join(argv[:1])}: not a script under scripts/ that exists"
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    saved = sys.argv
    argparse.ArgumentParser.parse_args = parse_then_stop
    sys.argv = [argv[0], *argv[1:]]
    try:
        problem = _argparse_error(lambda: runpy.run_path(str(REPO / argv[0]), run_name="__main__"))
    except _Parsed:
        return None
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = saved
    return problem or f"{argv[0]} returned without parsing its arguments"


def _script_texts(path: Path) -> str:
    text = path.read_text()
    for sourced in re.findall(r"^\s*source\s+(\S+)", text, re.M):
        if (REPO / sourced).is_file():
            text += _script_texts(REPO / sourced)
    return text


def check_bash(argv: list[str], env: list[str]) -> str | None:
    path = REPO / argv[0] if argv else None
    if path is None or not argv[0].startswith("scripts/") or not path.is_file():
        return f"bash {' '.join(argv[:1])}: not a script under scripts/ that exists"
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    if r.returncode:
        return f"bash -n {argv[0]}: {r.stderr.strip()}"
    text = _script_texts(path)
    unread = [n for n in env if not re.search(rf"\b{n}\b", text)]
    if unread:
        return f"{argv[0]} reads no variable {', '.join(unread)}"
    if argv[0] == "scripts/test.sh":  # the rest goes to pytest
        from test.conftest import BACKENDS

        args = argv[1:]
        for i, a in enumerate(args):
            if a == "--backend" and (i + 1 == len(args) or args[i + 1] not in BACKENDS):
                return f"test.sh --backend takes one of {BACKENDS}"
            if not a.startswith("-") and (i == 0 or args[i - 1] != "--backend") and not (REPO / a).exists():
                return f"test.sh: no test path {a}"
            if a.startswith("-") and a != "--backend":
                return f"test.sh: no check for pytest option {a}"
    elif len(argv) > 1:
        return f"{argv[0]}: no check for its arguments {argv[1:]}"
    return None


def check_pip(argv: list[str]) -> str | None:
    if argv[:1] != ["install"]:
        return f"pip {' '.join(argv[:1])}: only pip install has a check"
    pyproject = (REPO / "pyproject.toml").read_text()
    table = re.search(r"^\[project\.optional-dependencies\]\n(.*?)^\[", pyproject, re.M | re.S)
    extras = set(re.findall(r"^([A-Za-z0-9_-]+)\s*=", table.group(1), re.M))
    for a in argv[1:]:
        m = re.fullmatch(r"\.(?:\[([a-z0-9,-]+)\])?", a)
        if m:
            missing = set(filter(None, (m.group(1) or "").split(","))) - extras
            if missing:
                return f"pip install: no extra {sorted(missing)} in pyproject.toml"
        elif a not in ("-e", "--no-deps"):
            return f"pip install: no check for {a!r}"
    return None


def check_vllm(argv: list[str]) -> str | None:
    if argv[:1] != ["serve"]:
        return f"vllm {' '.join(argv[:1])}: only vllm serve has a check"
    if "--additional-config" in argv:
        try:
            json.loads(argv[argv.index("--additional-config") + 1])
        except (IndexError, ValueError) as e:
            return f"vllm serve --additional-config is not JSON: {e}"
    from test.vllm.test_compile_for_vllm import readme_commands

    try:
        serve = readme_commands()["serve"]
    except (ValueError, KeyError):
        return "test/vllm/test_compile_for_vllm.py finds no vllm serve line in the README's serving block"
    return None if serve == ["vllm", *argv] else "this vllm serve line is not the one test_compile_for_vllm checks"


def check_curl(argv: list[str]) -> str | None:
    if "-d" not in argv:
        return "curl: no -d body to check"
    try:
        json.loads(argv[argv.index("-d") + 1])
    except (IndexError, ValueError) as e:
        return f"curl -d is not JSON: {e}"
    return None


def check(words: list[str]) -> str | None:
    """The first problem of one command, or None."""
    env = []
    while words and ASSIGN.match(words[0]):
        env.append(words[0].split("=", 1)[0])
        words = words[1:]
    if not words:
        return None if env else "empty command"
    head, args = words[0], words[1:]
    if head == "export":
        return None if all(ASSIGN.match(a) for a in args) else "export: assignments only"
    if head == "minimax-m3":
        return check_cli(args)
    if head == "torchrun":
        return check_torchrun(args)
    if head == "python":
        return check_python(args)
    if head == "bash":
        return check_bash(args, env)
    if head == "pip":
        return check_pip(args)
    if head == "vllm":
        return check_vllm(args)
    if head == "curl":
        return check_curl(args)
    return f"no check for command {head!r} (add one to {Path(__file__).name})"


def _has(module, name: str) -> bool:
    try:
        return hasattr(module, name)
    except ImportError:  # a lazily exported name whose SDK this environment lacks (the neuron classes)
        return True


def problems(text: str) -> list[str]:
    out = [f"line {n}: {' '.join(w)[:90]}: {p}" for n, w in commands(text) if (p := check(w))]
    for first, body in blocks(text, "python"):
        for node in ast.walk(ast.parse(body)):
            if isinstance(node, ast.ImportFrom):
                mod = importlib.import_module(node.module)
                out += [f"line {first + node.lineno - 1}: {node.module} has no {a.name}"
                        for a in node.names if not _has(mod, a.name)]
    return out


def table_problems(text: str) -> list[str]:
    """Options named in the README's tables: a ``minimax-m3 SUB ...`` row's options exist for SUB; an option row of
    the engine table (``--x``, ``--[no-]x``) exists for every command that takes the engine options."""
    subs = next(a for a in _cli_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices

    def known(sub: str) -> set[str]:
        return {o for a in subs[sub]._actions for o in a.option_strings}

    out = []
    for n, line in enumerate(text.splitlines(), 1):
        row = re.match(r"\| `minimax-m3 (\S+)([^`]*)`", line)
        if row:
            if row.group(1) not in subs:
                out.append(f"line {n}: no command {row.group(1)}")
                continue
            out += [f"line {n}: {row.group(1)} has no {o}" for o in re.findall(r"--[a-z][a-z0-9-]*", row.group(2))
                    if o not in known(row.group(1))]
        row = re.match(r"\| `(--[^`]+)`(?:, `(--[^`]+)`)* \|", line)
        if row:
            for cell in re.findall(r"`(--[^`]+)`", line.split("|")[1]):
                name = cell.split()[0]
                names = [name.replace("[no-]", ""), name.replace("[no-]", "no-")] if "[no-]" in name else [name]
                out += [f"line {n}: {sub} has no {o}" for sub in ("golden", "generate", "longbench", "compile")
                        for o in names if o not in known(sub)]
    return out


# ---- the README ----------------------------------------------------------------------------------------------------
def test_every_readme_command_is_exercised():
    text = (REPO / "README.md").read_text()
    found = commands(text)
    heads = {w[0] for _, w in found}
    assert len(found) >= 20 and {"minimax-m3", "python", "bash", "vllm", "torchrun"} <= heads, (len(found), heads)
    assert not (p := problems(text)), "README commands that do not parse or run:\n" + "\n".join(p)


@pytest.mark.parametrize("page", ["docs/neuron.md", "docs/reference.md", "docs/workflows.md",
                                  "contrib/models/MiniMax-M3/README.md"])
def test_every_command_of_the_docs_pages_is_exercised(page):
    """The same checks for the pages the README links to (their ```bash and ```python blocks)."""
    text = (REPO / page).read_text()
    assert commands(text) or blocks(text, "python"), f"{page}: no command block left to check"
    assert not (p := problems(text)), f"{page} commands that do not parse or run:\n" + "\n".join(p)


def test_every_option_the_readme_tables_name_exists():
    assert not (p := table_problems((REPO / "README.md").read_text())), "\n".join(p)


def test_the_table_check_refuses_a_missing_option():
    text = ("| `minimax-m3 plan --tp 64 --batchh B` | x |\n| `minimax-m3 serve` | x |\n"
            "| `--[no-]all-logitz` | x | y |\n| `--tp`, `--epp` | x | y |\n")
    found = table_problems(text)
    assert found[0] == "line 1: plan has no --batchh" and found[1] == "line 2: no command serve", found
    assert {f.split(": ", 1)[1] for f in found[2:]} == {
        "golden has no --all-logitz", "generate has no --all-logitz", "longbench has no --all-logitz",
        "compile has no --all-logitz", "golden has no --no-all-logitz", "generate has no --no-all-logitz",
        "longbench has no --no-all-logitz", "compile has no --no-all-logitz", "golden has no --epp",
        "generate has no --epp", "longbench has no --epp", "compile has no --epp"}, found


def test_readme_opens_with_the_two_fresh_machine_commands():
    first = commands((REPO / "README.md").read_text())[:2]
    assert [w[:2] for _, w in first] == [["bash", "scripts/demo.sh"], ["bash", "scripts/test.sh"]]


# ---- the checker refuses what it must ----------------------------------------------------------------------------
@pytest.mark.parametrize("line, says", [
    ("minimax-m3 plan --tp 64 --ep 64 --batch 8 --seq 8192 --kv-type bf16", "unrecognized arguments: --kv-type"),
    ("minimax-m3 plan --tp 64 --ep 64 --batch 8 --seqq 8192", "required: --seq"),
    ("minimax-m3 generate --modle ckpt --prompt-ids 1,2", "--model"),
    ("minimax-m3 synth --preset huge --out d", "invalid choice"),
    ("minimax-m3 plan --tp 64 --ep 3 --batch 1 --seq 128", "exited"),
    ("torchrun --nproc-per-node 2 $(which minimax-m3) generate --model c --prompt-idz 1", "--prompt-idz"),
    ("torchrun --nprocs 2 train.py", "torchrun"),
    ("python scripts/compile_and_load.py --synthetc", "--synthetc"),
    ("python scripts/no_such.py", "exists"),
    ("bash scripts/no_such.sh", "exists"),
    ("NXDI_SCR=/x bash scripts/test_neuron_offdevice.sh", "NXDI_SCR"),
    ("bash scripts/test.sh --backend neuronx test/integration", "--backend"),
    ("bash scripts/test.sh test/no_such_folder", "no_such_folder"),
    ('pip install -e ".[test,gpu]"', "gpu"),
    ("vllm serve /m --additional-config '{\"a\": 1,}'", "JSON"),
    ("vllm serve /m --max-model-len 8192", "not the one"),
    ("curl -s http://x -d '{bad'", "JSON"),
    ("make all", "no check for command 'make'"),
])
def test_the_checker_refuses_a_bad_line(line, says):
    text = f"# t\n\n```bash\n{line}\n```\n"
    found = problems(text)
    assert len(found) == 1 and says in found[0], found


def test_the_checker_reads_continuations_comments_and_multiline_quotes():
    text = ("```bash\nminimax-m3 plan --tp 64 \\\n    --ep 64 --batch 1 --seq 4096   # comment\n"
            "curl -s http://x -d '{\"a\":\n  1}'\n```\n")
    assert [w for _, w in commands(text)] == [
        ["minimax-m3", "plan", "--tp", "64", "--ep", "64", "--batch", "1", "--seq", "4096"],
        ["curl", "-s", "http://x", "-d", '{"a":\n  1}']]
    assert problems(text) == []


def test_python_blocks_import_what_exists():
    assert problems("```python\nfrom minimax_m3 import EngineSpec, load_engin\n```\n") == [
        "line 2: minimax_m3 has no load_engin"]
    assert problems("```python\nfrom minimax_m3.neuron import NeuronEngine, NeuronEngin\n```\n") == [
        "line 2: minimax_m3.neuron has no NeuronEngin"]
