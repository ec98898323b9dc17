"""The harness's vLLM worker (``vllm/v1/worker/worker_base.py: WorkerBase``): one CPU rank, a gloo group of one, the
model runner of :mod:`.runner`. The engine calls, in order (``v1/engine/core.py``, ``v1/executor/abstract.py``):
init_device, load_model, get_kv_cache_spec, determine_available_memory, initialize_from_config,
compile_or_warm_up_model, get_supported_tasks, then per step execute_model (+ sample_tokens when it returned None)."""

from __future__ import annotations

import os

import torch
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from .runner import HarnessRunner

DEFAULT_KV_BYTES = 256 << 20


class HarnessWorker(WorkerBase):
    def init_device(self) -> None:
        from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

        self.device = torch.device("cpu")
        pc = self.parallel_config
        if pc.pipeline_parallel_size != 1 or pc.data_parallel_size != 1:
            raise NotImplementedError("the harness runs tensor parallelism only (one pipeline stage, one DP rank)")
        init_distributed_environment(pc.world_size, self.rank, self.distributed_init_method or "env://",
                                     self.local_rank, "gloo")
        ensure_model_parallel_initialized(pc.tensor_parallel_size, pc.pipeline_parallel_size,
                                          pc.prefill_context_parallel_size, pc.decode_context_parallel_size)
        torch.manual_seed(self.model_config.seed or 0)
        self.model_runner = HarnessRunner(self.vllm_config, self.device)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        # under the engine's config, as vLLM's own worker loads (vllm/v1/worker/gpu_worker.py:380) and as the plugin's
        # models expect (qwen3/model.py reads get_current_vllm_config() in load_weights)
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.model_runner.load_model()

    def get_model(self):
        return self.model_runner.model

    def get_kv_cache_spec(self):
        return self.model_runner.get_kv_cache_spec()

    def determine_available_memory(self) -> int:
        """The KV budget: ``M3_VNEURON_KV_BYTES``, else vLLM's ``kv_cache_memory_bytes``, else 256 MiB (tests pin the
        block count with ``num_gpu_blocks_override``)."""
        env = os.environ.get("M3_VNEURON_KV_BYTES")
        if env:
            return int(env)
        return int(getattr(self.cache_config, "kv_cache_memory_bytes", None) or DEFAULT_KV_BYTES)

    def initialize_from_config(self, kv_cache_config) -> None:
        self.model_runner.initialize_kv_cache(kv_cache_config)

    def initialize_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        pass

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=self.model_runner.warm_up(), encoder=0.0)

    def get_supported_tasks(self):
        return ("generate",)

    def execute_model(self, scheduler_output):
        return self.model_runner.execute_model(scheduler_output)

    def sample_tokens(self, grammar_output):
        return self.model_runner.sample_tokens(grammar_output)

    def take_draft_token_ids(self):
        return self.model_runner.take_draft_token_ids()

    def execute_dummy_batch(self) -> None:
        pass

    def update_max_model_len(self, max_model_len: int) -> None:
        self.model_config.max_model_len = max_model_len

    def get_cache_block_size_bytes(self) -> int:
        raise NotImplementedError

    def profile(self, is_start: bool = True, profile_prefix: str | None = None):
        pass

    def check_health(self) -> None:
        return

    def shutdown(self) -> None:
        return

    def add_lora(self, lora_request) -> bool:
        raise NotImplementedError("no LoRA in the harness")

    def remove_lora(self, lora_id: int) -> bool:
        raise NotImplementedError

    def pin_lora(self, lora_id: int) -> bool:
        raise NotImplementedError

    def list_loras(self) -> set[int]:
        return set()
