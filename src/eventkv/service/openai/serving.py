"""The OpenAI-compatible use case, without HTTP: the served model's card (:func:`model_list`,
:func:`model_card`) and a Chat Completions request answered on the worker (:func:`chat_completion`),
whole or as server-sent events. The routes (:mod:`eventkv.service.openai.router`) call one function
each; bodies: :mod:`eventkv.service.openai.protocol`.

With a memory attached (the body's ``memory``, or the header :data:`eventkv.wire.MEMORY_HEADER`) the
reply is ``EventMemory.query`` of the memory (a query on a memory, on the worker, as ``POST .../query``):
the served events are selected from the last user message, and the conversation is read after the
memory's header and served rows (:mod:`eventkv.memory.chat`); with ``remember`` the last user message
and the reply are added as two events in the same job, so the answer is sent only once they are stored;
a chat whose memory is deleted while it waits is refused 404 when its turn comes, and writes nothing
(:meth:`eventkv.service.worker.ModelWorker.deleted`).
Without a memory: the served model alone over its chat template (:func:`eventkv.memory.chat.chat_reply`).

Streaming: the worker's decode loop hands each step's text (:attr:`eventkv.kv.decoding.Decoding.on_step`,
whole characters only) to the response through an asyncio queue (:class:`Stream`); the stream opens once
the first step has run, so a request the memory or the model refuses still gets its 4xx; the finish chunk
comes after the job's end (and so after a ``remember``'s events are stored). A client that leaves
mid-stream ends the generation at its next step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, AsyncIterator, Callable, cast

from fastapi import Request
from fastapi.sse import format_sse_event
from pydantic import BaseModel

from eventkv.errors import EventKVError
from eventkv.kv.decoding import Decoding
from eventkv.kv.readout import Generation
from eventkv.memory.chat import chat_reply, last_user_text
from eventkv.memory.query import MemoryQuery
from eventkv.service.errors import ClientGone, status_and_code
from eventkv.service.openai import protocol
from eventkv.service.state import Jobs, ServiceState, disconnected, get_namespace
from eventkv.service.worker import Answered, answer_alone

#: when this server started (the model card's ``created``, seconds since the epoch)
STARTED = int(time.time())


def served(state: ServiceState) -> str:
    """The served model's name, as the model card and every answer give it."""
    return state.served or "?"


def check_model(state: ServiceState, model: str) -> None:
    """Raises ModelNotFound unless ``model`` is the served model."""
    if model != served(state):
        raise protocol.ModelNotFound(
            f"model {model!r} is not served here: this server serves {served(state)!r} (GET /v1/models)."
        )


def model_list(state: ServiceState) -> protocol.ModelList:
    """``GET /v1/models``: the one served model, in OpenAI's list shape."""
    return protocol.ModelList(data=[protocol.ModelCard(id=served(state), created=STARTED)])


def model_card(state: ServiceState, model: str) -> protocol.ModelCard:
    """``GET /v1/models/{model}``: the served model's card.

    Raises:
        ModelNotFound: ``model`` is not the served model.
    """
    check_model(state, model)
    return protocol.ModelCard(id=served(state), created=STARTED)


@dataclass
class Outcome:
    """What a chat job answered (worker thread), for the response."""

    generation: Generation
    memory_rows: int
    new_tokens: int
    memory: str | None = None
    namespace: str | None = None
    served_ids: list[str] = field(default_factory=list)
    remembered: list[str] = field(default_factory=list)
    version: int | None = None
    plan: dict[str, Any] = field(default_factory=dict)

    def usage(self) -> protocol.Usage:
        prompt, completion = self.memory_rows + self.new_tokens, len(self.generation.tokens)
        return protocol.Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            memory_rows=self.memory_rows,
            new_tokens=self.new_tokens,
        )

    def report(self) -> protocol.MemoryReport:
        return protocol.MemoryReport(
            memory=self.memory,
            namespace=self.namespace,
            served_ids=self.served_ids,
            remembered=self.remembered,
            version=self.version,
            tokens=list(self.generation.tokens),
            plan=self.plan,
        )


Job = Callable[[Callable[[str], None] | None], Outcome]


async def chat_completion(
    body: protocol.ChatRequest, request: Request, state: ServiceState, jobs: Jobs, namespace: str, header: str | None
) -> protocol.ChatCompletion | AsyncIterator[bytes]:
    """``POST /v1/chat/completions``: the answer (:class:`~eventkv.service.openai.protocol.ChatCompletion`),
    or, with ``stream: true``, the server-sent events of a stream whose first decode step has run
    (:meth:`Stream.events`). ``namespace`` and ``header`` are the request's namespace and memory headers.

    Raises:
        ModelNotFound: ``body.model`` is not the served model. Whatever :func:`plan` raises, and what the
        job raised before its first step (:meth:`Stream.started`; the whole job when not streamed).
    """
    check_model(state, body.model)
    include_usage = body.include_usage()
    job = plan(body, request, state, jobs, namespace, header)
    name, cid, created = served(state), f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if not body.stream:
        out: Outcome = await (job.batched() if isinstance(job, MemoryChat) else jobs.run(lambda: job(None)))
        return protocol.ChatCompletion(
            id=cid,
            created=created,
            model=name,
            choices=[
                protocol.Choice(
                    message=protocol.AssistantMessage(content=out.generation.text),
                    finish_reason=out.generation.finish_reason,
                )
            ],
            usage=out.usage(),
            eventkv=out.report(),
        )
    stream = Stream(request, jobs, job, state.scrub)
    await stream.started()
    return stream.events(cid, created, name, include_usage)


def plan(body: protocol.ChatRequest, request: Request, state: ServiceState, jobs: Jobs, namespace: str, header) -> Job:
    """The chat's job (run on the worker, given the step callback or None), after the checks that need
    no model: the conversation, the memory's namespace and existence.

    Raises:
        OptionError: bad messages (:func:`eventkv.memory.chat.check_messages`), a bad memory header or
            namespace. Forbidden, NotFound: the namespace is not granted, the memory does not exist.
    """
    messages = body.chat_messages()
    question = last_user_text(messages)
    options = body.attached(header)
    decoding = Decoding(
        temperature=body.temperature or 0.0,
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=body.stops(),
    )
    max_new = body.new_tokens()
    if options is None:

        def alone(on_step):
            reply = chat_reply(state.lm, messages, max_new_tokens=max_new, decoding=replace(decoding, on_step=on_step))
            return Outcome(reply.generation, 0, reply.prompt_tokens)

        return alone
    ns = get_namespace(request, namespace)
    d = state.existing(ns, options.id)
    return MemoryChat(d, options.query(question, messages, max_new, decoding), state.lm, jobs, ns, options.id)


@dataclass
class MemoryChat:
    """A chat on the memory of ``d`` as one typed query (:class:`eventkv.memory.MemoryQuery`, ``remember``
    included): not streamed, it is answered in one batched readout with the other queued queries
    (:meth:`eventkv.service.state.Jobs.query`); called with a step callback (streamed), it runs as one job,
    read out alone (a streamed answer is not batched)."""

    d: Path
    query: MemoryQuery
    lm: Any
    jobs: Jobs
    namespace: str
    memory_id: str

    def outcome(self, answered: Answered) -> Outcome:
        """The chat's :class:`Outcome` from its query's answers."""
        a = answered.answers[0]
        return Outcome(
            a.generation,
            a.n_rows_served,
            a.n_query_tokens,
            self.memory_id,
            self.namespace,
            a.served_ids,
            answered.remembered,
            answered.version_after,
            a.plan,
        )

    def __call__(self, on_step: Callable[[str], None] | None) -> Outcome:
        """(worker thread) the chat read out alone, each step's text handed to ``on_step``."""
        mem = self.jobs.open_checked(self.d, None)
        decoding = replace(cast(Decoding, self.query.decoding), on_step=on_step)
        return self.outcome(answer_alone(self.lm, mem, replace(self.query, decoding=decoding)))

    async def batched(self) -> Outcome:
        """The :class:`Outcome`, the chat's query batched on the worker."""
        return self.outcome(await self.jobs.query(self.d, self.query))


class Stream:
    """One streamed answer: the job on the worker, its steps' text through an asyncio queue.

    :meth:`started` returns once the first decode step has run (or raises what the job raised before
    it, for a 4xx answer); :meth:`events` is the response's server-sent events."""

    def __init__(self, request: Request, jobs: Jobs, job: Job, scrub: Callable[[str], str]) -> None:
        self.request, self.jobs, self.job, self.scrub = request, jobs, job, scrub
        self.loop = asyncio.get_running_loop()
        self.pieces: asyncio.Queue[str] = asyncio.Queue()
        self.gone = threading.Event()
        self.first: asyncio.Future | None = None
        self.result: asyncio.Future | None = None

    def step(self, piece: str) -> None:
        """(worker thread) one decode step's text, handed to the event loop; a client gone ends the job."""
        if self.gone.is_set():
            raise ClientGone()
        self.loop.call_soon_threadsafe(self.pieces.put_nowait, piece)

    async def started(self) -> None:
        """Queue the job and wait for its first step.

        Raises:
            whatever the job raised before its first step (the route's error answer); QueueFull,
            ShuttingDown (:meth:`eventkv.service.state.Jobs.start`); ClientGone: the client left while it waited.
        """
        # on the chat's memory (None without one): it is refused if the memory is deleted while it waits
        directory = self.job.d if isinstance(self.job, MemoryChat) else None
        self.result = self.jobs.start(lambda: self.job(self.step), directory)
        self.result.add_done_callback(lambda f: f.cancelled() or f.exception())  # read, even when nobody awaits
        self.first = asyncio.ensure_future(self.pieces.get())
        gone = asyncio.ensure_future(disconnected(self.request))
        try:
            await asyncio.wait({self.first, self.result, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not self.first.done():
            if self.result.done():  # the job ended before a step: its error is the answer
                self.first.cancel()
                self.result.result()
                return
            self.gone.set()
            self.result.cancel()  # a queued job leaves the queue; a running one stops at its next step
            self.first.cancel()
            raise ClientGone()

    async def pieces_until_done(self) -> AsyncIterator[str]:
        """Each step's text (possibly empty), until the job has ended (every piece it queued reaches
        the queue before its result: both go through ``call_soon_threadsafe``, in order)."""
        assert self.first is not None and self.result is not None
        if not self.first.cancelled():
            yield self.first.result()
        while True:
            get = asyncio.ensure_future(self.pieces.get())
            await asyncio.wait({get, self.result}, return_when=asyncio.FIRST_COMPLETED)
            if get.done():
                yield get.result()
                continue
            get.cancel()
            while not self.pieces.empty():
                yield self.pieces.get_nowait()
            return

    async def events(self, cid: str, created: int, model: str, include_usage: bool) -> AsyncIterator[bytes]:
        """The server-sent events of the answer (:class:`eventkv.service.openai.protocol.ChatCompletionChunk`)."""
        assert self.result is not None

        def chunk(delta: protocol.Delta | None, finish: str | None = None, **extra: BaseModel) -> bytes:
            # OpenAI's chunk: a delta holds only what it adds; "usage" is null but in the last chunk, and
            # present only with stream_options.include_usage
            data: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model}
            data["choices"] = (
                []
                if delta is None
                else [
                    {
                        "index": 0,
                        "delta": delta.model_dump(exclude_none=True),
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                ]
            )
            if include_usage:
                data["usage"] = None
            data.update({k: v.model_dump() for k, v in extra.items()})
            return format_sse_event(data_str=json.dumps(data, ensure_ascii=False, separators=(",", ":")))

        try:
            yield chunk(protocol.Delta(role="assistant", content=""))
            async for piece in self.pieces_until_done():
                if piece:
                    yield chunk(protocol.Delta(content=piece))
            try:
                out: Outcome = self.result.result()
            except Exception as exc:  # after the stream opened: OpenAI's error event, and no [DONE]
                yield format_sse_event(data_str=json.dumps(stream_error(exc, self.scrub), ensure_ascii=False))
                return
            yield chunk(protocol.Delta(), out.generation.finish_reason, eventkv=out.report())
            if include_usage:
                yield chunk(None, usage=out.usage())
            yield format_sse_event(data_str="[DONE]")
        finally:
            self.gone.set()  # a client that left: the job stops at its next step


def stream_error(exc: Exception, scrub: Callable[[str], str]) -> dict:
    """The error event of a stream that failed after it opened (OpenAI's error shape; the message
    ``scrub``-bed of the server's paths)."""
    if isinstance(exc, EventKVError):
        status, code = status_and_code(exc)
        message = scrub(str(exc))
    else:
        status, code, message = 500, "internal", f"internal error ({type(exc).__name__}): please report it."
    kind = "server_error" if status >= 500 else "invalid_request_error"
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
