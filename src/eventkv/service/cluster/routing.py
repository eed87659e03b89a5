"""Which memory a request works on: the key the Ray Serve backend routes it by.

A memory is one store directory with one writer at a time, so every request that may open it is sent
to the replica that has it open: the key is Ray Serve's multiplexed model id
(``DeploymentHandle.options(multiplexed_model_id=...)``), ``<namespace>/<memory id>``. A request that
names no memory (listing memories, ``/health``, ``/metrics``, ``/v1/models``, a chat without a memory,
the API pages) has no key and may go to any replica.
"""

from __future__ import annotations

import json
from urllib.parse import unquote

from eventkv.wire import DEFAULT_NAMESPACE, MEMORY_HEADER, NAME, NAMESPACE_HEADER

MEMORIES = "/v1/memories"
CHAT = "/v1/chat/completions"
#: the inspector's fragments of one memory (:mod:`eventkv.service.ui`): a query from the page opens the memory
UI_MEMORY = "/ui/part/memory"


def memory_key(method: str, path: str, headers: dict[str, str], body: bytes, raw_path: str | None = None) -> str | None:
    """The routing key ``<namespace>/<memory id>`` of a request, or None when it names no memory.

    Args:
        method: the HTTP method. path: the URL path (``raw_path``: as sent, still percent-encoded;
            a memory id is read from it segment by segment, as the service's routes read it).
        headers: the request's headers, names lower-case. body: the whole request body.

    Where the memory is named: the path ``/v1/memories/<id>/...`` or ``/ui/part/memory/<id>/...``; the body's ``id`` of
    ``POST /v1/memories`` (a creation); the body's ``memory.id`` or the header
    :data:`eventkv.wire.MEMORY_HEADER` of ``POST /v1/chat/completions`` (the body wins, as in the route).
    Any other request with that header (``GET /metrics``, ``GET /health``) goes to the replica holding
    the header's memory: that replica's metrics and queue.
    The namespace is the header :data:`eventkv.wire.NAMESPACE_HEADER` (default ``default``). A name that
    is not valid, or a body that is not JSON, gives None: the replica that gets the request answers
    its 4xx, as the single process does.
    """
    namespace = headers.get(NAMESPACE_HEADER.lower(), DEFAULT_NAMESPACE)
    memory: object = None
    prefix = next((p for p in (MEMORIES, UI_MEMORY) if path.startswith(p + "/")), None)
    if prefix is not None:
        raw = raw_path if raw_path and raw_path.startswith(prefix + "/") else path
        memory = unquote(raw[len(prefix) + 1 :].split("/")[0])
    elif method == "POST" and path in (MEMORIES, CHAT):
        try:
            doc = json.loads(body) if body else None
        except (ValueError, UnicodeDecodeError):
            doc = None
        if path == MEMORIES:
            memory = doc.get("id") if isinstance(doc, dict) else None
        else:
            attached = doc.get("memory") if isinstance(doc, dict) else None
            memory = attached.get("id") if isinstance(attached, dict) else headers.get(MEMORY_HEADER.lower())
    if memory is None and not path.startswith(MEMORIES) and path != CHAT:  # e.g. /metrics of that memory's replica
        memory = headers.get(MEMORY_HEADER.lower())
    if not isinstance(memory, str) or NAME.fullmatch(memory) is None or NAME.fullmatch(namespace) is None:
        return None
    return f"{namespace}/{memory}"
