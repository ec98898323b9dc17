#!/usr/bin/env bash
# Set up .venv with the pinned test environment and the package in editable mode.
# Usage: bash scripts/bootstrap.sh            (idempotent; re-running is quick)
# The venv itself lives in a per-machine cache keyed by constraints/test.txt (scripts/_venv.sh): the first run on a
# machine builds it (~7 GB of wheels), later runs and other clones reuse it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
cached_venv .venv constraints/test.txt -e ".[test,xla,eval,s3,s3-test]"
install_local .venv .
echo "bootstrap: .venv ready ($(.venv/bin/python -c 'from importlib.metadata import version as v; print("torch", v("torch"), "transformers", v("transformers"))'))"
