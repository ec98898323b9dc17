"""Whether the Neuron SDK is importable, and the one error that says what to install when it is not.

A leaf of the ``neuron`` package: the package root and its modules (``commands``) import the gate from here, so no
module of the package needs to import the package root.
"""

from __future__ import annotations

import importlib

from ..errors import M3Error

PACKAGE = __name__.rsplit(".", 1)[0]  # minimax_m3.neuron
INSTALL_HINT = (
    "the neuron backend needs the AWS Neuron SDK 2.29 Python packages: neuronx-distributed-inference 0.9 "
    "(NxDI), neuronx-distributed 0.18 (NxD) and torch-neuronx 2.9 with neuronx-cc, installed from the Neuron "
    "pip repository (https://pip.repos.neuron.amazonaws.com) on a Trainium/Inferentia host, e.g. "
    "`pip install --extra-index-url https://pip.repos.neuron.amazonaws.com neuronx-distributed-inference`; "
    "to run NxDI's CPU mode off-device see the README section 'NxDI CPU mode'"
)
SDK_MODULES = ("neuronx_distributed_inference", "neuronx_distributed", "torch_neuronx", "neuronxcc", "nki", "nkilib",
               "libneuronxla", "torch_xla")


class NeuronUnavailableError(M3Error, ImportError):
    """The Neuron SDK (NxDI/NxD) is not importable here."""


def sdk_available() -> bool:
    try:
        importlib.import_module("neuronx_distributed_inference.models.config")
        return True
    except Exception:
        return False


def import_neuron_module(module: str):
    """``minimax_m3.neuron.<module>``; a missing Neuron SDK module becomes one :class:`NeuronUnavailableError`."""
    try:
        return importlib.import_module(f"{PACKAGE}.{module}")
    except ImportError as exc:
        missing = getattr(exc, "name", "") or ""
        if missing.split(".")[0] in SDK_MODULES:
            raise NeuronUnavailableError(f"{INSTALL_HINT} (missing module: {missing})") from exc
        raise
