"""One rank of NxDI's CPU mode under ``torchrun``: the port loaded the normal way and from pre-sharded rank files.

``torchrun --nproc-per-node TP -m test.support.neuron.load_presharded_rank CKPT WEIGHTS OUT.json``

Engine A is NxDI's ``to_cpu()``: the whole converted state dict, sharded for this rank by NxD's
``get_sharded_checkpoint``. Engine B is the same ``to_cpu()`` with that one step replaced by what NxDI's
``load_weights`` does with ``save_sharded_checkpoint``: ``load_file(WEIGHTS/tp{rank}_sharded_checkpoint.safetensors)``
(no conversion, no hooks, no slicing: the file must already hold this rank's tensors). Every parameter of B must be
filled from the file (``NeuronMiniMaxM3Model.load_state_dict`` names any that is not). Rank 0 writes OUT.json with
both engines' prefill logits and greedy tokens.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

PROMPTS = [[5, 17, 200, 33, 41, 99, 7, 150] * 9, [3, 4, 5, 6, 7], [300, 12, 8, 77, 45, 2, 90, 61, 11, 260, 19]]
NEW_TOKENS = 6


@contextmanager
def presharded(app, weights: Path):
    """``app.to_cpu()`` reads this rank's pre-sharded file instead of converting and sharding the checkpoint."""
    import neuronx_distributed_inference.models.application_base as base
    from safetensors.torch import load_file

    def from_file(checkpoint, model, rank, tp_degree, is_cached=False):
        checkpoint.clear()
        checkpoint.update(load_file(str(weights / f"tp{rank}_sharded_checkpoint.safetensors")))

    saved = base.get_sharded_checkpoint
    base.get_sharded_checkpoint = from_file
    app.checkpoint_loader_fn = lambda mmap=False: {}
    try:
        yield
    finally:
        base.get_sharded_checkpoint = saved
        del app.checkpoint_loader_fn


def engine(ckpt: str, tp: int, weights: Path | None):
    from minimax_m3.neuron.provider import NeuronEngine
    from minimax_m3.neuron.nxd_compat import to_cpu as _to_cpu
    from minimax_m3.neuron.build import application, inference_config
    from test.support.neuron.cpu_plugin import nxdi_spec

    spec, m3 = nxdi_spec(ckpt, tp=tp, max_batch=1, max_seq_len=96, max_context_len=80, all_logits=True)
    app = application(ckpt, inference_config(spec, m3))
    if weights is None:
        _to_cpu(app)
    else:
        with presharded(app, weights):
            _to_cpu(app)
    return NeuronEngine(app, m3, spec)


def main(argv: list[str]) -> int:
    import torch

    from minimax_m3.engine import GenerationConfig
    from test.support.neuron import standins

    standins.bootstrap()
    ckpt, weights, out = argv[0], Path(argv[1]), Path(argv[2])
    tp = int(os.environ.get("WORLD_SIZE", "1"))
    res = {}
    for name, w in (("normal", None), ("presharded", weights)):
        eng = engine(ckpt, tp, w)
        logits = eng.prefill_logits(PROMPTS)
        gen = eng.generate(PROMPTS, GenerationConfig(max_new_tokens=NEW_TOKENS, return_logits=True))
        res[name] = {"prefill": logits, "tokens": [g.tokens for g in gen], "steps": [g.step_logits for g in gen]}
    a, b = res["normal"], res["presharded"]
    report = {
        "tp": tp,
        "prefill_max_abs": max(float((x - y).abs().max()) for x, y in zip(a["prefill"], b["prefill"])),
        "prefill_equal": all(torch.equal(x, y) for x, y in zip(a["prefill"], b["prefill"])),
        "steps_max_abs": max(float((x - y).abs().max()) for x, y in zip(a["steps"], b["steps"])),
        "tokens_normal": a["tokens"], "tokens_presharded": b["tokens"],
    }
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
