"""EventMemory: the gate against a fresh prefill, the store, the verbs,
forget, rebase, selection and the errors. Tiny random models in float32; smollm2-135m once
(``-m integration``).

The gate: ``query(mode="compact", select="all")`` equals a fresh :func:`eventkv.kv.prefill.prefill` of
the same header + events (same token ids and positions) within 1e-4 on every logit of the query and
8 greedy steps, with the same tokens (``eventkv.testing.assert_same_greedy``, which also asserts the
reference's top-two margin > 2e-4 at every step, so no comparison rests on a near-tie).
"""

from __future__ import annotations

import dataclasses
import json
import sqlite3

import pytest
import torch
from tiers import slow_except

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.log import tokenize, tokenize_query
from eventkv.kv.prefill import prefill
from eventkv.kv.readout import generate
from eventkv.kv.serve import serve
from eventkv.memory import EventMemory, MemoryEvent
from eventkv.memory.store import DATABASE, MANIFEST, SEGMENTS
from eventkv.models import LoadedModel
from eventkv.testing import assert_same_greedy, tiny_lm, tiny_tokenizer

TOL = 1e-4
QUESTION = "Where does Dana live?"
GATE_FAMILIES = ("llama", "qwen2", "gemma3")
MEASURED: dict[str, float] = {}

EVENTS = [
    MemoryEvent("Dana lives in Lisbon and works on the grant proposal.", role="user", id="dana"),
    MemoryEvent("Ravi will handle the quarterly report from Oslo.", role="user", id="ravi", budget=60),
    MemoryEvent("The team offsite is on Tuesday at 10:30.", role="assistant", tags=("calendar",)),
    "Mei moved the server migration to Friday.",
    {"text": "Tomas asked for the demo slides.", "role": "user", "id": "tomas"},
]


def sharp_lm(family: str) -> LoadedModel:
    """A tiny random model whose output layer is scaled by 30, so its logits spread like a trained
    model's (std ~3 instead of ~0.1): greedy steps then have clear top-two margins (> 2e-4, which
    assert_same_greedy requires) instead of frequent near-ties."""
    lm = tiny_lm(family)
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(30.0)
    return lm


@pytest.fixture(scope="module", params=GATE_FAMILIES)
def lm(request):
    return sharp_lm(request.param)


@pytest.fixture(scope="module")
def llama():
    return sharp_lm("llama")


def reference(lm: LoadedModel, mem: EventMemory, question: str = QUESTION, n: int = 8):
    """A fresh prefill of the memory's header + stored events (the same token ids and positions), all
    served, greedy: ``(tokenized log, generation with logits)``."""
    tlog = tokenize(mem.event_log("all"), lm.tokenizer, lm.profile)
    ekv = prefill(lm.model, tlog, max_context=lm.profile.max_context)
    q = tokenize_query(lm.tokenizer, lm.profile, question)
    gen = generate(lm.model, serve(ekv, "all", "compact"), q, max_new_tokens=n, keep_logits=True)
    return tlog, gen


def check_gate(lm: LoadedModel, mem: EventMemory, tag: str) -> float:
    """query(select='all', compact) == fresh prefill; returns max |Δlogit| over the steps."""
    tlog, ref = reference(lm, mem)
    ans = mem.query(QUESTION, select="all", mode="compact", max_new_tokens=8, keep_logits=True, positions="original")
    view = mem._ekv.log
    assert view.input_ids == tlog.input_ids and view.position_ids == tlog.position_ids
    assert ans.served_ids == tlog.event_ids
    assert ans.n_rows_served == tlog.n_rows
    gen = ans.generation
    assert_same_greedy(gen.tokens, gen.logits, ref.tokens, ref.logits, TOL)
    diff = max(float((a - b).abs().max()) for a, b in zip(gen.logits, ref.logits))
    MEASURED[tag] = max(MEASURED.get(tag, 0.0), diff)
    return diff


# ====================================================================== the gate
def test_gate_query_all_equals_fresh_prefill(lm, tmp_path):
    """Fresh memory, lazy prefill; after add/update/delete in several prefill calls; after open."""
    fam = lm.profile.name
    mem = EventMemory.create(tmp_path / "m", lm, namespace="t", instruction="Answer from the log.")
    mem.add(EVENTS)
    assert mem._ekv is None  # lazy
    assert check_gate(lm, mem, fam) <= TOL
    assert mem.stats().rows > 16, "the history must exceed the Gemma 3 test window"
    # a sequence of writes, partly eager, partly lazy: rows continue from the stored segments
    mem.add([MemoryEvent("Aiko booked the flight to Kyoto for Wednesday.", id="aiko")], prefill=True)
    mem.update("dana", "Dana moved to Porto last month.")
    mem.delete("tomas")
    mem.add("Lena joins the call at 9:15.", prefill=True)
    mem.update("dana", "Dana moved to Quito in the end.", prefill=True)
    assert check_gate(lm, mem, fam) <= TOL
    assert mem.stats().segments >= 3
    mem.close()
    mem = EventMemory.open(tmp_path / "m", lm)
    assert check_gate(lm, mem, fam) <= TOL
    mem.add("Omar sent the invoice on Monday.")
    mem.delete("aiko")
    assert check_gate(lm, mem, fam) <= TOL
    mem.close()


def test_gate_subset_served_at_original_positions(llama, tmp_path):
    """A served subset (compact) equals the data path's serve() of the same ids over a fresh prefill."""
    lm = llama
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add(EVENTS, prefill=True)
        ans = mem.query(QUESTION, select=["ravi", "tomas"], max_new_tokens=6, keep_logits=True, positions="original")
        tlog = tokenize(mem.event_log("all"), lm.tokenizer, lm.profile)
        ekv = prefill(lm.model, tlog)
        q = tokenize_query(lm.tokenizer, lm.profile, QUESTION)
        ref = generate(lm.model, serve(ekv, ["ravi", "tomas"]), q, max_new_tokens=6, keep_logits=True)
        assert_same_greedy(ans.generation.tokens, ans.generation.logits, ref.tokens, ref.logits, TOL)
        assert ans.positions == [(s.event_id, s.pos_start, s.width) for s in tlog.spans if s.event_id in ans.served_ids]
        assert ans.n_rows_served == len(ekv.rows_of(["ravi", "tomas"]))
        assert set(ans.timings_ms) == {"prefill", "serve", "decode"}


# ====================================================================== the store
def test_store_layout_and_manifest(llama, tmp_path):
    d = tmp_path / "m"
    with EventMemory.create(d, llama, namespace="agent-1", instruction="Be brief.") as mem:
        mem.add(EVENTS[:2], prefill=True)
        mem.add(EVENTS[2:], prefill=True)
        st = mem.stats()
    man = json.loads((d / MANIFEST).read_text())
    assert man["schema"] == 3 and man["namespace"] == "agent-1" and man["instruction"] == "Be brief."
    assert man["weights_digest"] == "tiny-llama-0" and man["dtype"] == "float32"
    assert len(man["tokenizer_digest"]) == 64 and len(man["chat_template_digest"]) == 64
    files = sorted(p.name for p in (d / SEGMENTS).iterdir())
    assert files == ["000001.safetensors", "000002.safetensors"] and st.segments == 2
    conn = sqlite3.connect(d / DATABASE)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    segs = conn.execute("SELECT row_start, n_rows FROM segments ORDER BY id").fetchall()
    assert segs[0][0] == 0 and segs[1][0] == segs[0][1] and segs[1][0] + segs[1][1] == st.rows
    cols = {r[1] for r in conn.execute("PRAGMA table_info(events)")}
    assert {
        "seq",
        "id",
        "kind",
        "text",
        "role",
        "tags",
        "budget",
        "token_ids",
        "position",
        "width",
        "row_start",
    } <= cols
    conn.close()
    from safetensors import safe_open

    with safe_open(d / SEGMENTS / files[0], "pt") as f:
        k = f.get_tensor("keys.0")
        assert tuple(k.shape) == (2, segs[0][1], 16)  # [kv_heads, rows, head_dim]
        assert f.get_tensor("positions").dtype == torch.int64
    assert not list(d.rglob("*.pkl")) and not list(d.rglob("*.pt"))


@pytest.mark.parametrize("what", ["weights", "tokenizer", "chat template", "dtype"])
def test_open_refuses_another_model(llama, tmp_path, what):
    with EventMemory.create(tmp_path / "m", llama, namespace="t") as mem:
        mem.add(EVENTS, prefill=True)
    if what == "weights":
        other = tiny_lm("qwen2")
    elif what == "tokenizer":
        tok = tiny_tokenizer()
        tok.add_tokens(["<extra>"])
        other = LoadedModel(llama.model, tok, llama.profile)
    elif what == "chat template":
        tok = tiny_tokenizer()
        tok.chat_template = tok.chat_template.replace("<|im_start|>", "<|im_start|> ")
        other = LoadedModel(llama.model, tok, llama.profile)
    else:
        other = LoadedModel(llama.model, llama.tokenizer, dataclasses.replace(llama.profile, dtype="bfloat16"))
    with pytest.raises(EventKVError, match=f"made with {what} .* but the model given has {what}") as exc:
        EventMemory.open(tmp_path / "m", other)
    assert "Open it with the model it was made with" in str(exc.value)


def test_open_discards_orphans_and_checks_segments(llama, tmp_path):
    d = tmp_path / "m"
    with EventMemory.create(d, llama, namespace="t") as mem:
        mem.add(EVENTS, prefill=True)
    (d / SEGMENTS / "000002.safetensors").write_bytes(b"orphan: a kill between write and commit")
    (d / SEGMENTS / ".000002.safetensors-x.tmp").write_bytes(b"half")
    with EventMemory.open(d, llama) as mem:
        assert sorted(p.name for p in (d / SEGMENTS).iterdir()) == ["000001.safetensors"]
        assert mem.stats().rows_prefilled == mem.stats().rows
    seg = d / SEGMENTS / "000001.safetensors"
    raw = bytearray(seg.read_bytes())
    raw[-3] ^= 0xFF
    seg.write_bytes(bytes(raw))
    with pytest.raises(EventKVError, match="does not match its sha256"):
        EventMemory.open(d, llama)
    with EventMemory.open(d, llama, verify="size"):  # size check only: passes (documented trade-off)
        pass
    seg.write_bytes(bytes(raw[:-1]))
    with pytest.raises(EventKVError, match="bytes, not the"):
        EventMemory.open(d, llama, verify="size")


# ====================================================================== verbs
def test_add_positions_budgets_and_lazy_prefill(llama, tmp_path):
    with EventMemory.create(tmp_path / "m", llama, namespace="t") as mem:
        h = len(mem.header_ids)
        added = mem.add(EVENTS)
        assert [a.id for a in added] == ["dana", "ravi", "e3", "e4", "tomas"]
        assert added[0].position == h and added[1].width == 60
        for a, b in zip(added, added[1:]):
            assert b.position == a.position + a.width
        assert mem.get("ravi").n_rows < 60 and mem.get("e3").tags == ("calendar",)
        st = mem.stats()
        assert (
            st.rows_prefilled == 0
            and st.prefilled_up_to == h
            and st.history_end == added[-1].position + added[-1].width
        )
        v0 = mem.version
        n = mem.prefill()
        assert n == st.rows and mem.prefill() == 0 and mem.version == v0  # rows only: no bump
        more = mem.add(["Jon is on leave.", "Sofia returns Monday."])
        n2 = mem.prefill()
        assert n2 == sum(mem.get(a.id).n_rows for a in more)  # only the new rows are computed
        st = mem.stats()
        assert st.rows_prefilled == st.rows and st.prefilled_up_to == st.history_end and st.segments == 2
        assert st.bytes_on_disk > 0 and st.events == 7 and st.live == 7


def test_update_history_view_delete_pin(llama, tmp_path):
    with EventMemory.create(tmp_path / "m", llama, namespace="t") as mem:
        mem.add(EVENTS)
        p1 = mem.update("dana", "Dana moved to Porto.")
        p2 = mem.update(p1.id, "Dana moved to Quito.")  # a patch's id updates its event
        assert (p1.id, p2.id) == ("dana~1", "dana~2")
        hist = mem.history("dana~1")
        assert [r.id for r in hist] == ["dana", "dana~1", "dana~2"] and hist[0].text.startswith("Dana lives")
        assert [r.kind for r in hist] == ["event", "patch", "patch"] and hist[2].supersedes == "dana"
        assert hist[2].role == "user"
        assert mem.view_ids() == ["ravi", "e3", "e4", "tomas", "dana~2"]
        mem.delete("dana~2")  # falls back to the previous patch
        assert mem.view_ids() == ["ravi", "e3", "e4", "tomas", "dana~1"]
        mem.delete("tomas")
        assert "tomas" not in mem.view_ids() and mem.get("tomas").deleted
        assert [r.id for r in mem.list()] == mem.view_ids()
        assert {r.id for r in mem.list(include_superseded=True)} == {"dana", "dana~1", "ravi", "e3", "e4"}
        assert {r.id for r in mem.list(include_deleted=True)} >= {"tomas", "dana~2"}
        with pytest.raises(EventKVError, match="'tomas' is deleted: it cannot be updated"):
            mem.update("tomas", "x")
        with pytest.raises(EventKVError, match="already deleted"):
            mem.delete("tomas")
        mem.pin("dana~1")
        assert mem.get("dana").pinned
        mem.delete("dana")  # a deleted event's patches leave with it
        assert mem.view_ids() == ["ravi", "e3", "e4"]
        # select='all' still serves every stored event (deleted ones are part of the stored history)
        assert mem.query("Who?", select="all", max_new_tokens=1).served_ids == [r.id for r in mem._stored()]


def test_version_bumps_on_every_committed_write_only(llama, tmp_path):
    with EventMemory.create(tmp_path / "m", llama, namespace="t") as mem:
        v = [mem.version]
        mem.add(EVENTS)
        mem.update("ravi", "Ravi hands the report to Mei.")
        mem.pin("e3")
        mem.delete("e4")
        mem.prefill()  # rows only: no bump
        v.append(mem.version)
        assert v[1] == v[0] + 4
        mem.query("Where?", select="all", max_new_tokens=1)
        assert mem.version == v[1]
        with pytest.raises(EventKVError):
            mem.add([MemoryEvent("fine"), MemoryEvent("dup", id="ravi")])
        assert mem.version == v[1] and len(mem.list(include_deleted=True, include_superseded=True)) == 6


def test_select_bm25_patches_pins_budget(llama, tmp_path):
    with EventMemory.create(tmp_path / "m", llama, namespace="t") as mem:
        mem.add(
            [
                MemoryEvent("Dana lives in Lisbon.", id="dana"),
                MemoryEvent("Ravi drinks green tea every morning.", id="ravi"),
                MemoryEvent("The offsite is in Kyoto.", id="offsite"),
                MemoryEvent("Mei owns the server migration.", id="mei"),
                MemoryEvent("Always answer in one short sentence.", id="rule"),
            ]
        )
        assert mem.select("What does Ravi drink?", k=1) == ["ravi"]
        mem.update("dana", "Dana now lives in Porto, near the river.")
        assert mem.select("Where does Dana live?", k=1) == ["dana~1"]  # the patch instead of the event
        mem.pin("rule")
        assert mem.select("Where does Dana live?", k=1) == ["rule", "dana~1"]  # history order
        got = mem.select("Dana Ravi Kyoto migration", k=4)
        assert got == ["ravi", "offsite", "mei", "rule", "dana~1"]  # top 4 + the pin, in history order
        rows = {r.id: r.n_rows for r in mem.list()}
        budget = rows["rule"] + rows["ravi"]
        ranked = mem.select("Ravi tea morning Dana", k=2, budget_rows=budget)
        assert ranked == ["ravi", "rule"]  # dana~1 (ranked second) dropped to fit; the pin never is
        with pytest.raises(EventKVError, match=r"pinned events need \d+ rows, over the budget of 1 rows"):
            mem.select("Ravi", k=3, budget_rows=1)  # a budget is never exceeded, and a pin never dropped
        ans = mem.query("What does Ravi drink?", k=1)  # select=None: BM25 + pins
        assert ans.served_ids == ["rule", "ravi"]  # the default at contiguous positions: the best-ranked last
        with pytest.raises(OptionError, match="k 0"):
            mem.select("x", k=0)
        with pytest.raises(OptionError, match="budget_rows"):
            mem.select("x", budget_rows=0)


def test_query_modes_and_candidates(llama, tmp_path):
    with EventMemory.create(tmp_path / "m", llama, namespace="t") as mem:
        mem.add(EVENTS)
        for mode in ("compact", "native", "text"):
            ans = mem.query(QUESTION, select="view", mode=mode, candidates=["Lisbon", "Porto"], max_new_tokens=3)
            assert len(ans.generation.tokens) <= 3 and [c.text for c in ans.candidates] == ["Lisbon", "Porto"]
            assert all(c.logprob < 0 for c in ans.candidates)
        compact = mem.query(
            QUESTION, select="view", mode="compact", max_new_tokens=4, keep_logits=True, positions="original"
        )
        native = mem.query(QUESTION, select="view", mode="native", max_new_tokens=4, keep_logits=True)
        assert_same_greedy(
            compact.generation.tokens,
            compact.generation.logits,
            native.generation.tokens,
            native.generation.logits,
            TOL,
        )
        assert native.n_rows_served == compact.n_rows_served
        assert mem.query(QUESTION, select="view", max_new_tokens=1).timings_ms["prefill"] >= 0


@pytest.mark.parametrize("family", slow_except(GATE_FAMILIES, "gemma3"))
def test_query_batch_equals_separate_queries(family, tmp_path):
    """Several plans read out in one batch give each plan's separate answer: same greedy tokens,
    logits within TOL, candidate log-probs within TOL (float32)."""
    lm = sharp_lm(family)
    plans = [(["dana", "tomas"], "compact"), (["dana", "tomas"], "text"), (["dana"], "isolated"), ("all", "native")]
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add(EVENTS)
        batch = mem.query_batch(QUESTION, plans, candidates=["Lisbon", "Porto"], max_new_tokens=6, keep_logits=True)
        assert len(batch) == len(plans)
        for (select, mode), got in zip(plans, batch):
            ref = mem.query(
                QUESTION,
                select=select,
                mode=mode,
                candidates=["Lisbon", "Porto"],
                max_new_tokens=6,
                keep_logits=True,
                positions="original",  # the batch holds a native plan: every plan at the original positions
            )
            assert got.served_ids == ref.served_ids and got.n_rows_served == ref.n_rows_served
            assert_same_greedy(
                got.generation.tokens, got.generation.logits, ref.generation.tokens, ref.generation.logits, TOL
            )
            for c, r in zip(got.candidates, ref.candidates):
                assert c.text == r.text and abs(c.logprob - r.logprob) <= TOL
            assert got.text == ref.text
        assert len({a.timings_ms["decode"] for a in batch}) == 1  # one shared readout
        with pytest.raises(OptionError, match="plans"):
            mem.query_batch(QUESTION, [])
        with pytest.raises(OptionError, match="'zip'"):
            mem.query_batch(QUESTION, [("all", "zip")])


def test_isolated_encodings_are_kept_while_open(llama, tmp_path):
    """mode="isolated" encodes each event alone once: a second query reuses the encoding (no new
    forward) and answers bit for bit as serve() without a memo; a forget empties the memo."""
    from eventkv.kv.serve import serve as plain_serve

    forwards = []
    hook = llama.model.register_forward_pre_hook(lambda *a: forwards.append(1))
    try:
        with EventMemory.create(tmp_path / "m", llama, namespace="t") as mem:
            mem.add(EVENTS, prefill=True)
            forwards.clear()
            a = mem.query(QUESTION, select=["dana", "tomas"], mode="isolated", max_new_tokens=1)
            n_first = len(forwards)
            forwards.clear()
            b = mem.query(QUESTION, select=["dana", "tomas"], mode="isolated", max_new_tokens=1)
            assert n_first - len(forwards) == 2  # the two events' encodings were not run again
            assert a.text == b.text and len(mem._isolated) == 2
            memo_sc = serve(mem._ekv, ["dana", "tomas"], "isolated", model=llama.model, isolated_memo=mem._isolated)
            plain = plain_serve(mem._ekv, ["dana", "tomas"], "isolated", model=llama.model)
            for x, y in zip(memo_sc.keys + memo_sc.values, plain.keys + plain.values):
                assert torch.equal(x, y)
            assert torch.equal(memo_sc.positions, plain.positions)
            mem.forget("ravi")
            assert mem._isolated == {}
    finally:
        hook.remove()


# ====================================================================== forget and rebase
def _all_bytes(d) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file())


@pytest.mark.parametrize("family", GATE_FAMILIES)
def test_forget_equals_fresh_prefill_without_the_event_and_erases_its_text(family, tmp_path):
    lm = sharp_lm(family)
    d = tmp_path / "m"
    secret = "Priya's passport number is XK-4471-SECRET."
    with EventMemory.create(d, lm, namespace="t") as mem:
        mem.add(EVENTS[:2], prefill=True)
        mem.add([MemoryEvent("Hanoi trip on Thursday.", id="hanoi"), MemoryEvent(secret, id="priya", role="user")])
        mem.add(EVENTS[2:], prefill=True)  # segment 2 straddles the secret: rows before it are kept
        mem.update("priya", secret.replace("4471", "9999"))  # its patch is forgotten with it
        mem.add("Sofia takes the 8:00 train.", prefill=True)
        mem.add("Perth office closes early.")  # pending: stays pending
        before = mem.stats()
        positions = {r.id: r.position for r in mem._stored()}
        width = mem.get("priya").width
        n = mem.forget("priya")
        assert n > 0 and mem.stats().rows_prefilled < before.rows_prefilled
        assert mem.get("priya").forgotten and mem.get("priya").text is None and mem.get("priya~1").forgotten
        assert mem.get("e5").position == positions["e5"] - width  # moved down: contiguous positions
        e5, e6, tomas = mem.get("e5"), mem.get("e6"), mem.get("tomas")
        assert mem.get("e9").position == e5.position + e5.width + e6.width + tomas.width
        assert mem.get("hanoi").position == positions["hanoi"]
        assert not mem.get("e10").prefilled  # the pending event was not computed by forget
        assert "priya" not in mem.view_ids()
        assert check_gate(lm, mem, f"forget-{family}") <= TOL
        with pytest.raises(EventKVError, match="duplicate event id 'priya': a forgotten event of this memory had it"):
            mem.add(MemoryEvent("x", id="priya"))
        with pytest.raises(EventKVError, match="already forgotten"):
            mem.forget("priya")
    blob = _all_bytes(d)
    for needle in ("XK-4471", "XK-9999", "passport"):
        assert needle.encode() not in blob and needle.encode("utf-16-le") not in blob
    with EventMemory.open(d, lm) as mem:
        assert check_gate(lm, mem, f"forget-{family}") <= TOL


def test_forget_first_event_and_unprefilled_event(llama, tmp_path):
    lm = llama
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add(EVENTS, prefill=True)
        rows = mem.stats().rows
        n = mem.forget("dana")  # no event before it: the header is recomputed too
        assert n == rows - mem.get("dana").n_rows - 0 or n == mem.stats().rows
        assert check_gate(lm, mem, "forget-first") <= TOL
        mem.add("pending one", prefill=False)
        assert mem.forget("e6") == 0
        assert check_gate(lm, mem, "forget-first") <= TOL


def test_rebase_folds_patches_and_equals_fresh_prefill(llama, tmp_path):
    lm = llama
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add(EVENTS, prefill=True)
        mem.update("dana", "Dana moved to Porto.")
        mem.delete("tomas")
        mem.pin("ravi")
        view = mem.view_ids()
        n = mem.rebase()
        assert n == mem.stats().rows and mem.stats().segments == 1
        assert [r.id for r in mem.list()] == ["dana", "ravi", "e3", "e4"] != view
        assert mem.get("dana").text == "Dana moved to Porto." and mem.get("ravi").pinned
        assert mem.get("ravi").budget == 60 and mem.history("dana") == [mem.get("dana")]
        assert check_gate(lm, mem, "rebase") <= TOL
        assert len(list((tmp_path / "m" / SEGMENTS).iterdir())) == 1


# ====================================================================== errors
def test_errors_name_the_value_and_the_fix(llama, tmp_path):
    lm = llama
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("x")
    with pytest.raises(EventKVError, match="exists and is not a memory .*notes.txt"):
        EventMemory.create(tmp_path / "junk", lm, namespace="t")
    with pytest.raises(EventKVError, match="is not a memory"):
        EventMemory.open(tmp_path / "junk", lm)
    with pytest.raises(EventKVError, match="does not exist: create one"):
        EventMemory.open(tmp_path / "nowhere", lm)
    with pytest.raises(OptionError, match="namespace"):
        EventMemory.create(tmp_path / "m0", lm, namespace=" ")
    mem = EventMemory.create(tmp_path / "m", lm, namespace="t")
    with pytest.raises(EventKVError, match="already holds a memory: open it"):
        EventMemory.create(tmp_path / "m", lm, namespace="t")
    mem.add(EVENTS)
    with pytest.raises(EventKVError, match="unknown event id 'nope': this memory's events are dana, ravi"):
        mem.get("nope")
    for verb in (mem.delete, mem.forget, mem.pin, mem.history):
        with pytest.raises(EventKVError, match="unknown event id 'nope'"):
            verb("nope")
    with pytest.raises(EventKVError, match="duplicate event id 'ravi'"):
        mem.add(MemoryEvent("again", id="ravi"))
    with pytest.raises(EventKVError, match="duplicate event id 'x'"):
        mem.add([MemoryEvent("a", id="x"), MemoryEvent("b", id="x")])
    with pytest.raises(EventKVError, match="text"):
        mem.add(MemoryEvent("   "))
    with pytest.raises(EventKVError, match="id"):
        mem.add(MemoryEvent("ok", id="a,b"))
    with pytest.raises(EventKVError, match="budget of 2: raise its budget"):
        mem.add(MemoryEvent("a longer text", budget=2))
    with pytest.raises(EventKVError, match="unknown key"):
        mem.add({"text": "x", "speaker": "me"})
    with pytest.raises(EventKVError, match="reserved for the header"):
        mem.add(MemoryEvent("x", id="<header>"))
    with pytest.raises(OptionError, match="events"):
        mem.add([])
    with pytest.raises(EventKVError, match="kind 'patch'"):
        mem.add(MemoryEvent("x", kind="patch"))
    with pytest.raises(OptionError, match="mode 'sideways'"):
        mem.query("q", select="all", mode="sideways")
    with pytest.raises(OptionError, match="select 'everything'"):
        mem.query("q", select="everything")
    with pytest.raises(OptionError, match="question"):
        mem.query("  ", select="all")
    with pytest.raises(OptionError, match="candidates"):
        mem.query("q", select="all", candidates=["a", "a"])
    assert mem.stats().rows_prefilled == 0  # every refusal above came before any compute
    # a history that grows past the model's context is kept (tests/test_memory_long.py); a question past
    # the context at the original positions is refused before anything is computed, naming the fix
    end = mem.stats().history_end
    small = LoadedModel(lm.model, lm.tokenizer, dataclasses.replace(lm.profile, max_context=end + 20))
    mem.close()
    with EventMemory.open(tmp_path / "m", small) as m2:
        with pytest.raises(OptionError, match="max_new_tokens 32: the history and the question take"):
            m2.query("q?", select="all", positions="original")
        (added,) = m2.add("this event is far longer than the twenty positions left in the context")
        assert added.position == end and m2.stats().history_end > small.profile.max_context
        with pytest.raises(EventKVError, match='positions="contiguous"'):
            m2.query("q?", select="all", positions="original")
        assert m2.stats().rows_prefilled == 0
    mem.close()
    with pytest.raises(EventKVError, match="is closed"):
        mem.add("x")


def test_empty_memory(llama, tmp_path):
    with EventMemory.create(tmp_path / "m", llama, namespace="t") as mem:
        assert mem.prefill() == 0 and mem.view_ids() == [] and mem.select("q") == []
        with pytest.raises(EventKVError, match="no live events"):
            mem.query("q")
        assert mem.stats().rows == len(mem.header_ids)
    with EventMemory.open(tmp_path / "m", llama) as mem:
        assert mem.stats().events == 0


# ====================================================================== a real model
@pytest.mark.slow
@pytest.mark.integration
def test_gate_smollm2(tmp_path):
    from eventkv.models import load

    lm = load("smollm2-135m", dtype="float32")
    mem = EventMemory.create(tmp_path / "m", lm, namespace="t")
    mem.add(EVENTS)
    assert check_gate(lm, mem, "smollm2") <= TOL
    mem.update("dana", "Dana moved to Porto last month.", prefill=True)
    mem.delete("tomas")
    mem.add("Lena joins the call at 9:15.", prefill=True)
    assert check_gate(lm, mem, "smollm2") <= TOL
    mem.close()
    with EventMemory.open(tmp_path / "m", lm) as mem:
        assert check_gate(lm, mem, "smollm2") <= TOL
        mem.forget("ravi")
        assert check_gate(lm, mem, "smollm2-forget") <= TOL


def test_zz_report_measured():
    """Prints the largest |Δlogit| of each gate above (run with -s to see it)."""
    print("\nmax |Δlogit| measured:", {k: f"{v:.2e}" for k, v in sorted(MEASURED.items())})


def test_docstring_example_runs():
    import doctest

    import eventkv.memory.memory as module

    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
