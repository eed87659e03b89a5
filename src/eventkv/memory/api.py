"""The verbs every memory front end speaks: :class:`MemoryAPI`, implemented by the library's
:class:`eventkv.memory.EventMemory` and by the HTTP client of ``eventkv serve``,
:class:`eventkv.client.Client`, with the same parameters and the same record types
(:mod:`eventkv.memory.records`), so code written against one runs against the other.

Deliberate differences, each a keyword-only parameter with a default that one side adds:

- ``expected_version=`` on every write of the client: the server answers 409 when the memory has
  moved on (optimistic concurrency between HTTP clients; a library memory has one writer).
- ``purge_wait_s=`` on :meth:`EventMemory.forget`: how long the purge waits for readers; the server
  uses the default and answers 503 ``purge_pending`` when a reader blocks it.
- ``keep_logits=`` on :meth:`EventMemory.query`: logits stay in the process (they do not travel).
- ``messages=`` and ``decoding=`` on :meth:`EventMemory.query`: a chat conversation read in place of
  the question, and sampling / stop strings; over HTTP they are the OpenAI-compatible
  ``POST /v1/chat/completions`` (``docs/service.md``), not the query route.

One parameter takes less over HTTP: ``selector=`` of ``select``, ``search`` and ``query`` is a registered name
only on the client (a :class:`eventkv.memory.select.Selector` object does not travel).

Beyond the protocol, the library has ``directory``, ``namespace`` (the store's tenant),
``query_batch``, a typed query's ``ask``, ``prepare_query`` and ``finish_query`` (the phases a batched
readout runs apart: :class:`eventkv.memory.query.MemoryQuery`), ``selection`` and ``event_log``;
the client has ``destroy``, ``memory_id`` and ``namespace`` (the request scope). Creating and
opening differ too (a directory and a model, or a URL).
"""

from __future__ import annotations

import builtins
from datetime import date
from typing import TYPE_CHECKING, Iterable, Literal, Protocol, Sequence, runtime_checkable

from eventkv.kv.blend import BlendSchedule
from eventkv.kv.serve import PositionMode, ServeMode, ServeOrder
from eventkv.memory.records import Added, CarrierResult, Hit, MemoryAnswer, MemoryEvent, MemoryRecord, MemoryStats

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.memory.select import Selector

#: which events a query serves: None (the selector's top ``k`` + pins), ``"view"``, ``"all"``, or ids
SelectSpec = None | Literal["all", "view"] | Sequence[str]


@runtime_checkable
class MemoryAPI(Protocol):
    """One memory's verbs (see :class:`eventkv.memory.EventMemory` for what each does and raises)."""

    @property
    def version(self) -> int:
        """The write counter: bumped by every committed write that changes the events."""
        ...

    @property
    def rows_format(self) -> str:
        """The format the store keeps its rows in (``native``, ``int8`` or ``int4``), chosen at create."""
        ...

    def add(
        self, events: Iterable[MemoryEvent | dict | str] | MemoryEvent | dict | str, *, prefill: bool = False
    ) -> list[Added]: ...

    def prefill(self) -> int: ...

    def update(self, event_id: str, text: str, *, prefill: bool = False, when: str | date | None = None) -> Added: ...

    def delete(self, event_id: str) -> None: ...

    def pin(self, event_id: str, pinned: bool = True) -> None: ...

    def forget(self, event_id: str) -> int: ...

    def rebase(self) -> int: ...

    def carrier(
        self, sources: Sequence[str], subject: str, kind: str = "auto", *, prefill: bool = False
    ) -> CarrierResult: ...

    def get(self, event_id: str) -> MemoryRecord: ...

    def history(self, event_id: str) -> list[MemoryRecord]: ...

    def list(self, include_superseded: bool = False, include_deleted: bool = False) -> list[MemoryRecord]: ...

    def view_ids(self) -> builtins.list[str]: ...

    def stats(self) -> MemoryStats: ...

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
    ) -> builtins.list[str]: ...

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
    ) -> builtins.list[Hit]: ...

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
    ) -> MemoryAnswer: ...

    def close(self) -> None: ...
