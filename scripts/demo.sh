#!/usr/bin/env bash
# Set everything up (pinned .venv) and run the main job on the built-in default: a synthetic tiny
# checkpoint, loaded on the best local device, generating with timings.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PJRT_DEVICE=CPU
exec .venv/bin/minimax-m3 demo "$@"
