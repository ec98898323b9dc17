#!/usr/bin/env bash
# MiniMax-M3 through vLLM on the vLLM Neuron 1.x model contract, off-device: vLLM 0.24.0 (torch 2.11) in its own
# environment (.venv-vneuron, ~10 GB: vLLM's x86 wheel brings CUDA libraries it does not use here) with the test-only
# platform plugin of test/support/vllm_neuron/harness_platform (vLLM's CpuPlatform, a worker and a runner that build
# the contract's forward calls as vllm-neuron's runner does; the plugin itself cannot be installed here).
#
#   bash scripts/test_vllm_neuron_offdevice.sh [pytest args]
#
# No NxDI or vllm-neuron sources are needed. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_offdevice_env.sh
offdevice_venv .venv-vneuron constraints/vllm_neuron.txt vllm torch transformers safetensors pytest torch-mlir -- . test/support/vllm_neuron/harness_platform
echo "test_vllm_neuron_offdevice: vLLM $(.venv-vneuron/bin/python -c 'from importlib.metadata import version; print(version("vllm"))')"
.venv-vneuron/bin/python -m pytest -q test/vllm_neuron "$@"
