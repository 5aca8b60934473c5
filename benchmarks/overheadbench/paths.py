"""Where the benchmarks live, and the checkout they measure."""

import os
import sys

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
REPO = os.path.dirname(BENCH_DIR)


def use_checkout() -> None:
    """This checkout's distmon and launch/model.py (the GPT) win over installed copies.

    Example:
        >>> use_checkout()
        >>> all(p in sys.path for p in (REPO, os.path.join(REPO, "launch")))
        True
    """
    for p in (os.path.join(REPO, "launch"), REPO):
        if p not in sys.path:
            sys.path.insert(0, p)
