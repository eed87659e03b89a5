"""The attention selector (eventkv.memory.attention) against a hand computation of its scores on every
tiny architecture, its k / budget / errors, the hybrid selector's reciprocal rank fusion against a
hand computation, and a hand-made event set on smollm2-135m (integration)."""

import collections

import pytest
import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.log import Event, EventLog, tokenize, tokenize_query
from eventkv.kv.prefill import prefill
from eventkv.kv.rows import cache_from_rows
from eventkv.memory import EventMemory
from eventkv.memory.attention import AttentionSelector, resolve_layers
from eventkv.memory.hybrid import K_RRF, HybridSelector
from eventkv.memory.select import BM25Selector, Ranked, SelectionContext, within_budget
from eventkv.testing import TINY_FAMILIES, tiny_lm

Candidate = collections.namedtuple("Candidate", "id text n_rows")
TEXTS = ["register A set to ON", "Dana moved the red key", "register B mirrors A", "the cat sat on a mat"]
QUESTION = "Who moved the key?"


def setup(family: str, texts=TEXTS):
    lm = tiny_lm(family)
    events = [Event(f"e{i}", t) for i, t in enumerate(texts)]
    log = tokenize(EventLog(events), lm.tokenizer, lm.profile)
    ekv = prefill(lm.model, log)
    cands = [Candidate(e.id, e.text, log.span(e.id).n_tokens) for e in events]
    return lm, ekv, cands, SelectionContext(lm=lm, rows=lambda: ekv, history_end=log.history_end)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def hand_scores(lm, ekv, cands, question, layers, pooling, header, attend, events=None):
    """The attention scores written out: the layer's input from output_hidden_states, its input norm, q_proj
    weights, q_norm, RoPE as q cos + rotate_half(q) sin, softmax over the events' rows, pooling, means."""
    model, cfg = lm.model, lm.model.config
    events = events or cands
    ids = tokenize_query(lm.tokenizer, lm.profile, question)
    start = ekv.log.history_end
    pos = torch.arange(start, start + len(ids))[None]
    kwargs = {}
    n_past = 0
    if attend == "history":
        kwargs["cache"], n_past = cache_from_rows(ekv.keys, ekv.values), ekv.n_rows
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([ids]),
            position_ids=pos,
            attention_mask=torch.ones(1, n_past + len(ids), dtype=torch.bool),
            output_hidden_states=True,
            **kwargs,
        )
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, lm.profile.head_dim
    scale = (cfg.query_pre_attn_scalar if cfg.model_type == "gemma3_text" else d) ** -0.5
    total = torch.zeros(len(events), dtype=torch.float64)
    for layer in layers:
        block = model.model.layers[layer]
        with torch.no_grad():
            h = block.input_layernorm(out.hidden_states[layer])[0]  # [q, hidden]
            w, b = block.self_attn.q_proj.weight, block.self_attn.q_proj.bias
            q = (h @ w.T + (b if b is not None else 0)).view(len(ids), heads, d)
            if hasattr(block.self_attn, "q_norm"):
                q = block.self_attn.q_norm(q)
            extra = (cfg.layer_types[layer],) if cfg.model_type == "gemma3_text" else ()
            cos, sin = model.model.rotary_emb(h[None], pos, *extra)
            q = q * cos[0][:, None, :] + rotate_half(q) * sin[0][:, None, :]  # [q, heads, d]
        spans = [ekv.log.span(e.id) for e in events]
        rows = [r for s in spans for r in range(s.row_start, s.row_end)]
        if header:
            rows = list(range(ekv.log.spans[0].row_end)) + rows
        keys = ekv.keys[layer][0][:, rows].double()  # [kv_heads, rows, d]
        per = torch.zeros(len(events), dtype=torch.float64)
        for hd in range(heads):
            z = q[:, hd].double() @ keys[hd // (heads // kv_heads)].T * scale  # [q, rows]
            p = torch.softmax(z, dim=-1)
            if header:
                p = p[:, ekv.log.spans[0].row_end :]
            at = 0
            for i, s in enumerate(spans):
                block_p = p[:, at : at + s.n_tokens]
                at += s.n_tokens
                pooled = {"mass": block_p.sum(1), "max": block_p.max(1).values, "mean": block_p.mean(1)}[pooling]
                per[i] += pooled.sum()
        total += per / (heads * len(ids))
    return total / len(layers)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_scores_equal_the_hand_computation(family):
    lm, ekv, cands, ctx = setup(family)
    n = lm.profile.num_layers
    for layers, pooling, header, attend in [
        ([0], "mass", False, "question"),
        (list(range(n)), "max", False, "question"),
        ([n - 1], "mean", True, "question"),
        ([0, n - 1], "mass", True, "history"),
        ([n - 1], "max", False, "history"),
    ]:
        sel = AttentionSelector(layers, pooling, header=header, attend=attend)
        got = torch.from_numpy(sel.scores(QUESTION, cands, ctx)).double()
        want = hand_scores(lm, ekv, cands, QUESTION, layers, pooling, header, attend)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=f"{layers} {pooling} {header} {attend}")
        if pooling == "mass" and not header:
            assert float(got.sum()) == pytest.approx(1.0, abs=1e-5)  # a unit of attention spread over events


def test_only_the_candidates_rows_enter_the_softmax():
    lm, ekv, cands, ctx = setup("qwen3")
    some = [cands[0], cands[3]]  # e.g. the others deleted or superseded
    got = torch.from_numpy(AttentionSelector([1], "mass").scores(QUESTION, some, ctx)).double()
    want = hand_scores(lm, ekv, cands, QUESTION, [1], "mass", False, "question", events=some)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_rank_is_best_first_and_honours_k_and_budget():
    lm, ekv, cands, ctx = setup("llama")
    sel = AttentionSelector()
    s = torch.from_numpy(sel.scores(QUESTION, cands, ctx))
    full = sel.rank(QUESTION, cands, context=ctx)
    assert [r.id for r in full] == [cands[i].id for i in torch.argsort(s, descending=True, stable=True).tolist()]
    assert [r.score for r in full] == pytest.approx(sorted(s.tolist(), reverse=True))
    assert sel.rank(QUESTION, cands, k=2, context=ctx) == full[:2]
    rows = {c.id: c.n_rows for c in cands}
    budget = rows[full[0].id] + rows[full[1].id] - 1  # the first fits, the second does not
    got = sel.rank(QUESTION, cands, budget=budget, context=ctx)
    assert got == within_budget(full, [rows[r.id] for r in full], budget) == full[:1]


def test_a_memory_selects_by_attention(tmp_path):
    lm = tiny_lm("gemma3")
    with EventMemory.create(tmp_path / "m", lm, namespace="t", selector="attention") as mem:
        mem.add(TEXTS)
        got = mem.select(QUESTION, k=2)
        ctx = mem._selection_context()
        view = mem.list()
        want = [r.id for r in AttentionSelector().rank(QUESTION, view, k=2, context=ctx)]
        assert len(got) == 2 and got == sorted(want, key=[r.id for r in view].index)


def test_errors_name_the_bad_value():
    lm, ekv, cands, ctx = setup("llama")
    with pytest.raises(OptionError, match="^context None: .*lm and rows"):
        AttentionSelector().rank(QUESTION, cands)
    with pytest.raises(OptionError, match="^context "):
        AttentionSelector().rank(QUESTION, cands, context=SelectionContext(lm=lm))
    with pytest.raises(OptionError, match=r"^layers 2: give layer indices in 0\.\.1"):
        AttentionSelector([2]).rank(QUESTION, cands, context=ctx)
    for bad in ([], [1.5], ["a"], "0", [True]):
        with pytest.raises(OptionError, match="^layers "):
            AttentionSelector(bad)
    with pytest.raises(OptionError, match="^pooling 'sum': give one of mass, max, mean"):
        AttentionSelector(pooling="sum")
    with pytest.raises(OptionError, match="^attend 'all'"):
        AttentionSelector(attend="all")
    with pytest.raises(OptionError, match="^k 0"):
        AttentionSelector().rank(QUESTION, cands, k=0, context=ctx)
    with pytest.raises(EventKVError, match="no events"):
        AttentionSelector().rank(QUESTION, [], context=ctx)
    with pytest.raises(EventKVError, match="unknown event id 'zz'"):
        AttentionSelector().rank(QUESTION, [Candidate("zz", "x", 1)], context=ctx)


def test_layers_resolve_by_index_and_fraction():
    assert resolve_layers([0.0, 0.5, 1.0], 30) == [0, 14, 29]  # round(0.5 * 29) = 14 (half to even)
    assert resolve_layers([-1, 3, 3, 0.1], 30) == [3, 29]
    assert resolve_layers(range(2, 5), 30) == [2, 3, 4]


# ====================================================================== hybrid (RRF)
class Fixed:
    """A test selector ranking the events in a fixed order of ids."""

    def __init__(self, name, order):
        self.name, self.order = name, order

    def rank(self, question, events, k=None, budget=None, *, context=None):
        ids = {e.id for e in events}
        return [Ranked(i, 0.0) for i in self.order if i in ids][:k]


def test_rrf_equals_the_hand_computation():
    cands = [Candidate(f"e{i}", f"t{i}", 3) for i in range(4)]
    a, b = Fixed("a", ["e2", "e0", "e1", "e3"]), Fixed("b", ["e1", "e2"])  # b ranks two events only
    hyb = HybridSelector([a, b])
    want = {
        "e0": 1 / (60 + 2),
        "e1": 1 / (60 + 3) + 1 / (60 + 1),
        "e2": 1 / (60 + 1) + 1 / (60 + 2),
        "e3": 1 / (60 + 4),
    }
    got = hyb.rank("q", cands)
    assert [r.id for r in got] == ["e2", "e1", "e0", "e3"]
    assert {r.id: r.score for r in got} == pytest.approx(want, abs=1e-12)
    assert K_RRF == 60 and hyb.rank("q", cands, k=2) == got[:2]
    assert hyb.rank("q", cands, budget=7) == got[:2]  # 3 + 3 rows fit, not 9


def test_rrf_ties_go_by_history_order():
    cands = [Candidate(f"e{i}", f"t{i}", 1) for i in range(3)]
    got = HybridSelector([Fixed("a", ["e2", "e0", "e1"]), Fixed("b", ["e0", "e2", "e1"])]).rank("q", cands)
    assert [r.id for r in got] == ["e0", "e2", "e1"]  # e0 and e2 tie (1/61 + 1/62)


def test_rrf_of_bm25_and_attention_by_name():
    lm, ekv, cands, ctx = setup("qwen2")
    ranks = [BM25Selector().rank(QUESTION, cands, context=ctx), AttentionSelector().rank(QUESTION, cands, context=ctx)]
    want = collections.Counter()
    for r in ranks:
        for i, x in enumerate(r, start=1):
            want[x.id] += 1 / (60 + i)
    got = HybridSelector(["bm25", "attention"]).rank(QUESTION, cands, context=ctx)
    assert {r.id: r.score for r in got} == pytest.approx(dict(want), abs=1e-12)
    assert [r.score for r in got] == sorted(want.values(), reverse=True)


def test_hybrid_errors():
    for bad in ([], "bm25"):
        with pytest.raises(OptionError, match="^selectors "):
            HybridSelector(bad)
    with pytest.raises(OptionError, match="^k_rrf 0: give a number > 0"):
        HybridSelector(k_rrf=0)
    with pytest.raises(OptionError, match="^selector 'nope'"):
        HybridSelector(["nope"]).rank("q", [Candidate("e0", "t", 1)])


# ====================================================================== a real model
DIARY = [
    "Dana adopted a grey cat named Pepper from the shelter on Monday.",
    "Ravi flew to Oslo for a conference about databases.",
    "Mei baked sourdough bread and burnt the second loaf.",
    "Tomas repaired the bicycle's rear brake with a new cable.",
    "Aiko started learning the cello with a teacher in Kyoto.",
    "Lena painted the kitchen walls a pale yellow.",
]


@pytest.mark.slow
@pytest.mark.integration
def test_attention_on_smollm2_ranks_the_events_it_does():
    from eventkv.models import load

    # float32 whatever the CPU: `auto` is bfloat16 on a CPU with AVX512-BF16, where the ranking moves
    lm = load("smollm2-135m", dtype="float32")
    events = [Event(f"e{i}", t) for i, t in enumerate(DIARY)]
    log = tokenize(EventLog(events), lm.tokenizer, lm.profile)
    ekv = prefill(lm.model, log)
    cands = [Candidate(e.id, e.text, log.span(e.id).n_tokens) for e in events]
    ctx = SelectionContext(lm=lm, rows=lambda: ekv, history_end=log.history_end)
    got = {
        q: [r.id for r in AttentionSelector().rank(q, cands, k=3, context=ctx)]
        for q in ("What is the name of Dana's cat?", "Where did Ravi fly to?", "Which instrument is Aiko learning?")
    }
    # what it does (float32, CPU, the default: layer 18 of 30, max pooling): Dana's and Ravi's events
    # first; Aiko's event (e4) only second, after the first event of the history (e0)
    assert [ids[0] for ids in got.values()] == ["e0", "e1", "e0"]
    assert got["Which instrument is Aiko learning?"][1] == "e4"
