"""The HTTP service over EventMemory: a FastAPI app built by :func:`create_app`.

Layout: ``STORE/<namespace>/<memory id>/`` is one EventMemory store (``docs/memory.md``); a posted
contract is kept as ``STORE/<namespace>/.contracts/<memory id>.json``. Every request is scoped to one
namespace (header ``X-EventKV-Namespace``, default ``default``); a memory id is resolved only inside
it, so a request can never name another namespace's files, and two namespaces may use the same id.

Routes that need the model or write a store run on the one :class:`ModelWorker` (bounded queue:
503 + Retry-After when full); ``GET`` routes and ``/metrics`` read the committed state through a
read-only connection (:func:`eventkv.memory.reader.read_memory`) and never wait behind it.

A queued job whose client disconnects before it starts is cancelled (it never runs); a job already
running finishes and its answer is dropped.

Errors are JSON ``{"code", "message"}``, one code per kind (:data:`eventkv.wire.ERRORS`,
the table ``docs/service.md`` lists): 401 no or wrong token, 403 namespace not granted, 404 unknown
memory or event, 408 a body too slow, 409 ``expected_version`` behind the memory, an id taken, or a
damaged store, 410 an event deleted or forgotten, 413 body too large, 422 a request outside its
schema or one the memory refuses, 503 queue full or shutting down, 507 the store's disk is full.
The OpenAPI document declares every one of them per route, and ``/metrics`` as text.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Callable
from urllib.parse import unquote

from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from eventkv.errors import EventKVError, OptionError, StoreDamaged
from eventkv.files import out_of_space, write_json_atomic
from eventkv.memory.reader import read_memory
from eventkv.memory.records import MemoryEvent
from eventkv.memory.store import Store, remove_leftovers
from eventkv.service import schemas as s
from eventkv.service.names import MAX_NAME, NAME, NAME_PATTERN, check_name
from eventkv.service.worker import ModelWorker
from eventkv.wire import (
    DEFAULT_NAMESPACE,
    ERRORS,
    NAMESPACE_HEADER,
    Conflict,
    Forbidden,
    Gone,
    NotFound,
)

CONTRACTS = ".contracts"

#: the HTTP methods a metric names; any other method is counted as "other" (a label's values stay few)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
#: the statuses the app answers with (499: the client went away before the answer)
STATUSES = frozenset({200, 201, 499} | {status for status, _ in ERRORS.values()})

#: what each error status means, as the OpenAPI document declares it
STATUS_TEXT = {
    401: "no bearer token, or a wrong one (`unauthorized`)",
    403: "the token is not granted the namespace, or the body names another namespace (`forbidden`)",
    404: "an unknown memory, event or route (`not_found`)",
    408: "the request body did not arrive within the server's body timeout (`timeout`)",
    409: "`conflict`: expected_version behind the memory, or the id taken; `damaged`: the memory's store "
    "fails its checks",
    410: "the event is deleted or forgotten (`gone`)",
    413: "the request body is over the server's limit (`body_too_large`)",
    422: "`invalid_request`: outside the schema, or not JSON; `invalid_option`: a bad memory id, namespace "
    "or model; `refused`: the memory cannot carry out the request",
    503: "the model queue is full (`busy`), the server is stopping (`shutting_down`), or a forget is done but its "
    "bytes are still on disk behind a reader (`purge_pending`: forget the same id again); retry after Retry-After",
    507: "the store's filesystem is full (`insufficient_storage`); nothing was written",
}

MemoryId = Annotated[
    str, PathParam(pattern=NAME_PATTERN, max_length=MAX_NAME, description="the memory's id in the namespace")
]
#: an event id in a path: no ``/``, no NUL (``.`` and ``..`` travel percent-encoded, as the client sends them)
EventIdPath = Annotated[
    str, PathParam(min_length=1, max_length=s.MAX_ID, pattern=r"^[^/\x00]+$", description="an event id")
]


class _ClientGone(Exception):
    """The client disconnected while its job waited: nobody reads the answer."""


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
    """

    lm: Any
    store: Path
    tokens: dict[str, frozenset[str] | None] = field(default_factory=dict)
    max_queue: int = 64
    max_body: int = 4 * 1024 * 1024
    max_open: int = 16
    body_timeout: float = 30.0


def _error(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"code": code, "message": message}, status_code=status, headers=headers)


class BodyLimit:
    """ASGI middleware: a request body over ``max_body`` bytes gets 413 — refused by its
    Content-Length before reading, or, for a chunked body, while it is read (the body is read here,
    at most ``max_body`` bytes, and handed on whole). A body that has not fully arrived
    ``body_timeout`` seconds after the request's headers gets 408 and the connection is closed (a
    slow sender cannot hold a connection open by trickling bytes)."""

    def __init__(self, app, max_body: int, body_timeout: float = 30.0) -> None:
        self.app, self.max_body, self.body_timeout = app, max_body, body_timeout

    def too_big(self) -> JSONResponse:
        return _error(413, "body_too_large", f"the request body is over {self.max_body} bytes: send less at once.")

    def too_slow(self) -> JSONResponse:
        return _error(
            408,
            "timeout",
            f"the request body did not arrive within {self.body_timeout:g} s: send it at once, or ask for a longer "
            "--body-timeout.",
            {"Connection": "close"},
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await self.too_big()(scope, receive, send)
        messages, seen = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                while True:
                    message = await receive()
                    messages.append(message)
                    if message["type"] != "http.request":
                        break
                    seen += len(message.get("body", b""))
                    if seen > self.max_body:
                        return await self.too_big()(scope, receive, send)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await self.too_slow()(scope, receive, send)
        replay = iter(messages)

        async def buffered():
            return next(replay, None) or await receive()

        return await self.app(scope, buffered, send)


class Measure:
    """ASGI middleware (outermost, so refusals by the other middleware count too): one request
    counter and one latency histogram, labelled by the route's template (``unmatched`` when no
    route matched: never the raw path), the method (:data:`METHODS`, else ``other``) and the status
    (:data:`STATUSES`, else its class, ``4xx``); so every label has a small, fixed set of values."""

    def __init__(self, app, requests: Counter, latency: Histogram) -> None:
        self.app, self.requests, self.latency = app, requests, latency

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0, status = time.perf_counter(), 499  # no answer started: the client went away first

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            if status == 499:  # no answer was started: the server answers 500
                status = 500
            raise
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            method = scope["method"] if scope["method"] in METHODS else "other"
            code = str(status) if status in STATUSES else f"{status // 100}xx"
            self.requests.labels(route, method, code).inc()
            self.latency.labels(route, method).observe(time.perf_counter() - t0)


class MemoryIdCheck:
    """ASGI middleware: the memory id of every ``/v1/memories/<id>...`` path is checked
    (:func:`check_name`) before routing, so a bad id is 422 whatever the route or method. The id is
    the raw path's segment, percent-decoded on its own: ``..%2Fx`` is the id ``../x``, not ``..``
    followed by ``x``."""

    PREFIX = "/v1/memories/"

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(self.PREFIX):
            raw = scope.get("raw_path")
            raw = raw.decode("latin-1") if raw else scope["path"]
            segment = raw[len(self.PREFIX) :].split("/")[0] if raw.startswith(self.PREFIX) else ""
            try:
                check_name(unquote(segment.split("?")[0]), "memory id")
            except OptionError as exc:
                return await _error(422, "invalid_option", str(exc))(scope, receive, send)
        return await self.app(scope, receive, send)


class BearerAuth:
    """ASGI middleware: with tokens configured, every path but ``/health`` needs ``Authorization:
    Bearer <token>`` (compared in constant time against every token); the token's namespaces go to
    ``scope["state"]["namespaces"]`` (None = all)."""

    def __init__(self, app, tokens: dict[str, frozenset[str] | None]) -> None:
        self.app, self.tokens = app, [(t.encode(), ns) for t, ns in tokens.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.tokens or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        granted, found = None, False
        for token, ns in self.tokens:  # every token compared: the time does not tell which matched
            if hmac.compare_digest(given, token):
                granted, found = ns, True
        if not found:
            response = _error(
                401,
                "unauthorized",
                "missing or wrong bearer token: send 'Authorization: Bearer <token>'.",
                {"WWW-Authenticate": "Bearer"},
            )
            return await response(scope, receive, send)
        scope.setdefault("state", {})["namespaces"] = granted
        return await self.app(scope, receive, send)


def clean_leftovers(root: Path) -> list[str]:
    """At start-up, remove what writes killed mid-way left under the store root ``root``, in every
    namespace: staging directories of interrupted creations and manifest-less store directories
    (:func:`eventkv.memory.store.remove_leftovers`), ``.trash-*`` directories of interrupted
    deletions, and contracts whose memory does not exist. Returns the removed paths, relative
    to ``root``, sorted (each also logged)."""
    removed = []
    for ns in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        removed += [f"{ns.name}/{n}" for n in remove_leftovers(ns)]
        for trash in sorted(ns.glob(".trash-*")):
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(f"{ns.name}/{trash.name}")
        for contract in sorted((ns / CONTRACTS).glob("*.json")) if (ns / CONTRACTS).is_dir() else []:
            if not (ns / contract.stem / "manifest.json").is_file():
                contract.unlink(missing_ok=True)
                removed.append(f"{ns.name}/{CONTRACTS}/{contract.name}")
    for path in removed:
        logging.getLogger("eventkv.service").warning("removed %s: left by a write that was killed mid-way", path)
    return sorted(removed)


def create_app(settings: Settings) -> FastAPI:
    """The service's FastAPI app over ``settings`` (the worker starts with the app and stops with
    its lifespan: queued work finishes, every memory is closed)."""
    from contextlib import asynccontextmanager

    root = Path(settings.store)
    root.mkdir(parents=True, exist_ok=True)
    clean_leftovers(root)
    lm = settings.lm
    worker: ModelWorker | None = None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        nonlocal worker
        worker = ModelWorker(lm, settings.max_queue, settings.max_open)
        app.state.worker = worker
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    app = FastAPI(
        title="eventkv memory service",
        version="1",
        description="EventMemory over HTTP: one model, many memories, one namespace per request.",
        lifespan=lifespan,
    )
    registry = CollectorRegistry()  # the server-wide series: no namespace or memory in any label
    requests = Counter(
        "eventkv_requests",
        "HTTP requests by route template, method and status",
        ["route", "method", "status"],
        registry=registry,
    )
    latency = Histogram(
        "eventkv_request_seconds",
        "HTTP request latency by route template and method (seconds)",
        ["route", "method"],
        registry=registry,
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    )
    depth = Gauge("eventkv_queue_depth", "model jobs waiting", registry=registry)
    depth.set_function(lambda: worker.depth if worker is not None else 0)

    class Jobs:
        def collect(self):
            jobs = CounterMetricFamily(
                "eventkv_jobs", "model jobs by outcome: started, or cancelled while queued", labels=["outcome"]
            )
            jobs.add_metric(["started"], worker.started if worker is not None else 0)
            jobs.add_metric(["cancelled"], worker.cancelled if worker is not None else 0)
            yield jobs

    registry.register(Jobs())

    class MemorySizes:
        """The per-memory series of the namespaces a token is granted (``granted`` None: every one).
        Labels name only memories that exist (a directory with a manifest, under a valid name); a
        memory whose store cannot be read is left out and counted in ``eventkv_memories_damaged``,
        so one damaged memory never fails the whole answer."""

        def __init__(self, granted: frozenset[str] | None) -> None:
            self.granted = granted

        def collect(self):
            rows = GaugeMetricFamily(
                "eventkv_memory_rows", "rows of the stored history", labels=["namespace", "memory"]
            )
            size = GaugeMetricFamily("eventkv_memory_bytes", "bytes on disk", labels=["namespace", "memory"])
            damaged = GaugeMetricFamily(
                "eventkv_memories_damaged", "memories whose store fails its checks", labels=["namespace"]
            )
            for nsdir in sorted(root.iterdir()):
                ns = nsdir.name
                if (
                    not nsdir.is_dir()
                    or not NAME.fullmatch(ns)
                    or (self.granted is not None and ns not in self.granted)
                ):
                    continue
                bad = 0
                for d in sorted(nsdir.iterdir()):
                    if not NAME.fullmatch(d.name) or not (d / "manifest.json").is_file():
                        continue
                    try:
                        snap = read_memory(d)
                    except Exception:  # StoreDamaged, or any other failure: never every memory's metrics
                        bad += (d / "manifest.json").is_file()  # not when it was deleted meanwhile
                        continue
                    rows.add_metric([ns, d.name], snap.stats.rows)
                    size.add_metric([ns, d.name], snap.stats.bytes_on_disk)
                if bad:
                    damaged.add_metric([ns], bad)
            yield rows
            yield size
            yield damaged

    app.add_middleware(MemoryIdCheck)
    app.add_middleware(BodyLimit, max_body=settings.max_body, body_timeout=settings.body_timeout)
    app.add_middleware(BearerAuth, tokens=settings.tokens)
    app.add_middleware(Measure, requests=requests, latency=latency)

    # ------------------------------------------------------------------ errors
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors()[:5]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{loc or 'body'}: {e.get('msg')}")
        return _error(422, "invalid_request", "; ".join(parts) + " (see /docs for the request schemas).")

    def scrub(message: str) -> str:
        """The message without the server's paths (a client knows its memories by id)."""
        for prefix in sorted({str(root.resolve()), str(root)}, key=len, reverse=True):
            message = message.replace(prefix + os.sep, "").replace(prefix, "<store>")
        return message

    @app.exception_handler(EventKVError)
    async def refused(request: Request, exc: EventKVError):
        code = next(
            (c for c, (_, kind) in ERRORS.items() if isinstance(exc, kind)),
            "invalid_option" if isinstance(exc, OptionError) else "refused",
        )
        headers = {"Retry-After": "1"} if ERRORS[code][0] == 503 else None
        return _error(ERRORS[code][0], code, scrub(str(exc)), headers)

    @app.exception_handler(_ClientGone)
    async def client_gone(request: Request, exc: _ClientGone):
        return Response(status_code=499)  # nobody reads it; the metrics count it as 499

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 404:
            return _error(404, "not_found", f"no route {request.method} {request.url.path}: see /docs for the routes.")
        if exc.status_code == 405:
            # Starlette's Allow names the methods of the first route whose path matched; a path can have
            # several routes (GET and POST /v1/memories): name every method of every route that matches
            allowed = set()
            for route in app.router.routes:
                match, _ = route.matches(request.scope)
                if match is not Match.NONE:
                    allowed |= getattr(route, "methods", None) or set()
            allow = ", ".join(sorted(allowed))
            return _error(
                405,
                "method_not_allowed",
                f"{request.method} is not a method of this route: use {allow}.",
                {"Allow": allow},
            )
        if exc.status_code == 400:  # the body could not be parsed (not UTF-8, not JSON)
            return _error(422, "invalid_request", "the request body is not valid JSON: send a JSON body (see /docs).")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return _error(exc.status_code, "invalid_request", message, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):  # a bug in eventkv, never the caller's input
        return _error(500, "internal", f"internal error ({type(exc).__name__}): please report it.")

    # ------------------------------------------------------------------ scope and helpers
    def namespace(
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
        ns = check_name(header, "namespace")  # the schema's pattern, checked here: 422 invalid_option
        granted = request.scope.get("state", {}).get("namespaces")
        if granted is not None and ns not in granted:
            raise Forbidden(f"this token is not granted namespace {ns!r}: use a namespace it was issued for.")
        return ns

    def memory_dir(ns: str, mid: str) -> Path:
        return root / ns / check_name(mid, "memory id")

    def existing(ns: str, mid: str) -> Path:
        d = memory_dir(ns, mid)
        if not (d / "manifest.json").is_file():
            raise NotFound(f"no memory {mid!r} in namespace {ns!r}: create it with POST /v1/memories.")
        return d

    def check_event_id(eid: str) -> str:
        if len(eid) > s.MAX_ID or "\x00" in eid:
            raise OptionError("event id", eid[:80], f"give an event id of at most {s.MAX_ID} characters, no NUL.")
        return eid

    async def disconnected(request: Request) -> None:
        """Returns once the client has gone (the body was read already: what remains is http.disconnect)."""
        while (await request.receive())["type"] != "http.disconnect":
            pass

    async def on_worker(request: Request, job: Callable[[], Any]) -> Any:
        """``job``'s result, run on the worker. Starlette does not cancel a handler whose client
        disconnected, so the wait watches the connection too: when the client goes first, a queued
        job is cancelled (it leaves the queue and never runs), a running one finishes and its result
        is dropped.

        Raises:
            QueueFull, ShuttingDown: as :meth:`ModelWorker.submit`; whatever ``job`` raises.
        """
        result = asyncio.wrap_future(worker.submit(job))
        gone = asyncio.ensure_future(disconnected(request))
        try:
            await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not result.done():
                result.cancel()  # cancels the queued job; a running one cannot be, and its result is dropped
        if result.cancelled():
            raise _ClientGone()
        return result.result()

    def open_checked(d: Path, expected: int | None, eid: str | None = None):
        """(worker thread) the memory, after the version and event checks."""
        mem = worker.memory(d)
        if expected is not None and mem.version != expected:
            raise Conflict(
                f"the memory is at version {mem.version}, the write expected {expected}: read it again and retry."
            )
        if eid is not None:
            record(mem, eid)
        return mem

    def record(mem, eid: str):
        """(worker thread) the stored record of ``eid``; NotFound when the memory has no such event."""
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
        if record(mem, eid).forgotten:
            raise Gone(f"event {eid!r} is forgotten: it cannot be {verb}.")

    def untaken(mem, ids) -> None:
        """(worker thread) Conflict when a given event id is taken (forgotten ids stay taken)."""
        for eid in ids:
            try:
                mem.get(eid)
            except StoreDamaged:
                raise
            except EventKVError:
                continue
            raise Conflict(f"event id {eid!r} is taken in memory {mem.directory.name!r}: give another id, or none.")

    def memory_out(d: Path) -> s.MemoryOut:
        snap = read_memory(d)
        m = snap.manifest
        return s.MemoryOut(
            id=d.name,
            namespace=snap.namespace,
            model=m["model"],
            instruction=m["instruction"],
            version=snap.version,
            stats=snap.stats,
        )

    # ------------------------------------------------------------------ routes
    def errors(*statuses: int, auth: bool = True) -> dict:
        """The OpenAPI ``responses`` of a route: each status with the error body (and its headers),
        plus those of every route: 408 and 413 (the body middleware), 401 with a token file (unless
        ``auth`` is False: /health needs no token)."""
        out = {}
        for status in sorted({408, 413, *statuses} | ({401} if settings.tokens and auth else set())):
            out[status] = {"model": s.ErrorOut, "description": STATUS_TEXT[status]}
            if status == 503:
                out[status]["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
            if status == 401:
                out[status]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
        return out

    SCOPED = (403, 422)  # every route with a namespace: not granted, a bad header
    MEMORY = (*SCOPED, 404, 409)  # and a memory id: unknown, damaged
    QUEUED = (*MEMORY, 503, 507)  # and model work: queue full, a full disk (a query's lazy prefill writes)

    @app.get("/health", response_model=s.HealthOut, responses=errors(auth=False))
    def health():
        return s.HealthOut(
            status="ok", model=getattr(lm.profile, "name", "?"), queue_depth=worker.depth if worker else 0
        )

    @app.get("/metrics", responses=errors())
    def metrics(request: Request):
        """Prometheus text: the server-wide series, and the per-memory series of the namespaces the
        token is granted (every namespace without a token file or with an unrestricted token)."""
        granted = request.scope.get("state", {}).get("namespaces")
        text = generate_latest(registry) + generate_latest(MemorySizes(granted))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/memories", status_code=201, response_model=s.MemoryOut, responses=errors(*SCOPED, 409, 503, 507))
    async def create_memory(body: s.CreateMemory, request: Request, ns: str = Depends(namespace)):
        from eventkv.memory import EventMemory

        if body.namespace is not None and body.namespace != ns:
            raise Forbidden(
                f"the body names namespace {body.namespace!r} but the request is scoped to {ns!r} "
                f"(header {NAMESPACE_HEADER}): send the same, or leave namespace out."
            )
        served = getattr(lm.profile, "name", None)
        if body.model is not None and body.model != served:
            raise OptionError(
                "model", body.model, f"this server serves {served!r}: create the memory on a server of that model."
            )
        mid = body.id or uuid.uuid4().hex[:16]
        d = memory_dir(ns, mid)
        contract_path = None

        def job():
            nonlocal contract_path
            remove_leftovers(d.parent, mid)  # what a creation killed mid-way left: the id is free again
            if d.exists():
                raise Conflict(f"memory {mid!r} already exists in namespace {ns!r}: pick another id.")
            if body.contract is not None:
                cdir = root / ns / CONTRACTS
                cdir.mkdir(parents=True, exist_ok=True)
                contract_path = cdir / f"{mid}.json"
                with out_of_space(cdir, f"the contract of memory {mid!r}"):
                    write_json_atomic(contract_path, body.contract, indent=None, newline=False, mode=0o600)
            try:
                # atomic: built aside and renamed into place, so d is absent or complete
                mem = EventMemory.create(d, lm, namespace=ns, instruction=body.instruction, contract=contract_path)
            except BaseException:
                if contract_path is not None:
                    contract_path.unlink(missing_ok=True)
                raise
            worker.adopt(d, mem)

        await on_worker(request, job)
        return memory_out(d)

    @app.get("/v1/memories", response_model=list[s.MemoryOut | s.DamagedMemoryOut], responses=errors(*SCOPED))
    def list_memories(ns: str = Depends(namespace)):
        base = root / ns
        dirs = sorted(p for p in base.iterdir() if not p.name.startswith(".")) if base.is_dir() else []
        out: list[s.MemoryOut | s.DamagedMemoryOut] = []
        for d in dirs:
            if not (d / "manifest.json").is_file():
                continue
            try:
                out.append(memory_out(d))
            except StoreDamaged as exc:  # that memory alone: the others are listed as usual
                out.append(s.DamagedMemoryOut(id=d.name, namespace=ns, damaged=scrub(str(exc))))
            except EventKVError:
                if (d / "manifest.json").is_file():
                    raise
                # deleted while the namespace was listed: no longer one of its memories
        return out

    @app.get("/v1/memories/{mid}", response_model=s.MemoryOut, responses=errors(*MEMORY))
    def get_memory(mid: MemoryId, ns: str = Depends(namespace)):
        return memory_out(existing(ns, mid))

    @app.delete("/v1/memories/{mid}", response_model=s.WriteOut, responses=errors(*QUEUED))
    async def delete_memory(
        mid: MemoryId,
        request: Request,
        ns: str = Depends(namespace),
        expected_version: Annotated[int | None, Query(ge=0, description="the version this write expects")] = None,
    ):
        d = existing(ns, mid)

        def job():
            try:
                mem = open_checked(d, expected_version)
            except StoreDamaged:
                # deleting is the documented way out of a damaged memory, so it is removed without
                # reading its state: it has no version to trust (answered as 0), and expected_version
                # cannot be checked against one; its writer lock is held while it goes
                worker.release(d)
                with contextlib.closing(Store.lock(d)):
                    remove(d)
                return 0
            version = mem.version
            worker.release(d)
            remove(d)
            return version

        def remove(d: Path) -> None:
            trash = root / ns / f".trash-{mid}-{uuid.uuid4().hex[:8]}"
            d.rename(trash)  # one step: the memory is gone for every reader at once
            shutil.rmtree(trash, ignore_errors=True)
            (root / ns / CONTRACTS / f"{mid}.json").unlink(missing_ok=True)

        return s.WriteOut(version=await on_worker(request, job))

    @app.post("/v1/memories/{mid}/events", status_code=201, response_model=s.WriteOut, responses=errors(*QUEUED))
    async def add_events(mid: MemoryId, body: s.AddEvents, request: Request, ns: str = Depends(namespace)):
        d = existing(ns, mid)
        events = [MemoryEvent(e.text, e.role, e.id, tuple(e.tags), e.budget, e.kind) for e in body.events]

        def job():
            mem = open_checked(d, body.expected_version)
            untaken(mem, [e.id for e in events if e.id is not None])
            added = mem.add(events, prefill=body.prefill)
            return s.WriteOut(version=mem.version, added=added)

        return await on_worker(request, job)

    @app.get("/v1/memories/{mid}/events", response_model=list[s.RecordOut], responses=errors(*MEMORY))
    def list_events(
        mid: MemoryId, include_superseded: bool = False, include_deleted: bool = False, ns: str = Depends(namespace)
    ):
        table = read_memory(existing(ns, mid)).table
        return table.list(include_superseded, include_deleted)

    @app.get("/v1/memories/{mid}/view", response_model=list[str], responses=errors(*MEMORY))
    def view_ids(mid: MemoryId, ns: str = Depends(namespace)):
        return read_memory(existing(ns, mid)).table.view_ids()

    def lookup(ns: str, mid: str, eid: str, what: Callable):
        table = read_memory(existing(ns, mid)).table
        check_event_id(eid)
        try:
            return what(table)
        except StoreDamaged:
            raise
        except EventKVError:
            raise NotFound(f"no event {eid!r} in memory {mid!r}.") from None

    @app.get("/v1/memories/{mid}/events/{eid}", response_model=s.RecordOut, responses=errors(*MEMORY))
    def get_event(mid: MemoryId, eid: EventIdPath, ns: str = Depends(namespace)):
        return lookup(ns, mid, eid, lambda t: t.lookup(eid))

    @app.get("/v1/memories/{mid}/events/{eid}/history", response_model=list[s.RecordOut], responses=errors(*MEMORY))
    def event_history(mid: MemoryId, eid: EventIdPath, ns: str = Depends(namespace)):
        return lookup(ns, mid, eid, lambda t: t.history(eid))

    def event_write(request: Request, verb: Callable, body: s.Write, ns: str, mid: str, eid: str):
        d = existing(ns, mid)
        check_event_id(eid)

        def job():
            mem = open_checked(d, body.expected_version, eid)
            return verb(mem)

        return on_worker(request, job)

    EVENT = errors(*QUEUED, 410)

    @app.post("/v1/memories/{mid}/events/{eid}/update", status_code=201, response_model=s.WriteOut, responses=EVENT)
    async def update_event(
        mid: MemoryId, eid: EventIdPath, body: s.UpdateEvent, request: Request, ns: str = Depends(namespace)
    ):
        def verb(mem):
            live(mem, eid, "updated", root=True)
            a = mem.update(eid, body.text, prefill=body.prefill)
            return s.WriteOut(version=mem.version, added=[a])

        return await event_write(request, verb, body, ns, mid, eid)

    @app.post("/v1/memories/{mid}/events/{eid}/delete", response_model=s.WriteOut, responses=EVENT)
    async def delete_event(
        mid: MemoryId, eid: EventIdPath, request: Request, body: s.Write | None = None, ns: str = Depends(namespace)
    ):
        def verb(mem):
            live(mem, eid, "deleted again")
            mem.delete(eid)
            return s.WriteOut(version=mem.version)

        return await event_write(request, verb, body or s.Write(), ns, mid, eid)

    @app.post("/v1/memories/{mid}/events/{eid}/forget", response_model=s.WriteOut, responses=EVENT)
    async def forget_event(
        mid: MemoryId, eid: EventIdPath, request: Request, body: s.Write | None = None, ns: str = Depends(namespace)
    ):
        def verb(mem):
            if not mem.store.purge_pending:  # forgetting again completes a pending purge (see purge_pending)
                not_forgotten(mem, eid, "forgotten again")
            rows = mem.forget(eid)
            return s.WriteOut(version=mem.version, rows=rows)

        return await event_write(request, verb, body or s.Write(), ns, mid, eid)

    @app.post("/v1/memories/{mid}/events/{eid}/pin", response_model=s.WriteOut, responses=EVENT)
    async def pin_event(
        mid: MemoryId, eid: EventIdPath, request: Request, body: s.PinEvent | None = None, ns: str = Depends(namespace)
    ):
        body = body or s.PinEvent()

        def verb(mem):
            if body.pinned:
                live(mem, eid, "pinned", root=True)
            mem.pin(eid, body.pinned)
            return s.WriteOut(version=mem.version)

        return await event_write(request, verb, body, ns, mid, eid)

    def memory_write(request: Request, verb: Callable, expected: int | None, ns: str, mid: str):
        d = existing(ns, mid)
        return on_worker(request, lambda: verb(open_checked(d, expected)))

    @app.post("/v1/memories/{mid}/prefill", response_model=s.WriteOut, responses=errors(*QUEUED))
    async def prefill(mid: MemoryId, request: Request, body: s.Write | None = None, ns: str = Depends(namespace)):
        body = body or s.Write()

        def verb(mem):
            rows = mem.prefill()
            return s.WriteOut(version=mem.version, rows=rows)

        return await memory_write(request, verb, body.expected_version, ns, mid)

    @app.post("/v1/memories/{mid}/rebase", response_model=s.WriteOut, responses=errors(*QUEUED))
    async def rebase(mid: MemoryId, request: Request, body: s.Write | None = None, ns: str = Depends(namespace)):
        body = body or s.Write()

        def verb(mem):
            rows = mem.rebase()
            return s.WriteOut(version=mem.version, rows=rows)

        return await memory_write(request, verb, body.expected_version, ns, mid)

    def served_ids(mem, ids) -> None:
        """(worker thread) every id of an explicit served set is an event of the memory, not forgotten."""
        if isinstance(ids, list):
            for eid in ids:
                not_forgotten(mem, eid, "served (it has no rows)")

    @app.post(
        "/v1/memories/{mid}/carriers", status_code=201, response_model=s.CarrierOut, responses=errors(*QUEUED, 410)
    )
    async def carrier(mid: MemoryId, body: s.CarrierIn, request: Request, ns: str = Depends(namespace)):
        def verb(mem):
            for sid in body.sources:
                live(mem, sid, "a carrier's source", root=True)
            r = mem.carrier(body.sources, body.subject, body.kind, prefill=body.prefill)
            return s.CarrierOut(
                kind=r.kind,
                added=r.added,
                pinned=list(r.pinned),
                reason=r.reason,
                version=mem.version,
            )

        return await memory_write(request, verb, body.expected_version, ns, mid)

    @app.post("/v1/memories/{mid}/select", response_model=list[str], responses=errors(*QUEUED))
    async def select(mid: MemoryId, body: s.SelectIn, request: Request, ns: str = Depends(namespace)):
        return await memory_write(
            request, lambda mem: mem.select(body.question, body.k, body.budget_rows), None, ns, mid
        )

    @app.post("/v1/memories/{mid}/query", response_model=s.AnswerOut, responses=errors(*QUEUED, 410))
    async def query(mid: MemoryId, body: s.QueryIn, request: Request, ns: str = Depends(namespace)):
        def verb(mem):
            served_ids(mem, body.select)
            if body.select in (None, "view", "all") and not mem.view_ids():
                if body.select != "all" or not mem.list(include_superseded=True, include_deleted=True):
                    raise Conflict(f"memory {mid!r} has no live events to serve: add some first.")
            a = mem.query(
                body.question,
                select=body.select,
                k=body.k,
                mode=body.mode,
                candidates=body.candidates,
                max_new_tokens=body.max_new_tokens,
                budget_rows=body.budget_rows,
            )
            return s.AnswerOut(
                text=a.text,
                tokens=list(a.generation.tokens),
                stopped=a.generation.stopped,
                candidates=[
                    s.CandidateOut(
                        text=c.text,
                        tokens=list(c.tokens),
                        logprob=c.logprob,
                        token_logprobs=list(c.token_logprobs),
                        prob=c.prob,
                    )
                    for c in a.candidates
                ],
                served_ids=a.served_ids,
                positions=[tuple(p) for p in a.positions],
                n_rows_served=a.n_rows_served,
                timings_ms=a.timings_ms,
                version=mem.version,
            )

        return await memory_write(request, verb, None, ns, mid)

    def openapi() -> dict:
        """FastAPI's document, made true where FastAPI cannot know: the bearer scheme (with a token
        file: every route but /health), and ``model`` of a new memory, which only the served model
        passes."""
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"] = {
                "text/plain": {"schema": {"type": "string"}, "example": "eventkv_queue_depth 0.0"}
            }  # Prometheus text, not JSON
            create = doc["components"]["schemas"]["CreateMemory"]["properties"]
            create["model"] = {
                "anyOf": [{"const": served_name}, {"type": "null"}],
                **{"description": "the served model"},
            }
            if settings.tokens:
                doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                for path, ops in doc["paths"].items():
                    for op in ops.values():
                        if path != "/health":
                            op["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    served_name = getattr(lm.profile, "name", None)
    app.openapi = openapi
    return app
