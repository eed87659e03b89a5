"""What the routes are handed by FastAPI's dependency injection (``Depends``): the app's state
(:class:`ServiceState`: settings, store root, served model), the model worker, the metrics, the
request's namespace, and :class:`Jobs` (a request's way onto the worker).
:func:`eventkv.service.app.create_app` keeps the state, the worker and the metrics on ``app.state``;
a test overrides any of :func:`get_state`, :func:`get_worker`, :func:`get_metrics`, :func:`get_jobs`
with ``app.dependency_overrides``.

Layout: ``STORE/<namespace>/<memory id>/`` is one EventMemory store; a posted contract is kept as
``STORE/<namespace>/.contracts/<memory id>.json``.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable

from fastapi import Depends, Header, Request
from fastapi import Path as PathParam

from eventkv.errors import Conflict, EventKVError, Gone, NotFound, StoreDamaged
from eventkv.memory.query import MemoryQuery
from eventkv.memory.reader import read_memory
from eventkv.service import schemas
from eventkv.service.errors import ClientGone, scrub
from eventkv.service.metrics import Metrics
from eventkv.service.worker import Answered, ModelWorker, QueryJob
from eventkv.wire import DEFAULT_NAMESPACE, MAX_NAME, NAME_PATTERN, NAMESPACE_HEADER, Forbidden, check_name

CONTRACTS = ".contracts"


@dataclass
class Settings:
    """What one server serves.

    Attributes:
        lm: the loaded model (:class:`eventkv.models.LoadedModel`).
        body_timeout: seconds a request body may take to arrive (408 beyond).
        store: the root directory of every namespace's memories.
        tokens: bearer token -> the namespaces it may use (None: every namespace); empty: no auth.
        max_queue: model jobs waiting at most (503 beyond). max_body: request body bytes at most (413 beyond).
        max_open: memories kept open by the worker.
        max_batch: queries the worker answers in one batched readout at most (1: one at a time).
        max_hot: open memories of quantized stores that keep their dequantized rows (the most recently used;
            :class:`eventkv.service.worker.ModelWorker`); None: every open memory.
        reports: run folders and contract folders whose summaries and figures the inspector shows
            (``/ui/reports``; ``eventkv serve --report``).
        clean_at_start: remove what killed writes left under ``store`` when the app is created
            (:func:`eventkv.service.app.clean_leftovers`); False where other processes may be writing
            under the same root (a Ray Serve replica: the deployment cleans once, before its replicas start).
    """

    lm: Any
    store: Path
    tokens: dict[str, frozenset[str] | None] = field(default_factory=dict)
    max_queue: int = 64
    max_body: int = 4 * 1024 * 1024
    max_open: int = 16
    body_timeout: float = 30.0
    max_batch: int = 8
    max_hot: int | None = None
    reports: tuple[Path, ...] = ()
    clean_at_start: bool = True


@dataclass(frozen=True)
class ServiceState:
    """One app's state: its ``settings`` and the store ``root`` every memory lies under."""

    settings: Settings
    root: Path

    @property
    def lm(self) -> Any:
        """The served model."""
        return self.settings.lm

    @property
    def served(self) -> str | None:
        """The served model's name (None when its profile has none)."""
        return getattr(self.lm.profile, "name", None)

    def memory_dir(self, ns: str, mid: str) -> Path:
        """The directory of memory ``mid`` in namespace ``ns`` (it may not exist).

        Raises:
            OptionError: ``mid`` is not a valid name (:func:`check_name`).
        """
        return self.root / ns / check_name(mid, "memory id")

    def existing(self, ns: str, mid: str) -> Path:
        """The directory of memory ``mid`` in namespace ``ns``.

        Raises:
            NotFound: no such memory. OptionError: as :meth:`memory_dir`.
        """
        d = self.memory_dir(ns, mid)
        if not (d / "manifest.json").is_file():
            raise NotFound(f"no memory {mid!r} in namespace {ns!r}: create it with POST /v1/memories.")
        return d

    def contract(self, ns: str, mid: str) -> Path:
        """Where the posted contract of memory ``mid`` in ``ns`` is kept."""
        return self.root / ns / CONTRACTS / f"{mid}.json"

    def scrub(self, message: str) -> str:
        """``message`` without the server's paths (:func:`eventkv.service.errors.scrub`)."""
        return scrub(message, self.root)

    def memory_out(self, d: Path) -> schemas.MemoryOut:
        """The committed state of the memory in ``d``, read without the worker.

        Raises:
            StoreDamaged, EventKVError: as :func:`eventkv.memory.reader.read_memory`.
        """
        snap = read_memory(d)
        m = snap.manifest
        return schemas.MemoryOut(
            id=d.name,
            namespace=snap.namespace,
            model=m["model"],
            instruction=m["instruction"],
            rows=m.get("rows", "native"),
            version=snap.version,
            stats=snap.stats,
        )


async def get_state(request: Request) -> ServiceState:
    """The app's :class:`ServiceState` (``app.state.service``)."""
    return request.app.state.service


async def get_metrics(request: Request) -> Metrics:
    """The app's :class:`~eventkv.service.metrics.Metrics` (``app.state.metrics``)."""
    return request.app.state.metrics


async def get_worker(request: Request) -> ModelWorker | None:
    """The app's model worker (``app.state.worker``; None before the app's lifespan starts it)."""
    return request.app.state.worker


def get_namespace(
    request: Request,
    header: Annotated[
        str,
        Header(
            alias=NAMESPACE_HEADER,
            description="the namespace the request is scoped to",
            json_schema_extra={"pattern": NAME_PATTERN, "maxLength": MAX_NAME},
        ),
    ] = DEFAULT_NAMESPACE,
) -> str:
    """The request's namespace (header :data:`eventkv.wire.NAMESPACE_HEADER`).

    Raises:
        OptionError: not a valid name (422 ``invalid_option``). Forbidden: the bearer token is not
            granted it (the token's namespaces are ``scope["state"]["namespaces"]``, None: all).
    """
    ns = check_name(header, "namespace")  # the schema's pattern, checked here: 422 invalid_option
    granted = request.scope.get("state", {}).get("namespaces")
    if granted is not None and ns not in granted:
        raise Forbidden(f"this token is not granted namespace {ns!r}: use a namespace it was issued for.")
    return ns


async def disconnected(request: Request) -> None:
    """Returns once the client has gone (the body was read already: what remains is http.disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Jobs:
    """One request's way onto the model worker: :meth:`run` a job there, :meth:`on_memory` a verb
    on an open memory after its version and event checks, or :meth:`query` a query on a memory,
    batched with the queries of other requests (:class:`eventkv.service.worker.QueryJob`)."""

    def __init__(self, request: Request, worker: ModelWorker | None) -> None:
        self.request, self.worker = request, worker

    async def run(self, job: Callable[[], Any], directory: Path | None = None) -> Any:
        """``job``'s result, run on the worker (``directory``: the memory it works on, None: no memory
        in particular; :meth:`ModelWorker.submit`). Starlette does not cancel a handler whose client
        disconnected, so the wait watches the connection too: when the client goes first, a queued
        job is cancelled (it leaves the queue and never runs), a running one finishes and its result
        is dropped.

        Raises:
            QueueFull, ShuttingDown: as :meth:`ModelWorker.submit`; whatever ``job`` raises.
            ClientGone: the client disconnected first.
        """
        assert self.worker is not None  # the app's lifespan starts the worker before a request is served
        return await self._wait(self.worker.submit(job, directory))

    def start(self, job: Callable[[], Any], directory: Path | None = None) -> asyncio.Future:
        """``job`` queued on the worker as :meth:`run` queues it, without waiting: the future of its result, for
        a caller that watches the job while it runs (a streamed chat: its pieces arrive before the result).
        The caller cancels the future when its client leaves (a queued job then never runs).

        Raises:
            QueueFull, ShuttingDown: as :meth:`ModelWorker.submit`.
        """
        assert self.worker is not None  # the app's lifespan starts the worker before a request is served
        return asyncio.wrap_future(self.worker.submit(job, directory))

    async def query(self, d: Path, query: MemoryQuery) -> Answered:
        """The answers to ``query`` on the memory of ``d`` (:class:`eventkv.service.worker.QueryJob`), read out
        in a batch with the other queued queries. The wait watches the connection as :meth:`run`'s.

        Raises:
            QueueFull, ShuttingDown: as :meth:`ModelWorker.submit`; whatever the memory raised for the query.
            ClientGone: the client disconnected first.
        """
        assert self.worker is not None  # the app's lifespan starts the worker before a request is served
        return await self._wait(self.worker.submit_query(QueryJob(d, query)))

    async def _wait(self, future: Future) -> Any:
        result = asyncio.wrap_future(future)
        gone = asyncio.ensure_future(disconnected(self.request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not result.done():
                result.cancel()  # cancels the queued job; a running one cannot be, and its result is dropped
        if result.cancelled():
            raise ClientGone()
        return result.result()

    def on_memory(self, d: Path, verb: Callable, expected: int | None, eid: str | None = None) -> Any:
        """An awaitable of ``verb(memory)`` run on the worker on the memory of ``d``, after
        :meth:`open_checked` (``expected`` version, event ``eid``); later queries on ``d`` wait for it."""
        return self.run(lambda: verb(self.open_checked(d, expected, eid)), d)

    def open_checked(self, d: Path, expected: int | None, eid: str | None = None):
        """(worker thread) the memory, after the version and event checks.

        Raises:
            Conflict: the memory is not at version ``expected``. NotFound: it has no event ``eid``.
        """
        assert self.worker is not None  # the app's lifespan starts the worker before a request is served
        mem = self.worker.memory(d)
        if expected is not None and mem.version != expected:
            raise Conflict(
                f"the memory is at version {mem.version}, the write expected {expected}: read it again and retry."
            )
        if eid is not None:
            record(mem, eid)
        return mem


async def get_jobs(request: Request, worker: Annotated[ModelWorker | None, Depends(get_worker)]) -> Jobs:
    """The request's :class:`Jobs` on the app's worker."""
    return Jobs(request, worker)


# ---------------------------------------------------------------------- checks (worker thread)
def record(mem, eid: str):
    """(worker thread) the stored record of ``eid``.

    Raises:
        NotFound: the memory has no such event. StoreDamaged: its store fails its checks.
    """
    try:
        return mem.get(eid)
    except StoreDamaged:
        raise
    except EventKVError:
        raise NotFound(f"no event {eid!r} in memory {mem.directory.name!r}.") from None


def live(mem, eid: str, verb: str, *, root: bool = False) -> None:
    """(worker thread) Gone unless ``eid`` (with ``root``: also the event it patches) is live:
    a state-dependent refusal, told apart from a malformed request before the verb runs."""
    recs = [record(mem, eid)] + (mem.history(eid)[:1] if root else [])
    for rec in recs:
        if not rec.live:
            how = "forgotten" if rec.forgotten else "deleted"
            raise Gone(f"event {rec.id!r} is {how}: it cannot be {verb}; add a new event instead.")


def not_forgotten(mem, eid: str, verb: str) -> None:
    """(worker thread) Gone when ``eid`` is forgotten (NotFound when the memory has no such event)."""
    if record(mem, eid).forgotten:
        raise Gone(f"event {eid!r} is forgotten: it cannot be {verb}.")


State = Annotated[ServiceState, Depends(get_state)]
Worker = Annotated[ModelWorker | None, Depends(get_worker)]
Namespace = Annotated[str, Depends(get_namespace)]
Work = Annotated[Jobs, Depends(get_jobs)]

#: a memory id in a path (every ``/v1/memories/<id>`` path is also checked before routing:
#: :class:`eventkv.service.middleware.MemoryIdCheck`)
MemoryId = Annotated[
    str, PathParam(pattern=NAME_PATTERN, max_length=MAX_NAME, description="the memory's id in the namespace")
]
