"""``python -m distmon report RUN.jsonl -o DIR`` (see :mod:`distmon.report`)."""

import sys

from .report import main

sys.exit(main())
