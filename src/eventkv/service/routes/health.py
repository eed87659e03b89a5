"""``GET /health``: the served model and the queue depth (the one route open without a token)."""

from __future__ import annotations

from fastapi import APIRouter

from eventkv.service import schemas as s
from eventkv.service.errors import responses
from eventkv.service.state import State, Worker

router = APIRouter(tags=["health"])


@router.get("/health", operation_id="health_health_get", response_model=s.HealthOut, responses=responses())
def health(state: State, worker: Worker):
    return s.HealthOut(
        status="ok", model=getattr(state.lm.profile, "name", "?"), queue_depth=worker.depth if worker else 0
    )
