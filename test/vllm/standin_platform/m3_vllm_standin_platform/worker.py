"""vllm-neuron's worker, with the loader's compile-and-load step replaced by NxDI's CPU mode (tests only).

Everything else is vllm-neuron's own: the neuron config it builds from vLLM's settings (plus the test's
``override_neuron_config``), the model class it finds in NxDI's ``MODEL_TYPES``, the inputs it builds per step.
"""

from vllm_neuron.worker import neuronx_distributed_model_loader as loader
from vllm_neuron.worker.neuron_worker import NeuronWorker


def _build_and_run_on_cpu(self, model_path, neuronx_model_cls, config, compiled_path):
    """Stands for ``_compile_and_load_model``: the same application, run eagerly by NxDI on CPU (``to_cpu``)
    instead of compiled to ``compiled_path`` and loaded onto NeuronCores."""
    self.model = neuronx_model_cls(model_path, config)
    self.model.to_cpu()


loader.NeuronCausalLM._compile_and_load_model = _build_and_run_on_cpu


class CpuModeNeuronWorker(NeuronWorker):
    pass
