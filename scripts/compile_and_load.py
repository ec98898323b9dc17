#!/usr/bin/env python
"""Compile MiniMax-M3 to NEFFs on trn2.48xlarge (TP=64, EP=64, LNC=2, explicit buckets, sharded weights saved),
load, generate one prompt and print TTFT / ITL. ``--synthetic`` does the same for a tiny model at TP=2.

Same code as ``minimax-m3 compile`` (this script runs that command, so ``--model s3://...``,
``--upload s3://...`` and ``--cache-dir`` work here too). Not yet run on Trainium (see README, "what was
verified where").

    python scripts/compile_and_load.py --model /data/MiniMax-M3 --batch 8 --seq-len 4096
    minimax-m3 generate --backend neuron --model /data/MiniMax-M3 --batch 8 --seq-len 4096 --prompt "..."  # same NEFFs
    python scripts/compile_and_load.py --synthetic
"""

import sys

from minimax_m3.cli import main

if __name__ == "__main__":
    sys.exit(main(["compile", *sys.argv[1:]]))
