"""Everything in this folder runs only with ``--backend neuron-cpu`` and NxDI/NxD sources; otherwise one-line skips."""

import pytest

from test.support.neuron import standins


@pytest.fixture(autouse=True, scope="module")
def _neuron_cpu_only(request):
    try:
        backend = request.config.getoption("--backend")
    except ValueError:
        backend = None
    if backend != "neuron-cpu":
        pytest.skip("NxDI CPU-mode test: run with --backend neuron-cpu")
    reason = standins.missing_reason()
    if reason:
        pytest.skip(reason)
    if not standins.installed():
        pytest.skip("the neuron-cpu plugin is not loaded: add -p test.support.neuron.cpu_plugin")
