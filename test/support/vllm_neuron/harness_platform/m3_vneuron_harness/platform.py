"""vLLM's CpuPlatform with the harness's worker, and the Neuron plugin's config defaults that shape a forward."""

from __future__ import annotations

from vllm.platforms.cpu import CpuPlatform

WORKER = "m3_vneuron_harness.worker.HarnessWorker"


class HarnessPlatform(CpuPlatform):
    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        from vllm import ModelRegistry

        from .contract import model_registry
        from .stub import stub_for

        for arch in model_registry():  # a bare factory fails vLLM 0.24's ModelConfig check (see .stub)
            ModelRegistry.register_model(arch, stub_for(arch))

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        super().check_and_update_config(vllm_config)
        cache = vllm_config.cache_config
        if not cache.user_specified_block_size:
            cache.block_size = 32  # P@0 update_block_size_for_backend: Neuron's default block size
        vllm_config.scheduler_config.async_scheduling = False  # the harness steps synchronously
        from vllm.config import CompilationMode

        vllm_config.compilation_config.mode = CompilationMode.NONE  # the model is not a vLLM model
        # the grammar bitmask on the scheduler's output before the forward, where the plugin's runner reads it
        vllm_config.scheduler_config.scheduler_cls = "m3_vneuron_harness.scheduler.GrammarFirstScheduler"
        if vllm_config.parallel_config.worker_cls in ("auto", "vllm.v1.worker.cpu_worker.CPUWorker"):
            vllm_config.parallel_config.worker_cls = WORKER

    @classmethod
    def update_block_size_for_backend(cls, vllm_config) -> None:
        return  # no vLLM attention backend to reconcile with
