"""Where the MCP server's tools find their memories: :class:`LocalStore` (EventMemory stores under
a directory, on one model thread, as ``eventkv serve`` keeps them) or :class:`RemoteServer` (a
running ``eventkv serve``, through :class:`eventkv.client.Client`). Both hand a tool a
:class:`eventkv.memory.api.MemoryAPI`, so the tools are written once against the protocol."""

from __future__ import annotations

import asyncio
import functools
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol, TypeVar

from eventkv.errors import Conflict, EventKVError, NotFound
from eventkv.kv.quant import check_row_format
from eventkv.memory.store import remove_leftovers
from eventkv.service.errors import scrub
from eventkv.service.worker import ModelWorker
from eventkv.wire import DEFAULT_NAMESPACE, ServiceError, check_name

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.client import Client
    from eventkv.memory.api import MemoryAPI
    from eventkv.models.profile import LoadedModel

T = TypeVar("T")

__all__ = ["Backend", "LocalStore", "RemoteServer"]


class Backend(Protocol):
    """What the tools run on: a verb on one memory of the backend's namespace."""

    namespace: str

    async def run(self, memory_id: str, verb: Callable[[MemoryAPI], T], *, create: bool = False) -> T:
        """``verb(memory)`` on memory ``memory_id`` (``create``: made, empty, when absent).

        Raises:
            NotFound: no such memory and ``create`` is False. OptionError: a bad memory id.
            Whatever ``verb`` raises.
        """
        ...

    def scrub(self, message: str) -> str:
        """``message`` without the backend's paths (a client knows its memories by id)."""
        ...

    def close(self) -> None:
        """Let go of every memory (the stores stay on disk / on the server)."""
        ...


class LocalStore:
    """EventMemory stores under ``root``: ``root/<namespace>/<memory id>/`` is one store, the layout
    of ``eventkv serve --store root``. Every verb runs on one :class:`eventkv.service.worker.ModelWorker`
    thread, in arrival order (the model and an open EventMemory are not thread-safe), which keeps up
    to ``max_open`` memories open.

    Args:
        lm: the model every memory is read with (a store made by other weights is refused).
        root: the store root. namespace: the one namespace this backend serves.
        instruction: the header instruction of a memory made by ``create``.
        rows: the row format of a memory made by ``create`` (``native``, ``int8``, ``int4``: docs/memory.md).
        max_queue, max_open: as ``eventkv serve``'s ``--max-queue`` and ``--max-open``.

    Raises:
        OptionError: ``namespace`` is not a name.
    """

    def __init__(
        self,
        lm: LoadedModel,
        root: str | Path,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        instruction: str | None = None,
        rows: str = "native",
        max_queue: int = 64,
        max_open: int = 16,
    ) -> None:
        self.lm, self.root = lm, Path(root)
        self.namespace = check_name(namespace, "namespace")
        self.instruction, self.rows = instruction, check_row_format(rows)
        self.base = self.root / self.namespace
        self.base.mkdir(parents=True, exist_ok=True)
        remove_leftovers(self.base)  # what creations killed mid-way left
        self.worker = ModelWorker(lm, max_queue, max_open)

    async def run(self, memory_id: str, verb: Callable[[MemoryAPI], T], *, create: bool = False) -> T:
        d = self.base / check_name(memory_id, "memory id")

        def job() -> T:
            if not (d / "manifest.json").is_file():
                if not create:
                    raise NotFound(
                        f"no memory {memory_id!r} in namespace {self.namespace!r}: add an event to it first "
                        "(add_memory creates it)."
                    )
                from eventkv.memory import EventMemory

                remove_leftovers(self.base, memory_id)
                # atomic: built aside and renamed into place
                mem = EventMemory.create(
                    d, self.lm, namespace=self.namespace, instruction=self.instruction, rows=self.rows
                )
                self.worker.adopt(d, mem)
            return verb(self.worker.memory(d))

        return await asyncio.wrap_future(self.worker.submit(job))

    def scrub(self, message: str) -> str:
        return scrub(message, self.root)

    def close(self) -> None:
        self.worker.stop()


class RemoteServer:
    """A running ``eventkv serve`` at ``url``: each memory id gets one :class:`eventkv.client.Client`
    (scoped to ``namespace``, with the bearer ``token``), and each verb runs on a thread of its own,
    so a slow answer does not hold the others up (the server queues model work itself). A memory that
    ``create`` makes stores its rows in format ``rows``."""

    def __init__(
        self,
        url: str,
        namespace: str = DEFAULT_NAMESPACE,
        *,
        token: str | None = None,
        timeout: float = 600.0,
        rows: str = "native",
    ) -> None:
        self.url, self.token, self.timeout, self.rows = url, token, timeout, check_row_format(rows)
        self.namespace = check_name(namespace, "namespace")
        self._clients: dict[str, Client] = {}
        self._known: set[str] = set()  # memory ids made or seen by a create
        self._lock = threading.Lock()

    def client(self, memory_id: str) -> Client:
        """The client of memory ``memory_id`` (made once; it checks nothing until a verb runs)."""
        from eventkv.client import Client

        check_name(memory_id, "memory id")
        with self._lock:
            if memory_id not in self._clients:
                self._clients[memory_id] = Client(
                    self.url, memory_id, token=self.token, namespace=self.namespace, timeout=self.timeout
                )
            return self._clients[memory_id]

    def health(self, timeout: float = 10.0) -> dict[str, Any]:
        """The server's ``GET /health`` (``status``, ``model``, ``queue_depth``).

        Raises:
            EventKVError: no answer within ``timeout`` seconds, or not a health answer.
        """
        import httpx

        try:
            r = httpx.get(self.url.rstrip("/") + "/health", timeout=timeout)
            body = r.json()
            if r.status_code != 200 or body.get("status") != "ok":
                raise ValueError(r.text[:200])
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            raise EventKVError(
                f"no eventkv server answers at {self.url} ({type(exc).__name__}: {exc}): start it with "
                "`eventkv serve`, or give its URL."
            ) from None
        return body

    def _created(self, memory_id: str) -> None:
        """Create memory ``memory_id`` on the server unless it exists."""
        from eventkv.client import Client

        kw: dict[str, Any] = {"namespace": self.namespace, "token": self.token, "timeout": self.timeout}
        try:
            Client.open(self.url, memory_id, **kw).close()
        except NotFound:
            try:
                Client.create(self.url, memory_id, rows=self.rows, **kw).close()
            except Conflict:  # made by another client in between
                pass

    async def run(self, memory_id: str, verb: Callable[[MemoryAPI], T], *, create: bool = False) -> T:
        import anyio.to_thread

        def call() -> T:
            import httpx

            try:
                return attempt()
            except httpx.TransportError as exc:  # no answer at all: not the server's error body
                raise ServiceError(
                    503, "unavailable", f"the eventkv server at {self.url} does not answer ({exc}): is it running?"
                ) from None

        def attempt() -> T:
            if create and memory_id not in self._known:
                self._created(memory_id)
                self._known.add(memory_id)
            try:
                return verb(self.client(memory_id))
            except NotFound:
                if not create:
                    raise
                # the memory was deleted since it was made here: make it again, once
                self._known.discard(memory_id)
                self._created(memory_id)
                self._known.add(memory_id)
                return verb(self.client(memory_id))

        return await anyio.to_thread.run_sync(functools.partial(call))

    def scrub(self, message: str) -> str:
        return message  # the server scrubbed its paths already

    def close(self) -> None:
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()
