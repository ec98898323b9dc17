"""What one HLO module computes, reads, copies and reduces, per rank (the engine of ``minimax-m3 graphs``).

Reads an ``xla.HloModuleProto`` through :mod:`hlo_schema` (protobuf only: no Neuron SDK, no torch). The module
is the unoptimised one NxD hands to neuronx-cc, so every figure is what the compiler receives:

* **dot FLOPs**: ``2 x prod(output dims) x prod(contracting dims)`` (``convolution``: ``2 x output elements x
  kernel elements / kernel output features``), classified by :data:`DOT_RULES` on the innermost Python frame of
  the op's debug metadata that is not inside torch / torch-xla. ``call`` computations are inlined (counted once
  per call site); a ``while`` body is counted once and said so.
* **bytes read per parameter**: a parameter is followed through shape-only ops (:data:`VIEW_OPS`, and
  broadcasts that add no elements); a ``slice`` / ``dynamic-slice`` / ``gather`` reads its output size, or less
  when its own users read only part of it (followed the same way: a bucket slice whose blocks are then
  gathered reads the blocks); being operand 0 of a ``dynamic-update-slice`` / ``scatter`` reads nothing (the
  updated buffer is followed on); any other use reads the whole buffer.
* **state copies**: a value reached from a state through data-movement ops only (:data:`MOVE_OPS`), with at
  least ``fraction`` of the state's elements (the bucket's share of the cache in token generation), that is
  not a view, not a partial read smaller than the state nor a gather larger than it (slots repeated: each query's
  blocks, counted as gathered K/V), not on the in-place chain (updates and views) that
  ends at the state's aliased output, and not structurally identical to a chain instruction (XLA's CSE would
  merge it): e.g. a second scatter into the parameter, a ``copy``, a ``concatenate`` rebuilding the buffer,
  a ``select`` over it.
* **gathered K/V**: the bytes of every floating-point ``gather`` whose deciding frame is attention code (the rule
  table's ``attention`` class): the blocks of K and V a sparse layer gathers per query (a block read by several
  queries counts once per query), what the planner counts (``test/support/seq_shards.gathered_kv_bytes`` by hand).
* **collectives**: each op with its kind (an all-reduce or reduce-scatter named by its reduction when it is not a
  sum: ``all-reduce (max)``), dtype, output shape, replica groups and bytes, the full buffer on each rank as the
  planner counts them (an all-gather's output, a reduce-scatter's input, an all-reduce's buffer); and the same
  summed by kind, dtype and group size.
Also: instruction counts, custom calls by target.
"""

from __future__ import annotations

import math
from collections import defaultdict

from . import hlo_schema as hs
from .nki_cost import NKI_KERNEL_COST, nki_kernel
from ..errors import M3Error

VIEW_OPS = frozenset({"reshape", "bitcast", "transpose", "convert"})
PART_READ_OPS = frozenset({"slice", "dynamic-slice", "gather"})
UPDATE_OPS = frozenset({"dynamic-update-slice", "scatter"})
# ops that move a state's data without computing on it: a state-sized result of these is a copy candidate
MOVE_OPS = VIEW_OPS | PART_READ_OPS | UPDATE_OPS | frozenset({"broadcast", "concatenate", "pad", "select", "copy",
                                                              "reverse", "tuple", "get-tuple-element"})
COLLECTIVES = {"all-reduce": "all-reduce", "all-reduce-start": "all-reduce", "all-gather": "all-gather",
               "all-gather-start": "all-gather", "reduce-scatter": "reduce-scatter", "all-to-all": "all-to-all",
               "collective-permute": "collective-permute", "collective-permute-start": "collective-permute"}
DOT_CLASSES = ("attention", "indexer", "routed_experts", "rest")
# library plumbing (nn.Module calls, torch-xla wrappers): skipped when looking for the deciding frame
PASS_THROUGH = ("/torch/", "/torch_xla/", "/site-packages/torch/")
# (path fragment, function name or None, (first, last) source line or None, class). The first row that matches
# the deciding frame wins; no match -> "rest". Python records only a function's bare name (``forward``), so
# rows for the published port's one-file model carry the line span of the method (its pinned commit 4bcdc54).
DOT_RULES: tuple[tuple[str, str | None, tuple[int, int] | None, str], ...] = (
    ("minimax_m3/ops/attention.py", None, None, "attention"),
    ("minimax_m3/ops/prefill.py", None, None, "attention"),
    ("minimax_m3/ops/indexer.py", None, None, "indexer"),
    ("minimax_m3/ops/step.py", "block_scores", None, "indexer"),  # the prior and active index keys' scores
    ("minimax_m3/ops/step.py", "residue", None, "rest"),  # the rank's share of a call's own keys
    ("minimax_m3/ops/step.py", None, None, "attention"),
    ("minimax_m3/ops/moe.py", "expert_ffn", None, "routed_experts"),  # the reference layers' experts (vLLM Neuron)
    ("minimax_m3/ops/moe.py", "moe_all_experts", None, "routed_experts"),
    ("minimax_m3/ops/paged.py", "gather", None, "attention"),  # the selected pages: gathered K/V
    ("minimax_m3/ops/paged.py", "lines", None, "rest"),  # every page of a row: a dense read (counted per cache)
    ("neuronx_distributed/modules/moe/routing.py", None, None, "rest"),
    ("neuronx_distributed/modules/moe/shared_experts.py", None, None, "rest"),
    ("neuronx_distributed/modules/moe/", None, None, "routed_experts"),
    ("neuronx_distributed_inference/modules/moe", None, None, "routed_experts"),
    ("neuronx_distributed_inference/modules/attention/attention_base.py", None, None, "attention"),
    ("neuronx_distributed_inference/modules/attention/utils.py", "neuron_scaled_dot_product_attention", None,
     "attention"),
    ("/modeling_minimax_m3.py", "forward", (239, 323), "indexer"),  # MiniMaxM3Indexer.forward
    ("/modeling_minimax_m3.py", "forward", (137, 146), "rest"),  # partial rotary embedding
)
# custom-call targets known to do no dot work (norm, top-k, NxDI's layer markers): 0 FLOPs. Any other target is
# listed as "uncounted" (an NKI kernel's FLOPs cannot be read from its shapes).
KNOWN_CUSTOM_CALLS = frozenset({"AwsNeuronRmsNorm", "AwsNeuronTopK", "AwsNeuronArgMax",
                                "AwsNeuronModuleMarkerStartForward", "AwsNeuronModuleMarkerEndForward"})


class HloCostError(M3Error, ValueError):
    """A module this analysis cannot read (e.g. no entry computation)."""


def numel(shape) -> int:
    return math.prod(shape.dimensions)


def nbytes(shape) -> int:
    """Bytes of an array shape (tuples: the sum of their elements)."""
    if shape.element_type == hs.PrimitiveType.Value("TUPLE"):
        return sum(nbytes(s) for s in shape.tuple_shapes)
    bits = hs.ELEMENT_BITS.get(hs.PRIMITIVE_TYPE_NAMES.get(shape.element_type, ""), 0)
    return numel(shape) * bits // 8


def dtype_name(shape) -> str:
    return hs.PRIMITIVE_TYPE_NAMES.get(shape.element_type, "?").lower()


def dot_flops(instr, operand_shapes) -> int:
    if instr.opcode == "dot":
        lhs = operand_shapes[0]
        k = math.prod(lhs.dimensions[d] for d in instr.dot_dimension_numbers.lhs_contracting_dimensions)
        return 2 * numel(instr.shape) * k
    if instr.opcode == "convolution":
        rhs = operand_shapes[1]
        out_features = rhs.dimensions[instr.convolution_dimension_numbers.kernel_output_feature_dimension]
        return 2 * numel(instr.shape) * numel(rhs) // max(1, out_features)
    return 0


class Module:
    """An HLO module with its ``call`` computations inlined into one value graph (nodes are call paths)."""

    def __init__(self, module):
        self.m = module
        self.comps = {c.id: c for c in module.computations}
        if module.entry_computation_id not in self.comps:
            raise HloCostError("the module has no entry computation")
        self.instr = {c.id: {i.id: i for i in c.instructions} for c in module.computations}
        self.entry = self.comps[module.entry_computation_id]
        self.nodes: list[tuple] = []  # (ctx, comp id, instr id) in topological order, calls expanded
        self.operands: dict[tuple, list[tuple]] = {}
        self.users: dict[tuple, list[tuple[tuple, int]]] = defaultdict(list)
        self.root = self._expand((), self.entry.id, [])
        self.params = {i.parameter_number: ((), self.entry.id, i.id) for i in self.entry.instructions
                       if i.opcode == "parameter"}
        self.loose_comps = self._loose_computations()

    def get(self, node):
        return self.instr[node[1]][node[2]]

    def _expand(self, ctx, cid, args) -> tuple:
        """Add computation ``cid`` under call path ``ctx``; ``args`` are the caller's operand nodes; returns
        the node holding the computation's root value."""
        local: dict[int, tuple] = {}
        comp = self.comps[cid]
        for ins in comp.instructions:
            if ins.opcode == "parameter" and ctx:
                local[ins.id] = args[ins.parameter_number]
                continue
            ops = [local[o] for o in ins.operand_ids]
            if ins.opcode == "call" and len(ins.called_computation_ids) == 1:
                local[ins.id] = self._expand(ctx + ((cid, ins.id),), ins.called_computation_ids[0], ops)
                continue
            node = (ctx, cid, ins.id)
            local[ins.id] = node
            self.nodes.append(node)
            self.operands[node] = ops
            for k, o in enumerate(ops):
                self.users[o].append((node, k))
        return local[comp.root_id]

    def _loose_computations(self) -> set[int]:
        """Computations reached other than by ``call`` (while bodies, branches, reducers): counted once."""
        inlined = {n[1] for n in self.nodes}
        out = set()
        for n in self.nodes:
            out.update(c for c in self.get(n).called_computation_ids if c not in inlined)
        stack = list(out)
        while stack:
            for ins in self.comps[stack.pop()].instructions:
                for c in ins.called_computation_ids:
                    if c not in out:
                        out.add(c)
                        stack.append(c)
        return out

    def all_instructions(self):
        """(node or None, instruction) over the inlined graph and the loose computations."""
        for n in self.nodes:
            yield n, self.get(n)
        for cid in sorted(self.loose_comps):
            for ins in self.comps[cid].instructions:
                yield None, ins

    def shape_of(self, node):
        return self.get(node).shape

    # ---- debug metadata -----------------------------------------------------------------------------
    def frames(self, ins) -> list[tuple[str, str, int]]:
        """(file, function, line) from innermost outwards: the module's stack frames, else source_file/line."""
        idx = self.m.stack_frame_index
        out, fid = [], ins.metadata.stack_frame_id
        while 0 < fid <= len(idx.stack_frames):
            frame = idx.stack_frames[fid - 1]
            loc = idx.file_locations[frame.file_location_id - 1]
            out.append((idx.file_names[loc.file_name_id - 1], idx.function_names[loc.function_name_id - 1],
                        loc.line))
            fid = frame.parent_frame_id
        if not out and ins.metadata.source_file:
            out.append((ins.metadata.source_file, "", ins.metadata.source_line))
        return out


def classify(frames, rules=DOT_RULES) -> str:
    """The class of a dot from its frames (innermost first): the first frame outside torch decides."""
    for path, func, line in frames:
        p = path.replace("\\", "/")
        if any(s in p for s in PASS_THROUGH):
            continue
        for frag, want_func, span, cls in rules:
            if frag in p and (want_func is None or want_func == func) and (
                    span is None or span[0] <= line <= span[1]):
                return cls
        return "rest"
    return "rest"


def _group_size(ins) -> int | None:
    groups = ins.replica_groups or ins.collective_device_list.replica_groups
    if groups:
        return len(groups[0].replica_ids)
    iota = ins.collective_device_list.iota_replica_group_list
    return iota.num_devices_per_group or None


def replica_groups(ins) -> list[list[int]]:
    """The explicit replica groups of a collective (empty when it has none, or iota groups)."""
    return [list(g.replica_ids) for g in (ins.replica_groups or ins.collective_device_list.replica_groups)]


REDUCTIONS = {"add": "", "maximum": " (max)", "minimum": " (min)", "multiply": " (mul)"}


def collective_kind(mod: "Module", ins) -> str:
    """``all-gather``, ``all-reduce``, ``all-reduce (max)``, ``reduce-scatter``, ...: the reducing collectives
    named by the root of their reduction computation when it is not a sum."""
    kind = COLLECTIVES[ins.opcode]
    if kind in ("all-reduce", "reduce-scatter") and ins.called_computation_ids:
        comp = mod.comps.get(ins.called_computation_ids[0])
        root = next((i for i in comp.instructions if i.id == comp.root_id), None) if comp else None
        if root is not None:
            kind += REDUCTIONS.get(root.opcode, f" ({root.opcode})")
    return kind


def _array(shape):
    """The first array of a (token-carrying) tuple shape, or the shape itself."""
    return shape if shape.dimensions or not shape.tuple_shapes else shape.tuple_shapes[0]


def collective_bytes(kind: str, out_shape, operand_shapes) -> int:
    """The full buffer on each rank: an all-gather's output, a reduce-scatter's input, an all-reduce's buffer (its
    data operands; torch-xla threads a token through as a second, empty operand)."""
    data = [s for s in operand_shapes if s.dimensions]
    if kind.startswith("all-gather"):
        return nbytes(_array(out_shape))
    return sum(nbytes(s) for s in data)


def _where(frames) -> str:
    """``file:function:line`` of the first frame outside torch and NxD's collective wrappers."""
    skip = PASS_THROUGH + ("/parallel_layers/comm.py", "/parallel_layers/mappings.py", "/minimax_m3/neuron/nxd_compat",
                           "m3-collective:")  # a collective's stand-in frame (graphs.stablehlo.MARK)
    for path, func, line in frames:
        if not any(s in path.replace("\\", "/") for s in skip):
            return f"{path.rsplit('/', 1)[-1]}:{func}:{line}"
    return ""


def _structural_keys(mod: Module) -> dict[tuple, int]:
    """A hash per node equal for instructions XLA's CSE would merge (same op, attributes and operands)."""
    keys: dict[tuple, int] = {}
    for n in mod.nodes:
        ins = mod.get(n)
        if _is_noop(mod, n):
            keys[n] = keys[mod.operands[n][0]]
            continue
        bare = hs.HloInstructionProto()
        bare.CopyFrom(ins)
        for f in ("name", "id", "operand_ids", "metadata", "called_computation_ids", "frontend_attributes"):
            bare.ClearField(f)
        called = tuple(tuple(i.opcode for i in mod.comps[c].instructions) for c in ins.called_computation_ids)
        salt = n if ins.opcode in ("rng", "rng-bit-generator") or ins.custom_call_has_side_effect else None
        keys[n] = hash((bare.SerializeToString(deterministic=True), called, salt,
                        tuple(keys[o] for o in mod.operands[n])))
    return keys


def _is_noop(mod: Module, node) -> bool:
    """An op XLA's simplifier removes: same dims and type as its operand (a full slice, a reshape, broadcast,
    convert or identity transpose to the same shape)."""
    ins = mod.get(node)
    if ins.opcode not in ("slice", "reshape", "broadcast", "convert", "bitcast", "transpose"):
        return False
    ops = mod.operands.get(node, ())
    if not ops:
        return False
    src = mod.shape_of(ops[0])
    same = list(src.dimensions) == list(ins.shape.dimensions) and src.element_type == ins.shape.element_type
    return same and (ins.opcode != "transpose" or list(ins.dimensions) == sorted(ins.dimensions))


def _is_view(mod: Module, node) -> bool:
    """Shape-only: :data:`VIEW_OPS`, a ``broadcast`` that adds no elements (torch-xla emits them), a full
    slice."""
    ins = mod.get(node)
    if ins.opcode in VIEW_OPS or _is_noop(mod, node):
        return True
    ops = mod.operands.get(node, ())
    return ins.opcode == "broadcast" and len(ops) == 1 and numel(ins.shape) == numel(mod.shape_of(ops[0]))


def _chain(mod: Module, state_node, out_node) -> set:
    """Nodes on the in-place path from the aliased output back to the state parameter (empty if none)."""
    path, n = [], out_node
    while n != state_node:
        ins = mod.get(n)
        if ins.opcode not in UPDATE_OPS and not _is_view(mod, n):
            return set()
        path.append(n)
        n = mod.operands[n][0]
    return set(path) | {state_node}


def _reads(mod: Module, node, full: int, elem_bytes: int, seen: set) -> int:
    """Bytes of ``node``'s buffer (``full`` bytes) its users read. A partial read (slice, gather) is followed
    on: it reads what its own users read of it, at most its size."""
    total = 0
    for user, k in mod.users.get(node, ()):
        op = mod.get(user).opcode
        if user in seen:
            continue
        if _is_view(mod, user) or (op in UPDATE_OPS and k == 0):
            seen.add(user)
            total += _reads(mod, user, full, elem_bytes, seen)
        elif op in PART_READ_OPS and k == 0:
            seen.add(user)
            part = numel(mod.shape_of(user)) * elem_bytes
            total += min(part, _reads(mod, user, part, elem_bytes, seen))
        elif user == mod.root and op == "tuple":
            continue  # returned (aliased output): written, not read
        else:
            total += full
    return total


def analyze_module(module, states: dict[int, float] | None = None) -> dict:
    """Figures of one module. ``states``: parameter number -> fraction of its elements a copy must reach to
    count (1.0 = full size; a token-generation bucket shorter than the cache passes bucket / max_length)."""
    mod = Module(module)
    states = states or {}
    shapes = {n: mod.shape_of(n) for n in mod.nodes}
    flops = dict.fromkeys(DOT_CLASSES, 0)
    custom: dict[str, dict] = {}
    coll: dict[tuple, dict] = {}
    coll_ops: list[dict] = []
    notes, bare, gathered = [], 0, 0
    loose_shapes = {i.id: i.shape for c in mod.loose_comps for i in mod.comps[c].instructions}
    for node, ins in mod.all_instructions():
        op = ins.opcode
        if op in ("dot", "convolution"):
            if node is not None:
                op_shapes = [shapes[o] for o in mod.operands[node]]
            else:
                op_shapes = [loose_shapes[o] for o in ins.operand_ids]
            frames = mod.frames(ins)
            bare += not frames
            flops[classify(frames)] += dot_flops(ins, op_shapes)
        elif op == "custom-call":
            c = custom.setdefault(ins.custom_call_target, {"count": 0, "counted": True})
            c["count"] += 1
            kernel = nki_kernel(ins)
            if kernel is not None and node is not None:
                cls, cost, assumes = NKI_KERNEL_COST[kernel["nki_kernel"]]
                flops[cls] += cost([shapes[o] for o in mod.operands[node]], kernel)
                notes.append(f"NKI kernel {kernel['nki_kernel']}: FLOPs counted analytically (nki_cost."
                             f"NKI_KERNEL_COST), {assumes}")
            elif ins.custom_call_target not in KNOWN_CUSTOM_CALLS:
                c["counted"] = False
        elif op in COLLECTIVES:
            kind = collective_kind(mod, ins)
            opnd = [shapes[o] for o in mod.operands[node]] if node else [ins.shape]
            size = collective_bytes(kind, ins.shape, opnd)
            dtype = dtype_name(_array(ins.shape))
            key = (kind, dtype, _group_size(ins))
            e = coll.setdefault(key, {"kind": kind, "dtype": key[1], "group_size": key[2], "count": 0,
                                      "bytes": 0})
            e["count"] += 1
            e["bytes"] += size
            coll_ops.append({"kind": kind, "dtype": dtype, "shape": list(_array(ins.shape).dimensions),
                             "bytes": size, "group_size": key[2], "replica_groups": replica_groups(ins),
                             "where": _where(mod.frames(ins))})
        elif op == "gather" and node is not None and dtype_name(ins.shape).startswith(("f", "bf")) \
                and classify(mod.frames(ins)) == "attention":
            gathered += nbytes(ins.shape)
        elif op == "while":
            notes.append("a while loop: its body is counted once (trip count not read)")
    if bare:
        notes.append(f"{bare} dot(s) without debug metadata counted as rest (trace with XLA_IR_DEBUG=1 "
                     "XLA_HLO_DEBUG=1)")
    uncounted = sorted(t for t, c in custom.items() if not c["counted"])
    if uncounted:
        notes.append("uncounted custom call(s) (FLOPs not known from shapes): " + ", ".join(uncounted))

    reads = {}
    for p, node in sorted(mod.params.items()):
        shape = mod.shape_of(node)
        elem = nbytes(shape) // max(1, numel(shape))
        reads[p] = _reads(mod, node, nbytes(shape), elem, set())

    copy_ops = _state_copies(mod, states, shapes) if states else {}
    return {
        "instructions": sum(len(c.instructions) for c in module.computations),
        "entry_instructions": len(mod.entry.instructions),
        "flops": flops,
        "custom_calls": {t: c["count"] for t, c in sorted(custom.items())},
        "uncounted_custom_calls": uncounted,
        "collectives": sorted(coll.values(), key=lambda e: (e["kind"], e["dtype"], e["group_size"] or 0)),
        "collective_ops": coll_ops,
        "gathered_kv": gathered,
        "reads": reads,
        "copies": {p: len(c) for p, c in copy_ops.items()},
        "copy_bytes": {p: sum(b for _, b in c) for p, c in copy_ops.items()},
        "copy_ops": {p: [d for d, _ in c] for p, c in copy_ops.items()},
        "aliases": aliases(module),
        "notes": sorted(set(notes)),
    }


def entry_parameters(module) -> dict:
    """parameter number -> shape, of the entry computation."""
    entry = next((c for c in module.computations if c.id == module.entry_computation_id), None)
    if entry is None:
        raise HloCostError("the module has no entry computation")
    return {i.parameter_number: i.shape for i in entry.instructions if i.opcode == "parameter"}


def aliases(module) -> dict[int, int]:
    """parameter number -> output tuple index (top-level aliases only)."""
    out = {}
    for e in module.input_output_alias.entries:
        if len(e.output_shape_index) <= 1:
            out[e.parameter_number] = e.output_shape_index[0] if e.output_shape_index else 0
    return out


def _state_copies(mod: Module, states: dict[int, float], shapes) -> dict[int, list[tuple[str, int]]]:
    """parameter number -> the copies found: (``opcode dtype[dims] file:line``, bytes written)."""
    alias = aliases(mod.m)
    root = mod.get(mod.root)
    keys: dict = {}
    order = {n: i for i, n in enumerate(mod.nodes)}
    out = {}
    for p, fraction in states.items():
        node = mod.params.get(p)
        if node is None:
            continue
        chain: set = set()
        if p in alias:
            outs = mod.operands[mod.root] if root.opcode == "tuple" else [mod.root]
            if alias[p] < len(outs):
                chain = _chain(mod, node, outs[alias[p]])
        chain_keys = None
        threshold = numel(shapes[node]) * fraction
        derived, stack = set(), [node]
        while stack:
            for user, _ in mod.users.get(stack.pop(), ()):
                if user not in derived and mod.get(user).opcode in MOVE_OPS:
                    derived.add(user)
                    stack.append(user)
        found = []
        for n in sorted(derived, key=order.get):
            ins = mod.get(n)
            if n in chain or n == mod.root or _is_view(mod, n) or ins.opcode == "tuple":
                continue
            if ins.opcode in PART_READ_OPS and numel(ins.shape) < numel(shapes[node]):
                continue
            if ins.opcode == "gather" and numel(ins.shape) > numel(shapes[node]):
                continue  # slots repeated (each query's blocks): the gathered K/V, not a copy of the state
            if ins.shape.tuple_shapes or numel(ins.shape) < threshold:
                continue
            if chain_keys is None:
                keys = keys or _structural_keys(mod)
                chain_keys = {keys[c] for c in chain if c in keys}
            if keys[n] in chain_keys:
                continue  # identical to the in-place update: CSE merges it
            frames = mod.frames(ins)
            where = f"{frames[0][0].rsplit('/', 1)[-1]}:{frames[0][2]}" if frames else ""
            found.append((f"{ins.opcode} {dtype_name(ins.shape)}{list(ins.shape.dimensions)} {where}".rstrip(),
                          nbytes(ins.shape)))
        out[p] = found
    return out
