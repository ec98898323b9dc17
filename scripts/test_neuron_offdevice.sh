#!/usr/bin/env bash
# The off-device Neuron suites: the NxDI port in NxDI's CPU mode (TP 1, 2, 4) and the graph harness (test/hlo: NxDI's
# compile path down to per-bucket HLO, validity, TP=1 execution, TP=64 sharding), in their own environment
# (.venv-nxdi: NxDI pins transformers 4.57, the project's oracle needs 5.23).
#
#   NXDI_SRC=<neuronx-distributed-inference>/src NXD_SRC=<neuronx-distributed>/src bash scripts/test_neuron_offdevice.sh
#
# Optional: M3_CONTRIB_SRC=<neuronx-distributed-inference>/contrib/models/MiniMax-M3/src also traces the published port
# at the same shapes for the side-by-side report. Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_offdevice_env.sh
need_sources test_neuron_offdevice "to the src/ folder of a checkout (see README, 'NxDI CPU mode')" NXDI_SRC NXD_SRC
offdevice_venv .venv-nxdi constraints/nxdi.txt torch torch-xla transformers tenacity boto3 safetensors pytest protobuf -- .
export PJRT_DEVICE=CPU
echo "test_neuron_offdevice: NxDI CPU mode (TP 1 in-process, 2 and 4 under torchrun)"
.venv-nxdi/bin/python -m pytest -q --backend neuron-cpu test/integration/test_backend_suite.py test/neuron_cpu "$@"
echo "test_neuron_offdevice: graph harness (test/hlo)"
.venv-nxdi/bin/python -m pytest -q test/hlo "$@"
