"""The memories of a namespace: ``POST /v1/memories`` (create, on the worker), ``GET /v1/memories``
(list; a damaged memory is listed as such), ``GET /v1/memories/{mid}`` (its committed state, read
without the worker) and ``DELETE /v1/memories/{mid}`` (on the worker, under its writer lock; the
requests on the memory queued before it are refused 404 when their turn comes:
:meth:`eventkv.service.worker.ModelWorker.deleted`)."""

from __future__ import annotations

import contextlib
import shutil
import uuid
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query

from eventkv.errors import Conflict, EventKVError, OptionError, StoreDamaged
from eventkv.files import out_of_space, write_json_atomic
from eventkv.memory.store import Store, remove_leftovers
from eventkv.service import schemas
from eventkv.service.errors import MEMORY, QUEUED, SCOPED, responses
from eventkv.service.state import MemoryId, Namespace, State, Work
from eventkv.wire import NAMESPACE_HEADER, Forbidden

router = APIRouter(tags=["memories"])


@router.post(
    "/v1/memories",
    operation_id="create_memory_v1_memories_post",
    status_code=201,
    response_model=schemas.MemoryOut,
    responses=responses(*SCOPED, 409, 503, 507),
)
async def create_memory(body: schemas.CreateMemory, ns: Namespace, state: State, jobs: Work):
    from eventkv.memory import EventMemory

    if body.namespace is not None and body.namespace != ns:
        raise Forbidden(
            f"the body names namespace {body.namespace!r} but the request is scoped to {ns!r} "
            f"(header {NAMESPACE_HEADER}): send the same, or leave namespace out."
        )
    served = state.served
    if body.model is not None and body.model != served:
        raise OptionError(
            "model", body.model, f"this server serves {served!r}: create the memory on a server of that model."
        )
    mid = body.id or uuid.uuid4().hex[:16]
    d = state.memory_dir(ns, mid)
    contract_path = None

    def job():
        nonlocal contract_path
        remove_leftovers(d.parent, mid)  # what a creation killed mid-way left: the id is free again
        if d.exists():
            raise Conflict(f"memory {mid!r} already exists in namespace {ns!r}: pick another id.")
        if body.contract is not None:
            contract_path = state.contract(ns, mid)
            contract_path.parent.mkdir(parents=True, exist_ok=True)
            with out_of_space(contract_path.parent, f"the contract of memory {mid!r}"):
                write_json_atomic(contract_path, body.contract, indent=None, newline=False, mode=0o600)
        try:
            # atomic: built aside and renamed into place, so d is absent or complete
            mem = EventMemory.create(
                d, state.lm, namespace=ns, instruction=body.instruction, contract=contract_path, rows=body.rows
            )
        except BaseException:
            if contract_path is not None:
                contract_path.unlink(missing_ok=True)
            raise
        jobs.worker.adopt(d, mem)

    await jobs.run(job)
    return state.memory_out(d)


@router.get(
    "/v1/memories",
    operation_id="list_memories_v1_memories_get",
    response_model=list[schemas.MemoryOut | schemas.DamagedMemoryOut],
    responses=responses(*SCOPED),
)
def list_memories(ns: Namespace, state: State):
    base = state.root / ns
    dirs = sorted(p for p in base.iterdir() if not p.name.startswith(".")) if base.is_dir() else []
    out: list[schemas.MemoryOut | schemas.DamagedMemoryOut] = []
    for d in dirs:
        if not (d / "manifest.json").is_file():
            continue
        try:
            out.append(state.memory_out(d))
        except StoreDamaged as exc:  # that memory alone: the others are listed as usual
            out.append(schemas.DamagedMemoryOut(id=d.name, namespace=ns, damaged=state.scrub(str(exc))))
        except EventKVError:
            if (d / "manifest.json").is_file():
                raise
            # deleted while the namespace was listed: no longer one of its memories
    return out


@router.get(
    "/v1/memories/{mid}",
    operation_id="get_memory_v1_memories__mid__get",
    response_model=schemas.MemoryOut,
    responses=responses(*MEMORY),
)
def get_memory(mid: MemoryId, ns: Namespace, state: State):
    return state.memory_out(state.existing(ns, mid))


@router.delete(
    "/v1/memories/{mid}",
    operation_id="delete_memory_v1_memories__mid__delete",
    response_model=schemas.WriteOut,
    responses=responses(*QUEUED),
)
async def delete_memory(
    mid: MemoryId,
    ns: Namespace,
    state: State,
    jobs: Work,
    expected_version: Annotated[int | None, Query(ge=0, description="the version this write expects")] = None,
):
    d = state.existing(ns, mid)

    def job():
        try:
            mem = jobs.open_checked(d, expected_version)
        except StoreDamaged:
            # deleting is the documented way out of a damaged memory, so it is removed without
            # reading its state: it has no version to trust (answered as 0), and expected_version
            # cannot be checked against one; its writer lock is held while it goes
            jobs.worker.release(d)
            with contextlib.closing(Store.lock(d)):
                remove(d)
            return 0
        version = mem.version
        jobs.worker.release(d)
        remove(d)
        return version

    def remove(d: Path) -> None:
        trash = state.root / ns / f".trash-{mid}-{uuid.uuid4().hex[:8]}"
        d.rename(trash)  # one step: the memory is gone for every reader at once
        assert jobs.worker is not None  # a job on the worker
        jobs.worker.deleted(d)  # the writes queued for it are refused, even once the id is taken again
        shutil.rmtree(trash, ignore_errors=True)
        state.contract(ns, mid).unlink(missing_ok=True)

    return schemas.WriteOut(version=await jobs.run(job))
