"""Probe framework, registry and the donor-pair probe on tiny random models (seconds each)."""

import dataclasses
import json
import math

import pytest
import torch
from probe_fixtures import tiny_runtime

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.log import TokenizedLog, tokenize_query
from eventkv.kv.readout import candidate_logprobs, generate, read_out
from eventkv.kv.serve import serve
from eventkv.probes import get_probe, load_probes
from eventkv.studies.materialization.donor_pair import DonorPair, last_state, summarize_donor_pairs
from eventkv.studies.materialization.pairs import (
    PairLayout,
    PairProbe,
    PrefillCache,
    donor_d,
    log_odds,
    outcome,
    tokenize_pair,
)
from eventkv.testing import assert_same_greedy


# ---------------------------------------------------------------- registry: every probe, tiny models
@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("name", sorted(load_probes()))
def test_every_registered_probe_runs_on_a_tiny_model(name, family):
    cls = get_probe(name)
    probe = cls(**cls.smoke_options)
    rt = tiny_runtime(family)
    items = probe.items(0, [0, 1])
    records = [json.loads(json.dumps(probe.run_item(rt, it))) for it in items]
    assert [r["index"] for r in records] == [0, 1]
    summary = probe.summarize(records)
    md = summary.to_markdown()
    assert md.startswith(f"# {name}")
    assert summary.tables and all(len(row) == len(t.columns) for t in summary.tables for row in t.rows)
    # deterministic: the same item gives the same record
    assert json.dumps(probe.run_item(rt, items[0])) == json.dumps(records[0])


def test_unknown_probe_is_a_user_error():
    with pytest.raises(EventKVError, match="donor-pair"):
        get_probe("donor-pairs")


# ---------------------------------------------------------------- batched readouts == one at a time
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_batched_readout_equals_single_readouts(family):
    rt = tiny_runtime(family)
    probe = DonorPair()
    item = probe.items(3, [0])[0]
    toks = [rt.encode(t) for t in item["events"][0]]
    log = TokenizedLog(rt.header_ids(probe.instruction), [probe.event_id(i) for i in range(24)], toks)
    ekv = rt.prefill(log)
    served = [
        serve(ekv, ["e00", "e13"], "compact"),
        serve(ekv, ["e05", "e13", "e20"], "native"),
        serve(ekv, "all", "compact"),
        serve(ekv, ["e00", "e13"], "isolated", model=rt.model),
    ]
    query = tokenize_query(rt.tokenizer, rt.profile, item["question"])
    cands = [rt.encode(" ONLINE"), rt.encode(" OFFLINE"), rt.encode(" X")]
    prefix = rt.encode("Answer:")
    batched = read_out(
        rt.model,
        served,
        query,
        generate=[True] * 4,
        score=[True] * 4,
        candidates=cands,
        candidate_texts=["ONLINE", "OFFLINE", "X"],
        answer_prefix_ids=prefix,
        max_new_tokens=12,
        stop_token_ids=rt.stop_token_ids + [rt.encode("[")[0]],
        keep_logits=True,
    )
    for s, b in zip(served, batched):
        g = generate(
            rt.model,
            s,
            query,
            max_new_tokens=12,
            stop_token_ids=rt.stop_token_ids + [rt.encode("[")[0]],
            keep_logits=True,
        )
        assert_same_greedy(b.generation.tokens, b.generation.logits, g.tokens, g.logits, tol=1e-4)
        assert b.generation.stopped == g.stopped
        single = candidate_logprobs(rt.model, s, query + prefix, cands)
        for x, y in zip(b.candidates, single):
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert x.prob == pytest.approx(y.prob, abs=1e-5)


# ---------------------------------------------------------------- donor-pair layout (Study 1 defaults)
def test_donor_pair_items_follow_the_study_layout():
    probe = DonorPair()
    items = probe.items(7, range(40))
    assert items == probe.items(7, range(40))  # same seed, same items
    assert items[5] == probe.items(7, [5])[0]  # item i depends on (seed, i) only
    assert items != probe.items(8, range(40))
    for it in items:
        a, b = it["events"]
        assert len(a) == len(b) == 24
        regs = it["registers"]
        m = it["source_slot"]
        assert 8 <= m <= 11
        assert sorted(it["values"]) == ["OFFLINE", "ONLINE"]
        source_line = f"observation: register {regs['source']} set to state {it['values'][0]}\n"
        assert a[m] == f"<step {m + 1}>\naction: reg_op()\n" + source_line
        assert b[m].endswith(f"set to state {it['values'][1]}\n")
        assert a[13].endswith(f"register {regs['root']} mirrors register {regs['source']}\n")
        assert a[0] == b[0] and a[0].endswith(f"register {regs['decoy']} set to state {it['decoy_values'][0]}\n")
        diff = [i for i in range(24) if a[i] != b[i]]
        assert diff == [m]  # the pair differs in the source only
        for i in set(range(24)) - {0, m, 13}:
            assert "refreshed to" in a[i]
    # independent decoy: the decoy value equals the first variant's value about half the time
    eq = sum(it["decoy_values"][0] == it["values"][0] for it in items)
    assert 0 < eq < 40
    assert {it["source_slot"] for it in items} == {8, 9, 10, 11}


def test_donor_pair_decoy_variants():
    opp = DonorPair(decoy="opposite").items(1, range(10))
    assert all(it["decoy_values"] == it["values"][::-1] for it in opp)
    none = DonorPair(decoy="none").items(1, range(10))
    assert all("self-test" in it["events"][0][0] and "state" not in it["events"][0][0] for it in none)


def test_donor_pair_positions_and_served_rows_on_tiny_model():
    rt = tiny_runtime("qwen2")
    probe = DonorPair(max_new_tokens=4, states=("ONLINE", "OFFLINE", "STANDBY"))
    rec = probe.run_item(rt, probe.items(0, [2])[0])
    m = rec["source_slot"]
    toks = [[rt.encode(t) for t in rec["events"][v]] for v in "AB"]
    budget = max(len(toks[0][m]), len(toks[1][m]))
    assert rec["budgets"] == {f"e{m:02d}": budget}
    logs = [
        TokenizedLog(
            rt.header_ids(probe.instruction),
            [f"e{i:02d}" for i in range(24)],
            t,
            [budget if i == m else None for i in range(24)],
        )
        for t in toks
    ]
    assert logs[0].history_end == logs[1].history_end == rec["history_end"]
    for i in range(m + 1, 24):  # every later event at the same positions
        assert logs[0].span(f"e{i:02d}").pos_start == logs[1].span(f"e{i:02d}").pos_start
    assert rec["served_positions"]["e13"][0] == logs[0].span("e13").pos_start
    assert rec["served"]["kv"]["events"] == ["e00", "e13"]
    assert rec["served_identical"] is True
    # the isolated arm is one cache for both variants: identical scores, d exactly 0
    assert rec["arms"]["isolated"]["A"] == rec["arms"]["isolated"]["B"]
    assert rec["d"]["isolated"] == 0.0
    # kv-all is the same computation as text-all: bitwise the same rows and positions
    assert rec["kv_all_vs_text_all"] == {"rows_and_positions_equal": True}
    # the donor reaches the served root's rows: kv scores differ between the variants
    assert rec["arms"]["kv"]["A"]["logprobs"] != rec["arms"]["kv"]["B"]["logprobs"]


def test_donor_pair_asks_after_the_served_events_where_the_study_does():
    rt = tiny_runtime("qwen2")
    item = DonorPair().items(0, [2])[0]
    at_end = DonorPair(max_new_tokens=2, query_at="history").run_item(rt, item)
    after = DonorPair(max_new_tokens=2).run_item(rt, item)  # the default: right after the served events
    root = after["served_positions"]["e13"]  # [first position, width] of the root, the last served event
    assert after["query_position"]["kv"] == after["query_position"]["isolated"] == root[0] + root[1]
    assert at_end["query_position"]["kv"] == at_end["query_position"]["isolated"] == at_end["history_end"]
    assert at_end["history_end"] > after["query_position"]["kv"]
    assert after["query_position"]["text-all"] == at_end["history_end"]
    assert after["arms"]["kv"]["A"]["logprobs"] != at_end["arms"]["kv"]["A"]["logprobs"]  # the readout moved
    assert after["arms"]["text-all"] == at_end["arms"]["text-all"]  # the whole history: the same question
    assert DonorPair().options()["query_at"] == "last-served"
    notes = DonorPair().summarize([after]).notes + DonorPair(query_at="history").summarize([at_end]).notes
    assert sum("asked right after the last served token" in n for n in notes) == 1
    assert sum("asked after the whole history (query_at history" in n for n in notes) == 1
    assert DonorPair.record_version == 6  # version 3 asked after the whole history: its folders do not resume
    with pytest.raises(EventKVError, match="query_at 'end'"):
        DonorPair(query_at="end")


def test_donor_pair_option_errors_name_the_value():
    with pytest.raises(EventKVError, match="root_slot 5"):
        DonorPair(root_slot=5)
    with pytest.raises(EventKVError, match="decoy 'opposit'"):
        DonorPair(decoy="opposit")
    with pytest.raises(EventKVError, match="states ONLINE"):
        DonorPair(states=("ONLINE",))
    with pytest.raises(EventKVError, match="source_slots 8,30"):
        DonorPair(source_slots=(8, 30), root_slot=13)


# ---------------------------------------------------------------- the pair probes' layout base
def test_donor_pair_options_keep_their_keys_and_order():
    # the options dictionary is what a run folder's manifest stores and compares on resume
    probe = DonorPair(source_slots=[7, 9], states=["UP", "DOWN"], arm_names=["kv", "text-all"])
    assert (probe.source_slots, probe.states, probe.arm_names) == ((7, 9), ("UP", "DOWN"), ("kv", "text-all"))
    assert list(probe.options()) == [
        "n_events",
        "decoy_slot",
        "source_slots",
        "root_slot",
        "decoy",
        "states",
        "registers",
        "readout",
        "max_new_tokens",
        "arm_names",
        "instruction",
        "question",
        "answer_prefix",
        "query_at",
    ]
    assert DonorPair(**json.loads(json.dumps(probe.options()))) == probe


@pytest.mark.parametrize("name", sorted(load_probes()))
def test_pair_layout_fields_lead_every_probe_that_has_them(name):
    # adopting PairLayout must leave the options dictionary's keys and their order as they are
    cls = get_probe(name)
    if issubclass(cls, PairLayout):
        assert list(cls().options())[:3] == ["n_events", "decoy_slot", "source_slots"]


@dataclasses.dataclass
class _Chain(PairLayout, PairProbe):
    """A layout with two later slots, as the contract probes declare theirs."""

    root_slot: int = 13
    edge_slot: int = 16

    def validate(self) -> None:
        self.check_layout(("root", self.root_slot), ("edge", self.edge_slot))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"edge_slot": 13}, "edge_slot 13: the edge must come after the root (slot 13): move it later."),
        ({"root_slot": 11}, "root_slot 11: the root must come after every source slot (last 11): move it later."),
        ({"decoy_slot": 8}, "decoy_slot 8: the decoy must come before the source slots 8-11: move it earlier."),
        ({"edge_slot": 24}, "edge_slot 24: outside the history's slots 0..23: choose slots below n_events=24."),
        ({"source_slots": (11, 8)}, "source_slots 11,8: the first slot must not exceed the last"),
        ({"n_events": 3}, "n_events 3: a donor pair needs at least 4 events (decoy, source, root, edge)."),
        ({"decoy_slot": -1}, "decoy_slot -1: give a 0-based slot"),
    ],
)
def test_pair_layout_check_names_the_field(options, message):
    with pytest.raises(OptionError) as e:
        _Chain(**options)
    assert str(e.value).startswith(message)


def test_pair_layout_normalizes_tuples_and_accepts_the_study_layout():
    layout = _Chain(source_slots=[2, 3], root_slot=5, edge_slot=7, n_events=8)
    assert layout.source_slots == (2, 3) and layout.options()["source_slots"] == [2, 3]
    # the donor-pair probe's decoy may follow the root, but never sit on a source slot or the root
    assert DonorPair(decoy_slot=20).decoy_slot == 20
    with pytest.raises(OptionError, match="decoy_slot 13: collides with the source slots 8-11 or the root 13"):
        DonorPair(decoy_slot=13)


# ---------------------------------------------------------------- the pair engine under the donor-pair probe
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_shared_prefix_prefill_matches_continuing_variant_a(family):
    rt = tiny_runtime(family)
    probe = DonorPair()
    item = probe.items(4, [0])[0]
    logs = tokenize_pair(rt, probe.instruction, item["events"])
    shared = PrefillCache(rt, probe.instruction)
    shared.prefill_shared(logs)
    a, b = (shared.prefill(log) for log in logs)
    plain = PrefillCache(rt, probe.instruction)
    a0, b0 = (plain.prefill(log) for log in logs)
    r = logs[0].span(f"e{item['source_slot']:02d}").row_start  # rows of the events both variants begin with
    for x, y, x0, y0 in zip(a.keys + a.values, b.keys + b.values, a0.keys + a0.values, b0.keys + b0.values):
        assert torch.equal(x[:, :, :r], y[:, :, :r])  # both variants continue the one shared prefix
        assert torch.allclose(x, x0, atol=1e-5) and torch.allclose(y, y0, atol=1e-5)


# ---------------------------------------------------------------- readout parsing and statistics
def test_last_state_and_outcome():
    states = ("ONLINE", "OFFLINE")
    assert last_state("It was ONLINE, then offline.", states) == "OFFLINE"
    assert last_state("Register M is ONLINE", states) == "ONLINE"
    assert last_state("ONLINEX NOTOFFLINE", states) is None
    assert last_state("", states) is None
    assert outcome("ONLINE", "OFFLINE", "ONLINE", "OFFLINE") == "follow"
    assert outcome("OFFLINE", "ONLINE", "ONLINE", "OFFLINE") == "anti"
    assert outcome("ONLINE", "ONLINE", "ONLINE", "OFFLINE") == "constant"
    assert outcome(None, None, "ONLINE", "OFFLINE") == "other"
    assert outcome("ONLINE", None, "ONLINE", "OFFLINE") == "other"


def test_log_odds_and_d_hand_values():
    lp_a = {"ONLINE": math.log(0.8), "OFFLINE": math.log(0.2)}
    lp_b = {"ONLINE": math.log(0.4), "OFFLINE": math.log(0.6)}
    assert log_odds(lp_a, "ONLINE") == pytest.approx(math.log(4))
    # d = lo(ON|A) - lo(ON|B) = log 4 - log(2/3); both brackets equal for two states
    assert donor_d(lp_a, lp_b, "ONLINE", "OFFLINE") == pytest.approx(math.log(4) - math.log(2 / 3))
    assert donor_d(lp_a, lp_a, "ONLINE", "OFFLINE") == 0.0


def _record(i, kv_gen, kv_logit, d, text="follow"):
    return {
        "index": i,
        "outcomes": {
            "kv": {"generate": kv_gen, "logits": kv_logit},
            "isolated": {"generate": "constant", "logits": "constant"},
            "text-all": {"generate": text, "logits": text},
        },
        "d": {"kv": d, "isolated": 0.0, "text-all": 5.0},
        "kv_all_vs_text_all": {"rows_and_positions_equal": True},
    }


def test_summary_counts_and_p_values_on_known_records():
    from scipy import stats as st

    gen = ["follow"] * 9 + ["anti"] + ["constant"] * 4 + ["other"] * 2
    logit = ["follow"] * 6 + ["anti"] * 2 + ["constant"] * 8
    ds = [1.0, 2.0, 0.5, -0.25, 3.0, 0.0, 1.5, -1.0, 0.75, 2.5, 0.1, 0.2, 0.3, 0.4, -0.6, 0.9]
    records = [_record(i, g, lo, d, "follow" if i < 12 else "anti") for i, (g, lo, d) in enumerate(zip(gen, logit, ds))]
    s = summarize_donor_pairs(records, DonorPair())
    kv = s.data["outcomes"]["kv/generate"]
    assert (kv["follow"], kv["anti"], kv["constant"], kv["other"]) == (9, 1, 4, 2)
    assert kv["p"] == pytest.approx(22 / 1024)
    assert kv["prevalence"]["k"] == 10 and kv["prevalence"]["n"] == 16
    assert s.data["outcomes"]["kv/logits"]["p"] == pytest.approx(st.binomtest(6, 8).pvalue)
    d = s.data["d"]["kv"]
    assert (d["pos"], d["neg"], d["zero"]) == (12, 3, 1)
    assert d["sign_p"] == pytest.approx(st.binomtest(12, 15).pvalue)
    assert d["wilcoxon_p"] == pytest.approx(st.wilcoxon([x for x in ds if x != 0]).pvalue)
    assert math.isnan(s.data["d"]["isolated"]["sign_p"])
    assert s.data["comprehension/generate"]["k"] == 12
    md = s.to_markdown()
    assert "follow 9, anti 1, n 10: p = 0.0215" in md
    assert "| kv | generate | 16 | 9 | 1 | 4 | 2 | 0.625 [0.386, 0.815] (10/16) | 0.0215 |" in md
    assert "bitwise equal to text-all's in 16/16 pairs" in md


def test_opposite_decoy_pairs_are_flagged_not_served_identical():
    rt = tiny_runtime("llama")
    probe = DonorPair(decoy="opposite", max_new_tokens=2)
    rec = probe.run_item(rt, probe.items(0, [0])[0])
    assert rec["served_identical"] is False
    assert set(rec["budgets"]) == {"e00", f"e{rec['source_slot']:02d}"}  # both differing slots budgeted
    assert rec["arms"]["isolated"]["A"] != rec["arms"]["isolated"]["B"]  # encoded per variant
    assert "not served-identical" in probe.summarize([rec]).to_markdown()
