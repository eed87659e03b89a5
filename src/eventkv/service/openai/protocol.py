"""The OpenAI-compatible routes' bodies (``GET /v1/models``, ``POST /v1/chat/completions``): pydantic
models of the parts of OpenAI's Chat Completions schema the service implements, the ``memory``
extension, and OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``.

Fields OpenAI's schema has and the service cannot honour are declared with the one value that changes
nothing (``null``, ``n: 1``, penalties of 0, ``logprobs: false``, ``response_format`` of type text), so
the document says what is accepted, and a request that sets them otherwise is refused with a message
saying the field is not supported (:data:`UNSUPPORTED`); fields that change nothing an answer holds
(``user``, ``metadata``, ``store``, ``service_tier``, ``parallel_tool_calls``) are accepted and
ignored; any other field is refused as unknown.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from eventkv.errors import NotFound, OptionError
from eventkv.kv.decoding import MAX_TEMPERATURE, SEED_END, SEED_MIN, Decoding
from eventkv.memory.query import MemoryQuery
from eventkv.service.schemas import MAX_TEXT, EventId, MaxNewTokens, Name, Shaping, json_invalid, pydantic_rule
from eventkv.wire import MAX_NAME, MEMORY_HEADER, NAME_PATTERN

#: tokens generated when the request gives neither ``max_completion_tokens`` nor ``max_tokens``
DEFAULT_MAX_TOKENS = 256
MAX_MESSAGES = 1024
MAX_STOPS = 16

#: field -> why it is refused when set to anything but its neutral value (the 400's message)
UNSUPPORTED = {
    "n": "n > 1 is not supported: this server returns one choice per request (n = 1); send several requests.",
    "tools": "tools (function calling) is not supported by this server: send messages only.",
    "tool_choice": "tool_choice is not supported by this server (no tools): leave it out.",
    "functions": "functions (function calling) is not supported by this server: send messages only.",
    "function_call": "function_call is not supported by this server (no functions): leave it out.",
    "logprobs": "logprobs is not supported by this server: leave it out or send false.",
    "top_logprobs": "top_logprobs is not supported by this server (no logprobs): leave it out.",
    "logit_bias": "logit_bias is not supported by this server: leave it out or send {}.",
    "presence_penalty": "presence_penalty other than 0 is not supported by this server.",
    "frequency_penalty": "frequency_penalty other than 0 is not supported by this server.",
    "response_format": "response_format other than {'type': 'text'} is not supported by this server (no JSON mode "
    "or structured outputs).",
    "audio": "audio output is not supported by this server: text only.",
    "modalities": "modalities other than ['text'] are not supported by this server.",
    "prediction": "prediction (predicted outputs) is not supported by this server.",
    "web_search_options": "web search is not supported by this server.",
    "reasoning_effort": "reasoning_effort is not supported by this server.",
}
#: message fields refused as not supported
UNSUPPORTED_MESSAGE = {
    "tool_calls": "tool_calls in a message is not supported by this server (no function calling).",
    "function_call": "function_call in a message is not supported by this server (no function calling).",
    "tool_call_id": "tool messages are not supported by this server (no function calling).",
    "audio": "audio in a message is not supported by this server: text only.",
}
UNSUPPORTED_ROLES = ("tool", "function")
#: the library's option names that a chat request spells otherwise (an error's ``param``)
PARAMS = {"max_new_tokens": "max_tokens", "question": "messages"}


class ModelNotFound(NotFound):
    """A request naming another model than the served one (404 ``model_not_found``)."""

    openai_code = "model_not_found"


class _Strict(BaseModel):
    # strict: "3" is not a number, 1 is not a boolean (as the service's other bodies)
    model_config = ConfigDict(extra="forbid", strict=True)


ChatText = Annotated[str, StringConstraints(max_length=MAX_TEXT)]


class TextPart(_Strict):
    """One part of a message's content in the list form: text only."""

    type: Literal["text"]
    text: ChatText


class Message(_Strict):
    """One chat message. ``developer`` is OpenAI's newer name for ``system``; ``name`` is accepted
    and not used; the content is a string or a list of text parts (joined with newlines)."""

    role: Literal["system", "developer", "user", "assistant"]
    content: ChatText | Annotated[list[TextPart], Field(max_length=256)]
    name: Annotated[str, StringConstraints(max_length=256)] | None = None
    refusal: None = None  # an assistant message of OpenAI's answers carries it (null)
    tool_calls: None = None
    function_call: None = None
    tool_call_id: None = None
    audio: None = None

    def as_dict(self) -> dict[str, str]:
        """``{"role", "content"}`` as :mod:`eventkv.memory.chat` reads it (``developer`` -> ``system``)."""
        role = "system" if self.role == "developer" else self.role
        text = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)
        return {"role": role, "content": text}


class StreamOptions(_Strict):
    include_usage: bool = Field(False, description="a last chunk with the usage and no choices")
    include_obfuscation: bool | None = Field(None, description="accepted, not used (no padding is added)")


class ResponseFormatText(_Strict):
    type: Literal["text"]


class MemoryOptions(Shaping):
    """The ``memory`` extension: answer from a memory's served rows (see docs/service.md, "Chat
    completions"). The served set's shaping is ``/query``'s (``k``, ``budget_rows``, ``selector``,
    ``budget``, ``neighbours``, ``with_headers``); none of ``k`` and the budgets given: the default budget."""

    id: Name = Field(description="the memory's id in the request's namespace (header X-EventKV-Namespace)")
    select: Literal["all", "view"] | list[EventId] | None = Field(
        None, max_length=10_000, description="null: selected from the last user message; or as /query's select"
    )
    mode: Literal["compact", "native", "isolated", "text", "blend"] = "compact"
    positions: Literal["original", "contiguous"] | None = Field(
        None, description="null: the memory's default (contiguous where the model's RoPE re-rotates exactly)"
    )
    order: Literal["log", "relevance"] | None = Field(
        None,
        description="null: relevance (the most relevant event last) for a selector's choice at contiguous "
        "positions, else log (history order)",
    )
    remember: bool = Field(
        False, description="append the last user message and the reply as events (acknowledged once stored)"
    )

    def query(self, question: str, messages: list[dict], max_new_tokens: int, decoding: Decoding) -> MemoryQuery:
        """The chat as the memory's query (:class:`eventkv.memory.query.MemoryQuery`): ``question`` (the last
        user message's text) selects, the conversation ``messages`` is read after the served rows."""
        options = self.options(mode=self.mode, positions=self.positions, order=self.order)
        return MemoryQuery(
            question,
            select=self.select,
            options=options,
            max_new_tokens=max_new_tokens,
            messages=messages,
            decoding=decoding,
            remember=self.remember,
        )


class ChatRequest(_Strict):
    """``POST /v1/chat/completions``: OpenAI's Chat Completions request, the parts implemented."""

    model: Annotated[str, StringConstraints(min_length=1, max_length=500)] = Field(description="the served model")
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: MaxNewTokens | None = Field(None, description=f"default {DEFAULT_MAX_TOKENS}")
    max_completion_tokens: MaxNewTokens | None = Field(None, description="wins over max_tokens")
    temperature: Annotated[float, Field(ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False)] | None = Field(
        None, description="null, 0 or below 1e-5: greedy; from 1e-5: sampled from softmax(logits / temperature)"
    )
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = Field(
        None, description="the nucleus, in (0, 1]; null: 1 (every token)"
    )
    seed: Annotated[int, Field(ge=SEED_MIN, lt=SEED_END)] | None = Field(
        None,
        description="seeds the sampling (temperature >= 1e-5): the same seed, the same answer; a signed or "
        "unsigned 64-bit integer",
    )
    stop: (
        Annotated[str, StringConstraints(min_length=1, max_length=1000)]
        | Annotated[list[Annotated[str, StringConstraints(min_length=1, max_length=1000)]], Field(max_length=MAX_STOPS)]
        | None
    ) = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: Literal[1] | None = None
    user: Annotated[str, StringConstraints(max_length=512)] | None = Field(None, description="accepted, not used")
    metadata: dict[str, Annotated[str, StringConstraints(max_length=512)]] | None = Field(
        None, max_length=16, description="accepted, not used"
    )
    store: bool | None = Field(None, description="accepted, not used (nothing is stored but memory.remember)")
    service_tier: Annotated[str, StringConstraints(max_length=32)] | None = Field(
        None, description="accepted, not used"
    )
    parallel_tool_calls: bool | None = Field(None, description="accepted, not used (no tools)")
    presence_penalty: Annotated[float, Field(ge=0, le=0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=0, le=0)] | None = None
    logprobs: Literal[False] | None = None
    top_logprobs: None = None
    logit_bias: dict[str, float] | None = Field(None, max_length=0)
    response_format: ResponseFormatText | None = None
    modalities: list[Literal["text"]] | None = Field(None, max_length=1)
    tools: None = None
    tool_choice: None = None
    functions: None = None
    function_call: None = None
    audio: None = None
    prediction: None = None
    web_search_options: None = None
    reasoning_effort: None = None
    memory: MemoryOptions | None = Field(None, description="eventkv's extension: answer from a memory")

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as :mod:`eventkv.memory.chat` reads them."""
        return [m.as_dict() for m in self.messages]

    def new_tokens(self) -> int:
        """The generation budget: ``max_completion_tokens``, else ``max_tokens``, else the default."""
        return self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS

    def stops(self) -> tuple[str, ...]:
        """The stop strings, as a tuple."""
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        """Whether a streamed answer ends with a usage chunk.

        Raises:
            OptionError: ``stream_options`` without ``stream: true`` (as OpenAI refuses it).
        """
        if self.stream_options is not None and not self.stream:
            raise OptionError("stream_options", "given", "send stream_options only with stream: true.")
        return bool(self.stream_options and self.stream_options.include_usage)

    def attached(self, header: str | None) -> MemoryOptions | None:
        """The memory the request is answered from: the body's ``memory``, or the memory header's id
        (the defaults otherwise); both must name the same memory.

        Raises:
            OptionError: the header is not a memory id, or names another memory than the body.
        """
        if header is None:
            return self.memory
        from eventkv.wire import check_name

        check_name(header, MEMORY_HEADER)
        if self.memory is None:
            return MemoryOptions.model_validate({"id": header})
        if self.memory.id != header:
            raise OptionError(
                "memory.id", self.memory.id, f"the memory header names {header!r}: name one memory, or leave one out."
            )
        return self.memory


# ---------------------------------------------------------------------- responses
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "eventkv"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Usage(BaseModel):
    """OpenAI's usage, plus eventkv's split of the prompt: ``memory_rows`` (the served memory's rows:
    its header and served events, read from the KV cache) + ``new_tokens`` (the conversation read
    after them) = ``prompt_tokens``. Without a memory ``memory_rows`` is 0. ``completion_tokens`` are
    the reply's tokens (a stop token that ended it not counted)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    memory_rows: int = Field(description="eventkv: prompt tokens served from the memory's rows (header included)")
    new_tokens: int = Field(description="eventkv: prompt tokens read after them (the conversation)")


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class MemoryReport(BaseModel):
    """eventkv's extension of an answer: what it was read from, and what it stored."""

    memory: str | None = Field(description="the memory's id (null without a memory)")
    namespace: str | None
    served_ids: list[str] = Field(description="the served events, in the order they were served")
    remembered: list[str] = Field(description="ids of the events memory.remember stored")
    version: int | None = Field(description="the memory's version after the answer")
    tokens: list[int] = Field(description="the reply's token ids")
    plan: dict[str, Any] = Field(
        default_factory=dict, description="the plan the served rows were read by (positions resolved); {} without one"
    )


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    system_fingerprint: None = None
    eventkv: MemoryReport


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed answer (``data: {chunk}``): the role first, then the text
    as it is decoded, then the finish reason (with the ``eventkv`` report), then (with
    ``stream_options.include_usage``) a chunk with no choices and the usage; then ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    eventkv: MemoryReport | None = None


class OpenAIError(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error, permission_error, server_error")
    param: str | None = Field(description="the request field at fault, when one is")
    code: str | None = Field(description="model_not_found, unsupported_parameter, unknown_parameter, or eventkv's code")


class OpenAIErrorOut(BaseModel):
    """Every error answer of the OpenAI-compatible routes (OpenAI's error shape)."""

    error: OpenAIError


#: the memory header's schema facts (a memory id)
MEMORY_HEADER_SCHEMA: dict[str, Any] = {"pattern": NAME_PATTERN, "maxLength": MAX_NAME}


_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def param_of(loc) -> str | None:
    """A pydantic error location as OpenAI names a parameter: ``messages[0].content``. The members of
    a union pydantic tried (``constrained-str``, ``list[TextPart]``) are not parameters: left out."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part != "body" and _FIELD.fullmatch(str(part)) and part not in ("str", "int", "float", "bool"):
            out += ("." if out else "") + str(part)
    return out or None


def unsupported(error: dict) -> tuple[str, str | None, str] | None:
    """``(message, param, code)`` when one pydantic ``error`` is a field set where it is not supported
    (:data:`UNSUPPORTED`, :data:`UNSUPPORTED_MESSAGE`, a tool role, a content part other than text) or
    an unknown field; else None."""
    loc = [x for x in error.get("loc", ()) if x != "body"]
    param = param_of(loc)
    top = str(loc[0]) if loc else ""
    if error.get("type") == "extra_forbidden":
        message = (
            f"unknown parameter {param!r}: this server implements the Chat Completions fields its /docs lists "
            "(docs/service.md, 'Chat completions')."
        )
        return message, param, "unknown_parameter"
    if top in UNSUPPORTED:
        return UNSUPPORTED[top], top, "unsupported_parameter"
    if top == "messages" and len(loc) >= 3 and isinstance(loc[1], int):
        field = str(loc[2])
        if field in UNSUPPORTED_MESSAGE:
            return UNSUPPORTED_MESSAGE[field], param, "unsupported_parameter"
        if field == "role" and error.get("input") in UNSUPPORTED_ROLES:
            message = (
                f"messages with role {error['input']!r} are not supported by this server (no function calling): "
                "send system, user and assistant messages."
            )
            return message, param, "unsupported_parameter"
        if field == "content" and loc[-1] == "type":
            message = "content parts other than text (images, audio, files) are not supported by this server."
            return message, param, "unsupported_parameter"
    return None


def invalid(errors: list[dict]) -> tuple[str, str | None, str]:
    """``(message, param, code)`` of a chat request outside its schema (pydantic's ``errors()``): the
    first error that is an unsupported or unknown field (:func:`unsupported`) says so; else the
    library's wording, ``field value: rule`` (code ``invalid_request``)."""
    for e in errors:
        found = unsupported(e)
        if found is not None:
            return found
    if errors and (not_json := json_invalid(errors[0])) is not None:  # a character of the body: no param
        return f"{not_json}.", None, "invalid_request"
    parts = []
    for e in errors[:3]:
        given = e.get("input")
        where = param_of([x for x in e.get("loc", ()) if x != "body"]) or "body"
        shown = "" if e.get("type") == "missing" or isinstance(given, (dict, list)) else f" {given!r}"
        shown = shown if len(shown) <= 60 else shown[:56] + " ..."
        parts.append(f"{where}{shown}: {pydantic_rule(e)}")
    param = param_of([x for x in errors[0].get("loc", ()) if x != "body"])
    return "; ".join(parts) + " (see /docs for the request schemas).", param, "invalid_request"
