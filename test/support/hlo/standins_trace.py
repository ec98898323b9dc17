"""Stand-ins for the ``torch_neuronx`` trace pieces, so that NxDI's own ``compile(dry_run=True)`` writes every bucket's
HLO module here, without the Neuron SDK. Test code (like ``test/support/neuron/standins.py``, whose import machinery it
extends); the NxDI/NxD sources come from ``NXDI_SRC``/``NXD_SRC``.

``torch_neuronx`` is a closed wheel, but the functions NxD calls on this path are thin layers over public torch-xla:

* ``generate_hlo(func, inputs, aliases)`` runs the module on the XLA CPU device, lowers its outputs with torch-xla's
  ``LoweringContext``, renumbers the entry parameters as [user inputs, aliased states in alias order, weights, other
  constants] and records each alias as a must-alias ``input_output_alias`` entry (output index <-> parameter);
* ``setup_compiler_dirs`` / ``get_compile_command`` / ``save_compile_command`` / ``generate_neff`` write the module
  (``model/graph.hlo``) and the neuronx-cc command line; nothing is compiled, and no NEFF file is written;
* ``xla_hlo_call`` builds NxDI's small HLO snippets (``DynamicUpdateSlice`` with constant or tensor starts,
  ``Constant``, ``Rng``) with ``torch_xla.core.xla_builder`` and inserts them as a ``call``; ``CustomCall`` snippets
  (layer markers) and ``RmsNorm`` (the published port's norm) become real custom-calls with the right shapes;
* ``hlo_pb2`` / ``xla_data_pb2`` are the package's own ``minimax_m3.graphs.hlo_schema`` classes, ``metaneff_pb2`` a
  message with the field names NxD reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import types
from pathlib import Path

import torch

from test.support.neuron import standins

DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", torch.int32: "s32",
          torch.int64: "s64", torch.bool: "pred", torch.uint8: "u8", torch.int8: "s8",
          torch.float8_e4m3fn: "f8e4m3fn", torch.uint32: "u32"}
MARKER_TARGETS = ("AwsNeuronModuleMarkerStartForward", "AwsNeuronModuleMarkerEndForward",
                  "AwsNeuronModuleMarkerStartBackward", "AwsNeuronModuleMarkerEndBackward")


# ---- metaneff ----------------------------------------------------------------------------------------------------
def _metaneff_module() -> types.ModuleType:
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    F = descriptor_pb2.FieldDescriptorProto
    fd = descriptor_pb2.FileDescriptorProto(name="standin_metaneff.proto", package="standin", syntax="proto3")
    tensor = fd.message_type.add(name="MetaTensor")
    enum = tensor.enum_type.add(name="Type")
    for i, n in enumerate(("USER_INPUT", "INPUT_STATE", "INPUT_WEIGHT", "OUTPUT")):
        enum.value.add(name=n, number=i)
    for name, num, typ in (("name", 1, F.TYPE_BYTES), ("data_type", 3, F.TYPE_STRING),
                           ("checkpoint_key", 5, F.TYPE_BYTES)):
        tensor.field.add(name=name, number=num, type=typ, label=F.LABEL_OPTIONAL)
    tensor.field.add(name="shape", number=2, type=F.TYPE_INT64, label=F.LABEL_REPEATED)
    tensor.field.add(name="type", number=4, type=F.TYPE_ENUM, type_name=".standin.MetaTensor.Type",
                     label=F.LABEL_OPTIONAL)
    neff = fd.message_type.add(name="MetaNeff")
    neff.field.add(name="input_tensors", number=1, type=F.TYPE_MESSAGE, type_name=".standin.MetaTensor",
                   label=F.LABEL_REPEATED)
    neff.field.add(name="output_tensors", number=2, type=F.TYPE_MESSAGE, type_name=".standin.MetaTensor",
                   label=F.LABEL_REPEATED)
    entry = neff.nested_type.add(name="OutputAliasesToEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    entry.field.add(name="value", number=2, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL)
    neff.field.add(name="output_aliases_to", number=3, type=F.TYPE_MESSAGE,
                   type_name=".standin.MetaNeff.OutputAliasesToEntry", label=F.LABEL_REPEATED)
    neff.field.add(name="serialized_graph_def", number=4, type=F.TYPE_BYTES, label=F.LABEL_OPTIONAL)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    fdesc = pool.FindFileByName(fd.name)
    mod = types.ModuleType("torch_neuronx.proto.metaneff_pb2")
    mod.MetaTensor = message_factory.GetMessageClass(fdesc.message_types_by_name["MetaTensor"])
    mod.MetaNeff = message_factory.GetMessageClass(fdesc.message_types_by_name["MetaNeff"])
    return mod


METANEFF = None  # built at install (needs protobuf)


# ---- artifacts ---------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class HloArtifacts:
    hlo_module: object
    flattener: object = None
    packer: object = None
    metaneff: object = None
    weights: object = None
    constant_parameter_tensors: dict | None = None
    weight_name_to_idx: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class NeffArtifacts:
    neff_filename: str | None = None


class _Flattener:
    """NxD reads ``flattener.exclude`` (inputs not passed to the NEFF): none here."""

    exclude = None


def get_torch_dtype(name):
    inverse = {v: k for k, v in DTYPES.items()}
    return inverse.get(str(name).lower(), torch.float32)


def _device():
    import torch_xla

    return torch_xla.device()


def _to_device(module: torch.nn.Module, dev) -> dict:
    """Weights and states onto the XLA device (once per module; later buckets reuse them). A CPU Parameter cannot
    take XLA data in place, so each is replaced by a new Parameter; returns id(old) -> (old, new) for the alias keys."""
    moved = getattr(module, "_standin_xla_params", None)
    if moved is None:
        moved = {}
        with torch.no_grad():
            for m in module.modules():
                for name, p in list(m._parameters.items()):
                    if p is not None and p.device != dev:
                        new = torch.nn.Parameter(p.data.to(dev), requires_grad=False)
                        moved[id(p)] = (p, new)  # the old one kept alive: its id must not be reused
                        m._parameters[name] = new
                for name, b in list(m._buffers.items()):
                    if b is not None and b.device != dev:
                        m._buffers[name] = b.to(dev)
        module._standin_xla_params = moved
    return moved


def _flatten(out) -> list:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        out = list(out.values())
    flat = []
    for o in out:
        flat.extend(_flatten(o) if not isinstance(o, torch.Tensor) else [o])
    return flat


def generate_hlo(func, example_inputs, input_output_aliases, inline_weights_to_neff=False, return_weights=False,
                 output_aliased_tensor=False, cpu_backend=True, preserve_parameters=False, **_):
    import torch_xla  # noqa: F401  (initialises the XLA runtime before the first device call)

    from minimax_m3.graphs import hlo_schema

    dev = _device()
    if isinstance(func, torch.nn.Module):
        moved = _to_device(func, dev)
        input_output_aliases = {moved[id(k)][1] if id(k) in moved and moved[id(k)][0] is k else k: v
                                for k, v in input_output_aliases.items()}
    inputs = [t.to(dev) if isinstance(t, torch.Tensor) else t for t in example_inputs]
    ctx, outputs, checks = _lower(func, inputs)
    module = hlo_schema.parse_module(ctx.hlo())
    if PROBE_POSITIONS and _is_decode(inputs):
        other = [(t + 3).to(dev) if isinstance(t, torch.Tensor) and not t.is_floating_point() else i
                 for t, i in zip(example_inputs, inputs)]
        checks["same_graph_at_other_positions"] = (
            _fingerprint(module) == _fingerprint(hlo_schema.parse_module(_lower(func, other)[0].hlo())))
    if PROBE_CHUNKS and not _is_decode(inputs):
        checks["same_graph_at_chunks"] = {str(k): _fingerprint(module) == _fingerprint(hlo_schema.parse_module(
            _lower(func, _chunk_inputs(example_inputs, inputs, k, dev))[0].hlo())) for k in PROBE_CHUNKS}

    order: list[tuple[int, str, str, torch.Tensor]] = []  # (old parameter number, role, name, tensor)
    seen: set[int] = set()

    def take(t, role, name):
        pid = ctx.tensor_parameter_id(t)
        if pid >= 0 and pid not in seen:
            seen.add(pid)
            order.append((pid, role, name, t))

    for i, t in enumerate(inputs):
        if isinstance(t, torch.Tensor):
            take(t, "input", f"input{i}")
    names = {id(p): n for n, p in func.named_parameters(remove_duplicate=False)} if isinstance(
        func, torch.nn.Module) else {}
    alias_items = sorted(input_output_aliases.items(), key=lambda kv: kv[1])
    for state, _out in alias_items:
        take(state, "state", names.get(id(state), f"state{_out}"))
    if isinstance(func, torch.nn.Module):
        for n, p in func.named_parameters():
            take(p, "weight", n)
        for n, b in func.named_buffers():
            take(b, "weight", n)
    mapping = ctx.parameter_id_tensor_mapping()
    constants = {}
    for pid in sorted(mapping):
        if pid not in seen:
            seen.add(pid)
            order.append((pid, "constant", f"constant{pid}", mapping[pid]))
    renumber = {old: new for new, (old, *_rest) in enumerate(order)}
    _renumber_entry(module, renumber)
    for state, out_idx in alias_items:
        pid = ctx.tensor_parameter_id(state)
        if pid >= 0:
            module.input_output_alias.entries.add(output_shape_index=[out_idx], parameter_number=renumber[pid],
                                                  kind=hlo_schema.Kind.MUST_ALIAS)
    weight_name_to_idx = {}
    meta = METANEFF.MetaNeff()
    role_type = {"input": 0, "state": 1, "weight": 2, "constant": 2}
    for new, (_old, role, name, t) in enumerate(order):
        mt = meta.input_tensors.add(name=name.encode(), shape=list(t.shape), data_type=DTYPES.get(t.dtype, "f32"),
                                    type=role_type[role], checkpoint_key=name.encode())
        if role == "weight":
            weight_name_to_idx[name] = new
        elif role == "constant":
            constants[new] = t.cpu()
            mt.checkpoint_key = b""
    for i, o in enumerate(outputs):
        meta.output_tensors.add(name=f"output{i}".encode(), shape=list(o.shape), data_type=DTYPES.get(o.dtype, "f32"),
                                type=3)
    for state, out_idx in alias_items:
        pid = ctx.tensor_parameter_id(state)
        if pid >= 0:
            meta.output_aliases_to[out_idx] = renumber[pid]
    artifacts = HloArtifacts(hlo_module=module, flattener=_Flattener(), metaneff=meta,
                             constant_parameter_tensors=constants, weight_name_to_idx=weight_name_to_idx)
    artifacts.trace_checks = checks
    return artifacts


PROBE_POSITIONS = os.environ.get("HLO_PROBE_POSITIONS", "1") == "1"


# chunk indices k at which each context-encoding bucket is lowered again (``dry_run --probe-chunks``); empty: none
PROBE_CHUNKS: tuple[int, ...] = ()
POSITION_INPUT = 2  # NxDI's example inputs: input_ids, attention_mask, position_ids, seq_ids, sampling_params, ...


def _chunk_inputs(example_inputs, inputs, k: int, dev) -> list:
    """A context-encoding bucket's inputs as the call of chunk ``k`` of a longer prompt: positions ``k x C ..``
    (C = the bucket's width), every other input unchanged."""
    width = example_inputs[0].shape[1]
    return [(t + k * width).to(dev) if i == POSITION_INPUT else d
            for i, (t, d) in enumerate(zip(example_inputs, inputs))]


def _is_decode(inputs) -> bool:
    return isinstance(inputs[0], torch.Tensor) and inputs[0].dim() == 2 and inputs[0].shape[1] == 1


def _lower(func, inputs):
    """Run ``func`` on the XLA device and lower its outputs; also what the trace needed from the host: aten ops
    that fell back to the CPU and device-to-host transfers (a value read during tracing)."""
    import torch_xla
    import torch_xla.debug.metrics as met

    _reset_collective_token()
    before = {n: met.counter_value(n) for n in met.counter_names()}
    reads = (met.metric_data("TransferFromDeviceTime") or (0,))[0]
    with torch.no_grad():
        outputs = _flatten(func(*inputs))
    fallbacks = sorted(n for n in met.counter_names()
                       if n.startswith("aten::") and met.counter_value(n) > before.get(n, 0))
    host_reads = (met.metric_data("TransferFromDeviceTime") or (0,))[0] - reads
    ctx = torch_xla._XLAC.lowering.LoweringContext("SyncTensorsGraph")
    ctx.build(outputs)
    _reset_collective_token()
    return ctx, outputs, {"cpu_fallback_ops": fallbacks, "host_reads": host_reads}


def _reset_collective_token() -> None:
    """torch-xla chains every collective through one per-device token tensor; left over from the previous bucket's
    trace it would pull that whole graph into the next one (as a sync would reset it between steps)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    _, devctx = xm._get_all_reduce_token()
    torch_xla._XLAC._set_all_reduce_token(devctx.device, None)


def _fingerprint(module) -> bytes:
    """The module without debug metadata and names (they differ between traces of the same graph)."""
    m = type(module)()
    m.CopyFrom(module)
    m.ClearField("stack_frame_index")
    m.ClearField("name")
    for c in m.computations:
        for i in c.instructions:
            i.ClearField("metadata")
    return m.SerializeToString(deterministic=True)


def _renumber_entry(module, renumber: dict[int, int]) -> None:
    entry = next(c for c in module.computations if c.id == module.entry_computation_id)
    for inst in entry.instructions:
        if inst.opcode == "parameter":
            inst.parameter_number = renumber[inst.parameter_number]
    for ps in (entry.program_shape, module.host_program_shape):
        params = list(ps.parameters)
        names = list(ps.parameter_names)
        inverse = {new: old for old, new in renumber.items()}
        del ps.parameters[:]
        for new in range(len(params)):
            ps.parameters.add().CopyFrom(params[inverse[new]])
        if names:
            del ps.parameter_names[:]
            ps.parameter_names.extend(names[inverse[new]] for new in range(len(names)))


def setup_compiler_dirs(hlo_module, compiler_workdir, constant_parameter_tensors=None, inline_weights=False):
    target = Path(compiler_workdir) / "model"
    target.mkdir(parents=True, exist_ok=True)
    (target / "graph.hlo").write_bytes(hlo_module.SerializeToString())
    return str(target / "graph.hlo")


def get_compile_command(compiler_target, compiler_workdir, compiler_args):
    args = compiler_args if isinstance(compiler_args, str) else " ".join(compiler_args)
    return (f"neuronx-cc compile --framework=XLA {compiler_target} --output "
            f"{Path(compiler_workdir) / 'graph.neff'} --target=trn2 {args}").split()


def save_compile_command(command, compiler_workdir):
    (Path(compiler_workdir) / "command.txt").write_text(" ".join(command) + "\n")


def generate_neff(hlo_artifacts, compiler_workdir, compiler_args, inline_weights_to_neff=False, **_):
    """The priority model's NEFF: written as HLO + command only (a dry run compiles nothing)."""
    target = setup_compiler_dirs(hlo_artifacts.hlo_module, compiler_workdir)
    save_compile_command(get_compile_command(target, compiler_workdir, compiler_args), compiler_workdir)
    return NeffArtifacts(neff_filename=str(Path(compiler_workdir) / "graph.neff"))


def hlo_entry_computation(hlo_module):
    return next(c for c in hlo_module.computations if c.id == hlo_module.entry_computation_id)


def get_hlo_computation_by_id(hlo_module, cid):
    return next(c for c in hlo_module.computations if c.id == cid)


def get_hlo_root_instruction(computation):
    return next(i for i in computation.instructions if i.id == computation.root_id)


# ---- installation ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def hlo_debug(*_, **__):
    yield


def _values() -> dict:
    from minimax_m3.graphs import hlo_schema

    from . import nki_kernels, scribe

    pb = types.SimpleNamespace(**hlo_schema.message_classes(), **hlo_schema.enums())

    def trace(m):
        for name in ("generate_hlo", "generate_neff", "setup_compiler_dirs", "get_compile_command",
                     "save_compile_command", "get_torch_dtype", "hlo_entry_computation", "get_hlo_computation_by_id",
                     "get_hlo_root_instruction"):
            setattr(m, name, globals()[name])
        m.HloArtifacts, m.NeffArtifacts = HloArtifacts, NeffArtifacts
        m.XLA_DTYPE_TO_METANEFF_DTYPE = {}

    def pyhlo(m):
        m.hlo_pb2 = m.xla_data_pb2 = pb

    def proto(m):
        m.metaneff_pb2 = METANEFF

    def ops(m):
        m.xla_hlo_call = scribe.xla_hlo_call
        m.RmsNorm = scribe.RmsNorm
        m.TopK = scribe.TopK
        m.Argmax = scribe.Argmax

    def base(m):
        m.xla_hlo_call = scribe.xla_hlo_call

    def targets(m):
        for t in MARKER_TARGETS:
            setattr(m, t, t)

    def profiler(m):
        m.hlo_debug = hlo_debug

    return {"torch_neuronx.xla_impl.trace": trace, "torch_neuronx.pyhlo": pyhlo, "torch_neuronx.proto": proto,
            "torch_neuronx.xla_impl.ops": ops, "torch_neuronx.xla_impl.base": base,
            "torch_neuronx.xla_impl.custom_call_targets": targets,
            "torch_neuronx.experimental.profiler.v2_x.custom_op_name": profiler, **nki_kernels.VALUES}


def install() -> None:
    """NxDI/NxD sources on the path, the SDK stand-ins with the trace pieces above, NxDI's CPU mode OFF."""
    global METANEFF
    if standins.installed():
        if os.environ.get("NXD_CPU_MODE"):
            raise RuntimeError("the CPU-mode stand-ins are installed in this process; trace in a fresh process")
        return
    METANEFF = _metaneff_module()
    standins.EXTRA_VALUES.update(_values())
    standins.add_sources()
    standins.install(cpu_mode=False)
