"""The worker of a sweep: it loads one model at a time, once, and computes what the sweep hands it.

Every backend runs the same :class:`Worker` — in the sweep's own process (``serial``), in a spawned
worker process (``process``) or as a Ray actor (``ray``) — so a record is computed by the same code
whatever the backend: :func:`eventkv.probes.runner.compute_record`, item ``i`` made from the run's seed
and ``i`` alone. The worker never writes a file; the sweep writes the records it returns.

A task is a :data:`Task`:

* :class:`Describe` — load the model of ``key`` (see :attr:`PlannedRun.model_key`) and return, for each
  run on it, a :class:`Described` (the run folder's identity and the model profile for its manifest) or,
  when the probe's own check of the model fails, a :class:`Failed` naming the run;
* :class:`Item` — return a :class:`Record`: the record, and the identity that lets the sweep refuse a
  record computed on another model or dtype than the folder's (e.g. a Ray node whose CPU resolves
  ``dtype: auto`` differently), and the device (provenance, for the manifest's invocation).

A user error (:class:`~eventkv.errors.EventKVError`) is returned as a :class:`Failed` rather than raised,
so it crosses process and Ray boundaries as one line. Every message is a frozen dataclass of plain
values, so it pickles for the ``process`` and ``ray`` backends.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from eventkv.errors import EventKVError
from eventkv.sweep.plan import PlannedRun

if TYPE_CHECKING:
    from eventkv.probes.base import Runtime


@dataclass(frozen=True)
class Describe:
    """Task: load the model of ``key`` (a :attr:`PlannedRun.model_key`) and describe every run on it."""

    key: tuple


@dataclass(frozen=True)
class Item:
    """Task: compute item ``index`` of run ``run`` (its position in the sweep's runs)."""

    run: int
    index: int


Task = Describe | Item
"""What a worker is handed."""


@dataclass(frozen=True)
class Described:
    """Result of a :class:`Describe`, one per run on the model: the run folder's identity (probe, record
    version, options, seed, model, weights digest, dtype) and the model profile for its manifest."""

    run: int
    identity: dict
    profile: dict


@dataclass(frozen=True)
class Record:
    """Result of an :class:`Item`: its JSON record, the identity it was computed under and the device
    (``"cpu"``, ``"cuda:0"``) it was computed on."""

    run: int
    index: int
    record: dict
    identity: dict
    device: str


@dataclass(frozen=True)
class Failed:
    """Result of a task that met a user error: the task, the run it concerns (a :class:`Describe` whose
    probe refused the model names its run; None: the task's own run or model) and the one-line message."""

    task: Task
    message: str
    run: int | None = None


Result = Described | Record | Failed
"""What a worker returns (a list of them per task)."""


class Worker:
    """Computes a sweep's tasks with ``threads`` torch CPU threads, holding one loaded model at a time.

    Args:
        runs: every run of the sweep (tasks name runs by their position in it).
        threads: torch CPU threads for this worker (``torch.set_num_threads``); float results depend on
            it in the last bits, so every worker of a sweep uses the same count.
    """

    def __init__(self, runs: Sequence[PlannedRun], threads: int) -> None:
        import torch

        torch.set_num_threads(threads)
        self.runs = tuple(runs)
        self.threads = threads
        self._key: tuple | None = None
        self._rt: Runtime | None = None
        self._probes: dict[int, object] = {}

    def runtime(self, key: tuple):
        """The Runtime of ``key``'s model, loading it (and dropping the one held before) if needed."""
        if key != self._key:
            self._rt, self._key = None, None
            gc.collect()  # free the previous model's weights before the next one loads
            run = next(r for r in self.runs if r.model_key == key)
            self._rt = run.run.load_runtime()
            self._key = key
        return self._rt

    def probe(self, n: int):
        if n not in self._probes:
            self._probes[n] = self.runs[n].make_probe()
        return self._probes[n]

    def identity(self, n: int) -> dict:
        from eventkv.probes.runner import identity

        run = self.runs[n]
        return identity(self.probe(n), run.run.model, self.runtime(run.model_key), run.run.seed)

    def execute(self, task: Task) -> list[Result]:
        """Compute one task (see the module docstring); returns a list of results."""
        from eventkv.probes.runner import compute_record, profile_dict

        try:
            if isinstance(task, Describe):
                rt = self.runtime(task.key)
                out: list[Result] = []
                for n, run in enumerate(self.runs):
                    if run.model_key == task.key:
                        try:
                            self.probe(n).check_model(rt)
                            out.append(Described(n, self.identity(n), profile_dict(rt)))
                        except EventKVError as exc:
                            out.append(Failed(task, str(exc), run=n))
                return out
            run = self.runs[task.run]
            rt = self.runtime(run.model_key)
            record = compute_record(self.probe(task.run), rt, run.run.seed, task.index)
            return [Record(task.run, task.index, record, self.identity(task.run), rt.device)]
        except EventKVError as exc:
            return [Failed(task, str(exc))]  # an option by its plan name
