"""``python -m test.support.hlo.execute_graphs DRY CKPT REQUEST.json OUT.pt``: the traced TP=1 modules executed
through XLA.

Proves the graphs ``compile --dry-run`` wrote compute the model (not only that they exist): NxD shards the checkpoint
for rank 0 exactly as it would for the NEFF (``ModelBuilder.shard_checkpoint``), each bucket is traced again in this
process (the stand-ins' ``generate_hlo``: the module must be identical to the one on disk, debug metadata aside, and
the trace gives the values of the constants the graph takes as parameters), then the modules run on torch-xla's CPU
client: context encoding of the prompts (right-padded into the smallest bucket that holds them; one pass per
prompt into its cache row when the graph's batch is 1, continuous batching), then
greedy decode steps, each in the smallest token-generation bucket that holds the position, the caches carried from
graph to graph through the aliased outputs. ``REQUEST.json``: ``{"prompts": [[ids], ...], "steps": N}``; writes
``{"step_logits": [B, N + 1, V], "tokens": [B, N + 1]}`` (float32) to ``OUT.pt``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from . import standins_trace


def _inputs(ids, pos, batch, first_row=0):
    """NxDI's positional model inputs: input_ids, attention_mask, position_ids, seq_ids, sampling_params."""
    return [ids, (ids != 0).to(torch.int32), pos, torch.arange(first_row, first_row + batch, dtype=torch.int32),
            torch.ones(batch, 3, dtype=torch.float32)]


def main(dry: str, ckpt: str, request: str, out: str) -> None:
    os.environ["HLO_PROBE_POSITIONS"] = "0"
    standins_trace.install()
    import torch_xla
    import torch_xla.core.xla_builder as xb

    from minimax_m3.graphs import hlo_schema
    from minimax_m3.neuron.config import MiniMaxM3InferenceConfig
    from minimax_m3.neuron.model import NeuronMiniMaxM3ForCausalLM

    dry = Path(dry)
    man = json.loads((dry / "dry_run.json").read_text())
    req = json.loads(Path(request).read_text())
    config = MiniMaxM3InferenceConfig.load(str(dry))
    # the dry run's saved config names the checkpoint it was traced with (``_name_or_path``), which NxDI's loader reads
    # first; a dry run reused from the result cache may name a folder that is gone: the checkpoint is this argument
    config._name_or_path = str(ckpt)
    app = NeuronMiniMaxM3ForCausalLM(ckpt, config)
    builder = app.get_builder()
    dev = torch_xla.device()

    with tempfile.TemporaryDirectory() as tmp:  # NxD's own trace again, here (see the module docstring)
        os.environ["BASE_COMPILE_WORK_DIR"] = tmp + "/"
        app.compile(tmp, dry_run=True)
    graphs = {}
    for g in man["graphs"]:
        key = g["submodel"]
        idx = int(Path(g["hlo"]).stem.removeprefix("bucket"))
        art = builder.model_collection[key].hlo_artifact_collection[idx]
        on_disk = hlo_schema.parse_module((dry / g["hlo"]).read_bytes())
        if standins_trace._fingerprint(art.hlo_module) != standins_trace._fingerprint(on_disk):
            raise SystemExit(f"{g['hlo']}: the re-traced module differs from the one on disk")
        comp = xb.computation_from_module_proto(f"{key}_{idx}", on_disk.SerializeToString())
        graphs[(key, g["bucket"])] = (g, comp, art.constant_parameter_tensors)
    cache_params = dict(builder.model_collection["context_encoding_model"].model_instance.module.named_parameters())
    weights = builder.shard_checkpoint()[0]  # after tracing: sharding reloads the modules on the meta device

    batch = man["batch_size"]
    states = [p for p in next(iter(graphs.values()))[0]["params"] if p["role"] == "state"]
    cache_shapes = {p["name"]: None for p in states}
    caches = {}

    def run(key, bucket, model_inputs):
        g, comp, constants = graphs[(key, bucket)]
        args = []
        for p in g["params"]:
            if p["role"] == "input":
                t = model_inputs[int(p["name"].removeprefix("input"))]
            elif p["role"] == "state":
                t = caches[p["name"]]
            elif p["role"] == "weight":
                t = weights[p["name"]]
            else:
                t = constants[p["number"]]
            args.append(t.to(dev))
        outs = torch_xla._XLAC._xla_user_computation(f"xla::{key}_{bucket}", args, comp)
        # one XLA graph for all outputs: reading them one by one (.cpu()) would compile the whole module once per
        # output (the logits and every cache): 12 compiles of each bucket instead of 1
        torch_xla.sync(wait=True)
        for i, p in enumerate(states):
            caches[p["name"]] = outs[1 + i].cpu()
        return outs[0].cpu().float()

    for name in cache_shapes:
        caches[name] = torch.zeros(cache_params[name].shape, dtype=cache_params[name].dtype)
    prompts = req["prompts"]
    ctx = sorted(b for k, b in graphs if k == "context_encoding_model")
    tkg = sorted(b for k, b in graphs if k == "token_generation_model")
    bucket = min(b for b in ctx if b >= max(len(p) for p in prompts))
    ids = torch.zeros(batch, bucket, dtype=torch.int32)
    pos = torch.zeros(batch, bucket, dtype=torch.int32)
    for r, p in enumerate(prompts):
        ids[r, :len(p)] = torch.tensor(p)
        pos[r, :len(p)] = torch.arange(len(p))
    ctx_batch = graphs[("context_encoding_model", bucket)][0]["batch"]  # 1 under continuous batching
    logits = torch.cat([run("context_encoding_model", bucket,
                            _inputs(ids[r:r + ctx_batch], pos[r:r + ctx_batch], ctx_batch, r)).reshape(ctx_batch, -1)
                        for r in range(0, batch, ctx_batch)])
    steps, tokens = [logits], [logits.argmax(-1)]
    position = torch.tensor([len(p) for p in prompts] + [len(prompts[0])] * (batch - len(prompts)))
    for _ in range(req["steps"]):
        b = min(x for x in tkg if x > int(position.max()))
        logits = run("token_generation_model", b, _inputs(tokens[-1].view(batch, 1).to(torch.int32),
                                                          position.view(batch, 1).to(torch.int32), batch))
        logits = logits.reshape(batch, -1)
        steps.append(logits)
        tokens.append(logits.argmax(-1))
        position = position + 1
    torch.save({"step_logits": torch.stack(steps, 1), "tokens": torch.stack(tokens, 1)}, out)


if __name__ == "__main__":
    main(*sys.argv[1:5])
