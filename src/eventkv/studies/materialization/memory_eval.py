"""``eventkv memory eval``: EventMemory on real multi-session dialogue (LoCoMo), against the
baselines an agent-memory user would reach for (Study 1, "Real dialogue").

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

The question is asked as LoCoMo's own evaluation asks it (its ``task_eval`` scripts): a category-2
(temporal) question gets the suffix "Use DATE of CONVERSATION to answer with an approximate date.".
A category-5 (adversarial) question asks about something the conversation does not contain; besides
the generated answer, each arm scores the forced choice LoCoMo offers there — "Not mentioned in the
conversation" against the adversarial answer (full-continuation log-probs, nats) — and abstains
when the first is more likely.

By default (``batch_arms``) the arms' served caches are read out in one batched pass
(:meth:`EventMemory.query_batch`: equal to separate readouts within float tolerance, and on a CPU
about one decode instead of five); ``isolated`` encodes each turn alone once per conversation and
reuses it for later questions (what a chunked-encoding store keeps).

Metric: LoCoMo's token F1 and exact match after its answer normalization
(:mod:`eventkv.memory.metrics`), by category 1-4; the adversarial category 5 is reported apart, as
the forced-choice abstention rate with a Wilson interval.
Statistics: the mean F1 per arm with a cluster-bootstrap 95% interval (clusters = conversations,
:func:`eventkv.stats.cluster_bootstrap`), the paired differences rows - text and rows - isolated
with their intervals and a question-level Wilcoxon signed-rank test (which treats questions as
independent, so it is the optimistic companion of the bootstrap), tokens generated per arm, and
latency p50/p95 (ms, wall clock: in the records' ``timing``, never compared on resume) of building
each arm's served cache and of the readout.

Item ``i`` is question slot ``i % Q`` of conversation ``i // Q`` (``Q`` questions per
conversation, drawn with the seed from the conversation's eligible questions); a conversation
with fewer eligible questions records the missing slots as ``skipped``.
"""

from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np

from eventkv.errors import OptionError
from eventkv.options import DIALOGUE_FORMATS, check_choices, check_int, check_max_new_tokens
from eventkv.probes.base import Arm, Probe, Runtime, Summary, Table
from eventkv.studies.materialization.dialogue_data import DialogueData

ARMS = ("rows", "text", "isolated", "full", "gold")
#: a tiny LoCoMo-format file of invented dialogue shipped with eventkv (smoke tests, a first try)
DEMO_DATA = str(files("eventkv") / "data" / "locomo-demo.json")
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
INSTRUCTION = (
    "The events below are the turns of a conversation, in order, each with its session date and speaker. "
    "Answer questions about the conversation."
)
QUESTION = "Question: {question}\nAnswer in a few words, using the conversation's own words where possible."
#: LoCoMo's evaluation scripts (task_eval) append this to category-2 (temporal) questions
TEMPORAL_SUFFIX = " Use DATE of CONVERSATION to answer with an approximate date."
#: LoCoMo's category-5 forced choice: this abstention against the question's adversarial answer
NOT_MENTIONED = "Not mentioned in the conversation"


def question_prompt(question: str, category: int) -> str:
    """The question as the eval asks it (LoCoMo's category-2 suffix; :data:`QUESTION`)."""
    return QUESTION.format(question=question + (TEMPORAL_SUFFIX if category == 2 else ""))


def first_line(text: str) -> str:
    """The first non-empty line of a generation, stripped (the short answer)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


@dataclass
class MemoryEval(DialogueData, Probe):
    """Options (all part of a run's identity): ``data`` (LoCoMo JSON path) and its ``data_digest``
    (sha256, filled in when empty: a changed file is another run), ``conversations``,
    ``questions_per_conversation``, ``max_tokens`` (history tokens per conversation), ``k``
    (turns selected), ``max_new_tokens``, ``arm_names``, ``batch_arms`` (read the arms out in one
    batch; off, one readout per arm, so each arm's latency is its own), ``timing`` (record wall-clock
    latencies; off, records depend only on the seed and index, byte for byte)."""

    name: ClassVar[str] = "memory-eval"
    record_version: ClassVar[int] = 2
    smoke_options: ClassVar[dict] = {
        "data": DEMO_DATA,
        "conversations": 1,
        "questions_per_conversation": 2,
        "max_tokens": 400,
        "k": 2,
        "max_new_tokens": 3,
        "timing": False,
    }

    conversations: int = 2
    questions_per_conversation: int = 30
    max_tokens: int = 4000
    k: int = 8
    max_new_tokens: int = 24
    arm_names: tuple[str, ...] = ARMS
    batch_arms: bool = True
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
        self.pin_data_digest(path)
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
            self._loaded = DIALOGUE_FORMATS.get("locomo")(self.data)
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
        prompt = question_prompt(qa.question, qa.category)
        trap = (qa.adversarial_answer or qa.answer) if qa.category == 5 else None
        candidates = [NOT_MENTIONED, trap] if trap and trap.strip() and trap != NOT_MENTIONED else None
        selected = mem.select(qa.question, k=self.k)
        plan = {
            "rows": (selected, "compact"),
            "text": (selected, "text"),
            "isolated": (selected, "isolated"),
            "full": ("all", "compact"),
            "gold": (list(qa.evidence), "text"),
        }
        ask = {"candidates": candidates, "max_new_tokens": self.max_new_tokens}
        groups = [list(self.arm_names)] if self.batch_arms else [[a] for a in self.arm_names]
        answers, serve_ms, readout_ms = {}, {}, {}
        for group in groups:
            for arm, ans in zip(group, mem.query_batch(prompt, [plan[a] for a in group], **ask)):
                answers[arm] = ans
                serve_ms[arm] = round(ans.timings_ms["serve"], 3)
                readout_ms[arm] = round(ans.timings_ms["decode"], 3)
        arms = {}
        for arm in self.arm_names:
            ans = answers[arm]
            answer = first_line(ans.text)
            score = score_answer(answer, qa.answer, qa.category)
            arms[arm] = {
                "answer": answer,
                "f1": score.f1,
                "em": score.exact,
                "n_rows": ans.n_rows_served,
                "n_tokens": len(ans.generation.tokens),
            }
            if candidates:
                margin = ans.candidates[0].logprob - ans.candidates[1].logprob
                arms[arm]["abstain_margin"] = round(margin, 6)
                arms[arm]["abstains"] = margin > 0
        return {
            **rec,
            "question": qa.question,
            "gold": qa.answer,
            "category": qa.category,
            "evidence": list(qa.evidence),
            "selected": list(selected),
            **({"choice": candidates} if candidates else {}),
            "arms": arms,
            **({"timing": {"serve": serve_ms, "readout": readout_ms}} if self.timing else {}),
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
    return "n/a" if b is None else b.interval(single="one conversation")


def summarize_memory_eval(records: Sequence[dict], probe: MemoryEval | None = None) -> Summary:
    """Tables: F1 / EM per arm (categories 1-4, cluster-bootstrap 95% intervals; per category;
    category 5 apart), paired differences rows - text and rows - isolated, latency p50/p95 (ms)."""
    from eventkv.stats import cluster_bootstrap, format_p, wilcoxon_d, wilson

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
        "abstention": {},
        "n_tokens": {},
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
        chose = [r["arms"][a]["abstains"] for r in adversarial if "abstains" in r["arms"][a]]
        if chose:
            w = wilson(sum(chose), len(chose))
            data["abstention"][a] = {"k": w.k, "n": w.n, "rate": w.rate, "low": w.low, "high": w.high}
        rows.append(
            [
                a,
                _with_ci(b),
                f"{np.mean(em):.3f}" if em else "n/a",
                *by_cat,
                f"{np.mean(adv):.3f} ({len(adv)})" if adv else "n/a",
                wilson(sum(chose), len(chose)).describe(2) if chose else "n/a",
            ]
        )
    tables = [
        Table(
            "Token F1 by arm (categories 1-4; cluster bootstrap 95%, clusters = conversations)",
            [
                "arm",
                "F1 [95%]",
                "EM",
                *[f"{c} {CATEGORIES[c]} (n)" for c in (1, 2, 3, 4)],
                "5: answer abstains (n)",
                "5: chooses 'not mentioned' [Wilson 95%]",
            ],
            rows,
        )
    ]
    paired_rows = []
    for other in ("text", "isolated"):
        if "rows" in arms and other in arms and main:
            diff = [r["arms"]["rows"]["f1"] - r["arms"][other]["f1"] for r in main]
            b = cluster_bootstrap(diff, clusters)
            w = wilcoxon_d(diff, what=f"F1 rows - {other}")
            data["paired"][f"rows-{other}"] = {
                **b.__dict__,
                "wilcoxon_p": w.p_value,
                "n_nonzero": w.counts["n"],
                "better": sum(x > 0 for x in diff),
                "worse": sum(x < 0 for x in diff),
            }
            paired_rows.append(
                [
                    f"rows - {other}",
                    f"{b.estimate:+.3f}",
                    f"[{b.low:+.3f}, {b.high:+.3f}]",
                    f"{sum(x > 0 for x in diff)}:{sum(x < 0 for x in diff)}",
                    "n/a" if w.p_value != w.p_value else format_p(w.p_value),
                    str(len(diff)),
                ]
            )
    if paired_rows:
        tables.append(
            Table(
                "Paired F1 differences (same questions)",
                ["difference", "mean", "95% CI (cluster bootstrap)", "better:worse", "Wilcoxon p (questions)", "n"],
                paired_rows,
            )
        )
    lat_rows = []
    timed = [r for r in done if "serve" in r.get("timing", {})]
    batched = bool(timed) and all(len(set(r["timing"]["readout"].values())) == 1 for r in timed) and len(arms) > 1
    for a in arms:
        toks = [r["arms"][a]["n_tokens"] for r in done]
        data["n_tokens"][a] = float(np.mean(toks)) if toks else None
        serve = [r["timing"]["serve"][a] for r in timed]
        readout = [r["timing"]["readout"][a] for r in timed]
        if serve:
            s50, s95 = (float(x) for x in np.percentile(serve, [50, 95]))
            r50, r95 = (float(x) for x in np.percentile(readout, [50, 95]))
            data["latency_ms"][a] = {"serve_p50": s50, "serve_p95": s95, "readout_p50": r50, "readout_p95": r95}
            lat_rows.append(
                [a, f"{s50:.0f}", f"{s95:.0f}", f"{r50:.0f}", f"{r95:.0f}", f"{np.mean(toks):.1f}", str(len(serve))]
            )
    if lat_rows:
        tables.append(
            Table(
                "Per-question latency (ms, wall clock; the one global prefill excluded)"
                + (": the arms are read out in one batch, so the readout time is shared" if batched else ""),
                ["arm", "serve p50", "serve p95", "readout p50", "readout p95", "tokens generated (mean)", "n"],
                lat_rows,
            )
        )
    data["batched_readout"] = batched
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
        "Category 5 (adversarial): 'answer abstains' scores the generated answer by LoCoMo's keyword rule "
        "('not mentioned', 'no information available'), which the free-form prompt does not invite; 'chooses' is "
        "LoCoMo's forced choice between 'Not mentioned in the conversation' and the adversarial answer, by "
        "log-probability. Both are reported apart from the F1 of categories 1-4.",
        "serve: building the arm's served cache (rows: select and copy; text and gold: prefill the turns; "
        "isolated: encode each turn alone, once per conversation; full: copy every row); readout: the question, "
        "the greedy answer and the category-5 scoring.",
        "Wilcoxon p treats the questions as independent (zero differences dropped); the cluster bootstrap "
        "resamples conversations. Neither corrects for the two comparisons.",
    ]
    if 1 < n_conv < 5:
        notes.append(
            f"With {n_conv} conversations the cluster bootstrap draws from only {n_conv**n_conv} ordered "
            "resamples of whole conversations: its intervals show the spread between these conversations, not a "
            "95% interval for the population of dialogues; evaluate more conversations for that."
        )
    return Summary(title, tables, notes=notes, data=data)
