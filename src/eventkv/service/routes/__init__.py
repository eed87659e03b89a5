"""The service's own routes, one :class:`fastapi.APIRouter` per resource, each tagged with it in the
OpenAPI document: :mod:`.health` (``/health``, open without a token), :mod:`.metrics` (``/metrics``),
:mod:`.memories` (create, list, read, delete), :mod:`.events` (add, list, read and the event verbs),
:mod:`.operations` (prefill, rebase, carriers) and :mod:`.queries` (select, search, query). The
OpenAI-compatible routes are their own package, :mod:`eventkv.service.openai`; the app includes its
router after these (:mod:`eventkv.service.app`). Each gets what it needs by dependency injection
(:mod:`eventkv.service.state`), so a router can be mounted and tested alone."""

from __future__ import annotations

from eventkv.service.routes import events, health, memories, metrics, operations, queries

#: the routers behind the bearer token (when the app has tokens), in the order the app includes them
GUARDED = (metrics.router, memories.router, events.router, operations.router, queries.router)
#: every router, in the order the app includes them (the OpenAPI document lists their paths so)
ROUTERS = (health.router, *GUARDED)
