"""pytest plugin for ``--backend neuron-cpu``: the project's NxDI port run eagerly in NxDI's own CPU mode.

Load it with ``pytest_plugins = ["test.support.neuron.cpu_plugin"]`` in ``test/conftest.py`` or
``-p test.support.neuron.cpu_plugin`` (pyproject's ``addopts`` does). With ``--backend neuron-cpu`` it

* skips every backend test with one line when ``NXDI_SRC``/``NXD_SRC`` (the NxDI and NxD ``src/`` folders)
  are not set, as in CI;
* otherwise puts those sources on ``sys.path`` and installs the Neuron SDK stand-ins (:mod:`.standins`) before
  any test imports ``minimax_m3.neuron``;
* lays out the CPU run: the TP degree is torchrun's ``WORLD_SIZE`` (1 without torchrun; gloo, float32), a free
  ``MASTER_PORT`` for the single-process group, a per-rank ``--basetemp`` under torchrun, and defaults for the
  neuron-cpu engine that the caller did not set (``tp_degree``, ``batch_size`` 4, float32);
* skips tests that need transformers' ``minimax_m3_vl`` (the golden's own grading) when the NxDI environment's
  transformers (4.57, NxDI's pin) does not have it; that grading runs in the project's own environment.

TP 2 and 4 are run by :mod:`test.neuron_cpu.test_torchrun` (``torchrun`` over this same suite, every file in one
pytest per rank). Under ``torchrun`` the plugin therefore also

* leaves the process group after each test file (NxD's model-parallel groups, then torch's default group), so every
  file starts as it would in a process of its own: NxDI's ``to_cpu()`` (and any test that joins the group itself)
  initialises the default group afresh;
* appends each test's outcome to ``$NEURON_CPU_REPORT_DIR/rank<RANK>.jsonl`` when that variable is set, for the
  launcher to grade every file on every rank.
"""

from __future__ import annotations

import json
import os
import socket

import pytest

from . import standins

_STATE: dict = {"active": False, "reason": None}
DEFAULT_BATCH = 4


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def neuron_cpu_engine_kwargs(**overrides) -> dict:
    """Keyword arguments of ``load_engine(..., backend="neuron-cpu")`` for this process's CPU layout."""
    kw = {"tp_degree": world_size(), "batch_size": DEFAULT_BATCH, "dtype": "float32"}
    kw.update(overrides)
    return kw


def tiny_target_and_draft(root):
    """``(config, checkpoint, draft)``: the speculative tests' tiny synthetic target (one KV head and index head, so
    every TP degree splits its caches) and a synthetic EAGLE3 draft for it, under ``root``."""
    from minimax_m3.checkpoint.draft import write_synthetic_draft
    from minimax_m3.checkpoint.synthetic import write_synthetic
    from minimax_m3.config import M3Config

    config = M3Config.preset("tiny").replace(num_kv_heads=1, index_heads=1)
    return config, write_synthetic(root / "tiny", config, seed=0), write_synthetic_draft(root / "draft", config, seed=1)


def nxdi_spec(ckpt, backend: str = "neuron-cpu", **fields):
    """``(spec, config)``: the resolved :class:`~minimax_m3.engine.spec.EngineSpec` of a test's NxDI build over
    ``ckpt`` and the checkpoint's parsed M3Config, for ``neuron_config(spec, **extra)`` / ``inference_config(spec,
    config, **extra)``: this process's TP, float32 and last-position logits unless ``fields`` say otherwise.
    Resolved, not validated: some tests build on purpose what the engine refuses (several decode buckets in CPU
    mode, a cache longer than the tiny model's positions)."""
    from minimax_m3.config import M3Config
    from minimax_m3.engine.spec import EngineSpec

    config = M3Config.from_pretrained(ckpt)
    fields = {"tp": world_size(), "dtype": "float32", "all_logits": False, **fields}
    return EngineSpec(str(ckpt), backend, **fields).resolve(config), config


def _backend(config) -> str | None:
    try:
        return config.getoption("--backend")
    except ValueError:
        return None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.addinivalue_line("markers", "neuron_cpu: runs the NxDI port in NxDI's CPU mode (--backend neuron-cpu)")
    if _backend(config) != "neuron-cpu":
        return
    reason = standins.missing_reason()
    if reason:
        _STATE["reason"] = reason
        return
    standins.bootstrap()
    _STATE["active"] = True
    if "WORLD_SIZE" not in os.environ:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = os.environ.get("NEURON_CPU_MASTER_PORT") or str(free_port())
    else:
        base = os.environ.get("NEURON_CPU_BASETEMP")
        if base and not config.option.basetemp:  # ranks must not share (and wipe) one basetemp
            os.makedirs(base, exist_ok=True)
            config.option.basetemp = os.path.join(base, f"rank{os.environ.get('RANK', '0')}")
    _fill_engine_defaults()


def _fill_engine_defaults() -> None:
    """Defaults for the neuron-cpu engine that the shared suite leaves to the backend (explicit kwargs win)."""
    import minimax_m3.neuron as neuron

    if getattr(neuron.load_neuron_engine, "_neuron_cpu_defaults", False):
        return
    original = neuron.load_neuron_engine

    def load_neuron_engine(spec, config, drafter=None):
        if spec.backend == "neuron-cpu":
            import dataclasses

            defaults = {"tp": world_size(), "max_batch": DEFAULT_BATCH, "dtype": "float32"}
            spec = dataclasses.replace(spec, **{k: v for k, v in defaults.items() if getattr(spec, k) is None})
        return original(spec, config, drafter)

    load_neuron_engine._neuron_cpu_defaults = True
    neuron.load_neuron_engine = load_neuron_engine


def _leave_process_group() -> None:
    """Undo what NxDI's ``to_cpu()`` set up, as a process exit would: NxD's model-parallel groups, then the default
    group. Every rank runs the same files in the same order, so all ranks leave together.

    The next ``init_process_group`` (env://) must not meet this group's rendezvous keys: torch names every default
    group ``default_pg/0`` in the store, and torchrun's agent store keeps them, so a rank could read its peer's old
    address and hang. Rank 0 therefore hosts a fresh store for the next file on a free port it hands to all ranks."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    try:
        from neuronx_distributed.parallel_layers import parallel_state
    except ImportError:
        parallel_state = None
    port = torch.tensor([free_port() if dist.get_rank() == 0 else 0])
    dist.broadcast(port, src=0)  # also: no rank tears down while another still runs the file's last collective
    if parallel_state is not None:
        parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    os.environ.update(MASTER_PORT=str(int(port)), TORCHELASTIC_USE_AGENT_STORE="False")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)  # the file's fixtures (its models) are finalised first
    finally:
        if _STATE["active"] and "WORLD_SIZE" in os.environ and (nextitem is None or nextitem.path != item.path):
            _leave_process_group()


def pytest_runtest_logreport(report):
    where = os.environ.get("NEURON_CPU_REPORT_DIR")
    if not where or "WORLD_SIZE" not in os.environ:
        return
    line = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}
    with open(os.path.join(where, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def _has_m3_transformers() -> bool:
    try:
        import transformers.models.minimax_m3_vl  # noqa: F401
        return True
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _backend(config) != "neuron-cpu":
        for item in items:
            if item.get_closest_marker("neuron_cpu"):
                item.add_marker(pytest.mark.skip(reason="NxDI CPU-mode test: run with --backend neuron-cpu"))
        return
    if not _has_m3_transformers():
        skip = pytest.mark.skip(reason="transformers here (NxDI's pin 4.57) has no minimax_m3_vl; the golden is "
                                       "graded against it in the project's own environment")
        for item in items:
            if "hf_tiny" in item.fixturenames:
                item.add_marker(skip)
    if _STATE["reason"]:
        skip = pytest.mark.skip(reason=_STATE["reason"])
        for item in items:
            if {"engine", "make_engine", "backend"} & set(item.fixturenames) or item.get_closest_marker("neuron_cpu"):
                item.add_marker(skip)


def pytest_report_header(config):
    if _backend(config) != "neuron-cpu":
        return None
    if _STATE["reason"]:
        return f"neuron-cpu: skipped ({_STATE['reason']})"
    return (f"neuron-cpu: NxDI {os.environ['NXDI_SRC']}, NxD {os.environ['NXD_SRC']}, "
            f"tp={world_size()} (gloo, float32), Neuron SDK answered by stand-ins")


@pytest.fixture(scope="session")
def neuron_cpu_tp() -> int:
    return world_size()
