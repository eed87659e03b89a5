"""The service's error answers: JSON ``{"code", "message"}`` with the status of its code.

:data:`TABLE` maps an exception type to its ``(status, code)``, built on :data:`eventkv.wire.ERRORS`
(the table the client reads answers back with); :func:`responses` declares a route's error statuses
in the OpenAPI document; :class:`Handlers` are the app's exception handlers (a request outside its
schema, an :class:`~eventkv.errors.EventKVError`, a client gone before its answer, Starlette's HTTP
errors, and any other exception as 500 ``internal``).

The OpenAI-compatible routes (paths under :data:`OPENAI_PREFIXES`) answer the same errors in OpenAI's
shape instead, ``{"error": {"message", "type", "param", "code"}}``, with 400 where the others say 422
(what OpenAI's clients expect of a bad request): :func:`error_answer` picks the shape by the path, for
the handlers and the middleware alike.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute, Match

from eventkv.errors import EventKVError, OptionError, show_value
from eventkv.service import schemas
from eventkv.service.openai import protocol
from eventkv.wire import ERRORS


#: exception type -> (HTTP status, code), in the order of :data:`eventkv.wire.ERRORS`: an exception
#: answers with the first type it is an instance of (a type listed under two codes keeps the first)
def _table() -> dict[type[EventKVError], tuple[int, str]]:
    table: dict[type[EventKVError], tuple[int, str]] = {}
    for code, (status, kind) in ERRORS.items():
        table.setdefault(kind, (status, code))
    return table


TABLE = _table()

#: what each error status means, as the OpenAPI document declares it
STATUS_TEXT = {
    400: "OpenAI-compatible routes: a request outside its schema, a field this server does not support, or one "
    "the model or the memory cannot answer (`invalid_request_error`)",
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
    503: "the model queue is full (`busy`), the server is stopping (`shutting_down`), a forget is done but its "
    "bytes are still on disk behind a reader (`purge_pending`: forget the same id again), the memory is open in "
    "another process (`locked`), or a Ray Serve replica stopped before its answer (`unavailable`); retry after "
    "Retry-After",
    507: "the store's filesystem is full (`insufficient_storage`); nothing was written",
}

SCOPED = (403, 422)  # every route with a namespace: not granted, a bad header
MEMORY = (*SCOPED, 404, 409)  # and a memory id: unknown, damaged
QUEUED = (*MEMORY, 503, 507)  # and model work: queue full, a full disk (a query's lazy prefill writes)


class ClientGone(Exception):
    """The client disconnected while its job waited: nobody reads the answer."""


def error_response(status: int, code: str, message: str, headers: dict | None = None) -> JSONResponse:
    """The error answer: ``{"code", "message"}`` with ``status`` (and ``headers``)."""
    return JSONResponse({"code": code, "message": message}, status_code=status, headers=headers)


#: the paths of the OpenAI-compatible routes, whose errors are in OpenAI's shape
OPENAI_PREFIXES = ("/v1/chat/", "/v1/models")


def openai_path(path: str) -> bool:
    """Whether ``path`` is one of the OpenAI-compatible routes' (:data:`OPENAI_PREFIXES`)."""
    return (
        path.startswith(OPENAI_PREFIXES[0]) or path == OPENAI_PREFIXES[1] or path.startswith(OPENAI_PREFIXES[1] + "/")
    )


def openai_status(status: int) -> int:
    """The status an OpenAI-compatible route answers for ``status``: 400 for 422, else the same."""
    return 400 if status == 422 else status


def openai_error_response(
    status: int, code: str | None, message: str, headers: dict | None = None, param: str | None = None
) -> JSONResponse:
    """An error answer in OpenAI's shape (:class:`eventkv.service.openai.protocol.OpenAIErrorOut`),
    with the status :func:`openai_status` gives and OpenAI's type for it."""
    status = openai_status(status)
    kind = {401: "authentication_error", 403: "permission_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    body = protocol.OpenAIErrorOut(error=protocol.OpenAIError(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def error_answer(
    path: str, status: int, code: str, message: str, headers: dict | None = None, param: str | None = None
) -> JSONResponse:
    """The error answer of a request to ``path``: OpenAI's shape on the OpenAI-compatible routes
    (:func:`openai_error_response`), the service's ``{"code", "message"}`` elsewhere."""
    if openai_path(path):
        return openai_error_response(status, code, message, headers, param)
    return error_response(status, code, message, headers)


def status_and_code(exc: EventKVError) -> tuple[int, str]:
    """``(HTTP status, code)`` of ``exc`` (:data:`TABLE`); an exception of no listed type is 422:
    ``invalid_option`` for an :class:`~eventkv.errors.OptionError`, else ``refused``."""
    found = next((answer for kind, answer in TABLE.items() if isinstance(exc, kind)), None)
    if found is not None:
        return found
    code = "invalid_option" if isinstance(exc, OptionError) else "refused"
    return ERRORS[code][0], code


def declared(status: int) -> dict[str, Any]:
    """The OpenAPI ``responses`` entry of an error ``status``: the error body, what it means, and
    the headers it carries (503: Retry-After; 401: WWW-Authenticate)."""
    out: dict = {"model": schemas.ErrorOut, "description": STATUS_TEXT[status]}
    if status == 503:
        out["headers"] = {"Retry-After": {"schema": {"type": "string"}, "description": "seconds"}}
    if status == 401:
        out["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    return out


def responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI ``responses`` of a route: each status with the error body, plus those of every
    route: 408 and 413 (the body middleware). 401 is not among them: the app adds it to the routes
    behind the bearer token when it has tokens (:data:`UNAUTHORIZED`)."""
    return {status: declared(status) for status in sorted({408, 413, *statuses})}


def openai_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """:func:`responses` of an OpenAI-compatible route: OpenAI's error body, 400 for 422."""
    return {
        status: {**declared(status), "model": protocol.OpenAIErrorOut}
        for status in sorted({408, 413, *(openai_status(x) for x in statuses)})
    }


#: the responses the bearer-token middleware adds to a route it guards
UNAUTHORIZED: dict[int | str, dict[str, Any]] = {401: declared(401)}
#: the same, on an OpenAI-compatible route
OPENAI_UNAUTHORIZED: dict[int | str, dict[str, Any]] = {401: {**declared(401), "model": protocol.OpenAIErrorOut}}


def validation_message(errors: Sequence[Any], hint: str = "see /docs for the request schemas") -> str:
    """The message of a request outside its schema, from pydantic's ``errors`` (``ValidationError.errors()``,
    the first five): the library's wording, ``field value: what is allowed`` (as an
    :class:`~eventkv.errors.OptionError`), with pydantic's rule as the fix, then ``(hint)``."""
    if errors and (not_json := schemas.json_invalid(errors[0])) is not None:
        return f"{not_json} ({hint})."
    parts = []
    for e in list(errors)[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        given = e.get("input")
        shown = "" if e.get("type") == "missing" or isinstance(given, dict) else f" {show_value(given)}"
        shown = shown if len(shown) <= 60 else shown[:56] + " ..."
        parts.append(f"{loc}{shown}: {schemas.pydantic_rule(e)}")
    return "; ".join(parts) + f" ({hint})."


def scrub(message: str, root: Path) -> str:
    """``message`` without the server's paths under the store ``root`` (a client knows its memories by id)."""
    for prefix in sorted({str(root.resolve()), str(root)}, key=len, reverse=True):
        message = message.replace(prefix + os.sep, "").replace(prefix, "<store>")
    return message


class Handlers:
    """The app's exception handlers (:meth:`install`): messages are scrubbed of the paths under
    ``root``; a 405's ``Allow`` names the methods of every route of the app and of ``routers`` whose
    path matches."""

    def __init__(self, root: Path, routers: Iterable = ()) -> None:
        self.root, self.routers = root, list(routers)

    def install(self, app: FastAPI) -> None:
        # ignored: Starlette's stub wants a handler of any Exception, though it calls one with its class only
        app.add_exception_handler(RequestValidationError, self.invalid)  # type: ignore[arg-type]
        app.add_exception_handler(EventKVError, self.refused)  # type: ignore[arg-type]
        app.add_exception_handler(ClientGone, self.client_gone)  # type: ignore[arg-type]
        app.add_exception_handler(StarletteHTTPException, self.http_error)  # type: ignore[arg-type]
        app.add_exception_handler(Exception, self.internal)

    async def invalid(self, request: Request, exc: RequestValidationError) -> JSONResponse:
        if openai_path(request.url.path):
            message, param, code = protocol.invalid(list(exc.errors()))
            return openai_error_response(400, code, message, param=param)
        return error_response(422, "invalid_request", validation_message(exc.errors()))

    async def refused(self, request: Request, exc: EventKVError) -> JSONResponse:
        status, code = status_and_code(exc)
        headers = {"Retry-After": "1"} if status == 503 else None
        if openai_path(request.url.path):
            param = protocol.PARAMS.get(exc.field, exc.field) or None if isinstance(exc, OptionError) else None
            code = getattr(exc, "openai_code", code)
            return openai_error_response(status, code, scrub(str(exc), self.root), headers, param)
        return error_response(status, code, scrub(str(exc), self.root), headers)

    async def client_gone(self, request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the metrics count it as 499

    def routes(self, app) -> list[BaseRoute]:
        """The app's own routes, then those of the included routers."""
        return [*app.router.routes, *(route for router in self.routers for route in router.routes)]

    async def http_error(self, request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_answer(
                request.url.path,
                404,
                "not_found",
                f"no route {request.method} {request.url.path}: see /docs for the routes.",
            )
        if exc.status_code == 405:
            # Starlette's Allow names the methods of the first route whose path matched; a path can have
            # several routes (GET and POST /v1/memories): name every method of every route that matches
            allowed = set()
            for route in self.routes(request.app):
                methods = getattr(route, "methods", None)
                if methods and route.matches(request.scope)[0] is not Match.NONE:
                    allowed |= methods
            allow = ", ".join(sorted(allowed))
            return error_answer(
                request.url.path,
                405,
                "method_not_allowed",
                f"{request.method} is not a method of this route: use {allow}.",
                {"Allow": allow},
            )
        if exc.status_code == 400:  # the body could not be parsed (not UTF-8, not JSON)
            return error_answer(
                request.url.path,
                422,
                "invalid_request",
                "the request body is not valid JSON: send a JSON body (see /docs).",
            )
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return error_answer(
            request.url.path, exc.status_code, "invalid_request", message, getattr(exc, "headers", None)
        )

    async def internal(self, request: Request, exc: Exception) -> JSONResponse:  # a bug, never the caller's input
        message = f"internal error ({type(exc).__name__}): please report it."
        return error_answer(request.url.path, 500, "internal", message)
