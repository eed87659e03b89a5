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

The interactive pages ``/docs`` (Swagger UI) and ``/redoc`` are served with their scripts from the
``fastapi-offline`` package (:data:`eventkv.service.middleware.DOCS_ASSETS`), so they render on a
machine without internet access; they, their assets and ``/openapi.json`` need no bearer token
(:data:`eventkv.service.middleware.PUBLIC`).

The memory inspector ``/ui`` (:mod:`eventkv.service.ui`): server-rendered pages of a memory's timeline, a
question's served set and a side-by-side of serving plans; its shells and assets are public as ``/docs`` is,
its fragments go through the bearer token and namespace grant.

The parts: the routers, one per resource (:mod:`eventkv.service.routes`) and the OpenAI-compatible
one (:mod:`eventkv.service.openai`), handed the app's state, worker and metrics by dependency
injection (:mod:`eventkv.service.state`); the middleware
(:mod:`eventkv.service.middleware`: bearer token, body size and timeout, memory id); the metrics
(:mod:`eventkv.service.metrics`); the error table and handlers (:mod:`eventkv.service.errors`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi_offline import FastAPIOffline

from eventkv.memory.store import remove_leftovers
from eventkv.service import routes, ui
from eventkv.service.errors import OPENAI_UNAUTHORIZED, UNAUTHORIZED, Handlers, openai_path
from eventkv.service.metrics import Measure, Metrics
from eventkv.service.middleware import DOCS_ASSETS, BearerAuth, BodyLimit, MemoryIdCheck
from eventkv.service.openai.router import router as openai_router
from eventkv.service.state import CONTRACTS, ServiceState, Settings
from eventkv.service.worker import ModelWorker

__all__ = ["Settings", "clean_leftovers", "create_app"]

#: the routers behind the bearer token (when the app has tokens): the service's, then the
#: OpenAI-compatible one, whose errors are in OpenAI's shape (:func:`eventkv.service.errors.error_answer`)
GUARDED = (*routes.GUARDED, openai_router)
#: every router, in the order the app includes them (the OpenAPI document lists their paths so)
ROUTERS = (*routes.ROUTERS, openai_router)


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
    its lifespan: queued work finishes, every memory is closed). The routers
    (:data:`ROUTERS`) read the state, the worker and the metrics from ``app.state``
    through their dependencies (:mod:`eventkv.service.state`)."""
    root = Path(settings.store)
    root.mkdir(parents=True, exist_ok=True)
    if settings.clean_at_start:
        clean_leftovers(root)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker = ModelWorker(
            settings.lm, settings.max_queue, settings.max_open, settings.max_batch, max_hot=settings.max_hot
        )
        app.state.worker = worker
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.stop)

    # fastapi-offline's app: /docs (Swagger UI) and /redoc load their scripts and styles from the
    # package (mounted at DOCS_ASSETS) instead of FastAPI's default CDN, so they render offline
    app = FastAPIOffline(
        title="eventkv memory service",
        version="1",
        description="EventMemory over HTTP: one model, many memories, one namespace per request.",
        lifespan=lifespan,
        static_url=DOCS_ASSETS,
    )
    app.state.service = ServiceState(settings, root)
    app.state.worker = None
    app.state.metrics = metrics = Metrics(root, lambda: app.state.worker)

    app.add_middleware(MemoryIdCheck)
    app.add_middleware(BodyLimit, max_body=settings.max_body, body_timeout=settings.body_timeout)
    app.add_middleware(BearerAuth, tokens=settings.tokens)
    app.add_middleware(Measure, requests=metrics.requests, latency=metrics.latency)
    Handlers(root, ROUTERS).install(app)
    for router in ROUTERS:  # 401 is declared where the bearer token is asked for: every route but /health
        unauthorized = OPENAI_UNAUTHORIZED if router is openai_router else UNAUTHORIZED
        app.include_router(router, responses=unauthorized if settings.tokens and router in GUARDED else None)

    ui.mount(app)  # the inspector at /ui (eventkv.service.ui): page shells public, fragments behind the token
    served = app.state.service.served

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
                "anyOf": [{"const": served}, {"type": "null"}],
                **{"description": "the served model"},
            }
            schemas = doc["components"]["schemas"]
            chat = schemas["ChatRequest"]["properties"]
            chat["model"] = {"const": served, "type": "string", "description": "the served model (GET /v1/models)"}
            # FastAPI declares its own 422 on a route with a body that declares none; the OpenAI-compatible
            # routes answer a bad request with 400 (declared), never 422
            for path, ops in doc["paths"].items():
                if openai_path(path):
                    for op in ops.values():
                        op["responses"].pop("422", None)
            if "#/components/schemas/HTTPValidationError" not in json.dumps(doc["paths"]):
                schemas.pop("HTTPValidationError", None)
                schemas.pop("ValidationError", None)
            if settings.tokens:
                doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
                for path, ops in doc["paths"].items():
                    for op in ops.values():
                        if path != "/health":
                            op["security"] = [{"bearer": []}]
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend its document
    return app
