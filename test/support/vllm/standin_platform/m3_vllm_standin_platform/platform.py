"""vllm-neuron's platform with the CPU-mode worker (tests only)."""

from vllm_neuron.platform import NeuronPlatform

NEURON_WORKER = "vllm_neuron.worker.neuron_worker.NeuronWorker"


class StandinNeuronPlatform(NeuronPlatform):
    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)
        if vllm_config.parallel_config.worker_cls == NEURON_WORKER:
            vllm_config.parallel_config.worker_cls = "m3_vllm_standin_platform.worker.CpuModeNeuronWorker"
