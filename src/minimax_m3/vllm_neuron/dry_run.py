"""``minimax-m3 compile --dry-run --route vllm-neuron``: every bucket the plugin would compile, as StableHLO, costed.

The plugin compiles one graph per bucket (``docs/notes/vllm_neuron_runner.md``, "Buckets"): prefill segments of
``max_num_batched_tokens`` tokens (one size, one of 512..8192, or ``max_model_len`` up to 16K single-shot) and
decode batches of 1, 2, 4 .. ``max_num_seqs`` rows, each over a block table ``cdiv(max_model_len, 128)`` pages wide.
Here ``--prefill-chunk`` is the segment, ``--batch`` ``max_num_seqs``, ``--max-seq-len`` ``max_model_len``,
``--speculative-tokens K`` adds the ``1 + K`` verify graph per batch, ``--on-device-sampling`` the sampler to every
graph (the plugin's default; without it, the graphs return logits to vLLM's sampler).

For each bucket, rank 0 of ``--tp`` (``--ep`` expert-parallel groups) with random weights at the rank's shapes
(:func:`.capture.rank_model`) is captured whole (:func:`.capture.capture`) and lowered to StableHLO
(:func:`.capture.lower`); under ``OUT`` this writes ``stablehlo/<submodel>/bucket<i>.mlir`` (the module neuronx-cc
would receive), ``hlo/<submodel>/bucket<i>.hlo`` (the same module as an ``xla.HloModuleProto``:
:mod:`minimax_m3.graphs.stablehlo`) and ``dry_run.json`` in the NxDI dry run's format (submodels named as NxDI's:
``context_encoding_model`` for a prefill segment, ``token_generation_model`` / ``speculation_model`` for decode and
verify), so ``minimax-m3 graphs OUT [NXDI_DIR]`` reports both ports the same way. Nothing is compiled and no
weights are read: ``--model`` needs only ``config.json``. Needs torch and torch-mlir (not the Neuron SDK).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .._atomic import write_atomic
from ..config.m3 import ConfigError, M3Config
from ..errors import M3Error
from ..graphs.stablehlo import to_hlo
from ..config import parallel
from ..planner.memory import segment_problems, segment_tokens
from .capture import Bucket, capture, lower, rank_model

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, None: torch.bfloat16}


class DryRunError(M3Error, ValueError):
    """The options name buckets the plugin would not compile, or torch-mlir is absent."""

    def __init__(self, problems):
        super().__init__(problems, "compile --dry-run --route vllm-neuron:")


def buckets(c: M3Config, max_seq_len: int, max_batch: int, segment: int | None, drafts: int = 0,
            dcp: int = 1) -> list[Bucket]:
    """The plugin's buckets: one prefill segment size, decode batches 1, 2, 4 .. ``max_batch`` (plus ``1 + drafts``
    verify graphs), all over a table ``cdiv(max_seq_len, block x dcp)`` pages wide (vLLM's virtual blocks under
    decode context parallelism)."""
    width = -(-max_seq_len // (c.index_block_size * dcp))
    seg = segment or segment_tokens(max_seq_len, None, dcp, c.index_block_size)
    # the plugin's segment rule, at its one home (the planner's paged layout); here the option is --prefill-chunk
    problems = [p.replace("--chunk = --seq", "--prefill-chunk = --max-seq-len").replace("--chunk", "--prefill-chunk")
                .replace("--seq", "--max-seq-len") for p in segment_problems(max_seq_len, seg, dcp, c.index_block_size)]
    if max_batch < 1:
        problems.append(f"--batch {max_batch}: at least 1")
    if problems:
        raise DryRunError(problems)
    out = [Bucket("prefill", seg, width)]
    b = 1
    while True:
        out.append(Bucket("decode", 1, width, batch=min(b, max_batch)))
        if drafts:
            out.append(Bucket("decode", 1 + drafts, width, batch=min(b, max_batch)))
        if b >= max_batch:
            return out
        b *= 2


def submodel(b: Bucket) -> str:
    return "context_encoding_model" if b.kind == "prefill" else (
        "token_generation_model" if b.tokens == 1 else "speculation_model")


def write(out: str | Path, c: M3Config, tp: int, ep: int, plan: list[Bucket], dtype=torch.bfloat16,
          log=print, experts: str = "bf16", on_device_sampling: bool = False, dcp: int = 1) -> Path:
    """Capture and lower each bucket of ``plan`` for rank 0 of ``tp`` (of its DCP group with ``dcp``); write the
    modules and ``dry_run.json``."""
    out = Path(out)
    width = plan[0].width
    rows = max(b.batch for b in plan)
    model = rank_model(c, world=tp, rank=0, ep=ep, dtype=dtype, num_blocks=rows * width + 1, experts=experts,
                       on_device_sampling=on_device_sampling, dcp=dcp)
    graphs, index = [], {}
    for b in plan:
        name = submodel(b)
        i = index[name] = index.get(name, -1) + 1
        t0 = time.perf_counter()
        cap = capture(model, b)  # whole, no recompile: what the plugin compiles
        low = lower(model, b)
        rel = f"{name}/bucket{i}"
        write_atomic(out / "stablehlo" / f"{rel}.mlir", low.text.encode())
        write_atomic(out / "hlo" / f"{rel}.hlo", to_hlo(low.text, low.aliases).SerializeToString())
        graphs.append({"submodel": name,
                       "bucket": b.tokens if b.kind == "prefill" else width * c.index_block_size * dcp,
                       "batch": b.batch, "tokens": b.tokens, "hlo": f"hlo/{rel}.hlo",
                       "stablehlo": f"stablehlo/{rel}.mlir", "params": low.params,
                       "trace_checks": {"fx_graphs": len(cap.graphs), "recompiles": 0}})
        log(f"  {name} bucket {i}: {b.kind} {b.batch} x {b.tokens} tokens over {b.width} pages, "
            f"{sum(cap.ops().values())} FX ops, StableHLO {len(low.text) / 1e6:.1f} MB in "
            f"{time.perf_counter() - t0:.0f} s")
    manifest = {"format": 1, "port": "vllm-neuron", "route": "torch.compile -> torch-mlir -> StableHLO",
                "layout": {"tp": tp, "ep": ep, "kv_layout": "paged", "chunked": True, "dcp": dcp},
                "dtype": str(dtype).replace("torch.", ""), "batch_size": rows,
                "max_length": width * c.index_block_size * dcp, "weights": experts,
                "on_device_sampling": on_device_sampling,
                "speculation_length": max((b.tokens for b in plan if b.kind == "decode"), default=1),
                "model": c.fields_dict(), "graphs": graphs}
    path = out / "dry_run.json"
    write_atomic(path, (json.dumps(manifest, indent=1) + "\n").encode())
    return path


def run(args) -> int:
    """The CLI: ``--model`` (config.json only), ``--tp`` (default 64: trn2.48xlarge at LNC 2), ``--ep`` (the model's
    ``ep_degree``, default 1), ``--weights`` (``fp8``: the plugin's ``quantization: "fp8"``),
    ``--max-seq-len``, ``--batch``, ``--prefill-chunk``, ``--speculative-tokens``, ``--on-device-sampling`` (the
    plugin's default: every graph ends in the draw of :mod:`.sampling`, ``sampling_params`` an input),
    ``--compiled OUT``."""
    problems = []
    try:
        import torch_mlir  # noqa: F401
    except ImportError:
        problems.append("torch-mlir is not installed: pip install torch-mlir (the plugin's native route lowers "
                        "through it; scripts/test_vllm_neuron_offdevice.sh builds an environment with it)")
    if not args.model or not (Path(args.model) / "config.json").is_file():
        problems.append(f"--model {args.model}: a directory with config.json (the only file a dry run reads)")
        c = None
    else:
        try:
            c = M3Config.from_pretrained(args.model)
        except ConfigError as exc:
            problems += exc.problems
            c = None
    tp, ep = args.tp or 64, args.ep or 1  # the model's default ep_degree: tensor-parallel experts
    dcp = getattr(args, "dcp", 1) or 1
    if c is not None:
        problems += parallel.dcp_problems(c, tp, dcp)
        if dcp > 1 and args.num_speculative_tokens:
            problems.append(f"--dcp {dcp} with --speculative-tokens: the EAGLE3 draft is not served with decode "
                            "context parallelism")
    if problems:
        raise DryRunError(problems)
    plan = buckets(c, args.max_seq_len, args.max_batch or 1, args.prefill_chunk, args.num_speculative_tokens or 0,
                   dcp)
    out = args.compiled or str(Path(args.model).resolve()) + f"-vllm-neuron-tp{tp}-dry-run"
    t0 = time.perf_counter()
    print(f"vllm-neuron dry run: rank 0 of TP {tp} / EP {ep}" + (f" / DCP {dcp}" if dcp > 1 else "")
          + f", {c.num_layers} layers, {len(plan)} bucket(s)")
    path = write(out, c, tp, ep, plan, DTYPES[args.dtype], experts=getattr(args, "weights", None) or "bf16",
                 on_device_sampling=bool(getattr(args, "on_device_sampling", False)), dcp=dcp)
    print(f"wrote {len(plan)} graph(s) in {time.perf_counter() - t0:.0f} s -> {path}")
    from ..graphs import report as graphs

    print(graphs.format_report([graphs.analyze_dir(out)]))
    return 0
