"""Operations on a memory's KV rows, on the worker: ``POST .../prefill`` (compute the rows of the
pending events) and ``POST .../rebase`` (recompute every row from the history), one implementation
(:func:`rows_route`), and ``POST .../carriers`` (a programmed carrier over source events)."""

from __future__ import annotations

from fastapi import APIRouter

from eventkv.service import schemas
from eventkv.service.errors import QUEUED, responses
from eventkv.service.state import MemoryId, Namespace, State, Work, live

router = APIRouter(tags=["operations"])


def rows_route(verb: str):
    """The endpoint of ``POST /v1/memories/{mid}/<verb>``: ``memory.<verb>()`` on the worker, answered
    with the memory's version and the rows it computed. (No docstring on the endpoint: the OpenAPI
    document shows none for these routes.)"""

    async def endpoint(mid: MemoryId, ns: Namespace, state: State, jobs: Work, body: schemas.Write | None = None):
        body = body or schemas.Write()

        def run(mem):
            rows = getattr(mem, verb)()
            return schemas.WriteOut(version=mem.version, rows=rows)

        return await jobs.on_memory(state.existing(ns, mid), run, body.expected_version)

    return endpoint


for _verb in ("prefill", "rebase"):
    router.add_api_route(
        f"/v1/memories/{{mid}}/{_verb}",
        rows_route(_verb),
        methods=["POST"],
        name=_verb,
        operation_id=f"{_verb}_v1_memories__mid__{_verb}_post",
        response_model=schemas.WriteOut,
        responses=responses(*QUEUED),
    )


@router.post(
    "/v1/memories/{mid}/carriers",
    operation_id="carrier_v1_memories__mid__carriers_post",
    status_code=201,
    response_model=schemas.CarrierOut,
    responses=responses(*QUEUED, 410),
)
async def carrier(mid: MemoryId, body: schemas.CarrierIn, ns: Namespace, state: State, jobs: Work):
    def verb(mem):
        for sid in body.sources:
            live(mem, sid, "a carrier's source", root=True)
        r = mem.carrier(body.sources, body.subject, body.kind, prefill=body.prefill)
        return schemas.CarrierOut(
            kind=r.kind,
            added=r.added,
            pinned=list(r.pinned),
            reason=r.reason,
            version=mem.version,
        )

    return await jobs.on_memory(state.existing(ns, mid), verb, body.expected_version)
