"""``minimax-m3 compile --dry-run``: NxDI's own ``compile(dry_run=True)``, then every bucket's HLO module on disk.

NxD's ``ModelBuilder.trace`` lowers each bucket of each submodel (context encoding, token generation) to the HLO
module neuronx-cc would receive; with ``dry_run=True`` it writes the neuronx-cc command lines instead of compiling
(NxD still compiles the *priority* model, token generation bucket 0, when ``libneuronxla`` offers
``neuron_xla_wlo_compile``; on a trn2 host that is one real compile). This module then writes, under ``OUT``:

* ``hlo/<submodel>/bucket<i>.hlo``: the serialized ``xla.HloModuleProto`` of each bucket (rank 0's graph: NxD traces
  one SPMD graph for all ranks at per-rank shapes);
* ``workdir/``: NxD's compiler work directory (per bucket ``model/graph.hlo`` and the neuronx-cc command);
* ``dry_run.json``: the layout, the model config and, per graph, its bucket, batch and the role and name of every
  entry parameter (user input, state = aliased cache, weight, constant) read from the bucket's metaneff;
* ``graphs.json``: the cost report of ``minimax-m3 graphs`` (when that module is present).

Nothing here loads weights: a ``config.json`` is enough. Importing this module needs nothing beyond the package;
the NxDI classes are imported inside the functions.
"""

from __future__ import annotations

import json
from pathlib import Path

from .._atomic import write_atomic
from ..config import parallel
from ..config.m3 import ConfigError, M3Config
from ..engine.spec import EngineSpec, SpecError

ROLES = {0: "input", 1: "state", 2: "weight"}  # metaneff MetaTensor.Type: USER_INPUT, INPUT_STATE, INPUT_WEIGHT


def check(spec: EngineSpec) -> tuple[EngineSpec, M3Config]:
    """Every reason the port cannot trace ``spec``, in one :class:`SpecError`: the spec's own checks and the dry
    run's (``--model`` must be a directory with ``config.json``, the only file a dry run reads; the graph harness
    splits the vocabulary in equal slices). Else the resolved spec and the model config."""
    config, problems = None, []
    if not (Path(spec.model) / "config.json").is_file():
        problems.append(f"{spec.model}/config.json not found: --model must name a checkpoint directory (a dry run "
                        "reads only its config.json)")
    else:
        try:
            config = M3Config.from_pretrained(spec.model)
        except ConfigError as exc:
            problems += exc.problems
    s = spec.resolve(config)
    problems += spec.problems(config)
    if config is not None and min(s.tp, s.ep) >= 1:
        problems += parallel.vocab_problems(config, s.tp)
    if problems:
        raise SpecError(problems, source="compile --dry-run")
    return s, config


def _bucket_of(example_inputs) -> tuple[int, int, int]:
    """(bucket length, batch, tokens per row) of one bucket's example inputs: NxDI passes input_ids, attention_mask,
    ... and the attention mask spans the bucket (prefill: the prompt bucket; decode and a speculative verify step:
    the cache bucket); input_ids hold the call's tokens per row (decode 1, verify ``speculation_length``)."""
    ids, mask = example_inputs[0], example_inputs[1]
    return int(mask.shape[-1]), int(ids.shape[0]), int(ids.shape[-1])


def write_manifest(app, out: str | Path, port: str, model_config: M3Config) -> Path:
    """After ``app.compile(out, dry_run=True)``: each bucket's module and ``dry_run.json``. Works for any NxDI
    application (the published community port is traced by the same code in the tests)."""
    from torch_neuronx.proto import metaneff_pb2

    from .nxd_compat import own_commands

    out = Path(out)
    builder = app.get_builder()
    own_commands(builder)  # NxD 2.29's dry run writes the priority graph's arguments into every command
    nc = app.neuron_config
    graphs = []
    for key, artifacts in builder.model_collection.items():
        for i, hlo in enumerate(artifacts.hlo_artifact_collection):
            rel = Path("hlo") / key / f"bucket{i}.hlo"
            write_atomic(out / rel, hlo.hlo_module.SerializeToString())
            meta = metaneff_pb2.MetaNeff()
            meta.ParseFromString(hlo.metaneff if isinstance(hlo.metaneff, bytes) else hlo.metaneff.SerializeToString())
            params = []
            for n, t in enumerate(meta.input_tensors):
                name = (t.checkpoint_key or t.name or b"").decode(errors="replace")
                role = ROLES.get(int(t.type), "constant")
                if role == "weight" and not t.checkpoint_key:
                    role = "constant"
                params.append({"number": n, "role": role, "name": name})
            bucket, batch, tokens = _bucket_of(artifacts.example_inputs[i])
            workdir = Path(builder.compiler_workdir) / key / f"_tp0_bk{i}"
            command = workdir / "command.txt"
            graphs.append({"submodel": key, "bucket": bucket, "batch": batch, "tokens": tokens, "hlo": str(rel),
                           "command": str(command.relative_to(out)) if command.is_file() and _under(command, out)
                           else (str(command) if command.is_file() else None),
                           "compiler_args": artifacts.compiler_args, "params": params,
                           # what the tracer saw (CPU fallbacks, host reads, position probe), where it reports it
                           "trace_checks": getattr(hlo, "trace_checks", None)})
    manifest = {
        "format": 1, "port": port,
        "layout": {"tp": nc.tp_degree, "ep": getattr(nc, "moe_ep_degree", 1), "lnc": nc.logical_nc_config,
                   "world_size": nc.world_size, "rank": 0, **cache_layout(app.config),
                   # --decode-experts tp: NxD's hybrid sharding, the decode graphs' own copy of the routed experts
                   "decode_experts": "ep" if getattr(nc, "hybrid_sharding_config", None) is None else "tp"},
        "dtype": str(nc.torch_dtype).replace("torch.", ""), "batch_size": nc.batch_size,
        "max_length": nc.max_length, "model": model_config.fields_dict(), "graphs": graphs,
        # a build with a draft: k + 1 tokens per verify step (the speculation graph), the target states it returns
        "speculation_length": getattr(nc, "speculation_length", 0) or 0,
        "aux_hidden_layers": list(getattr(app.config, "aux_hidden_layers", None) or ()),
        "weights": "fp8" if getattr(nc, "quantized", False) else "bf16",  # routed experts (checkpoint.fp8_experts)
    }
    path = out / "dry_run.json"
    write_atomic(path, (json.dumps(manifest, indent=1) + "\n").encode())
    return path


def cache_layout(config) -> dict:
    """The KV caches' layout of an NxDI config: ``kv_layout`` (``sharded``: each KV head's K/V and index-K split
    over its ``kv_group`` ranks; ``replicated``: NxDI's GQA copies, also any port without the attribute) and
    ``prefill_chunk`` (tokens per context-encoding call; None: a prompt in one call), ``chunked`` (a prompt may take
    several calls: the chunk is below ``max_context_length``)."""
    group = int(getattr(config, "num_cores_per_group", 1) or 1)
    layout = "sharded" if getattr(config, "kv_layout", None) == "sharded" and group > 1 else "replicated"
    chunk = getattr(config, "prefill_chunk", None)
    return {"kv_layout": layout, "kv_group": group if layout == "sharded" else 1, "prefill_chunk": chunk,
            "chunked": bool(chunk) and chunk < config.neuron_config.max_context_length}


def _under(p: Path, root: Path) -> bool:
    try:
        p.resolve().relative_to(root.resolve())
        return True
    except ValueError:
        return False


def trace(app, out: str | Path, port: str, model_config: M3Config) -> Path:
    """NxDI's ``compile(dry_run=True)`` into ``out`` (compiler work directory ``out/workdir``), with HLO metadata
    (source lines, for the cost report's classification), then :func:`write_manifest`."""
    from neuronx_distributed.utils import HloMetadataLevel

    from .nxd_compat import compiler_workdir

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with compiler_workdir(out / "workdir"):
        app.compile(str(out), debug=HloMetadataLevel.INFO, dry_run=True)
    return write_manifest(app, out, port, model_config)
