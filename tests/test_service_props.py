"""Property-based tests (hypothesis) of the service's names and request models:
arbitrary strings as memory ids / namespaces, arbitrary bodies, and arbitrary ids sent to a live
server — never a path outside the store, never a 500."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from eventkv.errors import OptionError  # noqa: E402
from eventkv.service import schemas as s  # noqa: E402
from eventkv.wire import MAX_NAME, check_name  # noqa: E402

ALLOWED = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
names = st.one_of(
    st.text(max_size=80),
    st.text(alphabet="ab_-./\\\x00 \n9", max_size=70),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_-]{0,70}", fullmatch=True),
)


def is_valid(x: str) -> bool:
    return 1 <= len(x) <= MAX_NAME and set(x) <= ALLOWED and x[0] not in "_-"


@given(names)
def test_check_name_accepts_exactly_the_rule(x):
    if is_valid(x):
        assert check_name(x) == x
        root = Path("/srv/store/ns").resolve()
        assert (root / x).resolve().parent == root  # a valid name never leaves its directory
    else:
        with pytest.raises(OptionError, match="memory id"):
            check_name(x)


@given(names)
def test_request_models_use_the_same_rule(x):
    try:
        s.CreateMemory(id=x)
        accepted = True
    except ValidationError:
        accepted = False
    assert accepted == is_valid(x)


#: Unicode White_Space, what the schemas' ``\S`` (pydantic's Rust regex) treats as blank
WHITE_SPACE = set("\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000") | {chr(c) for c in range(0x2000, 0x200B)}


@given(st.text(max_size=60), st.integers(-5, 20_000), st.integers(-3, 5000))
def test_query_and_event_bounds(text, k, max_new):
    ok = 1 <= len(text) <= s.MAX_TEXT and any(c not in WHITE_SPACE for c in text)  # non-blank texts only
    try:
        s.EventIn(text=text)
        assert ok
    except ValidationError:
        assert not ok
    try:
        s.QueryIn(question=text, k=k, max_new_tokens=max_new)
        assert ok and 1 <= k <= 10_000 and 1 <= max_new <= 4096
    except ValidationError:
        assert not (ok and 1 <= k <= 10_000 and 1 <= max_new <= 4096)


@given(st.dictionaries(st.text(max_size=8), st.integers(), max_size=3))
def test_unknown_keys_are_refused(extra):
    body = {"events": [{"text": "x", **extra}]}
    known = {"text", "role", "id", "tags", "budget", "kind"}
    try:
        s.AddEvents.model_validate(body)
        assert set(extra) <= known
    except ValidationError:
        pass


@pytest.fixture(scope="module")
def live(tmp_path_factory, cluster):
    """A live server, on each backend (tests/conftest.cluster)."""
    from service_fixtures import Server, save_sharp_model

    store = tmp_path_factory.mktemp("store")
    srv = Server(save_sharp_model(tmp_path_factory.mktemp("m")), store, cluster=cluster)
    yield srv, store
    srv.kill()


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names, st.sampled_from(["GET", "POST", "DELETE"]))
def test_arbitrary_ids_over_http_never_500_and_never_escape(live, x, method):
    srv, store = live
    before = {p for p in store.parent.iterdir()}
    seg = quote(x, safe="").replace(".", "%2E")  # encoded as the Client does: no dot segment to fold away
    r = httpx.request(method, f"{srv.url}/v1/memories/{seg}/events", json={"events": [{"text": "hi"}]})
    assert r.status_code in (404, 405, 422), (x, r.status_code, r.text)
    assert set(r.json()) == {"code", "message"}
    assert {p for p in store.parent.iterdir()} == before  # nothing created beside the store
    if not is_valid(x):
        assert r.status_code == 422  # a bad id is named as such, whatever the method
