"""Sources of measurements: where distmon reads each rank's local and reduced gradients.

A source (:class:`~distmon.sources.base.Source`) is built with the sums it hands each
backward's measurements to, and refuses in its constructor what it cannot measure; nothing is
installed until :meth:`install`.

==================  ===========================================================================
``models.py``       what the object handed over is (DDP, FSDP2, DeepSpeed, a pipeline stage,
                    under ``torch.compile`` or Lightning Fabric), the job's process group
``reading.py``      how it reads the layout: which parts of each reduced gradient count here
``select.py``       which source measures it; the composite and pipeline-stage sources
``base.py``         what every source is; the backward order of layers
``grad_sums.py``    one fused read of many parameters' gradients (every source's reads)
``ddp.py``          DDP: two fused reads where the backward ends (in a comm hook where needed)
``fsdp.py``         FSDP2: around its reduce-scatters and in its sharded gradients
``deepspeed.py``    a DeepSpeed engine, ZeRO 0-3: where DeepSpeed holds each gradient
``plain.py``        a module no wrapper reduces (one process, TP, a stage): when backward ends
==================  ===========================================================================

``fsdp.py`` imports FSDP2 and DTensor (about 2 s), ``deepspeed.py`` DeepSpeed (about 4 s): each
is imported only for a model of its kind, which means the job imported that library already.
"""

from __future__ import annotations

from .base import Source, first_device
from .ddp import CommHook
from .models import enclosing, is_deepspeed, is_fsdp, pipeline_stage, process_group, trained_module
from .reading import LayoutReading, read_layout
from .select import PipelineSource, source_for

__all__ = [
    "Source",
    "CommHook",
    "source_for",
    "read_layout",
    "LayoutReading",
    "process_group",
    "enclosing",
    "trained_module",
    "is_fsdp",
    "is_deepspeed",
    "first_device",
    "pipeline_stage",
    "PipelineSource",
]
