#!/usr/bin/env bash
# Set everything up (pinned .venv), run the whole test suite, then ruff (pinned in constraints/test.txt; its rules
# are in pyproject.toml). Extra arguments go to pytest, e.g.
# `bash scripts/test.sh --backend neuron-cpu test/integration`.
# Exits non-zero when either the tests or ruff fail; ruff runs even when a test failed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PJRT_DEVICE=CPU
rc=0
.venv/bin/python -m pytest -q "$@" || rc=$?
echo "ruff check src test scripts"
.venv/bin/ruff check src test scripts || { [ "$rc" -ne 0 ] || rc=1; }
exit "$rc"
