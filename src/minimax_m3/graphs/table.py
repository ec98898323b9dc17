"""The text tables of ``minimax-m3 graphs``: one per submodel x bucket x batch, one column per dry-run directory, the
planner's analytic minimum of each cache layout present, and each directory's ratio to its own layout's minimum;
then each graph's collectives, op by op, beside the planner's rows (:func:`minimax_m3.planner.collectives`)."""

from __future__ import annotations

import json
from pathlib import Path

from .hlo_cost import DOT_CLASSES

STATE_KINDS = ("kv_dense", "kv_sparse", "index_k")
PLANNER_DTYPES = {"fp32": "f32", "bf16": "bf16", "fp8": "f8e4m3fn", "int64": "s64"}


def _si(n: float | None, unit: str) -> str:
    if n is None:
        return "-"
    for div, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g} {prefix}{unit}"
    return f"{n:g} {unit}".rstrip()


def collective_key(kind: str, dtype: str, group: int | None, size: int) -> str:
    return f"{kind} {dtype} x{group or 'all'} {_si(size, 'B')}"


def collective_counts(g: dict) -> dict[str, list]:
    """label -> [graph count, planner count, planner name]: the graph's collectives by kind, dtype, group size and
    bytes each (the full buffer on each rank), matched to the planner's rows of the same pass."""
    out: dict[str, list] = {}
    for op in g.get("collective_ops", []):
        out.setdefault(collective_key(op["kind"], op["dtype"], op["group_size"], op["bytes"]), [0, 0, ""])[0] += 1
    for row in g["analytic"].get("collectives", []):
        key = collective_key(row["kind"], PLANNER_DTYPES.get(row["dtype"], row["dtype"]), row["ranks"], row["bytes"])
        entry = out.setdefault(key, [0, 0, ""])
        entry[1] += row["count"]
        entry[2] = f"{entry[2]}, {row['name']}" if entry[2] else row["name"]
    return out


def _rows(g: dict) -> list[tuple[str, float | None, float | None, str]]:
    """(label, graph value, analytic value, unit) for one graph."""
    an = g["analytic"]
    rows = [("HLO instructions (all)", g["instructions"], None, ""),
            ("HLO instructions (entry)", g["entry_instructions"], None, "")]
    af = an.get("flops", {})
    for cls in DOT_CLASSES:
        rows.append((f"dot FLOPs {cls.replace('_', ' ')}", g["flops"][cls], af.get(cls), "FLOP"))
    rows.append(("dot FLOPs total", sum(g["flops"].values()), sum(af.values()) if af else None, "FLOP"))
    ab = an.get("bytes_read", {})
    for key, label in (("weights", "weights"), ("kv_dense", "K/V dense layers"),
                       ("kv_sparse", "K/V sparse layers"), ("index_k", "index-K")):
        rows.append((f"bytes read: {label}", g["bytes_read"][key], ab.get(key), "B"))
    rows.append(("gathered K/V (sparse attention)", g.get("gathered_kv"), an.get("gathered_kv"), "B"))
    for key in STATE_KINDS:
        rows.append((f"state copies: {key.replace('_', ' ')}", g["state_copies"][key], 0 if ab else None, ""))
    rows.append(("state copies: bytes written", sum(g["state_copy_bytes"].values()), 0 if ab else None, "B"))
    for key, label in (("weights", "weights"), ("kv", "K/V"), ("states", "target states (rolling buffer)"),
                       ("state_copies", "state copies"), ("state_copy_bytes", "state copies: bytes written")):
        if "draft" in g:  # a fused build: the draft's own figures (no planner minimum: the target's only)
            rows.append((f"draft: {label}" if key.startswith("state_c") else f"draft: bytes read: {label}",
                         g["draft"][key], None, "" if key == "state_copies" else "B"))
    counts = collective_counts(g)
    for label in sorted(counts):
        graph, planner, name = counts[label]
        rows.append((f"{label}{f' ({name})' if name else ''}: count", graph, planner if "collectives" in an else None,
                     ""))
    for target, n in g["custom_calls"].items():
        flag = " (uncounted)" if target in g["uncounted_custom_calls"] else ""
        rows.append((f"custom call {target}{flag}", n, None, ""))
    return rows


def _ratio(v, ref) -> str:
    if v is None or not ref:
        return "-"
    r = v / ref
    return f"{r:.2f}" + ("" if 0.9 <= r <= 1.1 else " !")


def _layout(r: dict) -> str:
    return r["layout"].get("kv_layout", "replicated")


def _names(reports: list[dict]) -> list[str]:
    """Each directory's column: its port, with its cache layout or its folder where ports repeat."""
    names = [r["port"] for r in reports]
    if len(set(names)) < len(names):
        names = [f"{r['port']} ({_layout(r)})" for r in reports]
    if len(set(names)) < len(names):
        names = [f"{r['port']} ({Path(r['dir']).name})" for r in reports]
    return names


def _groups(groups: list[list[int]]) -> str:
    if not groups:
        return "all"
    n = len(groups[0])
    runs = all(g == list(range(g[0], g[0] + n)) for g in groups)
    return f"{len(groups)} x {n}{' consecutive' if runs else ''}"


def format_collectives(g: dict) -> list[str]:
    """A graph's collectives op by op, in program order, repeats folded: kind, dtype, output shape, replica groups,
    bytes (the full buffer on each rank) and where the model code issued it."""
    seen: dict[tuple, int] = {}
    for op in g.get("collective_ops", []):
        key = (op["kind"], op["dtype"], tuple(op["shape"]), _groups(op["replica_groups"]), op["bytes"], op["where"])
        seen[key] = seen.get(key, 0) + 1
    lines = ["collectives (per pass: count x kind dtype [output shape], replica groups, bytes each, issued at)"]
    for (kind, dtype, shape, groups, size, where), n in seen.items():
        lines.append(f"  {n:>3} x {kind} {dtype}{list(shape)}  groups {groups}  {_si(size, 'B')}  {where}")
    return lines


def format_report(reports: list[dict]) -> str:
    """One table per submodel x bucket x batch; one column per directory, then the analytic minimum of each cache
    layout present (from the first directory of that layout) and each directory's ratio to its own layout's
    (``!`` beyond 10 %)."""
    names = _names(reports)
    layouts = list(dict.fromkeys(_layout(r) for r in reports))
    an_names = ["analytic"] if len(layouts) == 1 else [f"analytic {lay}" for lay in layouts]
    keys = []
    for r in reports:
        keys += [k for k in ((g["submodel"], g["bucket"], g["batch"]) for g in r["graphs"]) if k not in keys]
    first = reports[0]
    out = [f"per rank, layout {json.dumps(first['layout'])}, dtype {first['dtype']}, "
           f"max_length {first['max_length']}"]
    for key in keys:
        per = [next((g for g in r["graphs"] if (g["submodel"], g["bucket"], g["batch"]) == key), None)
               for r in reports]
        table: dict[str, list] = {}  # label -> [value per dir, analytic per layout, unit]
        for i, (r, g) in enumerate(zip(reports, per)):
            j = len(per) + layouts.index(_layout(r))
            for label, val, an, unit in _rows(g) if g else []:
                row = table.setdefault(label, [None] * (len(per) + len(layouts)) + [unit])
                row[i] = val
                if row[j] is None:
                    row[j] = an
        head = ["", *names, *an_names, *[f"{n}/analytic" for n in names]]
        lines = [head]
        for label, row in table.items():
            vals, ans, unit = row[:len(per)], row[len(per):-1], row[-1]
            ratios = [_ratio(v, ans[layouts.index(_layout(r))]) for v, r in zip(vals, reports)]
            lines.append([label, *[_si(v, unit) for v in vals], *[_si(a, unit) for a in ans], *ratios])
        widths = [max(len(str(line[i])) for line in lines) for i in range(len(head))]
        out.append(f"\n== {key[0]}  bucket {key[1]}  batch {key[2]} ==")
        out += ["  ".join(str(c).ljust(w) if j == 0 else str(c).rjust(w) for j, (c, w) in
                          enumerate(zip(line, widths))).rstrip() for line in lines]
        for name, g in zip(names, per):
            if g and g.get("collective_ops"):
                out += [f"{name}: {line}" if k == 0 else line for k, line in enumerate(format_collectives(g))]
            for note in (g or {}).get("notes", []):
                out.append(f"note ({name}): {note}")
            if g and "error" in g["analytic"]:
                out.append(f"note ({name}): no analytic minimum: {g['analytic']['error']}")
    return "\n".join(out)
