"""Where a sweep's workers run: ``serial`` (one worker in this process), ``process`` (worker processes on
this machine, the cores split among them) and ``ray`` (Ray actors on a cluster), listed by name in
:data:`eventkv.options.BACKENDS`; each takes ``(runs, workers, threads, ray_address, gpus_per_worker)``
(the last two reach Ray only: the other backends take them as ``**ray`` and leave them unused).

Each backend holds :class:`~eventkv.sweep.worker.Worker` objects — each loads a model once and keeps it —
and hands them tasks from one pool, yielding each task's results as it finishes (in any order):

    >>> with open_backend("serial", runs, threads=1) as pool:  # doctest: +SKIP
    ...     for results in pool.map_unordered([Describe(key)]):
    ...         ...

Workers get their tasks as they become free (a shared queue for ``process``, Ray's
:class:`~ray.util.ActorPool` for ``ray``), so a slow item never holds up the others.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterable, Iterator, Sequence

from eventkv.errors import EventKVError, OptionError
from eventkv.options import BACKENDS
from eventkv.sweep.plan import PlannedRun
from eventkv.sweep.worker import Result, Task, Worker

DEFAULT_PROCESS_WORKERS = 2
"""Worker processes of the ``process`` backend when ``--workers`` is not given: each holds its own copy of
the model in memory, so more is not always better."""


def cores() -> int:
    """This machine's logical cores (what the ``serial`` and ``process`` backends divide)."""
    return os.cpu_count() or 1


class SerialBackend:
    """One worker in this process, with ``threads`` torch threads (default: every core); torch's thread
    count is restored on exit."""

    name = "serial"

    def __init__(
        self, runs: Sequence[PlannedRun], workers: int | None = None, threads: int | None = None, **ray
    ) -> None:
        self.runs, self.workers, self.threads = runs, 1, threads or cores()

    def __enter__(self) -> SerialBackend:
        import torch

        self._saved = torch.get_num_threads()
        self._worker: Worker | None = Worker(self.runs, self.threads)
        return self

    def __exit__(self, *exc) -> None:
        import torch

        self._worker = None
        torch.set_num_threads(self._saved)

    def map_unordered(self, tasks: Iterable[Task]) -> Iterator[list[Result]]:
        for task in tasks:
            assert self._worker is not None  # made by __enter__
            yield self._worker.execute(task)


# one Worker per worker process, made by the pool's initializer (a spawned process imports this module)
_WORKER: Worker | None = None


def _init_process(runs: Sequence[PlannedRun], threads: int) -> None:
    global _WORKER
    exit_with_parent()
    _WORKER = Worker(runs, threads)


def exit_with_parent() -> None:
    """End this spawned process when its parent ends. Why: a sweep process killed with SIGKILL cannot
    stop its pool, and each orphaned worker would keep a whole model in memory (two workers of a
    1.5B model hold over 2 GB). A daemon thread waits on the parent's sentinel (the standard
    library's handle that becomes ready when the parent exits) and then exits at once. Nothing in a
    process that is not a multiprocessing child."""
    import multiprocessing
    import multiprocessing.connection
    import threading

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="eventkv-exit-with-parent", daemon=True).start()


def _execute(task: Task) -> list[Result]:
    assert _WORKER is not None  # made by the pool's initializer, _init_process
    return _WORKER.execute(task)


class ProcessBackend:
    """``workers`` spawned worker processes on this machine (default :data:`DEFAULT_PROCESS_WORKERS`), each
    with ``threads`` torch threads (default: this machine's cores divided among the workers, at least 1),
    taking tasks from one queue."""

    name = "process"

    def __init__(
        self, runs: Sequence[PlannedRun], workers: int | None = None, threads: int | None = None, **ray
    ) -> None:
        self.runs = runs
        self.workers = workers or DEFAULT_PROCESS_WORKERS
        self.threads = threads or max(1, cores() // self.workers)

    def __enter__(self) -> ProcessBackend:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        # spawn, not fork: a forked child would inherit torch's thread pools and any loaded model
        self._pool = ProcessPoolExecutor(
            max_workers=self.workers,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_process,
            initargs=(tuple(self.runs), self.threads),
        )
        return self

    def __exit__(self, *exc) -> None:
        self._pool.shutdown(wait=exc[0] is None, cancel_futures=True)

    def map_unordered(self, tasks: Iterable[Task]) -> Iterator[list[Result]]:
        from concurrent.futures import as_completed
        from concurrent.futures.process import BrokenProcessPool

        futures = [self._pool.submit(_execute, t) for t in tasks]
        try:
            for f in as_completed(futures):
                yield f.result()
        except BrokenProcessPool:
            raise EventKVError(
                "a sweep worker process died (killed, or out of memory: each worker holds its own model): "
                "run again with fewer --workers; finished records are kept and the sweep resumes."
            ) from None
        finally:
            for f in futures:
                f.cancel()


def import_ray():
    """The ``ray`` module.

    Raises:
        EventKVError: Ray is not installed (says how to install it).
    """
    try:
        import ray
    except ImportError:
        raise EventKVError(
            "--backend ray: Ray is not installed: pip install 'eventkv[ray]' (or use --backend process)."
        ) from None
    return ray


class RayBackend:
    """``workers`` Ray actors, each reserving ``threads`` CPUs (and ``gpus`` GPUs) and running torch with
    ``threads`` threads, fed from one :class:`ray.util.ActorPool`.

    ``address`` is passed to ``ray.init`` (None: Ray's default — the cluster in ``RAY_ADDRESS``, else a new
    local instance on this machine's cores; ``auto``: the cluster started with ``ray start`` on this
    machine; ``ray://host:10001``: a remote cluster through Ray Client). When Ray is already initialised
    in this process (e.g. by the caller), that cluster is used and left running. Defaults: 1 thread per
    worker, as many workers as the cluster has CPUs for.
    """

    name = "ray"

    def __init__(
        self,
        runs: Sequence[PlannedRun],
        workers: int | None = None,
        threads: int | None = None,
        ray_address: str | None = None,
        gpus_per_worker: float = 0.0,
    ) -> None:
        address, gpus = ray_address, gpus_per_worker
        self.runs, self.workers, self.threads, self.address, self.gpus = runs, workers, threads or 1, address, gpus

    def __enter__(self) -> RayBackend:
        ray = import_ray()
        self._ray = ray
        self._started = False
        if not ray.is_initialized():
            try:
                ray.init(address=self.address)
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise EventKVError(
                    f"--ray-address {self.address!r}: cannot start or reach a Ray cluster ({exc}): give the "
                    "address of a running cluster (auto: the one `ray start --head` began on this machine), "
                    "or leave --ray-address out to start a local one."
                ) from None
            self._started = True
        try:
            self._check_capacity()
            from ray.util import ActorPool

            actor = ray.remote(Worker).options(num_cpus=self.threads, num_gpus=self.gpus)
            assert self.workers is not None  # filled by _check_capacity
            self._actors = [actor.remote(tuple(self.runs), self.threads) for _ in range(self.workers)]
            self._pool = ActorPool(self._actors)
        except BaseException:
            self._shutdown()
            raise
        return self

    def _check_capacity(self) -> None:
        """Fill the default worker count; refuse workers the cluster cannot place (they would wait forever)."""
        ray = self._ray
        total = int(ray.cluster_resources().get("CPU", 0))
        node_cpus = [int(n.get("Resources", {}).get("CPU", 0)) for n in ray.nodes() if n.get("Alive")]
        largest = max(node_cpus, default=0)
        if self.threads > largest:
            raise EventKVError(
                f"--threads {self.threads}: each Ray worker reserves that many CPUs on one node, and the largest "
                f"node of the cluster has {largest}: give --threads {max(1, largest)} or fewer."
            )
        fits = sum(c // self.threads for c in node_cpus)
        if self.workers is None:
            self.workers = max(1, fits)
        elif self.workers > fits:
            raise EventKVError(
                f"--workers {self.workers}: {self.workers} Ray workers of {self.threads} CPU(s) each do not fit the "
                f"cluster ({total} CPUs, room for {fits}): give --workers {fits} or fewer, or fewer --threads."
            )

    def __exit__(self, *exc) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        for a in getattr(self, "_actors", []):
            # why suppress: after a worker or the head died, killing an actor may fail too; the error that
            # ended the sweep is the one to report
            with contextlib.suppress(Exception):
                self._ray.kill(a)
        self._actors = []
        if self._started:
            self._ray.shutdown()

    def map_unordered(self, tasks: Iterable[Task]) -> Iterator[list[Result]]:
        """Each task's results as its actor returns them.

        Raises:
            EventKVError: an actor, its worker process or its node died, or Ray lost a result (any
                ``ray.exceptions.RayError`` but a task's own exception); one line, as the process backend's.
            Exception: what a worker's code raised other than an EventKVError (a bug), with its traceback,
                as the process backend re-raises it.
        """
        errors = self._ray.exceptions
        try:
            yield from self._pool.map_unordered(lambda actor, task: actor.execute.remote(task), list(tasks))
        except errors.RayTaskError as exc:
            if isinstance(exc.cause, EventKVError):
                raise EventKVError(str(exc.cause)) from None
            raise
        except errors.RayError as exc:  # ActorDiedError, WorkerCrashedError, NodeDiedError, OutOfMemoryError, ...
            said = " ".join(str(exc).split())[:200]
            raise EventKVError(
                f"a sweep's Ray worker died ({type(exc).__name__}: {said}): killed, out of memory, or its node "
                "left the cluster; finished records are kept: run the same command again to resume (with fewer "
                "--workers if they ran out of memory)."
            ) from None


def open_backend(
    name: str,
    runs: Sequence[PlannedRun],
    *,
    workers: int | None = None,
    threads: int | None = None,
    ray_address: str | None = None,
    gpus_per_worker: float = 0.0,
):
    """The backend called ``name`` (one of :data:`eventkv.options.BACKENDS`), to use as a context manager.
    ``ray_address`` and ``gpus_per_worker`` reach the ``ray`` backend only (the others take no cluster).

    Raises:
        EventKVError: an unknown backend.
    """
    try:
        backend = BACKENDS.get(name)
    except OptionError as exc:
        raise EventKVError(exc.for_cli()) from None
    return backend(runs, workers, threads, ray_address=ray_address, gpus_per_worker=gpus_per_worker)
