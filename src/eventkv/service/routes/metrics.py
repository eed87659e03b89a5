"""``GET /metrics``: Prometheus text (:class:`eventkv.service.metrics.Metrics`)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from eventkv.service.errors import responses
from eventkv.service.metrics import Metrics
from eventkv.service.state import get_metrics

router = APIRouter(tags=["metrics"])


@router.get("/metrics", operation_id="metrics_metrics_get", responses=responses())
def metrics(request: Request, series: Annotated[Metrics, Depends(get_metrics)]):
    """Prometheus text: the server-wide series, and the per-memory series of the namespaces the
    token is granted (every namespace without a token file or with an unrestricted token)."""
    granted = request.scope.get("state", {}).get("namespaces")
    return Response(series.text(granted), media_type=CONTENT_TYPE_LATEST)
