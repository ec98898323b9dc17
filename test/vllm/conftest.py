"""Gates of the vLLM tests, each a one-line skip where its inputs are absent.

* ``test_plugin_inert.py`` runs everywhere (the project's own environment has neither vLLM nor the Neuron SDK).
* ``test_serving_config.py`` needs NxDI/NxD sources (``NXDI_SRC``/``NXD_SRC``) and torch-xla: the SDK stand-ins
  of ``test/support/neuron`` make NxDI's config classes importable (``.venv-nxdi`` or ``.venv-vllm``).
* ``test_vllm_smoke.py`` needs those plus vLLM 0.13, vllm-neuron 0.4.1's source (``VLLM_NEURON_SRC``) and the
  test platform plugin (``test/support/vllm/standin_platform``): ``scripts/test_vllm_offdevice.sh`` builds all of it.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from test.support.neuron import standins


def nxdi_missing() -> str | None:
    return standins.missing_reason()


def vllm_missing() -> str | None:
    reason = nxdi_missing()
    if reason:
        return reason
    if importlib.util.find_spec("vllm") is None:
        return "vLLM smoke test: vLLM is not installed here (scripts/test_vllm_offdevice.sh builds .venv-vllm)"
    src = os.environ.get("VLLM_NEURON_SRC", "")
    if not os.path.isdir(os.path.join(src, "vllm_neuron")):
        return "vLLM smoke test: set VLLM_NEURON_SRC to a vllm-neuron 0.4.1 checkout (../shared/third_party/)"
    if importlib.util.find_spec("m3_vllm_standin_platform") is None:
        return ("vLLM smoke test: the test platform plugin is not installed "
                "(pip install -e test/support/vllm/standin_platform)")
    return None


# vLLM picks its platform once per process, on first use: the test platform plugin must be selected before any
# test imports vLLM (VLLM_PLUGINS names the plugins vLLM may load; the platform is active only with
# M3_VLLM_STANDIN=1). One engine process (VLLM_ENABLE_V1_MULTIPROCESSING=0) unless a test starts a server.
if vllm_missing() is None:
    import tempfile

    os.environ.setdefault("VLLM_PLUGINS", "m3_standin_neuron,minimax_m3")
    os.environ.setdefault("M3_VLLM_STANDIN", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="m3-vllm-cache-"))
    os.environ.setdefault("PJRT_DEVICE", "CPU")


@pytest.fixture(scope="session")
def nxdi():
    """NxDI importable through the SDK stand-ins (CPU mode), or a one-line skip."""
    reason = nxdi_missing()
    if reason:
        pytest.skip(reason)
    if not standins.installed() and importlib.util.find_spec("vllm") is None:
        # the stand-ins change this process for good: only where they are the point (the vLLM environment, or a
        # --backend neuron-cpu session that installed them already)
        pytest.skip("NxDI config test: run in .venv-vllm (scripts/test_vllm_offdevice.sh) or with --backend neuron-cpu")
    standins.bootstrap()
