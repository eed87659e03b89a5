"""The OpenAI-compatible chat endpoint through real clients: the official ``openai`` package (sync,
async, streaming) and LangChain's ``ChatOpenAI``, against a live uvicorn server on 127.0.0.1 and a
free port (tests/service_fixtures.LiveApp: the tiny Llama, output layer sharpened, float32). A greedy
chat completion equals ``EventMemory.query`` on the same open memory, token for token; streamed and
non-streamed answers are equal; usage counts equal the tokens counted independently; seeded
sampling repeats; ``remember`` stores two events, and an acknowledged one survives a SIGKILL (a
subprocess server); every bad request gets OpenAI's error shape with a 4xx, never a 500."""

from __future__ import annotations

import asyncio
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import torch  # noqa: E402
from service_fixtures import LiveApp, save_sharp_model  # noqa: E402

from eventkv.kv.decoding import Decoding  # noqa: E402
from eventkv.kv.log import tokenize_query  # noqa: E402
from eventkv.memory import EventMemory  # noqa: E402
from eventkv.service.app import Settings, create_app  # noqa: E402
from eventkv.service.server import ServerProcess  # noqa: E402
from eventkv.testing import tiny_lm  # noqa: E402

TOKEN = "t0k3n-for-the-chat-tests-0123456789"
ELSEWHERE = "t0k3n-granted-namespace-elsewhere-01"  # granted another namespace only
MODEL = "tiny-llama"
QUESTION = "Where does Dana live?"
EVENTS = [
    {"text": "Dana lives in Lisbon and works on the grant proposal.", "id": "dana", "role": "user"},
    {"text": "Ravi will handle the quarterly report from Oslo.", "id": "ravi", "role": "user"},
    {"text": "The team offsite is on Tuesday at 10:30.", "id": "offsite", "role": "assistant"},
]


@pytest.fixture(scope="module")
def lm():
    """The tiny random Llama with its output layer scaled by 30 (clear top-two margins, as the
    subprocess servers' model: tests/service_fixtures.save_sharp_model)."""
    lm = tiny_lm("llama")
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(30.0)
    return lm


@pytest.fixture(scope="module")
def live(lm, tmp_path_factory):
    """A live server with a token file's two tokens and memory ``m`` (three events, prefilled)."""
    store = tmp_path_factory.mktemp("chat-store")
    app = create_app(Settings(lm, store, {TOKEN: None, ELSEWHERE: frozenset({"elsewhere"})}))
    with LiveApp(app) as srv:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        post = lambda path, body: httpx.post(f"{srv.url}{path}", json=body, headers=auth, timeout=60)  # noqa: E731
        assert post("/v1/memories", {"id": "m"}).status_code == 201
        assert post("/v1/memories/m/events", {"events": EVENTS, "prefill": True}).status_code == 201
        assert post("/v1/memories", {"id": "empty"}).status_code == 201
        srv.store, srv.auth = store, auth
        yield srv


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=TOKEN, max_retries=0, timeout=120)


def on_memory(live, mid, verb):
    """``verb(memory)`` on the server's worker thread, on the memory it holds open (the same object
    the chat endpoint answers from)."""
    worker = live.app.state.worker
    return worker.submit(lambda: verb(worker.memory(live.store / "default" / mid))).result(120)


def ask(content=QUESTION):
    return [{"role": "user", "content": content}]


def chat(client, messages=None, memory=None, **kw):
    extra = {"memory": memory} if memory is not None else None
    return client.chat.completions.create(model=MODEL, messages=messages or ask(), extra_body=extra, **kw)


def streamed(client, messages=None, memory=None, **kw):
    """The streamed answer: (text, the chunks)."""
    extra = {"memory": memory} if memory is not None else None
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages or ask(), extra_body=extra, stream=True, **kw)
    )
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


# ---------------------------------------------------------------------- the models
def test_the_served_model_is_listed_and_retrieved(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].owned_by == "eventkv"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"


# ---------------------------------------------------------------------- answers equal the library's
@pytest.mark.parametrize(
    "memory, query",
    [
        ({"id": "m", "select": "view"}, {"select": "view"}),
        ({"id": "m", "k": 1}, {"k": 1}),  # selected from the last user message by the memory's selector
        ({"id": "m", "budget_rows": 70}, {"k": None, "budget_rows": 70}),  # a budget without k: filled
        ({"id": "m", "select": ["ravi"], "mode": "text"}, {"select": ["ravi"], "mode": "text"}),
    ],
)
def test_greedy_chat_equals_the_memory_query(live, client, memory, query):
    r = chat(client, memory=memory, max_tokens=12)
    a = on_memory(live, "m", lambda mem: mem.query(QUESTION, max_new_tokens=12, **query))
    assert r.eventkv["tokens"] == a.generation.tokens and len(a.generation.tokens) > 0
    assert r.choices[0].message.content == a.text
    assert r.eventkv["served_ids"] == a.served_ids and r.eventkv["memory"] == "m"
    assert r.choices[0].finish_reason == ("stop" if a.generation.stopped else "length")


def test_usage_counts_are_the_real_token_counts(live, lm, client):
    r = chat(client, memory={"id": "m", "select": ["dana", "offsite"]}, max_tokens=9)
    header = on_memory(live, "m", lambda mem: len(mem.header_ids))
    rows = on_memory(live, "m", lambda mem: mem.get("dana").n_rows + mem.get("offsite").n_rows)
    new = len(tokenize_query(lm.tokenizer, lm.profile, QUESTION))
    u = r.usage
    assert (u.memory_rows, u.new_tokens) == (header + rows, new)
    assert u.prompt_tokens == header + rows + new and u.completion_tokens == len(r.eventkv["tokens"])
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # without a memory: the chat template's tokens of the conversation
    messages = [{"role": "system", "content": "Be brief."}, *ask()]
    plain = chat(client, messages, max_tokens=5)
    prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = prompt["input_ids"] if isinstance(prompt, dict) or hasattr(prompt, "keys") else prompt
    assert (plain.usage.prompt_tokens, plain.usage.memory_rows, plain.usage.new_tokens) == (len(ids), 0, len(ids))
    assert plain.usage.completion_tokens == len(plain.eventkv["tokens"]) and plain.eventkv["memory"] is None


def test_plain_chat_is_the_model_over_its_chat_template(lm, client):
    """Greedy decoding recomputed from scratch (a full forward per token, no cache) over the chat
    template's ids gives the plain chat's tokens (the sharpened model's margins are far above the
    cached path's float rounding)."""
    messages = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": "Hello."}, *ask()]
    r = chat(client, messages, max_tokens=6)
    prompt = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    out = []
    with torch.no_grad():
        for _ in range(6):
            t = int(lm.model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if t in lm.profile.stop_token_ids:
                break
            out.append(t)
    assert r.eventkv["tokens"] == out


def test_text_parts_system_messages_and_the_memory_header(live, client):
    base = chat(client, memory={"id": "m", "select": "view"}, max_tokens=8)
    parts = chat(
        client,
        [{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        {"id": "m", "select": "view"},
        max_tokens=8,
    )
    assert parts.eventkv["tokens"] == base.eventkv["tokens"]
    # X-EventKV-Memory attaches a memory with the default options (the served set selected by BM25, k=8)
    header = client.chat.completions.create(
        model=MODEL, messages=ask(), max_tokens=8, extra_headers={"X-EventKV-Memory": "m"}
    )
    selected = on_memory(live, "m", lambda mem: mem.query(QUESTION, max_new_tokens=8))
    assert header.eventkv["tokens"] == selected.generation.tokens and header.eventkv["memory"] == "m"
    # under a memory a system message opens the next user message's content
    folded = chat(
        client, [{"role": "system", "content": "Be brief."}, *ask()], {"id": "m", "select": "view"}, max_tokens=8
    )
    expected = on_memory(
        live,
        "m",
        lambda mem: mem.query(
            QUESTION,
            select="view",
            max_new_tokens=8,
            messages=[{"role": "user", "content": "Be brief.\n\n" + QUESTION}],
        ),
    )
    assert folded.eventkv["tokens"] == expected.generation.tokens


# ---------------------------------------------------------------------- streaming
@pytest.mark.parametrize("memory", [{"id": "m", "select": "view"}, None])
def test_streamed_equals_non_streamed(client, memory):
    for question, stop in [(QUESTION, None), ("What is on Tuesday?", None), ("Who writes the report?", "e")]:
        kw = {"max_tokens": 16, **({"stop": stop} if stop else {})}
        whole = chat(client, ask(question), memory, **kw)
        text, chunks = streamed(client, ask(question), memory, stream_options={"include_usage": True}, **kw)
        assert text == whole.choices[0].message.content
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
        finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert [c.choices[0].finish_reason for c in finish] == [whole.choices[0].finish_reason]
        assert finish[0].eventkv["tokens"] == whole.eventkv["tokens"]
        assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage  # include_usage: the last chunk
        assert all(c.usage is None for c in chunks[:-1])


def test_the_stream_is_openai_server_sent_events(live):
    body = {"model": MODEL, "messages": ask(), "max_tokens": 6, "stream": True, "memory": {"id": "m"}}
    with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=body, headers=live.auth, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"} and len({c["id"] for c in chunks}) == 1
    assert "usage" not in chunks[0]  # only with stream_options.include_usage


def test_async_client_sync_client_and_streams_agree(live, client):
    sync = chat(client, memory={"id": "m", "select": "view"}, max_tokens=10)

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key=TOKEN, max_retries=0) as aclient:
            whole = await aclient.chat.completions.create(
                model=MODEL, messages=ask(), max_tokens=10, extra_body={"memory": {"id": "m", "select": "view"}}
            )
            stream = await aclient.chat.completions.create(
                model=MODEL,
                messages=ask(),
                max_tokens=10,
                stream=True,
                extra_body={"memory": {"id": "m", "select": "view"}},
            )
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            return whole, "".join(pieces)

    whole, text = asyncio.run(run())
    assert whole.choices[0].message.content == text == sync.choices[0].message.content
    assert whole.eventkv["tokens"] == sync.eventkv["tokens"]


def test_langchain_chat_openai_invoke_and_stream(live, client):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=f"{live.url}/v1",
        api_key=TOKEN,
        model=MODEL,
        max_tokens=10,
        temperature=0,
        max_retries=0,
        extra_body={"memory": {"id": "m", "select": "view"}},
    )
    expected = chat(client, memory={"id": "m", "select": "view"}, max_tokens=10).choices[0].message.content
    reply = llm.invoke(QUESTION)
    assert reply.content == expected
    assert "".join(str(c.content) for c in llm.stream(QUESTION)) == expected
    plain = ChatOpenAI(base_url=f"{live.url}/v1", api_key=TOKEN, model=MODEL, max_tokens=6, max_retries=0)
    assert plain.invoke([("system", "Be brief."), ("human", QUESTION)]).content == (
        chat(client, [{"role": "system", "content": "Be brief."}, *ask()], max_tokens=6).choices[0].message.content
    )


# ---------------------------------------------------------------------- sampling and stop strings
def test_seeded_sampling_repeats_and_equals_the_library(live, client):
    kw = dict(memory={"id": "m", "select": "view"}, max_tokens=12, temperature=1.0)
    first, again = chat(client, seed=7, **kw), chat(client, seed=7, **kw)
    other = chat(client, seed=8, **kw)
    assert first.eventkv["tokens"] == again.eventkv["tokens"] != other.eventkv["tokens"]
    a = on_memory(
        live,
        "m",
        lambda mem: mem.query(QUESTION, select="view", max_new_tokens=12, decoding=Decoding(temperature=1.0, seed=7)),
    )
    assert first.eventkv["tokens"] == a.generation.tokens
    nucleus = chat(client, seed=7, top_p=0.5, **kw)
    assert nucleus.eventkv["tokens"] == chat(client, seed=7, top_p=0.5, **kw).eventkv["tokens"]
    greedy = chat(client, memory={"id": "m", "select": "view"}, max_tokens=12, temperature=0, seed=7)
    assert (
        greedy.eventkv["tokens"] == chat(client, memory={"id": "m", "select": "view"}, max_tokens=12).eventkv["tokens"]
    )
    text, _ = streamed(client, seed=7, **kw)
    assert text == first.choices[0].message.content


def test_stop_strings_cut_the_answer(client):
    whole = chat(client, memory={"id": "m", "select": "view"}, max_tokens=16)
    text = whole.choices[0].message.content
    cut = next(i for i in range(1, len(text)) if text[i] not in text[:i] and text[i] != "\ufffd")
    stop = text[cut]
    r = chat(client, memory={"id": "m", "select": "view"}, max_tokens=16, stop=[stop, "\x00never"])
    assert r.choices[0].message.content == text[:cut] and r.choices[0].finish_reason == "stop"
    assert r.eventkv["tokens"] == whole.eventkv["tokens"][: len(r.eventkv["tokens"])]
    assert streamed(client, memory={"id": "m", "select": "view"}, max_tokens=16, stop=stop)[0] == text[:cut]


# ---------------------------------------------------------------------- remember
def test_remember_stores_the_user_turn_and_the_reply(live, client):
    before = on_memory(live, "m", lambda mem: (mem.version, [r.id for r in mem.list()]))
    r = chat(
        client, ask("Remember that Mei moved to Porto."), {"id": "m", "select": "view", "remember": True}, max_tokens=8
    )
    added = r.eventkv["remembered"]
    assert len(added) == 2 and r.eventkv["version"] == before[0] + 1
    records = on_memory(live, "m", lambda mem: [mem.get(i) for i in added])
    assert [(x.role, x.text) for x in records] == [
        ("user", "Remember that Mei moved to Porto."),
        ("assistant", r.choices[0].message.content),
    ]
    assert on_memory(live, "m", lambda mem: [x.id for x in mem.list()]) == before[1] + added
    # a streamed remember: the finish chunk names the events, stored before it was sent
    text, chunks = streamed(
        client, ask("Ravi left Oslo."), {"id": "m", "select": "view", "remember": True}, max_tokens=6
    )
    finish = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    stored = on_memory(live, "m", lambda mem: [mem.get(i).text for i in finish.eventkv["remembered"]])
    assert stored == ["Ravi left Oslo.", text]
    for eid in added + finish.eventkv["remembered"]:  # leave the memory as the other tests expect
        r = httpx.post(f"{live.url}/v1/memories/m/events/{eid}/delete", headers=live.auth, timeout=60)
        assert r.status_code == 200


@pytest.mark.slow
def test_an_acknowledged_remember_survives_sigkill(tmp_path):
    model_dir = save_sharp_model(tmp_path / "sharp")
    srv = ServerProcess(model_dir, tmp_path / "store", "--dtype", "float32", "--threads", "1", timeout=900)
    try:
        assert httpx.post(f"{srv.url}/v1/memories", json={"id": "k"}, timeout=60).status_code == 201
        r = httpx.post(f"{srv.url}/v1/memories/k/events", json={"events": EVENTS[:2]}, timeout=60)
        assert r.status_code == 201
        c = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = c.models.list().data[0].id
        reply = c.chat.completions.create(
            model=model, messages=ask(), max_tokens=6, extra_body={"memory": {"id": "k", "remember": True}}
        )
    finally:
        srv.kill()  # SIGKILL right after the acknowledgement: no shutdown at all
    from eventkv.models import load

    with EventMemory.open(tmp_path / "store" / "default" / "k", load(model_dir, dtype="float32")) as mem:
        texts = [(x.id, x.role, x.text) for x in mem.list()]
    (user_id, assistant_id) = reply.eventkv["remembered"]
    assert texts[-2:] == [(user_id, "user", QUESTION), (assistant_id, "assistant", reply.choices[0].message.content)]


# ---------------------------------------------------------------------- bad requests: OpenAI's errors, 4xx
BAD = [
    ({"n": 2}, openai.BadRequestError, "unsupported_parameter", "n"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        openai.BadRequestError,
        "unsupported_parameter",
        "tools",
    ),
    ({"tool_choice": "auto"}, openai.BadRequestError, "unsupported_parameter", "tool_choice"),
    ({"functions": [{"name": "f"}]}, openai.BadRequestError, "unsupported_parameter", "functions"),
    ({"response_format": {"type": "json_object"}}, openai.BadRequestError, "unsupported_parameter", "response_format"),
    ({"logprobs": True}, openai.BadRequestError, "unsupported_parameter", "logprobs"),
    ({"presence_penalty": 0.5}, openai.BadRequestError, "unsupported_parameter", "presence_penalty"),
    ({"extra_body": {"colour": "blue"}}, openai.BadRequestError, "unknown_parameter", "colour"),
    ({"temperature": "hot"}, openai.BadRequestError, "invalid_request", "temperature"),
    ({"temperature": 3}, openai.BadRequestError, "invalid_request", "temperature"),
    ({"max_tokens": 0}, openai.BadRequestError, "invalid_request", "max_tokens"),
    ({"messages": [{"role": "user", "content": 5}]}, openai.BadRequestError, "invalid_request", "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        openai.BadRequestError,
        "unsupported_parameter",
        "messages[0].content[0].type",
    ),
    (
        {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]},
        openai.BadRequestError,
        "unsupported_parameter",
        "messages[0].role",
    ),
    ({"messages": []}, openai.BadRequestError, "invalid_request", "messages"),
    (
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]},
        openai.BadRequestError,
        "invalid_option",
        "messages[-1].role",
    ),
    (
        {"messages": [{"role": "user", "content": " "}]},
        openai.BadRequestError,
        "invalid_option",
        "messages[-1].content",
    ),
    (
        {"messages": [{"role": "user", "content": "word " * 900}]},
        openai.BadRequestError,
        "refused",
        None,
    ),  # past the context
    ({"model": "gpt-4o"}, openai.NotFoundError, "model_not_found", None),
    ({"extra_body": {"memory": {"id": "nope"}}}, openai.NotFoundError, "not_found", None),
    ({"extra_body": {"memory": {"id": "../etc"}}}, openai.BadRequestError, "invalid_request", "memory.id"),
    ({"extra_body": {"memory": {"id": "m", "select": ["nope"]}}}, openai.NotFoundError, "not_found", None),
    ({"extra_body": {"memory": {"id": "m", "k": 0}}}, openai.BadRequestError, "invalid_request", "memory.k"),
    ({"extra_body": {"memory": {"id": "empty"}}}, openai.ConflictError, "conflict", None),  # nothing to serve
    (
        {"extra_body": {"memory": {"id": "m"}}, "extra_headers": {"X-EventKV-Memory": "other"}},
        openai.BadRequestError,
        "invalid_option",
        "memory.id",
    ),
    ({"extra_headers": {"X-EventKV-Memory": "bad id"}}, openai.BadRequestError, "invalid_option", "X-EventKV-Memory"),
    ({"stream_options": {"include_usage": True}}, openai.BadRequestError, "invalid_option", "stream_options"),
    (
        {"max_tokens": 4096, "extra_body": {"memory": {"id": "m"}}},
        openai.BadRequestError,
        "invalid_option",
        "max_tokens",
    ),
]


@pytest.mark.parametrize("given, kind, code, param", BAD, ids=[str(i) for i in range(len(BAD))])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_requests_get_openai_errors(client, given, kind, code, param, stream):
    kw = {"model": MODEL, "messages": ask("hi"), "max_tokens": 4, **given}
    if stream and "stream_options" in kw:
        pytest.skip("stream_options is valid with stream: true")
    with pytest.raises(kind) as e:
        client.chat.completions.create(stream=stream, **kw)
    assert 400 <= e.value.status_code < 500
    body = e.value.body
    assert set(body) == {"message", "type", "param", "code"} and body["type"] == "invalid_request_error"
    assert (body["code"], body["param"]) == (code, param) and body["message"]
    if code == "unsupported_parameter":
        assert "not supported" in body["message"]


def test_auth_namespaces_and_raw_bodies_keep_openai_shape(live):
    denied = openai.OpenAI(base_url=f"{live.url}/v1", api_key="wrong-token-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        denied.chat.completions.create(model=MODEL, messages=ask())
    assert e.value.status_code == 401 and e.value.body["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        denied.models.list()
    elsewhere = openai.OpenAI(base_url=f"{live.url}/v1", api_key=ELSEWHERE, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as e:  # memory m is in namespace default
        elsewhere.chat.completions.create(model=MODEL, messages=ask(), max_tokens=2, extra_body={"memory": {"id": "m"}})
    assert e.value.status_code == 403 and e.value.body["type"] == "permission_error"
    plain = elsewhere.chat.completions.create(model=MODEL, messages=ask(), max_tokens=2)  # no namespace involved
    assert plain.choices[0].finish_reason in ("stop", "length")
    url = f"{live.url}/v1/chat/completions"
    not_json = httpx.post(
        url, content=b"{not json", headers={**live.auth, "content-type": "application/json"}, timeout=60
    )
    assert not_json.status_code == 400 and set(not_json.json()["error"]) == {"message", "type", "param", "code"}
    assert not_json.json()["error"]["param"] is None  # a character of the body is not a parameter
    assert not_json.json()["error"]["message"].startswith(
        "the body is not valid JSON at character 1: Expecting property name enclosed in double quotes"
    )
    wrong_method = httpx.get(url, headers=live.auth, timeout=60)
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()
    too_big = httpx.post(url, content=b"x" * (5 * 1024 * 1024), headers=live.auth, timeout=60)  # over --max-body
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "body_too_large"
    no_route = httpx.get(f"{live.url}/v1/chat/nothing", headers=live.auth, timeout=60)
    assert no_route.status_code == 404 and no_route.json()["error"]["code"] == "not_found"
    # the memory routes keep their own error body
    other = httpx.post(f"{live.url}/v1/memories/m/query", json={"question": "x", "k": 0}, headers=live.auth, timeout=60)
    assert other.status_code == 422 and set(other.json()) == {"code", "message"}


def test_concurrent_chats_are_answered_in_one_batch_as_alone(live, client):
    """Three non-streamed chats on the memory (other questions, budgets and served sets) and a
    ``POST …/query``, queued while the worker is held, are answered in one batched readout; each chat's
    tokens equal the same chat sent alone afterwards."""
    import threading
    import time
    from collections import Counter

    worker = live.app.state.worker
    asks = [
        dict(messages=ask(), memory={"id": "m", "select": ["dana", "offsite"]}, max_tokens=4),
        dict(messages=ask("Who handles the quarterly report?"), memory={"id": "m"}, max_tokens=6),
        dict(messages=ask("When is the offsite?"), memory={"id": "m", "k": 1}, max_tokens=3),
    ]
    running, release = threading.Event(), threading.Event()
    before = Counter(worker.batches)
    blocker = worker.submit(lambda: (running.set(), release.wait(60)))
    assert running.wait(30)
    answers: dict[int, object] = {}

    def send(i: int) -> None:
        if i < len(asks):
            answers[i] = chat(client, **asks[i])
        else:
            body = {"question": QUESTION, "max_new_tokens": 2}
            answers[i] = httpx.post(f"{live.url}/v1/memories/m/query", json=body, headers=live.auth, timeout=60)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(asks) + 1)]
    for i, t in enumerate(threads):
        t.start()
        deadline = time.monotonic() + 30
        while worker.depth < i + 1:  # queued in this order
            assert time.monotonic() < deadline
            time.sleep(0.01)
    release.set()
    blocker.result(60)
    for t in threads:
        t.join(60)
    assert Counter(worker.batches) - before == Counter({4: 1})
    assert answers[len(asks)].status_code == 200
    for i, a in enumerate(asks):
        alone = chat(client, **a)
        assert answers[i].eventkv["tokens"] == alone.eventkv["tokens"]
        assert answers[i].choices[0].message.content == alone.choices[0].message.content
        assert answers[i].usage == alone.usage
