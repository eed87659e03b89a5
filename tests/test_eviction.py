"""Eviction policies: each rule against a hand computation on small captures
(per head; positions with gaps and out of row order), the capture against the model's own attention,
and the per-(layer, head) masked serving path against unmasked and row-masked native serving."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.eviction import (
    POLICIES,
    EventTopK,
    ExpectedAttention,
    Knorm,
    LayerCapture,
    Random,
    SnapKV,
    StreamingLLM,
    Tova,
    UserPolicy,
    keep_mask,
    kept_count,
    make_policy,
)
from eventkv.eviction.capture import capture_prefill
from eventkv.eviction.masked import masked_attention, read_out_masked
from eventkv.kv.log import Event, EventLog, tokenize, tokenize_query
from eventkv.kv.readout import read_out
from eventkv.kv.serve import serve
from eventkv.testing import tiny_lm

KV, QH, D = 2, 4, 8


def capture(rows=12, window=4, seed=0, positions=None):
    g = torch.Generator().manual_seed(seed)
    pos = torch.tensor(positions) if positions is not None else torch.arange(rows) * 3 + torch.arange(rows) % 2
    inv_freq = 1.0 / 10000 ** (torch.arange(D // 2, dtype=torch.float64) / (D // 2))
    qpos = torch.sort(pos).values[-window:]
    return LayerCapture(
        layer=0,
        keys=torch.randn(KV, rows, D, generator=g),
        values=torch.randn(KV, rows, D, generator=g),
        positions=pos,
        queries=torch.randn(QH, window, D, generator=g),
        query_positions=qpos,
        scaling=None,
        rope=(inv_freq, 1.0),
        event_of_row=torch.tensor([-1, -1] + [i // 3 for i in range(rows - 2)]),
    )


def kept_rows(mask):
    return [sorted(np.flatnonzero(m.numpy()).tolist()) for m in mask]


# ====================================================================== each rule by hand
def test_streaming_keeps_sinks_and_the_latest_positions_not_rows():
    pos = [5, 0, 9, 40, 1, 30, 2, 20, 3, 50, 60, 7]  # out of row order, with gaps
    c = capture(positions=pos)
    m = keep_mask(StreamingLLM(sinks=2), c, 0.5)  # keep 6: positions 0, 1 + the 4 latest (60, 50, 40, 30)
    want = sorted(pos.index(p) for p in (0, 1, 60, 50, 40, 30))
    assert kept_rows(m) == [want, want]


def test_settings_kvpress_refuses_or_crashes_on_are_well_defined_here():
    """docs/eviction.md's table of settings: sinks >= rows keeps the earliest positions; an even SnapKV kernel
    gives one pooled score per row (kvpress's avg_pool1d returns one more and its view fails)."""
    pos = [5, 0, 9, 40, 1, 30, 2, 20, 3, 50, 60, 7]
    c = capture(positions=pos)
    m = keep_mask(StreamingLLM(sinks=100), c, 0.5)  # every row a sink: the 6 earliest positions stay
    want = sorted(pos.index(p) for p in (0, 1, 2, 3, 5, 7))
    assert kept_rows(m) == [want, want]
    for pooling in ("max", "avg"):
        s = SnapKV(window=4, kernel=4, pooling=pooling).scores(capture())
        assert s.shape == (KV, 12) and torch.isfinite(s[:, :8]).all() and torch.isinf(s[:, 8:]).all()


def test_knorm_keeps_the_smallest_key_norms_per_head():
    c = capture()
    m = keep_mask(Knorm(), c, 0.25)
    for h in range(KV):
        norms = [float(np.linalg.norm(c.keys[h, r].numpy())) for r in range(12)]
        assert kept_rows(m)[h] == sorted(np.argsort(norms, kind="stable")[:9].tolist())
    assert kept_rows(m)[0] != kept_rows(m)[1]  # per head


def _window_softmax(c):
    """By hand: per query head and window query, softmax over rows at positions <= its own."""
    out = np.zeros((QH, c.queries.shape[1], c.rows))
    for h in range(QH):
        kh = h // (QH // KV)
        for w in range(c.queries.shape[1]):
            logits = []
            for r in range(c.rows):
                if c.positions[r] <= c.query_positions[w]:
                    logits.append(float(c.queries[h, w].double() @ c.keys[kh, r].double()) / math.sqrt(D))
                else:
                    logits.append(-np.inf)
            e = np.exp(np.array(logits) - max(logits))
            out[h, w] = e / e.sum()
    return out


def test_snapkv_by_hand():
    c = capture(rows=12, window=4)
    att = _window_softmax(c)
    prefix = [r for r in range(12) if c.positions[r] < c.query_positions.min()]
    for kernel, pooling in ((1, "max"), (3, "max"), (3, "avg"), (5, "avg")):
        scores = SnapKV(window=4, kernel=kernel, pooling=pooling).scores(c)
        for kh in range(KV):
            heads = range(kh * 2, kh * 2 + 2)
            votes = [np.mean([att[h, :, r].mean() for h in heads]) for r in prefix]  # the window's mean
            half = kernel // 2
            if pooling == "max" and kernel > 1:
                votes = [max(votes[max(0, i - half) : i + half + 1]) for i in range(len(votes))]
            elif pooling == "avg":  # the zero padding counts: every window sums to kernel entries
                votes = [sum(votes[max(0, i - half) : i + half + 1]) / kernel for i in range(len(votes))]
            np.testing.assert_allclose(scores[kh, prefix].numpy(), votes, rtol=1e-6)
            assert all(math.isinf(scores[kh, r]) for r in range(12) if r not in prefix)  # the window is kept


def test_snapkv_reads_only_its_window():
    c = capture(rows=12, window=4)
    two = SnapKV(window=2, kernel=1).scores(c)
    att = _window_softmax(c)[:, -2:, :]  # the last two queries only
    prefix = [r for r in range(12) if c.positions[r] < c.query_positions[-2]]
    want = att[:, :, prefix].mean(axis=1).reshape(KV, 2, -1).mean(axis=1)
    np.testing.assert_allclose(two[:, prefix].numpy(), want, rtol=1e-6)
    assert not torch.equal(two, SnapKV(window=4, kernel=1).scores(c))


def test_event_topk_respects_the_budget_with_infinite_inner_scores():
    c = capture(rows=12, window=4)  # SnapKV scores the window's rows +inf
    for ratio in (0.5, 0.75):
        m = keep_mask(EventTopK(inner=SnapKV(window=4)), c, ratio)
        assert int(m[0].sum()) <= kept_count(12, ratio) and m[0, :2].all()  # header first, within budget


def test_tova_by_hand():
    c = capture()
    att = _window_softmax(c)[:, -1, :].mean(axis=0)
    s = Tova().scores(c)
    last = int(torch.argmax(c.positions))  # the last query's own row: always kept, as kvpress's TOVAPress
    others = [r for r in range(c.rows) if r != last]
    np.testing.assert_allclose(s[0, others].numpy(), att[others], rtol=1e-6)
    assert math.isinf(s[0, last]) and torch.equal(s[0], s[1])


def _rotate(x, angles):
    """Rotate each (i, i + d/2) pair of ``x [..., d]`` by ``angles [..., d/2]`` as complex numbers."""
    h = x.shape[-1] // 2
    z = (x[..., :h] + 1j * x[..., h:]) * np.exp(1j * angles)
    return np.concatenate([z.real, z.imag], axis=-1)


def test_expected_attention_by_hand():
    c = capture(rows=12, window=6)
    inv_freq = c.rope[0].numpy()
    rng = np.random.default_rng(0)
    pre = rng.normal(size=(QH, 6, D))
    c.queries = torch.tensor(_rotate(pre, c.query_positions.numpy()[:, None] * inv_freq), dtype=torch.float32)
    horizon = 16
    future = c.query_positions.max().item() + 1 + np.arange(horizon)
    # R-bar as a matrix: the mean of the future rotations, each built by rotating the basis vectors
    rbar = np.mean([_rotate(np.eye(D), p * inv_freq).T for p in future], axis=0)
    pre32 = _rotate(c.queries.double().numpy(), -c.query_positions.numpy()[:, None] * inv_freq)
    order = np.argsort(c.positions.numpy(), kind="stable")
    for use_cov, sinks in ((False, 0), (True, 0), (True, 4), (True, 9)):
        got = ExpectedAttention(horizon=horizon, use_covariance=use_cov, sinks=sinks).scores(c).numpy()
        sink_rows = set(order[:sinks].tolist())  # the rows at the first `sinks` positions
        free = [r for r in range(c.rows) if r not in sink_rows]
        first_free = min(int(c.positions[r]) for r in free)
        counted = [w for w in range(6) if int(c.query_positions[w]) >= first_free]  # queries at sinks left out
        assert len(counted) == (6 if sinks < 9 else 3)
        for kh in range(KV):
            per_head = []
            for h in (2 * kh, 2 * kh + 1):
                qs = pre32[h][counted]
                mu = rbar @ qs.mean(axis=0)
                k = c.keys[kh].double().numpy()[free]
                logits = k @ mu / math.sqrt(D)
                if use_cov:  # the maximum-likelihood covariance (divided by n), as kvpress's
                    cov = rbar @ np.cov(qs.T, bias=True) @ rbar.T
                    logits = logits + 0.5 / D * np.einsum("rd,de,re->r", k, cov, k)
                e = np.exp(logits - logits.max())
                per_head.append(e / e.sum())
            want = np.mean(per_head, axis=0) * np.linalg.norm(c.values[kh].double().numpy()[free], axis=-1)
            np.testing.assert_allclose(got[kh, free], want, rtol=1e-5)
            assert all(math.isinf(got[kh, r]) for r in sink_rows)  # sinks always kept


def test_random_is_seeded_per_layer():
    c = capture()
    a, b = keep_mask(Random(seed=1), c, 0.5), keep_mask(Random(seed=1), c, 0.5)
    assert torch.equal(a, b) and not torch.equal(a, keep_mask(Random(seed=2), c, 0.5))
    c2 = capture()
    c2.layer = 1
    assert not torch.equal(Random(seed=1).scores(c), Random(seed=1).scores(c2))


def test_event_topk_keeps_whole_events_and_the_header():
    c = capture(rows=12)  # header rows 0-1, events of 3 rows: 2-4, 5-7, 8-10, and 11
    m = keep_mask(EventTopK(inner=Knorm()), c, 0.5)  # 6 rows: header + one 3-row event (+ the 1-row one if best)
    rows = kept_rows(m)[0]
    assert rows[:2] == [0, 1] and len(rows) <= 6 and torch.equal(m[0], m[1])
    ev = c.event_of_row
    for e in range(4):
        in_e = (ev == e).nonzero().flatten().tolist()
        assert all(r in rows for r in in_e) or not any(r in rows for r in in_e)  # all or nothing


def test_ratio_zero_keeps_everything_and_bad_input_is_named():
    c = capture()
    small = SnapKV(window=4)
    settings = {
        name: {"inner": small} for name in ("adakv", "per-layer-ratio", "criticalkv", "criticaladakv", "chunkkv")
    }
    settings |= {"snapkv": {"window": 4}, "pyramidkv": {"window": 4}, "finch": {"window": 4}}
    settings |= {"per-layer": {"policies": (Knorm(),)}, "composed": {"policies": (small, Knorm())}}
    # what some policies read besides: the model's depth, the output projection, every prefill query
    c = dataclasses.replace(c, n_layers=2, out_proj=torch.randn(QH * D, QH * D))
    for name in POLICIES:
        on = dataclasses.replace(capture(window=12), n_layers=2) if name == "observed" else c
        if name == "kvzip":  # a reconstruction pass's keys, after the history
            on = dataclasses.replace(c, extra_keys=torch.randn(KV, 3, D), extra_positions=torch.arange(100, 103))
        assert keep_mask(make_policy(name, **settings.get(name, {})), on, 0.0).all(), name
    with pytest.raises(OptionError, match="window 64"):
        SnapKV().scores(c)  # 64 > the 4 captured queries: refused, not silently shortened
    for bad in (1.0, -0.1, True, "0.5", float("nan")):
        with pytest.raises(OptionError, match="ratio"):
            keep_mask(Knorm(), c, bad)
    with pytest.raises(OptionError, match="policy 'h2o': use one of streaming"):
        make_policy("h2o")
    with pytest.raises(OptionError, match="shape"):
        keep_mask(UserPolicy(fn=lambda c: torch.zeros(3)), c, 0.5)
    m = keep_mask(UserPolicy(fn=lambda c: -c.positions.double().expand(c.kv_heads, -1)), c, 0.5)
    assert kept_rows(m)[0] == list(range(6))  # a user rule: keep the earliest positions
    no_q = capture()
    no_q.queries = None
    with pytest.raises(OptionError, match="queries"):
        SnapKV().scores(no_q)


BAD_PARAMETERS = [
    (StreamingLLM, "sinks", -1),  # would keep the oldest rows as "sinks" from the end
    (StreamingLLM, "sinks", 2.5),
    (StreamingLLM, "sinks", True),
    (SnapKV, "window", 0),
    (SnapKV, "window", -8),
    (SnapKV, "kernel", 0),
    (SnapKV, "pooling", "mean"),
    (ExpectedAttention, "horizon", 0),
    (ExpectedAttention, "sinks", -1),
    (ExpectedAttention, "epsilon", -0.1),
    (ExpectedAttention, "epsilon", float("nan")),
    (ExpectedAttention, "use_covariance", "yes"),
    (ExpectedAttention, "use_vnorm", 1),
    (Random, "seed", -1),
    (Random, "seed", 0.5),
    (EventTopK, "inner", "knorm"),
    (UserPolicy, "fn", None),
    (UserPolicy, "fn", 3),
]


@pytest.mark.parametrize("cls, name, bad", BAD_PARAMETERS, ids=[f"{c.name}-{f}-{v!r}" for c, f, v in BAD_PARAMETERS])
def test_policy_parameters_are_refused_when_the_policy_is_made(cls, name, bad):
    """Each policy checks its own fields, so the library refuses what the CLI refuses."""
    with pytest.raises(OptionError) as err:
        cls(**{name: bad})
    assert err.value.field == name and str(err.value).startswith(f"{name} ")
    if cls.name in POLICIES:
        with pytest.raises(OptionError, match=f"^{name} "):
            make_policy(cls.name, **{name: bad})


def test_every_registered_policy_is_made_with_its_defaults_and_its_edges():
    needs = {"per-layer", "composed"}  # no default list of policies
    assert [type(make_policy(n)) for n in POLICIES if n not in needs] == [
        cls for n, cls in POLICIES.items() if n not in needs
    ]
    with pytest.raises(OptionError, match="^policies .*: give one policy per layer"):
        make_policy("per-layer")
    assert StreamingLLM(sinks=0).sinks == 0 and SnapKV(window=1, kernel=1).window == 1
    assert ExpectedAttention(sinks=0, horizon=1, epsilon=0).horizon == 1 and Random(seed=0).seed == 0


def test_the_audit_refuses_a_policy_parameter_as_the_library_does():
    from eventkv.studies.materialization.audit import EvictionAudit

    with pytest.raises(OptionError) as err:
        EvictionAudit(policies=("streaming",), sinks=-1)
    assert err.value.for_cli().startswith("--sinks -1: ")


def test_snapkv_refuses_a_window_that_leaves_no_row_before_it():
    """kvpress's SnapKVPress asserts more tokens than its window; here the policy refuses with the fix,
    rather than scoring every row as the window's and evicting the header."""
    c = capture(rows=12, window=12)
    with pytest.raises(OptionError, match="window 12: the layer has 12 rows.*below 12"):
        keep_mask(SnapKV(window=12, kernel=1), c, 0.5)
    m = keep_mask(SnapKV(window=11, kernel=1), c, 0.0)
    assert m.all()
    m = keep_mask(SnapKV(window=11, kernel=1), c, 0.05)  # keep 11 of 12: only the window's rows
    assert kept_rows(m) == [list(range(1, 12))] * 2


def test_expected_attention_refuses_a_layer_of_sinks_only():
    c = capture(rows=12, window=4)
    with pytest.raises(OptionError, match="sinks 12: the layer has 12 rows, all sinks"):
        ExpectedAttention(sinks=12).scores(c)
    c.query_positions = torch.tensor([0, 4, 6, 10])  # a capture of the first four queries only
    with pytest.raises(OptionError, match="sinks 4: every captured query sits at a sink position"):
        ExpectedAttention(sinks=4).scores(c)


def test_kept_count_is_kvpress_count():
    """``max(1, int(rows * (1 - r)))``, kvpress 0.5.5's count: one row fewer than ``rows - floor(r * rows)``
    whenever ``r * rows`` is fractional, and never an empty layer."""
    assert [kept_count(61, r) for r in (0.0, 0.3, 0.5, 0.75, 0.99)] == [61, 42, 30, 15, 1]
    assert kept_count(10, 0.7) == int(10 * (1 - 0.7)) == 3  # the same float arithmetic (0.3 * 10 = 3.0000000000000004)
    assert kept_count(1, 0.5) == 1
    for bad in (1.0, 1.5, -0.1, float("nan"), True):
        with pytest.raises(OptionError, match="^ratio "):
            kept_count(10, bad)
    with pytest.raises(OptionError, match="^rows 0"):
        kept_count(0, 0.5)
    c = capture(rows=12)
    assert int(keep_mask(Knorm(), c, 0.3)[0].sum()) == 8  # 12 - floor(3.6) would keep 9


def test_knorm_ties_within_float32_rounding_keep_the_later_position():
    c = capture(rows=6)
    c.positions = torch.arange(6)
    base = c.keys[:, 0].clone()
    c.keys[:, 2] = base * (1 + 2e-7)  # the same norm up to rounding, as one token's rotated keys in layer 0
    c.keys[:, 4] = base
    assert not torch.equal(c.keys[:, 2].double().norm(dim=-1), base.double().norm(dim=-1))
    s = Knorm().scores(c)
    assert torch.equal(s[:, 0], s[:, 2]) and torch.equal(s[:, 0], s[:, 4])
    for h in range(KV):  # a budget that keeps one of the three tied rows keeps the latest position
        n_better = int((s[h] > s[h, 0]).sum())
        m = Knorm().keep(c, n_better + 1)
        assert m[h, 4] and not m[h, 0] and not m[h, 2]
    c.keys[:, 2] = base * (1 + 1e-5)  # a real difference is not a tie
    assert not torch.equal(Knorm().scores(c)[:, 2], Knorm().scores(c)[:, 0])


# ====================================================================== capture on a real forward
@pytest.fixture(scope="module")
def llama():
    lm = tiny_lm("llama")
    events = [Event("a", "register A set to ON", budget=40), Event("b", "register B mirrors A"), Event("c", "C is 7")]
    return lm, tokenize(EventLog(events), lm.tokenizer, lm.profile)


def test_capture_reads_the_log_positions_and_the_model_attention(llama):
    lm, log = llama
    ekv, caps = capture_prefill(lm.model, log, window=8)
    assert lm.model.config._attn_implementation == "sdpa"  # switched back
    assert len(caps) == lm.model.config.num_hidden_layers
    c = caps[-1]
    assert c.positions.tolist() == log.position_ids and c.positions.tolist() != list(range(log.n_rows))  # gaps
    assert c.query_positions.tolist() == log.position_ids[-8:]
    cfg = lm.model.config
    inv = 1.0 / cfg.rope_parameters["rope_theta"] ** (torch.arange(0, D * 2, 2, dtype=torch.float64) / (D * 2))
    assert c.rope[1] == pytest.approx(1.0) and (c.rope[0] - inv).abs().max() < 1e-6
    # TOVA's scores are the model's own attention of the last token (eager, uncached, same positions)
    lm.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = lm.model(
                torch.tensor([log.input_ids]), position_ids=torch.tensor([log.position_ids]), output_attentions=True
            )
    finally:
        lm.model.set_attn_implementation("sdpa")
    model_att = out.attentions[-1][0, :, -1, :].double().mean(dim=0)
    assert (Tova().scores(c)[0, :-1] - model_att[:-1]).abs().max() < 1e-5  # the last row: always kept (inf)


# ====================================================================== the per-head masked path
def test_masked_attention_is_a_per_head_softmax():
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(1, QH, 2, D, generator=g),
        torch.randn(1, KV, 7, D, generator=g),
        torch.randn(1, KV, 7, D, generator=g),
    )
    import eventkv.eviction.masked as masked

    class Module:
        layer_idx, is_causal, num_key_value_groups = 0, True, QH // KV

    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 1, 1, 0, 1]], dtype=torch.bool)  # 5 cache rows, 2 query tokens
    masked._MASKS = {0: mask}
    try:
        out, _ = masked_attention(Module(), q, k, v, None, scaling=1 / math.sqrt(D))
    finally:
        masked._MASKS = None
    for h in range(QH):
        kh = h // 2
        for t in range(2):
            visible = [r for r in range(5) if mask[kh, r]] + list(range(5, 5 + t + 1))
            logits = torch.stack([q[0, h, t] @ k[0, kh, r] for r in visible]) / math.sqrt(D)
            want = torch.softmax(logits, 0) @ v[0, kh, visible]
            assert torch.allclose(out[0, t, h], want, atol=1e-6)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gate_masked_serving(family):
    """A mask that keeps everything equals unmasked native serving; a mask that drops the same rows in
    every head equals native serving with those events hidden (both: greedy tokens, logits within 1e-5)."""
    lm = tiny_lm(family)
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(30.0)
    log = tokenize(
        EventLog([Event("a", "register A set to ON", budget=40), Event("b", "B mirrors A"), Event("c", "C is 7")]),
        lm.tokenizer,
        lm.profile,
    )
    ekv, caps = capture_prefill(lm.model, log, window=8)
    q = tokenize_query(lm.tokenizer, lm.profile, "What is A?")
    opts = {"max_new_tokens": 4, "keep_logits": True, "tokenizer": lm.tokenizer}
    ref = read_out(lm.model, [serve(ekv, "all", "native")], q, generate=[True], score=[False], **opts)[0].generation
    keep_all = [torch.ones(c.kv_heads, c.rows, dtype=torch.bool) for c in caps]
    got = read_out_masked(lm.model, ekv, keep_all, q, **opts).generation
    assert got.tokens == ref.tokens
    assert max(float((a - b).abs().max()) for a, b in zip(got.logits, ref.logits)) <= 1e-5
    span = log.span("b")
    drop_b = []
    for c in caps:
        m = torch.ones(c.kv_heads, c.rows, dtype=torch.bool)
        m[:, span.row_start : span.row_end] = False
        drop_b.append(m)
    ref_b = read_out(lm.model, [serve(ekv, ["a", "c"], "native")], q, generate=[True], score=[False], **opts)[0]
    got_b = read_out_masked(lm.model, ekv, drop_b, q, **opts)
    assert got_b.generation.tokens == ref_b.generation.tokens
    assert max(float((a - b).abs().max()) for a, b in zip(got_b.generation.logits, ref_b.generation.logits)) <= 1e-5
    with pytest.raises(EventKVError, match="mask of layer 0"):
        read_out_masked(lm.model, ekv, [torch.ones(1, 3, dtype=torch.bool)], q, **opts)


def test_kvzip_scores_are_the_model_attention_of_its_reconstruction_pass(llama):
    """KVzip's row scores equal the model's own attention weights (eager, one uncached forward of the history,
    the request and the history's tokens again), maximised over the reconstruction queries and each GQA group."""
    from eventkv.eviction.budgets import AdaKV
    from eventkv.eviction.capture import capture_reconstruction
    from eventkv.eviction.scorers import KVzip

    lm, log = llama
    ekv, caps = capture_prefill(lm.model, log, window=8)
    prompt = lm.tokenizer.encode("Repeat it:", add_special_tokens=False)
    rebuilt = capture_reconstruction(lm.model, ekv, log, prompt, caps)
    context = [t for toks in log.event_tokens for t in toks]
    n_rec = len(prompt) + len(context)
    c = rebuilt[-1]
    assert c.queries.shape[1] == n_rec == c.extra_keys.shape[1]
    assert c.extra_positions.tolist() == list(range(log.history_end, log.history_end + n_rec))
    assert torch.equal(c.keys, caps[-1].keys)  # the history's rows are untouched
    ids = log.input_ids + prompt + context
    pos = log.position_ids + c.extra_positions.tolist()
    lm.model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = lm.model(torch.tensor([ids]), position_ids=torch.tensor([pos]), output_attentions=True)
    finally:
        lm.model.set_attn_implementation("sdpa")
    att = out.attentions[-1][0, :, -n_rec:, : log.n_rows].double()  # [q_heads, reconstruction, history rows]
    group = att.shape[0] // c.kv_heads
    want = att.amax(dim=1).reshape(c.kv_heads, group, log.n_rows).amax(dim=1)
    assert (KVzip().scores(c) - want).abs().max() < 1e-5
    assert KVzip().needs_reconstruction and AdaKV(inner=KVzip()).needs_reconstruction
    with pytest.raises(OptionError, match="capture one"):
        KVzip().scores(caps[-1])


def test_masked_readout_serves_pruned_key_channels_as_zeros(llama):
    """Pruning key channels (ThinK) reads the same as serving keys whose pruned channels are 0."""
    from eventkv.kv.rows import EventKV

    lm, log = llama
    ekv, caps = capture_prefill(lm.model, log, window=8)
    query = tokenize_query(lm.tokenizer, lm.profile, "What is C?")
    g = torch.Generator().manual_seed(0)
    channels = [torch.rand(c.kv_heads, c.keys.shape[-1], generator=g) > 0.3 for c in caps]
    zeroed = EventKV(
        ekv.log, [k * ch[None, :, None, :] for k, ch in zip(ekv.keys, channels)], ekv.values, ekv.positions
    )
    a = read_out_masked(lm.model, ekv, {}, query, key_channels=channels, max_new_tokens=3, keep_logits=True)
    b = read_out_masked(lm.model, zeroed, {}, query, max_new_tokens=3, keep_logits=True)
    assert a.generation.tokens == b.generation.tokens
    assert torch.allclose(torch.stack(a.generation.logits), torch.stack(b.generation.logits), atol=1e-6)
    c = read_out_masked(lm.model, ekv, {}, query, max_new_tokens=3, keep_logits=True)
    assert not torch.allclose(torch.stack(a.generation.logits), torch.stack(c.generation.logits))


def _lag_capture(rows: int, seed: int = 0) -> LayerCapture:
    g = torch.Generator().manual_seed(seed)
    keys, values = torch.randn(2, rows, 6, generator=g), torch.randn(2, rows, 6, generator=g)
    return LayerCapture(0, keys, values, torch.arange(rows))


def test_lagkv_scores_each_partition_against_the_next_one():
    from eventkv.eviction.scorers import LagKV

    c = _lag_capture(4 + 3 * 4 + 2)  # 4 sinks, partitions of 4: two scored, the third and 2 rows more the tail
    policy = LagKV(sinks=4, lag=4, cross_scoring=True)
    s = policy.scores(c)
    assert s[:, :4].eq(1).all() and s[:, 12:].eq(1).all()  # sinks and tail always kept

    def by_hand(states: np.ndarray, head: int, part: int) -> np.ndarray:  # the paper's rule, one partition
        x = states[head, 4 + 4 * part : 8 + 4 * part]
        ref = states[head, 8 + 4 * part : 12 + 4 * part]
        normed = (x - ref.min(axis=0)) / (ref.max(axis=0) - ref.min(axis=0))
        spread = normed.std(axis=1, ddof=1)
        return np.exp(spread) / np.exp(spread).sum()

    keys, values = c.keys.double().numpy(), c.values.double().numpy()
    for head in range(2):
        for part in range(2):
            want = (by_hand(keys, head, part) + by_hand(values, head, part)) / 2
            got = s[head, 4 + 4 * part : 8 + 4 * part].numpy()
            assert np.allclose(got, want, rtol=1e-12, atol=0)
    ranked = LagKV(sinks=4, lag=4).scores(c)  # the default: ranks within the partition
    for head in range(2):
        for part in range(2):
            block = ranked[head, 4 + 4 * part : 8 + 4 * part]
            assert sorted(block.tolist()) == [0, 0.25, 0.5, 0.75]
            assert block.argsort().tolist() == s[head, 4 + 4 * part : 8 + 4 * part].argsort().tolist()
    # ranks tie across partitions: 13 of 18 rows kept = 4 sinks + 6 tail + both rank-0.75 rows + one of the two
    # rank-0.5 rows, the later partition's (ties keep the later row)
    m = keep_mask(LagKV(sinks=4, lag=4), c, 0.25)
    for head in range(2):
        kept = set(torch.nonzero(m[head]).flatten().tolist())
        top = {r for r in range(4, 12) if ranked[head, r] == 0.75}
        second = sorted(r for r in range(4, 12) if ranked[head, r] == 0.5)
        assert kept == set(range(4)) | set(range(12, 18)) | top | {second[1]} and second[1] >= 8


def test_lagkv_keeps_sinks_and_latest_rows_when_too_short_and_never_scores_nan():
    from eventkv.eviction.scorers import LagKV

    c = _lag_capture(4 + 2 * 8 - 1)  # one row short of two partitions of 8: 9 of 19 kept, sinks then latest
    m = keep_mask(LagKV(sinks=4, lag=8), c, 0.5)
    assert [sorted(torch.nonzero(row).flatten().tolist()) for row in m] == [[0, 1, 2, 3] + list(range(14, 19))] * 2
    flat = _lag_capture(4 + 3 * 4)
    flat.keys[:, 8:12, 0] = 1.0  # a reference channel with no spread: normalized to 0, not divided by 0
    assert torch.isfinite(LagKV(sinks=4, lag=4, cross_scoring=True).scores(flat)).all()
    for bad, match in (({"lag": 0}, "lag 0"), ({"sinks": -1}, "sinks -1"), ({"cross_scoring": "yes"}, "cross")):
        with pytest.raises(OptionError, match=match):
            LagKV(**bad)
