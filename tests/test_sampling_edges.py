"""Sampling parameters at the edges of their range, in the library (:class:`eventkv.kv.decoding.Decoding`,
:func:`eventkv.kv.decoding.sampling_probs`, :func:`eventkv.memory.chat.chat_reply`) and on the chat route
(``POST /v1/chat/completions`` of a live server: tests/service_fixtures.LiveApp).

The rule under test: a temperature in [0, 1e-5) is greedy (the argmax: the tokens of temperature 0,
whatever the seed), one in [1e-5, 2] samples from a float64 softmax that is finite at every temperature;
``top_p`` is in (0, 1] and at most ``1 / vocab`` keeps the most probable token alone; ``seed`` is a
whole number in [-2**63, 2**64). Anything else is an OptionError in the library and a 400 in OpenAI's
error shape naming the field on the route, never a 500: checked by hypothesis over each field's whole
float range (subnormals, the largest floats, NaN and the infinities, which Python's ``json`` writes as
``NaN`` / ``Infinity``), ints of any size and booleans.

The greedy-equality tests use the tiny Llama with its output rows paired (row ``2k + 1`` a copy of row
``2k``): every logit ties with its neighbour's, so a temperature that samples draws either token of the
top pair, while the argmax (and so greedy decoding) takes the first: a draw that leaks below the
threshold shows as a different token. What the tests assert holds whatever the ties."""

from __future__ import annotations

import json
import math
import sys

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

import torch  # noqa: E402
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from service_fixtures import LiveApp  # noqa: E402

from eventkv.errors import OptionError  # noqa: E402
from eventkv.kv.decoding import MIN_SAMPLING_TEMPERATURE, SEED_END, SEED_MIN, Decoding, sampling_probs  # noqa: E402
from eventkv.memory.chat import chat_reply  # noqa: E402
from eventkv.service.app import Settings, create_app  # noqa: E402
from eventkv.testing import tiny_lm  # noqa: E402

MODEL = "tiny-llama"
QUESTION = [{"role": "user", "content": "Where does Dana live?"}]
EVENTS = [{"text": "Dana lives in Lisbon."}, {"text": "Ravi drinks tea in Oslo."}]
NEW_TOKENS = 4
FLOAT_MAX = sys.float_info.max
TINY = 5e-324  # the smallest positive float (subnormal)

# every float (subnormals, NaN, the infinities), ints of any size up to 4000 digits (what a JSON body
# can carry through Python's json), booleans
ANY_NUMBER = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.integers(),
    st.integers(min_value=-(10**4000), max_value=10**4000),
    st.booleans(),
)
# temperatures and top_p values around the rule's bounds, where the floats are dense
NEAR_BOUNDS = st.sampled_from(
    [0.0, -0.0, TINY, 1e-300, math.nextafter(1e-5, 0), 1e-5, math.nextafter(1e-5, 1), 1.0, 2.0, 1 / 320]
)
SEEDS = st.one_of(
    st.integers(min_value=SEED_MIN - 2, max_value=SEED_END + 2),
    st.sampled_from([SEED_MIN - 1, SEED_MIN, -1, 0, 2**63 - 1, 2**63, SEED_END - 1, SEED_END, 10**400]),
    ANY_NUMBER,
)


def temperature_ok(t) -> bool:
    """The rule for a temperature: an int or a finite float (not a bool) in [0, 2]."""
    number = not isinstance(t, bool) and (isinstance(t, int) or (isinstance(t, float) and math.isfinite(t)))
    return number and 0 <= t <= 2


def top_p_ok(p) -> bool:
    """The rule for top_p: an int or a finite float (not a bool) in (0, 1]."""
    number = not isinstance(p, bool) and (isinstance(p, int) or (isinstance(p, float) and math.isfinite(p)))
    return number and 0 < p <= 1


def seed_ok(s) -> bool:
    """The rule for a seed: None, or an int (not a bool) in [-2**63, 2**64)."""
    return s is None or (isinstance(s, int) and not isinstance(s, bool) and SEED_MIN <= s < SEED_END)


def paired_lm():
    """The tiny Llama whose output row ``2k + 1`` is a copy of row ``2k``: every logit ties with its
    neighbour's; the argmax takes the even token of the top pair."""
    lm = tiny_lm("llama")
    with torch.no_grad():
        weight = lm.model.lm_head.weight
        weight[1::2] = weight[0::2]
    return lm


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


@pytest.fixture(scope="module")
def paired():
    return paired_lm()


@pytest.fixture(scope="module")
def greedy(lm):
    return chat_reply(lm, QUESTION, max_new_tokens=NEW_TOKENS).generation.tokens


# ====================================================================== the library: Decoding
@settings(max_examples=300, deadline=None)
@given(t=st.one_of(ANY_NUMBER, NEAR_BOUNDS))
@example(t=TINY)
@example(t=1e-300)
@example(t=FLOAT_MAX)
@example(t=-FLOAT_MAX)
@example(t=-0.0)
@example(t=math.nextafter(2.0, 3.0))
@example(t=math.nan)
@example(t=math.inf)
@example(t=10**5000)
def test_a_temperature_is_checked_over_the_float_range(t):
    d = Decoding(temperature=t)
    if not temperature_ok(t):
        with pytest.raises(OptionError) as e:
            d.check()
        assert e.value.field == "temperature" and e.value.value is t and "[0, 2]" in str(e.value)
        return
    assert d.check() is d
    assert d.samples is (t >= 1e-5)  # below the threshold: greedy


@settings(max_examples=300, deadline=None)
@given(p=st.one_of(ANY_NUMBER, NEAR_BOUNDS))
@example(p=TINY)
@example(p=0.0)
@example(p=1.0)
@example(p=math.nextafter(1.0, 2.0))
@example(p=FLOAT_MAX)
@example(p=math.nan)
@example(p=-math.inf)
def test_a_top_p_is_checked_over_the_float_range(p):
    d = Decoding(temperature=1.0, top_p=p)
    if not top_p_ok(p):
        with pytest.raises(OptionError) as e:
            d.check()
        assert e.value.field == "top_p" and e.value.value is p and "(0, 1]" in str(e.value)
        return
    assert d.check() is d


@settings(max_examples=300, deadline=None)
@given(s=SEEDS)
@example(s=True)
@example(s=False)
@example(s=1.0)
@example(s=SEED_MIN - 1)
@example(s=SEED_END)
@example(s=10**5000)  # past what str() of an int takes: the message gives its size
@example(s=-(10**5000))
def test_a_seed_is_checked_over_its_range(s):
    d = Decoding(temperature=1.0, seed=s)
    if not seed_ok(s):
        with pytest.raises(OptionError) as e:
            d.check()
        assert e.value.field == "seed" and "[-2**63, 2**64)" in str(e.value)
        return
    assert d.check() is d


def test_the_seed_bounds_and_their_wrap(lm):
    """-1 and 2**64 - 1 are one seed (as torch.Generator.manual_seed maps them), so are -2**63 and 2**63."""

    def sampled(seed):
        return chat_reply(lm, QUESTION, max_new_tokens=6, decoding=Decoding(temperature=1.0, seed=seed)).generation

    assert sampled(-1).tokens == sampled(SEED_END - 1).tokens
    assert sampled(SEED_MIN).tokens == sampled(2**63).tokens
    assert sampled(0).tokens == sampled(0).tokens
    with pytest.raises(OptionError, match=r"seed 18446744073709551616: give a whole number in \[-2\*\*63, 2\*\*64\)"):
        sampled(SEED_END)
    with pytest.raises(OptionError, match=r"seed -9223372036854775809: "):
        sampled(SEED_MIN - 1)
    with pytest.raises(OptionError, match=r"seed \(an integer of 16610 bits\): "):
        sampled(10**5000)


# ====================================================================== the library: the distribution
LOGITS = st.lists(
    st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True), min_size=1, max_size=40
)


@settings(max_examples=400, deadline=None)
@given(logits=LOGITS, t=st.one_of(st.floats(min_value=1e-5, max_value=FLOAT_MAX), NEAR_BOUNDS))
@example(logits=[10.0, -10.0, 3.0], t=1e-5)
@example(logits=[3.4e38, -3.4e38, 0.0], t=1e-5)  # float32's extremes: a difference of 6.8e38 over 1e-5
@example(logits=[math.inf, 1.0, math.inf], t=1.0)
@example(logits=[-math.inf, -math.inf], t=1.0)
@example(logits=[math.nan, 2.0, math.nan], t=1.0)
@example(logits=[1.0, 2.0], t=FLOAT_MAX)
def test_sampling_probs_are_a_distribution_at_every_temperature(logits, t):
    if t < MIN_SAMPLING_TEMPERATURE:
        with pytest.raises(OptionError) as e:
            sampling_probs(torch.tensor(logits, dtype=torch.float32), t)
        assert e.value.field == "temperature"
        return
    x = torch.tensor(logits, dtype=torch.float32)
    probs = sampling_probs(x, t)
    assert probs.dtype == torch.float64 and probs.shape == x.shape
    assert bool(torch.isfinite(probs).all()) and bool((probs >= 0).all())
    assert abs(float(probs.sum()) - 1.0) <= 1e-9
    as_number = torch.where(torch.isnan(x), -math.inf, x).double()
    top = as_number.max()
    assert float(probs[as_number == top].min()) >= 1 / len(logits) - 1e-12  # the top tokens: at least 1 / vocab
    assert float(probs.max()) == float(probs[as_number == top].max())  # and the most probable
    if top == math.inf:  # tokens at +inf share everything
        assert float(probs[as_number != top].sum()) == 0.0
    torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(0))  # a valid distribution to draw from


# ====================================================================== the library: decoding
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    t=st.one_of(ANY_NUMBER, NEAR_BOUNDS),
    p=st.one_of(st.just(1.0), NEAR_BOUNDS, ANY_NUMBER),
    s=st.one_of(st.none(), SEEDS),
)
@example(t=TINY, p=1.0, s=1)
@example(t=1e-300, p=1.0, s=None)
@example(t=1.0, p=TINY, s=3)
@example(t=2.0, p=1 / 320, s=SEED_END - 1)
@example(t=FLOAT_MAX, p=1.0, s=0)
@example(t=math.nan, p=1.0, s=0)
@example(t=1.0, p=1.0, s=-2023110040)  # draws a stop token first: an empty answer
def test_decoding_over_the_float_range_answers_or_refuses(lm, greedy, t, p, s):
    """A decoding the rule accepts answers valid token ids, the greedy tokens below the threshold or
    with top_p <= 1 / vocab (the nucleus is then the most probable token alone); any other is refused."""
    d = Decoding(temperature=t, top_p=p, seed=s)
    if not (temperature_ok(t) and top_p_ok(p) and seed_ok(s)):
        with pytest.raises(OptionError) as e:
            chat_reply(lm, QUESTION, max_new_tokens=NEW_TOKENS, decoding=d)
        assert e.value.field in {"temperature", "top_p", "seed"}
        return
    gen = chat_reply(lm, QUESTION, max_new_tokens=NEW_TOKENS, decoding=d).generation
    tokens, vocab = gen.tokens, lm.model.config.vocab_size
    assert len(tokens) <= NEW_TOKENS and all(0 <= x < vocab for x in tokens)
    assert tokens or gen.finish_reason == "stop"  # empty only where the first token drawn is a stop token
    if t < 1e-5 or p <= 1 / vocab:
        assert tokens == greedy


@pytest.mark.parametrize("t", [TINY, 1e-300, 1e-100, math.nextafter(1e-5, 0), -0.0])
def test_a_temperature_below_the_threshold_is_greedy_where_logits_tie(paired, t):
    """With tied top logits a draw takes either token of the pair; below 1e-5 nothing is drawn: the
    tokens of temperature 0, for every seed."""
    greedy = chat_reply(paired, QUESTION, max_new_tokens=8).generation.tokens
    for seed in range(6):
        reply = chat_reply(paired, QUESTION, max_new_tokens=8, decoding=Decoding(temperature=t, seed=seed))
        assert reply.generation.tokens == greedy, seed


# ====================================================================== the chat route
@pytest.fixture(scope="module")
def live(paired, tmp_path_factory):
    """A live server on the paired model, with memory ``m`` (two events)."""
    app = create_app(Settings(paired, tmp_path_factory.mktemp("sampling-store")))
    with LiveApp(app) as srv:
        assert httpx.post(f"{srv.url}/v1/memories", json={"id": "m"}, timeout=60).status_code == 201
        assert httpx.post(f"{srv.url}/v1/memories/m/events", json={"events": EVENTS}, timeout=60).status_code == 201
        srv.vocab = paired.model.config.vocab_size
        yield srv


def post_chat(live, memory: bool = False, stream: bool = False, **fields):
    """``(status, answer)`` of a chat whose body is written by Python's json (NaN and the infinities as
    the literals ``NaN``, ``Infinity``); the answer of a stream is its events' data, parsed (``[DONE]``
    kept as the string)."""
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": NEW_TOKENS, "stream": stream, **fields}
    if memory:
        body["memory"] = {"id": "m", "select": "all"}
    url, headers = f"{live.url}/v1/chat/completions", {"content-type": "application/json"}
    if not stream:
        r = httpx.post(url, content=json.dumps(body), headers=headers, timeout=120)
        return r.status_code, r.json()
    with httpx.stream("POST", url, content=json.dumps(body), headers=headers, timeout=120) as r:
        if r.headers["content-type"].startswith("application/json"):
            return r.status_code, json.loads(r.read())
        datas = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        return r.status_code, [d if d == "[DONE]" else json.loads(d) for d in datas]


def tokens_of(answer, stream: bool) -> list[int]:
    """The reply's tokens (the ``eventkv`` report; a stream's is in its finish chunk)."""
    if not stream:
        return answer["eventkv"]["tokens"]
    assert answer[-1] == "[DONE]"
    return next(c["eventkv"] for c in answer[:-1] if c.get("eventkv"))["tokens"]


def openai_error(answer) -> dict:
    """The error of an answer in OpenAI's shape, checked."""
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    return error


@pytest.fixture(scope="module")
def route_greedy(live):
    """The greedy reply's tokens on the route (temperature 0), without and with the memory."""
    out = {}
    for memory in (False, True):
        status, answer = post_chat(live, memory, temperature=0)
        assert status == 200, answer
        out[memory] = tokens_of(answer, False)
    return out


@pytest.mark.parametrize("memory", [False, True], ids=["alone", "memory"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(
    "fields", [{"temperature": TINY, "seed": 1}, {"temperature": 1e-300}], ids=["5e-324", "1e-300"]
)
def test_subnormal_and_tiny_temperatures_answer_the_greedy_reply(live, route_greedy, memory, stream, fields):
    status, answer = post_chat(live, memory, stream, **fields)
    assert status == 200, answer
    assert tokens_of(answer, stream) == route_greedy[memory]


#: a sampling field out of its range: (the field, the 400's param, what its message says)
OUT_OF_RANGE = [
    ({"temperature": math.nan}, "temperature", "temperature nan: input should be a finite number"),
    ({"temperature": math.inf}, "temperature", "temperature inf: input should be a finite number"),
    ({"temperature": FLOAT_MAX}, "temperature", "input should be less than or equal to 2"),
    ({"temperature": True}, "temperature", "temperature True: input should be a valid number"),
    ({"top_p": 0}, "top_p", "top_p 0: input should be greater than 0"),
    ({"top_p": -0.0}, "top_p", "top_p -0.0: input should be greater than 0"),
    ({"top_p": math.nan}, "top_p", "top_p nan: input should be a finite number"),
    ({"top_p": -math.inf}, "top_p", "top_p -inf: input should be a finite number"),
    ({"top_p": math.nextafter(1.0, 2.0)}, "top_p", "input should be less than or equal to 1"),
    ({"seed": SEED_END}, "seed", "seed 18446744073709551616: input should be less than 18446744073709551616"),
    ({"seed": SEED_MIN - 1}, "seed", "input should be greater than or equal to -9223372036854775808"),
    ({"seed": 10**400}, "seed", "input should be less than 18446744073709551616"),
    ({"seed": True}, "seed", "seed True: input should be a valid integer"),
    ({"seed": 3.0}, "seed", "seed 3.0: input should be a valid integer"),
    ({"seed": math.nan}, "seed", "seed nan: input should be a valid integer"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("fields, param, says", OUT_OF_RANGE, ids=[str(f)[:40] for f, _, _ in OUT_OF_RANGE])
def test_out_of_range_sampling_fields_are_400_naming_the_field(live, stream, fields, param, says):
    status, answer = post_chat(live, stream=stream, **{"temperature": 1.0, "seed": 0, **fields})
    assert status == 400, answer
    error = openai_error(answer)
    assert (error["param"], error["code"]) == (param, "invalid_request") and says in error["message"]


@pytest.mark.parametrize(
    "fields",
    [
        {"top_p": 1},
        {"top_p": TINY},
        {"seed": -1},
        {"seed": SEED_MIN},
        {"seed": 2**63},
        {"seed": SEED_END - 1},
        {"temperature": 2},
        {"temperature": 1e-5},
    ],
    ids=str,
)
def test_sampling_fields_at_their_bounds_are_answered(live, fields):
    status, answer = post_chat(live, **{"temperature": 1.0, "seed": 0, **fields})
    assert status == 200, answer
    assert answer["choices"][0]["finish_reason"] in ("stop", "length") and len(tokens_of(answer, False)) >= 1


@settings(max_examples=35, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    t=st.one_of(st.none(), NEAR_BOUNDS, ANY_NUMBER),
    p=st.one_of(st.none(), NEAR_BOUNDS, ANY_NUMBER),
    s=st.one_of(st.none(), SEEDS),
    memory=st.booleans(),
)
@example(t=TINY, p=None, s=1, memory=False)
@example(t=1e-300, p=None, s=None, memory=True)
@example(t=FLOAT_MAX, p=None, s=None, memory=False)
@example(t=-0.0, p=math.nan, s=None, memory=False)
@example(t=1.0, p=math.inf, s=2**64, memory=False)
def test_the_chat_route_over_the_float_range_is_200_or_400(live, route_greedy, t, p, s, memory):
    """Never a 5xx: 200 when the library's rule accepts every field (the greedy tokens below 1e-5),
    else 400 in OpenAI's shape naming a field the rule refuses."""
    fields = {k: v for k, v in (("temperature", t), ("top_p", p), ("seed", s)) if v is not None}
    status, answer = post_chat(live, memory, **fields)
    refused = {
        name
        for name, value, ok in (("temperature", t, temperature_ok), ("top_p", p, top_p_ok), ("seed", s, seed_ok))
        if value is not None and not ok(value)
    }
    if refused:
        assert status == 400, answer
        error = openai_error(answer)
        assert error["param"] in refused and error["code"] == "invalid_request"
        return
    assert status == 200, answer
    tokens = tokens_of(answer, False)
    assert 1 <= len(tokens) <= NEW_TOKENS and all(0 <= x < live.vocab for x in tokens)
    if t is None or t < 1e-5:
        assert tokens == route_greedy[memory]


def test_the_query_route_takes_no_decoding_options(live):
    """``POST /v1/memories/{id}/query`` decodes greedily and has no sampling field: one sent is refused
    as unknown (422), never ignored."""
    for field, value in (("temperature", 5e-324), ("top_p", math.nan), ("seed", 2**64)):
        r = httpx.post(
            f"{live.url}/v1/memories/m/query",
            content=json.dumps({"question": "Where does Dana live?", field: value}),
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 422 and r.json()["code"] == "invalid_request", r.text
        assert r.json()["message"].startswith(f"{field} ") and "extra inputs are not permitted" in r.json()["message"]
