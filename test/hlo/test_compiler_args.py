"""neuronx-cc arguments per submodel (issue 15 item 6), read from the commands the dry run saved for every bucket
(``workdir/.../command.txt``, NxD's ``save_compile_command``): as NxDI's Qwen3-MoE sets them
(``models/qwen3_moe/modeling_qwen3_moe.py:513-543``): context encoding ``-O1``; token generation ``-O3`` with
expert parallelism, ``-O1`` without. NxD 2.29's dry run writes every non-priority command with the priority model's
arguments (``trace/model_builder.py:699``); ``nxd_compat.own_commands`` writes each with its own, as a real compile
uses them."""

from __future__ import annotations

import json
import re
import shlex

import pytest

COMMON = ("--enable-saturate-infinity", "--enable-mixed-precision-accumulation", "--auto-cast=none",
          "--internal-enable-dge-levels")


def _commands(out):
    man = json.loads((out / "dry_run.json").read_text())
    for g in man["graphs"]:
        yield g["submodel"], g["bucket"], (out / g["command"]).read_text(), man


def _opt_levels(cmd: str) -> list[str]:
    return [t for t in shlex.split(cmd) if re.fullmatch(r"-O\d", t)]


@pytest.mark.parametrize("shape,tkg_level", [("tiny", "-O1"), ("narrow", "-O3")])
def test_optimisation_level_per_submodel(request, shape, tkg_level):
    out = request.getfixturevalue(f"dry_{shape}")
    seen = set()
    for sub, bucket, cmd, man in _commands(out):
        want = "-O1" if sub == "context_encoding_model" else tkg_level
        assert _opt_levels(cmd) == [want], (shape, sub, bucket, cmd)
        assert all(flag in cmd for flag in COMMON), (sub, bucket, cmd)
        assert f"--lnc={man['layout']['lnc']}" in cmd, (sub, cmd)
        assert cmd.count("--verify-hlo=true") == 1, cmd  # NxDI's ModelWrapper appends it once
        # its own work directory's log: NxD's dry run wrote the priority model's (nxd_compat.own_commands fixes it)
        logs = [t for t in shlex.split(cmd) if t.startswith("--logfile=")]
        assert len(logs) == 1 and f"/{sub}/" in logs[0], (sub, bucket, logs)
        seen.add(sub)
    assert seen == {"context_encoding_model", "token_generation_model"}
