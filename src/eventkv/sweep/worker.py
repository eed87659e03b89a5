"""The worker of a sweep: it loads one model at a time, once, and computes what the sweep hands it.

Every backend runs the same :class:`Worker` — in the sweep's own process (``serial``), in a spawned
worker process (``process``) or as a Ray actor (``ray``) — so a record is computed by the same code
whatever the backend: :func:`eventkv.probes.runner.compute_record`, item ``i`` made from the run's seed
and ``i`` alone. The worker never writes a file; the sweep writes the records it returns.

A task is a tuple:

* ``("describe", key)`` — load the model of ``key`` (see :attr:`PlannedRun.model_key`) and return, for
  each run on it, ``("described", run, identity, profile)`` (the run folder's identity and the model
  profile for its manifest) or, when the probe's own check of the model fails,
  ``("error", ("describe", run), message)``;
* ``("item", run, index)`` — return ``("record", run, index, record, identity, device)``; the
  identity lets the sweep refuse a record computed on another model or dtype than the folder's (e.g. a
  Ray node whose CPU resolves ``dtype: auto`` differently); the device (provenance) goes into the
  manifest's invocation.

A user error (:class:`~eventkv.errors.EventKVError`) is returned as ``("error", task, message)``
rather than raised, so it crosses process and Ray boundaries as one line.
"""

from __future__ import annotations

import gc
from typing import Sequence

from eventkv.errors import EventKVError
from eventkv.sweep.plan import PlannedRun


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
        self._key = None
        self._rt = None
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

    def execute(self, task: tuple) -> list[tuple]:
        """Compute one task (see the module docstring); returns a list of results."""
        from eventkv.probes.runner import compute_record, profile_dict

        try:
            if task[0] == "describe":
                rt = self.runtime(task[1])
                out = []
                for n, run in enumerate(self.runs):
                    if run.model_key == task[1]:
                        try:
                            self.probe(n).check_model(rt)
                            out.append(("described", n, self.identity(n), profile_dict(rt)))
                        except EventKVError as exc:
                            out.append(("error", ("describe", n), str(exc)))
                return out
            _, n, index = task
            run = self.runs[n]
            rt = self.runtime(run.model_key)
            record = compute_record(self.probe(n), rt, run.run.seed, index)
            return [("record", n, index, record, self.identity(n), rt.device)]
        except EventKVError as exc:
            return [("error", task, str(exc))]  # an option by its plan name
