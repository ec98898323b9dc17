"""Stand-ins for the Neuron SDK's binary packages, so that NxDI/NxD's Python sources run in CPU mode.

NxDI and NxD import ``torch_neuronx``, ``neuronxcc``, ``nki``, ``nkilib`` and ``libneuronxla`` at module top.
Their CPU mode (``NXD_CPU_MODE=1``, gloo, ``to_cpu()``) never *calls* into them on the paths we run, so each
stand-in module answers any attribute with a class that answers any attribute in turn; calling one with a
single function returns that function unchanged (``@nki.jit``), any other call returns another such class
(so ``@nki_jit(mode=...)`` works too). Three values are
real: the platform target (``"trn2"``), ``xla_hlo_call`` (identity on its tensors: only NxDI's layer-boundary
markers reach it on CPU), and the TorchScript namespace ``torch.classes.neuron`` (used in annotations).

This is our test code, not the SDK; a kernel that would really run on Neuron is not executed here, which is
why CPU-mode configs switch NxDI's kernels off (``attn_kernel_enabled=False`` and friends).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

PREFIXES = ("torch_neuronx", "neuronxcc", "nki", "nkilib", "libneuronxla")


class _AnyMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        sub = _AnyMeta(name, (_Any,), {"__module__": cls.__module__})
        setattr(cls, name, sub)
        return sub

    def __call__(cls, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _AnyMeta):
            return args[0]  # used as a decorator
        return _AnyMeta("result", (_Any,), {"__module__": cls.__module__})

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False

    def __or__(cls, other):
        return cls

    __ror__ = __or__
    __getitem__ = lambda cls, key: cls  # noqa: E731  (type hints like nl.ndarray[...])


class _Any(metaclass=_AnyMeta):
    pass


def _xla_hlo_call(fn):
    def identity(*args, **kwargs):
        return args[0] if len(args) == 1 else args

    return identity


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _AnyMeta(name, (_Any,), {"__module__": self.__name__})
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in PREFIXES:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module):
        _real_values(module)


# module name -> callable(module) that sets real values on a stand-in module; filled by other harnesses (e.g.
# test/hlo's trace stand-ins) before ``install``.
EXTRA_VALUES: dict = {}


def _real_values(module: types.ModuleType) -> None:
    if module.__name__ == "torch_neuronx.utils":
        module.get_platform_target = lambda *a, **k: "trn2"
    elif module.__name__ == "torch_neuronx.xla_impl.base":
        module.xla_hlo_call = _xla_hlo_call
    elif module.__name__ == "torch_neuronx.xla_impl.ops":
        module.xla_hlo_call = _xla_hlo_call
    elif module.__name__ == "torch_neuronx":
        module.__version__ = "2.9.0+standin"
    elif module.__name__ == "neuronxcc":
        module.__version__ = "2.29.0+standin"
    if module.__name__ in EXTRA_VALUES:  # last: a harness's real values win over the CPU-mode ones
        EXTRA_VALUES[module.__name__](module)


class _NeuronClasses(types.SimpleNamespace):
    def __getattr__(self, name):
        return _AnyMeta(name, (_Any,), {"__module__": "torch.classes.neuron"})


def _fx_module() -> types.ModuleType:
    """``transformers.utils.fx`` (HFTracer, for NxD's pipeline tracing) is gone from transformers 4.57's
    import surface in a way that fails at import; NxD only imports it by name."""
    mod = types.ModuleType("transformers.utils.fx")

    class HFTracer:  # never used in CPU mode
        pass

    mod.HFTracer = HFTracer
    mod.symbolic_trace = lambda *a, **k: (_ for _ in ()).throw(NotImplementedError("fx stand-in"))
    return mod


_INSTALLED = False


def install(cpu_mode: bool = True) -> None:
    """Install the stand-ins (idempotent). ``torch_xla`` is imported first and for real: it would otherwise
    look for ``libneuronxla`` and, finding our stand-in, take this host for a Neuron one. ``cpu_mode=False`` leaves
    NxDI's CPU mode off (the graph harness in ``test/hlo`` traces NxDI's device path)."""
    global _INSTALLED
    if _INSTALLED:
        return
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    if cpu_mode:
        os.environ["NXD_CPU_MODE"] = "1"
    else:
        os.environ.pop("NXD_CPU_MODE", None)
    import torch
    import torch_xla  # noqa: F401  (real, before the libneuronxla stand-in exists)

    sys.meta_path.insert(0, _Finder())
    torch.classes.neuron = _NeuronClasses()
    try:
        import transformers.utils.fx  # noqa: F401
    except Exception:
        sys.modules["transformers.utils.fx"] = _fx_module()
    _INSTALLED = True


def installed() -> bool:
    return _INSTALLED


def add_sources() -> tuple[str, str]:
    """Put ``$NXDI_SRC`` and ``$NXD_SRC`` (the ``src/`` folders) on ``sys.path``; raises if unset/missing."""
    paths = []
    for var, pkg in (("NXDI_SRC", "neuronx_distributed_inference"), ("NXD_SRC", "neuronx_distributed")):
        p = os.environ.get(var, "")
        if not p or not os.path.isdir(os.path.join(p, pkg)):
            raise RuntimeError(f"${var} must name the {pkg} source folder's parent (its src/); got {p!r}")
        paths.append(p)
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    return paths[0], paths[1]


def missing_reason() -> str | None:
    """One line saying why neuron-cpu cannot run here, or None."""
    for var, pkg in (("NXDI_SRC", "neuronx_distributed_inference"), ("NXD_SRC", "neuronx_distributed")):
        p = os.environ.get(var, "")
        if not p:
            return f"neuron-cpu needs NxDI/NxD sources: set NXDI_SRC and NXD_SRC to their src/ folders (${var} unset)"
        if not os.path.isdir(os.path.join(p, pkg)):
            return f"${var}={p} has no {pkg}/ folder"
    try:
        import torch_xla  # noqa: F401
    except Exception as e:  # pragma: no cover
        return f"neuron-cpu needs torch-xla importable ({type(e).__name__}: {e})"
    return None


def bootstrap() -> None:
    """Sources on the path, stand-ins installed: after this, ``import neuronx_distributed_inference`` works."""
    add_sources()
    install()
