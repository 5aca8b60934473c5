"""Where every gradient lives: which layer each parameter folds into, which part of each reduced
gradient each rank holds and whether it counts, read from the whole job and checked on the first step.

=================  ==============================================================================
``grouping.py``    parameters -> the layer groups the monitor reports
``placements.py``  a parameter's placements: its copies and shards, this rank's coordinates
``census.py``      the layout read from every rank at start-up; the job's norm counted by value
``verify.py``      the first-step check: distmon's reading of the layout against a direct norm
=================  ==============================================================================
"""
