"""``minimax-m3 compile``: the CLI face of :mod:`minimax_m3.neuron.compile` (imports NxDI only when run).

``minimax-m3 generate --backend neuron`` with the same engine options loads what this wrote: both go through
:class:`minimax_m3.engine.spec.EngineSpec`, whose ``artifact_dir()`` names the compiled directory.
"""

from __future__ import annotations


def _run(args) -> int:
    from ._sdk import import_neuron_module as _import
    from .compile import check_backend, check_dry_run, check_fit

    check_backend(args)
    if args.dry_run:
        check_dry_run(args)  # every layout problem, before the (slow) NxDI import
    check_fit(args)  # a trn2 build that does not fit HBM: refused before the SDK is imported
    _import("config")  # without the Neuron SDK: one NeuronUnavailableError saying what to install
    return _import("compile").run(args)


def register(subparsers) -> None:
    from .compile import add_args  # argparse only; compile.py imports NxDI inside run()

    p = subparsers.add_parser("compile", help="compile NEFFs for Trainium (trn2: TP=64, EP=64, LNC=2), load, "
                                              "generate and print TTFT/ITL; --synthetic for a TP=2 smoke check")
    add_args(p)
    p.set_defaults(func=_run)
