"""The front of the Ray Serve backend: ``eventkv serve --backend ray`` listens with uvicorn (the same
connection limits and timeouts as the single process) and hands each request to a replica
(:mod:`eventkv.service.cluster.replica`) through a ``DeploymentHandle``, with the memory it names as
the multiplexed id, so Ray Serve's router sends it to the replica that holds that memory.

The gateway checks the bearer token and reads the body under the same limits as the single process
(the same middleware: 401, 413, 408), then forwards it whole; everything else — namespaces, routes,
validation, the JSON error body — is the replica's app. An answer of 503 ``locked`` (the replica asked
does not hold the memory: another one does, its store lock refused the open, nothing was done) is
retried with backoff for up to :data:`RETRY_S` seconds, by which time the router has found the holder,
or the holder has closed the store. A replica that stops before its answer gives 503 ``unavailable``:
the request is not retried, since a write may have been carried out.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from eventkv.service.cluster.replica import Forwarded, Start
from eventkv.service.cluster.routing import memory_key
from eventkv.service.errors import error_answer
from eventkv.service.middleware import BearerAuth, BodyLimit

#: seconds a request refused with 503 ``locked`` is retried before that answer goes to the client
RETRY_S = 30.0
LOG = logging.getLogger("eventkv.service")


class Gateway:
    """The ASGI app of the front: one request, one forwarded call (:meth:`MemoryReplica.forward`).

    Args:
        handle: the replicas' ``DeploymentHandle``. retry_s: as :data:`RETRY_S`.
    """

    def __init__(self, handle: Any, retry_s: float = RETRY_S) -> None:
        self.handle, self.retry_s = handle, retry_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        body, more = [], True
        while more:  # BodyLimit has read it already, under the size limit and the body timeout
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left
            body.append(message.get("body", b""))
            more = message.get("more_body", False)
        request = Forwarded(
            method=scope["method"],
            path=scope["path"],
            raw_path=scope.get("raw_path") or scope["path"].encode(),
            query_string=scope.get("query_string", b""),
            headers=list(scope.get("headers") or []),
            body=b"".join(body),
            client=tuple(scope["client"]) if scope.get("client") else None,
        )
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
        raw = request.raw_path.decode("latin-1").split("?")[0]
        key = memory_key(request.method, request.path, headers, request.body, raw)
        calls: list[Any] = []  # the forwarded call under way, cancelled when the client leaves first
        starting = asyncio.ensure_future(self._start(request, key, calls))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({starting, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not starting.done():
                starting.cancel()
                for call in calls:
                    call.cancel()  # Ray cancels the replica's task: a queued job leaves the worker's queue
        if starting.cancelled():
            return
        got = starting.result()
        if isinstance(got, tuple):
            start, stream = got
            await send({"type": "http.response.start", "status": start.status, "headers": start.headers})
            try:
                async for chunk in stream:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except Exception as exc:  # the replica stopped mid-answer: the status is sent, so close unfinished
                LOG.warning("a replica stopped while streaming %s %s: %s", request.method, request.path, exc)
                raise
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            await got(scope, receive, send)

    async def _start(self, request: Forwarded, key: str | None, calls: list) -> Any:
        """``(Start, the rest of the stream)`` of the forwarded request, or an error answer (a Starlette
        response) when no replica could answer."""
        import ray.exceptions
        from ray.serve.exceptions import BackPressureError, RayServeException

        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + self.retry_s, 0.05
        while True:
            call = self.handle.options(stream=True, multiplexed_model_id=key or "").forward.remote(request)
            calls[:] = [call]
            try:
                start: Start = await call.__anext__()
            except BackPressureError:
                return error_answer(
                    request.path,
                    503,
                    "busy",
                    "every replica's queue is full: retry after a moment.",
                    {"Retry-After": "1"},
                )
            except ray.exceptions.RayTaskError as exc:  # the replica's code raised: a bug, the app answers 500 itself
                LOG.error("forwarding %s %s failed: %s", request.method, request.path, exc)
                return error_answer(request.path, 500, "internal", "an internal error: please report it.")
            except (ray.exceptions.RayError, RayServeException) as exc:
                LOG.warning("a replica stopped before answering %s %s: %s", request.method, request.path, exc)
                return error_answer(
                    request.path,
                    503,
                    "unavailable",
                    "the replica answering this request stopped before its answer: a write may or may not have "
                    "been carried out; read the memory (its version or events) before sending it again.",
                    {"Retry-After": "1"},
                )
            if start.locked and loop.time() + delay < deadline:
                call.cancel()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            return start, call


async def _disconnected(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def gateway_app(handle: Any, tokens: dict, max_body: int, body_timeout: float, retry_s: float = RETRY_S) -> Any:
    """The front's ASGI app: :class:`BearerAuth` and :class:`BodyLimit` (as the single process stacks
    them, with its ``tokens``, ``max_body`` bytes and ``body_timeout`` seconds) over a :class:`Gateway`
    to ``handle``."""
    return BearerAuth(BodyLimit(Gateway(handle, retry_s), max_body=max_body, body_timeout=body_timeout), tokens=tokens)
