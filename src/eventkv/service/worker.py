"""One model, many clients: every job that touches the model or writes a store runs on one worker
thread (the model and an open EventMemory are not thread-safe), fed by a bounded queue. A full queue
is refused at once (the caller answers 503 with Retry-After) instead of piling up; a queued job can
be cancelled until it starts (its client went away) and then leaves the queue at once; stopping
rejects new jobs, finishes the queued ones and closes every memory.

Queries are batched: a :class:`QueryJob` (a query on a memory, in two phases) queued behind
others is taken with them, up to ``max_batch`` at a time, and they are answered in one batched
readout (:func:`eventkv.memory.answer.answer_prepared`). Which queries a batch takes:

- the oldest first: a batch starts at the head of the queue and takes the queued queries in arrival
  order, so a query waits at most for the queries queued before it (no client is starved by another
  client's stream);
- a write is a barrier for its memory: a query queued after a job on the same memory (a write, or
  any other job) is not taken before that job, so it sees the write; a job on no memory in
  particular (creating or deleting a memory) is a barrier for every memory;
- a batch never runs a job other than queries: the jobs it passes over stay queued in order, and
  the next one starts right after the batch.

A memory deleted while jobs on it wait (:meth:`ModelWorker.deleted`, by the ``DELETE`` route's job) is
never written again by them: each job on a memory was queued for the memory of that time, so a job
queued before the deletion is refused with NotFound when its turn comes, even when a memory of the
same id was created in the meantime; a job queued after the deletion works on the new one.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from eventkv.errors import NotFound
from eventkv.wire import QueueFull, ShuttingDown

if TYPE_CHECKING:
    from eventkv.memory import EventMemory, MemoryAnswer, MemoryQuery, PreparedQuery
    from eventkv.models.profile import LoadedModel

#: each open and close of a memory is logged here at INFO, as ``memory NS/ID opened|closing at UNIX_TIME``,
#: the time taken while the store's writer lock is held (so one store's intervals never overlap across
#: processes: the Ray Serve backend's tests read them from the replicas' logs)
LOG = logging.getLogger("eventkv.service.memories")

__all__ = ["Answered", "ModelWorker", "QueryJob", "QueueFull", "ShuttingDown"]


@dataclass(frozen=True, eq=False)
class QueryJob:
    """A query on a memory: the unit :class:`ModelWorker` batches. On the worker thread, with the memory
    of ``directory`` open: ``EventMemory.prepare_query(query)`` (what it raises is this job's answer, and
    the other queries of the batch go on), one batched readout with the other prepared queries
    (:func:`eventkv.memory.answer.answer_prepared`), then ``EventMemory.finish_query(query, answers)``
    (a ``remember``'s events stored before the next job). Its future holds an :class:`Answered`.

    Example (on the worker thread, ``mem.query("Where?")`` would give the same answer)::

        QueryJob(d, MemoryQuery("Where?"))
    """

    directory: Path
    query: MemoryQuery


@dataclass
class Answered:
    """A :class:`QueryJob`'s result: one answer per plan, the memory's version when it was served, the ids
    a ``remember`` stored, and the version after them."""

    answers: list[MemoryAnswer]
    version: int
    remembered: list[str]
    version_after: int


def finish(mem: EventMemory, query: MemoryQuery, prepared: PreparedQuery, answers: list[MemoryAnswer]) -> Answered:
    """(worker thread) the query's last phase, ``mem.finish_query`` (a ``remember``'s events stored), as
    an :class:`Answered`."""
    remembered = mem.finish_query(query, answers)
    return Answered(answers, prepared.version, remembered, mem.version)


def answer_alone(lm: LoadedModel, mem: EventMemory, query: MemoryQuery) -> Answered:
    """(worker thread) ``query`` on ``mem`` read out alone (a streamed chat: its steps are not batched)."""
    from eventkv.memory import answer_prepared

    prepared = mem.prepare_query(query)
    return finish(mem, query, prepared, answer_prepared(lm, [prepared])[0])


@dataclass(eq=False)
class _Item:
    """A queued job: a plain ``job()`` or a :class:`QueryJob`; ``directory`` is the memory it works on
    (None: no memory in particular, a barrier for all), ``deletions`` how many times that memory had
    been deleted when the job was queued (:meth:`ModelWorker.deleted`)."""

    job: Callable[[], Any] | QueryJob
    future: Future
    directory: Path | None
    deletions: int = 0


class ModelWorker:
    """The one thread that runs model work and store writes, in arrival order, queries batched.

    Args:
        lm: the served model.
        max_queue: jobs waiting at most (the running ones not counted); ``submit`` beyond raises QueueFull.
        max_open: memories kept open (rows in RAM, writer lock held); the least recently used one is
            closed beyond it (reopening verifies its segments again).
        max_batch: queries answered in one batched readout at most (1: one at a time).
        max_hot: of the open memories whose stores are quantized (``rows="int8"`` / ``"int4"``), the most
            recently used ``max_hot`` keep their dequantized rows; the others keep only their packed tensors
            (:meth:`eventkv.memory.EventMemory.release_rows`) and rebuild the rows at their next use. None: every
            open memory keeps its rows.

    Attributes:
        started: jobs that began to run (each query of a batch counted). cancelled: jobs cancelled
            while queued (they never ran). batches: how many batches of each size were read out
            (``{size: count}``; a batch of queries that all failed before the readout counts too).
        opened, closed: memories opened (a store read from disk, its segments checked) and closed by the
            worker; released: times an open memory's dequantized rows were dropped (``max_hot``).
    """

    def __init__(
        self, lm: LoadedModel, max_queue: int = 64, max_open: int = 16, max_batch: int = 8, max_hot: int | None = None
    ) -> None:
        self.lm = lm
        self.max_queue = max_queue
        self.max_open = max_open
        self.max_hot = max_hot
        self.max_batch = max_batch
        self.opened = self.closed = self.released = 0
        #: the memories of the job or batch running now: never closed to make room (``max_open``) until it ends
        self._busy: set[Path] = set()
        self.started = 0
        self.cancelled = 0
        self.batches: Counter[int] = Counter()
        self._queue: deque[_Item] = deque()
        self._ready = threading.Condition()
        self._open: OrderedDict[Path, EventMemory] = OrderedDict()
        self._deletions: Counter[Path] = Counter()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="eventkv-model-worker", daemon=True)
        self._thread.start()

    def on_worker_thread(self) -> bool:
        """Whether the caller runs on the worker thread (where a job must not wait for another job)."""
        return threading.current_thread() is self._thread

    @property
    def n_open(self) -> int:
        """Memories held open now."""
        return len(self._open)

    @property
    def depth(self) -> int:
        """Jobs waiting (not counting the ones running; cancelled jobs have left the queue)."""
        with self._ready:
            return len(self._queue)

    def submit(self, job: Callable[[], Any], directory: Path | None = None) -> Future:
        """Queue ``job`` (run on the worker thread); its result or exception arrives in the future.
        ``future.cancel()`` before the job starts removes it from the queue: it never runs.
        ``directory``: the memory the job works on (queries on it queued later wait for it); None:
        a barrier for every memory.

        Raises:
            QueueFull: ``max_queue`` jobs are waiting.
            ShuttingDown: :meth:`stop` was called.
        """
        return self._enqueue(_Item(job, Future(), directory))

    def submit_query(self, query: QueryJob) -> Future:
        """Queue ``query``, to be answered in a batch with the queries queued with it (see the module
        docstring for which); its future holds an :class:`Answered` or what a phase raised, and can be
        cancelled until the query starts, as with :meth:`submit`.

        Raises:
            QueueFull, ShuttingDown: as :meth:`submit`.
        """
        return self._enqueue(_Item(query, Future(), query.directory))

    def close_memory(self, directory: Path) -> Future:
        """Queue the closing of the memory of ``directory`` (its rows dropped, its writer lock released),
        after the jobs queued on it; the future is done once it is closed (at once when the worker has
        stopped: every memory is closed then). Never refused for a full queue: closing frees the store
        for another process, which a full queue must not hold up.
        """
        item = _Item(lambda: self.release(directory), Future(), directory)
        with self._ready:
            if self._closing and not self._thread.is_alive():
                item.future.set_result(None)
                return item.future
            item.deletions = self._deletions[directory]
            self._queue.append(item)
            self._ready.notify()
        return item.future

    def _enqueue(self, item: _Item) -> Future:
        with self._ready:
            if self._closing:
                raise ShuttingDown("the server is shutting down and takes no new work: retry on its next start.")
            if len(self._queue) >= self.max_queue:
                raise QueueFull(
                    f"the model worker's queue is full ({self.max_queue} jobs waiting): retry after a moment."
                )
            if item.directory is not None:
                item.deletions = self._deletions[item.directory]
            self._queue.append(item)
            self._ready.notify()
        item.future.add_done_callback(lambda f: self._drop(item) if f.cancelled() else None)
        return item.future

    def _drop(self, item: _Item) -> None:
        with self._ready:
            try:
                self._queue.remove(item)
            except ValueError:  # already taken by the worker (which then skips it)
                return
            self.cancelled += 1

    def _take(self) -> list[_Item]:
        """(under the lock, the queue not empty) The next job, or the next batch of queries: the head
        query and the queued queries after it, oldest first, up to ``max_batch``, passing over the
        jobs that are not queries but never a query on a memory one of them works on."""
        head = self._queue.popleft()
        if not isinstance(head.job, QueryJob) or self.max_batch <= 1:
            return [head]
        batch, barred = [head], set()
        for item in list(self._queue):
            if len(batch) >= self.max_batch:
                break
            if item.directory is None:  # a job on no memory in particular: nothing after it goes first
                break
            if isinstance(item.job, QueryJob) and item.directory not in barred:
                batch.append(item)
                self._queue.remove(item)
            else:  # a write (or a query held behind one) keeps later queries on its memory behind it
                barred.add(item.directory)
        return batch

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._closing:
                    self._ready.wait()
                if not self._queue:  # closing, and every queued job done
                    break
                taken = self._take()
            items = []
            for item in taken:
                if not item.future.set_running_or_notify_cancel():  # cancelled between the take and here
                    with self._ready:
                        self.cancelled += 1
                elif item.directory is not None and item.deletions != self._deletions[item.directory]:
                    item.future.set_exception(_deleted(item.directory))  # queued for a memory since deleted
                else:
                    items.append(item)
            self.started += len(items)
            self._busy = {item.directory for item in items if item.directory is not None}
            try:
                if len(items) == 1 and not isinstance(items[0].job, QueryJob):
                    self._run_one(items[0])
                elif items:
                    self._answer(items)
            finally:
                self._busy = set()
                self._evict()
        for directory, mem in self._open.items():
            _close(directory, mem)
        self._open.clear()

    @staticmethod
    def _run_one(item: _Item) -> None:
        assert not isinstance(item.job, QueryJob)
        try:
            item.future.set_result(item.job())
        except BaseException as exc:  # handed to the caller, who maps it to an HTTP answer
            item.future.set_exception(exc)

    def _answer(self, items: list[_Item]) -> None:
        """Answer a batch of queries: each prepared on its memory, all read out together, each finished."""
        from eventkv.memory import answer_prepared

        self._prefill_together(items)
        ready: list[tuple[_Item, QueryJob, PreparedQuery]] = []
        for item in items:
            job, d = item.job, item.directory
            assert isinstance(job, QueryJob) and d is not None
            try:
                ready.append((item, job, self.memory(d).prepare_query(job.query)))
            except BaseException as exc:  # this query's answer; the others go on
                item.future.set_exception(exc)
        self.batches[len(items)] += 1
        if not ready:
            return
        try:
            answers = answer_prepared(self.lm, [p for _, _, p in ready])
        except BaseException:
            answers = None  # one query failed the batch's readout: each is read out alone, for its own answer
        for k, (item, job, p) in enumerate(ready):
            try:
                got = answers[k] if answers is not None else answer_prepared(self.lm, [p])[0]
                item.future.set_result(finish(self.memory(job.directory), job.query, p, got))
            except BaseException as exc:
                item.future.set_exception(exc)

    def _prefill_together(self, items: list[_Item]) -> None:
        """The pending events of the batch's memories prefilled in one batched forward
        (:func:`eventkv.memory.prefill_many`) when more than one memory has some; any failure here is left to each
        query's own lazy prefill, which raises it as that query's answer."""
        from eventkv.memory import prefill_many

        mems = []
        for d in dict.fromkeys(item.directory for item in items):
            try:
                mem = self.memory(d) if d is not None else None
            except Exception:  # the query on it gets the error from prepare_query
                continue
            if mem is not None and mem.pending:
                mems.append(mem)
        if len(mems) > 1:
            with contextlib.suppress(Exception):
                prefill_many(mems)

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
            NotFound: no memory in ``directory`` (deleted since the job's request found it).
            EventKVError: as :meth:`EventMemory.open`.
        """
        from eventkv.memory import EventMemory

        mem = self._open.get(directory)
        if mem is None:
            if not (directory / "manifest.json").is_file():
                raise _deleted(directory)
            mem = EventMemory.open(directory, self.lm)
            LOG.info("memory %s opened at %.6f", _name(directory), time.time())
            self.opened += 1
            self._open[directory] = mem
            self._evict()
        self._open.move_to_end(directory)
        if self.max_hot is not None:  # the quantized memories used longest ago keep their packed tensors only
            quantized = [m for m in self._open.values() if m.store.rows_format != "native"]
            for cold in quantized[: max(0, len(quantized) - self.max_hot)]:
                self.released += cold.release_rows() > 0
        return mem

    def adopt(self, directory: Path, mem: EventMemory) -> None:
        """Keep a memory created on the worker thread open for later jobs."""
        LOG.info("memory %s opened at %.6f", _name(directory), time.time())
        self._open[directory] = mem
        self._evict()

    def _evict(self) -> None:
        """Close the least recently used open memories beyond ``max_open``, but none the running job or batch
        works on (a batch on more memories than ``max_open`` holds them all until it ends)."""
        for directory in list(self._open):
            if len(self._open) <= self.max_open:
                break
            if directory not in self._busy:
                _close(directory, self._open.pop(directory))
                self.closed += 1

    def release(self, directory: Path) -> None:
        """Close the memory of ``directory`` if open (before it is removed). Worker thread only."""
        mem = self._open.pop(directory, None)
        if mem is not None:
            _close(directory, mem)
            self.closed += 1

    def deleted(self, directory: Path) -> None:
        """Record that the memory of ``directory`` was deleted (after :meth:`release` and its removal):
        the jobs on it queued before now are refused with NotFound when their turn comes, whatever
        ``directory`` holds by then (see the module docstring). Worker thread only."""
        with self._ready:
            self._deletions[directory] += 1


def _name(directory: Path) -> str:
    return f"{directory.parent.name}/{directory.name}"


def _deleted(directory: Path) -> NotFound:
    return NotFound(
        f"no memory {directory.name!r} in namespace {directory.parent.name!r}: it was deleted after this request "
        "found it; create it with POST /v1/memories."
    )


def _close(directory: Path, mem: EventMemory) -> None:
    LOG.info("memory %s closing at %.6f", _name(directory), time.time())
    mem.close()
