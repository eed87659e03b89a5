"""The OpenAI-compatible routes: ``GET /v1/models``, ``GET /v1/models/{model}`` (the served model) and
``POST /v1/chat/completions`` (OpenAI's Chat Completions, streamed or not), behind the same bearer
token, namespaces, body limits and worker as every route; errors in OpenAI's shape
(:func:`eventkv.service.errors.error_answer`). Each route is one call into
:mod:`eventkv.service.openai.serving`, answered as JSON or as server-sent events; bodies:
:mod:`eventkv.service.openai.protocol`.

The operation ids are written out as FastAPI generated them (``{name}{path}_{method}``, ``\\W`` as
``_``), so a client generated from the document keeps its method names when a function is renamed.
(No docstring on the model routes: the OpenAPI document shows none for them.)
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.sse import EventSourceResponse

from eventkv.service.errors import openai_responses
from eventkv.service.openai import protocol, serving
from eventkv.service.state import State, Work
from eventkv.wire import DEFAULT_NAMESPACE, MAX_NAME, MEMORY_HEADER, NAME_PATTERN, NAMESPACE_HEADER

router = APIRouter(tags=["openai"])

NamespaceHeader = Annotated[
    str,
    Header(
        alias=NAMESPACE_HEADER,
        description="the namespace of the attached memory",
        json_schema_extra={"pattern": NAME_PATTERN, "maxLength": MAX_NAME},
    ),
]
MemoryHeader = Annotated[
    str | None,
    Header(
        alias=MEMORY_HEADER,
        description="attach this memory (by id) with the default options; the body's memory wins",
        json_schema_extra=protocol.MEMORY_HEADER_SCHEMA,
    ),
]

STREAM = {"content": {"text/event-stream": {"schema": {"type": "string"}}}}


@router.get(
    "/v1/models",
    operation_id="list_models_v1_models_get",
    response_model=protocol.ModelList,
    responses=openai_responses(),
)
def list_models(state: State):
    return serving.model_list(state)


@router.get(
    "/v1/models/{model:path}",
    operation_id="get_model_v1_models__model__get",
    response_model=protocol.ModelCard,
    responses=openai_responses(404),
)
def get_model(model: str, state: State):
    return serving.model_card(state, model)


@router.post(
    "/v1/chat/completions",
    operation_id="chat_completions_v1_chat_completions_post",
    response_model=protocol.ChatCompletion,
    responses={200: STREAM, **openai_responses(400, 403, 404, 409, 410, 503, 507)},
)
async def chat_completions(
    body: protocol.ChatRequest,
    request: Request,
    state: State,
    jobs: Work,
    namespace: NamespaceHeader = DEFAULT_NAMESPACE,
    memory: MemoryHeader = None,
):
    """OpenAI's Chat Completions, answered from a memory's served rows (``memory``) or by the served
    model alone; ``stream: true`` answers server-sent events (``data: {chunk}`` ... ``data: [DONE]``)."""
    answer = await serving.chat_completion(body, request, state, jobs, namespace, memory)
    if isinstance(answer, protocol.ChatCompletion):
        return answer
    return EventSourceResponse(answer, headers={"Cache-Control": "no-cache"})
