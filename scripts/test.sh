#!/usr/bin/env bash
# Set everything up (pinned .venv) and run the whole test suite. Extra arguments go to pytest,
# e.g. `bash scripts/test.sh --backend neuron-cpu test/integration`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PJRT_DEVICE=CPU
exec .venv/bin/python -m pytest -q "$@"
