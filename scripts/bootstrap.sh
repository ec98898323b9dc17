#!/usr/bin/env bash
# Set up .venv with the pinned test environment and the package in editable mode.
# Usage: bash scripts/bootstrap.sh            (idempotent; re-running is quick)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -c constraints/test.txt -e ".[test,xla,eval,s3,s3-test]"
echo "bootstrap: .venv ready ($(.venv/bin/python -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
