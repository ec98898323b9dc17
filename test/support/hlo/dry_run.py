"""``python -m test.support.hlo.dry_run ARGS``: ``compile --dry-run ARGS`` (the CLI) with the trace stand-ins (needs
``NXDI_SRC``/``NXD_SRC``). A separate process per trace: NxD's mock distributed state and the stand-ins stay out of
the test process."""

import sys

from . import standins_trace

if __name__ == "__main__":
    standins_trace.install()
    from minimax_m3.cli import main

    sys.exit(main(["compile", "--dry-run", *sys.argv[1:]]))
