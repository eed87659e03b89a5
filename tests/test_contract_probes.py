"""The memory-contract probes (trigger-bank, landing, access, carriers, patch) and their engine,
on tiny random models and hand-made records. The registry test in test_probes.py runs each probe
end to end on tiny Llama and Gemma 3 models."""

import math

import pytest
import torch
from probe_fixtures import tiny_runtime
from scipy import stats as st

from eventkv.errors import EventKVError
from eventkv.kv.serve import serve
from eventkv.probes.base import Summary
from eventkv.stats import format_p, mean_effect, tost, wilson
from eventkv.studies.materialization.access import Access, last_number, summarize_access
from eventkv.studies.materialization.carriers import ANSWER_FREE, KINDS, Carriers, is_answer_free
from eventkv.studies.materialization.contract_rows import ContractRow, d_tests, d_value, proportion
from eventkv.studies.materialization.landing import Landing, factorial_effects
from eventkv.studies.materialization.pairs import PrefillCache, event_id, serve_mixed, tokenize_pair
from eventkv.studies.materialization.patch import Patch, leak_rate
from eventkv.studies.materialization.trigger_bank import (
    CONSTRUCTIONS,
    TriggerBank,
    carrier_text,
    summarize_trigger_bank,
)


# ---------------------------------------------------------------- carriers: answer-free, donor-identical
def test_every_answer_free_carrier_arm_is_answer_free_and_byte_identical():
    probe = Carriers()
    for item in probe.items(0, range(30)):
        for arm in probe.pair_arms():
            h = item["histories"][arm.history]
            roles = item["roles"][arm.history]
            if arm.served == "all":
                continue
            for role in arm.served:
                a, b = h[0][roles[role]], h[1][roles[role]]
                if role == "carrier" and arm.history == "explicit":
                    assert a != b and not is_answer_free(a)  # the upper bound names the value
                else:  # every other served event is byte-identical; carriers and the shared row name no value
                    assert a == b, (arm.name, role)
                    if role != "decoy":
                        assert is_answer_free(a), (arm.name, role, a)
        # the source is the only other difference between the variants (and the explicit carrier)
        for kind, (A, B) in item["histories"].items():
            diff = [i for i in range(len(A)) if A[i] != B[i]]
            assert diff == ([item["source_slot"], 13] if kind == "explicit" else [item["source_slot"]])


def test_answer_free_check_and_unknown_kind():
    assert is_answer_free("register X keeps the state it was set to at step 9")
    assert not is_answer_free("register X is online")
    assert set(ANSWER_FREE) | {"explicit"} == set(KINDS)
    with pytest.raises(EventKVError, match="kinds"):
        Carriers(kinds=("passive", "magic"))


# ---------------------------------------------------------------- trigger bank: layout and padding
def test_trigger_bank_items_cover_the_16_constructions_with_dropped_operand_and_verdict():
    probe = TriggerBank()
    items = probe.items(3, range(32))
    assert [(it["family"], it["construction"]) for it in items[:16]] == list(CONSTRUCTIONS)
    assert sum(it["family"] == "mirror" for it in items) == 16
    for it in items:
        A, B = it["histories"]["main"]
        s = it["source_slot"]
        diff = [i for i in range(24) if A[i] != B[i]]
        if it["family"] == "flag":
            assert diff == [s, s + 1]  # operand and verdict differ, both dropped
            assert "measured" in A[s] and "threshold" in A[s] and f": {it['values'][0]}\n" in A[s + 1]
            assert sorted(it["values"]) == ["EXCEEDED", "NORMAL"]
        else:
            assert diff == [s]
        assert "carrier" in it["roles"]["main"] and A[13] == B[13]
        assert all(v not in A[13] for v in ("ONLINE", "OFFLINE", "EXCEEDED", "NORMAL"))


def test_trigger_bank_padding_gives_every_construction_the_same_positions():
    rt = tiny_runtime("llama")
    probe = TriggerBank()
    item = probe.items(0, [0])[0]
    n = item["names"]
    ends, carrier_pos = set(), set()
    for fam, phrase in CONSTRUCTIONS:  # the same skeleton with each construction's texts in the padded slots
        texts = [list(v) for v in item["histories"]["main"]]
        s = item["source_slot"]
        for v in (0, 1):
            texts[v][13] = (
                f"<step 14>\naction: reg_op()\nobservation: {carrier_text(fam, phrase, n['target'], n['source'])}\n"
            )
            if fam == "flag":
                texts[v][s] = item["pad"]["main"][str(s)][2 + v]
                texts[v][s + 1] = item["pad"]["main"][str(s + 1)][2 + v]
                texts[v][0] = item["pad"]["main"]["0"][1]
        logs = tokenize_pair(rt, probe.instruction, texts, item["pad"]["main"])
        ends.add(logs[0].history_end)
        ends.add(logs[1].history_end)
        carrier_pos.add(logs[0].span(event_id(13)).pos_start)
    assert len(ends) == 1 and len(carrier_pos) == 1


def _tb_record(i, phrase, kv, text):
    return {
        "index": i,
        "construction": phrase,
        "outcomes": {"kv": {"logits": kv}, "text": {"logits": text}},
        "d": {"kv": 0.5 if kv == "follow" else -0.5},
    }


def test_trigger_bank_summary_exact_counts_and_scipy_p_values():
    phrase = CONSTRUCTIONS[0][1]
    kv = ["follow"] * 3 + ["anti"] + ["constant"] * 6
    text = ["follow"] * 9 + ["other"]
    recs = [_tb_record(i, phrase, k, t) for i, (k, t) in enumerate(zip(kv, text))]
    s = summarize_trigger_bank(recs, ("logits",), ("kv", "text"))
    row = s.data["constructions"][phrase]["logits"]
    assert row["write_through"]["k"] == 3 and row["comprehension"]["k"] == 9 and row["n"] == 10
    assert row["p_sign"] == pytest.approx(st.binomtest(3, 4).pvalue)
    # McNemar: text follows but kv does not in 6 pairs (3..8), kv but not text in 0
    assert (row["text_only"], row["kv_only"]) == (6, 0)
    assert row["p_dissociation"] == pytest.approx(st.binomtest(6, 6).pvalue)
    assert row["write_through"]["low"] == pytest.approx(st.binomtest(3, 10).proportion_ci(method="wilson").low)


def test_graded_donor_shift_d_counts_and_scipy_p_values():
    from eventkv.studies.materialization.pairs import PairArm, d_stats, d_table

    d = [0.5, 0.25, 0.125, -0.0625, 0.0, 0.75, 0.3, -0.2, 0.0, 0.4]
    recs = [{"d": {"kv": x}} for x in d] + [{"d": {}}]  # a record without the arm is skipped
    s = d_stats(recs, "kv")
    assert (s["n"], s["pos"], s["neg"], s["zero"]) == (10, 6, 2, 2)
    assert s["median"] == pytest.approx(0.1875)  # (0.125 + 0.25) / 2
    assert s["sign_p"] == pytest.approx(st.binomtest(6, 8).pvalue)
    nz = [x for x in d if x != 0]
    assert s["wilcoxon_p"] == pytest.approx(st.wilcoxon(nz).pvalue)
    data: dict = {}
    t = d_table(recs, [PairArm("kv", "main", ("decoy",)), PairArm("gen-only", "main", ("decoy",))], "caption", data)
    assert set(data) == {"d/kv"} and len(t.rows) == 1 and t.rows[0][3:6] == ["6", "2", "2"]
    assert d_stats([{"d": {}}], "kv") is None and d_table([{"d": {}}], [PairArm("kv", "main", ("decoy",))], "c") is None


# ---------------------------------------------------------------- landing: TOST and the factorial
def test_tost_matches_two_scipy_one_sided_t_tests():
    x = [0.01, -0.02, 0.03, 0.0, 0.05, -0.04, 0.02, 0.01]
    t = tost(x, 0.075)
    lo = st.ttest_1samp(x, -0.075, alternative="greater").pvalue
    hi = st.ttest_1samp(x, 0.075, alternative="less").pvalue
    assert t.p_lower == pytest.approx(lo) and t.p_upper == pytest.approx(hi) and t.p == pytest.approx(max(lo, hi))
    assert t.p < 0.05
    assert tost([0.3, 0.4, 0.2, 0.5], 0.075).p > 0.5  # far outside the band: not equivalent
    m = mean_effect(x)
    assert m.p_zero == pytest.approx(st.ttest_1samp(x, 0).pvalue)
    assert tost([0.0, 0.0, 0.0], 0.075).p == 0.0 and math.isnan(tost([0.1], 0.075).p)
    with pytest.raises(ValueError):
        tost(x, 0)


def test_factorial_effects_by_hand():
    def out(ans):
        return {"answer": ans}

    # root rows decide (root effect 1), the mention's rows do not (mention effect 0)
    r = {
        "values": ["ONLINE", "OFFLINE"],
        "arms": {
            "root+mention": {"A": out("ONLINE"), "B": out("OFFLINE")},
            "factorial": {"A": out("ONLINE"), "B": out("OFFLINE")},
        },
    }
    assert factorial_effects([r], "generate") == ([1.0], [0.0])
    # the mention decides
    r["arms"]["factorial"] = {"A": out("OFFLINE"), "B": out("ONLINE")}
    assert factorial_effects([r], "generate") == ([0.0], [1.0])


def test_serve_mixed_takes_swapped_rows_from_the_other_variant():
    rt = tiny_runtime("qwen2")
    probe = Landing(**Landing.smoke_options)
    item = probe.items(0, [1])[0]
    logs = tokenize_pair(rt, probe.instruction, item["histories"]["main"])
    cache = PrefillCache(rt, probe.instruction)
    A, B = [cache.prefill(log) for log in logs]
    ids = [event_id(item["roles"]["main"][r]) for r in ("decoy", "root", "mention")]
    plain = serve(A, ids, "compact")
    same = serve_mixed(A, B, ids, [])
    assert all(torch.equal(x, y) for x, y in zip(plain.keys, same.keys)) and torch.equal(
        plain.positions, same.positions
    )
    mixed = serve_mixed(A, B, ids, [ids[2]])
    m = B.log.span(ids[2])
    assert torch.equal(mixed.keys[0][:, :, -m.n_tokens :], B.keys[0][:, :, m.row_start : m.row_end])
    assert torch.equal(mixed.positions, plain.positions)
    # shared-prefix prefill equals a fresh one
    fresh = rt.prefill(logs[1])
    assert torch.allclose(fresh.keys[-1], B.keys[-1], atol=1e-5)


# ---------------------------------------------------------------- access: payloads and recovery counts
def test_access_items_and_menus():
    probe = Access()
    items = probe.items(0, range(8))
    assert [it["cardinality"] for it in items] == ["binary", "compass", "phonetic", "number"] * 2
    for it in items:
        q = it["questions"]["main"]
        if it["cardinality"] == "number":
            a, b = it["values"]
            assert len(a) == len(b) == 3 and a[0] != b[0] and it["gold_candidates"] == [a[0], b[0]]
        else:
            assert all(c in q for c in it["candidates"])  # the menu is enumerated in the question
            assert it["decoy_value"] in it["candidates"]
        A, B = it["histories"]["main"]
        assert [i for i in range(24) if A[i] != B[i]] == [it["source_slot"]]
    assert last_number("it is 482, not 4821 or 12") == "482" and last_number("none") is None


def test_access_recovery_counts_and_binomial_against_chance():
    def rec(card, ok_a, ok_b):
        vals = ["NORTH", "EAST"] if card == "compass" else ["ONLINE", "OFFLINE"]
        wrong = "WEST" if card == "compass" else "X"
        arms = {
            arm: {"A": {"choice": vals[0] if ok_a else wrong}, "B": {"choice": vals[1] if ok_b else wrong}}
            for arm in ("kv", "text")
        }
        return {
            "cardinality": card,
            "values": vals,
            "arms": arms,
            "outcomes": {"kv": {"logits": "other"}, "text": {"logits": "other"}},
        }

    recs = [rec("compass", True, True)] * 3 + [rec("compass", True, False)] * 2 + [rec("compass", False, False)] * 5
    s = summarize_access(recs, Access(readout="logits"))
    r = s.data["recovery"]["compass/kv/logits"]
    assert (r["rate"]["k"], r["rate"]["n"]) == (8, 20)
    assert r["p"] == pytest.approx(st.binomtest(8, 20, 0.25, alternative="greater").pvalue)


# ---------------------------------------------------------------- patch: layout and leak
def test_patch_items_and_leak_counts():
    probe = Patch(lengths=(8, 12))
    items = probe.items(0, range(4))
    assert [it["n_events"] for it in items] == [8, 12, 8, 12]
    for it in items:
        P, R = it["histories"]["patched"], it["histories"]["rewritten"]
        assert len(P[0]) == it["n_events"] + 1 and len(R[0]) == it["n_events"]
        assert it["values"] == it["old_values"][::-1]
        assert P[0][-1].endswith(f"now set to state {it['values'][0]}\n")
    recs = [
        {"old_values": ["ONLINE", "OFFLINE"], "arms": {"x": {"A": {"answer": a}, "B": {"answer": b}}}}
        for a, b in (("ONLINE", "OFFLINE"), ("ONLINE", "ONLINE"), ("OFFLINE", "ONLINE"))
    ]
    w = leak_rate(recs, "x", "generate")
    assert (w.k, w.n) == (3, 6)


def test_option_errors_name_the_value():
    with pytest.raises(EventKVError, match="carrier_slot 30: outside the history"):
        TriggerBank(carrier_slot=30)
    with pytest.raises(EventKVError, match="tost_margin 0"):
        Landing(tost_margin=0)
    with pytest.raises(EventKVError, match="cardinalities"):
        Access(cardinalities=("binary", "hex"))
    with pytest.raises(EventKVError, match="lengths"):
        Patch(lengths=(2,))


# ---------------------------------------------------------------- contract sections: each probe writes its own
def test_contract_cell_formatters():
    w = wilson(3, 10)
    assert proportion(w.__dict__) == f"0.300 [{w.low:.3f}, {w.high:.3f}] (3/10)" == "0.300 [0.108, 0.603] (3/10)"
    assert proportion(None) == proportion(wilson(0, 0).__dict__) == "n/a"
    d = {"pos": 2, "neg": 1, "median": 0.125, "n": 4, "sign_p": 1.0, "wilcoxon_p": 0.5}
    assert d_value(d) == "d>0:d<0 = 2:1, median +0.125 nats" and d_value(None) == "n/a (no candidate readout)"
    assert d_tests(d) == f"sign p = {format_p(1.0)}, Wilcoxon p = {format_p(0.5)} (4 pairs)" and d_tests(None) == "n/a"


def test_trigger_bank_contract_section_from_its_summary():
    phrase = CONSTRUCTIONS[0][1]
    kv = ["follow"] * 3 + ["anti"] + ["constant"] * 6
    text = ["follow"] * 9 + ["other"]
    recs = [_tb_record(i, phrase, k, t) for i, (k, t) in enumerate(zip(kv, text))]
    sec = TriggerBank.contract_section(summarize_trigger_bank(recs, ("logits",), ("kv", "text")))
    assert sec.key == "trigger" and sec.figure[0] == "trigger.png"
    assert all(isinstance(r, ContractRow) and r.clause == "trigger" for r in sec.rows)
    by_measure = {r.measure: r for r in sec.rows}
    assert by_measure["comprehension over 1 constructions (logits)"].measured == "mean 0.900"
    assert by_measure["write-through over 1 constructions (logits)"].measured == "0.300 to 0.300"
    # 3:1 is no evidence of writing (p = .625); 6:0 discordant pairs dissociate (McNemar p = .031)
    assert by_measure["constructions that write (follow > anti, sign test p < .05)"][2:4] == ("0/1", "none")
    assert by_measure["dissociation: comprehended but not written (McNemar p < .05)"].measured == "1/1"
    c = sec.data["constructions"][phrase]
    assert c["writes"] is False and c["p_sign"] == pytest.approx(st.binomtest(3, 4).pvalue)
    assert sec.data["d_pooled"]["n"] == 10 and c["median_d"] == -0.5 and not c["writes_graded"]


def test_access_contract_section_from_its_summary():
    def rec(ok_a, ok_b):
        arms = {
            arm: {"A": {"choice": "NORTH" if ok_a else "WEST"}, "B": {"choice": "EAST" if ok_b else "WEST"}}
            for arm in ("kv", "text")
        }
        out = {"kv": {"logits": "other"}, "text": {"logits": "other"}}
        return {"cardinality": "compass", "values": ["NORTH", "EAST"], "arms": arms, "outcomes": out}

    recs = [rec(True, True)] * 8 + [rec(False, False)] * 2  # 16/20 answers recovered
    sec = Access.contract_section(summarize_access(recs, Access(readout="logits")))
    p = st.binomtest(16, 20, 0.25, alternative="greater").pvalue
    assert sec.key == "capacity" and sec.figure[0] == "access.png" and len(sec.rows) == 1
    assert sec.rows[0][:3] == ("access", "compass: kv recovery per answer (exact, logits)", "0.800")
    assert sec.data["payloads"]["compass"]["p_above_chance"] == pytest.approx(p) and p < 0.05
    assert sec.data["largest_payload_above_chance"] == "compass"


def test_patch_contract_section_reads_leak_and_the_longest_timing():
    data = {
        "primary": "logits",
        "leak": {"patch-served/logits": wilson(0, 8).__dict__, "patch-not-served/logits": wilson(6, 8).__dict__},
        "timing": {
            "16": {"L_tokens": 300.0, "patch_ms": 5.0, "rewrite_ms": 40.0},
            "64": {"L_tokens": 1200.4, "patch_ms": 9.6, "rewrite_ms": 310.2},
            "slope/patch_ms": 0.4,
            "slope/rewrite_ms": 1.5,
        },
    }
    sec = Patch.contract_section(Summary("patch", [], data=data))
    assert [r[2] for r in sec.rows] == ["0/8", "6/8", "10 ms vs 310 ms"]
    assert sec.rows[2].measure == "update time at L = 1200 tokens: patch vs re-prefill"
    assert sec.rows[2].test == "log-log slopes: patch 0.40, re-prefill 1.50"
    assert sec.key == "updates" and sec.data == {"readout": "logits", "leak": data["leak"], "timing": data["timing"]}


def test_trigger_bank_carrier_after_the_source_block():
    """The trigger bank's source takes two slots (the source and the event after it): a carrier in
    the slot right after the last source slot collides with that second event."""
    with pytest.raises(EventKVError, match=r"carrier_slot 12: the carrier must come after the source block"):
        TriggerBank(source_slots=(8, 11), carrier_slot=12)
    assert TriggerBank(source_slots=(8, 11), carrier_slot=13).carrier_slot == 13
