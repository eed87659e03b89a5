"""The HTTP service over EventMemory: a FastAPI app built by :func:`create_app`.

Layout: ``STORE/<namespace>/<memory id>/`` is one EventMemory store (``docs/memory.md``); a posted
contract is kept as ``STORE/<namespace>/.contracts/<memory id>.json``. Every request is scoped to one
namespace (header ``X-EventKV-Namespace``, default ``default``); a memory id is resolved only inside
it, so a request can never name another namespace's files, and two namespaces may use the same id.

Routes that need the model or write a store run on the one :class:`ModelWorker` (bounded queue:
503 + Retry-After when full); ``GET`` routes and ``/metrics`` read the committed state through a
read-only connection (:func:`eventkv.memory.reader.read_memory`) and never wait behind it.

Errors are JSON ``{"code", "message"}``: 401 no or wrong token, 403 namespace not granted,
404 unknown memory or event, 409 ``expected_version`` behind the memory (or the id taken), 413 body
too large, 422 a bad request or a request the memory refuses, 503 queue full or shutting down.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import unquote

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException

from eventkv.errors import EventKVError, OptionError, OutOfSpace, StoreDamaged
from eventkv.files import out_of_space, write_json_atomic
from eventkv.memory.reader import read_memory
from eventkv.memory.records import MemoryEvent
from eventkv.memory.store import remove_leftovers
from eventkv.service import schemas as s
from eventkv.service.names import check_name
from eventkv.service.worker import ModelWorker, QueueFull, ShuttingDown

NAMESPACE_HEADER = "X-EventKV-Namespace"
DEFAULT_NAMESPACE = "default"
CONTRACTS = ".contracts"


class NotFound(EventKVError):
    """An unknown memory or event (HTTP 404)."""


class Conflict(EventKVError):
    """A write whose ``expected_version`` is behind the memory, or a memory id already taken (HTTP 409)."""


@dataclass
class Settings:
    """What one server serves.

    Attributes:
        lm: the loaded model (:class:`eventkv.models.LoadedModel`).
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


def _error(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"code": code, "message": message}, status_code=status, headers=headers)


class BodyLimit:
    """ASGI middleware: a request body over ``max_body`` bytes gets 413 — refused by its
    Content-Length before reading, or, for a chunked body, while it is read (the body is read here,
    at most ``max_body`` bytes, and handed on whole)."""

    def __init__(self, app, max_body: int) -> None:
        self.app, self.max_body = app, max_body

    def too_big(self) -> JSONResponse:
        return _error(413, "body_too_large", f"the request body is over {self.max_body} bytes: send less at once.")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            return await self.too_big()(scope, receive, send)
        messages, seen = [], 0
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
        replay = iter(messages)

        async def buffered():
            return next(replay, None) or await receive()

        return await self.app(scope, buffered, send)


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
    registry = CollectorRegistry()
    requests = Counter(
        "eventkv_requests",
        "HTTP requests by route, method and status",
        ["route", "method", "status"],
        registry=registry,
    )
    latency = Histogram(
        "eventkv_request_seconds",
        "HTTP request latency by route and method (seconds)",
        ["route", "method"],
        registry=registry,
        buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
    )
    depth = Gauge("eventkv_queue_depth", "model jobs waiting", registry=registry)
    depth.set_function(lambda: worker.depth if worker is not None else 0)

    class MemorySizes:
        def collect(self):
            rows = GaugeMetricFamily(
                "eventkv_memory_rows", "rows of the stored history", labels=["namespace", "memory"]
            )
            size = GaugeMetricFamily("eventkv_memory_bytes", "bytes on disk", labels=["namespace", "memory"])
            for d in sorted(root.glob("*/*")):
                if d.name.startswith(".") or not (d / "manifest.json").is_file():
                    continue
                try:
                    snap = read_memory(d)
                except EventKVError:
                    continue
                rows.add_metric([d.parent.name, d.name], snap.stats.rows)
                size.add_metric([d.parent.name, d.name], snap.stats.bytes_on_disk)
            yield rows
            yield size

    registry.register(MemorySizes())

    @app.middleware("http")
    async def measure(request: Request, call_next):
        t0 = time.perf_counter()
        response = await call_next(request)
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        requests.labels(path, request.method, str(response.status_code)).inc()
        latency.labels(path, request.method).observe(time.perf_counter() - t0)
        return response

    app.add_middleware(MemoryIdCheck)
    app.add_middleware(BodyLimit, max_body=settings.max_body)
    app.add_middleware(BearerAuth, tokens=settings.tokens)

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
        if isinstance(exc, StoreDamaged):
            return _error(409, "damaged", scrub(str(exc)))
        if isinstance(exc, OutOfSpace):
            return _error(507, "insufficient_storage", scrub(str(exc)))
        if not isinstance(exc, (NotFound, Conflict, OptionError, QueueFull, ShuttingDown)):
            return _error(422, "refused", scrub(str(exc)))
        if isinstance(exc, (QueueFull, ShuttingDown)):
            return _error(
                503, "busy" if isinstance(exc, QueueFull) else "shutting_down", str(exc), {"Retry-After": "1"}
            )
        if isinstance(exc, NotFound):
            return _error(404, "not_found", str(exc))
        if isinstance(exc, Conflict):
            return _error(409, "conflict", str(exc))
        if isinstance(exc, OptionError):
            return _error(422, "invalid_option", str(exc))
        return _error(422, "refused", str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}: see /docs for the routes."
        return _error(exc.status_code, code, message, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):  # a bug in eventkv, never the caller's input
        return _error(500, "internal", f"internal error ({type(exc).__name__}): please report it.")

    # ------------------------------------------------------------------ scope and helpers
    def namespace(request: Request) -> str:
        ns = request.headers.get(NAMESPACE_HEADER, DEFAULT_NAMESPACE)
        check_name(ns, "namespace")
        granted = request.scope.get("state", {}).get("namespaces")
        if granted is not None and ns not in granted:
            raise _Forbidden(ns)
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

    async def on_worker(job: Callable[[], Any]) -> Any:
        return await asyncio.wrap_future(worker.submit(job))

    def open_checked(d: Path, expected: int | None, eid: str | None = None):
        """(worker thread) the memory, after the version and event checks."""
        mem = worker.memory(d)
        if expected is not None and mem.version != expected:
            raise Conflict(
                f"the memory is at version {mem.version}, the write expected {expected}: read it again and retry."
            )
        if eid is not None:
            try:
                mem.get(eid)
            except EventKVError:
                raise NotFound(f"no event {eid!r} in memory {d.name!r}.") from None
        return mem

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
    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": getattr(lm.profile, "name", "?"), "queue_depth": worker.depth if worker else 0}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/memories", status_code=201, response_model=s.MemoryOut)
    async def create_memory(body: s.CreateMemory, ns: str = Depends(namespace)):
        from eventkv.memory import EventMemory

        if body.namespace is not None and body.namespace != ns:
            raise OptionError(
                "namespace",
                body.namespace,
                f"the request's namespace is {ns!r} (header {NAMESPACE_HEADER}): send the same.",
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

        await on_worker(job)
        return memory_out(d)

    @app.get("/v1/memories", response_model=list[s.MemoryOut])
    def list_memories(ns: str = Depends(namespace)):
        base = root / ns
        dirs = sorted(p for p in base.iterdir() if not p.name.startswith(".")) if base.is_dir() else []
        return [memory_out(d) for d in dirs if (d / "manifest.json").is_file()]

    @app.get("/v1/memories/{mid}", response_model=s.MemoryOut)
    def get_memory(mid: str, ns: str = Depends(namespace)):
        return memory_out(existing(ns, mid))

    @app.delete("/v1/memories/{mid}", response_model=s.WriteOut)
    async def delete_memory(mid: str, ns: str = Depends(namespace), expected_version: int | None = None):
        d = existing(ns, mid)

        def job():
            mem = open_checked(d, expected_version)
            version = mem.version
            worker.release(d)
            trash = root / ns / f".trash-{mid}-{uuid.uuid4().hex[:8]}"
            d.rename(trash)  # one step: the memory is gone for every reader at once
            shutil.rmtree(trash, ignore_errors=True)
            (root / ns / CONTRACTS / f"{mid}.json").unlink(missing_ok=True)
            return version

        return s.WriteOut(version=await on_worker(job))

    @app.post("/v1/memories/{mid}/events", status_code=201, response_model=s.WriteOut)
    async def add_events(mid: str, body: s.AddEvents, ns: str = Depends(namespace)):
        d = existing(ns, mid)
        events = [MemoryEvent(e.text, e.role, e.id, tuple(e.tags), e.budget, e.kind) for e in body.events]

        def job():
            mem = open_checked(d, body.expected_version)
            added = mem.add(events, prefill=body.prefill)
            return s.WriteOut(version=mem.version, added=added)

        return await on_worker(job)

    @app.get("/v1/memories/{mid}/events", response_model=list[s.RecordOut])
    def list_events(
        mid: str, include_superseded: bool = False, include_deleted: bool = False, ns: str = Depends(namespace)
    ):
        table = read_memory(existing(ns, mid)).table
        return table.list(include_superseded, include_deleted)

    @app.get("/v1/memories/{mid}/view", response_model=list[str])
    def view_ids(mid: str, ns: str = Depends(namespace)):
        return read_memory(existing(ns, mid)).table.view_ids()

    def lookup(ns: str, mid: str, eid: str, what: Callable):
        table = read_memory(existing(ns, mid)).table
        check_event_id(eid)
        try:
            return what(table)
        except EventKVError:
            raise NotFound(f"no event {eid!r} in memory {mid!r}.") from None

    @app.get("/v1/memories/{mid}/events/{eid}", response_model=s.RecordOut)
    def get_event(mid: str, eid: str, ns: str = Depends(namespace)):
        return lookup(ns, mid, eid, lambda t: t.lookup(eid))

    @app.get("/v1/memories/{mid}/events/{eid}/history", response_model=list[s.RecordOut])
    def event_history(mid: str, eid: str, ns: str = Depends(namespace)):
        return lookup(ns, mid, eid, lambda t: t.history(eid))

    def event_write(verb: Callable, body: s.Write, ns: str, mid: str, eid: str):
        d = existing(ns, mid)
        check_event_id(eid)

        def job():
            mem = open_checked(d, body.expected_version, eid)
            return verb(mem)

        return on_worker(job)

    @app.post("/v1/memories/{mid}/events/{eid}/update", status_code=201, response_model=s.WriteOut)
    async def update_event(mid: str, eid: str, body: s.UpdateEvent, ns: str = Depends(namespace)):
        def verb(mem):
            a = mem.update(eid, body.text, prefill=body.prefill)
            return s.WriteOut(version=mem.version, added=[a])

        return await event_write(verb, body, ns, mid, eid)

    @app.post("/v1/memories/{mid}/events/{eid}/delete", response_model=s.WriteOut)
    async def delete_event(mid: str, eid: str, body: s.Write | None = None, ns: str = Depends(namespace)):
        def verb(mem):
            mem.delete(eid)
            return s.WriteOut(version=mem.version)

        return await event_write(verb, body or s.Write(), ns, mid, eid)

    @app.post("/v1/memories/{mid}/events/{eid}/forget", response_model=s.WriteOut)
    async def forget_event(mid: str, eid: str, body: s.Write | None = None, ns: str = Depends(namespace)):
        def verb(mem):
            rows = mem.forget(eid)
            return s.WriteOut(version=mem.version, rows=rows)

        return await event_write(verb, body or s.Write(), ns, mid, eid)

    @app.post("/v1/memories/{mid}/events/{eid}/pin", response_model=s.WriteOut)
    async def pin_event(mid: str, eid: str, body: s.PinEvent | None = None, ns: str = Depends(namespace)):
        body = body or s.PinEvent()

        def verb(mem):
            mem.pin(eid, body.pinned)
            return s.WriteOut(version=mem.version)

        return await event_write(verb, body, ns, mid, eid)

    def memory_write(verb: Callable, expected: int | None, ns: str, mid: str):
        d = existing(ns, mid)
        return on_worker(lambda: verb(open_checked(d, expected)))

    @app.post("/v1/memories/{mid}/prefill", response_model=s.WriteOut)
    async def prefill(mid: str, body: s.Write | None = None, ns: str = Depends(namespace)):
        body = body or s.Write()

        def verb(mem):
            rows = mem.prefill()
            return s.WriteOut(version=mem.version, rows=rows)

        return await memory_write(verb, body.expected_version, ns, mid)

    @app.post("/v1/memories/{mid}/rebase", response_model=s.WriteOut)
    async def rebase(mid: str, body: s.Write | None = None, ns: str = Depends(namespace)):
        body = body or s.Write()

        def verb(mem):
            rows = mem.rebase()
            return s.WriteOut(version=mem.version, rows=rows)

        return await memory_write(verb, body.expected_version, ns, mid)

    @app.post("/v1/memories/{mid}/carriers", status_code=201, response_model=s.CarrierOut)
    async def carrier(mid: str, body: s.CarrierIn, ns: str = Depends(namespace)):
        def verb(mem):
            r = mem.carrier(body.sources, body.subject, body.kind, prefill=body.prefill)
            return s.CarrierOut(
                kind=r.kind,
                added=r.added,
                pinned=list(r.pinned),
                reason=r.reason,
                version=mem.version,
            )

        return await memory_write(verb, body.expected_version, ns, mid)

    @app.post("/v1/memories/{mid}/select", response_model=list[str])
    async def select(mid: str, body: s.SelectIn, ns: str = Depends(namespace)):
        return await memory_write(lambda mem: mem.select(body.question, body.k, body.budget_rows), None, ns, mid)

    @app.post("/v1/memories/{mid}/query", response_model=s.AnswerOut)
    async def query(mid: str, body: s.QueryIn, ns: str = Depends(namespace)):
        def verb(mem):
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

        return await memory_write(verb, None, ns, mid)

    @app.exception_handler(_Forbidden)
    async def forbidden(request: Request, exc: _Forbidden):
        return _error(403, "forbidden", str(exc))

    return app


class _Forbidden(EventKVError):
    def __init__(self, ns: str) -> None:
        super().__init__(f"this token is not granted namespace {ns!r}: use a namespace it was issued for.")
