"""``GET /health``: the served model and the queue depth (the one route open without a token)."""

from __future__ import annotations

from fastapi import APIRouter

from eventkv.service import schemas
from eventkv.service.errors import responses
from eventkv.service.state import State, Worker

router = APIRouter(tags=["health"])


@router.get("/health", operation_id="health_health_get", response_model=schemas.HealthOut, responses=responses())
def health(state: State, worker: Worker):
    return schemas.HealthOut(
        status="ok", model=getattr(state.lm.profile, "name", "?"), queue_depth=worker.depth if worker else 0
    )
