"""NxD / NxDI adaptations that run while NxDI compiles the application (``minimax-m3 compile``, the dry run
``compile --dry-run``): NxD's compiler work directory (:func:`compiler_workdir`), each bucket's own compiler command
after a dry run (:func:`own_commands`), and the sampling parameters of the example inputs NxD traces each bucket with
(:func:`map_example_sampling_params`; on device NxDI also warms a loaded model up with them).

Targets Neuron SDK 2.29: NxDI 0.9 (4bcdc54; ``models/application_base.py``, ``models/model_wrapper.py``) and NxD 0.18
(``trace/model_builder.py``); each function names the upstream code it works around. ``neuron/trace.py`` (the dry run,
which imports without the SDK) imports them inside its functions.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

from ..._atomic import write_atomic


@contextmanager
def compiler_workdir(path: str | Path):
    """NxD's compiler work directory set to ``path`` for the ``with`` block (the environment restored after).

    Targets NxDI 0.9 (``models/application_base.py``: ``NeuronApplicationBase.get_builder``, and
    ``models/model_wrapper.py``: ``ModelWrapper.__init__``), which read it from ``BASE_COMPILE_WORK_DIR`` only
    (default ``/tmp/nxd_model/``), with no argument."""
    old = os.environ.get("BASE_COMPILE_WORK_DIR")
    os.environ["BASE_COMPILE_WORK_DIR"] = str(path) + "/"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("BASE_COMPILE_WORK_DIR", None)
        else:
            os.environ["BASE_COMPILE_WORK_DIR"] = old


def own_commands(builder) -> int:
    """Rewrite each non-priority bucket's ``command.txt`` with its own submodel's compiler arguments; returns how
    many were rewritten.

    Targets NxD 0.18 (``trace/model_builder.py``: ``ModelBuilder.compile`` with ``dry_run=True``): the dry run writes
    them with the *priority* model's arguments, a variable left over from its priority compile (``:699`` passes
    ``compiler_args`` from ``:642-645``), while a real compile uses each submodel's own (``:720-722``: its
    ``compiler_args`` plus ``--logfile`` in its work directory). A command that does not contain the leaked
    arguments is left as NxD wrote it."""
    from neuronx_distributed.trace.model_builder import LOG_FILE_DEFAULT_NAME as LOG

    def workdir(key, i):
        return Path(builder.compiler_workdir, key, f"_tp0_bk{i}").absolute()

    prio = [(k, a) for k, a in builder.model_collection.items() if a.priority_model_idx is not None]
    if not prio:
        return 0
    key, art = prio[0]
    log = workdir(key, art.priority_model_idx) / LOG
    leaked_t, n = f"{art.compiler_args} --logfile={log} --enable-internal-neff-wrapper".split(), 0
    for key, art in builder.model_collection.items():
        for i in range(len(art.hlo_artifact_collection)):
            path = workdir(key, i) / "command.txt"
            if i == art.priority_model_idx or not path.is_file():
                continue
            tokens = path.read_text().split()
            at = next((j for j in range(len(tokens)) if tokens[j:j + len(leaked_t)] == leaked_t), None)
            if at is None:
                continue
            own = f"{art.compiler_args} --logfile={workdir(key, i) / LOG}".split()
            write_atomic(path, (" ".join(tokens[:at] + own + tokens[at + len(leaked_t):]) + "\n").encode())
            n += 1
    return n


SAMPLING_PARAMS_INPUT = 4  # the position of sampling_params in NeuronBaseModel.forward's inputs


def map_example_sampling_params(inputs, fn) -> tuple:
    """One bucket's example inputs with ``fn`` applied to their ``sampling_params``.

    Targets NxDI 0.9 (``models/model_wrapper.py``: ``ModelWrapper.input_generator`` returns each bucket's example
    inputs as a positional tuple in ``NeuronBaseModel.forward``'s order: ``input_ids, attention_mask,
    position_ids, seq_ids, sampling_params, ...``; the traced graph takes the shapes it is given)."""
    inputs = list(inputs)
    inputs[SAMPLING_PARAMS_INPUT] = fn(inputs[SAMPLING_PARAMS_INPUT])
    return tuple(inputs)
