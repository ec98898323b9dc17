"""Structured outputs through vllm-neuron 0.4.1: honoured or refused, never silently unconstrained.

vllm-neuron 0.4.1 applies vLLM's grammar bitmask only on its host-sampling path
(``vllm_neuron/worker/neuronx_distributed_model_runner.py``, ``sample_tokens``: with ``on_device_sampling_config`` set
it logs "The grammar bitmask will be ignored" and samples unconstrained). Its default neuron config samples on
device (``_get_default_neuron_config``), and so does every build ``compile --for-vllm`` makes without
``--structured-outputs``. So:

* a build that samples on the host (``compile --for-vllm --structured-outputs``, or ``"on_device_sampling_config":
  null`` in ``--additional-config``'s ``override_neuron_config``) gets grammar-constrained tokens: vLLM's bitmask on
  the logits the device returns;
* a build that samples on device refuses each request that carries a grammar — ``response_format`` (JSON schema or
  object), ``structured_outputs`` / ``guided_*``, ``tool_choice`` ``"required"`` or a named tool — with HTTP 400 and
  one message naming the fix; the server keeps serving.

How the refusal reaches vLLM without patching it or vllm-neuron: :class:`StructuredOutputGuard` is a vLLM logits
processor that :func:`install` adds to the model config's ``logits_processors`` when vLLM builds its config for one
of M3's architectures (the plugin's ``VllmConfigChecks``: vLLM's per-architecture config hook). vLLM calls each such
processor's ``validate_params`` on every request's sampling parameters in the API server, before the request reaches
the engine (``OpenAIServingChat`` / ``OpenAIServingCompletion``: ``validate_logits_processors_parameters``; a
``ValueError`` there is a 400). Its ``apply`` changes nothing (vllm-neuron 0.4.1 builds no logits processors). Not an
installed ``vllm.logits_processors`` entry point: vLLM would load that for every model of the installation, and vLLM
>= 0.24 counts any such plugin as a feature its V2 model runner lacks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

try:  # vLLM's interface when vLLM is importable (the entry point is only loaded by vLLM)
    from vllm.v1.sample.logits_processor import LogitsProcessor as _Base
except ImportError:  # imported without vLLM (the docs, the unit tests of the rule)
    _Base = object

HOST_SAMPLING = {"on_device_sampling_config": None}  # the override that makes vllm-neuron sample on the host
FIX = ("serve a build that samples on the host: `minimax-m3 compile --for-vllm --structured-outputs ...` (or add "
       '"on_device_sampling_config": null to --additional-config\'s override_neuron_config), at the cost of the '
       "logits crossing to the host every step (docs/neuron.md, 'Structured outputs'); or send the request without "
       "the constraint (tool_choice \"auto\")")

# set by record(): None (not an M3 build on vllm-neuron: inert), else the reason this build cannot apply a grammar
# ("" when it can)
_refusal: str | None = None


def samples_on_device(additional_config: dict | None, artifacts: str | None = None) -> bool:
    """Whether the neuron config vllm-neuron 0.4.1 builds (or loads) samples on device: from a precompiled artifact
    (``$NEURON_COMPILED_ARTIFACTS``/neuron_config.json, whose config wins over any override), else from
    ``override_neuron_config``, else vllm-neuron's default (on device)."""
    if artifacts:
        path = Path(artifacts) / "neuron_config.json"
        if path.is_file():
            nc = json.loads(path.read_text()).get("neuron_config", {})
            return nc.get("on_device_sampling_config") is not None
    override = (additional_config or {}).get("override_neuron_config") or {}
    if "on_device_sampling_config" in override:
        return override["on_device_sampling_config"] is not None
    return True


GUARD = f"{__name__}:StructuredOutputGuard"  # vLLM's "module:Class" form, loadable in every process


def install(vllm_config) -> None:
    """Called by the plugin's config hook for M3's architectures: records what this build can honour and adds the
    guard to the model config's logits processors (once)."""
    record(vllm_config)
    model_config = vllm_config.model_config
    procs = list(model_config.logits_processors or [])
    if GUARD not in procs and StructuredOutputGuard not in procs:
        model_config.logits_processors = procs + [GUARD]


def record(vllm_config) -> None:
    """What this process's build can honour (:func:`samples_on_device`)."""
    global _refusal
    on_device = samples_on_device(getattr(vllm_config, "additional_config", None),
                                  os.environ.get("NEURON_COMPILED_ARTIFACTS"))
    _refusal = ("this MiniMax-M3 server samples on device, where vllm-neuron 0.4.1 does not apply the grammar of "
                "structured outputs" if on_device else "")


def refusal(params) -> str | None:
    """The one-line error for ``params`` (vLLM ``SamplingParams``) on this build, or None when it is served."""
    if not _refusal or getattr(params, "structured_outputs", None) is None:
        return None
    return (f"{_refusal} (this request asks for one: response_format, structured_outputs/guided_*, or tool_choice "
            f"'required' or a named tool); {FIX}")


class StructuredOutputGuard(_Base):
    """The ``vllm.logits_processors`` entry point: refuses what the build cannot constrain (module doc); changes no
    logits."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        message = refusal(sampling_params)
        if message:
            raise ValueError(message)

    def __init__(self, vllm_config=None, device=None, is_pin_memory: bool = False) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update) -> None:
        pass

    def apply(self, logits):
        return logits
