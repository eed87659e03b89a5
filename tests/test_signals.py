"""How each long-running command stops on SIGTERM and on Ctrl-C (SIGINT), as README.md's "Stopping a
command" table states. Each command runs as a real subprocess (this interpreter, the tiny models, servers
on 127.0.0.1 and a port uvicorn picks) and gets the signal once it is really running:

* the batch commands (a probe run, ``memory eval``, ``sweep``) are paused just before their second record
  (the start-up code below wraps :func:`eventkv.probes.runner.compute_record` in the child only: it marks
  a file and waits there for the test's signal), so exactly one record is on disk; they exit 143 on
  SIGTERM and 130 on SIGINT, print one line saying what was kept, leave the record whole, and the same
  command resumes (only the missing items are computed);
* the servers (``serve``, ``serve --backend ray``, ``mcp`` over stdio and over HTTP) answer a write, then
  exit 0, every memory closed (its SQLite write-ahead log checkpointed away) and the write kept.

Every step waits at most :data:`WAIT` seconds (a bound, never a pace) and every child is killed in
``finally``."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml
from cli_fixtures import run_cli

from eventkv.probes.runner import RECORDS, RUN_MANIFEST

WAIT = 180.0
"""Seconds any one step (a start-up, a reply, an exit) may take at most."""

START = "from eventkv.cli import main; import sys; sys.argv[0] = 'eventkv'; main()"

PAUSED = textwrap.dedent(
    """
    import os, sys, time
    import eventkv.probes.runner as runner

    compute, calls = runner.compute_record, []

    def paused(*args, **kwargs):
        if len(calls) == 1:  # the first record is written: say so, and wait here for the test's signal
            open(os.environ["PAUSE_MARK"], "w").close()
            time.sleep(600)
        calls.append(1)
        return compute(*args, **kwargs)

    runner.compute_record = paused
    from eventkv.cli import main
    sys.argv[0] = "eventkv"
    main()
    """
)
"""``eventkv ARGS`` whose runner stops before its second record: it creates the file ``$PAUSE_MARK`` and waits."""

CODES = [(signal.SIGTERM, 143), (signal.SIGINT, 130)]
"""A batch command's exit status per signal (128 + the signal's number, the shell's convention)."""


def _default_sigint() -> None:
    """In the child, before exec: SIGINT back to its default disposition."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Child:
    """``eventkv ARGS`` in a subprocess: ``pause`` (a path) runs it under :data:`PAUSED`; ``wire``: stdin and
    stdout are the MCP stdio transport (:meth:`send`, :meth:`reply`) and stderr is the log, else stdout and
    stderr together are the log. Killed on leaving the ``with`` block."""

    def __init__(self, *args: str, pause: Path | None = None, wire: bool = False) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        if pause is not None:
            env["PAUSE_MARK"] = str(pause)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PAUSED if pause is not None else START, *args],
            stdin=subprocess.PIPE if wire else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if wire else subprocess.STDOUT,
            text=True,
            env=env,
            # a shell without job control starts background jobs with SIGINT ignored, and a child inherits that
            # (then Python installs no KeyboardInterrupt handler): the command is tested as a terminal starts it
            preexec_fn=_default_sigint,
        )
        self.log: list[str] = []
        self.wire: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        if wire:
            assert self.proc.stderr is not None
            self._pump(self.proc.stdout, self.wire.put)
            self._pump(self.proc.stderr, self.log.append)
        else:
            self._pump(self.proc.stdout, self.log.append)

    @staticmethod
    def _pump(stream, put) -> None:
        threading.Thread(target=lambda: [put(line) for line in stream], daemon=True).start()

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def output(self) -> str:
        return "".join(self.log)

    def wait_for(self, ready, what: str) -> None:
        """Poll ``ready()`` until it holds; fail when the child exits first or after :data:`WAIT` seconds."""
        deadline = time.monotonic() + WAIT
        while not ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"no {what} (exit {self.proc.poll()}):\n{self.output()[-3000:]}")
            time.sleep(0.05)

    def stop(self, sig: int) -> int:
        """Send ``sig`` and wait for the exit status."""
        self.proc.send_signal(sig)
        return self.proc.wait(WAIT)

    def send(self, message: dict) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def reply(self, rid: int) -> dict:
        """The JSON-RPC answer to request ``rid`` (notifications before it skipped)."""
        deadline = time.monotonic() + WAIT
        while True:
            try:
                message = json.loads(self.wire.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                pytest.fail(f"no answer to request {rid} (exit {self.proc.poll()}):\n{self.output()[-3000:]}")
            if message.get("id") == rid:
                return message


def stop_paused(args: list[str], tmp_path: Path, sig: int) -> tuple[int, str]:
    """Run ``eventkv ARGS`` until it pauses before its second record, send ``sig``: ``(exit status, output)``."""
    mark = tmp_path / "paused"
    with Child(*args, pause=mark) as child:
        child.wait_for(mark.exists, "pause before the second record")
        return child.stop(sig), child.output()


def whole_lines(folder: Path) -> list[str]:
    """The lines of ``folder/records.jsonl``, checked whole: the file ends with a newline, each line is JSON."""
    text = (folder / RECORDS).read_text()
    assert text.endswith("\n"), text[-200:]
    lines = text.splitlines()
    assert all(isinstance(json.loads(line)["index"], int) for line in lines)
    return lines


def invocations(folder: Path) -> list[dict]:
    return json.loads((folder / RUN_MANIFEST).read_text())["invocations"]


def said_stopped(output: str, sig: int) -> bool:
    """The one line a batch command prints when a signal stops it."""
    line = "interrupted: every finished record is kept; run the same command again to resume. "
    line += f"(stopped by {signal.Signals(sig).name}: exit {dict(CODES)[sig]})"
    return line in output and "Traceback" not in output


# ============================================================================================= batch commands
FAST = ["--dtype", "float32", "--threads", "1", "--no-progress"]


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", CODES, ids=["SIGTERM", "SIGINT"])
def test_a_probe_run_stops_with_its_records_whole_and_resumes(sig, code, tiny_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = ["run", "donor-pair", "--model", str(tiny_dir), "--items", "3", "--max-new-tokens", "4", *FAST]
    args += ["--out", str(out)]
    status, output = stop_paused(args, tmp_path, sig)
    assert status == code and said_stopped(output, sig), output
    first = whole_lines(out)
    assert [json.loads(line)["index"] for line in first] == [0]
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0  # the same command resumes, and says so
    assert f"resuming {out}: 1 item already recorded, 2 to compute" in err
    lines = whole_lines(out)
    assert lines[0] == first[0] and sorted(json.loads(line)["index"] for line in lines) == [0, 1, 2]
    assert invocations(out)[-1]["items_computed"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", CODES, ids=["SIGTERM", "SIGINT"])
def test_memory_eval_stops_and_resumes_on_its_prefilled_memory(sig, code, tiny_dir, tmp_path, monkeypatch, capsys):
    from eventkv.studies.materialization.memory_eval import DEMO_DATA

    out = tmp_path / "run"
    args = ["memory", "eval", "--data", DEMO_DATA, "--model", str(tiny_dir), "--conversations", "2"]
    args += ["--questions-per-conversation", "2", "--max-tokens", "600", "--budgets", "20%,50%"]
    args += ["--max-new-tokens", "3", "--selectors", "bm25", *FAST, "--out", str(out)]
    status, output = stop_paused(args, tmp_path, sig)
    assert status == code and said_stopped(output, sig), output
    first = whole_lines(out)
    assert [json.loads(line)["index"] for line in first] == [0]
    segments = sorted((out / "memories" / "c0").rglob("*.safetensors"))
    stamps = [p.stat().st_mtime_ns for p in segments]
    assert segments
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0 and f"resuming {out}: 1 item already recorded, 3 to compute" in err
    lines = whole_lines(out)
    assert lines[0] == first[0] and sorted(json.loads(line)["index"] for line in lines) == [0, 1, 2, 3]
    assert invocations(out)[-1]["items_computed"] == 3
    # conversation 0's memory was reopened, not prefilled again
    assert sorted((out / "memories" / "c0").rglob("*.safetensors")) == segments
    assert [p.stat().st_mtime_ns for p in segments] == stamps


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", CODES, ids=["SIGTERM", "SIGINT"])
def test_a_sweep_stops_marks_its_folder_interrupted_and_resumes(sig, code, tiny_dir, tmp_path, monkeypatch, capsys):
    plan = tmp_path / "plan.yaml"
    data = {
        "out": f"{tmp_path}/runs/{{label}}/{{model}}-seed{{seed}}",
        "models": [str(tiny_dir)],
        "seeds": [0],
        "items": 3,
        "dtype": "float32",
        "threads": 1,
        "probes": [{"probe": "donor-pair", "options": {"max_new_tokens": 4}}],
    }
    plan.write_text(yaml.safe_dump(data))
    args = ["sweep", str(plan), "--no-progress"]
    status, output = stop_paused(args, tmp_path, sig)
    assert status == code and said_stopped(output, sig), output
    (folder,) = [p.parent for p in (tmp_path / "runs").rglob(RUN_MANIFEST)]
    first = whole_lines(folder)
    assert [json.loads(line)["index"] for line in first] == [0]
    (inv,) = invocations(folder)
    assert inv["interrupted"] is True and inv["items_computed"] == 1
    assert run_cli(monkeypatch, capsys, *args)[0] == 0
    lines = whole_lines(folder)
    assert lines[0] == first[0] and sorted(json.loads(line)["index"] for line in lines) == [0, 1, 2]
    assert [i["items_computed"] for i in invocations(folder)] == [1, 2]


def test_the_batch_helper_maps_each_stop_to_its_status_and_restores_the_handler(capsys):
    """In this process: SIGTERM itself, Ctrl-C's KeyboardInterrupt, and the ``SystemExit(15)`` that Ray's own
    SIGTERM handler raises (a sweep on the ray backend) each end in one line and ``typer.Exit``; any other
    SystemExit passes; the SIGTERM handler is the previous one again afterwards."""
    import typer

    from eventkv.cli.common import stops_resumably

    def ctrl_c():
        raise KeyboardInterrupt

    before = signal.getsignal(signal.SIGTERM)
    for stop, code, name in [
        (lambda: signal.raise_signal(signal.SIGTERM), 143, "SIGTERM"),
        (ctrl_c, 130, "SIGINT"),
        (lambda: sys.exit(signal.SIGTERM), 143, "SIGTERM"),
    ]:
        with pytest.raises(typer.Exit) as exc:
            with stops_resumably():
                stop()
        assert exc.value.exit_code == code
        assert capsys.readouterr().err.strip().endswith(f"(stopped by {name}: exit {code})")
        assert signal.getsignal(signal.SIGTERM) is before
    with pytest.raises(SystemExit) as other:
        with stops_resumably():
            sys.exit(3)
    assert other.value.code == 3


# ==================================================================================================== servers
QUESTION_TEXT = "Dana lives in Lisbon."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from service_fixtures import save_sharp_model

    return save_sharp_model(tmp_path_factory.mktemp("sharp"))


def kept_and_closed(model_dir: Path, memory: Path) -> list[str]:
    """The texts of the memory in ``memory``, after checking it was closed: closing the last connection
    checkpoints SQLite's write-ahead log into the database and removes it; a killed process leaves it."""
    from eventkv.memory import EventMemory
    from eventkv.models import load

    assert not (memory / "memory.sqlite-wal").exists(), sorted(p.name for p in memory.iterdir())
    with EventMemory.open(memory, load(str(model_dir), dtype="float32")) as mem:
        return [r.text for r in mem.list()]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_stops_cleanly_keeping_what_it_acknowledged(sig, model_dir, tmp_path):
    pytest.importorskip("fastapi")
    from service_fixtures import Server

    from eventkv.client import Client

    srv = Server(model_dir, tmp_path / "store")
    try:
        client = Client.create(srv.url, "notes")
        client.add(QUESTION_TEXT)
        client.close()
        srv.proc.send_signal(sig)
        status = srv.proc.wait(WAIT)
    finally:
        srv.kill()
    assert status == 0, srv.log()
    assert kept_and_closed(model_dir, tmp_path / "store" / "default" / "notes") == [QUESTION_TEXT]


@pytest.mark.slow
def test_serve_on_ray_stops_cleanly_and_removes_its_application(model_dir, tmp_path):
    pytest.importorskip("fastapi")
    pytest.importorskip("ray.serve")
    from service_fixtures import RayCluster, Server

    from eventkv.client import Client

    cluster = RayCluster()
    try:
        srv = Server(model_dir, tmp_path / "store", cluster=cluster)
        try:
            client = Client.create(srv.url, "notes")
            client.add(QUESTION_TEXT)
            client.close()
            status = srv.stop(WAIT)
            left = cluster.replicas()
        finally:
            srv.kill()
        assert status == 0, srv.log()
        assert left == {}  # the server deleted its application: every replica closed its memories
    finally:
        cluster.shutdown()
    assert kept_and_closed(model_dir, tmp_path / "store" / "default" / "notes") == [QUESTION_TEXT]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_mcp_over_stdio_stops_cleanly_keeping_what_it_acknowledged(sig, model_dir, tmp_path):
    """The client keeps stdin open (as a client that signals the server does): the server still exits 0."""
    pytest.importorskip("mcp")
    import mcp_types

    store = tmp_path / "store"
    args = ["mcp", "--model", str(model_dir), "--store", str(store), "--dtype", "float32", "--threads", "1"]
    with Child(*args, wire=True) as child:
        hello = {"protocolVersion": mcp_types.LATEST_PROTOCOL_VERSION, "capabilities": {}}
        hello["clientInfo"] = {"name": "test_signals", "version": "0"}
        child.send({"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": hello})
        assert child.reply(1)["result"]["serverInfo"]["name"] == "eventkv"
        child.send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        call = {"name": "add_memory", "arguments": {"text": QUESTION_TEXT, "id": "dana"}}
        child.send({"jsonrpc": "2.0", "id": 2, "method": "tools/call", "params": call})
        result = child.reply(2)["result"]
        assert not result.get("isError") and result["structuredContent"]["id"] == "dana", result
        status = child.stop(sig)
    assert status == 0, child.output()
    assert kept_and_closed(model_dir, store / "default" / "default") == [QUESTION_TEXT]


@pytest.mark.slow
def test_mcp_over_http_stops_cleanly_on_ctrl_c(model_dir, tmp_path):
    """SIGINT, as SIGTERM in tests/test_mcp.py: exit 0."""
    pytest.importorskip("mcp")
    args = ["mcp", "--model", str(model_dir), "--store", str(tmp_path / "s"), "--dtype", "float32"]
    args += ["--threads", "1", "--transport", "http", "--port", "0"]
    with Child(*args) as child:
        child.wait_for(lambda: "Uvicorn running on http://127.0.0.1:" in child.output(), "server start")
        status = child.stop(signal.SIGINT)
    assert status == 0, child.output()
    assert "Application shutdown complete" in child.output()
