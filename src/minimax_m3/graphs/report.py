"""``minimax-m3 graphs DIR [DIR2 ...]``: the per-rank cost report of the graphs ``compile --dry-run`` wrote.

A dry-run directory holds ``dry_run.json`` (layout, model config, and per submodel x bucket the HLO module's
path and its parameters' roles) and the modules. For every graph this prints, per rank, what the module
computes (dot FLOPs by class), reads per step (weights, and the dense layers' K/V, sparse layers' K/V and
index-K caches), copies (full-size state copies) and reduces (collectives), next to the analytic minimum of
:mod:`minimax_m3.planner` for the same shapes, and refreshes ``DIR/graphs.json`` with the same figures.
How each figure is counted: :mod:`minimax_m3.graphs.hlo_cost`. Needs protobuf and the standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

from google.protobuf.message import DecodeError

from .._atomic import write_atomic
from ..config import parallel
from ..config.m3 import ConfigError, M3Config
from . import hlo_cost, hlo_schema
from .table import STATE_KINDS, format_report
from .. import planner as plan
from ..errors import M3Error

MANIFEST = "dry_run.json"
REPORT = "graphs.json"
FUSED = "fused_speculation_model"  # NxDI's fused speculation: draft steps, the target's verify, acceptance
SUBMODELS = ("context_encoding_model", "token_generation_model", "speculation_model", FUSED)  # NxDI's tags
STEPS = ("token_generation_model", "speculation_model", FUSED)  # a step over the bucket's caches
_CACHE_NAME = re.compile(r"past_key_values\.(\d+)$")


class GraphsError(M3Error, ValueError):
    """A directory that is not a readable dry run (says what was expected)."""


def _expected(path: Path, why: str) -> GraphsError:
    return GraphsError(f"{path}: {why}; expected a directory with {MANIFEST} and the HLO modules it lists, as "
                       f"`minimax-m3 compile --dry-run --compiled DIR` writes it")


def load_manifest(path: str | Path) -> tuple[Path, dict, M3Config]:
    root = Path(path)
    f = root / MANIFEST
    if not f.is_file():
        raise _expected(root, f"no {MANIFEST}")
    try:
        man = json.loads(f.read_text())
    except json.JSONDecodeError as exc:
        raise _expected(root, f"{MANIFEST} is not valid JSON ({exc})") from None
    problems = []
    if not isinstance(man, dict):
        raise _expected(root, f"{MANIFEST} is not a JSON object")
    if man.get("format") != 1:
        problems.append(f"format {man.get('format')!r} (this reader knows format 1)")
    layout = man.get("layout")
    if not isinstance(layout, dict) or not all(isinstance(layout.get(k), int) for k in ("tp", "ep")):
        problems.append("layout.tp / layout.ep missing")
    graphs = man.get("graphs")
    if not isinstance(graphs, list) or not graphs:
        problems.append("no graphs listed")
    else:
        for i, g in enumerate(graphs):
            if not isinstance(g, dict) or g.get("submodel") not in SUBMODELS or not isinstance(
                    g.get("bucket"), int) or not isinstance(g.get("hlo"), str):
                problems.append(f"graphs[{i}] needs submodel ({' | '.join(SUBMODELS)}), bucket and hlo")
            elif not (root / g["hlo"]).is_file():
                problems.append(f"graphs[{i}]: module {g['hlo']} is missing")
    model = man.get("model")
    if not isinstance(model, dict) or not model:
        problems.append("model config missing (the M3Config fields of the traced model)")
    try:
        cfg = M3Config.from_fields(model or {})
    except (ConfigError, TypeError) as exc:
        problems.append(f"model config unreadable ({exc})")
        cfg = None
    if problems:
        raise _expected(root, f"{MANIFEST} has {len(problems)} problem(s): " + "; ".join(problems))
    return root, man, cfg


def _roles(g: dict, params: dict, aliased: dict) -> tuple[dict[int, tuple[str, str]], bool]:
    """parameter number -> (role, name); inferred from the aliases when the manifest has no ``params``."""
    listed = g.get("params")
    if listed:
        return {int(p["number"]): (p.get("role", "weight"), p.get("name", "")) for p in listed}, False
    states = set(aliased)
    first_state = min(states) if states else None
    out = {}
    for p in params:
        role = "state" if p in states else ("input" if first_state is not None and p < first_state else "weight")
        out[p] = (role, f"p{p}")
    return out, True


def _state_kind(name: str, ordinal: int, rank: int, cfg: M3Config) -> str:
    """K/V of a dense or sparse layer, or an index-K cache (NxDI's order: 2L K/V entries, then index-K)."""
    m = _CACHE_NAME.search(name)
    n = int(m.group(1)) if m else ordinal
    if n >= 2 * cfg.num_layers or rank == 3:
        return "index_k"
    return "kv_sparse" if cfg.sparse_layers[n // 2] else "kv_dense"


def _draft_part(role: str, name: str) -> str | None:
    """A fused build's draft parameter (NxDI names the two models' ``draft_model.`` and ``target_model.``): its
    weights, its K/V cache (``kv``), or the target states NxDI keeps for it (``states``: the rolling buffer)."""
    if name.startswith("draft_model."):
        return {"weight": "weights", "state": "kv"}.get(role)
    return "states" if role == "state" and name.startswith("hidden_state_rolling_buffer.") else None


def analyze_graph(root: Path, man: dict, g: dict, cfg: M3Config) -> dict:
    try:
        module = hlo_schema.parse_module((root / g["hlo"]).read_bytes())
        params, aliases = hlo_cost.entry_parameters(module), hlo_cost.aliases(module)
    except (DecodeError, hlo_cost.HloCostError) as exc:
        raise _expected(root, f"module {g['hlo']} is not a readable HloModuleProto ({exc})") from None
    roles, inferred = _roles(g, params, aliases)
    bucket, max_len = g["bucket"], man.get("max_length") or g["bucket"]
    fraction = min(1.0, bucket / max_len)
    states = {p: fraction for p, (role, _) in roles.items() if role == "state"}
    a = hlo_cost.analyze_module(module, states=states)
    reads = dict.fromkeys(("weights",) + STATE_KINDS, 0)
    copies, copy_bytes = dict.fromkeys(STATE_KINDS, 0), dict.fromkeys(STATE_KINDS, 0)
    ordinal, notes, copy_ops = 0, list(a["notes"]), []
    draft = dict.fromkeys(("weights", "kv", "states", "state_copies", "state_copy_bytes"), 0)
    for p in sorted(roles):
        role, name = roles[p]
        part = _draft_part(role, name)
        if part:  # a fused build's draft: apart from the target's figures (and the planner's minimum)
            draft[part] += a["reads"].get(p, 0)
            draft["state_copies"] += a["copies"].get(p, 0)
            draft["state_copy_bytes"] += a["copy_bytes"].get(p, 0)
            copy_ops += a["copy_ops"].get(p, [])
        elif role == "weight":
            reads["weights"] += a["reads"].get(p, 0)
        elif role == "state" and p in params:
            kind = _state_kind(name, ordinal, len(params[p].dimensions), cfg)
            ordinal += 1
            reads[kind] += a["reads"].get(p, 0)
            copies[kind] += a["copies"].get(p, 0)
            copy_bytes[kind] += a["copy_bytes"].get(p, 0)
            copy_ops += a["copy_ops"].get(p, [])
    notes += [f"state copies: {n} x {op}" for op, n in Counter(copy_ops).items()]
    if inferred:
        notes.append("parameter roles inferred (no params in dry_run.json): aliased = state, numbered before "
                     "the first state = input, the rest = weight")
    unaliased = [roles[p][1] for p in states if p not in aliases]
    if unaliased:
        notes.append(f"state(s) not aliased to an output: {', '.join(unaliased)}")
    return {
        "submodel": g["submodel"], "bucket": bucket, "batch": g.get("batch", man.get("batch_size", 1)),
        "tokens": row_tokens(man, g),
        "hlo": g["hlo"], "command": g.get("command"),
        "instructions": a["instructions"], "entry_instructions": a["entry_instructions"],
        "flops": a["flops"], "bytes_read": reads, "state_copies": copies, "state_copy_bytes": copy_bytes,
        "collectives": a["collectives"], "collective_ops": a["collective_ops"], "gathered_kv": a["gathered_kv"],
        "custom_calls": a["custom_calls"],
        "uncounted_custom_calls": a["uncounted_custom_calls"], "notes": notes,
        "params": g.get("params"), "trace_checks": g.get("trace_checks"),
        **({"draft": draft} if any(_draft_part(*roles[p]) for p in roles) else {}),
    }


def kv_layout(man: dict) -> str:
    """The traced caches' layout (``sharded`` / ``replicated`` / ``paged``: the vLLM Neuron route's; a manifest from
    before the field: replicated)."""
    return man["layout"].get("kv_layout", "replicated")


def row_tokens(man: dict, g: dict) -> int:
    """Tokens per row of a graph's call: the manifest's (``tokens``), else 1 for token generation, the build's
    ``speculation_length`` for the speculation graph (``k + 1``), the bucket for context encoding. The fused graph
    takes one token per row (the last accepted) and its target verifies ``speculation_length``: that."""
    if g["submodel"] == FUSED:
        return man.get("speculation_length") or 1
    if g.get("tokens"):
        return int(g["tokens"])
    return {"token_generation_model": 1, "speculation_model": man.get("speculation_length") or 1}.get(
        g["submodel"], g["bucket"])


def analytic(cfg: M3Config, man: dict, g: dict) -> dict:
    """The planner's minimum for the same shapes and cache layout (an ``error`` when the layout cannot be planned).

    Token generation and speculation (a verify step: ``batch`` rows of T = ``k + 1`` tokens, :func:`row_tokens`):
    :func:`planner.decode_minimum_bytes` with ``tokens = T`` (the weights read once, each row's dense K/V and index
    keys once for its T queries, the selected blocks per query: also the gathered K/V) and
    :func:`planner.collectives` of the ``batch x T`` tokens. Context encoding, replicated:
    :func:`planner.prefill_flops` of a prompt as long as the bucket, the port's query chunks' gathered K/V
    (:func:`planner.chunk_bytes`); sharded, a call graph of C = bucket tokens over cache lines of ``max_length``
    tokens: the last call of a ``max_length`` prompt (:func:`planner.chunk_flops`, :func:`planner.chunk_bytes` from
    ``max_length - C``), the call the one graph must be able to serve; collectives: :func:`planner.collectives` of a
    call of ``batch x bucket`` tokens."""
    tp, ep = man["layout"]["tp"], man["layout"]["ep"]
    batch = g.get("batch", man.get("batch_size", 1))
    size = 4 if str(man.get("dtype", "bfloat16")) in ("float32", "torch.float32") else 2
    layout, weights = kv_layout(man), man.get("weights", "bf16")
    dcp = man["layout"].get("dcp", 1)  # the vLLM Neuron route's decode context parallelism
    try:
        if g["submodel"] in STEPS:  # a decode copy of the experts (--decode-experts tp) is read at its own ep
            t, ep = row_tokens(man, g), parallel.decode_ep(ep, man["layout"].get("decode_experts", "ep"))
            b = plan.decode_minimum_bytes(cfg, tp, ep, batch, g["bucket"], weights, dtype_bytes=size, layout=layout,
                                          tokens=t, dcp=dcp)
            return {"bytes_read": b, "gathered_kv": b["kv_sparse"],
                    "collectives": plan.collectives(cfg, tp, ep, batch * t, layout, row_tokens=t, dcp=dcp)}
        coll = plan.collectives(cfg, tp, ep, batch * g["bucket"], layout, logit_rows=batch, phase="prefill",
                                chunked=man["layout"].get("chunked", True), dcp=dcp)
        if layout in ("sharded", "paged"):  # a call (a segment) of a longer prompt
            seq = max(man.get("max_length") or g["bucket"], g["bucket"])
            start = seq - g["bucket"]
            flops = {k: v * batch for k, v in plan.chunk_flops(cfg, tp, ep, start, g["bucket"], seq).items()}
            gathered = plan.chunk_bytes(cfg, tp, ep, start, g["bucket"], seq, weights, layout=layout)["gathered K/V"]
        else:
            flops = plan.prefill_flops(cfg, tp, ep, batch, g["bucket"])
            gathered = plan.chunk_bytes(cfg, tp, ep, 0, g["bucket"], g["bucket"], weights,
                                        layout=layout)["gathered K/V"]
        return {"flops": flops, "gathered_kv": batch * gathered * size // 2, "collectives": coll}
    except plan.PlanError as exc:
        return {"error": str(exc)}


def analyze_dir(path: str | Path, write: bool = True) -> dict:
    """Every graph of a dry-run directory with its analytic minimum; refreshes ``DIR/graphs.json`` with the same
    figures unless ``write=False``."""
    root, man, cfg = load_manifest(path)
    graphs = []
    for g in sorted(man["graphs"], key=lambda g: (g["submodel"], g["bucket"], g.get("batch", 1))):
        entry = analyze_graph(root, man, g, cfg)
        entry["analytic"] = analytic(cfg, man, g)
        graphs.append(entry)
    out = {"format": 1, "dir": str(root), "port": man.get("port", root.name), "layout": man["layout"],
           "dtype": man.get("dtype"), "batch_size": man.get("batch_size"), "max_length": man.get("max_length"),
           "graphs": graphs}
    if write:
        write_atomic(root / REPORT, (json.dumps(out, indent=1) + "\n").encode())
    return out


def run(args: argparse.Namespace) -> int:
    try:
        reports = [analyze_dir(d) for d in args.dirs]
    except GraphsError as exc:
        print(f"minimax-m3 graphs: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(reports if len(reports) > 1 else reports[0], indent=1) if args.json
          else format_report(reports))
    return 0


def register(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("graphs", help="per-rank cost report of the HLO graphs `compile --dry-run` wrote "
                                             "(no Neuron SDK needed)", description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", metavar="DIR", help="dry-run directories (two: ports side by side)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON instead of tables")
    p.set_defaults(func=run)
    return p
