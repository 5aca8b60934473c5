#!/usr/bin/env python3
"""What does gradient monitoring cost a DDP training step? distmon against its peers, in one run.

Run it (one command; it starts ``torchrun`` itself when not already under it)::

    python benchmarks/overhead.py --quick      # ~1M, ~5M and ~2,000-tensor models (minutes)
    python benchmarks/overhead.py --full       # + ~20M and ~50M models (about 15 min on 2 CPU cores)
    python benchmarks/overhead.py --smoke      # tiny model, a few steps: does the benchmark run?
    python benchmarks/overhead.py --gpu        # one GPU: GPT-20M/124M/350M, bf16, ~5 min (issue #35)
    python benchmarks/overhead.py --gpu --sizes smoke   # the same on a tiny model (runs on CPU too)
    torchrun --nproc-per-node 2 benchmarks/overhead.py --full   # the same, launched by hand
    python benchmarks/overhead.py --render benchmarks/results/overhead.json   # README section, no run

The method, the approaches and the outputs: ``benchmarks/overheadbench/`` (this script is its
entry point; it runs from this folder, so the package imports without any path setup).
"""

import sys

from overheadbench.cli import main

if __name__ == "__main__":
    sys.exit(main())
