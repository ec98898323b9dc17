"""``xla_hlo_call`` / ``RmsNorm`` stand-ins for the graph harness (test code).

NxDI writes a few HLO snippets with torch_neuronx's "scribe" API (``dtype[shape].DynamicUpdateSlice(t, u, *starts)``,
``scribe.u32.Constant(constant_value=0)``, ``dtype[shape].Rng(lo, hi, distribution=1)``, ``ty.CustomCall(*args,
custom_call_target=...)``, ``scribe.tuple(*args)``). The snippet function is first run on recording values, which
give a small expression; the expression is then emitted on the XLA device: DynamicUpdateSlice/Constant through
``torch_xla.core.xla_builder`` as one called computation (what torch_neuronx inserts too), a CustomCall as a real
custom-call with the right shapes (``torch_xla._XLAC._xla_custom_call``), a uniform Rng as ``torch.rand``.
"""

from __future__ import annotations

import torch

_TORCH = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "s32": torch.int32, "s64": torch.int64,
          "u32": torch.uint32, "u8": torch.uint8, "pred": torch.bool}
_XLA = {v: k for k, v in _TORCH.items()}


class DType:
    def __init__(self, scribe, name):
        self.scribe, self.name = scribe, name

    def __getitem__(self, sizes):
        return ShapeType(self, tuple(sizes) if isinstance(sizes, (tuple, list)) else (sizes,))

    def Constant(self, constant_value):  # noqa: N802 (the scribe API's names)
        return Node("constant", ShapeType(self, ()), (), value=constant_value)


class ShapeType:
    def __init__(self, dtype, sizes):
        self.dtype, self.sizes = dtype, sizes

    def DynamicUpdateSlice(self, tensor, update, *starts):  # noqa: N802
        return Node("dus", self, (tensor, update, *starts))

    def Rng(self, lo, hi, distribution):  # noqa: N802
        return Node("rng", self, (lo, hi), distribution=distribution)

    def CustomCall(self, *args, custom_call_target, **_):  # noqa: N802
        return Node("custom_call", self, args, target=custom_call_target)


class TupleType:
    def __init__(self, parts):
        self.parts = parts

    def CustomCall(self, *args, custom_call_target, **_):  # noqa: N802
        return Node("custom_call", self, args, target=custom_call_target)


class Scribe:
    def __getattr__(self, name):
        if name in _TORCH:
            return DType(self, name)
        raise AttributeError(name)

    def tuple(self, *args):
        return TupleType([a.type for a in args])


class Node:
    def __init__(self, kind, type_, args, **attrs):
        self.kind, self.type, self.args, self.attrs = kind, type_, args, attrs

    # what snippet code reads from its arguments
    @property
    def dtype(self):
        return self.type.dtype

    @property
    def sizes(self):
        return self.type.sizes

    @property
    def scribe(self):
        return self.type.dtype.scribe

    def CustomCall(self, *args, custom_call_target, **_):  # noqa: N802 (a value used as its own output type)
        return Node("custom_call", self.type, args, target=custom_call_target)


def _param(scribe, i, t):
    return Node("param", ShapeType(DType(scribe, _XLA[t.dtype]), tuple(t.shape)), (), index=i)


def xla_hlo_call(fn):
    def call(*tensors):
        scribe = Scribe()
        params = [_param(scribe, i, t) for i, t in enumerate(tensors)]
        root = fn(*params)
        return _emit(root, list(tensors))

    return call


def _emit(root: Node, tensors: list):
    if root.kind == "custom_call":
        return custom_call(tensors, root.attrs["target"], root.type)
    if root.kind == "rng" and root.attrs.get("distribution") == 1:
        lo, hi = (a.attrs.get("value") for a in root.args)
        if (lo, hi) == (0, 1):
            return torch.rand(root.sizes, dtype=_TORCH[root.dtype.name], device=tensors[0].device)
    if root.kind != "dus":
        raise NotImplementedError(f"xla_hlo_call stand-in: no lowering for {root.kind}")
    import torch_xla
    import torch_xla.core.xla_builder as xb

    def build(*ops):
        def lower(node):
            if node.kind == "param":
                return ops[node.attrs["index"]]
            if node.kind == "constant":
                return xb.Op.scalar(ops[0].builder(), node.attrs["value"], dtype=node.dtype.name)
            if node.kind == "dus":
                tensor, update, *starts = node.args
                return lower(tensor).dynamic_update_slice(lower(update), [lower(s) for s in starts])
            raise NotImplementedError(node.kind)

        return lower(root)

    comp = xb.create_computation("xla_hlo_call", build, [xb.tensor_shape(t) for t in tensors])
    out = torch_xla._XLAC._xla_user_computation("xla::hlo_call", tensors, comp)
    return out[0] if len(out) == 1 else tuple(out)


def custom_call(tensors, target: str, out_type):
    import torch_xla

    parts = out_type.parts if isinstance(out_type, TupleType) else [out_type]
    shapes = [list(p.sizes) for p in parts]
    dtypes = [_TORCH[p.dtype.name] for p in parts]
    out = torch_xla._XLAC._xla_custom_call(list(tensors), target, shapes, dtypes, False, "", 1, {})
    return out[0] if len(out) == 1 else tuple(out)


class RmsNorm(torch.autograd.Function):
    """``torch_neuronx.xla_impl.ops.RmsNorm``: the custom-call ``AwsNeuronRmsNorm`` (hidden, weight) -> hidden."""

    @staticmethod
    def forward(ctx, hidden, weight, eps, dim):
        import torch_xla

        return torch_xla._XLAC._xla_custom_call([hidden, weight], "AwsNeuronRmsNorm", [list(hidden.shape)],
                                                [hidden.dtype], False, "", 1, {})[0]


class TopK:
    """``torch_neuronx.xla_impl.ops.TopK`` as NxD's distributed top-k calls it (``TopK.apply(t, k, dim=dim)``;
    on-device sampling with ``top_k_kernel_enabled=False``): ``torch.topk`` lowered by XLA (values, int32 indices),
    not Neuron's own lowering."""

    @staticmethod
    def apply(x, k, dim=-1):
        values, indices = torch.topk(x, k, dim=dim)
        return values, indices.to(torch.int32)


class Argmax:
    """``torch_neuronx.xla_impl.ops.Argmax`` as NxD's distributed argmax calls it (``Argmax.apply(t, dim, keepdim)``:
    the argmax over the ranks' gathered maxima; a fused build's draft token): ``torch.argmax`` lowered by XLA."""

    @staticmethod
    def apply(x, dim=-1, keepdim=False):
        return torch.argmax(x, dim=dim, keepdim=keepdim)
