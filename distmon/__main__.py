"""``python -m distmon report LOG... -o DIR`` (see :mod:`distmon.report`)."""

import sys

from .report import main

sys.exit(main())
