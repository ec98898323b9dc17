"""StableHLO text (MLIR, generic form, with debug locations) as an ``xla.HloModuleProto`` for :mod:`hlo_cost`.

The vLLM Neuron route compiles through ``torch.compile(backend="neuron")``: Dynamo, AOTAutograd, torch-mlir, then
StableHLO for neuronx-cc. ``minimax-m3 compile --dry-run --route vllm-neuron`` writes those modules; this reader
turns one into the HLO proto that NxD hands neuronx-cc on the other route, so both ports are costed by the same
rules (:func:`minimax_m3.graphs.hlo_cost.analyze_module`: dot FLOPs by class, bytes read per argument, collectives,
state copies). The mapping is one op to one instruction: ``stablehlo.dot_general`` to ``dot`` (its dimension
numbers), ``broadcast_in_dim`` to ``broadcast``, other ``stablehlo.x_y`` to ``x-y``; regions to computations (a
reduce's, scatter's or all-reduce's reducer, a while's condition and body); ``func.call`` to ``call``; the entry
function's ``func.return`` to a root tuple; a location ``loc("file":line:col)`` to a stack frame whose function is
read from the file where it exists (torch-mlir records only the innermost frame).

**Collectives.** torch-mlir 20261001 lowers no ``_c10d_functional`` op. :func:`collective_marker` names a stand-in
(the capture replaces each collective by shape-equivalent aten ops whose location carries the marker);
:func:`restore_collectives` puts ``stablehlo.all_reduce`` / ``all_gather`` / ``reduce_scatter`` back in the text
with their replica groups, so the written module is the one neuronx-cc would receive. Standard library and protobuf
only.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

from . import hlo_schema as hs
from ..errors import M3Error

MARK = "m3-collective"
REDUCERS = {"sum": "add", "max": "maximum", "min": "minimum", "product": "multiply", "avg": "add"}
OPCODES = {"dot_general": "dot", "broadcast_in_dim": "broadcast", "custom_call": "custom-call", "if": "conditional",
           "case": "conditional", "return": "return"}
ELEMENT = {"f32": "F32", "f16": "F16", "bf16": "BF16", "f64": "F64", "i1": "PRED", "i8": "S8", "i16": "S16",
           "i32": "S32", "i64": "S64", "ui8": "U8", "ui16": "U16", "ui32": "U32", "ui64": "U64",
           "f8E4M3FN": "F8E4M3FN", "f8E5M2": "F8E5M2", "complex<f32>": "C64", "complex<f64>": "C128"}

_OP = re.compile(r'^\s*(?:(%[\w.$-]+)(?::(\d+))?\s*=\s*)?"([\w.]+)"\((.*?)\)')
_LOC_DEF = re.compile(r'^(#loc\d*)\s*=\s*loc\((.*)\)\s*$')
_FILE_LINE = re.compile(r'"([^"]+)":(\d+)')
_LOC = re.compile(r'\s*loc\((?:[^()]|\([^()]*\))*\)')


def _block_args(line: str) -> list[tuple[str, str]]:
    """``[(name, type)]`` of a block header ``^bb0(%a: T loc(...), %b: T):``."""
    body = _LOC.sub("", line.strip())
    body = body[body.index("(") + 1:body.rindex(")")]
    return [tuple(x.strip() for x in a.split(":", 1)) for a in _split(body)]


class StableHloError(M3Error, ValueError):
    """A StableHLO text this reader cannot map (names the line)."""


def collective_marker(kind: str, reduce: str, group: int, n: int) -> str:
    """The file name of the location a collective's stand-in ops carry: ``m3-collective:KIND:REDUCE:GROUP:N``."""
    return f"{MARK}:{kind}:{reduce}:{group}:{n}"


def _split(s: str) -> list[str]:
    """``s`` split at commas outside ``<>``, ``()`` and ``[]``."""
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "<([{":
            depth += 1
        elif ch in ">)]}":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _strip_loc(line: str) -> tuple[str, str]:
    """(line without its trailing ``loc(...)``, the loc's body)."""
    i = line.rfind(" loc(")
    if i < 0:
        return line.rstrip(), ""
    return line[:i].rstrip(), line[i + 5:].rstrip()[:-1]


def _signature(head: str) -> tuple[list[str], list[str]]:
    """(operand types, result types) of ``... : (A, B) -> R`` or ``-> (R1, R2)``."""
    i = head.rfind(" : (")
    if i < 0:
        raise StableHloError(f"no type signature in: {head.strip()[:160]}")
    sig = head[i + 3:]
    depth = 0
    for j, ch in enumerate(sig):  # noqa: B007 (j: where the operand list closes)
        depth += ch in "<(["
        depth -= ch in ">)]"
        if depth == 0:
            break
    ins, outs = sig[1:j], sig[j + 1:].strip()
    if not outs.startswith("->"):
        raise StableHloError(f"no result types in: {head.strip()[:160]}")
    outs = outs[2:].strip()
    if outs.startswith("(") and outs.endswith(")"):
        outs = outs[1:-1]
    return _split(ins), _split(outs)


def shape_of(t: str):
    """``tensor<4x16xbf16>`` as a ShapeProto (any other type: an empty tuple shape, as HLO has tokens)."""
    s = hs.ShapeProto()
    m = re.fullmatch(r"tensor<(.*)>", t.strip())
    if not m:
        s.element_type = hs.PrimitiveType.Value("TOKEN")
        return s
    parts = m.group(1).split("x")
    dims, elem = [], parts[-1]
    for p in parts[:-1]:
        if not p.isdigit():
            raise StableHloError(f"a dynamic or unreadable dimension {p!r} in {t} (the dry run lowers static shapes)")
        dims.append(int(p))
    if elem not in ELEMENT:
        raise StableHloError(f"element type {elem!r} of {t} is not known to this reader")
    s.element_type = hs.PrimitiveType.Value(ELEMENT[elem])
    s.dimensions.extend(dims)
    return s


def _ints(attrs: str, name: str) -> list[int]:
    m = re.search(rf"{name}\s*=\s*(?:array<i64(?::\s*([^>]*))?>|\[([^\]]*)\])", attrs)
    if not m:
        return []
    body = m.group(1) if m.group(1) is not None else (m.group(2) or "")
    return [int(x) for x in re.findall(r"-?\d+", body)]


@lru_cache(maxsize=None)
def _functions(path: str) -> tuple[tuple[int, int, str], ...]:
    """(first line, last line, name) of every function in a Python file (innermost last); empty if unreadable."""
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return ()
    return tuple(sorted(((n.lineno, n.end_lineno or n.lineno, n.name) for n in ast.walk(tree)
                         if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), key=lambda t: (t[0], -t[1])))


def function_at(path: str, line: int) -> str:
    """The innermost function of ``path`` that spans ``line`` ("" where unknown)."""
    name = ""
    for first, last, fn in _functions(path):
        if first <= line <= last:
            name = fn
    return name


class _Reader:
    def __init__(self, text: str):
        self.lines = text.splitlines()
        self.locs: dict[str, str] = {}
        for ln in self.lines:
            m = _LOC_DEF.match(ln.strip())
            if m:
                self.locs[m.group(1)] = m.group(2)
        self.module = hs.HloModuleProto(name="stablehlo")
        self.next_id = 1
        self.funcs: dict[str, int] = {}
        self.frames: dict[tuple[str, int, int], int] = {}
        self.files, self.fnames = {}, {}
        self.idx = self.module.stack_frame_index

    # ---- locations -> stack frames ----------------------------------------------------------------------
    def _chain(self, loc: str, depth: int = 0) -> list[tuple[str, int]]:
        """(file, line) frames of a location, innermost first: ``callsite(callee at caller)`` nests them."""
        loc = loc.strip()
        if depth > 64:
            return []
        if loc.startswith("#loc"):
            return self._chain(self.locs.get(loc, ""), depth + 1)
        if loc.startswith("callsite("):
            body = loc[len("callsite("):-1]
            d = 0
            for j in range(len(body)):
                d += body[j] in "(["
                d -= body[j] in ")]"
                if d == 0 and body.startswith(" at ", j):
                    return self._chain(body[:j], depth + 1) + self._chain(body[j + 4:], depth + 1)
        m = _FILE_LINE.search(loc)
        return [(m.group(1), int(m.group(2)))] if m else []

    def _frame(self, loc: str) -> int:
        """The stack frame id (XLA's StackFrameIndexProto, 1-based, parents outwards) of a location; 0 if none."""
        parent = 0
        for path, line in reversed(self._chain(loc)):
            key = (path, line, parent)
            if key not in self.frames:
                idx = self.idx
                if path not in self.files:
                    idx.file_names.append(path)
                    self.files[path] = len(idx.file_names)
                fn = function_at(path, line)
                if fn not in self.fnames:
                    idx.function_names.append(fn)
                    self.fnames[fn] = len(idx.function_names)
                idx.file_locations.add(file_name_id=self.files[path], function_name_id=self.fnames[fn], line=line)
                idx.stack_frames.add(file_location_id=len(idx.file_locations), parent_frame_id=parent)
                self.frames[key] = len(idx.stack_frames)
            parent = self.frames[key]
        return parent

    def _id(self) -> int:
        self.next_id += 1
        return self.next_id

    # ---- blocks -----------------------------------------------------------------------------------------
    def computation(self, name: str, i: int, args: list[tuple[str, str]], entry: bool) -> tuple[object, int]:
        """Read the ops of a region from line ``i`` until its closing brace; returns (computation, next line)."""
        comp = self.module.computations.add(name=name, id=self._id())
        env: dict[str, object] = {}
        for k, (v, t) in enumerate(args):
            ins = comp.instructions.add(name=v[1:], opcode="parameter", id=self._id(), parameter_number=k)
            ins.shape.CopyFrom(shape_of(t))
            env[v] = ins
        root = None
        while i < len(self.lines):
            raw = self.lines[i]
            s = raw.strip()
            if s.startswith("})") or s.startswith("}, {") or s == "}":
                break
            if not s or s.startswith("^bb") or s.startswith("#loc"):
                i += 1
                continue
            m = _OP.match(raw)
            if not m:
                raise StableHloError(f"line {i + 1}: not an op in generic form: {s[:160]}")
            res, nres, opname, operands = m.group(1), m.group(2), m.group(3), m.group(4)
            regions: list[int] = []
            if s.endswith("({"):
                i += 1
                while True:  # each region: ^bb0(args): ... then "}, {" or "}) : sig loc"
                    bb = self.lines[i].strip()
                    rargs = _block_args(bb) if bb.startswith("^bb") else []
                    sub, i = self.computation(f"{opname}.{len(self.module.computations)}", i + (1 if bb.startswith(
                        "^bb") else 0), rargs, False)
                    regions.append(sub.id)
                    if self.lines[i].strip().startswith("}, {"):
                        i += 1
                        continue
                    break
                tail = self.lines[i].strip()[2:]  # after "})"
                head, loc = _strip_loc(raw.rstrip()[:-2] + tail)
            else:
                head, loc = _strip_loc(raw)
            i += 1
            ops = [o.strip() for o in _split(operands)] if operands.strip() else []
            dialect, _, op = opname.partition(".")
            if opname == "func.return" or opname == "stablehlo.return":
                vals = [self._value(comp, env, o) for o in ops]
                if len(vals) == 1 and not entry:
                    root = vals[0]
                else:
                    t = comp.instructions.add(name=f"root.{comp.id}", opcode="tuple", id=self._id())
                    t.shape.element_type = hs.PrimitiveType.Value("TUPLE")
                    for v in vals:
                        t.operand_ids.append(v.id)
                        t.shape.tuple_shapes.add().CopyFrom(v.shape)
                    root = t
                continue
            _, outs = _signature(head)
            args_in = [self._value(comp, env, o).id for o in ops]  # before the op: a get-tuple-element may be new
            ins = comp.instructions.add(name=(res or "%op")[1:], id=self._id())
            ins.opcode = OPCODES.get(op, op.replace("_", "-")) if dialect == "stablehlo" else (
                "call" if opname == "func.call" else opname)
            if len(outs) == 1 and not nres:
                ins.shape.CopyFrom(shape_of(outs[0]))
            else:
                ins.shape.element_type = hs.PrimitiveType.Value("TUPLE")
                for t in outs:
                    ins.shape.tuple_shapes.add().CopyFrom(shape_of(t))
            ins.operand_ids.extend(args_in)
            ins.called_computation_ids.extend(regions)
            self._attributes(ins, op, head)
            if opname == "func.call":
                callee = re.search(r"callee\s*=\s*@([\w.$-]+)", head)
                if not callee or callee.group(1) not in self.funcs:
                    raise StableHloError(f"line {i}: func.call of an unknown function")
                ins.called_computation_ids.append(self.funcs[callee.group(1)])
            frame = self._frame(loc)
            if frame:
                ins.metadata.stack_frame_id = frame
            if res:
                env[res] = ins
        if root is None:
            raise StableHloError(f"region {name} has no return")
        comp.root_id = root.id
        return comp, i

    def _value(self, comp, env, ref: str):
        name, _, k = ref.partition("#")
        if name not in env:
            raise StableHloError(f"{ref} is used before it is defined (or is not a value this reader knows)")
        v = env[name]
        if not k:
            return v
        key = f"{name}#{k}"
        if key not in env:
            g = comp.instructions.add(name=f"{name[1:]}.{k}", opcode="get-tuple-element", id=self._id(),
                                      tuple_index=int(k))
            g.shape.CopyFrom(v.shape.tuple_shapes[int(k)])
            g.operand_ids.append(v.id)
            env[key] = g
        return env[key]

    @staticmethod
    def _attributes(ins, op: str, head: str) -> None:
        if op == "dot_general":
            dn = ins.dot_dimension_numbers
            dn.lhs_batch_dimensions.extend(_ints(head, "lhs_batching_dimensions"))
            dn.rhs_batch_dimensions.extend(_ints(head, "rhs_batching_dimensions"))
            dn.lhs_contracting_dimensions.extend(_ints(head, "lhs_contracting_dimensions"))
            dn.rhs_contracting_dimensions.extend(_ints(head, "rhs_contracting_dimensions"))
        elif op in ("transpose",):
            ins.dimensions.extend(_ints(head, "permutation"))
        elif op == "broadcast_in_dim":
            ins.dimensions.extend(_ints(head, "broadcast_dimensions"))
        elif op in ("reduce", "reverse"):
            ins.dimensions.extend(_ints(head, "dimensions"))
        elif op == "dynamic_slice":
            ins.dynamic_slice_sizes.extend(_ints(head, "slice_sizes"))
        elif op == "custom_call":
            m = re.search(r'call_target_name\s*=\s*"([^"]*)"', head)
            ins.custom_call_target = m.group(1) if m else ""
        elif op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute"):
            m = re.search(r"replica_groups\s*=\s*dense<(.*?)>\s*:\s*tensor<", head)
            for group in re.findall(r"\[([\d,\s-]+)\]", m.group(1) if m else ""):
                ins.replica_groups.add().replica_ids.extend(int(x) for x in group.split(","))

    def read(self, aliases: dict[int, int]) -> object:
        i = 0
        entry = None
        while i < len(self.lines):
            s = self.lines[i].strip()
            if s.startswith('"func.func"()'):
                name = re.search(r'sym_name\s*=\s*"([^"]+)"', s).group(1)
                bb = self.lines[i + 1].strip()
                args = _block_args(bb) if bb.startswith("^bb") else []
                comp, i = self.computation(name, i + (2 if args or bb.startswith("^bb") else 1), args, True)
                self.funcs[name] = comp.id
                if name == "main":
                    entry = comp
            i += 1
        if entry is None:
            raise StableHloError("no func.func @main in the module")
        self.module.entry_computation_id = entry.id
        self.module.entry_computation_name = entry.name
        for p, out in sorted(aliases.items()):
            self.module.input_output_alias.entries.add(output_shape_index=[out], parameter_number=p, kind=1)
        return self.module


def to_hlo(text: str, aliases: dict[int, int] | None = None):
    """The ``xla.HloModuleProto`` of a StableHLO module printed in generic form with debug info
    (``get_asm(print_generic_op_form=True, enable_debug_info=True)``). ``aliases``: argument number -> index of the
    result that is its updated value (the pages a graph writes in place), as input/output aliases."""
    return _Reader(text).read(aliases or {})


def restore_collectives(text: str) -> str:
    """``text`` with each marked stand-in (ops whose innermost location frame is a :func:`collective_marker`)
    replaced by the collective it stands for: one ``stablehlo.all_reduce`` / ``all_gather`` / ``reduce_scatter`` /
    ``all_to_all`` from the group's input to its last op's result, replica group ``[0 .. GROUP-1]``, at the
    stand-in's location."""
    reader = _Reader(text)
    marks: dict[str, str | None] = {}

    def mark_of(loc: str) -> str | None:
        if loc not in marks:
            chain = reader._chain(loc)
            marks[loc] = chain[0][0] if chain and chain[0][0].startswith(MARK + ":") else None
        return marks[loc]

    groups: dict[str, list[int]] = {}
    lines = text.splitlines()
    for i, ln in enumerate(lines if MARK in text else ()):
        if not _OP.match(ln):
            continue
        mark = mark_of(_strip_loc(ln)[1])
        if mark:
            groups.setdefault(mark, []).append(i)
    drop = set()
    for mark, idx in groups.items():
        _, kind, reduce, group, n = mark.split(":")
        results = {_OP.match(lines[i]).group(1) for i in idx}
        src, src_type = None, None
        for i in idx:
            head, _ = _strip_loc(lines[i])
            ins, _ = _signature(head)
            for ref, t in zip(_split(_OP.match(lines[i]).group(4)), ins):
                if ref.split("#")[0] not in results:
                    src, src_type = ref, t
                    break
            if src:
                break
        if src is None:
            raise StableHloError(f"collective {mark}: its stand-in ops take no input")
        last = lines[idx[-1]]
        out = _OP.match(last).group(1)
        _, outs = _signature(_strip_loc(last)[0])
        _, loc = _strip_loc(last)
        indent = last[:len(last) - len(last.lstrip())]
        groups_attr = f"dense<[[{', '.join(map(str, range(int(group))))}]]> : tensor<1x{group}xi64>"
        common = (f"channel_handle = #stablehlo.channel_handle<handle = {int(n) + 1}, type = 1>, "
                  f"replica_groups = {groups_attr}, use_global_device_ids")
        elem = re.fullmatch(r"tensor<(?:.*x)?([^x>]+)>", src_type.strip()).group(1)
        scalar = f"tensor<{elem}>"
        a, b, r = (f"%m3_collective{n}_{x}" for x in "abr")
        region = (f' ({{\n{indent}^bb0({a}: {scalar}, {b}: {scalar}):\n'
                  f'{indent}  {r} = "stablehlo.{REDUCERS.get(reduce, "add")}"({a}, {b}) : ({scalar}, {scalar}) -> '
                  f'{scalar}\n{indent}  "stablehlo.return"({r}) : ({scalar}) -> ()\n{indent}}})')
        if kind == "all-reduce":
            new = f'{indent}{out} = "stablehlo.all_reduce"({src}) <{{{common}}}>{region} : ({src_type}) -> {outs[0]}'
        elif kind == "all-gather":
            new = (f'{indent}{out} = "stablehlo.all_gather"({src}) <{{all_gather_dim = 0 : i64, {common}}}> : '
                   f'({src_type}) -> {outs[0]}')
        elif kind == "reduce-scatter":
            new = (f'{indent}{out} = "stablehlo.reduce_scatter"({src}) <{{scatter_dimension = 0 : i64, {common}}}>'
                   f'{region} : ({src_type}) -> {outs[0]}')
        elif kind == "all-to-all":  # part j of dim 0 to group rank j, the parts received stacked along dim 0
            a2a = f"channel_handle = #stablehlo.channel_handle<handle = {int(n) + 1}, type = 1>, replica_groups = "
            new = (f'{indent}{out} = "stablehlo.all_to_all"({src}) <{{{a2a}{groups_attr}, split_dimension = 0 : i64, '
                   f'concat_dimension = 0 : i64, split_count = {group} : i64}}> : ({src_type}) -> {outs[0]}')
        else:
            raise StableHloError(f"collective {mark}: kind {kind!r} has no StableHLO form here")
        lines[idx[0]] = f"{new} loc({loc})"
        drop.update(idx[1:])
    return "\n".join(ln for i, ln in enumerate(lines) if i not in drop) + "\n"
