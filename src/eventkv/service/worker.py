"""One model, many clients (issue 12, point 4): every job that touches the model or writes a store
runs on one worker thread (the model and an open EventMemory are not thread-safe), fed by a bounded
queue. A full queue is refused at once (the caller answers 503 with Retry-After) instead of piling
up; stopping rejects new jobs, finishes the queued ones and closes every memory."""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from eventkv.errors import EventKVError

if TYPE_CHECKING:
    from eventkv.memory import EventMemory
    from eventkv.models.profile import LoadedModel

T = TypeVar("T")


class QueueFull(EventKVError):
    """The worker's queue holds ``max_queue`` jobs: try again later (HTTP 503 + Retry-After)."""


class ShuttingDown(EventKVError):
    """The server is stopping and takes no new work (HTTP 503)."""


class ModelWorker:
    """The one thread that runs model work and store writes, in arrival order.

    Args:
        lm: the served model.
        max_queue: jobs waiting at most (the running one not counted); ``submit`` beyond raises QueueFull.
        max_open: memories kept open (rows in RAM, writer lock held); the least recently used one is
            closed beyond it (reopening verifies its segments again).
    """

    def __init__(self, lm: LoadedModel, max_queue: int = 64, max_open: int = 16) -> None:
        self.lm = lm
        self.max_queue = max_queue
        self.max_open = max_open
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self._open: OrderedDict[Path, EventMemory] = OrderedDict()
        self._closing = False
        self._submit_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="eventkv-model-worker", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the one running)."""
        return self._queue.qsize()

    def submit(self, job: Callable[[], T]) -> Future:
        """Queue ``job`` (run on the worker thread); its result or exception arrives in the future.

        Raises:
            QueueFull: ``max_queue`` jobs are waiting.
            ShuttingDown: :meth:`stop` was called.
        """
        fut: Future = Future()
        with self._submit_lock:
            if self._closing:
                raise ShuttingDown("the server is shutting down and takes no new work: retry on its next start.")
            try:
                self._queue.put_nowait((job, fut))
            except queue.Full:
                raise QueueFull(
                    f"the model worker's queue is full ({self.max_queue} jobs waiting): retry after a moment."
                ) from None
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            job, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(job())
            except BaseException as exc:  # handed to the caller, who maps it to an HTTP answer
                fut.set_exception(exc)
        for mem in self._open.values():
            mem.close()
        self._open.clear()

    def stop(self, timeout: float | None = None) -> None:
        """Take no new jobs, finish the queued ones, close every open memory (idempotent)."""
        with self._submit_lock:
            if not self._closing:
                self._closing = True
                self._queue.put(None)  # after every queued job; blocks only while the queue is full
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
