"""Test-only vLLM platform plugin: vllm-neuron's ``NeuronPlatform`` on a host without Neuron devices.

``register`` (entry point ``vllm.platform_plugins: m3_standin_neuron``, chosen with ``VLLM_PLUGINS``) is active
only with ``M3_VLLM_STANDIN=1``. It puts the NxDI/NxD sources (``NXDI_SRC``, ``NXD_SRC``) and vllm-neuron's
(``VLLM_NEURON_SRC``) on ``sys.path``, installs the project's Neuron SDK stand-ins
(``test/support/neuron/standins.py``: NxDI's CPU mode) and returns :class:`.platform.StandinNeuronPlatform`, which
differs from vllm-neuron's platform only in its worker: :mod:`.worker` builds the NxDI application and runs it
with ``to_cpu()`` where vllm-neuron would compile NEFFs and load them onto NeuronCores.

vLLM calls platform plugins in every process it starts, so the set-up happens in each.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(os.environ.get("M3_REPO_ROOT") or Path(__file__).resolve().parents[5])


def _standins():
    name = "m3_neuron_standins"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "test" / "support" / "neuron" / "standins.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def setup() -> None:
    src = os.environ.get("VLLM_NEURON_SRC", "")
    if not os.path.isdir(os.path.join(src, "vllm_neuron")):
        raise RuntimeError(f"$VLLM_NEURON_SRC must name a vllm-neuron checkout (its vllm_neuron/ parent); got {src!r}")
    if src not in sys.path:
        sys.path.insert(0, src)
    _standins().bootstrap()  # NxDI/NxD sources on sys.path, SDK stand-ins, NXD_CPU_MODE=1


def register():
    if os.environ.get("M3_VLLM_STANDIN") != "1":
        return None
    setup()
    return "m3_vllm_standin_platform.platform.StandinNeuronPlatform"
