"""Reading a memory through the model, on the worker: ``POST .../select`` (the event ids a question
would be served), ``POST .../search`` (the same events ranked, with their texts and scores) and
``POST .../query`` (an answer from the served set's KV rows; concurrent queries, on any memories, are
answered in one batched readout: :class:`eventkv.service.worker.MemoryQuery`)."""

from __future__ import annotations

from fastapi import APIRouter

from eventkv.service import schemas
from eventkv.service.errors import QUEUED, responses
from eventkv.service.state import MemoryId, Namespace, State, Work, not_forgotten
from eventkv.wire import Conflict

router = APIRouter(tags=["queries"])


def served_ids(mem, ids) -> None:
    """(worker thread) every id of an explicit served set is an event of the memory, not forgotten."""
    if isinstance(ids, list):
        for eid in ids:
            not_forgotten(mem, eid, "served (it has no rows)")


def check_servable(mem, select, mid: str) -> None:
    """(worker thread) the served set ``select`` (a query's) can be served: its explicit ids are live
    events (:func:`served_ids`), and a selection, the view or ``"all"`` has events to serve.

    Raises:
        NotFound, Gone: an explicit id unknown, or forgotten. Conflict: nothing to serve.
    """
    served_ids(mem, select)
    if select in (None, "view", "all") and not mem.view_ids():
        if select != "all" or not mem.list(include_superseded=True, include_deleted=True):
            raise Conflict(f"memory {mid!r} has no live events to serve: add some first.")


@router.post(
    "/v1/memories/{mid}/select",
    operation_id="select_v1_memories__mid__select_post",
    response_model=list[str],
    responses=responses(*QUEUED),
)
async def select(mid: MemoryId, body: schemas.SelectIn, ns: Namespace, state: State, jobs: Work):
    return await jobs.on_memory(
        state.existing(ns, mid), lambda mem: mem.select(body.question, body.k, **body.shaping()), None
    )


@router.post(
    "/v1/memories/{mid}/search",
    operation_id="search_v1_memories__mid__search_post",
    response_model=list[schemas.HitOut],
    responses=responses(*QUEUED),
)
async def search(mid: MemoryId, body: schemas.SearchIn, ns: Namespace, state: State, jobs: Work):
    return await jobs.on_memory(
        state.existing(ns, mid), lambda mem: mem.search(body.query, body.k, **body.shaping()), None
    )


@router.post(
    "/v1/memories/{mid}/query",
    operation_id="query_v1_memories__mid__query_post",
    response_model=schemas.AnswerOut,
    responses=responses(*QUEUED, 410),
)
async def query(mid: MemoryId, body: schemas.QueryIn, ns: Namespace, state: State, jobs: Work):
    def prepare(mem):
        check_servable(mem, body.select, mid)
        return mem.prepare_query(
            body.question,
            [(body.select, body.mode)],
            k=body.k,
            candidates=body.candidates,
            max_new_tokens=body.max_new_tokens,
            **body.shaping(),
            positions=body.positions,
            order=body.order,
            recompute=body.recompute,
            blend_schedule=body.blend_schedule,
        )

    def finish(mem, prepared, answers):
        return schemas.AnswerOut.from_answer(answers[0], version=prepared.version)

    return await jobs.query(state.existing(ns, mid), prepare, finish)
