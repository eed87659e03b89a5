"""The MCP server's tools: :data:`TOOLS`, one :class:`MemoryTool` per verb (``add_memory``,
``search_memory``, ``query_memory``, ``update_memory``, ``memory_history``, ``delete_memory``,
``forget_memory``), each with its argument and result models.

The argument models are the HTTP service's request bodies (:mod:`eventkv.service.schemas`) with a
``memory_id`` (and an ``event_id`` where the route has one in its path), so a tool's input schema
has the route's fields, types and limits, and a call is validated as the route validates its body:
strict types (``"3"`` is not a number), unknown fields refused, the same messages. The tools call
the verbs of :class:`eventkv.memory.api.MemoryAPI`, so they run unchanged on a local EventMemory and
on a server's :class:`eventkv.client.Client` (:mod:`eventkv.mcp.backends`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from mcp_types import ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field

from eventkv.errors import Conflict
from eventkv.memory.api import MemoryAPI
from eventkv.memory.records import Hit, MemoryEvent, MemoryRecord
from eventkv.service import schemas
from eventkv.service.routes.events import untaken
from eventkv.service.state import live, not_forgotten

__all__ = ["TOOLS", "MemoryTool"]

MEMORY_ID = (
    "the memory's id in the server's namespace (default: the server's --memory). mem0's agent_id, or "
    "agent_id--run_id for one run of an agent"
)


#: descriptions of the fields several tools share
COMMON = {
    "expected_version": "the memory's version this write expects (refused with conflict when it moved on)",
}


def _described(fields: dict[str, str]) -> Callable[[dict[str, Any], Any], None]:
    """A ``json_schema_extra`` that gives the named properties (and :data:`COMMON`'s) a description
    where the service's model has none: the schema tells an agent what each field is, the validation
    stays the model's."""

    def extra(schema: dict[str, Any], cls: Any) -> None:
        for name, text in {**COMMON, **fields}.items():
            if name in schema["properties"]:
                schema["properties"][name].setdefault("description", text)

    return extra


class _Scoped(BaseModel):
    """A tool's arguments: a memory of the server's namespace."""

    # as the service's bodies: strict types, unknown fields refused
    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra=_described({}))

    memory_id: schemas.Name | None = Field(default=None, description=MEMORY_ID)


class _OnEvent(_Scoped):
    event_id: schemas.EventId = Field(description="the event's id (as add_memory or search_memory gave it)")


EVENT_FIELDS = {
    "text": "the event's text, exactly as it enters the prompt (a turn, a fact, a tool result)",
    "role": "speaker label; the event is rendered 'role: text' (e.g. user, assistant)",
    "id": "the event's id (default: generated, e1, e2, ...); an id given twice is refused",
    "tags": "free labels kept with the event ('header' starts a group: see search_memory's with_headers)",
    "budget": "positions the event reserves (at least its tokens); default: its tokens",
    "kind": "'event', or 'carrier' for an answer-free carrier event",
    "when": "when it happened (e.g. '2023-05-08'): stored as '[8 May 2023] text', 'yesterday' etc. dated after them",
    "prefill": "compute the event's KV rows now (default: at the next query or search that needs them)",
}


class AddMemory(_Scoped, schemas.EventIn):
    """Store one event (a turn, a fact); the memory is created when it does not exist yet."""

    model_config = ConfigDict(json_schema_extra=_described(EVENT_FIELDS))

    prefill: bool = False
    expected_version: schemas.Version | None = None


class SearchMemory(_Scoped, schemas.SearchIn):
    """The events a query is served, ranked."""


QUERY_FIELDS = {
    "question": "the question, answered by the model from the served events' stored KV rows",
    "select": "which events are served: null (the selector's best events within the budget, shaped), 'view', 'all' "
    "or a list of event ids",
    "mode": "how the served events are read: compact (their rows), native, isolated, text (re-prefilled) or blend",
    "candidates": "answers to score by log-probability (nats), besides the greedy answer",
    "max_new_tokens": "greedy decoding budget, in tokens",
    "positions": "where served rows sit: 'contiguous' (after the header; the default, null, where the model allows) "
    "or 'original' (where they were computed)",
    "order": "with positions 'contiguous': 'log' (history order) or 'relevance' (the most relevant event last); "
    "null: relevance for a selector's choice at contiguous positions, else log",
}


class QueryMemory(_Scoped, schemas.QueryIn):
    """An answer from the memory's served rows."""

    model_config = ConfigDict(json_schema_extra=_described(QUERY_FIELDS))


class UpdateMemory(_OnEvent, schemas.UpdateEvent):
    """Append a patch to an event (its history is kept)."""

    model_config = ConfigDict(
        json_schema_extra=_described(
            {
                "text": "the event's new text (served instead of the old)",
                "prefill": EVENT_FIELDS["prefill"],
                "when": EVENT_FIELDS["when"],
            }
        )
    )


class MemoryHistory(_OnEvent):
    """An event and its patches."""


class DeleteMemory(_OnEvent, schemas.Write):
    """Tombstone an event."""


class ForgetMemory(_OnEvent, schemas.Write):
    """Purge an event's text and rows."""


# ---------------------------------------------------------------------- results
class Written(BaseModel):
    memory_id: str
    id: str = Field(description="the event's id (an update: the patch's)")
    position: int = Field(description="its first RoPE position")
    width: int = Field(description="positions it reserves")
    version: int = Field(description="the memory's version after the write (for expected_version)")


class Hits(BaseModel):
    memory_id: str
    results: list[Hit] = Field(description="the served events, best first (score never increases)")


class Answer(schemas.AnswerOut):
    memory_id: str


class History(BaseModel):
    memory_id: str
    events: list[MemoryRecord] = Field(description="the event and its patches, oldest first")


class Changed(BaseModel):
    memory_id: str
    version: int = Field(description="the memory's version after the write")
    rows: int | None = Field(default=None, description="forget: the rows recomputed")


# ---------------------------------------------------------------------- the verbs
def _checks(mem: MemoryAPI) -> bool:
    """Whether the routes' state checks run here: a local memory gets them (they tell an unknown,
    taken, deleted or forgotten event apart as the routes do); a server runs them itself."""
    from eventkv.memory import EventMemory

    return isinstance(mem, EventMemory)


def add(mem: MemoryAPI, a: AddMemory, mid: str) -> Written:
    event = MemoryEvent(a.text, a.role, a.id, tuple(a.tags), a.budget, a.kind, a.when)
    if _checks(mem):
        _expect(mem, a.expected_version)
        untaken(mem, [event.id] if event.id is not None else [])
    kw = {} if _checks(mem) else {"expected_version": a.expected_version}
    added = mem.add([event], prefill=a.prefill, **kw)[0]
    return Written(memory_id=mid, id=added.id, position=added.position, width=added.width, version=mem.version)


def search(mem: MemoryAPI, a: SearchMemory, mid: str) -> Hits:
    return Hits(memory_id=mid, results=mem.search(a.query, a.k, **a.options().shaping()))


def query(mem: MemoryAPI, a: QueryMemory, mid: str) -> Answer:
    # the memory refuses an unknown or forgotten event and nothing to serve (NotFound, Gone, Conflict)
    q = a.query()
    answer = mem.query(
        q.question, q.select, candidates=q.candidates, max_new_tokens=q.max_new_tokens, **q.options.keywords()
    )
    return Answer(**schemas.AnswerOut.from_answer(answer, mem.version).model_dump(), memory_id=mid)


def update(mem: MemoryAPI, a: UpdateMemory, mid: str) -> Written:
    if _checks(mem):
        _expect(mem, a.expected_version)
        live(mem, a.event_id, "updated", root=True)
    kw = {} if _checks(mem) else {"expected_version": a.expected_version}
    patch = mem.update(a.event_id, a.text, prefill=a.prefill, when=a.when, **kw)
    return Written(memory_id=mid, id=patch.id, position=patch.position, width=patch.width, version=mem.version)


def history(mem: MemoryAPI, a: MemoryHistory, mid: str) -> History:
    return History(memory_id=mid, events=mem.history(a.event_id))


def delete(mem: MemoryAPI, a: DeleteMemory, mid: str) -> Changed:
    if _checks(mem):
        _expect(mem, a.expected_version)
        live(mem, a.event_id, "deleted again")
        mem.delete(a.event_id)
    else:
        mem.delete(a.event_id, expected_version=a.expected_version)  # type: ignore[call-arg]  # Client's keyword
    return Changed(memory_id=mid, version=mem.version)


def forget(mem: MemoryAPI, a: ForgetMemory, mid: str) -> Changed:
    if _checks(mem):
        _expect(mem, a.expected_version)
        if not mem.store.purge_pending:  # type: ignore[attr-defined]  # forgetting again completes a pending purge
            not_forgotten(mem, a.event_id, "forgotten again")
        rows = mem.forget(a.event_id)
    else:
        rows = mem.forget(a.event_id, expected_version=a.expected_version)  # type: ignore[call-arg]
    return Changed(memory_id=mid, version=mem.version, rows=rows)


def _expect(mem: MemoryAPI, expected: int | None) -> None:
    """Conflict unless the memory is at version ``expected`` (None: no check), as the routes check."""
    if expected is not None and mem.version != expected:
        raise Conflict(
            f"the memory is at version {mem.version}, the write expected {expected}: read it again and retry."
        )


@dataclass(frozen=True)
class MemoryTool:
    """One MCP tool: its ``name``, ``title`` and ``description`` (what an agent reads), its argument
    model ``args`` (the input schema and the validation) and result model ``result`` (the output
    schema), ``verb(memory, arguments, memory id)`` and whether it ``creates`` a missing memory."""

    name: str
    title: str
    description: str
    args: type[_Scoped]
    result: type[BaseModel]
    verb: Callable[[MemoryAPI, Any, str], BaseModel]
    creates: bool = False
    annotations: ToolAnnotations | None = None


READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)
WRITES = ToolAnnotations(read_only_hint=False, destructive_hint=False, open_world_hint=False)
DESTROYS = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)

#: every tool of the server, in the order ``tools/list`` gives them
TOOLS: tuple[MemoryTool, ...] = (
    MemoryTool(
        "add_memory",
        "Add a memory",
        "Store one event (a conversation turn, a fact, a tool result) in the memory, verbatim: no summarising "
        "or extraction. The memory is created when it does not exist. Cheap: the event is tokenized and "
        "committed; its KV rows are computed once, at the next query that needs them (or now with prefill). "
        "Returns the event's id and the memory's version.",
        AddMemory,
        Written,
        add,
        creates=True,
        annotations=WRITES,
    ),
    MemoryTool(
        "search_memory",
        "Search the memory",
        "The stored events most relevant to a query, ranked by the memory's selector (BM25 by default), best "
        "first, each with its id, text and score: for composing a prompt from the memory yourself.",
        SearchMemory,
        Hits,
        search,
        annotations=READ_ONLY,
    ),
    MemoryTool(
        "query_memory",
        "Ask the memory",
        "Answer a question with the served model from the stored KV rows of the most relevant events (no "
        "re-reading of their text). Returns the answer, the served event ids and the memory's version.",
        QueryMemory,
        Answer,
        query,
        annotations=READ_ONLY,
    ),
    MemoryTool(
        "update_memory",
        "Update a memory",
        "Give an event new text: a patch is appended and served instead of the event; the old text stays in "
        "its history (memory_history).",
        UpdateMemory,
        Written,
        update,
        annotations=WRITES,
    ),
    MemoryTool(
        "memory_history",
        "A memory's history",
        "An event and its patches, oldest first, with their flags (deleted, forgotten, pinned).",
        MemoryHistory,
        History,
        history,
        annotations=READ_ONLY,
    ),
    MemoryTool(
        "delete_memory",
        "Delete a memory",
        "Tombstone an event: it is no longer served or searched; its record (and text) stays in the store, "
        "for the history. To remove the text itself, use forget_memory.",
        DeleteMemory,
        Changed,
        delete,
        annotations=DESTROYS,
    ),
    MemoryTool(
        "forget_memory",
        "Forget a memory",
        "The privacy path: purge an event's text and KV rows from every file of the store (later events' rows "
        "are recomputed without it); only a marker of its id is kept.",
        ForgetMemory,
        Changed,
        forget,
        annotations=DESTROYS,
    ),
)
