"""A Ray Serve replica of the memory service: the service's FastAPI app (:func:`eventkv.service.app.create_app`,
every route, middleware and error answer) as a Serve deployment through ``serve.ingress``, its model
loaded once per replica, and the memories it holds as Ray Serve's multiplexed models.

The memory is the multiplexed id (``<namespace>/<memory id>``, :mod:`eventkv.service.cluster.routing`):
Serve's router sends a request with that id to the replica that reported it loaded, and a replica
loads it (:meth:`MemoryReplica.slot`) by opening the store on its model worker, which takes the
store's writer lock. ``memories`` of them are kept per replica, least recently used closed first
(its lock released), so a memory is open on one replica at a time and moves between replicas by
close and open, never by copying rows. A replica that cannot take the lock (another replica holds
the store) answers 503 ``locked`` before anything is read or written; the gateway
(:mod:`eventkv.service.cluster.gateway`) retries it, and the router then finds the holder.

Requests reach a replica through a ``DeploymentHandle`` (:meth:`MemoryReplica.forward`): the
gateway's request, whole, is run through the app in the replica, and the answer comes back as a
stream (its status and headers, then the body's chunks), so a streamed chat streams across.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, AsyncIterator

from eventkv.errors import EventKVError, StoreLocked
from eventkv.service.cluster.routing import MEMORIES
from eventkv.service.state import Settings

#: Ray Serve writes the records of this logger to each replica's log file
#: (``/tmp/ray/session_latest/logs/serve/replica_<app>_<deployment>_<replica id>.log``); the replica
#: adds the opens and closes of its memories (:data:`eventkv.service.worker.LOG`) to it
LOG = logging.getLogger("ray.serve")
#: the response header naming the replica that answered (``serve.get_replica_context().replica_id``)
REPLICA_HEADER = "x-eventkv-replica"


@dataclass(frozen=True)
class ReplicaSpec:
    """What each replica serves: the model to load, and the service's settings with the model left out
    (each replica loads it and sets ``lm``, ``max_open`` = ``memories``, ``clean_at_start`` False).

    Attributes:
        model: a packaged alias, a Hugging Face directory or hub id, or a ``.gguf`` file (every replica
            loads it: a path must be on storage every node reaches).
        settings: :class:`eventkv.service.state.Settings` (``lm`` None); its ``store`` on storage every
            replica reaches (POSIX, with working ``flock`` and ``fsync``: docs/service.md).
        dtype, device: as :func:`eventkv.models.load`. threads: torch threads (and Ray CPUs) per replica.
        memories: memories kept open per replica (the multiplexed models per replica).
    """

    model: str
    settings: Settings
    dtype: str = "auto"
    device: str = "auto"
    threads: int = 1
    memories: int = 16


@dataclass(frozen=True)
class Forwarded:
    """One HTTP request as the gateway received it, body whole (ASGI's fields)."""

    method: str
    path: str
    raw_path: bytes
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None = None


@dataclass(frozen=True)
class Start:
    """The first item of a forwarded answer: its status and headers. ``locked``: the answer is 503
    ``locked`` (another replica holds the memory's store; nothing was done), which the gateway retries."""

    status: int
    headers: list[tuple[bytes, bytes]]
    locked: bool = False


class MemorySlot:
    """A memory a replica holds (Ray Serve's multiplexed model): its store open on the replica's
    worker. Ray Serve calls ``__del__`` when it evicts the slot (least recently used), which closes
    the store and releases its writer lock, so another replica can open it."""

    def __init__(self, worker, directory: Path, key: str, replica: str) -> None:
        self.worker, self.directory, self.key, self.replica = worker, directory, key, replica
        self.closed = False

    def __del__(self) -> None:
        if self.closed:  # Ray Serve's eviction called it already; this is the garbage collector
            return
        self.closed = True
        done = self.worker.close_memory(self.directory)
        if not self.worker.on_worker_thread():  # the worker thread must not wait for its own job
            done.result(timeout=120)


def replica_deployment(spec: ReplicaSpec, replicas: int, max_ongoing: int) -> Any:
    """The Serve application of ``replicas`` replicas of :class:`MemoryReplica` over ``spec``, each
    reserving ``spec.threads`` CPUs and taking up to ``max_ongoing`` requests at once (the service's
    own queue, ``spec.settings.max_queue``, answers 503 ``busy`` beyond it, as the single process does).
    Built per call because the number of memories per replica is the multiplexed decorator's argument
    (and so Ray is imported only here: it is an optional extra).
    """
    from ray import serve

    @serve.deployment(name="MemoryReplica")
    @serve.ingress()
    class MemoryReplica:
        """One replica: the model, the service's app over it, and the memories it holds."""

        app: Any  # the service's app, set by serve.ingress from __serve_build_asgi_app__ (its lifespan run by Serve)

        def __init__(self, spec: ReplicaSpec) -> None:
            import torch

            from eventkv.models import load

            torch.set_num_threads(spec.threads)
            self.spec = spec
            self.lm = load(spec.model, dtype=spec.dtype, device=spec.device)
            self.root = Path(spec.settings.store)
            self.replica = serve.get_replica_context().replica_id.unique_id
            # each open and close of a memory (eventkv.service.worker.LOG) into this replica's Serve log
            opens = logging.getLogger("eventkv.service.memories")
            opens.setLevel(logging.INFO)
            for handler in LOG.handlers:
                opens.addHandler(handler)
            LOG.info("eventkv: replica %s loaded %s (%s)", self.replica, spec.model, self.lm.profile.dtype)

        def __serve_build_asgi_app__(self):
            from eventkv.service.app import create_app

            # other replicas write under the same root: the gateway cleaned it once, before they started
            settings = replace(self.spec.settings, lm=self.lm, max_open=self.spec.memories, clean_at_start=False)
            return create_app(settings)

        @serve.multiplexed(max_num_models_per_replica=spec.memories)
        async def slot(self, key: str) -> MemorySlot:
            """Hold the memory ``key`` (``<namespace>/<memory id>``): its store opened on the worker.
            A memory not created yet is held without a store (its creation opens it here).

            Raises:
                StoreLocked: another replica (or process) holds the store: this replica does not hold it.
            """
            namespace, memory = key.split("/", 1)
            worker = self.app.state.worker
            d = self.root / namespace / memory
            if (d / "manifest.json").is_file():
                try:
                    await asyncio.wrap_future(worker.submit(lambda: worker.memory(d), d))
                except StoreLocked:
                    raise
                except EventKVError:  # a damaged store, a full queue, ...: the app answers it as the process does
                    pass
            return MemorySlot(worker, d, key, self.replica)

        async def forward(self, request: Forwarded) -> AsyncIterator[Start | bytes]:
            """Answer ``request`` with the app: a :class:`Start`, then the body's chunks (bytes)."""
            key = serve.get_multiplexed_model_id()
            if key:
                try:
                    await self.slot(key)
                except StoreLocked as exc:
                    refusal = json.dumps({"code": "locked", "message": self.app.state.service.scrub(str(exc))})
                    yield Start(
                        503, self._headers([(b"content-type", b"application/json"), (b"retry-after", b"1")]), True
                    )
                    yield refusal.encode()
                    return
            messages: asyncio.Queue[dict | None] = asyncio.Queue()
            task = asyncio.ensure_future(self._run(request, messages))
            try:
                start = await messages.get()
                assert start is not None and start["type"] == "http.response.start", start
                status, headers = start["status"], list(start.get("headers") or [])
                creation = request.method == "POST" and request.path == MEMORIES
                chunks: list[bytes] = []
                more = True
                if status == 503 or creation:  # small answers, read whole first: `locked`? a new memory's id?
                    while more:
                        m = await messages.get()
                        more = m is not None and m.get("more_body", False)
                        chunks.append(b"" if m is None else m.get("body", b""))
                body = b"".join(chunks)
                if creation and status == 201:  # a new memory (perhaps an id the client did not name): held here
                    await self._hold_created(body)
                yield Start(status, self._headers(headers), status == 503 and _code(body) == "locked")
                if body:
                    yield body
                while more:
                    m = await messages.get()
                    if m is None:
                        break
                    if m.get("body"):
                        yield m["body"]
                    more = m.get("more_body", False)
            except BaseException:  # the gateway went away (its client left) or the answer failed: stop the app
                task.cancel()
                raise
            # the answer's last message is out: the app returns (a streamed answer first stops waiting for a
            # disconnect), and is cancelled if it does not within seconds
            finished, _ = await asyncio.wait({task}, timeout=10)
            if not finished:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

        async def _hold_created(self, body: bytes) -> None:
            created = json.loads(body)
            await self.slot(f"{created['namespace']}/{created['id']}")

        def _headers(self, headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
            return [*headers, (REPLICA_HEADER.encode(), self.replica.encode())]

        async def _run(self, request: Forwarded, messages: asyncio.Queue) -> None:
            scope = {
                "type": "http",
                "asgi": {"version": "3.0", "spec_version": "2.3"},
                "http_version": "1.1",
                "method": request.method,
                "scheme": "http",
                "path": request.path,
                "raw_path": request.raw_path,
                "query_string": request.query_string,
                "root_path": "",
                "headers": request.headers,
                "client": request.client,
                "server": None,
                "state": {},
            }
            delivered = False

            async def receive() -> dict:
                nonlocal delivered
                if not delivered:
                    delivered = True
                    return {"type": "http.request", "body": request.body, "more_body": False}
                await asyncio.Event().wait()  # the client stays until the gateway cancels this call
                return {"type": "http.disconnect"}

            async def send(message: dict) -> None:
                await messages.put(message)

            try:
                await self.app(scope, receive, send)
            finally:
                await messages.put(None)

    deployment: Any = MemoryReplica  # serve.deployment made it a Deployment
    return deployment.options(
        num_replicas=replicas, max_ongoing_requests=max_ongoing, ray_actor_options={"num_cpus": spec.threads}
    ).bind(spec)


def _code(body: bytes) -> str | None:
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    return doc.get("code") if isinstance(doc, dict) else None
