"""The package's one error base class.

Every error this package raises on purpose derives from :class:`M3Error`, which carries the list of problems
found (one check usually finds several: a bad config, a checkpoint with missing and truncated shards). The CLI maps
``M3Error`` to an exit code once and prints the problems, never a traceback. Subclasses keep a second, builtin base
(``ValueError``, ``RuntimeError``, ``ImportError``) so callers that caught those before still catch them.

This module is a leaf: it imports nothing from the package, so any module may import it. Besides the base, the one
error two layers raise alike: ``ServingError`` (the Neuron config and the vLLM plugin refuse a serving setup).
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["M3Error", "ServingError"]


class M3Error(Exception):
    """Something this package refuses to do, with every problem that was found.

    ``problems`` is one string or a sequence of strings. Without ``heading`` the message is the problems joined one
    per line; with it, the heading followed by the problems as an indented list.
    """

    def __init__(self, problems: str | Sequence[str], heading: str | None = None):
        self.problems: list[str] = [problems] if isinstance(problems, str) else [str(p) for p in problems]
        if heading is None:
            message = "\n".join(self.problems)
        else:
            message = heading + "".join(f"\n  - {p}" for p in self.problems)
        super().__init__(message)


class ServingError(M3Error, ValueError):
    """A configuration the Neuron port cannot serve, each problem naming the option (engine and vLLM) to change:
    raised where vllm-neuron builds the neuron config and where NxDI validates the inference config
    (``neuron.config``; also the engine's own build, whose spec has refused such values before), and where vLLM
    builds its own (``neuron.vllm.plugin.VllmConfigChecks``). Here, not in ``neuron.config``, because the vLLM hook
    runs without NxDI imported."""

    def __init__(self, problems: str | Sequence[str]):
        super().__init__(problems, heading="MiniMax-M3 cannot be served with this configuration:")
