"""The service's ASGI middleware, outermost first as :func:`eventkv.service.app.create_app` stacks
them (after :class:`eventkv.service.metrics.Measure`): :class:`BearerAuth` (401 without a granted
token), :class:`BodyLimit` (413 over the size limit, 408 past the body timeout) and
:class:`MemoryIdCheck` (422 for a bad memory id in any path). Their refusals are the service's
error answers (:func:`eventkv.service.errors.error_response`; on the OpenAI-compatible routes in OpenAI's shape:
:func:`eventkv.service.errors.error_answer`)."""

from __future__ import annotations

import asyncio
import hmac
from urllib.parse import unquote

from fastapi.responses import JSONResponse

from eventkv.errors import OptionError
from eventkv.service.errors import error_answer, error_response
from eventkv.service.ui import is_ui_shell
from eventkv.wire import check_name

#: where the interactive API pages' scripts and styles are served from (fastapi-offline's static files)
DOCS_ASSETS = "/docs/assets"
#: the paths :class:`BearerAuth` lets through without a token: the health check, and the API's
#: description (the interactive pages, their assets under :data:`DOCS_ASSETS`, the OpenAPI document).
#: They are the same for every caller and hold no memory's data (the served model's name is on
#: ``/health`` already), and a browser opening a page cannot send a bearer header.
PUBLIC = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


class BodyLimit:
    """ASGI middleware: a request body over ``max_body`` bytes gets 413 — refused by its
    Content-Length before reading, or, for a chunked body, while it is read (the body is read here,
    at most ``max_body`` bytes, and handed on whole). A body that has not fully arrived
    ``body_timeout`` seconds after the request's headers gets 408 and the connection is closed (a
    slow sender cannot hold a connection open by trickling bytes)."""

    def __init__(self, app, max_body: int, body_timeout: float = 30.0) -> None:
        self.app, self.max_body, self.body_timeout = app, max_body, body_timeout

    def too_big(self, path: str) -> JSONResponse:
        return error_answer(
            path, 413, "body_too_large", f"the request body is over {self.max_body} bytes: send less at once."
        )

    def too_slow(self, path: str) -> JSONResponse:
        return error_answer(
            path,
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
            return await self.too_big(scope["path"])(scope, receive, send)
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
                        return await self.too_big(scope["path"])(scope, receive, send)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            return await self.too_slow(scope["path"])(scope, receive, send)
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
                return await error_response(422, "invalid_option", str(exc))(scope, receive, send)
        return await self.app(scope, receive, send)


class BearerAuth:
    """ASGI middleware: with tokens configured, every path but the public ones (:data:`PUBLIC`, and
    the pages' assets under :data:`DOCS_ASSETS`) needs ``Authorization: Bearer <token>`` (compared in
    constant time against every token); the token's namespaces go to ``scope["state"]["namespaces"]``
    (None = all)."""

    def __init__(self, app, tokens: dict[str, frozenset[str] | None]) -> None:
        self.app, self.tokens = app, [(t.encode(), ns) for t, ns in tokens.items()]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.tokens or is_public(scope["path"]):
            return await self.app(scope, receive, send)
        auth = dict(scope.get("headers") or []).get(b"authorization", b"")
        given = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
        granted, found = None, False
        for token, ns in self.tokens:  # every token compared: the time does not tell which matched
            if hmac.compare_digest(given, token):
                granted, found = ns, True
        if not found:
            response = error_answer(
                scope["path"],
                401,
                "unauthorized",
                "missing or wrong bearer token: send 'Authorization: Bearer <token>'.",
                {"WWW-Authenticate": "Bearer"},
            )
            return await response(scope, receive, send)
        scope.setdefault("state", {})["namespaces"] = granted
        return await self.app(scope, receive, send)


def is_public(path: str) -> bool:
    """Whether ``path`` is answered without a bearer token (:data:`PUBLIC`, an asset under :data:`DOCS_ASSETS`,
    or a page shell or asset of the inspector: :func:`eventkv.service.ui.is_ui_shell`, which hold no memory's
    data; the inspector's fragments need the token)."""
    return path in PUBLIC or path.startswith(DOCS_ASSETS + "/") or is_ui_shell(path)
