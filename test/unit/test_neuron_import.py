"""Without the Neuron SDK: the package imports, and asking for the backend raises one clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

import minimax_m3.neuron as neuron


def _sdk_here() -> bool:
    return neuron.sdk_available()


def test_importing_the_package_pulls_in_no_neuron_module():
    code = ("import sys, minimax_m3, minimax_m3.neuron, minimax_m3.engine; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('neuronx_distributed', "
            "'neuronx_distributed_inference', 'torch_neuronx', 'neuronxcc', 'libneuronxla', 'nki', 'nkilib')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(_sdk_here(), reason="the Neuron SDK is importable here")
def test_class_access_raises_one_clear_error():
    with pytest.raises(neuron.NeuronUnavailableError) as exc:
        neuron.NeuronMiniMaxM3ForCausalLM  # noqa: B018
    msg = str(exc.value)
    assert "neuronx-distributed-inference" in msg and "pip.repos.neuron.amazonaws.com" in msg
    assert "missing module: neuronx_distributed" in msg


@pytest.mark.skipif(_sdk_here(), reason="the Neuron SDK is importable here")
@pytest.mark.parametrize("backend", ["neuron", "neuron-cpu"])
def test_load_engine_without_sdk(backend, tmp_path):
    from minimax_m3.load import load_engine

    with pytest.raises(neuron.NeuronUnavailableError, match="Neuron SDK"):
        load_engine(str(tmp_path), backend=backend)


def test_unknown_attribute_is_an_attribute_error():
    with pytest.raises(AttributeError):
        neuron.NoSuchThing  # noqa: B018
