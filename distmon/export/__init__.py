"""From device rows to the exporters: the export thread, host snapshots, the JSONL log and slow sinks.

======================  ===========================================================================
``export_thread.py``    turns exported host copies into snapshots and hands them to the sinks
``decode.py``           one exported row -> a :class:`~distmon.snapshot.Snapshot`
``sinks.py``            exporters that may be slow or stuck, each on a thread of its own
``jsonl_log.py``        the JSONL log, one line per step (per node)
``log_schema.py``       the log's fields, their types, units and scope (docs/log-schema.md's table)
``tracker_figures.py``  a snapshot as the named figures an experiment tracker is handed
``trackers.py``         ``tracker=``: TensorBoard, W&B, MLflow, a callable; the frameworks' mailbox
======================  ===========================================================================
"""
