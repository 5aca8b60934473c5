"""``python -m distmon report LOG... -o DIR``: pictures and a summary of a run's JSONL log(s).

Imports neither torch nor matplotlib until a report is drawn.

=================  ==============================================================================
``cli.py``         the command line
``log_reader.py``  reads one or several node logs as one run, in bounded memory
``log_lines.py``   what a line must be: field checks, caps, the ranks it names
``run.py``         what the report keeps of one run
``pictures.py``    the pictures and the summary
=================  ==============================================================================
"""

from .cli import main

__all__ = ["main"]
