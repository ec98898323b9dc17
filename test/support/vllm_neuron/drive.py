"""``python -m test.support.vllm_neuron.drive SPEC.json OUT.json``: one ``vllm.LLM`` on the off-device harness
(``m3_vneuron_harness``), requests added at chosen engine steps, their tokens (greedy unless a request's
``sampling`` says otherwise) and the step of each written to OUT.

SPEC: ``{"model": DIR, "engine": {LLM kwargs}, "env": {...}, "requests": [{"id", "prompt": [ids], "max_tokens",
"arrive": STEP, "sampling": {SamplingParams fields, optional}}, ...]}``. The harness's per-forward trace goes to
``$M3_VNEURON_TRACE`` (SPEC ``env`` may set it). OUT: ``{"tokens": {id: [...]}, "token_steps": {id: [engine step of
each token]}, "steps": N, "seconds": {...}}``.

Run in a process of its own (vLLM picks its platform once per process; spawned workers re-import this module, hence
the ``__main__`` guard). ``M3_VNEURON_HARNESS=1`` selects the harness platform; ``VLLM_PLUGINS`` limits vLLM to it.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    os.environ.update({k: str(v) for k, v in spec.get("env", {}).items()})
    os.environ["M3_VNEURON_HARNESS"] = "1"
    os.environ.setdefault("VLLM_PLUGINS", "m3_vneuron_harness")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t0 = time.perf_counter()
    import vllm
    from vllm.sampling_params import RequestOutputKind

    t_import = time.perf_counter()
    engine_kw = dict(dtype="float32", skip_tokenizer_init=True, seed=0, tensor_parallel_size=1)
    engine_kw.update(spec.get("engine", {}))
    llm = vllm.LLM(model=spec["model"], **engine_kw)
    engine = llm.llm_engine
    t_init = time.perf_counter()

    pending = sorted(spec["requests"], key=lambda r: r.get("arrive", 0))
    tokens: dict[str, list[int]] = {r["id"]: [] for r in pending}
    steps: dict[str, list[int]] = {r["id"]: [] for r in pending}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].get("arrive", 0) <= step:
            r = pending.pop(0)
            sampling = {"temperature": 0.0, **r.get("sampling", {})}  # greedy unless the request says otherwise
            params = vllm.SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True,
                                         output_kind=RequestOutputKind.DELTA, **sampling)
            engine.add_request(r["id"], vllm.TokensPrompt(prompt_token_ids=r["prompt"]), params)
        step += 1
        for out in engine.step():
            new = list(out.outputs[0].token_ids)
            tokens[out.request_id] += new
            steps[out.request_id] += [step] * len(new)
        if step > 10000:
            raise RuntimeError("no progress")
    t_run = time.perf_counter()
    result = {"tokens": tokens, "token_steps": steps, "steps": step,
              "seconds": {"import": round(t_import - t0, 2), "init": round(t_init - t_import, 2),
                          "run": round(t_run - t_init, 2)}}
    with open(out_path, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
