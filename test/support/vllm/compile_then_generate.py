"""``python -m test.support.vllm.compile_then_generate MODEL DIR OUT.json``: ``minimax-m3 compile --for-vllm`` (CPU
mode) writes DIR, then ``vllm.LLM`` with ``NEURON_COMPILED_ARTIFACTS=DIR`` and no ``override_neuron_config`` at all
generates greedy tokens for the smoke test's prompts (in a fresh process: one NxDI CPU-mode model per process)."""

from __future__ import annotations

import json
import os
import sys


def main(model: str, compiled: str, out: str) -> int:
    import m3_vllm_standin_platform

    m3_vllm_standin_platform.setup()  # NxDI importable (stand-ins) before compile runs
    from minimax_m3.neuron import compile as m3_compile

    from test.vllm.test_vllm_smoke import MAX_LEN, PROMPTS, SEQS, STEPS

    m3_compile.main(["--backend", "neuron-cpu", "--for-vllm", "--model", model, "--dtype", "float32", "--batch",
                     str(SEQS), "--max-seq-len", str(MAX_LEN), "--context-buckets", "16,32,64", "--token-buckets",
                     str(MAX_LEN), "--compiled", compiled])
    os.environ["NEURON_COMPILED_ARTIFACTS"] = compiled
    import vllm

    llm = vllm.LLM(model=model, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=SEQS, tensor_parallel_size=1,
                   enable_prefix_caching=False)
    params = vllm.SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([vllm.TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    report = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "branch": getattr(runner.model, "m3_branch", None), "model_path": str(runner.model.model.model_path),
              "files": sorted(os.listdir(compiled))}
    with open(out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
