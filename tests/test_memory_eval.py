"""`eventkv memory eval`: the arm grid, budgets, batched readouts grouped by length, the memories kept
under the run folder, resume, option errors, and the summary's statistics on hand-made records."""

import json
import shutil

import numpy as np
import pytest
import scipy.stats
from cli_fixtures import run_cli

from eventkv.errors import EventKVError, OptionError
from eventkv.stats import cluster_bootstrap, cluster_bootstrap_ratio, wilson
from eventkv.studies.materialization.memory_eval import (
    DEMO_DATA,
    MemoryEval,
    arm_spec,
    first_line,
    history_events,
    length_groups,
    parse_arm,
    parse_budget,
    summarize_memory_eval,
)

BASE = ["--conversations", "2", "--questions-per-conversation", "2", "--max-tokens", "600", "--budgets", "20%,50%"]
BASE += [
    "--max-new-tokens",
    "3",
    "--dtype",
    "float32",
    "--no-progress",
    "--selectors",
    "bm25",
    "--positions",
    "original",
]


def _records(out):
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def test_eval_runs_resumes_and_reports(tiny_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = ["memory", "eval", "--data", DEMO_DATA, "--model", str(tiny_dir), *BASE, "--out", str(out)]
    code, out_text, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, out_text + err
    records = _records(out)
    assert [x["index"] for x in records] == [0, 1, 2, 3]
    done = [x for x in records if "arms" in x]
    names = ["rows:bm25@20%", "text:bm25@20%", "isolated:bm25@20%", "rows:bm25@50%", "text:bm25@50%"]
    names += ["isolated:bm25@50%", "full", "gold"]
    assert done and all(list(x["arms"]) == names for x in done)
    for x in done:
        n = x["history_rows"]
        for key, sel in x["selection"].items():  # budgets never exceeded
            budget = parse_budget(key.rpartition("@")[2])
            assert sel["rows"] <= budget * n and 0 <= sel["recall"] <= 1
        for name, arm in x["arms"].items():
            a = parse_arm(name)
            if a.budget is not None:
                assert arm["rows"] <= a.budget * n
                assert arm["rows"] == x["selection"][f"bm25@{name.rpartition('@')[2]}"]["rows"]
        assert x["arms"]["full"]["rows"] == n and x["arms"]["full"]["fraction"] == 1.0
        read = {name for name, arm in x["arms"].items() if not arm.get("empty")}  # an empty served set: no readout
        assert set(x["timing"]) == {"serve", "readout", "batch"} and set(x["timing"]["serve"]) == read
        assert all(1 <= x["arms"][a]["n_tokens"] <= 3 for a in read) and {"full", "gold"} <= read
        assert all(x["arms"][a]["rows"] == 0 and x["arms"][a]["f1"] == 0.0 for a in set(x["arms"]) - read)
        # --positions original: every arm that serves rows says so (the memory's own default is contiguous); the
        # arms re-prefilled as text (text, gold) sit right after the header, and say so
        prefilled = {a for a in read if a.startswith("text:") or a == "gold"}
        assert {x["arms"][a]["positions"] for a in read - prefilled} == {"original"}
        assert {x["arms"][a]["positions"] for a in prefilled} == {"contiguous"}
    assert (out / "summary.md").read_text().startswith("# memory-eval")
    assert sorted(p.name for p in (out / "memories").iterdir()) == ["c0", "c1"]
    assert run_cli(monkeypatch, capsys, *args)[0] == 0  # resume: nothing recomputed
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["invocations"][-1]["items_computed"] == 0


def test_restart_reuses_the_prefilled_memories(tiny_dir, tmp_path, monkeypatch, capsys):
    """A run killed after its first item: restarted, it reopens the memory kept under the run folder (no
    new segment written) and its records match an uninterrupted run's."""
    out = tmp_path / "run"
    args = ["memory", "eval", "--data", DEMO_DATA, "--model", str(tiny_dir), *BASE, "--out", str(out)]
    args[args.index("--conversations") + 1] = "1"
    assert run_cli(monkeypatch, capsys, *args)[0] == 0
    whole = _records(out)
    segments = sorted((out / "memories" / "c0").rglob("*.safetensors"))
    stamps = [p.stat().st_mtime_ns for p in segments]
    lines = (out / "records.jsonl").read_text().splitlines()
    (out / "records.jsonl").write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # killed mid-write
    assert run_cli(monkeypatch, capsys, *args)[0] == 0
    again = _records(out)
    assert sorted((out / "memories" / "c0").rglob("*.safetensors")) == segments
    assert [p.stat().st_mtime_ns for p in segments] == stamps
    for a, b in zip(whole, again):
        assert {k: v for k, v in a.items() if k != "timing"} == {k: v for k, v in b.items() if k != "timing"}


def test_open_history_continues_a_memory_cut_short(tmp_path):
    """A memory holding the first session only (a kill between two sessions' commits) is completed, not
    rebuilt: its rows equal a memory built in one go (float32, within 1e-5)."""
    import torch
    from probe_fixtures import tiny_runtime

    from eventkv.models import LoadedModel
    from eventkv.models.introspect import profile_for
    from eventkv.studies.materialization.memory_eval import INSTRUCTION, open_history

    probe = MemoryEval(data=DEMO_DATA, conversations=1, max_tokens=0)
    rt = tiny_runtime("llama")
    sessions = probe._history(rt, 0).sessions
    assert len(sessions) >= 2
    lm = LoadedModel(rt.model, rt.tokenizer, profile_for(rt.model, rt.tokenizer, "tiny"))
    open_history(tmp_path / "a", lm, INSTRUCTION, sessions[:1]).close()
    cut = open_history(tmp_path / "a", lm, INSTRUCTION, sessions)
    whole = open_history(tmp_path / "b", lm, INSTRUCTION, sessions)
    assert [r.id for r in cut.list()] == [e.id for _, evs in sessions for e in evs]
    for k1, k2 in zip(cut._ekv.keys, whole._ekv.keys):
        torch.testing.assert_close(k1, k2, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--data", "/no/such.json"], "--data '/no/such.json': no such file"),
        (["--data", "demo", "--conversations", "3"], "--conversations 3: "),
        (["--data", DEMO_DATA, "--conversations", "9"], "--conversations 9:"),
        (["--data", DEMO_DATA, "--k", "0"], "--k 0:"),
        (["--data", DEMO_DATA, "--arms", "text,gold"], "--arms"),
        (["--data", DEMO_DATA, "--budgets", "5"], "--budgets '5': give each budget as a percentage"),
        (["--data", DEMO_DATA, "--budgets", "5%,5%"], "--budgets"),
        (["--data", DEMO_DATA, "--selectors", "grep"], "--selectors grep: give selectors"),
        (["--data", DEMO_DATA, "--controls", "grep"], "--controls grep: "),
        (["--data", DEMO_DATA, "--positions", "sideways"], "--positions 'sideways'"),
        (["--data", DEMO_DATA, "--order", "score"], "--order 'score': give log (the served turns in history order)"),
        (["--data", DEMO_DATA, "--max-tokens", "8"], "--max-tokens 8:"),
        (["--data", DEMO_DATA, "--max-padding", "2"], "--max-padding 2.0: give a fraction in [0, 1]."),
    ],
)
def test_eval_option_errors(extra, message, tmp_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "memory", "eval", *extra, "--out", str(tmp_path / "o"))
    assert code == 2 and message in err and "Traceback" not in out + err
    assert not (tmp_path / "o").exists()


def test_whole_history_past_the_context_is_refused_in_original_positions():
    from probe_fixtures import TinyProfile, tiny_runtime

    rt = tiny_runtime("llama")
    rt.profile = TinyProfile(max_context=300, stop_token_ids=rt.profile.stop_token_ids)
    probe = MemoryEval(data=DEMO_DATA, conversations=1, max_tokens=0, positions="original")
    with pytest.raises(OptionError) as e:
        probe.check_model(rt)
    msg = e.value.for_cli()
    assert msg.startswith("--max-tokens 0: conversation 'conv-demo-1' keeps ") or msg.startswith("--max-tokens 0:")
    assert "the model's context of 300 tokens in original positions" in msg and "--positions contiguous" in msg
    # contiguous positions (when the memory serves them) take the history, but not the full arm
    probe.positions = "contiguous"
    with pytest.raises(OptionError, match="the full arm cannot serve it"):
        probe.check_model(rt)
    probe.arm_names = ("rows", "text", "gold")
    probe.check_model(rt)


def test_arm_grid_names_and_budgets():
    from eventkv.options import SELECTORS

    default = MemoryEval(data=DEMO_DATA)  # every registered selector, the fused one as the control when registered
    assert default.selectors[0] == "bm25" and set(default.selectors) == set(SELECTORS.names())
    assert default.controls == (("hybrid",) if "hybrid" in SELECTORS.names() else ("bm25",))
    assert default.with_headers and default.resolve_dates  # the histories as the memory stores dated sessions
    probe = MemoryEval(
        data=DEMO_DATA,
        selectors=("bm25",),
        budgets=(0.05, 0.1),
        arm_names=("rows", "text", "isolated", "full", "gold"),
        positions="original",
    )
    assert probe.selectors == ("bm25",) and probe.controls == ("bm25",) and probe.k is None
    assert [a.name for a in probe.grid()] == [
        "rows:bm25@5%",
        "text:bm25@5%",
        "isolated:bm25@5%",
        "rows:bm25@10%",
        "text:bm25@10%",
        "isolated:bm25@10%",
        "full",
        "gold",
    ]
    probe.selectors, probe.controls, probe.positions = ("bm25", "dense"), ("dense",), "both"
    probe.arm_names, probe.budgets = ("rows", "text", "isolated", "blend", "full"), (0.025,)
    assert [a.name for a in probe.grid()] == [
        "rows:bm25@2.5%",
        "rows:bm25@2.5%/contiguous",
        "rows:dense@2.5%",
        "rows:dense@2.5%/contiguous",
        "text:dense@2.5%",
        "isolated:dense@2.5%",
        "isolated:dense@2.5%/contiguous",
        "blend:dense@2.5%",
        "blend:dense@2.5%/contiguous",
        "full",
    ]
    for a in probe.grid():
        assert parse_arm(a.name) == a
    assert (parse_budget("2.5%"), parse_budget("0.2"), parse_budget("100%")) == (0.025, 0.2, 1.0)
    for bad in ("0", "120%", "abc", "12"):
        with pytest.raises(OptionError, match="budgets"):
            parse_budget(bad)


def test_length_groups():
    assert length_groups([10, 12, 100, 11], 0.5) == [[0, 3, 1], [2]]
    assert length_groups([10, 12, 100, 11], 1.0) == [[0, 3, 1, 2]]
    assert length_groups([10, 10, 12], 0.0) == [[0, 1], [2]]
    assert length_groups([], 0.5) == []


def test_history_events_with_headers():
    from eventkv.options import DIALOGUE_FORMATS

    conv = DIALOGUE_FORMATS.get("locomo")(DEMO_DATA)[0]
    plain = [e for _, evs in history_events(conv, False) for e in evs]
    headed = history_events(conv, True)
    assert [e.id for e in plain] == [t.id for t in conv.turns]
    assert plain[0].text == conv.turns[0].event_text() and conv.turns[0].date_time in plain[0].text
    first = headed[0][1]
    assert first[0].id == "session-1" and first[0].tags == ("header",)
    assert first[0].text == f"[session 1 begins: {conv.turns[0].date_time}]"
    assert first[1].text == f"[session 1] {conv.turns[0].speaker}: {conv.turns[0].text}"
    assert sum(len(evs) for _, evs in headed) == len(conv.turns) + len(headed)


class _Latest:
    """A stand-in selector: the latest events first (the reverse of history order)."""

    name = "latest"

    def rank(self, question, events, k=None, budget=None, *, context=None):
        from eventkv.memory.select import Ranked, within_budget

        order = list(reversed(range(len(events))))[:k]
        if budget is not None:
            order = within_budget(order, [events[i].n_rows for i in order], budget)
        return [Ranked(events[i].id, float(i)) for i in order]


@pytest.fixture
def latest_selector():
    from eventkv.options import SELECTORS

    SELECTORS.put("latest", _Latest)
    yield "latest"
    SELECTORS._loaded.pop("latest")


def _probe(**kw):
    """A probe on the demo data, at the original positions and in history order unless ``kw`` says otherwise
    (relevance order reads the prompt as a chat message, which needs a whole profile: see its own test)."""
    opts = dict(data=DEMO_DATA, conversations=1, questions_per_conversation=8, max_tokens=600, max_new_tokens=2)
    return MemoryEval(**{**opts, "positions": "original", "order": "log", **kw})


def test_a_registered_selector_just_works(latest_selector):
    """A selector added to the registry is a valid --selectors name: its served set is the latest
    turns that fit the budget (hand rule: from the end, while the rows fit int(0.3 * history rows))."""
    from probe_fixtures import tiny_runtime

    probe = _probe(
        selectors=("bm25", "latest"), controls=("latest",), budgets=(0.3,), timing=False, with_headers=False
    )  # dated turns: the served set is the selector's alone, no session header beside it
    rt = tiny_runtime("llama")
    rec = probe.run_item(rt, probe.items(0, [0])[0])
    assert list(rec["arms"]) == ["rows:bm25@30%", "rows:latest@30%", "text:latest@30%", "isolated:latest@30%"] + [
        "full",
        "gold",
    ]
    _, mem, _ = probe._memory(rt, 0, 0)
    events = mem.list()
    limit, used, want = int(0.3 * rec["history_rows"]), 0, []
    for e in reversed(events):
        if used + e.n_rows > limit:
            break
        want.insert(0, e.id)
        used += e.n_rows
    assert rec["selection"]["latest@30%"]["ids"] == want and rec["selection"]["latest@30%"]["rows"] == used
    assert rec["arms"]["rows:latest@30%"]["rows"] == used == rec["arms"]["text:latest@30%"]["rows"]
    evidence = set(rec["evidence"])
    assert rec["selection"]["latest@30%"]["recall"] == pytest.approx(len(evidence & set(want)) / len(evidence))
    cfg = rt.model.config
    row = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    assert rec["arms"]["full"]["kv_bytes"] == rec["arms"]["full"]["n_rows"] * row


@pytest.mark.slow
def test_grouped_readouts_answer_as_one_batch():
    """Readouts split by length (max_padding 0: equal lengths only) give the same greedy answers as one
    batch of every arm (max_padding 1); forced-choice margins within 1e-3 nats (float32)."""
    from probe_fixtures import tiny_runtime

    rt = tiny_runtime("llama")
    one, split = _probe(max_padding=1.0, budgets=(0.2, 0.5)), _probe(max_padding=0.0, budgets=(0.2, 0.5))
    _, _, questions = one._memory(rt, 0, 0)
    slots = [0, next(i for i, q in enumerate(questions) if q.category == 5)]
    for slot in slots:
        a, b = (p.run_item(rt, p.items(0, [slot])[0]) for p in (one, split))
        assert max(a["timing"]["batch"].values()) == len(a["arms"]) and max(b["timing"]["batch"].values()) < len(
            b["arms"]
        )
        for name in a["arms"]:
            x, y = a["arms"][name], b["arms"][name]
            assert (x["answer"], x["n_tokens"], x["rows"]) == (y["answer"], y["n_tokens"], y["rows"])
            if "abstain_margin" in x:
                assert x["abstain_margin"] == pytest.approx(y["abstain_margin"], abs=1e-3)


def test_first_line():
    assert first_line("\n  Pepper \nthe cat") == "Pepper"
    assert first_line("   \n") == ""


def _rec(conv, cat, f1s, i, abstains=None, recall=0.5):
    arms = {}
    for a, f in f1s.items():
        rows = 100 if a == "full" else int(100 * (parse_arm(a).budget or 0.1))
        arms[a] = {"f1": f, "em": f == 1.0, "answer": "x", "n_tokens": i + 1, "n_rows": rows + 5, "rows": rows}
        arms[a].update({"fraction": rows / 100, "kv_bytes": (rows + 5) * 1024})
    for a, choice in (abstains or {}).items():
        arms[a]["abstains"] = choice
    return {
        "index": i,
        "conversation": conv,
        "category": cat,
        "history_rows": 100,
        "selection": {"bm25@10%": {"ids": [], "rows": 10, "recall": recall}},
        "arms": arms,
        "timing": {
            "serve": {a: 10.0 * (i + 1) for a in f1s},
            "readout": {a: 100.0 for a in f1s},
            "batch": {a: len(f1s) for a in f1s},
        },
    }


R, T, ISO = "rows:bm25@10%", "text:bm25@10%", "isolated:bm25@10%"


def test_summary_statistics_on_hand_made_records():
    recs = [
        _rec("c1", 4, {R: 1.0, T: 0.5, ISO: 0.0, "full": 1.0}, 0, recall=1.0),
        _rec("c1", 1, {R: 0.5, T: 0.5, ISO: 0.5, "full": 0.5}, 1, recall=0.0),
        _rec("c2", 2, {R: 0.0, T: 1.0, ISO: 0.0, "full": 1.0}, 2, recall=0.5),
        _rec(
            "c2", 5, {R: 1.0, T: 1.0, ISO: 1.0, "full": 1.0}, 3, {R: True, T: False, ISO: True, "full": True}
        ),  # adversarial: apart
        {"index": 4, "conversation": "c3", "skipped": "0 eligible questions"},
    ]
    s = summarize_memory_eval(recs).data
    assert (s["n_questions"], s["n_adversarial"], s["n_skipped"], s["n_conversations"]) == (3, 1, 1, 2)
    assert s["f1"][R]["estimate"] == pytest.approx(0.5)
    assert s["f1"][T]["estimate"] == pytest.approx(2 / 3)
    ref = cluster_bootstrap([0.5, 0.0, -1.0], ["c1", "c1", "c2"])
    paired = s["paired"][f"{R} - {T}"]
    assert paired["estimate"] == pytest.approx(-0.5 / 3)
    assert (paired["low"], paired["high"]) == (ref.low, ref.high)
    assert s["paired"][f"{R} - full"]["estimate"] == pytest.approx((0 + 0 - 1) / 3)
    assert s["latency_ms"][R]["serve_p50"] == pytest.approx(float(np.percentile([10, 20, 30, 40], 50)))
    assert s["latency_ms"][R]["readout_p95"] == pytest.approx(100.0) and s["batched_readout"]
    assert s["cost"][R] == {"rows": 10.0, "fraction": 0.1, "kv_bytes": 15 * 1024.0, "n_tokens": 2.5}
    assert s["cost"]["full"]["kv_bytes"] == 105 * 1024.0
    assert s["em"][R] == pytest.approx(1 / 3)
    # question-level Wilcoxon on rows - text: differences +0.5, 0, -1 -> scipy on the non-zero ones
    w = scipy.stats.wilcoxon([0.5, -1.0], zero_method="wilcox")
    assert paired["wilcoxon_p"] == pytest.approx(w.pvalue)
    assert (paired["better"], paired["worse"]) == (1, 1)
    # category 5 forced choice: Wilson interval of 1/1 and 0/1
    assert s["abstention"][R]["k"] == 1 and s["abstention"][T]["k"] == 0
    assert s["abstention"][R]["low"] == pytest.approx(wilson(1, 1).low)
    # recall of bm25 at 10%: (1 + 0 + 0.5) / 3, clusters c1, c1, c2
    assert s["recall"]["bm25@10%"]["estimate"] == pytest.approx(0.5)
    assert s["recall"]["bm25@10%"]["fraction"] == pytest.approx(0.1)
    # headline: rows at 10% over full = 0.5 / (2.5 / 3) = 0.6, the ratio bootstrap's interval
    h = s["headline"]
    assert (h["arm"], h["budget"]) == (R, 0.1) and h["estimate"] == pytest.approx(0.6)
    ratio = cluster_bootstrap_ratio([1.0, 0.5, 0.0], [1.0, 0.5, 1.0], ["c1", "c1", "c2"])
    assert (h["low"], h["high"]) == (ratio.low, ratio.high)
    assert s["reach_text"] == {"bm25": None}  # 0.5 < 2/3 at the only budget
    md = summarize_memory_eval(recs).to_markdown()
    assert "| best rows at 10% | rows:bm25@10% | 0.500 | 0.833 | 0.600 [" in md
    assert "| rows reach text (bm25) | at no budget |" in md


def test_rows_reach_text_at_the_smallest_budget_where_they_tie():
    r5, t5, r20, t20 = "rows:bm25@5%", "text:bm25@5%", "rows:bm25@20%", "text:bm25@20%"
    recs = [
        _rec("c1", 4, {r5: 0.0, t5: 1.0, r20: 1.0, t20: 1.0}, 0),
        _rec("c2", 4, {r5: 0.5, t5: 0.5, r20: 0.5, t20: 0.5}, 1),
    ]
    s = summarize_memory_eval(recs).data
    assert s["reach_text"] == {"bm25": 0.2}
    assert s["headline"]["arm"] == r5 and s["headline"]["budget"] == 0.05  # nearest 10%: 5% (ties: the smaller)
    assert "estimate" not in s["headline"]  # no full arm: no ratio


def _served(rec, evidence, **ids):
    """``rec`` with its evidence and the served ids of each ``bm25@<budget>`` (keyword ``b10``: ``bm25@10%``)."""
    rec["evidence"] = evidence
    rec["selection"] = {f"bm25@{k[1:]}%": {"ids": v, "rows": 10, "recall": 0.5} for k, v in ids.items()}
    return rec


def _turns(session, n):
    return [f"session-{session}"] + [f"D{session}:{j}" for j in range(1, n + 1)]


def test_precision_served_turns_and_f1_by_turns_on_hand_made_records():
    r10, c10, r20 = "rows:bm25@10%", "rows:bm25@10%/contiguous", "rows:bm25@20%"
    recs = [
        # 3 turns at 10% (two session headers not counted), 1 of them evidence; 7 turns at 20%, 2 evidence
        _served(
            _rec("c1", 4, {r10: 0.2, c10: 0.4, r20: 0.5, "gold": 1.0}, 0),
            ["D1:1", "D1:2"],
            b10=["session-1", "D1:1", "D1:3", "session-2", "D2:1"],
            b20=_turns(1, 7),
        ),
        # 1 turn at 10%, the evidence; 12 turns at 20%
        _served(
            _rec("c1", 1, {r10: 1.0, c10: 0.6, r20: 0.3, "gold": 0.5}, 1),
            ["D2:4"],
            b10=["session-2", "D2:4"],
            b20=_turns(2, 12),
        ),
        # an empty served set at 10% (no precision, no bin); 45 turns at 20%, 3 evidence
        _served(
            _rec("c2", 2, {r10: 0.0, c10: 0.0, r20: 0.9, "gold": 0.0}, 2),
            ["D3:1", "D3:2", "D3:3"],
            b10=[],
            b20=_turns(3, 45),
        ),
        # adversarial: apart from every statistic below
        _served(_rec("c2", 5, {r10: 1.0, c10: 1.0, r20: 1.0, "gold": 1.0}, 3), ["D4:1"], b10=_turns(4, 90), b20=[]),
    ]
    summary = summarize_memory_eval(recs)
    s = summary.data
    assert s["served_turns"] == {"bm25@10%": pytest.approx(4 / 3), "bm25@20%": pytest.approx(64 / 3)}
    p10, p20 = s["precision"]["bm25@10%"], s["precision"]["bm25@20%"]
    assert (p10["estimate"], p10["n_items"], p10["n_clusters"]) == (pytest.approx(2 / 3), 2, 1)
    ref = cluster_bootstrap([2 / 7, 1 / 12, 3 / 45], ["c1", "c1", "c2"])
    assert p20["estimate"] == pytest.approx((2 / 7 + 1 / 12 + 3 / 45) / 3)
    assert (p20["low"], p20["high"]) == (ref.low, ref.high)
    # pooled over the three rows arms: turns 3, 3, 1, 1 | 7 | 12 | 45; the two empty sets left out
    by = s["f1_by_turns"]
    assert by["all"] == {
        "1-5": {"f1": pytest.approx(0.55), "n": 4},
        "6-10": {"f1": pytest.approx(0.5), "n": 1},
        "11-20": {"f1": pytest.approx(0.3), "n": 1},
        "41-80": {"f1": pytest.approx(0.9), "n": 1},
    }
    assert by["positions"]["original"]["1-5"] == {"f1": pytest.approx(0.6), "n": 2}
    assert by["positions"]["contiguous"] == {"1-5": {"f1": pytest.approx(0.5), "n": 2}}
    assert by["n_empty"] == 2
    assert by["gold"] == {"f1": pytest.approx(0.5), "served_turns": pytest.approx(2.0), "n": 3}
    md = summary.to_markdown()
    # precision at 10% from one conversation's two questions: no interval, its n beside it
    assert "| bm25 | 10% | 0.500 [0.500, 0.500] | 0.667 [n/a: one conversation] (n=2) | 1.3 | 10.0% | 3 |" in md
    assert "| 1-5 | 0.550 | 4 |" in md and "| gold (evidence: 2.0 turns, mean) | 0.500 | 3 |" in md
    assert "2 served sets without a turn (empty, or session headers alone) left out" in md
    assert "| 1-5 | 0.600 (2) | 0.500 (2) |" in md and "| 41-80 | 0.900 (1) |  |" in md


def test_f1_by_turns_has_no_positions_table_with_one_mode():
    r10 = "rows:bm25@10%"
    recs = [_served(_rec("c1", 4, {r10: 0.25}, 0), ["D1:1"], b10=_turns(1, 81))]
    summary = summarize_memory_eval(recs)
    assert summary.data["f1_by_turns"]["all"] == {"81+": {"f1": 0.25, "n": 1}}
    assert summary.data["f1_by_turns"]["gold"] is None  # no gold arm: no reference row
    titles = [t.caption for t in summary.tables]
    assert any(t.startswith("F1 against the number of served turns (") for t in titles)
    assert not any("per positions mode" in t for t in titles)


def test_cluster_bootstrap_ratio_by_hand():
    # clusters A (1 over 1) and B (0 over 1): resamples AA 1, AB 0.5, BB 0 with chances 1/4, 1/2, 1/4
    r = cluster_bootstrap_ratio([1.0, 0.0], [1.0, 1.0], ["A", "B"])
    assert (r.estimate, r.low, r.high, r.n_clusters) == (0.5, 0.0, 1.0, 2)
    assert np.isnan(cluster_bootstrap_ratio([1.0], [0.0], ["A"]).estimate)


def test_probe_options_are_checked_before_the_model():
    with pytest.raises(Exception, match="questions_per_conversation 0"):
        MemoryEval(data=DEMO_DATA, questions_per_conversation=0)
    with pytest.raises(OptionError, match="controls"):
        MemoryEval(data=DEMO_DATA, selectors=("bm25",), controls=("hybrid",))  # a control must be compared


@pytest.mark.parametrize("batch_arms", [True, False])
def test_adversarial_question_gets_the_forced_choice(batch_arms):
    """A category-5 question: every arm scores 'Not mentioned in the conversation' against the
    adversarial answer; abstains is the sign of the log-prob margin. Batched or not, the same
    structure; unbatched, each arm has its own readout."""
    from probe_fixtures import tiny_runtime

    from eventkv.studies.materialization.memory_eval import NOT_MENTIONED, question_prompt

    probe = _probe(budgets=(0.3,), batch_arms=batch_arms)
    rt = tiny_runtime("llama")
    _, _, questions = probe._memory(rt, 0, 0)
    slot = next(i for i, q in enumerate(questions) if q.category == 5)
    rec = probe.run_item(rt, probe.items(0, [slot])[0])
    assert rec["category"] == 5 and rec["choice"] == [NOT_MENTIONED, "A blue ceramic tile"]
    for arm in rec["arms"].values():
        assert arm["abstains"] == (arm["abstain_margin"] > 0) and np.isfinite(arm["abstain_margin"])
    assert (max(rec["timing"]["batch"].values()) > 1) == batch_arms
    assert question_prompt("When?", 2).startswith("Question: When? Use DATE of CONVERSATION")
    assert "DATE" not in question_prompt("When?", 4)
    assert question_prompt("When?", 4).endswith(
        "Answer in a few words, not a complete sentence, using the conversation's own words where possible."
    )


@pytest.mark.slow
def test_relevance_order_serves_each_contiguous_arm_as_the_memory_query_does():
    """order="relevance": every text and /contiguous arm answers as ``EventMemory.query`` with
    ``order="relevance"`` on the same question, selector, budget and shaping (the same served order and
    greedy answer), its set the recorded selection's; with session headers each session's served turns follow
    its header in history order, and the best-ranked turn's session is served last. Arms at original positions,
    full and gold answer as under order="log" and record no served order."""
    from probe_fixtures import tiny_runtime

    from eventkv.models.introspect import profile_for
    from eventkv.studies.materialization.memory_eval import question_prompt

    rt = tiny_runtime("llama")
    rt.profile = profile_for(rt.model, rt.tokenizer, "tiny")  # a whole profile: the prompt is read as a message
    opts = dict(selectors=("bm25",), budgets=(0.6,), positions="both", with_headers=True, timing=False)
    relevance, log = _probe(order="relevance", **opts), _probe(**opts)
    _, mem, questions = relevance._memory(rt, 0, 0)
    qa = questions[0]
    rec = relevance.run_item(rt, relevance.items(0, [0])[0])
    ids = rec["selection"]["bm25@60%"]["ids"]
    ordered = ["rows:bm25@60%/contiguous", "text:bm25@60%", "isolated:bm25@60%/contiguous"]
    assert sorted(n for n, arm in rec["arms"].items() if "served_order" in arm) == sorted(ordered)
    hits = mem.search(qa.question, k=None, selector="bm25", budget=0.6, with_headers=True)
    for name in ordered:
        mode = {"rows": "compact", "text": "text", "isolated": "isolated"}[name.partition(":")[0]]
        ans = mem.query(
            qa.question,
            None,
            None,
            mode,
            max_new_tokens=2,
            selector="bm25",
            budget=0.6,
            with_headers=True,
            positions="contiguous",
            order="relevance",
            messages=[{"role": "user", "content": question_prompt(qa.question, qa.category)}],
        )
        served = rec["arms"][name]["served_order"]
        assert served == ans.served_ids and sorted(served) == sorted(ids)
        assert rec["arms"][name]["answer"] == first_line(ans.text)
        last = max(i for i, e in enumerate(served) if e.startswith("session-"))
        assert hits[0].id in served[last:] and served != ids  # the best turn's session last, not history order
        session = None
        for e in served:  # each header heads its session's served turns, in history order
            if e.startswith("session-"):
                session, turn = e.removeprefix("session-"), 0
            else:
                assert session is not None and e.startswith(f"D{session}:") and int(e.split(":")[1]) > turn
                turn = int(e.split(":")[1])
    mem.close()
    assert {rec["arms"][n]["positions"] for n in rec["arms"] if n.endswith("/contiguous")} == {"contiguous"}
    assert rec["arms"]["rows:bm25@60%"]["positions"] == rec["arms"]["full"]["positions"] == "original"
    plain = log.run_item(rt, log.items(0, [0])[0])
    assert not [a for a in plain["arms"].values() if "served_order" in a]
    for name in ("rows:bm25@60%", "isolated:bm25@60%", "full", "gold"):  # batched apart: the same answers
        x, y = rec["arms"][name], plain["arms"][name]
        assert (x["answer"], x["n_tokens"], x["rows"]) == (y["answer"], y["n_tokens"], y["rows"])


def test_readout_groups_keep_relevance_plans_apart():
    """Plans served in relevance order are served as one query only with plans of the same selector and budget,
    never with a plan in history order; every query of a readout is read out in one batch, which with max_padding 1
    holds every arm of the question."""
    from eventkv.studies.materialization.memory_eval import ArmPlan

    probe = _probe(max_padding=1.0)
    plans = {
        "a": ArmPlan(["x"], "compact", "contiguous", None, ("bm25", 0.1)),
        "b": ArmPlan(["x"], "compact", "contiguous", None, ("dense", 0.1)),
        "c": ArmPlan(["x"], "compact", "contiguous", None, ("bm25", 0.2)),
        "d": ArmPlan(["x", "y"], "text", "contiguous", None, ("bm25", 0.1)),
        "e": ArmPlan(["x"], "compact", "contiguous"),
        "f": ArmPlan(["y"], "text", "contiguous"),
        "g": ArmPlan([], "compact", "contiguous", None, ("bm25", 0.1)),
    }
    assert probe._readouts(plans, {"x": 5, "y": 3}, 10, 2) == [[["f", "e"], ["a", "d"], ["b"], ["c"]]]
    split = _probe(max_padding=0.0)._readouts(plans, {"x": 5, "y": 3}, 10, 2)  # equal lengths only
    assert split == [[["f"]], [["a"], ["b"], ["c"], ["e"]], [["d"]]]
    assert _probe(batch_arms=False)._readouts(plans, {"x": 5, "y": 3}, 10, 2) == [[[n]] for n in "abcdef"]


@pytest.mark.slow
def test_order_is_checked_and_recorded(tmp_path, monkeypatch, capsys, tiny_dir):
    """``--order relevance`` reaches the probe: the manifest's options record it, the arm names stay those
    of order log, and the text and /contiguous arms record the order they were served in."""
    with pytest.raises(OptionError, match="order 'score'"):
        MemoryEval(data=DEMO_DATA, order="score")
    assert MemoryEval(data=DEMO_DATA).order == "relevance"  # as the memory serves a selector's choice by default
    # the rows are served at contiguous positions unless asked otherwise, as the memory serves them by default
    default = MemoryEval(data=DEMO_DATA, selectors=("bm25",), arm_names=("rows", "text", "full", "gold"))
    assert default.positions == "contiguous"
    assert [a.name for a in default.grid()][:2] == ["rows:bm25@2.5%/contiguous", "text:bm25@2.5%"]
    out = tmp_path / "run"
    args = ["memory", "eval", "--data", DEMO_DATA, "--model", str(tiny_dir), *BASE, "--out", str(out)]
    args[args.index("--conversations") + 1] = "1"
    args += ["--order", "relevance", "--positions", "contiguous"]
    code, out_text, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, out_text + err
    assert json.loads((out / "manifest.json").read_text())["identity"]["options"]["order"] == "relevance"
    done = [x for x in _records(out) if "arms" in x]
    names = ["rows:bm25@20%/contiguous", "text:bm25@20%", "isolated:bm25@20%/contiguous"]
    names += [n.replace("20%", "50%") for n in names] + ["full", "gold"]
    assert done and all(list(x["arms"]) == names for x in done)
    for x in done:
        for name, arm in x["arms"].items():
            if name in ("full", "gold") or arm.get("empty"):
                assert "served_order" not in arm
            else:
                ids = x["selection"][f"bm25@{name.partition('@')[2].partition('/')[0]}"]["ids"]
                assert sorted(arm["served_order"]) == sorted(ids)
    assert "Order relevance" in (out / "summary.md").read_text()


def test_arm_spec_keeps_unpositioned_kinds_original():
    assert arm_spec("text", "bm25", 0.1, "contiguous").name == "text:bm25@10%"
    assert arm_spec("rows", "bm25", 0.1, "contiguous").positions == "contiguous"


def test_a_redacted_run_keeps_no_dataset_text_and_reports_and_resumes(tiny_dir, tmp_path, monkeypatch, capsys):
    """`eventkv memory redact`: the copy holds no question, gold answer, option or model answer; its
    summary equals the source's; the eval resumed into it computes only the items it lacks."""
    src, dst = tmp_path / "run", tmp_path / "shared"
    args = ["memory", "eval", "--data", DEMO_DATA, "--model", str(tiny_dir), *BASE, "--out", str(src)]
    args[args.index("--conversations") + 1] = "1"
    assert run_cli(monkeypatch, capsys, *args)[0] == 0
    whole = _records(src)
    lines = (src / "records.jsonl").read_text().splitlines()
    (src / "records.jsonl").write_text(lines[0] + "\n")  # as if stopped after the first item
    code, out_text, err = run_cli(monkeypatch, capsys, "memory", "redact", str(src), str(dst))
    assert code == 0, out_text + err
    assert "1 records redacted" in out_text
    kept = _records(dst)
    texts = {whole[0].get("question"), whole[0].get("gold"), *whole[0].get("choice", [])}
    texts |= {arm["answer"] for arm in whole[0].get("arms", {}).values()}
    body = (dst / "records.jsonl").read_text()
    assert all(k not in kept[0] for k in ("question", "gold", "choice"))
    assert all("answer" not in arm for arm in kept[0].get("arms", {}).values())
    assert not [t for t in texts if t and len(t) > 3 and json.dumps(t)[1:-1] in body]
    assert {k: v for k, v in kept[0].items() if k != "arms"} == {
        k: v for k, v in whole[0].items() if k not in ("question", "gold", "choice", "arms")
    }
    assert run_cli(monkeypatch, capsys, "report", str(src))[0] == 0
    assert run_cli(monkeypatch, capsys, "report", str(dst))[0] == 0
    assert (dst / "summary.md").read_text() == (src / "summary.md").read_text()
    # reported where the data file is not (a relative --data, a reader without LoCoMo): from the records alone
    moved = tmp_path / "moved"
    shutil.copytree(dst, moved)
    manifest = json.loads((moved / "manifest.json").read_text())
    manifest["identity"]["options"]["data"] = "../nowhere/locomo10.json"
    (moved / "manifest.json").write_text(json.dumps(manifest))
    assert run_cli(monkeypatch, capsys, "report", str(moved))[0] == 0
    assert (moved / "summary.md").read_text() == (src / "summary.md").read_text()
    assert run_cli(monkeypatch, capsys, *args[:-1], str(dst))[0] == 0  # resumed into the redacted folder
    again = _records(dst)
    assert [r["index"] for r in again] == [r["index"] for r in whole]
    assert json.loads((dst / "manifest.json").read_text())["invocations"][-1]["items_computed"] == len(whole) - 1
    for a, b in zip(whole[1:], again[1:]):  # the lacking items, computed afresh, equal the source's
        assert {k: v for k, v in a.items() if k != "timing"} == {k: v for k, v in b.items() if k != "timing"}
    code, _, err = run_cli(monkeypatch, capsys, "memory", "redact", str(src), str(dst))
    assert code == 2 and "already holds records.jsonl" in err
    code, _, err = run_cli(monkeypatch, capsys, "memory", "redact", str(tmp_path / "nope"), str(tmp_path / "x"))
    assert code == 2 and "is not a run folder" in err


def test_history_events_resolve_relative_dates():
    from eventkv.studies.materialization.dialogue import Conversation, Turn

    conv = Conversation(
        "c",
        ("Ann", "Bo"),
        [
            Turn("D1:1", 1, "1:56 pm on 8 May, 2023", "Ann", "I went to the climbing gym yesterday."),
            Turn("D1:2", 1, "1:56 pm on 8 May, 2023", "Bo", "We are here now."),
        ],
    )
    ((_, (first, second)),) = history_events(conv, False, resolve_dates=True)
    assert first.text == "[session 1, 1:56 pm on 8 May, 2023] Ann: I went to the climbing gym yesterday [7 May 2023]."
    assert second.text == "[session 1, 1:56 pm on 8 May, 2023] Bo: We are here now."
    ((_, (head, turn, _)),) = history_events(conv, True, resolve_dates=True)
    assert (
        head.tags == ("header",) and turn.text == "[session 1] Ann: I went to the climbing gym yesterday [7 May 2023]."
    )


def test_eval_rows_format_and_categories(tiny_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = ["memory", "eval", "--data", DEMO_DATA, "--model", str(tiny_dir), *BASE, "--out", str(out)]
    code, out_text, err = run_cli(
        monkeypatch, capsys, *args, "--rows", "int8", "--categories", "2,4", "--no-resolve-dates"
    )
    assert code == 0, out_text + err
    manifest = json.loads((out / "manifest.json").read_text())
    options = manifest["identity"]["options"]
    assert options["rows"] == "int8" and options["categories"] == [2, 4] and options["resolve_dates"] is False
    assert all(json.loads((m / "manifest.json").read_text())["rows"] == "int8" for m in (out / "memories").iterdir())
    assert {r["category"] for r in _records(out) if "arms" in r} <= {2, 4}
    code, _, err = run_cli(monkeypatch, capsys, "memory", "eval", "--data", DEMO_DATA, "--categories", "2,x")
    assert code == 2 and "--categories '2,x': give comma-separated integers" in err


def _run(f1s, question="q"):
    """Hand-made records: one per (conversation, F1 of arm a)."""
    return [
        {
            "index": i,
            "conversation": c,
            "slot": i,
            "category": 2 if i % 2 else 4,
            "question": question,
            "arms": {"a": {"f1": f}, "only-here": {"f1": 0.0}},
        }
        for i, (c, f) in enumerate(f1s)
    ]


def test_compare_runs_pairs_questions():
    from eventkv.studies.materialization.memory_eval.compare import compare_runs, comparison_table

    a = _run([("c0", 0.1), ("c0", 0.5), ("c1", 0.2), ("c1", 0.0), ("c2", 0.4), ("c2", 0.3)])
    b = _run([("c0", 0.3), ("c0", 0.5), ("c1", 0.6), ("c1", 0.1), ("c2", 0.2), ("c2", 0.9)])
    b[0]["arms"].pop("only-here")
    (row,) = compare_runs(a, b)
    d = [y["arms"]["a"]["f1"] - x["arms"]["a"]["f1"] for x, y in zip(a, b)]
    assert row.arm == "a" and row.n == 6 and (row.better, row.worse) == (4, 1)
    assert row.f1_a[0] == pytest.approx(0.25) and row.diff[0] == pytest.approx(np.mean(d))
    assert row.wilcoxon_p == pytest.approx(scipy.stats.wilcoxon([x for x in d if x]).pvalue)
    cat2, only_here = compare_runs(a, b, category=2)  # b lacks only-here in a category-4 question
    assert only_here.arm == "only-here" and cat2.n == 3 and cat2.diff[0] == pytest.approx(np.mean([0.0, 0.1, 0.6]))
    assert "| a | 0.250 [" in comparison_table([row], "native", "int4", None).to_markdown()
    with pytest.raises(EventKVError, match="question 0 differs between the runs \\(question 'q' vs 'other'\\)"):
        compare_runs(a, _run([("c0", 0.1)], question="other"))


def test_memory_compare_command(tmp_path, monkeypatch, capsys):
    a = _run([("c0", 0.1), ("c0", 0.5), ("c1", 0.2)])
    b = _run([("c0", 0.3), ("c0", 0.5)])
    for name, records in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    args = ["memory", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--label-a", "native", "--label-b", "int4"]
    code, out, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    assert "Token F1, native (A) vs int4 (B), paired questions of categories 1-4" in out
    assert "| a | 0.300 [" in out and out.rstrip().endswith(
        "2 questions answered in both runs (every category); answered in A only: 1, in B only: 0 (left out)."
    )
    code, out, err = run_cli(monkeypatch, capsys, "memory", "compare", str(tmp_path / "a"), str(tmp_path / "nope"))
    assert code == 2 and "holds no records.jsonl" in err and "Traceback" not in out + err


def test_prefill_window_computes_late_rows_with_a_short_past(tmp_path):
    """``window``: the events within the window are prefilled as in one global pass (float32, within 1e-5); a
    row past it is computed with only the header and the rows just before it in view, so it differs."""
    import torch
    from probe_fixtures import tiny_runtime

    from eventkv.models import LoadedModel
    from eventkv.models.introspect import profile_for
    from eventkv.studies.materialization.memory_eval import INSTRUCTION, open_history

    probe = MemoryEval(data=DEMO_DATA, conversations=1, max_tokens=0)
    rt = tiny_runtime("llama")
    sessions = probe._history(rt, 0).sessions
    lm = LoadedModel(rt.model, rt.tokenizer, profile_for(rt.model, rt.tokenizer, "tiny"))
    whole = open_history(tmp_path / "a", lm, INSTRUCTION, sessions)
    short = open_history(tmp_path / "b", lm, INSTRUCTION, sessions, window=96)
    n = whole._ekv.keys[0].shape[-2]
    assert short._ekv.keys[0].shape[-2] == n > 96
    for k1, k2 in zip(whole._ekv.keys, short._ekv.keys):
        torch.testing.assert_close(k1[..., :48, :], k2[..., :48, :], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(whole._ekv.values[-1][..., -8:, :], short._ekv.values[-1][..., -8:, :], atol=1e-3)
    with pytest.raises(OptionError, match="window"):
        open_history(tmp_path / "c", lm, INSTRUCTION, sessions, window=1)


def test_prefill_window_option_is_checked_and_kept_out_of_the_identity_at_its_default():
    assert "prefill_window" not in MemoryEval(data=DEMO_DATA).options()
    assert MemoryEval(data=DEMO_DATA, prefill_window=2048).options()["prefill_window"] == 2048
    with pytest.raises(OptionError, match="prefill_window"):
        MemoryEval(data=DEMO_DATA, prefill_window=1).validate()
    with pytest.raises(OptionError, match="prefill_window"):
        MemoryEval(data=DEMO_DATA, prefill_window=True).validate()


def test_eval_with_a_prefill_window_records_it(tiny_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    args = ["memory", "eval", "--data", DEMO_DATA, "--model", str(tiny_dir), *BASE, "--out", str(out)]
    args[args.index("--conversations") + 1] = "1"
    code, text, err = run_cli(monkeypatch, capsys, *args, "--prefill-window", "400")
    assert code == 0, text + err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["identity"]["options"]["prefill_window"] == 400
    assert any("arms" in x for x in _records(out))
    code, text, err = run_cli(monkeypatch, capsys, *args, "--prefill-window", "1", "--out", str(tmp_path / "bad"))
    assert code == 2 and "prefill" in text + err and "Traceback" not in text + err
