"""vllm-neuron's worker, with the loader's compile-and-load and load-precompiled steps run in NxDI's CPU mode
(tests only).

Everything else is vllm-neuron's own: the neuron config it builds from vLLM's settings (plus the test's
``override_neuron_config``), the model class it finds in NxDI's ``MODEL_TYPES``, the inputs it builds per step.
"""

from minimax_m3.neuron.nxd_compat import to_cpu
from vllm_neuron.worker import neuronx_distributed_model_loader as loader
from vllm_neuron.worker.neuron_worker import NeuronWorker


def _build_and_run_on_cpu(self, model_path, neuronx_model_cls, config, compiled_path):
    """Stands for ``_compile_and_load_model``: the same application, run eagerly by NxDI on CPU (``to_cpu``)
    instead of compiled to ``compiled_path`` and loaded onto NeuronCores; through the port's own CPU-mode entry
    (``nxd_compat.to_cpu``: its adaptations of NxDI's, e.g. for fused speculation)."""
    self.model = neuronx_model_cls(model_path, config)
    to_cpu(self.model)
    self.m3_branch = "compiled"


def _load_precompiled_on_cpu(self, compiled_model_path, neuronx_model_cls, kwargs):
    """Stands for ``_load_compiled_model`` (vllm-neuron's branch for ``$NEURON_COMPILED_ARTIFACTS``): the same
    application built from the directory alone (NxDI reads ``neuron_config.json`` there and raises
    FileNotFoundError without it, which sends vllm-neuron to its compile branch), then run on CPU instead of
    ``load(dir)`` (which reads ``model.pt`` and ``weights/`` onto NeuronCores)."""
    self.model = neuronx_model_cls(compiled_model_path)
    to_cpu(self.model)
    self.m3_branch = "precompiled"


loader.NeuronCausalLM._compile_and_load_model = _build_and_run_on_cpu
loader.NeuronCausalLM._load_compiled_model = _load_precompiled_on_cpu


class CpuModeNeuronWorker(NeuronWorker):
    pass
