"""Running a sweep: every run of a :class:`~eventkv.sweep.plan.Plan` into its own run folder, on a backend.

The sweep goes in three steps, each finished before the next begins:

1. **describe** — one task per model (model, dtype, device ...): a worker loads it and returns each run's
   identity (probe, record version, options, seed, model, weights digest, dtype) and the model profile,
   after the probe's own check of the model;
2. **open** — this process opens every run folder through the runner
   (:func:`eventkv.probes.runner.open_folder`): a folder holding records of other settings is refused
   (every refusal is reported, before any item is computed), a record cut short by a kill is dropped,
   and the items still missing are listed;
3. **items** — one task per missing ``(run, index)``, handed to whichever worker is free; this process
   appends each record to its folder's ``records.jsonl`` as it arrives (fsynced; the order of lines may
   differ from a serial run's), then adds the invocation to each manifest and renders its summary.

A record depends only on the run's settings, its seed and its index — and on the torch thread count of
the worker that computed it, in the last bits of float scores — so a sweep on any backend writes the same
records as ``serial`` when each worker has the same number of threads (see docs/sweep.md). A killed sweep
resumes per folder: run it again and only the missing items are computed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from eventkv.errors import EventKVError, OptionError
from eventkv.options import BACKENDS, check_float, check_optional_int, check_threads
from eventkv.probes.runner import (
    SUMMARY,
    add_invocation,
    append_record,
    now,
    open_folder,
    progress_bar,
    render,
)
from eventkv.sweep.backends import open_backend
from eventkv.sweep.plan import Plan
from eventkv.sweep.worker import Describe, Described, Failed, Item


@dataclass(frozen=True)
class SweepOptions:
    """How a sweep runs (what it runs is the :class:`~eventkv.sweep.plan.Plan`).

    Attributes:
        backend: ``serial`` (one worker in this process), ``process`` (worker processes on this machine)
            or ``ray`` (Ray actors; needs ``pip install 'eventkv[ray]'``).
        workers: how many workers (``serial``: 1; ``process``: default 2; ``ray``: default as many as the
            cluster has CPUs for at ``threads`` each).
        threads: torch CPU threads of each worker (default: the plan's ``threads``, else ``serial`` every
            core, ``process`` the cores divided among the workers, ``ray`` 1).
        ray_address: the Ray cluster to use (``ray`` only; see :class:`~eventkv.sweep.backends.RayBackend`).
        gpus_per_worker: GPUs each Ray actor reserves (``ray`` only; e.g. 1 for a plan with ``device: cuda``).
        progress: show a progress bar over the sweep's items.
    """

    backend: str = "serial"
    workers: int | None = None
    threads: int | None = None
    ray_address: str | None = None
    gpus_per_worker: float = 0.0
    progress: bool = False

    def validate(self) -> None:
        """Check every option before anything starts.

        Raises:
            OptionError: naming the field (the CLI prints the flag) and what is allowed.
        """
        if self.backend not in BACKENDS:
            raise BACKENDS.unknown(self.backend)
        check_optional_int("workers", self.workers, "give a whole number of workers (>= 1).")
        if self.backend == "serial" and self.workers not in (None, 1):
            raise OptionError(
                "workers",
                self.workers,
                "the serial backend runs one worker in this process: leave --workers out, or use --backend process.",
            )
        if self.backend == "ray":  # Ray workers may run on other machines: this one's cores do not bound them
            check_optional_int("threads", self.threads, "give the torch threads (and CPUs) of each Ray worker (>= 1).")
        else:
            check_threads(self.threads)
        if self.ray_address is not None and self.backend != "ray":
            raise OptionError(
                "ray_address", self.ray_address, "only the ray backend uses a cluster: add --backend ray."
            )
        if self.gpus_per_worker != 0:
            check_float("gpus_per_worker", self.gpus_per_worker, "give a number of GPUs > 0.", low=0, high=1e6)
            if self.backend != "ray":
                raise OptionError(
                    "gpus_per_worker",
                    self.gpus_per_worker,
                    "only Ray workers reserve GPUs: add --backend ray (other backends use the plan's device).",
                )


@dataclass(frozen=True)
class RunResult:
    """What a sweep did to one run folder.

    Attributes:
        out: the run folder.
        label, probe, model, seed: the run.
        items: the run's items (records now in the folder).
        computed: items computed by this sweep (the rest were there already).
    """

    out: Path
    label: str
    probe: str
    model: str
    seed: int
    items: int
    computed: int

    @property
    def summary(self) -> Path:
        return self.out / SUMMARY


def run_sweep(plan: Plan, options: SweepOptions = SweepOptions(), console=None, figure: bool = True) -> list[RunResult]:
    """Run every run of ``plan`` into its folder on ``options.backend`` (resuming each folder), then render
    each folder's summary.md (and figure.png when ``figure``).

    Returns:
        one :class:`RunResult` per run, in plan order.

    Raises:
        OptionError: a bad option of ``options``.
        EventKVError: a model that cannot be loaded or that a probe cannot run; run folders holding runs
            made with other settings (all named, before any item is computed); a probe error on an item
            (the records finished before it are kept); Ray missing or its cluster unreachable.
    """
    options.validate()
    runs = plan.runs
    threads = options.threads or plan.threads
    if options.threads is None and options.backend != "ray":
        try:  # the plan's threads bound by this machine's cores, as --threads is
            check_threads(plan.threads)
        except OptionError as exc:
            raise EventKVError(f"{plan.source}: {exc} (or give --threads)") from None
    started, t0 = now(), time.perf_counter()
    backend = open_backend(
        options.backend,
        runs,
        workers=options.workers,
        threads=threads,
        ray_address=options.ray_address,
        gpus_per_worker=options.gpus_per_worker,
    )
    with backend as pool:
        if console is not None:
            console.print(
                f"sweep: {len(runs)} runs, backend {backend.name}: {backend.workers} worker(s) x "
                f"{backend.threads} torch thread(s)",
                highlight=False,
            )
        # 1. describe: one task per model; every identity before any folder is touched
        keys = list(dict.fromkeys(r.model_key for r in runs))
        described: dict[int, tuple[dict, dict]] = {}
        errors = []
        for results in pool.map_unordered([Describe(k) for k in keys]):
            for res in results:
                if isinstance(res, Described):
                    described[res.run] = (res.identity, res.profile)
                else:
                    errors.append(_error_line(runs, res))
        if errors:
            raise EventKVError("; ".join(sorted(errors)))

        # 2. open every folder through the runner (refusals all reported, before any item runs)
        opened: dict[int, tuple[dict, list[int]]] = {}
        for n, run in enumerate(runs):
            ident, profile = described[n]
            try:
                opened[n] = open_folder(run.out, ident, profile, run.run.items)
            except EventKVError as exc:
                errors.append(str(exc))
        if errors:
            raise EventKVError(
                f"{len(errors)} of {len(runs)} run folders refused, nothing computed: " + " | ".join(errors)
            )

        # 3. items: any worker, any order; records written here as they arrive
        # grouped by model, so a worker seldom loads another model: the order records arrive in is free
        order = sorted(range(len(runs)), key=lambda n: keys.index(runs[n].model_key))
        todo = [Item(n, i) for n in order for i in opened[n][1]]
        left = {n: len(opened[n][1]) for n in opened}
        computed = dict.fromkeys(opened, 0)
        devices: dict[int, set[str]] = {n: set() for n in opened}
        finished: set[int] = set()

        def invocation(n: int, **extra) -> None:
            seen = sorted(devices[n])
            if seen:  # provenance: the device(s) this invocation's records were computed on
                extra["device"] = seen[0] if len(seen) == 1 else seen
            add_invocation(
                runs[n].out,
                opened[n][0],
                started=started,
                seconds=time.perf_counter() - t0,
                items_computed=computed[n],
                torch_threads=backend.threads,
                backend=backend.name,
                workers=backend.workers,
                **extra,
            )

        def finish(n: int) -> None:
            invocation(n)
            finished.add(n)
            render(runs[n].out, figure=figure)

        total = sum(r.run.items for r in runs)
        try:
            with progress_bar(options.progress, console) as bar:
                task = (
                    bar.add_task(f"sweep ({backend.name})", total=total, completed=total - len(todo)) if bar else None
                )
                for n in [n for n in opened if left[n] == 0]:
                    finish(n)
                for results in pool.map_unordered(todo):
                    for res in results:
                        if isinstance(res, Failed):
                            raise EventKVError(_error_line(runs, res) + " (records finished before it are kept)")
                        n = res.run
                        _check_record(runs[n].out, opened[n][0], res.index, res.record, res.identity)
                        append_record(runs[n].out, res.record)
                        computed[n] += 1
                        devices[n].add(res.device)
                        left[n] -= 1
                        if bar:
                            bar.advance(task)
                        if left[n] == 0:
                            finish(n)
        finally:
            for n in opened:  # an interrupted sweep still says, per folder, what this invocation computed
                if n not in finished and computed[n]:
                    invocation(n, interrupted=True)
    return [
        RunResult(r.out, r.label, r.probe, r.run.model, r.run.seed, opened[n][0]["items"], computed[n])
        for n, r in enumerate(runs)
    ]


def _check_record(out: Path, manifest: dict, index: int, record: dict, ident: dict) -> None:
    """Refuse a record for another item, or computed on another model or dtype than the folder's run."""
    if record.get("index") != index:
        raise EventKVError(f"{out}: item {index} came back as item {record.get('index')!r}: a probe bug; report it.")
    if ident != manifest["identity"]:
        diff = ", ".join(
            f"{k}: {manifest['identity'].get(k)!r} on the first worker, {ident.get(k)!r} here"
            for k in sorted(set(ident) | set(manifest["identity"]))
            if ident.get(k) != manifest["identity"].get(k)
        )
        raise EventKVError(
            f"{out}: item {index} was computed with other settings than the folder's run ({diff}), e.g. a node "
            "whose CPU resolves dtype auto differently: give an explicit dtype (and device) in the plan."
        )


def _error_line(runs, res: Failed) -> str:
    """One line for a worker's :class:`~eventkv.sweep.worker.Failed`, naming the run folder (and item), or
    the model when loading it failed."""
    task, message = res.task, res.message
    if res.run is not None:
        return f"{runs[res.run].out}: {message}"
    if isinstance(task, Describe):
        model = dict(task.key).get("model")
        return f"model {model!r}: {message}"
    return f"{runs[task.run].out} item {task.index}: {message}"
