"""The events of a memory: ``POST .../events`` (add, on the worker), the reads ``GET .../events``,
``GET .../view``, ``GET .../events/{eid}`` and ``GET .../events/{eid}/history`` (the committed
state, read without the worker), and the verbs ``POST .../events/{eid}/update``, ``delete``,
``forget`` and ``pin`` (on the worker, after the version and event checks: 404 for an unknown
event, 410 for one the verb needs live)."""

from __future__ import annotations

from typing import Annotated, Callable

from fastapi import APIRouter
from fastapi import Path as PathParam

from eventkv.errors import Conflict, EventKVError, NotFound, OptionError, StoreDamaged
from eventkv.memory.reader import read_memory
from eventkv.memory.records import MemoryEvent
from eventkv.service import schemas
from eventkv.service.errors import MEMORY, QUEUED, responses
from eventkv.service.state import Jobs, MemoryId, Namespace, ServiceState, State, Work, live, not_forgotten

router = APIRouter(tags=["events"])

#: an event id in a path: no ``/``, no NUL (``.`` and ``..`` travel percent-encoded, as the client sends them)
EventIdPath = Annotated[
    str, PathParam(min_length=1, max_length=schemas.MAX_ID, pattern=r"^[^/\x00]+$", description="an event id")
]

EVENT = responses(*QUEUED, 410)


def check_event_id(eid: str) -> str:
    """``eid`` if it can be an event id.

    Raises:
        OptionError: longer than :data:`eventkv.service.schemas.MAX_ID` characters, or a NUL in it.
    """
    if len(eid) > schemas.MAX_ID or "\x00" in eid:
        raise OptionError("event id", eid[:80], f"give an event id of at most {schemas.MAX_ID} characters, no NUL.")
    return eid


def untaken(mem, ids) -> None:
    """(worker thread) Conflict when a given event id is taken (forgotten ids stay taken)."""
    for eid in ids:
        try:
            mem.get(eid)
        except StoreDamaged:
            raise
        except EventKVError:
            continue
        raise Conflict(f"event id {eid!r} is taken in memory {mem.directory.name!r}: give another id, or none.")


@router.post(
    "/v1/memories/{mid}/events",
    operation_id="add_events_v1_memories__mid__events_post",
    status_code=201,
    response_model=schemas.WriteOut,
    responses=responses(*QUEUED),
)
async def add_events(mid: MemoryId, body: schemas.AddEvents, ns: Namespace, state: State, jobs: Work):
    d = state.existing(ns, mid)
    events = [MemoryEvent(e.text, e.role, e.id, tuple(e.tags), e.budget, e.kind, e.when) for e in body.events]

    def verb(mem):
        untaken(mem, [e.id for e in events if e.id is not None])
        added = mem.add(events, prefill=body.prefill)
        return schemas.WriteOut(version=mem.version, added=added)

    return await jobs.on_memory(d, verb, body.expected_version)


@router.get(
    "/v1/memories/{mid}/events",
    operation_id="list_events_v1_memories__mid__events_get",
    response_model=list[schemas.RecordOut],
    responses=responses(*MEMORY),
)
def list_events(
    mid: MemoryId, ns: Namespace, state: State, include_superseded: bool = False, include_deleted: bool = False
):
    table = read_memory(state.existing(ns, mid)).table
    return table.list(include_superseded, include_deleted)


@router.get(
    "/v1/memories/{mid}/view",
    operation_id="view_ids_v1_memories__mid__view_get",
    response_model=list[str],
    responses=responses(*MEMORY),
)
def view_ids(mid: MemoryId, ns: Namespace, state: State):
    return read_memory(state.existing(ns, mid)).table.view_ids()


def lookup(state: ServiceState, ns: str, mid: str, eid: str, what: Callable):
    """``what(table)`` on the committed event table of memory ``mid``; NotFound when it fails."""
    table = read_memory(state.existing(ns, mid)).table
    check_event_id(eid)
    try:
        return what(table)
    except StoreDamaged:
        raise
    except EventKVError:
        raise NotFound(f"no event {eid!r} in memory {mid!r}.") from None


@router.get(
    "/v1/memories/{mid}/events/{eid}",
    operation_id="get_event_v1_memories__mid__events__eid__get",
    response_model=schemas.RecordOut,
    responses=responses(*MEMORY),
)
def get_event(mid: MemoryId, eid: EventIdPath, ns: Namespace, state: State):
    return lookup(state, ns, mid, eid, lambda t: t.lookup(eid))


@router.get(
    "/v1/memories/{mid}/events/{eid}/history",
    operation_id="event_history_v1_memories__mid__events__eid__history_get",
    response_model=list[schemas.RecordOut],
    responses=responses(*MEMORY),
)
def event_history(mid: MemoryId, eid: EventIdPath, ns: Namespace, state: State):
    return lookup(state, ns, mid, eid, lambda t: t.history(eid))


def event_write(state: ServiceState, jobs: Jobs, verb: Callable, body: schemas.Write, ns: str, mid: str, eid: str):
    """An awaitable of ``verb(memory)`` on the worker, after the version check and event ``eid``'s."""
    d = state.existing(ns, mid)
    check_event_id(eid)
    return jobs.on_memory(d, verb, body.expected_version, eid)


@router.post(
    "/v1/memories/{mid}/events/{eid}/update",
    operation_id="update_event_v1_memories__mid__events__eid__update_post",
    status_code=201,
    response_model=schemas.WriteOut,
    responses=EVENT,
)
async def update_event(
    mid: MemoryId, eid: EventIdPath, body: schemas.UpdateEvent, ns: Namespace, state: State, jobs: Work
):
    def verb(mem):
        live(mem, eid, "updated", root=True)
        a = mem.update(eid, body.text, prefill=body.prefill, when=body.when)
        return schemas.WriteOut(version=mem.version, added=[a])

    return await event_write(state, jobs, verb, body, ns, mid, eid)


@router.post(
    "/v1/memories/{mid}/events/{eid}/delete",
    operation_id="delete_event_v1_memories__mid__events__eid__delete_post",
    response_model=schemas.WriteOut,
    responses=EVENT,
)
async def delete_event(
    mid: MemoryId, eid: EventIdPath, ns: Namespace, state: State, jobs: Work, body: schemas.Write | None = None
):
    def verb(mem):
        live(mem, eid, "deleted again")
        mem.delete(eid)
        return schemas.WriteOut(version=mem.version)

    return await event_write(state, jobs, verb, body or schemas.Write(), ns, mid, eid)


@router.post(
    "/v1/memories/{mid}/events/{eid}/forget",
    operation_id="forget_event_v1_memories__mid__events__eid__forget_post",
    response_model=schemas.WriteOut,
    responses=EVENT,
)
async def forget_event(
    mid: MemoryId, eid: EventIdPath, ns: Namespace, state: State, jobs: Work, body: schemas.Write | None = None
):
    def verb(mem):
        if not mem.store.purge_pending:  # forgetting again completes a pending purge (see purge_pending)
            not_forgotten(mem, eid, "forgotten again")
        rows = mem.forget(eid)
        return schemas.WriteOut(version=mem.version, rows=rows)

    return await event_write(state, jobs, verb, body or schemas.Write(), ns, mid, eid)


@router.post(
    "/v1/memories/{mid}/events/{eid}/pin",
    operation_id="pin_event_v1_memories__mid__events__eid__pin_post",
    response_model=schemas.WriteOut,
    responses=EVENT,
)
async def pin_event(
    mid: MemoryId, eid: EventIdPath, ns: Namespace, state: State, jobs: Work, body: schemas.PinEvent | None = None
):
    body = body or schemas.PinEvent()

    def verb(mem):
        if body.pinned:
            live(mem, eid, "pinned", root=True)
        mem.pin(eid, body.pinned)
        return schemas.WriteOut(version=mem.version)

    return await event_write(state, jobs, verb, body, ns, mid, eid)
