"""``python -m test.support.vllm.compile_then_generate MODEL DIR OUT.json [DRAFT]``: ``minimax-m3 compile --for-vllm``
(CPU mode) writes DIR, then ``vllm.LLM`` with ``NEURON_COMPILED_ARTIFACTS=DIR`` and no ``override_neuron_config`` at all
generates greedy tokens for the smoke test's prompts (in a fresh process: one NxDI CPU-mode model per process). With
DRAFT: a fused-speculation artifact (``--draft DRAFT --fused-speculation``, 3 drafts), served with the
``--speculative-config`` and the override compile printed, for the prompts short enough to leave room for the drafts
(vLLM stops a sequence ``num_speculative_tokens`` before ``--max-model-len``)."""

from __future__ import annotations

import json
import os
import sys


def main(model: str, compiled: str, out: str, draft: str | None = None) -> int:
    import m3_vllm_standin_platform

    m3_vllm_standin_platform.setup()  # NxDI importable (stand-ins) before compile runs
    from minimax_m3.neuron import compile as m3_compile

    from test.vllm.test_vllm_smoke import MAX_LEN, PROMPTS, SEQS, STEPS

    fused = ["--draft", draft, "--speculative-tokens", "3", "--fused-speculation", "--on-device-sampling"] \
        if draft else []
    m3_compile.main(["--backend", "neuron-cpu", "--for-vllm", "--model", model, "--dtype", "float32", "--batch",
                     str(SEQS), "--max-seq-len", str(MAX_LEN), "--context-buckets", "16,32,64", "--token-buckets",
                     str(MAX_LEN), "--compiled", compiled, *fused])
    os.environ["NEURON_COMPILED_ARTIFACTS"] = compiled
    import vllm

    kw, prompts = {}, list(range(len(PROMPTS)))
    if draft:  # what compile printed: the speculative config, and the EAGLE3 switches vllm-neuron's config needs
        kw = dict(speculative_config={"method": "eagle", "model": draft, "num_speculative_tokens": 4},
                  additional_config={"override_neuron_config": {"is_eagle3": True, "disable_kv_cache_tiling": True}})
        prompts = [i for i, p in enumerate(PROMPTS) if len(p) + STEPS + 4 <= MAX_LEN]
    llm = vllm.LLM(model=model, dtype="float32", max_model_len=MAX_LEN, max_num_seqs=SEQS, tensor_parallel_size=1,
                   enable_prefix_caching=False, **kw)
    params = vllm.SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)
    outs = llm.generate([vllm.TokensPrompt(prompt_token_ids=PROMPTS[i]) for i in prompts], params)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    report = {"tokens": [list(o.outputs[0].token_ids) for o in outs], "prompts": prompts,
              "fused": bool(runner.model.model.neuron_config.enable_fused_speculation),
              "branch": getattr(runner.model, "m3_branch", None), "model_path": str(runner.model.model.model_path),
              "files": sorted(os.listdir(compiled))}
    with open(out, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
