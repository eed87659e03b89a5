"""The interactive API pages (``/docs``: Swagger UI, ``/redoc``) work offline: their scripts and styles
come from the server (fastapi-offline's packaged files), never from a CDN; they, their assets and
the OpenAPI document need no bearer token while every data route does; and Swagger UI renders the
operations in a real headless Chromium that can resolve no host but the server's, and every request
of the page in Chromium's network log is the server's. The browser test is skipped where no Chromium
is installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi_offline")

from service_fixtures import CHROMIUM_OFFLINE, LiveApp  # noqa: E402

from eventkv.service.app import Settings, create_app  # noqa: E402
from eventkv.service.middleware import DOCS_ASSETS  # noqa: E402
from eventkv.testing import tiny_lm  # noqa: E402

TOKEN = "t" * 32


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A live server with a token file's token: the public pages must work without it."""
    app = create_app(Settings(tiny_lm("llama"), tmp_path_factory.mktemp("store"), tokens={TOKEN: None}))
    with LiveApp(app) as live:
        yield live


def test_the_pages_load_their_assets_from_the_server_without_a_token(live):
    with httpx.Client(base_url=live.url, timeout=60) as http:
        for page in ("/docs", "/redoc"):
            r = http.get(page)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            urls = re.findall(r'(?:src|href)="([^"]+)"', r.text)
            assert urls and all(u.startswith(DOCS_ASSETS + "/") for u in urls), urls  # nothing from elsewhere
            assert "https://" not in r.text and "http://" not in r.text
            for u in urls:
                asset = http.get(u)
                assert asset.status_code == 200 and len(asset.content) > 1000, u
        assert http.get(f"{DOCS_ASSETS}/swagger-ui-bundle.js").headers["content-type"].startswith("text/javascript")
        doc = http.get("/openapi.json")
        assert doc.status_code == 200 and doc.json()["openapi"].startswith("3.1")
        assert "/v1/memories/{mid}/query" in doc.json()["paths"]
        # the data routes still need the token
        for path in ("/v1/memories", "/metrics"):
            assert http.get(path).status_code == 401
            assert http.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
        # an asset path does not open anything else: '..' is not resolved past the assets
        r = http.get(f"{DOCS_ASSETS}/../../v1/memories")
        assert r.status_code in (401, 404)


def test_swagger_ui_renders_the_operations_offline_in_a_headless_browser(live, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no Chromium installed (Debian: apt-get install chromium)")
    netlog = tmp_path / "netlog.json"
    cmd = [
        browser,
        "--headless",
        # offline: no host but the server's resolves, so the page renders only if it needs nothing else
        *CHROMIUM_OFFLINE,
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--log-net-log={netlog}",
        "--virtual-time-budget=30000",  # virtual ms for the scripts to fetch /openapi.json and render
        "--dump-dom",
        f"{live.url}/docs",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    dom = out.stdout.replace("\u200b", "").replace("&ZeroWidthSpace;", "").replace("&#8203;", "")
    for path in ("/v1/memories", "/v1/memories/{mid}/query", "/v1/memories/{mid}/events"):
        assert f'data-path="{path}"' in dom, path  # an operation block per path, from the rendered document
    assert "eventkv memory service" in dom
    # the page's requests, from Chromium's network log: the navigation and every request the page
    # initiated (Chromium's own background requests, network time or account checks, are initiated by
    # no origin and are not the page's; the resolver rule above keeps them from leaving too)
    log = json.loads(netlog.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    jobs = [e["params"] for e in log["events"] if e["type"] == start and "url" in e.get("params", {})]
    page = [j["url"] for j in jobs if j.get("initiator") == live.url or j.get("request_type") == "main frame"]
    assert f"{live.url}/docs" in page and f"{live.url}/openapi.json" in page
    assert f"{live.url}{DOCS_ASSETS}/swagger-ui-bundle.js" in page and f"{live.url}{DOCS_ASSETS}/swagger-ui.css" in page
    outside = [u for u in page if not u.startswith(f"{live.url}/")]
    assert not outside, outside  # no request of the page left 127.0.0.1
