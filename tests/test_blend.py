"""Selective recompute (``serve(..., mode="blend")``, :mod:`eventkv.blend`; CacheBlend, arXiv 2405.16444).

The gate: recomputing every served token equals a fresh prefill of header + served events at their
original positions (K/V rows and a following query's logits, <= 1e-4 in float32) on every tiny
architecture (Gemma 3's sliding layers included: the history is longer than its 16-token window);
``recompute=0`` is ``compact`` exactly. The token choice is checked against a deviation computed by
hand from a separate full forward, and a partial recompute against prefix forwards (the mask keeps
causality by position: later cached rows are invisible to a recomputed token)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from eventkv import blend as blend_module
from eventkv.blend import DEFAULT_RECOMPUTE, blend, check_recompute, choose, kv_deviation, n_recomputed
from eventkv.errors import EventKVError, OptionError
from eventkv.log import Event, EventLog, tokenize
from eventkv.prefill import cache_from_rows, cache_kv, model_forward, prefill
from eventkv.serve import serve
from eventkv.testing import TINY_FAMILIES, tiny_lm

EVENTS = [
    Event("a", "register A set to ON now"),
    Event("b", "register B mirrors A always"),
    Event("c", "the lamp is red and blue"),
    Event("d", "alarm rings at noon daily"),
]
SERVED = ["b", "d"]
TOL = 1e-4


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def setup(request):
    lm = tiny_lm(request.param)
    ekv = prefill(lm.model, tokenize(EventLog(EVENTS), lm.tokenizer, lm.profile))
    return lm, ekv


@torch.inference_mode()
def _fresh(lm, ekv, ids):
    """A fresh prefill of header + the served events at their original positions: (keys, values)."""
    rows = ekv.rows_of(ids)
    toks = torch.tensor([[ekv.log.input_ids[r] for r in rows.tolist()]])
    cache = DynamicCache()
    model_forward(lm.model, toks, ekv.positions[rows].unsqueeze(0), cache)
    return cache_kv(cache)


@torch.inference_mode()
def _query_logits(lm, ekv, keys, values):
    q = [5, 17, 42, 9]
    pos = torch.arange(ekv.log.history_end, ekv.log.history_end + len(q)).unsqueeze(0)
    return model_forward(lm.model, torch.tensor([q]), pos, cache_from_rows(keys, values))


def _gap(a, b):
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def test_full_recompute_equals_a_fresh_prefill_of_the_served_set(setup):
    lm, ekv = setup
    assert ekv.n_rows > 16  # past Gemma 3's window: its sliding layers are exercised
    served = serve(ekv, SERVED, "blend", lm.model, recompute=1.0)
    keys, values = _fresh(lm, ekv, SERVED)
    assert served.n_rows == keys[0].shape[2]
    assert torch.equal(served.positions, ekv.positions[ekv.rows_of(SERVED)])
    assert _gap(served.keys, keys) <= TOL and _gap(served.values, values) <= TOL
    got = _query_logits(lm, ekv, served.keys, served.values)
    want = _query_logits(lm, ekv, keys, values)
    assert float((got - want).abs().max()) <= TOL
    # and it differs from the stored rows (they saw events a and c): the recompute did something
    compact = serve(ekv, SERVED, "compact")
    assert _gap(compact.keys, keys) > 1e-3


def test_zero_recompute_is_compact_serving_exactly(setup, monkeypatch):
    lm, ekv = setup
    monkeypatch.setattr(blend_module, "model_forward", None)  # no forward may run
    served = serve(ekv, SERVED, "blend", lm.model, recompute=0)
    compact = serve(ekv, SERVED, "compact")
    assert served.mode == "blend" and served.next_position == compact.next_position
    assert all(torch.equal(a, b) for a, b in zip(served.keys, compact.keys))
    assert all(torch.equal(a, b) for a, b in zip(served.values, compact.values))
    assert torch.equal(served.positions, compact.positions)


def test_deviation_and_choice_match_a_hand_computation(setup):
    lm, ekv = setup
    h = ekv.log.span("<header>").n_tokens
    keys, values = _fresh(lm, ekv, SERVED)  # a separate full forward: every token fresh
    tok_rows = ekv.rows_of(SERVED, include_header=False)
    layer = 1
    dk = keys[layer][0, :, h:] - ekv.keys[layer][0][:, tok_rows]
    dv = values[layer][0, :, h:] - ekv.values[layer][0][:, tok_rows]
    by_hand = [float((dk[:, i].square().sum() + dv[:, i].square().sum()).sqrt()) for i in range(tok_rows.shape[0])]
    got = kv_deviation(lm.model, ekv, SERVED, select_layer=layer)
    assert got.shape == (len(by_hand),)
    assert torch.allclose(got, torch.tensor(by_hand), atol=TOL, rtol=0)
    # layer 0's K/V depend only on the token and its position: no deviation there
    assert float(kv_deviation(lm.model, ekv, SERVED, select_layer=0).max()) < 1e-5
    want = sorted(sorted(range(len(by_hand)), key=lambda i: (-got[i].item(), i))[: n_recomputed(0.3, len(by_hand))])
    b = blend(lm.model, ekv, SERVED, 0.3)
    assert b.chosen.tolist() == want and b.deviation is not None and torch.equal(b.deviation, got)


def test_choice_counts_and_ties():
    assert n_recomputed(0.15, 100) == 15 and n_recomputed(0.15, 101) == 16  # ceil, no float noise
    assert n_recomputed(0.0, 7) == 0 and n_recomputed(1.0, 7) == 7 and n_recomputed(0.01, 7) == 1
    dev = torch.tensor([1.0, 3.0, 3.0, 0.5, 3.0])
    assert choose(dev, 0.4).tolist() == [1, 2]  # 2 of 5: the ties at 3.0 go to the earlier rows


@pytest.mark.parametrize("block", ["suffix", "middle"])
def test_partial_recompute_keeps_causality_by_position(setup, monkeypatch, block):
    """A recomputed block sees the stored rows before it and never the stored rows after it: it equals a
    forward of the block over a cache of the served rows before it (where no later row exists)."""
    lm, ekv = setup
    h = ekv.log.span("<header>").n_tokens
    compact = serve(ekv, SERVED, "compact")
    n = compact.n_rows - h
    a, b = (n - 9, n) if block == "suffix" else (10, 19)
    monkeypatch.setattr(blend_module, "choose", lambda dev, r: torch.arange(a, b))
    got = blend(lm.model, ekv, SERVED, 0.5)
    assert got.chosen.tolist() == list(range(a, b))
    rows = ekv.rows_of(SERVED)
    cache = cache_from_rows([k[:, :, : h + a] for k in compact.keys], [v[:, :, : h + a] for v in compact.values])
    toks = torch.tensor([[ekv.log.input_ids[r] for r in rows[h + a : h + b].tolist()]])
    with torch.inference_mode():
        model_forward(lm.model, toks, ekv.positions[rows[h + a : h + b]].unsqueeze(0), cache)
    ref_k, ref_v = cache_kv(cache)
    assert _gap([k[:, :, h + a : h + b] for k in got.keys], [k[:, :, h + a :] for k in ref_k]) <= TOL
    assert _gap([v[:, :, h + a : h + b] for v in got.values], [v[:, :, h + a :] for v in ref_v]) <= TOL
    outside = torch.ones(h + n, dtype=torch.bool)
    outside[h + a : h + b] = False
    assert all(torch.equal(x[:, :, outside], y[:, :, outside]) for x, y in zip(got.keys, compact.keys))


def test_blend_sits_between_rows_and_a_fresh_prefill(setup):
    lm, ekv = setup
    keys, values = _fresh(lm, ekv, SERVED)
    gaps = [_gap(serve(ekv, SERVED, "blend", lm.model, recompute=r).keys, keys) for r in (0.0, DEFAULT_RECOMPUTE, 1.0)]
    assert gaps[0] >= gaps[1] >= gaps[2]


@pytest.mark.parametrize("bad", [-0.1, 1.5, "0.2", True, float("nan")])
def test_a_bad_fraction_is_an_option_error(bad):
    with pytest.raises(OptionError, match="recompute"):
        check_recompute(bad)


def test_recompute_belongs_to_blend_only(setup):
    lm, ekv = setup
    assert check_recompute(None) == DEFAULT_RECOMPUTE and check_recompute(None, "compact") is None
    with pytest.raises(OptionError, match="mode 'blend' only"):
        serve(ekv, SERVED, "compact", lm.model, recompute=0.2)
    with pytest.raises(OptionError, match="in \\[0, 1\\]"):
        serve(ekv, SERVED, "blend", lm.model, recompute=2)


# ====================================================================== through the memory
MEMORY_EVENTS = [
    "Dana lives in Lisbon and works on the grant proposal.",
    "Ravi will handle the quarterly report from Oslo.",
    "The team offsite is on Tuesday at 10:30.",
    "Mei moved the server migration to Friday.",
]


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    from eventkv.memory import EventMemory

    mem = EventMemory.create(tmp_path_factory.mktemp("blend") / "m", tiny_lm("llama"), namespace="t")
    mem.add(MEMORY_EVENTS)
    yield mem
    mem.close()


def test_a_memory_serves_blend_with_its_fraction(memory, monkeypatch):
    ids = ["e1", "e3"]
    seen = []
    real = blend_module.blend
    monkeypatch.setattr("eventkv.serve.blend", lambda *a, **kw: seen.append(a[3]) or real(*a, **kw))
    zero, compact = memory.query_batch(
        "Where?", [(ids, "blend"), (ids, "compact")], max_new_tokens=4, keep_logits=True, recompute=0.0
    )
    assert zero.generation.tokens == compact.generation.tokens
    assert all(torch.equal(a, b) for a, b in zip(zero.generation.logits, compact.generation.logits))
    assert zero.n_rows_served == compact.n_rows_served and zero.served_ids == ids
    memory.query("Where?", ids, mode="blend", max_new_tokens=2)
    memory.query("Where?", ids, mode="blend", max_new_tokens=2, recompute=1)
    assert seen == [0.0, DEFAULT_RECOMPUTE, 1.0]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(mode="blend", recompute=1.5), "in \\[0, 1\\]"),
        (dict(mode="blend", recompute=-0.5), "in \\[0, 1\\]"),
        (dict(mode="compact", recompute=0.2), "mode 'blend' only"),
        (dict(mode="text", recompute=0.0), "mode 'blend' only"),
    ],
)
def test_a_memory_refuses_a_bad_fraction(memory, kw, match):
    with pytest.raises(OptionError, match=match):
        memory.query("Where?", "view", max_new_tokens=2, **kw)


def test_the_http_body_carries_the_fraction():
    pytest.importorskip("pydantic")
    from pydantic import ValidationError

    from eventkv.service.schemas import QueryIn

    assert QueryIn(question="q", mode="blend", recompute=0.25).recompute == 0.25
    assert QueryIn(question="q").recompute is None
    with pytest.raises(ValidationError):
        QueryIn(question="q", mode="blend", recompute=1.5)


def test_an_attention_without_4d_masks_is_refused(setup, monkeypatch):
    lm, ekv = setup
    text = lm.model.config.get_text_config(decoder=True)
    monkeypatch.setattr(text, "_attn_implementation", "flash_attention_2")
    with pytest.raises(EventKVError, match="attn_implementation='sdpa'"):
        serve(ekv, SERVED, "blend", lm.model, recompute=0.5)
