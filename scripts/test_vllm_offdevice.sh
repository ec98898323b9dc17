#!/usr/bin/env bash
# MiniMax-M3 through vLLM, off-device: vLLM 0.13.0 + vllm-neuron 0.4.1 (torch 2.9.0) in their own environment
# (.venv-vllm, ~11 GB: vLLM's x86 wheel brings CUDA libraries it does not use here), the project's NxDI port in
# NxDI's CPU mode behind vllm-neuron's platform (test/vllm: the plugin, the neuron config vLLM builds, the smoke test).
#
#   NXDI_SRC=<neuronx-distributed-inference>/src NXD_SRC=<neuronx-distributed>/src \
#   VLLM_NEURON_SRC=<vllm-neuron 0.4.1 checkout> bash scripts/test_vllm_offdevice.sh
#
# The pinned sources are at ../shared/third_party/. vllm-neuron is put on sys.path from VLLM_NEURON_SRC (not
# installed: its NxDI requirement is not on PyPI). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_offdevice_env.sh
need_sources test_vllm_offdevice "(see README, 'Serving with vLLM')" NXDI_SRC NXD_SRC VLLM_NEURON_SRC
offdevice_venv .venv-vllm constraints/vllm.txt vllm torch torch-xla transformers tenacity boto3 safetensors pytest -- . test/support/vllm/standin_platform
export PJRT_DEVICE=CPU
echo "test_vllm_offdevice: vLLM $(.venv-vllm/bin/python -c 'from importlib.metadata import version; print(version("vllm"))'), vllm-neuron from $VLLM_NEURON_SRC"
.venv-vllm/bin/python -m pytest -q test/vllm "$@"
