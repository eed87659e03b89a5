"""``eventkv mcp`` through the MCP SDK's own client: the server runs as a subprocess (the real
command line, a sharpened tiny random model saved as a local directory, float32, one thread) and
``mcp.client.stdio.stdio_client`` + ``ClientSession`` initialize, list the tools (each schema's
required fields and descriptions), call every tool and get bad input back as tool errors. The
answers are checked against the library on the same store once the server has exited. Also: the
streamable HTTP transport, the ``--server URL`` backend against a live ``eventkv serve``, and the
command line's refusals (exit 2, one line)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

pytest.importorskip("mcp")
pytest.importorskip("fastapi")

import anyio  # noqa: E402
from mcp import ClientSession, StdioServerParameters  # noqa: E402
from mcp.client.stdio import stdio_client  # noqa: E402

from eventkv.memory import EventMemory, Hit  # noqa: E402

START = "from eventkv.cli import main; import sys; sys.argv[0] = 'eventkv'; main()"
TOOLS = [
    "add_memory",
    "search_memory",
    "query_memory",
    "update_memory",
    "memory_history",
    "delete_memory",
    "forget_memory",
]
REQUIRED = {
    "add_memory": ["text"],
    "search_memory": ["query"],
    "query_memory": ["question"],
    "update_memory": ["event_id", "text"],
    "memory_history": ["event_id"],
    "delete_memory": ["event_id"],
    "forget_memory": ["event_id"],
}
TOKEN = "mcp-t0k3n-for-the-tests-0123456789"
QUESTION = "Where does Dana live?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from service_fixtures import save_sharp_model

    return save_sharp_model(tmp_path_factory.mktemp("sharp"))


def params(*args: str) -> StdioServerParameters:
    """``eventkv mcp ARGS`` as the stdio client starts it (this interpreter, this checkout's sources)."""
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return StdioServerParameters(command=sys.executable, args=["-c", START, "mcp", *args], env=env)


def text(result) -> str:
    """The one text block of a tool result."""
    assert len(result.content) == 1
    return result.content[0].text


async def calls(session: ClientSession, steps: list[tuple[str, str, dict]]) -> dict:
    """``{key: result}`` of the tool calls ``(key, tool, arguments)``, in order."""
    return {key: await session.call_tool(tool, args) for key, tool, args in steps}


# ====================================================================== stdio, local store
WRITES = [
    (
        "add1",
        "add_memory",
        {"text": "Dana lives in Lisbon and works on the grant proposal.", "role": "user", "id": "dana"},
    ),
    ("add2", "add_memory", {"text": "Ravi will handle the quarterly report from Oslo.", "id": "ravi"}),
    ("add3", "add_memory", {"text": "The team offsite is on Tuesday at 10:30.", "tags": ["calendar"]}),
    ("add4", "add_memory", {"text": "Mei moved the server migration to Friday.", "prefill": True}),
    ("other", "add_memory", {"text": "Tomas asked for the demo slides.", "memory_id": "other"}),
    ("search", "search_memory", {"query": QUESTION, "k": 2}),
    ("query", "query_memory", {"question": QUESTION, "k": 1, "max_new_tokens": 4}),
    ("update", "update_memory", {"event_id": "ravi", "text": "Ravi moved the quarterly report to Bergen."}),
    ("history", "memory_history", {"event_id": "ravi"}),
    ("delete", "delete_memory", {"event_id": "e3", "expected_version": 5}),
    ("forget", "forget_memory", {"event_id": "dana"}),
    ("final_search", "search_memory", {"query": "quarterly report Bergen", "k": 3, "neighbours": 1}),
    ("final_query", "query_memory", {"question": "Who handles the report?", "select": "view", "max_new_tokens": 5}),
]
ERRORS = [
    ("blank", "add_memory", {"text": "   "}, "invalid_request: text '   ': string should match pattern '\\S'"),
    ("string_k", "search_memory", {"query": QUESTION, "k": "3"}, "invalid_request: k '3': input should be a valid"),
    ("extra", "search_memory", {"query": QUESTION, "limit": 3}, "limit 3: extra inputs are not permitted"),
    ("missing", "update_memory", {"text": "x"}, "invalid_request: event_id: field required"),
    ("bad_id", "search_memory", {"query": QUESTION, "memory_id": "../x"}, "invalid_request: memory_id '../x'"),
    ("unknown_memory", "search_memory", {"query": QUESTION, "memory_id": "nobody"}, "not_found: no memory 'nobody'"),
    ("unknown_event", "delete_memory", {"event_id": "nope"}, "not_found: no event 'nope' in memory 'notes'"),
    ("deleted", "update_memory", {"event_id": "e3", "text": "x"}, "gone: event 'e3' is deleted"),
    ("forgotten", "forget_memory", {"event_id": "dana"}, "gone: event 'dana' is forgotten"),
    ("stale", "add_memory", {"text": "late", "expected_version": 1}, "conflict: the memory is at version 7"),
    ("taken", "add_memory", {"text": "again", "id": "ravi"}, "conflict: event id 'ravi' is taken"),
    ("mark_id", "add_memory", {"text": "x", "id": "\u0301"}, "invalid_option: event id '\u0301': it starts"),
    ("blank_id", "add_memory", {"text": "x", "id": "\u2800"}, "invalid_option: event id '\u2800': it holds no"),
    ("budget", "search_memory", {"query": QUESTION, "budget": 0.5, "budget_rows": 9}, "invalid_option: budget 0.5"),
    ("tool", "no_such_tool", {}, "not_found: no tool 'no_such_tool': the tools are add_memory, search_memory"),
]


@pytest.fixture(scope="module")
def stdio_session(model_dir, tmp_path_factory):
    """One stdio session with ``eventkv mcp --store`` (default memory ``notes``): initialize, list the
    tools, the calls of WRITES and ERRORS and one more search after the errors; the server's
    stderr is kept. Yields the store and what the session got."""
    store = tmp_path_factory.mktemp("mcp-store")
    errlog = store.parent / "mcp-stderr.txt"
    got: dict = {}

    async def session():
        args = ["--model", str(model_dir), "--store", str(store), "--memory", "notes"]
        args += ["--dtype", "float32", "--threads", "1", "--instruction", "Answer from the events."]
        with errlog.open("w") as err, anyio.fail_after(600):
            async with stdio_client(params(*args), errlog=err) as (read, write):
                async with ClientSession(read, write) as s:
                    got["init"] = await s.initialize()
                    got["tools"] = (await s.list_tools()).tools
                    got.update(await calls(s, WRITES))
                    got.update(await calls(s, [(key, tool, a) for key, tool, a, _ in ERRORS]))
                    got["alive"] = await s.call_tool("search_memory", {"query": QUESTION, "k": 1})

    anyio.run(session)
    return store, got, errlog.read_text()


def test_initialize_names_the_server_and_its_default_memory(stdio_session):
    _, got, _ = stdio_session
    init = got["init"]
    assert init.server_info.name == "eventkv" and init.capabilities.tools is not None
    assert "memory_id (default 'notes') in namespace 'default'" in init.instructions


def test_every_tool_is_listed_with_a_described_schema(stdio_session):
    _, got, _ = stdio_session
    tools = {t.name: t for t in got["tools"]}
    assert list(tools) == TOOLS
    for name, tool in tools.items():
        schema = tool.input_schema
        assert schema["type"] == "object" and sorted(schema.get("required", [])) == REQUIRED[name], name
        assert schema["additionalProperties"] is False, name
        assert "memory_id" in schema["properties"] and tool.description and tool.output_schema, name
        undescribed = [p for p, spec in schema["properties"].items() if not spec.get("description")]
        assert undescribed == [], (name, undescribed)
    search = tools["search_memory"].input_schema["properties"]
    assert search["k"]["anyOf"][0] == {"maximum": 10000, "minimum": 1, "type": "integer"}
    assert tools["delete_memory"].annotations.destructive_hint is True
    assert tools["search_memory"].annotations.read_only_hint is True


def test_every_tool_answers(stdio_session):
    _, got, _ = stdio_session
    for key, _, _ in WRITES:
        assert not got[key].is_error, (key, text(got[key]))
    adds = [got[f"add{i}"].structured_content for i in (1, 2, 3, 4)]
    assert [a["id"] for a in adds] == ["dana", "ravi", "e3", "e4"] and [a["version"] for a in adds] == [1, 2, 3, 4]
    assert all(b["position"] == a["position"] + a["width"] for a, b in zip(adds, adds[1:]))  # one after another
    assert {a["memory_id"] for a in adds} == {"notes"} and got["other"].structured_content["memory_id"] == "other"
    hits = got["search"].structured_content["results"]
    assert [h["id"] for h in hits][0] == "dana" and len(hits) == 2 and hits[0]["score"] > hits[1]["score"]
    assert hits[0]["text"] == "Dana lives in Lisbon and works on the grant proposal." and hits[0]["role"] == "user"
    answer = got["query"].structured_content
    assert answer["served_ids"] == ["dana"] and 1 <= len(answer["tokens"]) <= 4 and answer["version"] == 4
    assert got["update"].structured_content["id"] == "ravi~1" and got["update"].structured_content["version"] == 5
    history = got["history"].structured_content["events"]
    assert [(r["id"], r["kind"], r["supersedes"]) for r in history] == [
        ("ravi", "event", None),
        ("ravi~1", "patch", "ravi"),
    ]
    assert got["delete"].structured_content == {"memory_id": "notes", "version": 6, "rows": None}
    forget = got["forget"].structured_content
    assert forget["version"] == 7 and forget["rows"] > 0
    assert "ravi~1" in [h["id"] for h in got["final_search"].structured_content["results"]]
    # the text block is the structured content as JSON
    import json

    assert json.loads(text(got["search"])) == got["search"].structured_content


def test_bad_calls_are_tool_errors_and_the_server_lives_on(stdio_session):
    _, got, stderr = stdio_session
    for key, _, _, says in ERRORS:
        assert got[key].is_error, key
        assert says in text(got[key]), (key, text(got[key]))
    assert not got["alive"].is_error and len(got["alive"].structured_content["results"]) == 1
    assert "Traceback" not in stderr
    assert str(stdio_session[0]) not in "".join(text(got[k]) for k, *_ in ERRORS)  # no server path leaks


def test_answers_equal_the_library_on_the_same_store(stdio_session, model_dir):
    from eventkv.models import load

    store, got, _ = stdio_session
    lm = load(str(model_dir), dtype="float32")
    with EventMemory.open(store / "default" / "notes", lm) as mem:
        assert mem.store.manifest["instruction"] == "Answer from the events."
        assert mem.version == 7 and mem.get("dana").forgotten and mem.get("e3").deleted
        hits = mem.search("quarterly report Bergen", k=3, neighbours=1)
        served = got["final_search"].structured_content["results"]
        assert [Hit(**{**h, "tags": tuple(h["tags"])}) for h in served] == hits
        answer = mem.query("Who handles the report?", select="view", max_new_tokens=5)
        assert got["final_query"].structured_content["tokens"] == answer.generation.tokens
        assert got["final_query"].structured_content["served_ids"] == answer.served_ids
    with EventMemory.open(store / "default" / "other", lm) as other:
        assert [r.text for r in other.list()] == ["Tomas asked for the demo slides."]


# ====================================================================== streamable HTTP
@pytest.mark.slow
def test_the_streamable_http_transport(model_dir, tmp_path):
    from mcp.client.streamable_http import streamable_http_client

    cmd = [sys.executable, "-c", START, "mcp", "--model", str(model_dir), "--store", str(tmp_path / "s")]
    cmd += ["--dtype", "float32", "--threads", "1", "--transport", "http", "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    found = threading.Event()
    port: list[int] = []

    def pump():
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line)
            if m and not port:
                port.append(int(m.group(1)))
                found.set()
        found.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert found.wait(180) and port, "".join(lines)
        got: dict = {}

        async def session():
            with anyio.fail_after(300):
                async with streamable_http_client(f"http://127.0.0.1:{port[0]}/mcp") as (read, write):
                    async with ClientSession(read, write) as s:
                        await s.initialize()
                        got["tools"] = [t.name for t in (await s.list_tools()).tools]
                        got["add"] = await s.call_tool("add_memory", {"text": "Dana lives in Lisbon.", "id": "dana"})
                        got["search"] = await s.call_tool("search_memory", {"query": QUESTION})
                        got["bad"] = await s.call_tool("search_memory", {"query": ""})

        anyio.run(session)
        assert got["tools"] == TOOLS
        assert got["add"].structured_content["id"] == "dana"
        assert [h["id"] for h in got["search"].structured_content["results"]] == ["dana"]
        assert got["bad"].is_error and text(got["bad"]).startswith("invalid_request: query '': ")
    finally:
        proc.terminate()
        code = proc.wait(60)
    assert code == 0, "".join(lines)  # SIGTERM: a clean shutdown
    assert (tmp_path / "s" / "default" / "default" / "manifest.json").is_file()


# ====================================================================== --server: a live eventkv serve
@pytest.mark.slow
def test_the_server_backend_through_a_live_eventkv_serve(model_dir, tmp_path):
    from service_fixtures import Server

    from eventkv.client import Client

    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} team\n")
    srv = Server(model_dir, tmp_path / "store", "--token-file", str(tokens))
    got: dict = {}
    try:

        async def session():
            args = ["--server", srv.url, "--token-file", str(tokens), "--namespace", "team", "--memory", "agent-1"]
            with (tmp_path / "mcp-stderr.txt").open("w") as err, anyio.fail_after(600):
                async with stdio_client(params(*args), errlog=err) as (read, write):
                    async with ClientSession(read, write) as s:
                        await s.initialize()
                        got.update(
                            await calls(
                                s,
                                [
                                    ("add1", "add_memory", {"text": "Dana lives in Lisbon.", "id": "dana"}),
                                    ("add2", "add_memory", {"text": "Ravi drinks green tea.", "id": "ravi"}),
                                    ("search", "search_memory", {"query": QUESTION, "k": 2}),
                                    ("query", "query_memory", {"question": QUESTION, "k": 1, "max_new_tokens": 3}),
                                    ("update", "update_memory", {"event_id": "ravi", "text": "Ravi drinks coffee."}),
                                    ("history", "memory_history", {"event_id": "ravi"}),
                                    ("delete", "delete_memory", {"event_id": "ravi~1"}),
                                    ("forget", "forget_memory", {"event_id": "dana", "expected_version": 4}),
                                    ("gone", "update_memory", {"event_id": "dana", "text": "x"}),
                                    ("stale", "delete_memory", {"event_id": "ravi", "expected_version": 1}),
                                    ("string_k", "search_memory", {"query": QUESTION, "k": "2"}),
                                    ("unknown", "search_memory", {"query": QUESTION, "memory_id": "nobody"}),
                                ],
                            )
                        )

        anyio.run(session)
        with Client.open(srv.url, "agent-1", namespace="team", token=TOKEN) as client:
            library = client.search(QUESTION, k=2)
            view = client.view_ids()
    finally:
        srv.kill()
    for key in ("add1", "add2", "search", "query", "update", "history", "delete", "forget"):
        assert not got[key].is_error, (key, text(got[key]))
    assert [got[k].structured_content["version"] for k in ("add1", "add2", "update", "delete", "forget")] == [
        1,
        2,
        3,
        4,
        5,
    ]
    assert [h["id"] for h in got["search"].structured_content["results"]] == ["dana", "ravi"]
    assert got["query"].structured_content["served_ids"] == ["dana"]
    assert [r["id"] for r in got["history"].structured_content["events"]] == ["ravi", "ravi~1"]
    assert got["forget"].structured_content["rows"] >= 0
    assert text(got["gone"]).startswith("gone: ") and text(got["stale"]).startswith(
        "conflict: the memory is at version 5"
    )
    assert text(got["string_k"]).startswith("invalid_request: k '2'")
    assert text(got["unknown"]).startswith("not_found: no memory 'nobody' in namespace 'team'")
    assert view == ["ravi"] and [h.id for h in library] == ["ravi"]  # dana forgotten, the patch deleted


# ====================================================================== the command line
@pytest.mark.parametrize(
    ("args", "says"),
    [
        ([], "eventkv mcp needs a backend: --store DIR with --model"),
        (["--store", "S"], "--store 'S': a local store needs --model M"),
        (["--server", "localhost:8000"], "--server 'localhost:8000': give the server's URL"),
        (["--server", "http://127.0.0.1:9", "--store", "S", "--model", "m"], "not both"),
        (["--server", "http://127.0.0.1:9", "--model", "m"], "--model 'm': leave --model out with --server"),
        (["--store", "S", "--model", "m", "--token-file", "t"], "--token-file 't': a token is for --server"),
        (["--store", "S", "--model", "m", "--transport", "sse"], "--transport 'sse': give stdio or http."),
        (["--store", "S", "--model", "m", "--transport", "http", "--host", "0.0.0.0"], "--host '0.0.0.0': the MCP"),
        (["--store", "S", "--model", "m", "--namespace", "a/b"], "--namespace 'a/b': use 1-64 characters"),
        (["--store", "S", "--model", "m", "--memory", ".."], "--memory '..': use 1-64 characters"),
        (["--store", "S", "--model", "m", "--threads", "0"], "--threads 0: give 1 to"),
        (["--store", "S", "--model", "m", "--rows", "int2"], "rows 'int2': give native"),
        (["--server", "http://127.0.0.1:9"], "no eventkv server answers at http://127.0.0.1:9"),
    ],
)
def test_bad_options_exit_2_with_one_line(monkeypatch, capsys, tmp_path, args, says):
    from cli_fixtures import run_cli

    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(monkeypatch, capsys, "mcp", *args)
    assert code == 2 and says in err and "Traceback" not in out + err, err
    assert not Path("S").exists()  # refused before anything is made


def test_a_memory_add_memory_creates_stores_its_rows_in_the_asked_format(tmp_path):
    from eventkv.mcp.backends import LocalStore
    from eventkv.memory import MemoryEvent
    from eventkv.memory.reader import read_memory
    from eventkv.testing import tiny_lm

    store = LocalStore(tiny_lm("llama"), tmp_path, "team", rows="int4")
    try:
        anyio.run(
            lambda: store.run("m", lambda mem: mem.add([MemoryEvent("The heron is back.")], prefill=True), create=True)
        )
    finally:
        store.close()
    assert read_memory(tmp_path / "team" / "m").manifest["rows"] == "int4"


def test_a_token_not_granted_the_namespace_is_refused(monkeypatch, capsys, tmp_path):
    from cli_fixtures import run_cli

    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN} team,ops\n")
    code, _, err = run_cli(
        monkeypatch, capsys, "mcp", "--server", "http://127.0.0.1:9", "--token-file", str(tokens), "--namespace", "x"
    )
    assert code == 2 and "--namespace 'x': the token of" in err and "granted ops, team only" in err
