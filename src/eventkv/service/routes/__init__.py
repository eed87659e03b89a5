"""The service's routes, one :class:`fastapi.APIRouter` per resource: :mod:`.health` (``/health``,
open without a token), :mod:`.metrics` (``/metrics``), :mod:`.memories` (create, list, read, delete),
:mod:`.events` (add, list, read and the event verbs), :mod:`.operations` (prefill, rebase,
carriers), :mod:`.queries` (select, query) and :mod:`.chat` (the OpenAI-compatible ``/v1/models`` and
``/v1/chat/completions``, whose errors are in OpenAI's shape). Each gets what it needs by dependency injection
(:mod:`eventkv.service.state`), so a router can be mounted and tested alone."""

from __future__ import annotations

from eventkv.service.routes import chat, events, health, memories, metrics, operations, queries

#: the routers behind the bearer token (when the app has tokens), in the order the app includes them
GUARDED = (metrics.router, memories.router, events.router, operations.router, queries.router, chat.router)
#: the routers whose errors are in OpenAI's shape (:func:`eventkv.service.errors.error_answer`)
OPENAI = (chat.router,)
#: every router, in the order the app includes them (the OpenAPI document lists their paths so)
ROUTERS = (health.router, *GUARDED)
