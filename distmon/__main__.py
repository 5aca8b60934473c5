"""``python -m distmon``: ``report LOG... -o DIR``, ``check``, ``--version`` (:mod:`distmon.report.cli`)."""

import sys

from .report import main

if __name__ == "__main__":  # not on import (the docs' API reference imports every module)
    sys.exit(main())
