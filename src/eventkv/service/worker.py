"""One model, many clients: every job that touches the model or writes a store runs on one worker
thread (the model and an open EventMemory are not thread-safe), fed by a bounded queue. A full queue
is refused at once (the caller answers 503 with Retry-After) instead of piling up; a queued job can
be cancelled until it starts (its client went away) and then leaves the queue at once; stopping
rejects new jobs, finishes the queued ones and closes every memory."""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from eventkv.wire import QueueFull, ShuttingDown

if TYPE_CHECKING:
    from eventkv.memory import EventMemory
    from eventkv.models.profile import LoadedModel

T = TypeVar("T")

__all__ = ["ModelWorker", "QueueFull", "ShuttingDown"]


class ModelWorker:
    """The one thread that runs model work and store writes, in arrival order.

    Args:
        lm: the served model.
        max_queue: jobs waiting at most (the running one not counted); ``submit`` beyond raises QueueFull.
        max_open: memories kept open (rows in RAM, writer lock held); the least recently used one is
            closed beyond it (reopening verifies its segments again).

    Attributes:
        started: jobs that began to run. cancelled: jobs cancelled while queued (they never ran).
    """

    def __init__(self, lm: LoadedModel, max_queue: int = 64, max_open: int = 16) -> None:
        self.lm = lm
        self.max_queue = max_queue
        self.max_open = max_open
        self.started = 0
        self.cancelled = 0
        self._queue: deque[tuple[Callable, Future]] = deque()
        self._ready = threading.Condition()
        self._open: OrderedDict[Path, EventMemory] = OrderedDict()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="eventkv-model-worker", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the one running; cancelled jobs have left the queue)."""
        with self._ready:
            return len(self._queue)

    def submit(self, job: Callable[[], T]) -> Future:
        """Queue ``job`` (run on the worker thread); its result or exception arrives in the future.
        ``future.cancel()`` before the job starts removes it from the queue: it never runs.

        Raises:
            QueueFull: ``max_queue`` jobs are waiting.
            ShuttingDown: :meth:`stop` was called.
        """
        fut: Future = Future()
        item = (job, fut)
        with self._ready:
            if self._closing:
                raise ShuttingDown("the server is shutting down and takes no new work: retry on its next start.")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(
                    f"the model worker's queue is full ({self.max_queue} jobs waiting): retry after a moment."
                )
            self._queue.append(item)
            self._ready.notify()
        fut.add_done_callback(lambda f: self._drop(item) if f.cancelled() else None)
        return fut

    def _drop(self, item) -> None:
        with self._ready:
            try:
                self._queue.remove(item)
            except ValueError:  # already taken by the worker (which then skips it)
                return
            self.cancelled += 1

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closing:
                    self._ready.wait()
                if not self._queue:  # closing, and every queued job done
                    break
                job, fut = self._queue.popleft()
            if not fut.set_running_or_notify_cancel():  # cancelled between the pop and here
                with self._ready:
                    self.cancelled += 1
                continue
            self.started += 1
            try:
                fut.set_result(job())
            except BaseException as exc:  # handed to the caller, who maps it to an HTTP answer
                fut.set_exception(exc)
        for mem in self._open.values():
            mem.close()
        self._open.clear()

    def stop(self, timeout: float | None = None) -> None:
        """Take no new jobs, finish the queued ones, close every open memory (idempotent)."""
        with self._ready:
            self._closing = True
            self._ready.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ memories (worker thread only)
    def memory(self, directory: Path) -> EventMemory:
        """The open EventMemory of ``directory`` (opened on first use). Worker thread only.

        Raises:
            EventKVError: as :meth:`EventMemory.open`.
        """
        from eventkv.memory import EventMemory

        mem = self._open.get(directory)
        if mem is None:
            mem = EventMemory.open(directory, self.lm)
            self._open[directory] = mem
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)[1].close()
        self._open.move_to_end(directory)
        return mem

    def adopt(self, directory: Path, mem: EventMemory) -> None:
        """Keep a memory created on the worker thread open for later jobs."""
        self._open[directory] = mem
        while len(self._open) > self.max_open:
            self._open.popitem(last=False)[1].close()

    def release(self, directory: Path) -> None:
        """Close the memory of ``directory`` if open (before it is removed). Worker thread only."""
        mem = self._open.pop(directory, None)
        if mem is not None:
            mem.close()
