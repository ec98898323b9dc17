"""``python -m test.support.hlo.dry_run [--probe-chunks K,..] ARGS``: ``compile --dry-run ARGS`` (the
CLI) with the trace stand-ins (needs ``NXDI_SRC``/``NXD_SRC``). A separate process per trace: NxD's mock distributed
state and the stand-ins stay out of the test process.

The harness's own option (taken out before the CLI sees ``ARGS``; it is in the trace cache's key like the rest):

* ``--probe-chunks K,..``: each context-encoding bucket of C tokens is lowered again as the call of chunk ``k`` of a
  longer prompt (every position moved by ``k x C``) and compared with the first chunk's module (``trace_checks``:
  ``same_graph_at_chunks``), the proof that one graph serves every chunk (the start comes from ``position_ids``).

A build with on-device sampling (``--on-device-sampling``, and every ``--fused-speculation`` build, target and draft)
is traced with ``top_k_kernel_enabled=False``, and a fused build's draft with ``disable_argmax_kernel=True``: NxD's
NKI top-k and max kernels have no stand-ins, so NxD's other distributed top-k (the ``TopK`` custom call,
``scribe.TopK``) and argmax (``torch.max`` per rank) are lowered instead, as ``sampling_graph_dry_run`` does; on trn2
NxDI's defaults (the kernels) apply. The model's weights, caches and collectives do not depend on them.
"""

import sys

from . import standins_trace


def _take(argv: list[str], flag: str) -> tuple[list[str], str | None]:
    if flag not in argv:
        return argv, None
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:], argv[i + 1]


def without_sampling_kernels() -> None:
    """Every on-device sampling config the build makes (``neuron.sampling.on_device_sampling_config``, also as the
    draft's config module imported it) gets ``top_k_kernel_enabled=False``, the fused draft's neuron config
    ``disable_argmax_kernel=True`` (module docstring)."""
    from minimax_m3.neuron import config, sampling

    draft_of = config.draft_neuron_config

    def draft_neuron_config(nc):
        out = draft_of(nc)
        out.disable_argmax_kernel = True
        return out

    config.draft_neuron_config = draft_neuron_config

    make = sampling.on_device_sampling_config

    def on_device_sampling_config(*args, **kw):
        kw.setdefault("top_k_kernel_enabled", False)
        return make(*args, **kw)

    sampling.on_device_sampling_config = config.on_device_sampling_config = on_device_sampling_config


if __name__ == "__main__":
    args, chunks = _take(sys.argv[1:], "--probe-chunks")
    standins_trace.install()
    without_sampling_kernels()
    if chunks:
        standins_trace.PROBE_CHUNKS = tuple(int(k) for k in chunks.split(","))
    from minimax_m3.cli import main

    sys.exit(main(["compile", "--dry-run", *args]))
