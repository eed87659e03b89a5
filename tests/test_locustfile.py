"""benchmarks/locustfile.py runs against a live server: locust (headless, 2 users for 5 s) in a
subprocess against an in-process server on 127.0.0.1 and a free port (tiny model). Each user
creates its memory and deletes it when the run ends; no request fails; locust's table names routes
by template only. Skipped where locust (the ``load`` extra) is not installed."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from service_fixtures import LiveApp  # noqa: E402

from eventkv.service.app import Settings, create_app  # noqa: E402
from eventkv.testing import tiny_lm  # noqa: E402

LOCUSTFILE = Path(__file__).resolve().parents[1] / "benchmarks" / "locustfile.py"
ROUTES = {
    "/v1/memories",
    "/v1/memories/[mid]",
    "/v1/memories/[mid]/events",
    "/v1/memories/[mid]/query",
    "/v1/memories/[mid]/events/[eid]/update",
    "Aggregated",
}


@pytest.mark.skipif(importlib.util.find_spec("locust") is None, reason="locust is not installed (the load extra)")
def test_locustfile_runs_headless_against_a_live_server(tmp_path):
    # locust patches the standard library with gevent when imported, so it runs (and is imported) in a
    # subprocess of its own, never in the test process
    imported = subprocess.run(
        [sys.executable, "-c", f"import runpy; runpy.run_path({str(LOCUSTFILE)!r})"], capture_output=True, timeout=300
    )
    assert imported.returncode == 0, imported.stderr[-3000:]
    app = create_app(Settings(tiny_lm("llama"), tmp_path / "store"))
    with LiveApp(app) as live:
        env = {**os.environ, "EVENTKV_EVENTS": "3", "EVENTKV_K": "2", "EVENTKV_NEW_TOKENS": "2"}
        cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--host", live.url]
        cmd += ["--headless", "-u", "2", "-r", "2", "-t", "5s", "--stop-timeout", "300"]  # each user ends its work
        cmd += ["--only-summary", "--csv", str(tmp_path / "run")]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
        with open(tmp_path / "run_stats.csv", newline="") as f:
            rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
        assert {name for _, name in rows} <= ROUTES, rows.keys()
        assert rows[("POST", "/v1/memories")]["Request Count"] == "2"  # one memory per user
        assert all(r["Failure Count"] == "0" for r in rows.values()), rows
        # each user deleted its memory when the run ended (locust's CSV is written before those requests)
        assert httpx.get(f"{live.url}/v1/memories").json() == []
