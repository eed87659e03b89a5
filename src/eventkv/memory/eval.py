"""``eventkv memory eval``: EventMemory on real multi-session dialogue (LoCoMo), against the
baselines an agent-memory user would reach for (Study 1, "Real dialogue"; issue 11, point 6).

Each conversation, truncated to its first ``max_tokens`` tokens of turns (each turn rendered with
its session, date and speaker; only the questions whose evidence lies inside are kept), becomes
one :class:`~eventkv.memory.EventMemory`, prefilled once. For each question, the same greedy short
answer is read out under five arms:

* ``rows`` — BM25 selects the top-``k`` turns (:meth:`EventMemory.select`); their rows from the one
  global prefill are served (compact, original positions);
* ``text`` — the same turns re-prefilled as text after the header (the RAG baseline);
* ``isolated`` — the same turns, each encoded alone at its original positions (what chunked or
  streaming encoding would have stored);
* ``full`` — the whole truncated history in context (every stored row served);
* ``gold`` — the question's evidence turns as text (what a perfect retriever would give).

Metric: LoCoMo's token F1 and exact match after its answer normalization
(:mod:`eventkv.memory.metrics`), by category 1-4; the adversarial category 5 is reported apart.
Statistics: the mean F1 per arm with a cluster-bootstrap 95% interval (clusters = conversations,
:func:`eventkv.stats.cluster_bootstrap`), the paired differences rows - text and rows - isolated
with their intervals, and per-query latency p50/p95 per arm (ms, wall clock: in the records'
``timing``, never compared on resume).

Item ``i`` is question slot ``i % Q`` of conversation ``i // Q`` (``Q`` questions per
conversation, drawn with the seed from the conversation's eligible questions); a conversation
with fewer eligible questions records the missing slots as ``skipped``.
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np

from eventkv.errors import EventKVError, OptionError
from eventkv.files import sha256_file
from eventkv.options import check_choices, check_int, check_max_new_tokens
from eventkv.probes.base import Arm, Probe, Runtime, Summary, Table

ARMS = ("rows", "text", "isolated", "full", "gold")
#: a tiny LoCoMo-format file of invented dialogue shipped with eventkv (smoke tests, a first try)
DEMO_DATA = str(files("eventkv") / "data" / "locomo-demo.json")
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
INSTRUCTION = (
    "The events below are the turns of a conversation, in order, each with its session date and speaker. "
    "Answer questions about the conversation."
)
QUESTION = "Question: {question}\nAnswer in a few words, using the conversation's own words where possible."


def first_line(text: str) -> str:
    """The first non-empty line of a generation, stripped (the short answer)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


@dataclass
class MemoryEval(Probe):
    """Options (all part of a run's identity): ``data`` (LoCoMo JSON path) and its ``data_digest``
    (sha256, filled in when empty: a changed file is another run), ``conversations``,
    ``questions_per_conversation``, ``max_tokens`` (history tokens per conversation), ``k``
    (turns selected), ``max_new_tokens``, ``arm_names``, ``timing`` (record each arm's wall-clock
    latency; off, records depend only on the seed and index, byte for byte)."""

    name: ClassVar[str] = "memory-eval"
    record_version: ClassVar[int] = 1
    smoke_options: ClassVar[dict] = {
        "data": DEMO_DATA,
        "conversations": 1,
        "questions_per_conversation": 2,
        "max_tokens": 400,
        "k": 2,
        "max_new_tokens": 3,
        "timing": False,
    }

    data: str = ""
    data_digest: str = ""
    conversations: int = 2
    questions_per_conversation: int = 30
    max_tokens: int = 4000
    k: int = 8
    max_new_tokens: int = 24
    arm_names: tuple[str, ...] = ARMS
    timing: bool = True

    def __post_init__(self) -> None:
        self.arm_names = tuple(self.arm_names)
        self._memories: dict = {}
        self._loaded: list | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.validate()

    # ------------------------------------------------------------------ options
    def validate(self) -> None:
        if not self.data:
            raise OptionError("data", self.data, "give the LoCoMo JSON file (e.g. locomo10.json).", flag="--data")
        path = Path(self.data)
        if not path.is_file():
            raise OptionError("data", self.data, "no such file: give the path of a LoCoMo JSON file.", flag="--data")
        digest = sha256_file(path)
        if not self.data_digest:
            self.data_digest = digest
        elif self.data_digest != digest:
            raise EventKVError(
                f"{self.data!r} changed since this run started (sha256 {digest[:12]}, run has "
                f"{self.data_digest[:12]}): use a new --out for the new file."
            )
        check_int("conversations", self.conversations, "evaluate at least 1 conversation.")
        check_int("questions_per_conversation", self.questions_per_conversation, "ask at least 1 question.")
        check_int("max_tokens", self.max_tokens, "keep at least 1 token of history.", minimum=16)
        check_int("k", self.k, "select at least 1 turn.")
        check_max_new_tokens(self.max_new_tokens)
        check_choices("arm_names", self.arm_names, ARMS, required=("rows",), flag="--arms", what="arms")
        n = len(self._conversations())
        if self.conversations > n:
            raise OptionError(
                "conversations", self.conversations, f"{self.data!r} holds {n} conversations: ask for {n} or fewer."
            )

    def _conversations(self):
        """The file's conversations, parsed once per probe (validate and every memory read them)."""
        if self._loaded is None:
            from eventkv.memory.dialogue import load_locomo

            self._loaded = load_locomo(self.data)
        return self._loaded

    def max_items(self) -> int:
        return self.conversations * self.questions_per_conversation

    def check_model(self, rt: Runtime) -> None:
        if rt.max_context is not None and self.max_tokens + 256 > rt.max_context:
            raise OptionError(
                "max_tokens",
                self.max_tokens,
                f"the model's context is {rt.max_context} tokens: keep at most {rt.max_context - 256} of history.",
            )

    def arms(self) -> list[Arm]:
        served = {"rows": "selected", "text": "selected", "isolated": "selected", "full": "all", "gold": "evidence"}
        encoding = {"rows": "compact", "text": "prefill", "isolated": "isolated", "full": "compact", "gold": "prefill"}
        return [Arm(a, served[a], encoding[a], ("generate",)) for a in self.arm_names]

    # ------------------------------------------------------------------ items
    def items(self, seed: int, indices: Sequence[int]) -> list[dict]:
        q = self.questions_per_conversation
        return [{"index": i, "conversation": i // q, "slot": i % q, "seed": seed} for i in indices]

    def _memory(self, rt: Runtime, c: int, seed: int):
        """The conversation's memory (built and prefilled once per run) and its sampled questions."""
        if c not in self._memories:
            from eventkv.memory import EventMemory, MemoryEvent
            from eventkv.memory.dialogue import truncate
            from eventkv.models import LoadedModel

            conv = truncate(self._conversations()[c], rt.tokenizer, self.max_tokens)
            if self._tmp is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="eventkv-memory-eval-")
            lm = LoadedModel(rt.model, rt.tokenizer, rt.profile)
            mem = EventMemory.create(Path(self._tmp.name) / f"c{c}", lm, namespace="eval", instruction=INSTRUCTION)
            mem.add([MemoryEvent(t.event_text(), id=t.id) for t in conv.turns], prefill=True)
            questions = list(conv.questions)
            random.Random(f"memory-eval:{seed}:{c}").shuffle(questions)
            self._memories[c] = (conv, mem, questions[: self.questions_per_conversation])
        return self._memories[c]

    def run_item(self, rt: Runtime, item: dict) -> dict:
        from eventkv.memory.metrics import score_answer

        conv, mem, questions = self._memory(rt, item["conversation"], item["seed"])
        rec = {"index": item["index"], "conversation": conv.id, "slot": item["slot"]}
        if item["slot"] >= len(questions):
            return {**rec, "skipped": f"{len(questions)} eligible questions in the first {self.max_tokens} tokens"}
        qa = questions[item["slot"]]
        prompt = QUESTION.format(question=qa.question)
        selected = mem.select(qa.question, k=self.k)
        plan = {
            "rows": (selected, "compact"),
            "text": (selected, "text"),
            "isolated": (selected, "isolated"),
            "full": ("all", "compact"),
            "gold": (list(qa.evidence), "text"),
        }
        arms, timing = {}, {}
        for arm in self.arm_names:
            served, mode = plan[arm]
            t0 = time.perf_counter()
            ans = mem.query(prompt, select=served, mode=mode, max_new_tokens=self.max_new_tokens)
            timing[arm] = round(1000 * (time.perf_counter() - t0), 3)
            answer = first_line(ans.text)
            score = score_answer(answer, qa.answer, qa.category)
            arms[arm] = {"answer": answer, "f1": score.f1, "em": score.exact, "n_rows": ans.n_rows_served}
        return {
            **rec,
            "question": qa.question,
            "gold": qa.answer,
            "category": qa.category,
            "evidence": list(qa.evidence),
            "selected": list(selected),
            "arms": arms,
            **({"timing": timing} if self.timing else {}),
        }

    # ------------------------------------------------------------------ statistics
    def summarize(self, records: Sequence[dict]) -> Summary:
        return summarize_memory_eval(records, self)

    def figure(self, records: Sequence[dict], path) -> None:
        from eventkv.probes.figures import pyplot, save_figure

        s = self.summarize(records).data
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 3.8))
        arms = [a for a in ARMS if a in s["f1"]]
        est = [s["f1"][a]["estimate"] for a in arms]
        lo = [s["f1"][a]["estimate"] - s["f1"][a]["low"] for a in arms]
        hi = [s["f1"][a]["high"] - s["f1"][a]["estimate"] for a in arms]
        ax.bar(arms, est, yerr=[lo, hi], capsize=4, color="#2b8cbe")
        ax.set_ylabel("token F1 (categories 1-4), cluster bootstrap 95%")
        ax.set_ylim(0, 1)
        ax.set_title(f"memory eval: {s['n_questions']} questions, {s['n_conversations']} conversations")
        save_figure(fig, path)


def _with_ci(b) -> str:
    """``mean [low, high]`` of a cluster bootstrap; with one cluster there is no interval to give."""
    if b is None:
        return "n/a"
    if b.n_clusters < 2:
        return f"{b.estimate:.3f} [n/a: one conversation]"
    return f"{b.estimate:.3f} [{b.low:.3f}, {b.high:.3f}]"


def summarize_memory_eval(records: Sequence[dict], probe: MemoryEval | None = None) -> Summary:
    """Tables: F1 / EM per arm (categories 1-4, cluster-bootstrap 95% intervals; per category;
    category 5 apart), paired differences rows - text and rows - isolated, latency p50/p95 (ms)."""
    from eventkv.stats import cluster_bootstrap

    done = [r for r in records if "arms" in r]
    main = [r for r in done if r["category"] in (1, 2, 3, 4)]
    adversarial = [r for r in done if r["category"] == 5]
    arms = [a for a in ARMS if done and a in done[0]["arms"]]
    clusters = [r["conversation"] for r in main]
    data: dict = {
        "n_questions": len(main),
        "n_adversarial": len(adversarial),
        "n_skipped": len(records) - len(done),
        "n_conversations": len(set(clusters)),
        "f1": {},
        "em": {},
        "paired": {},
        "latency_ms": {},
    }
    rows = []
    for a in arms:
        f1 = [r["arms"][a]["f1"] for r in main]
        em = [float(r["arms"][a]["em"]) for r in main]
        b = cluster_bootstrap(f1, clusters) if f1 else None
        data["f1"][a] = b.__dict__ if b else None
        data["em"][a] = float(np.mean(em)) if em else None
        by_cat = []
        for c in (1, 2, 3, 4):
            xs = [r["arms"][a]["f1"] for r in main if r["category"] == c]
            by_cat.append(f"{np.mean(xs):.3f} ({len(xs)})" if xs else "n/a")
        adv = [r["arms"][a]["f1"] for r in adversarial]
        rows.append(
            [
                a,
                _with_ci(b),
                f"{np.mean(em):.3f}" if em else "n/a",
                *by_cat,
                f"{np.mean(adv):.3f} ({len(adv)})" if adv else "n/a",
            ]
        )
    tables = [
        Table(
            "Token F1 by arm (categories 1-4; cluster bootstrap 95%, clusters = conversations)",
            ["arm", "F1 [95%]", "EM", *[f"{c} {CATEGORIES[c]} (n)" for c in (1, 2, 3, 4)], "5 adversarial (n)"],
            rows,
        )
    ]
    paired_rows = []
    for other in ("text", "isolated"):
        if "rows" in arms and other in arms and main:
            diff = [r["arms"]["rows"]["f1"] - r["arms"][other]["f1"] for r in main]
            b = cluster_bootstrap(diff, clusters)
            data["paired"][f"rows-{other}"] = b.__dict__
            paired_rows.append(
                [f"rows - {other}", f"{b.estimate:+.3f}", f"[{b.low:+.3f}, {b.high:+.3f}]", str(len(diff))]
            )
    if paired_rows:
        tables.append(
            Table("Paired F1 differences (same questions)", ["difference", "mean", "95% CI", "n"], paired_rows)
        )
    lat_rows = []
    for a in arms:
        ms = [r["timing"][a] for r in done if a in r.get("timing", {})]
        if ms:
            p50, p95 = (float(x) for x in np.percentile(ms, [50, 95]))
            data["latency_ms"][a] = {"p50": p50, "p95": p95, "n": len(ms)}
            lat_rows.append([a, f"{p50:.0f}", f"{p95:.0f}", str(len(ms))])
    if lat_rows:
        tables.append(
            Table(
                "Per-query latency (ms, wall clock; the one global prefill excluded)",
                ["arm", "p50", "p95", "n"],
                lat_rows,
            )
        )
    n_conv = data["n_conversations"]
    title = (
        f"memory-eval: {len(main)} questions (categories 1-4) from {n_conv} conversation{'s' if n_conv != 1 else ''}"
        + (f", {len(adversarial)} adversarial" if adversarial else "")
        + (f", {data['n_skipped']} slots skipped" if data["n_skipped"] else "")
    )
    notes = [
        "rows: BM25 top-k turns served from the one global prefill; text: the same turns re-prefilled as text; "
        "isolated: the same turns each encoded alone; full: the whole truncated history; gold: the evidence turns "
        "as text.",
        "F1 and EM: LoCoMo's token F1 after its answer normalization (eventkv.memory.metrics).",
        "Category 5 (adversarial) scores 1 only when the answer abstains ('not mentioned', 'no information "
        "available'); the prompt does not ask for those phrases, so that column is reported apart and is not "
        "comparable with the others.",
    ]
    if 1 < n_conv < 5:
        notes.append(
            f"With {n_conv} conversations the cluster bootstrap draws from only {n_conv**n_conv} ordered "
            "resamples of whole conversations: its intervals show the spread between these conversations, not a "
            "95% interval for the population of dialogues; evaluate more conversations for that."
        )
    return Summary(title, tables, notes=notes, data=data)
