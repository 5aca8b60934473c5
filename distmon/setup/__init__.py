"""Building a monitor: its options, what it is made of, and a start and an end on every rank or on none.

=================  ==============================================================================
``start.py``       a monitor's start, on every rank or none: read, build, agree, wire the exporters
``config.py``      the options validated (:class:`MonitorConfig`), the opt-in features they build
``build.py``       what one rank builds, in order, before and after the ranks agree
``hostinfo.py``    who each rank is: run id, host, node, local rank, GPU; exchanged once
``lifecycle.py``   all-or-nothing start-up (prepare, agree, announce) and a shutdown that never raises
``off_switch.py``  ``DISTMON_DISABLE``: off on every rank of the job or on none, agreed in one collective
``selfcheck.py``   ``python -m distmon check``: a one-process self-check of an install
=================  ==============================================================================
"""
