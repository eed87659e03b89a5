"""Reading a memory through the model, on the worker: ``POST .../select`` (the event ids a question
would be served), ``POST .../search`` (the same events ranked, with their texts and scores) and
``POST .../query`` (an answer from the served set's KV rows; concurrent queries, on any memories, are
answered in one batched readout: :class:`eventkv.service.worker.QueryJob`). The memory refuses what it
cannot serve (an unknown or forgotten event, nothing to serve: NotFound, Gone, Conflict)."""

from __future__ import annotations

from fastapi import APIRouter

from eventkv.service import schemas
from eventkv.service.errors import QUEUED, responses
from eventkv.service.state import MemoryId, Namespace, State, Work

router = APIRouter(tags=["queries"])


@router.post(
    "/v1/memories/{mid}/select",
    operation_id="select_v1_memories__mid__select_post",
    response_model=list[str],
    responses=responses(*QUEUED),
)
async def select(mid: MemoryId, body: schemas.SelectIn, ns: Namespace, state: State, jobs: Work):
    return await jobs.on_memory(
        state.existing(ns, mid), lambda mem: mem.selection().select(body.question, body.options()), None
    )


@router.post(
    "/v1/memories/{mid}/search",
    operation_id="search_v1_memories__mid__search_post",
    response_model=list[schemas.HitOut],
    responses=responses(*QUEUED),
)
async def search(mid: MemoryId, body: schemas.SearchIn, ns: Namespace, state: State, jobs: Work):
    return await jobs.on_memory(
        state.existing(ns, mid), lambda mem: mem.selection().search(body.query, body.options()), None
    )


@router.post(
    "/v1/memories/{mid}/query",
    operation_id="query_v1_memories__mid__query_post",
    response_model=schemas.AnswerOut,
    responses=responses(*QUEUED, 410),
)
async def query(mid: MemoryId, body: schemas.QueryIn, ns: Namespace, state: State, jobs: Work):
    answered = await jobs.query(state.existing(ns, mid), body.query())
    return schemas.AnswerOut.from_answer(answered.answers[0], version=answered.version)
