"""The vLLM general plugin without vLLM or without the Neuron SDK: it registers nothing and breaks nothing.

Run in a fresh interpreter each (plugins run at vLLM start-up, in a process that has imported nothing else)."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PROBE = """
import importlib.util, json, sys
{hide}
before = set(sys.modules)
from minimax_m3.neuron.vllm import plugin as vllm_plugin
vllm_plugin.register()
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
out = {{"sdk_imported": sorted(m for m in set(sys.modules) - before
                               if m.split(".")[0] in ("neuronx_distributed_inference", "neuronx_distributed")),
        "vllm_imported": sys.modules.get("vllm") is not None,
        "our_config_registered": any(getattr(CONFIG_MAPPING._extra_content.get(t), "__module__", "")
                                     == vllm_plugin.__name__ for t in ("minimax_m3_vl", "minimax_m3_vl_text"))}}
if importlib.util.find_spec("vllm") is not None and "vllm" not in {hidden!r}:
    from vllm import ModelRegistry
    out["archs_registered"] = [a for a in vllm_plugin.ARCHITECTURES if a in ModelRegistry.get_supported_archs()]
print("PROBE" + json.dumps(out))
"""


def _probe(hidden: tuple[str, ...]) -> dict:
    # a module set to None in sys.modules cannot be imported: the environment without it
    hide = "\n".join(f"sys.modules[{m!r}] = None" for m in hidden)
    code = PROBE.format(hide=hide, hidden=hidden)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home())}  # no NXDI_SRC etc.: the SDK is not on the path
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("PROBE")][-1]
    return json.loads(line[len("PROBE"):])


def test_without_vllm_registers_nothing():
    got = _probe(("vllm",))
    assert got == {"sdk_imported": [], "vllm_imported": False, "our_config_registered": False}


def test_without_the_neuron_sdk_registers_nothing():
    got = _probe(("neuronx_distributed_inference", "neuronx_distributed"))
    assert got["sdk_imported"] == [] and not got["our_config_registered"]
    assert got.get("archs_registered", []) == []


def test_entry_point_names_the_register_function():
    eps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]
    assert eps["vllm.general_plugins"] == {"minimax_m3": "minimax_m3.neuron.vllm.plugin:register",
                                           "minimax_m3_vllm_neuron": "minimax_m3.vllm_neuron.plugin:register"}
    from minimax_m3.neuron.vllm import plugin as vllm_plugin
    from minimax_m3.vllm_neuron import plugin as vllm_neuron_plugin

    assert callable(vllm_plugin.register) and callable(vllm_neuron_plugin.register)


def test_kv_connector_and_kv_offloading_are_one_error_naming_the_flag():
    """The config hook the plugin gives vLLM (``MODELS_CONFIG_MAP``) on vLLM's config attributes (vLLM 0.13 names:
    ``kv_transfer_config.kv_connector``, ``cache_config.kv_offloading_backend``); through vLLM itself in
    ``test_vllm_smoke.py``."""
    import pytest
    from types import SimpleNamespace as NS

    from minimax_m3.neuron.vllm.plugin import VllmConfigChecks

    from minimax_m3.neuron.vllm.structured import GUARD

    def model():
        return NS(logits_processors=None)

    plain = NS(kv_transfer_config=None, cache_config=NS(kv_offloading_backend=None), model_config=model(),
               additional_config={})
    VllmConfigChecks.verify_and_update_config(plain)  # nothing to refuse
    assert plain.model_config.logits_processors == [GUARD]  # the structured-outputs guard (test_agentic_serve.py)
    VllmConfigChecks.verify_and_update_config(NS(kv_transfer_config=NS(kv_connector=None), model_config=model(),
                                                 cache_config=NS(kv_offloading_backend=None), additional_config={}))
    for cfg, flag in ((NS(kv_transfer_config=NS(kv_connector="NixlConnector"), cache_config=plain.cache_config),
                       "--kv-transfer-config"),
                      (NS(kv_transfer_config=None, cache_config=NS(kv_offloading_backend="native")),
                       "--kv-offloading-backend")):
        with pytest.raises(ValueError) as e:
            VllmConfigChecks.verify_and_update_config(cfg)
        assert str(e.value).count("MiniMax-M3 cannot be served") == 1 and flag in str(e.value)
