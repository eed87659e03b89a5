"""Faithfulness gates of the data path (Study 1, "Setting", faithfulness gate), on tiny random
models in float32. ``pytest -k gate`` selects them all.

Tolerance: max |Δlogit| <= 1e-4 and the same argmax (measured: ~3e-7 on all four families); the
argmax is compared where the reference's top two logits are more than 2e-4 apart, which is asserted
(``eventkv.testing.assert_same_greedy``), so no comparison rests on a near-tie.
"""

import random

import pytest
import torch

from eventkv.kv.log import TokenizedLog
from eventkv.kv.prefill import prefill
from eventkv.kv.readout import candidate_logprobs, generate, query_logits
from eventkv.kv.rows import EventKV
from eventkv.kv.serve import serve
from eventkv.testing import TINY_FAMILIES, assert_same_greedy, tiny_model

TOL = 1e-4
QUERY = [5, 6, 7, 8]


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def family_model(request):
    return request.param, tiny_model(request.param)


def make_log(n_events=10, seed=0, budgets=True, vocab=256):
    rng = random.Random(seed)
    events = []
    for i in range(n_events):
        toks = [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 8))]
        events.append((f"e{i}", toks, (len(toks) + 3) if (budgets and i % 3 == 0) else None))
    return TokenizedLog.from_ids([1, 2, 3, 4], events)


def fresh_logits(model, ids, positions):
    """Reference: one forward over the whole token sequence, no cache. Returns [len, vocab]."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([positions])).logits[0].float()


def max_diff(a, b):
    return float((a - b).abs().max())


@pytest.mark.parametrize("mode", ["compact", "native"])
def test_gate_all_events_equals_fresh_prefill(family_model, mode):
    _, model = family_model
    log = make_log()
    assert log.n_rows > 16, "history must exceed the Gemma 3 test window"
    ekv = prefill(model, log)
    gen = generate(model, serve(ekv, "all", mode), QUERY, max_new_tokens=8, keep_logits=True)
    assert len(gen.tokens) == 8
    ids = log.input_ids + QUERY + gen.tokens
    pos = log.position_ids + list(range(log.history_end, log.history_end + len(QUERY) + 8))
    ref = fresh_logits(model, ids, pos)[log.n_rows + len(QUERY) - 1 :]
    assert_same_greedy(gen.tokens, gen.logits, [int(r.argmax()) for r in ref[:8]], list(ref[:8]), TOL)


def test_gate_chunked_prefill_equals_one_pass(family_model):
    fam, model = family_model
    log = make_log()
    whole, chunked = prefill(model, log), prefill(model, log, chunk_size=7)
    for a, b in zip(whole.keys + whole.values, chunked.keys + chunked.values):
        assert max_diff(a, b) <= 1e-5


def test_gate_prefix_prefill_equals_one_pass(family_model):
    fam, model = family_model
    log = make_log()
    head = TokenizedLog.from_ids(log.header_ids, [(log.event_ids[0], log.event_tokens[0], log.budgets[0])])
    whole, resumed = prefill(model, log), prefill(model, log, prefix=prefill(model, head))
    for a, b in zip(whole.keys + whole.values, resumed.keys + resumed.values):
        assert max_diff(a, b) <= 1e-5


SUBSET = ["e1", "e4", "e8"]


def test_gate_subset_compact_equals_native_masked(family_model):
    """A subset served compactly equals the full cache with the dropped rows masked — exactly
    for full-attention models; for Gemma 3 only while the whole history fits the window."""
    fam, model = family_model
    log = make_log()
    if fam == "gemma3":  # same weights, a window that covers history + query + 8 new tokens
        model = tiny_model("gemma3", sliding_window=128)
        assert log.n_rows + len(QUERY) + 8 <= 128
    ekv = prefill(model, log)
    gc = generate(model, serve(ekv, SUBSET, "compact"), QUERY, max_new_tokens=8, keep_logits=True)
    gn = generate(model, serve(ekv, SUBSET, "native"), QUERY, max_new_tokens=8, keep_logits=True)
    assert_same_greedy(gc.tokens, gc.logits, gn.tokens, gn.logits, TOL)


def test_gate_gemma3_compact_and_native_differ_beyond_window():
    """Stated difference: with history longer than the sliding window, native hides served rows
    older than the window from the sliding layers while compact counts the window in served rows,
    so their logits differ; the full-attention-only families agree (test above)."""
    model = tiny_model("gemma3")
    ekv = prefill(model, make_log())
    lc = query_logits(model, serve(ekv, SUBSET, "compact"), QUERY)
    ln = query_logits(model, serve(ekv, SUBSET, "native"), QUERY)
    assert max_diff(lc, ln) > 1e-3


def test_gate_subset_native_equals_masked_fresh_forward(family_model):
    """Native serving equals one uncached forward over history + query in which the query's
    attention to the dropped rows is masked out (an independent 4D-mask reference)."""
    fam, model = family_model
    log = make_log()
    ekv = prefill(model, log)
    got = query_logits(model, serve(ekv, SUBSET, "native"), QUERY)
    keep = torch.zeros(log.n_rows, dtype=torch.bool)
    keep[ekv.rows_of(SUBSET)] = True
    n = log.n_rows + len(QUERY)
    ids = log.input_ids + QUERY
    pos = log.position_ids + list(range(log.history_end, log.history_end + len(QUERY)))
    window = getattr(model.config, "sliding_window", None)
    masks = {}
    for kind in ("full_attention", "sliding_attention"):
        allowed = torch.ones(n, n, dtype=torch.bool).tril()
        if kind == "sliding_attention" and window:
            allowed &= ~torch.ones(n, n, dtype=torch.bool).tril(-window)
        allowed[log.n_rows :, : log.n_rows] &= keep
        masks[kind] = allowed[None, None]
    mask = masks if fam == "gemma3" else masks["full_attention"]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), attention_mask=mask).logits[0, -1]
    assert max_diff(got, ref.float()) <= TOL


def test_gate_isolated_first_event_equals_compact(family_model):
    """The first event only ever saw the header, so its isolated encoding equals its global rows."""
    fam, model = family_model
    ekv = prefill(model, make_log())
    a = query_logits(model, serve(ekv, ["e0"], "compact"), QUERY)
    b = query_logits(model, serve(ekv, ["e0"], "isolated", model=model), QUERY)
    assert max_diff(a, b) <= TOL
    c = query_logits(model, serve(ekv, ["e0", "e5"], "compact"), QUERY)
    d = query_logits(model, serve(ekv, ["e0", "e5"], "isolated", model=model), QUERY)
    assert max_diff(c, d) > 1e-4  # e5's isolated rows never saw e1..e4


def test_gate_text_all_equals_kv_all_without_budgets(family_model):
    """Without position budgets, re-prefilling every event as text is the same computation as
    serving all events' rows (Study 1: kv-all must match text-all)."""
    fam, model = family_model
    ekv = prefill(model, make_log(budgets=False))
    a = query_logits(model, serve(ekv, "all", "compact"), QUERY)
    b = query_logits(model, serve(ekv, "all", "text", model=model), QUERY)
    assert max_diff(a, b) <= TOL


@pytest.mark.parametrize("mode", ["compact", "native"])
def test_gate_candidate_logprobs_equal_fresh(family_model, mode):
    fam, model = family_model
    log = make_log()
    ekv = prefill(model, log)
    cands = [[10], [11, 12, 13], [14, 15]]
    scores = candidate_logprobs(model, serve(ekv, SUBSET, mode), QUERY, cands)
    for cand, score in zip(cands, scores):
        # reference: each candidate alone, token by token, through generate-free forwards
        served = serve(ekv, SUBSET, mode)
        total = 0.0
        for j in range(len(cand)):
            lp = torch.log_softmax(query_logits(model, served, QUERY + cand[:j]), -1)
            total += float(lp[cand[j]])
        assert abs(score.logprob - total) <= TOL
    assert abs(sum(s.prob for s in scores) - 1.0) < 1e-9


def test_gate_eventkv_save_load_roundtrip(tmp_path, family_model):
    fam, model = family_model
    ekv = prefill(model, make_log(), weights_digest="abc")
    ekv.save(tmp_path / "kv")
    back = EventKV.load(tmp_path / "kv", expect_digest="abc")
    assert back.log.input_ids == ekv.log.input_ids and back.log.history_end == ekv.log.history_end
    for a, b in zip(ekv.keys + ekv.values, back.keys + back.values):
        assert torch.equal(a, b)
    a = query_logits(model, serve(ekv, SUBSET), QUERY)
    b = query_logits(model, serve(back, SUBSET), QUERY)
    assert torch.equal(a, b)
