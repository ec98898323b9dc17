"""What ``torch.compile`` captures of the vLLM Neuron model, bucket by bucket, before anyone compiles on a trn2.

The plugin compiles the forward with ``torch.compile(fullgraph=True)``, one graph per bucket at warm-up, and makes a
recompile afterwards an error (``docs/notes/vllm_neuron_runner.md``, "Buckets"). :func:`capture` does the same with a
backend that only records the FX graph Dynamo hands it: a graph break fails at once (``fullgraph``) with the op and
the source line Dynamo names; then the bucket is called again with other contents — positions, prompt lengths,
block tables, slots — under ``fail_on_recompile``, so a guard on any value fails too.

:func:`rank_model` builds one rank's model at any width (random weights, the reference layers' per-rank shapes) with
its collectives on a process group that need not exist (torch's ``fake`` backend): the captured graph is that rank's,
the collectives in it as ``_c10d_functional`` ops — what ``compile --dry-run`` gives for the NxDI port.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import parallel
from ..config.m3 import M3Config
from ..errors import M3Error
from ..ops.paged import slot_mapping
from ..reference.model import M3Model
from . import sampling
from .contract import Layout, attention_spec
from .model import MiniMaxM3ForCausalLM


class CaptureError(M3Error, RuntimeError):
    """The model does not capture as the plugin compiles it: a graph break, or a recompile within a bucket."""

    def __init__(self, problems):
        super().__init__(problems, "the vLLM Neuron model does not capture whole:")


@dataclass(frozen=True)
class Bucket:
    """One compiled shape: ``prefill`` (one request, ``tokens`` padded, a block table ``width`` wide) or ``decode``
    (``batch`` rows of ``tokens`` each, 1 or 1 + drafts)."""

    kind: str
    tokens: int
    width: int
    batch: int = 1


@dataclass
class Capture:
    bucket: Bucket
    graphs: list = field(default_factory=list)  # FX GraphModules, one per compilation (one when whole)

    def ops(self) -> dict[str, int]:
        """``{op: count}`` of the captured graph's calls."""
        out: dict[str, int] = {}
        for gm in self.graphs:
            for node in gm.graph.nodes:
                if node.op == "call_function":
                    name = getattr(node.target, "__name__", str(node.target))
                    out[name] = out.get(name, 0) + 1
        return out

    def collectives(self) -> dict[str, int]:
        return {k: v for k, v in self.ops().items() if k in ("all_reduce", "all_gather_into_tensor",
                                                             "reduce_scatter_tensor", "all_to_all_single")}


@dataclass(frozen=True)
class SpecDecode:
    """A verify step's ``spec_decode_metadata`` as the model reads it (given or not; the drafts are the call's
    tokens): the runner passes vLLM's ``SpecDecodeMetadata``."""

    drafts: int


def inputs(model: MiniMaxM3ForCausalLM, b: Bucket, start: int = 0, seed: int = 0) -> dict:
    """The forward's arguments for bucket ``b``, laid out as the runner lays them out: flat ``input_ids`` (int32) and
    ``positions``, one ``attn_metadata`` dict under every layer's name (slots from the block table, padding 0),
    ``sampling_positions`` at each row's last token (a verify step's: at every token, with ``spec_decode_metadata``
    set, which makes an on-device-sampling model decide the step), and with on-device sampling ``sampling_params``.
    ``start``: the
    first position (a prefill segment after cached tokens, or each decode row's position); ``seed`` shuffles the
    pages (other block tables, same shapes). Under decode context parallelism the slots are the rank's
    (``ops.paged.slot_mapping``), a segment's cut to its blocks (start and tokens then whole laps of ``dcp``
    blocks)."""
    c = model.config
    bs, rows = c.index_block_size, b.batch if b.kind == "decode" else 1
    gen = torch.Generator().manual_seed(seed)
    pages = torch.randperm(rows * b.width, generator=gen).view(rows, b.width) + 1  # page 0: the null page
    per = b.tokens
    pos = torch.arange(per).view(1, per) + start + torch.arange(rows).view(rows, 1) * (seed % 3)
    lay = model.layout
    slots = slot_mapping(pages, pos, bs, lay.dcp, lay.dcp_rank)
    if lay.dcp > 1 and b.kind == "prefill":  # the runner cuts a DCP segment's slots to this rank's blocks
        slots = slots.view(-1, lay.dcp, bs)[:, lay.dcp_rank]
    md = {"slot_mapping": slots.reshape(-1), "block_table_tensor": pages.to(torch.int32), "block_size": bs,
          "max_query_len": per, "decode_token_threshold": per if b.kind == "decode" else 1}
    verify = b.kind == "decode" and per > 1
    out = dict(input_ids=torch.randint(3, c.vocab_size, (rows * per,), generator=gen, dtype=torch.int32),
               positions=pos.reshape(-1), attn_metadata={attention_spec(i): md for i in range(c.num_layers)},
               sampling_positions=torch.arange(rows * per) if verify else torch.arange(rows) * per + per - 1,
               spec_decode_metadata=SpecDecode(per - 1) if verify else None)
    if model.ods is not None:  # the runner's (top_k, top_p, temperature) per row (:mod:`.sampling`)
        out["sampling_params"] = torch.tensor([[50.0, 0.9, 0.8]]).expand(rows, 3).contiguous()
    return out


def capture(model: MiniMaxM3ForCausalLM, b: Bucket, starts: tuple[int, ...] = (0,)) -> Capture:
    """Capture bucket ``b`` with ``fullgraph=True, dynamic=False``; then run it from each of ``starts`` with other
    page tables under ``fail_on_recompile``. Raises :class:`CaptureError` naming the op and line on a break or a
    recompile."""
    import torch._dynamo

    cap = Capture(b)

    def record(gm, example_inputs):
        cap.graphs.append(gm)
        if model.layout.dcp == 1:
            return gm.forward
        # the fake process group's collectives hand back uninitialised memory, and the DCP step indexes with what
        # they gather (the merged block ids): the graph is recorded, not run; the call returns zeros of its outputs
        outs = [n.meta.get("example_value") for n in gm.graph.output_node().args[0]]
        return lambda *args: tuple(torch.zeros(o.shape, dtype=o.dtype) for o in outs)

    torch._dynamo.reset()
    fn = torch.compile(model.forward, backend=record, fullgraph=True, dynamic=False)
    try:
        fn(**inputs(model, b))
        with torch.compiler.set_stance("fail_on_recompile"):
            for i, s in enumerate(starts):
                fn(**inputs(model, b, start=s, seed=i + 1))
    except (torch._dynamo.exc.Unsupported, torch._dynamo.exc.RecompileError, torch._dynamo.exc.UserError) as e:
        raise CaptureError([f"{b}: {type(e).__name__}: {str(e).strip()}"]) from None
    return cap


def rank_model(c: M3Config, world: int = 1, rank: int = 0, ep: int = 1, dtype=torch.bfloat16,
               num_blocks: int = 64, experts: str = "bf16", on_device_sampling: bool = False,
               dcp: int = 1) -> MiniMaxM3ForCausalLM:
    """Rank ``rank`` of ``world`` with random weights at the per-rank shapes, its pages bound (``num_blocks`` of the
    index block), the load-time choices of :meth:`MiniMaxM3ForCausalLM.load_weights` made; ``on_device_sampling``:
    the plugin's default sampler config (its graphs then end in the draw). ``world > 1`` joins (once) torch's
    ``fake`` process group of that size: collectives are captured, never run; ``dcp``: vLLM's decode context
    parallelism, the rank's DCP group (consecutive ranks, as vLLM forms them) a sub-group of it."""
    group = dcp_group = None
    if world > 1:
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if not dist.is_initialized():
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        group = dist.group.WORLD
        if dcp > 1:
            from ..reference.parallel import SequenceGroup

            first = rank - rank % dcp
            dcp_group = SequenceGroup(dcp, dist.new_group(list(range(first, first + dcp))))
    problems = parallel.dcp_problems(c, world, dcp)
    if problems:
        raise CaptureError(problems)
    model = MiniMaxM3ForCausalLM(c, Layout(world=world, rank=rank, ep=ep, dtype=dtype, group=group, experts=experts,
                                           dcp=dcp, dcp_rank=rank % dcp, dcp_group=dcp_group))
    torch.manual_seed(0)
    m3 = M3Model(c, model.plan)
    for p in m3.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model.m3 = m3.to(dtype)
    if experts == "fp8":  # what load_weights does with quantization "fp8"
        from ..checkpoint.fp8_experts import quantize_experts_

        quantize_experts_(model.m3)
    model.fix_for_capture("cpu")
    model.ods = sampling.OnDeviceSampling() if on_device_sampling else None
    caches = {s.name: [torch.zeros(num_blocks, s.num_kv_heads, c.index_block_size, s.head_size, dtype=dtype)
                       for _ in range(2)] for s in model.get_kv_spec().layers}
    model.bind_kv_cache(caches)
    return model


COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")


@dataclass
class Lowered:
    """A bucket's forward as StableHLO: ``text`` (generic form, debug locations, collectives restored), one entry
    per function argument in ``params`` (``number``, ``role``: input | weight | state, ``name``: the parameter's, or
    ``past_key_values.N`` for pages, NxDI's numbering: layer ``i``'s K and V are ``2i``, ``2i + 1``, the index
    specs' halves follow the ``2L`` K/V), and ``aliases``: argument number -> result index of its written value."""

    text: str
    params: list
    aliases: dict


def _mark_collectives(gm) -> int:
    """Replace each functional collective of an exported graph by shape-equivalent aten ops whose location is a
    :func:`~minimax_m3.graphs.stablehlo.collective_marker` (torch-mlir lowers none of them); drop the waits."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    from ..graphs.stablehlo import collective_marker

    c10d, aten, g, n = torch.ops._c10d_functional, torch.ops.aten, gm.graph, 0
    for node in list(g.nodes):
        if node.target == c10d.wait_tensor.default:
            node.replace_all_uses_with(node.args[0])
            g.erase_node(node)
    for node in list(g.nodes):
        name = getattr(node.target, "__name__", "").split(".")[0]
        if node.op != "call_function" or not str(node.target).startswith("_c10d_functional."):
            continue
        if name not in COLLECTIVES:
            raise CaptureError([f"collective {node.target} has no StableHLO stand-in (capture.COLLECTIVES)"])
        x = node.args[0]
        dims = x.meta["val"].dim()
        with g.inserting_before(node):
            if name == "all_reduce":
                size, reduce = _resolve_process_group(node.args[2]).size(), node.args[1]
                new = g.call_function(aten.abs.default, (x,))
            elif name == "all_gather_into_tensor":
                size, reduce = node.args[1], "none"
                new = g.call_function(aten.repeat.default, (x, [size] + [1] * (dims - 1)))
            elif name == "all_to_all_single":  # even parts along dim 0 (the DCP step's exchange): the same shape
                size, reduce = _resolve_process_group(node.args[3]).size(), "none"
                new = g.call_function(aten.abs.default, (x,))
            else:
                size, reduce = node.args[2], node.args[1]
                part = x.meta["val"].shape[0] // size
                new = g.call_function(aten.slice.Tensor, (g.call_function(aten.abs.default, (x,)), 0, 0, part))
        kind = {"all_reduce": "all-reduce", "all_gather_into_tensor": "all-gather",
                "all_to_all_single": "all-to-all"}.get(name, "reduce-scatter")
        for m in (new, *new.all_input_nodes):
            if m is not x:
                frame = f'  File "{collective_marker(kind, reduce, size, n)}", line 1, in collective\n'
                m.meta = dict(node.meta, stack_trace=(node.meta.get("stack_trace") or "") + frame)  # innermost last
        node.replace_all_uses_with(new)
        g.erase_node(node)
        n += 1
    g.lint()
    gm.recompile()
    return n


def lower(model: MiniMaxM3ForCausalLM, b: Bucket) -> Lowered:
    """Bucket ``b``'s forward as StableHLO, the module neuronx-cc receives on the plugin's native route
    (``torch.export`` → torch-mlir → StableHLO), its arguments the forward's own, then the weights, then the pages
    (written in place: aliased to results); collectives as ``stablehlo`` collectives (:func:`_mark_collectives`).
    Needs ``torch-mlir``."""
    from torch_mlir import fx, ir

    from ..graphs.stablehlo import restore_collectives

    c = model.config
    specs = [s.name for s in model.get_kv_spec().layers]
    cache = model.cache
    pages = [t for i in range(c.num_layers)
             for t in ((cache.k[i], cache.v[i]) + (cache.ik[i] if i in cache.ik else ()))]
    index = [id(t) for i in sorted(cache.ik) for t in cache.ik[i]]
    order = {id(t): f"past_key_values.{2 * i + j}" for i in range(c.num_layers) for j, t in
             enumerate((cache.k[i], cache.v[i]))} | {t: f"past_key_values.{2 * c.num_layers + j}"
                                                     for j, t in enumerate(index)}
    fused = {name: mod for name, mod in model.m3.named_modules() if getattr(mod, "_fused", None) is not None}
    for mod in fused.values():  # the fused input projections (weights the linears view): arguments, not constants
        t = mod.__dict__.pop("_fused")
        mod.register_buffer("_fused", t, persistent=False)
    views = {t.untyped_storage().data_ptr() for t in (m._fused for m in fused.values())}
    weights = {k: p for k, p in model.m3.named_parameters() if p.untyped_storage().data_ptr() not in views}
    weights.update({f"{name}._fused" if name else "_fused": mod._fused for name, mod in fused.items()})
    args = inputs(model, b)
    md = args["attn_metadata"][attention_spec(0)]
    n_w = len(weights)

    extra = ["sampling_params"] if "sampling_params" in args else []  # on-device sampling: the runner's tensor

    class Forward(torch.nn.Module):  # the model is a closure, not a submodule: its weights stay arguments
        def forward(self, input_ids, positions, slots, table, sampling_positions, *tensors):
            more, tensors = tensors[:len(extra)], tensors[len(extra):]  # the forward's own inputs come first
            w = {f"m3.{k}": t for k, t in zip(weights, tensors[:n_w])}
            it = iter(tensors[n_w:])
            model.bind_kv_cache({name: [next(it), next(it)] for name in specs})
            meta = {attention_spec(i): dict(md, slot_mapping=slots, block_table_tensor=table)
                    for i in range(c.num_layers)}
            return torch.func.functional_call(model, w, (input_ids, positions), dict(
                attn_metadata=meta, sampling_positions=sampling_positions,
                spec_decode_metadata=args["spec_decode_metadata"], **dict(zip(extra, more))))

    user = (args["input_ids"], args["positions"], md["slot_mapping"], md["block_table_tensor"],
            args["sampling_positions"], *(args[k] for k in extra), *weights.values(), *pages)
    names = ["input_ids", "positions", "slot_mapping", "block_table", "sampling_positions", *extra, *weights,
             *(order[id(t)] for t in pages)]
    roles = ["input"] * (5 + len(extra)) + ["weight"] * n_w + ["state"] * len(pages)
    try:
        with torch.no_grad():
            ep = torch.export.export(Forward(), user, strict=True)
        from torch_mlir.extras.fx_decomp_util import get_decomposition_table

        _mark_collectives(ep.graph_module)
        ep = ep.run_decompositions(get_decomposition_table())
        module = fx.export_and_import(ep, output_type="stablehlo", func_name="main", decomposition_table={})
    finally:
        model.bind_kv_cache({name: list(pair) for name, pair in zip(specs, _pairs(pages))})
        for mod in fused.values():
            mod.__dict__["_fused"] = mod._buffers.pop("_fused")
    from torch.export.graph_signature import InputKind, OutputKind

    sig = ep.graph_signature
    position = {s.arg.name: k for k, s in enumerate(s for s in sig.input_specs if s.kind == InputKind.USER_INPUT)}
    aliases = {position[s.target]: k for k, s in enumerate(sig.output_specs)
               if s.kind == OutputKind.USER_INPUT_MUTATION}
    text = restore_collectives(module.operation.get_asm(enable_debug_info=True, print_generic_op_form=True))
    ir.Module.parse(text, module.context).operation.verify()  # the restored collectives are well-formed StableHLO
    return Lowered(text, [{"number": k, "role": r, "name": nm} for k, (r, nm) in enumerate(zip(roles, names))],
                   aliases)


def stablehlo(model: MiniMaxM3ForCausalLM, b: Bucket) -> str:
    """Bucket ``b``'s forward as StableHLO text (:func:`lower`)."""
    return lower(model, b).text


def _pairs(pages: list) -> list:
    return [pages[i:i + 2] for i in range(0, len(pages), 2)]
