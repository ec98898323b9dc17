"""XLA CPU device fixtures for the static-graph proofs.

``PJRT_DEVICE=CPU`` is set before torch_xla is imported, so the tests run on the XLA CPU device (the same
lazy-tensor tracing that NxDI uses for Neuron). Without torch_xla every test that asks for the ``xla`` fixture
is skipped with one line; the eager-only oracle checks in this folder still run.
"""

import os

import pytest
import torch

os.environ.setdefault("PJRT_DEVICE", "CPU")
try:
    import torch_xla
    import torch_xla.debug.metrics as met
except ImportError:  # pragma: no cover - CI installs torch-xla
    torch_xla = met = None


def compile_count() -> int:
    """How many XLA graphs this process has compiled so far (the ``CompileTime`` metric's sample count)."""
    data = met.metric_data("CompileTime")
    return 0 if data is None else int(data[0])


def aten_fallbacks() -> list[str]:
    """Ops that fell back to the CPU (``aten::`` counters) since the counters were last cleared."""
    return sorted(set(met.executed_fallback_ops()) | {n for n in met.counter_names() if n.startswith("aten::")})


def run_on_xla(fn, *args):
    """Move ``args`` (tensors, or tuples/lists/dicts of them) to the XLA device, run ``fn`` and one graph, bring
    the outputs back to the CPU. Returns ``(outputs, graphs compiled by this call)``."""
    dev = torch_xla.device()

    def to(a):
        if isinstance(a, torch.Tensor):
            return a.to(dev)
        if isinstance(a, (tuple, list)):
            return type(a)(to(x) for x in a)
        if isinstance(a, dict):
            return {k: to(v) for k, v in a.items()}
        return a

    xargs = [to(a) for a in args]
    torch_xla.sync()  # uploads only; no computation is pending
    before = compile_count()
    out = fn(*xargs)
    outs = out if isinstance(out, tuple) else (out,)
    torch_xla.sync()
    compiled = compile_count() - before
    cpu = tuple(o.cpu() for o in outs)
    return (cpu if isinstance(out, tuple) else cpu[0]), compiled


@pytest.fixture
def xla():
    """The XLA CPU device, with a check that nothing fell back to the CPU during the test."""
    if torch_xla is None:
        pytest.skip("torch_xla is not installed (pip install -e .[xla])")
    met.clear_counters()  # fallback counters are cumulative; start this test from zero
    yield torch_xla.device()
    fallen = aten_fallbacks()
    assert not fallen, f"ops fell back to the CPU on the XLA device: {fallen}"
