"""The ``tracker=`` option: distmon's figures handed to TensorBoard, W&B, MLflow or a callable.

Each tracker is an adapter with :meth:`Tracker.write` (a batch of :class:`Figures`) and
:meth:`Tracker.close`, fed by a :class:`~distmon.export.sinks.SinkWorker` of its own
(``setup/build.py``): its own thread behind a bounded queue, so a slow, stuck or failing tracker
never holds the export thread or training; a full queue drops snapshots, counted in
``distmon_monitor_errors_total``, and so is every exception a tracker raises.

What a user passes (checked by :func:`check_tracker` when the monitor is built, before any
library is imported; used on global rank 0 only):

- a ``SummaryWriter`` (``torch.utils.tensorboard`` or ``tensorboardX``), a W&B run
  (``wandb.init()``'s), an MLflow run (``mlflow.start_run()``'s, or ``MlflowClient().get_run()``'s;
  written through ``MlflowClient`` at the current tracking URI): the object the user has;
- a callable ``fn(figures: dict[str, float], step: int)`` (e.g. a Lightning logger's
  ``log_metrics``);
- a name that makes one (``DISTMON_TRACKER``): ``"tensorboard"`` or ``"tensorboard:DIR"``,
  ``"wandb"`` or ``"wandb:PROJECT"``, ``"mlflow"`` or ``"mlflow:EXPERIMENT"``; distmon then
  closes (finishes, terminates) it when the monitor closes;
- a list of these.

The tracker libraries are imported only when one is used: ``import distmon`` never imports them.

Example:
    >>> from torch.utils.tensorboard import SummaryWriter                 # doctest: +SKIP
    >>> mon = distmon.GradMonitor(model, opt, tracker=SummaryWriter())    # doctest: +SKIP
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Sequence

from ..errors import ErrorCounter
from ..snapshot import Snapshot
from .sinks import SINK_CAPACITY, SinkWorker
from .tracker_figures import EVENTS, FAMILIES, STEP_KEY, Figures, figures_of, mlflow_name

__all__ = [
    "Tracker",
    "TrackerSpec",
    "TensorBoardTracker",
    "WandbTracker",
    "MlflowTracker",
    "CallableTracker",
    "Mailbox",
    "check_tracker",
    "open_trackers",
    "tracker_workers",
    "TRACKER_NAMES",
    "TRACKER_CAPACITY",
]

# What tracker= takes: a SummaryWriter, a W&B run, an MLflow run (objects of libraries distmon does
# not import, so no narrower type can name them), a callable fn(figures, step), a name that makes
# one; check_tracker says what is not.
TrackerSpec = object
# name -> (the package that makes it, what pip installs)
TRACKER_NAMES = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow-skinny"),
}
# snapshots a tracker may hold unwritten before more are dropped (counted): the JSONL log's bound
TRACKER_CAPACITY = SINK_CAPACITY
MLFLOW_BATCH = 1000  # MLflow's log_batch takes at most 1000 metrics and tags per call


class Tracker:
    """One tracker: :meth:`write` runs on its sink thread, :meth:`close` there at the end.

    ``made``: distmon made the tracker from a name, and closes it; one the user handed over is
    only flushed (the user's code goes on using it).
    """

    name = "tracker"

    def __init__(self, made: bool = False) -> None:
        self.made = made

    def __call__(self, snaps: Sequence[Snapshot]) -> None:
        """The sink: every snapshot's figures, in step order."""
        self.write([figures_of(s) for s in snaps])

    def write(self, batch: list[Figures]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    """Scalars through ``add_scalar(name, value, step, walltime)``, events through ``add_text``.

    Example:
        >>> import tempfile
        >>> from torch.utils.tensorboard import SummaryWriter
        >>> tb = TensorBoardTracker(SummaryWriter(tempfile.mkdtemp()), made=True)
        >>> tb([Snapshot(step=1, timestamp=0.0, grad_norm=0.5)]); tb.close()
    """

    name = "TensorBoard"

    def __init__(self, writer: object, made: bool = False) -> None:
        super().__init__(made)
        self.writer = writer
        self._torch = type(writer).__module__.startswith("torch.utils.tensorboard")
        if made:  # the Custom Scalars tab: one chart per family, every item a line in it
            writer.add_custom_scalars(
                {"distmon": {kind: ["Multiline", [rf"distmon\.{kind}/.*"]] for kind in FAMILIES}}
            )

    def write(self, batch: list[Figures]) -> None:
        add_scalar, add_text = self.writer.add_scalar, self.writer.add_text
        # torch's writer stores a float64 tensor summary (the scalars dashboard reads it): the
        # value is the JSONL log's exactly; another writer (tensorboardX) stores float32
        exact = {"new_style": True, "double_precision": True} if self._torch else {}
        for f in batch:
            for name, value in f.scalars.items():
                add_scalar(name, value, f.step, walltime=f.timestamp, **exact)
            if f.text:
                add_text(EVENTS, f.text, f.step, walltime=f.timestamp)
        self.writer.flush()

    def close(self) -> None:
        if self.made:
            self.writer.close()
        else:
            self.writer.flush()


class WandbTracker(Tracker):
    """One history row per step: ``{"distmon_step": step, **figures}``, events as text.

    W&B's own step counts rows and must only grow, so distmon's figures, which arrive up to
    ``export_every`` steps late, carry their step in ``distmon_step``, declared their x-axis
    (``define_metric``) for every ``distmon/`` and ``distmon.`` key.
    """

    name = "W&B"

    def __init__(self, run: object, made: bool = False) -> None:
        super().__init__(made)
        self.run = run
        run.define_metric(STEP_KEY, hidden=True)
        for glob in ("distmon/*", "distmon.*"):
            run.define_metric(glob, step_metric=STEP_KEY)

    def write(self, batch: list[Figures]) -> None:
        for f in batch:
            self.run.log({STEP_KEY: f.step, **f.logs()})

    def close(self) -> None:
        if self.made:
            self.run.finish()


class MlflowTracker(Tracker):
    """Metrics through ``MlflowClient.log_batch`` (step and timestamp each), events as tags
    ``distmon/events/<step>``; names with characters MLflow rejects have them replaced by ``_``."""

    name = "MLflow"

    def __init__(self, client: object, run_id: str, made: bool = False) -> None:
        super().__init__(made)
        self.client, self.run_id = client, run_id

    def write(self, batch: list[Figures]) -> None:
        from mlflow.entities import Metric, RunTag

        metrics, tags = [], []
        for f in batch:
            ms = int(f.timestamp * 1000)
            metrics += [Metric(mlflow_name(k), v, ms, f.step) for k, v in f.scalars.items()]
            if f.text:
                tags.append(RunTag(f"{EVENTS}/{f.step}", f.text[:5000]))
        for i in range(0, len(metrics), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + MLFLOW_BATCH])
        for i in range(0, len(tags), 100):
            self.client.log_batch(self.run_id, tags=tags[i : i + 100])

    def close(self) -> None:
        if self.made:
            self.client.set_terminated(self.run_id)


class CallableTracker(Tracker):
    """``fn(figures, step)`` per step, numbers only (a step's events are its ``distmon.anomalies/``)."""

    def __init__(self, fn: Callable[[dict[str, float], int], object]) -> None:
        super().__init__()
        self.fn = fn
        self.name = f"callable {getattr(fn, '__qualname__', type(fn).__name__)}"

    def write(self, batch: list[Figures]) -> None:
        for f in batch:
            self.fn(dict(f.scalars), f.step)


class TrackerBehind(RuntimeError):
    """A mailbox nobody empties: its figures are dropped (counted where the sink's errors are)."""


class Mailbox(Tracker):
    """Figures kept for a framework callback that hands them to the framework's loggers on the
    training thread (Lightning's and the HF Trainer's loggers are not made to be called from
    another thread); at most ``capacity`` steps waiting, more raise (counted) and are dropped.

    Example:
        >>> box = Mailbox()
        >>> box([Snapshot(step=1, timestamp=0.0, grad_norm=0.5)])
        >>> [f.step for f in box.take()], box.take()
        ([1], [])
    """

    name = "framework loggers"

    def __init__(self, capacity: int = 1024) -> None:
        super().__init__()
        self.capacity = capacity
        self.errors: ErrorCounter | None = None  # the monitor's, set when its exporters are built
        self._figures: deque[Figures] = deque()
        self._lock = threading.Lock()

    def write(self, batch: list[Figures]) -> None:
        with self._lock:
            room = self.capacity - len(self._figures)
            self._figures.extend(batch[: max(room, 0)])
        if len(batch) > room:
            raise TrackerBehind(
                f"{len(batch) - max(room, 0)} steps' figures dropped: {self.capacity} wait for the "
                "framework's loggers (the training loop no longer hands them over)"
            )

    def take(self) -> list[Figures]:
        """Every step waiting, in order (called on the training thread)."""
        with self._lock:
            out = list(self._figures)
            self._figures.clear()
        return out

    def failed(self, site: str) -> None:
        """Call from an ``except`` block where a framework's logger raised: counted, logged once."""
        if self.errors is not None:
            self.errors.record(site)


def _is_instance(obj: object, module: str, path: str) -> bool:
    """``obj`` is an instance of ``module.path``, if ``module`` is imported (an object of a library
    can only exist once its library was imported: nothing is imported here)."""
    mod = sys.modules.get(module)
    if mod is None:
        return False
    cls: object = mod
    for part in path.split("."):
        cls = getattr(cls, part, None)
        if cls is None:
            return False
    return isinstance(cls, type) and isinstance(obj, cls)


def _kind(obj: object) -> str | None:
    """Which tracker an object is (``tensorboard``, ``wandb``, ``mlflow``, ``callable``), or None."""
    if _is_instance(obj, "wandb.sdk.wandb_run", "Run"):
        return "wandb"
    if _is_instance(obj, "mlflow.entities", "Run"):
        return "mlflow"
    if type(obj).__name__ == "SummaryWriter" and hasattr(obj, "add_scalar") and hasattr(obj, "add_text"):
        return "tensorboard"
    if isinstance(obj, Tracker) or callable(obj) and not isinstance(obj, type):
        return "callable"
    return None


def _as_list(value: object) -> list[object]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def check_tracker(value: object) -> None:
    """Raise ``TypeError``/``ValueError`` naming the fix unless ``value`` is a tracker, a name that
    makes one (its library installed), or a list of them. Imports no tracker library.

    Example:
        >>> check_tracker(["tensorboard:runs/x", print])
        >>> check_tracker("neptune")   # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: distmon: tracker='neptune' is not a tracker name: use 'tensorboard[:DIR]', ...
    """
    if value is None:
        return
    for item in _as_list(value):
        if isinstance(item, str):
            kind = item.split(":", 1)[0].strip().lower()
            if kind not in TRACKER_NAMES:
                raise ValueError(
                    f"distmon: tracker={item!r} is not a tracker name: use 'tensorboard[:DIR]', "
                    "'wandb[:PROJECT]' or 'mlflow[:EXPERIMENT]', or pass the tracker object (a "
                    "SummaryWriter, a W&B run, an MLflow run) or a callable fn(figures, step)"
                )
            module, package = TRACKER_NAMES[kind]
            if importlib.util.find_spec(module) is None:
                raise ValueError(
                    f"distmon: tracker={item!r} needs {module}, which is not installed: pip install "
                    f"{package!r} (or distmon[trackers])"
                )
        elif _kind(item) is None:
            raise TypeError(
                f"distmon: tracker= got a {type(item).__module__}.{type(item).__qualname__}, which is "
                "no tracker distmon knows: pass a torch.utils.tensorboard SummaryWriter, a W&B run "
                "(wandb.init()'s), an MLflow run (mlflow.start_run()'s), a callable fn(figures, step) "
                "(e.g. a logger's log_metrics), a name ('tensorboard:DIR', 'wandb', 'mlflow'), or a "
                "list of them"
            )


def _made(name: str, run_id: str) -> Tracker:
    """The tracker a name makes (on global rank 0, at start-up: a failure fails the start)."""
    kind, _, arg = name.partition(":")
    kind, arg = kind.strip().lower(), arg.strip()
    if kind == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        return TensorBoardTracker(SummaryWriter(log_dir=arg or os.path.join("runs", run_id)), made=True)
    if kind == "wandb":
        import wandb

        run = wandb.init(project=arg or os.environ.get("WANDB_PROJECT") or "distmon", name=run_id)
        return WandbTracker(run, made=True)
    from mlflow import MlflowClient

    client = MlflowClient()
    experiment = arg or os.environ.get("MLFLOW_EXPERIMENT_NAME") or "distmon"
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
    run = client.create_run(experiment_id, run_name=run_id)
    return MlflowTracker(client, run.info.run_id, made=True)


def _adapter(obj: object) -> Tracker:
    kind = _kind(obj)
    if kind == "tensorboard":
        return TensorBoardTracker(obj)
    if kind == "wandb":
        return WandbTracker(obj)
    if kind == "mlflow":
        from mlflow import MlflowClient

        return MlflowTracker(MlflowClient(), obj.info.run_id)
    return obj if isinstance(obj, Tracker) else CallableTracker(obj)


def open_trackers(value: object, run_id: str) -> list[Tracker]:
    """The adapters of a checked ``tracker=`` value; names make their tracker (closed again if a
    later one fails).

    Example:
        >>> [t.name for t in open_trackers([print], "run-1")]
        ['callable print']
    """
    out: list[Tracker] = []
    try:
        for item in _as_list(value) if value is not None else []:
            out.append(_made(item, run_id) if isinstance(item, str) else _adapter(item))
    except BaseException:
        for tracker in out:
            if tracker.made:
                tracker.close()
        raise
    return out


def tracker_workers(trackers: Sequence[Tracker], errors: ErrorCounter) -> list[SinkWorker]:
    """A :class:`SinkWorker` per tracker (its own thread, a queue of at most
    :data:`TRACKER_CAPACITY` snapshots, drops and exceptions counted in ``errors``)."""
    workers = []
    for tracker in trackers:
        if isinstance(tracker, Mailbox):
            tracker.errors = errors
        name = f"tracker {tracker.name}"
        workers.append(SinkWorker(name, tracker, errors, close=tracker.close, capacity=TRACKER_CAPACITY))
    return workers
