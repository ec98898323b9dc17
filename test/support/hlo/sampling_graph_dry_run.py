"""``python -m test.support.hlo.sampling_graph_dry_run CONFIG_DIR OUT [--output-logits] [--no-sampling]``: NxDI's
``compile(dry_run=True)`` of the port with on-device sampling (:mod:`minimax_m3.neuron.sampling`) at TP 1, float32,
batch 2, buckets 128 and 256, then a JSON summary of every traced graph on stdout: the result tuple's leading
outputs (dtype and shape), the user inputs' shapes (``input4``: the sampling params), and the count of ``rng``
instructions (the seeded draw needs none).

Runs with the trace stand-ins (``standins_trace``) in its own process, as ``test.support.hlo.dry_run``. NxD's NKI top-k
kernel has no stand-in, so ``top_k_kernel_enabled=False`` traces NxD's other distributed top-k (the ``TopK`` custom
call); on trn2 NxDI's default (the kernel) applies.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from . import standins_trace

TYPES = {1: "pred", 2: "s8", 3: "s16", 4: "s32", 5: "s64", 6: "u8", 8: "u32", 10: "f16", 11: "f32", 12: "f64",
         16: "bf16"}


def _shape(s) -> str:
    return f"{TYPES.get(s.element_type, s.element_type)}{list(s.dimensions)}"


def summarize(out: Path) -> list[dict]:
    from minimax_m3.graphs import hlo_schema

    man = json.loads((out / "dry_run.json").read_text())
    rows = []
    for g in man["graphs"]:
        m = hlo_schema.parse_module((out / g["hlo"]).read_bytes())
        result = m.host_program_shape.result
        shapes = [_shape(p) for p in m.host_program_shape.parameters]
        inputs = {p["name"]: shapes[p["number"]] for p in g["params"] if p["role"] == "input"}
        rng = sum(i.opcode.startswith("rng") for c in m.computations for i in c.instructions)
        rows.append({"submodel": g.get("submodel"), "bucket": g.get("bucket"),
                     "outputs": [_shape(s) for s in result.tuple_shapes[:3]], "n_outputs": len(result.tuple_shapes),
                     "inputs": inputs, "rng_ops": rng})
    return rows


def main(argv: list[str]) -> int:
    standins_trace.install()
    from minimax_m3.config import M3Config
    from minimax_m3.engine.spec import EngineSpec
    from minimax_m3.neuron import trace as dry_run
    from minimax_m3.neuron.build import inference_config
    from minimax_m3.neuron.model import NeuronMiniMaxM3ForCausalLM
    from minimax_m3.neuron.sampling import on_device_sampling_config

    model, out = argv[0], Path(argv[1])
    m3 = M3Config.from_pretrained(model)
    spec = EngineSpec(model, backend="neuron", tp=1, ep=1, lnc=1, max_batch=2, max_seq_len=256, dtype="float32",
                      context_buckets=(128, 256), token_buckets=(128, 256)).resolve(m3)
    config = inference_config(spec, m3, save_sharded_checkpoint=False, attn_kernel_enabled=False,
                              output_logits="--output-logits" in argv,
                              on_device_sampling_config=None if "--no-sampling" in argv else
                              on_device_sampling_config(top_k_kernel_enabled=False))
    app = NeuronMiniMaxM3ForCausalLM(model, config)
    dry_run.trace(app, out, "minimax-m3", m3)
    print(json.dumps(summarize(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
