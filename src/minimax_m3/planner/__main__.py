"""``python -m minimax_m3.planner``: the same as ``minimax-m3 plan``."""

import sys

from .cli import main

sys.exit(main())
