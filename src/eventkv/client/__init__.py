"""A Python client for ``eventkv serve``, on httpx. It mirrors
:class:`eventkv.memory.EventMemory` verb for verb and returns the same record types, so code written
against the library runs against a server by swapping the object::

    mem = Client.create("http://127.0.0.1:8000", memory_id="agent-7", instruction="...")
    mem.add(["Dana lives in Lisbon."])
    mem.query("Where does Dana live?").text

Every write also takes ``expected_version=`` (the server answers 409 when the memory has moved on).
An HTTP error raises :class:`ServiceError` (an EventKVError) with the server's ``status``, ``code``
and ``message``; it is also an instance of the exception the answer stands for (:data:`ERRORS`), so
``except StoreDamaged`` or ``except NotFound`` catches the same failure from the library and from a
server. Needs the ``server`` extra (httpx).

The wire's constants (the namespace header, the error codes with their HTTP statuses, the exceptions
both sides raise) live in :mod:`eventkv.wire`, which the service imports too."""

from __future__ import annotations

import builtins
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence
from urllib.parse import quote

from eventkv.errors import Conflict, EventKVError, Gone, NotFound, OutOfSpace, PurgePending, StoreDamaged
from eventkv.kv.serve import PositionMode, ServeMode, ServeOrder
from eventkv.memory.api import MemoryAPI, SelectSpec
from eventkv.memory.query import SHAPING, QueryOptions
from eventkv.memory.records import Added, CarrierResult, Hit, MemoryAnswer, MemoryEvent, MemoryRecord, MemoryStats
from eventkv.wire import (
    DEFAULT_NAMESPACE,
    ERRORS,
    NAMESPACE_HEADER,
    Forbidden,
    InternalError,
    InvalidRequest,
    MethodNotAllowed,
    QueueFull,
    Refused,
    RequestTimeout,
    RequestTooLarge,
    ServiceError,
    ShuttingDown,
    Unauthorized,
    error_for,
    scope,
)

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.kv.blend import BlendSchedule
    from eventkv.memory.select import Selector

__all__ = [
    "Client",
    "Conflict",
    "DEFAULT_NAMESPACE",
    "ERRORS",
    "EventKVError",
    "Forbidden",
    "Gone",
    "InternalError",
    "InvalidRequest",
    "MethodNotAllowed",
    "NAMESPACE_HEADER",
    "NotFound",
    "OutOfSpace",
    "PurgePending",
    "QueueFull",
    "Refused",
    "RequestTimeout",
    "RequestTooLarge",
    "ServiceError",
    "ShuttingDown",
    "StoreDamaged",
    "Unauthorized",
    "error_for",
]


def _seg(x: str) -> str:
    """One URL path segment: every character but letters, digits, ``_``, ``-`` and ``~`` percent-encoded
    (``/`` too, and ``.``, so HTTP clients cannot fold ``.`` or ``..`` away as dot segments)."""
    return quote(str(x), safe="").replace(".", "%2E")


def _record(d: dict) -> MemoryRecord:
    return MemoryRecord(**{**d, "tags": tuple(d["tags"])})


def _added(d: dict) -> Added:
    return Added(d["id"], d["position"], d["width"])


class Client:
    """One memory on an eventkv server (see the module docstring). Implements
    :class:`eventkv.memory.api.MemoryAPI` (as :class:`eventkv.memory.EventMemory` does), plus
    ``expected_version=`` on every write (see :mod:`eventkv.memory.api` for the deliberate
    differences).

    Args:
        url: the server, e.g. ``http://127.0.0.1:8000``.
        memory_id: the memory's id in ``namespace``.
        token: bearer token (when the server has a token file).
        namespace: the request scope (header ``X-EventKV-Namespace``).
        timeout: seconds per request (model work can queue behind other clients).
        http: an ``httpx.Client`` to use instead of a new one (its base URL and headers are kept).
    """

    def __init__(
        self,
        url: str,
        memory_id: str,
        *,
        token: str | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        timeout: float = 600.0,
        http: Any = None,
    ) -> None:
        try:
            import httpx
        except ImportError:
            raise EventKVError("the memory client needs httpx: pip install 'eventkv[server]'.") from None
        headers = {NAMESPACE_HEADER: namespace}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        self._own = http is None
        self.http = http or httpx.Client(base_url=url, headers=headers, timeout=timeout)
        self.memory_id = memory_id
        self.namespace = namespace
        self._base = f"/v1/memories/{_seg(memory_id)}"

    # ------------------------------------------------------------------ plumbing
    def _call(self, method: str, path: str, json: Any = None, params: dict | None = None) -> Any:
        r = self.http.request(method, path, json=json, params=params)
        if r.status_code >= 400:
            try:
                body = r.json()
                code, message = str(body["code"]), str(body["message"])
            except (
                ValueError,
                TypeError,
                KeyError,
            ):  # not the service's JSON body (a proxy's page, uvicorn's plain 503)
                code, message = "error", r.text
            raise error_for(r.status_code, code, message)
        return r.json()

    def close(self) -> None:
        """Close the HTTP connection pool (the memory stays on the server)."""
        if self._own:
            self.http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ create / open / destroy
    @classmethod
    def create(
        cls,
        url: str,
        memory_id: str | None = None,
        *,
        namespace: str = DEFAULT_NAMESPACE,
        instruction: str | None = None,
        contract: str | Path | dict | None = None,
        model: str | None = None,
        rows: str | None = None,
        token: str | None = None,
        timeout: float = 600.0,
    ) -> "Client":
        """Create a memory on the server (``POST /v1/memories``) and return its client.

        Args:
            contract: the model's contract.json (path or parsed) for ``carrier(kind="auto")``.
            model: when given, the server refuses (422) unless it serves this model.
            rows: the store's row format, ``native`` (the server's default), ``int8`` or ``int4``
                (:meth:`eventkv.memory.EventMemory.create`).

        Raises:
            ServiceError: 409 the id is taken; 422 a bad id, namespace, model or contract.
        """
        if isinstance(contract, (str, Path)):
            import json

            contract = json.loads(Path(contract).read_text())
        client = cls(url, "", token=token, namespace=namespace, timeout=timeout)
        body = {"id": memory_id, "instruction": instruction, "contract": contract, "model": model, "rows": rows}
        try:
            out = client._call("POST", "/v1/memories", {k: v for k, v in body.items() if v is not None})
        except BaseException:
            client.close()
            raise
        client.memory_id, client._base = out["id"], f"/v1/memories/{_seg(out['id'])}"
        return client

    @classmethod
    def open(
        cls, url: str, memory_id: str, *, namespace: str = DEFAULT_NAMESPACE, token: str | None = None, timeout=600.0
    ):
        """The client of an existing memory.

        Raises:
            ServiceError: 404 no such memory in ``namespace``.
        """
        client = cls(url, memory_id, token=token, namespace=namespace, timeout=timeout)
        try:
            client._call("GET", client._base)
        except BaseException:
            client.close()
            raise
        return client

    @classmethod
    def scoped(
        cls,
        url: str,
        *,
        user_id: str | None = None,
        agent_id: str | None = None,
        run_id: str | None = None,
        instruction: str | None = None,
        token: str | None = None,
        timeout: float = 600.0,
    ) -> "Client":
        """The client of the memory of mem0's scopes (:func:`eventkv.wire.scope`: namespace
        ``user_id``, memory id ``agent_id`` or ``agent_id--run_id``), created (with ``instruction``)
        when the namespace has no such memory yet.

        Raises:
            OptionError: a scope that is not a name, or ids that do not join (:func:`eventkv.wire.scope`).
            ServiceError: as :meth:`open` and :meth:`create`.
        """
        namespace, memory_id = scope(user_id, agent_id, run_id)
        try:
            return cls.open(url, memory_id, namespace=namespace, token=token, timeout=timeout)
        except NotFound:
            pass
        try:
            return cls.create(
                url, memory_id, namespace=namespace, instruction=instruction, token=token, timeout=timeout
            )
        except Conflict:  # created by another client in between
            return cls.open(url, memory_id, namespace=namespace, token=token, timeout=timeout)

    def destroy(self, *, expected_version: int | None = None) -> None:
        """Delete the whole memory on the server (its files are removed)."""
        self._call(
            "DELETE", self._base, params=None if expected_version is None else {"expected_version": expected_version}
        )

    # ------------------------------------------------------------------ writes (EventMemory's verbs)
    def add(
        self,
        events: Iterable[MemoryEvent | dict | str] | MemoryEvent | dict | str,
        *,
        prefill: bool = False,
        expected_version: int | None = None,
    ) -> list[Added]:
        """As :meth:`EventMemory.add`."""
        if isinstance(events, (str, dict, MemoryEvent)):
            events = [events]
        evs = [MemoryEvent.coerce(e) for e in events]
        body = {
            "events": [
                {
                    k: v
                    for k, v in {
                        "text": e.text,
                        "role": e.role,
                        "id": e.id,
                        "tags": list(e.tags),
                        "budget": e.budget,
                        "kind": e.kind,
                        "when": e.when,
                    }.items()
                    if v is not None
                }
                for e in evs
            ],
            "prefill": prefill,
            "expected_version": expected_version,
        }
        return [_added(a) for a in self._call("POST", f"{self._base}/events", body)["added"]]

    def prefill(self, *, expected_version: int | None = None) -> int:
        """As :meth:`EventMemory.prefill`: rows computed."""
        return self._call("POST", f"{self._base}/prefill", {"expected_version": expected_version})["rows"]

    def update(
        self,
        event_id: str,
        text: str,
        *,
        prefill: bool = False,
        when: str | date | None = None,
        expected_version: int | None = None,
    ) -> Added:
        """As :meth:`EventMemory.update`: the patch event."""
        body: dict[str, Any] = {"text": text, "prefill": prefill, "expected_version": expected_version}
        if when is not None:
            body["when"] = MemoryEvent(text, when=when).when
        return _added(self._call("POST", f"{self._base}/events/{_seg(event_id)}/update", body)["added"][0])

    def delete(self, event_id: str, *, expected_version: int | None = None) -> None:
        """As :meth:`EventMemory.delete` (tombstone)."""
        self._call("POST", f"{self._base}/events/{_seg(event_id)}/delete", {"expected_version": expected_version})

    def forget(self, event_id: str, *, expected_version: int | None = None) -> int:
        """As :meth:`EventMemory.forget`: rows recomputed."""
        return self._call(
            "POST", f"{self._base}/events/{_seg(event_id)}/forget", {"expected_version": expected_version}
        )["rows"]

    def pin(self, event_id: str, pinned: bool = True, *, expected_version: int | None = None) -> None:
        """As :meth:`EventMemory.pin`."""
        body = {"pinned": pinned, "expected_version": expected_version}
        self._call("POST", f"{self._base}/events/{_seg(event_id)}/pin", body)

    def rebase(self, *, expected_version: int | None = None) -> int:
        """As :meth:`EventMemory.rebase`: rows computed."""
        return self._call("POST", f"{self._base}/rebase", {"expected_version": expected_version})["rows"]

    def carrier(
        self,
        sources: Sequence[str],
        subject: str,
        kind: str = "auto",
        *,
        prefill: bool = False,
        expected_version: int | None = None,
    ) -> CarrierResult:
        """As :meth:`EventMemory.carrier`."""
        ids = [sources] if isinstance(sources, str) else list(sources)
        body = {
            "sources": ids,
            "subject": subject,
            "kind": kind,
            "prefill": prefill,
            "expected_version": expected_version,
        }
        out = self._call("POST", f"{self._base}/carriers", body)
        added = _added(out["added"]) if out["added"] else None
        return CarrierResult(out["kind"], added, tuple(out["pinned"]), out["reason"])

    # ------------------------------------------------------------------ reads
    @property
    def version(self) -> int:
        """The memory's write counter (what ``expected_version`` compares with)."""
        return self._call("GET", self._base)["version"]

    @property
    def rows_format(self) -> str:
        """The format the memory's store keeps its rows in (``native``, ``int8`` or ``int4``), chosen at create."""
        return self._call("GET", self._base).get("rows", "native")

    def stats(self) -> MemoryStats:
        """As :meth:`EventMemory.stats`."""
        return MemoryStats(**self._call("GET", self._base)["stats"])

    def get(self, event_id: str) -> MemoryRecord:
        """As :meth:`EventMemory.get`."""
        return _record(self._call("GET", f"{self._base}/events/{_seg(event_id)}"))

    def history(self, event_id: str) -> list[MemoryRecord]:
        """As :meth:`EventMemory.history`."""
        return [_record(r) for r in self._call("GET", f"{self._base}/events/{_seg(event_id)}/history")]

    def list(self, include_superseded: bool = False, include_deleted: bool = False) -> list[MemoryRecord]:
        """As :meth:`EventMemory.list`."""
        params = {"include_superseded": include_superseded, "include_deleted": include_deleted}
        return [_record(r) for r in self._call("GET", f"{self._base}/events", params=params)]

    def view_ids(self) -> builtins.list[str]:
        """As :meth:`EventMemory.view_ids`."""
        return self._call("GET", f"{self._base}/view")

    def select(
        self,
        question: str,
        k: int | None = None,
        budget_rows: int | None = None,
        *,
        selector: Selector | str | None = None,
        budget: float | None = None,
        neighbours: int = 0,
        with_headers: bool = True,
    ) -> builtins.list[str]:
        """As :meth:`EventMemory.select` (``selector``: a registered name; the server answers 422 for
        another).

        Raises:
            OptionError: ``selector`` is not a name (a Selector object cannot travel).
        """
        options = QueryOptions(
            k=k,
            budget_rows=budget_rows,
            selector=selector,
            budget=budget,
            neighbours=neighbours,
            with_headers=with_headers,
        )
        return self._call("POST", f"{self._base}/select", {"question": question, **options.body("k", *SHAPING)})

    def search(
        self,
        query: str,
        k: int | None = None,
        budget_rows: int | None = None,
        *,
        selector: Selector | str | None = None,
        budget: float | None = None,
        neighbours: int = 0,
        with_headers: bool = True,
    ) -> builtins.list[Hit]:
        """As :meth:`EventMemory.search` (``POST .../search``; ``selector`` as in :meth:`select`).

        Raises:
            OptionError: ``selector`` is not a name (a Selector object cannot travel).
        """
        options = QueryOptions(
            k=k,
            budget_rows=budget_rows,
            selector=selector,
            budget=budget,
            neighbours=neighbours,
            with_headers=with_headers,
        )
        out = self._call("POST", f"{self._base}/search", {"query": query, **options.body("k", *SHAPING)})
        return [Hit(**{**h, "tags": tuple(h["tags"])}) for h in out]

    def query(
        self,
        question: str,
        select: SelectSpec = None,
        k: int | None = None,
        mode: ServeMode = "compact",
        candidates: Sequence[str] | None = None,
        max_new_tokens: int = 32,
        *,
        # selection: passed to select() when select is None
        budget_rows: int | None = None,
        selector: Selector | str | None = None,
        budget: float | None = None,
        neighbours: int = 0,
        with_headers: bool = True,
        # serving positions and the served rows' order under contiguous positions
        positions: PositionMode | None = None,
        order: ServeOrder | None = None,
        # selective recompute (mode "blend")
        recompute: float | None = None,
        blend_schedule: BlendSchedule | None = None,
    ) -> MemoryAnswer:
        """As :meth:`EventMemory.query` (``keep_logits`` is library-only: logits do not travel;
        ``selector`` as in :meth:`select`)."""
        from eventkv.kv.readout import CandidateScore, Generation

        options = QueryOptions(
            k=k,
            budget_rows=budget_rows,
            selector=selector,
            budget=budget,
            neighbours=neighbours,
            with_headers=with_headers,
            mode=mode,
            positions=positions,
            order=order,
            recompute=recompute,
            blend_schedule=blend_schedule,
        )
        body = {
            "question": question,
            "select": select if select is None or isinstance(select, str) else list(select),
            "candidates": list(candidates) if candidates else None,
            "max_new_tokens": max_new_tokens,
            **options.body(),
        }
        out = self._call("POST", f"{self._base}/query", body)
        return MemoryAnswer(
            text=out["text"],
            generation=Generation(out["tokens"], out["text"], out["stopped"]),
            candidates=[CandidateScore(**c) for c in out["candidates"]],
            served_ids=out["served_ids"],
            positions=[tuple(p) for p in out["positions"]],
            n_rows_served=out["n_rows_served"],
            timings_ms=out["timings_ms"],
            plan=out.get("plan", {}),
        )


if TYPE_CHECKING:  # mypy checks Client against the protocol it implements
    _implements: type[MemoryAPI] = Client
