"""``eventkv harvest``: passive harvesting on real dialogue (Study 1, "Real
dialogs"). Do natural later turns, served as rows from one global prefill of the conversation,
carry an earlier answer better than the same turns encoded alone?

Per conversation (truncated to its first ``max_tokens`` tokens of turns, questions kept only when
their evidence lies inside; one global prefill of header + every turn):

* questions of categories 1-3 with a non-empty gold answer whose evidence turns resolve;
* the **evidence session** is the session of the last evidence turn; **carrier candidates** are the
  turns of later sessions that are not evidence, share >= 2 content words with the question (BM25's
  tokens: lowercased words of >= 2 characters, English stopwords removed), and contain the gold
  answer (normalized) neither in themselves nor in their neighbouring turns (+-1);
* a candidate is **strong** when a shared word is rare: it occurs in at most two sessions;
* the top four by a fixed rank — more shared words first, then strong first, then the rarest
  shared word, then the earlier turn — are served; a question with no candidate is skipped;
* arms: ``none`` (the header alone + question), ``text`` (the carriers as text), ``isolated`` (each
  carrier encoded alone at its original positions), ``harvested`` (the carriers' rows from the
  global prefill, compact, original positions), ``gold`` (the evidence turns as text); evidence is
  never served in the first four;
* readouts: a short greedy answer scored by LoCoMo's token F1, and a **forced choice** between the
  gold answer and a **hard negative** — the gold answer of the nearest other question (by index) in
  the same conversation whose normalized answer differs — both named in the question, in an order
  fixed by a hash of the question, scored by full-continuation log-probabilities (nats).

Primary contrast: forced-choice accuracy harvested - isolated on the strong stratum, with a cluster
bootstrap over conversations and a TOST equivalence test (margin ``tost_margin``, default 0.05) on
the conversations' mean differences; secondary: harvested - text, every arm vs none and vs gold.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np

from eventkv.errors import OptionError
from eventkv.options import DIALOGUE_FORMATS
from eventkv.probes.base import Arm, Probe, Runtime, Summary, Table
from eventkv.studies.materialization.dialogue_data import DialogueData

ARMS = ("none", "text", "isolated", "harvested", "gold")
TOP = 4
INSTRUCTION = (
    "The events below are turns of a conversation, each with its session date and speaker. Answer questions "
    "about the conversation."
)
QUESTION = "Question: {question}\nAnswer in a few words."
CHOICE = "Question: {question}\nOptions: {first} / {second}\nAnswer with one of the options."


def content_words(text: str) -> set[str]:
    """The content words of ``text`` (BM25's tokens: :func:`eventkv.memory.select.tokens`)."""
    from eventkv.memory.select import tokens

    return set(tokens([text])[0])


def carriers(conv, qa, rare_sessions: int = 2) -> tuple[list[dict], int]:
    """The carrier candidates of one question (module docstring), ranked, and the evidence session.

    Returns:
        ``(candidates, evidence_session)``; each candidate ``{"id", "index", "shared", "strong", "rarity"}``.
    """
    from eventkv.studies.materialization.answer_metric import normalize_answer

    turns = conv.turns
    index = {t.id: i for i, t in enumerate(turns)}
    ev_session = max(turns[index[e]].session for e in qa.evidence)
    gold = normalize_answer(qa.answer)
    q_words = content_words(qa.question)
    sessions_of: dict[str, set[int]] = {}
    words = [content_words(t.text) for t in turns]
    for t, ws in zip(turns, words):
        for w in ws:
            sessions_of.setdefault(w, set()).add(t.session)
    out = []
    for i, t in enumerate(turns):
        if t.session <= ev_session or t.id in qa.evidence:
            continue
        shared = q_words & words[i]
        if len(shared) < 2:
            continue
        window = turns[max(0, i - 1) : i + 2]
        if gold and any(gold in normalize_answer(x.text) for x in window):
            continue
        rarity = min(len(sessions_of[w]) for w in shared)
        out.append(
            {"id": t.id, "index": i, "shared": sorted(shared), "strong": rarity <= rare_sessions, "rarity": rarity}
        )
    out.sort(key=lambda c: (-len(c["shared"]), not c["strong"], c["rarity"], c["index"]))
    return out, ev_session


def hard_negative(conv, k: int) -> str | None:
    """The gold answer of the nearest other question (by index; the earlier one on a tie) whose
    normalized answer is non-empty and differs from question ``k``'s."""
    from eventkv.studies.materialization.answer_metric import normalize_answer

    gold = normalize_answer(conv.questions[k].answer)
    n = len(conv.questions)
    for dist in range(1, n):
        for j in (k - dist, k + dist):
            if 0 <= j < n:
                other = conv.questions[j].answer
                if normalize_answer(other) and normalize_answer(other) != gold:
                    return other
    return None


@dataclass
class Harvest(DialogueData, Probe):
    """Options (all part of a run's identity): ``data`` and its digest, ``data_format``
    (``locomo`` | ``realtalk``), ``max_tokens``, ``max_new_tokens``, ``tost_margin``, ``max_questions``
    (questions per conversation at most, in file order; 0 = all)."""

    name: ClassVar[str] = "harvest"
    record_version: ClassVar[int] = 1
    smoke_options: ClassVar[dict] = {
        "data": str(files("eventkv") / "data" / "locomo-demo.json"),
        "max_tokens": 600,
        "max_new_tokens": 3,
    }

    data_format: str = "locomo"
    max_tokens: int = 4000
    max_new_tokens: int = 16
    tost_margin: float = 0.05
    max_questions: int = 0

    def __post_init__(self) -> None:
        self._loaded = None
        self._convs: dict = {}
        self.validate()

    def validate(self) -> None:
        from eventkv.options import check_int

        if self.data_format not in DIALOGUE_FORMATS:
            raise DIALOGUE_FORMATS.unknown(self.data_format)
        if not self.data or not Path(self.data).exists():
            raise OptionError("data", self.data, "give the path of the dialogue data.", flag="--data")
        self.pin_data_digest()
        check_int("max_tokens", self.max_tokens, "keep at least 16 tokens of history.", minimum=16, flag="--max-tokens")
        check_int("max_new_tokens", self.max_new_tokens, "generate at least 1 token.", flag="--max-new-tokens")
        check_int("max_questions", self.max_questions, "give 0 (all) or more.", minimum=0, flag="--max-questions")
        if isinstance(self.tost_margin, bool) or not 0 < float(self.tost_margin) < 1:
            raise OptionError("tost_margin", self.tost_margin, "give a margin in (0, 1).", flag="--tost-margin")

    def conversations(self):
        if self._loaded is None:
            read = DIALOGUE_FORMATS.get(self.data_format)  # realtalk: a file or a folder
            self._loaded = read(self.data)
        return self._loaded

    def max_items(self) -> int:
        return len(self.conversations())

    def check_model(self, rt: Runtime) -> None:
        if rt.max_context is not None and self.max_tokens + 512 > rt.max_context:
            raise OptionError(
                "max_tokens",
                self.max_tokens,
                f"the model's context is {rt.max_context} tokens: keep at most {rt.max_context - 512} of history "
                "(the header, the question and the answer need the rest).",
                flag="--max-tokens",
            )

    def arms(self) -> list[Arm]:
        enc = {"none": "prefill", "text": "prefill", "isolated": "isolated", "harvested": "compact", "gold": "prefill"}
        return [Arm(a, "carriers" if a not in ("none", "gold") else a, enc[a], ("generate", "logits")) for a in ARMS]

    def items(self, seed: int, indices: Sequence[int]) -> list[dict]:
        return [{"index": i, "conversation": i} for i in indices]  # one item = one conversation (its questions)

    def run_item(self, rt: Runtime, item: dict) -> dict:
        from eventkv.kv.log import Event, EventLog, tokenize, tokenize_query
        from eventkv.kv.prefill import prefill
        from eventkv.kv.readout import read_out
        from eventkv.kv.serve import ServedCache, serve
        from eventkv.models.encoding import encode
        from eventkv.studies.materialization.answer_metric import token_f1
        from eventkv.studies.materialization.dialogue import truncate

        whole = self.conversations()[item["conversation"]]
        conv = truncate(whole, rt.tokenizer, self.max_tokens)
        log = tokenize(
            EventLog([Event(t.id, t.event_text()) for t in conv.turns], instruction=INSTRUCTION),
            rt.tokenizer,
            rt.profile,
        )
        ekv = prefill(rt.model, log, max_context=rt.max_context)
        h = len(log.header_ids)
        header = ServedCache(
            [k[:, :, :h] for k in ekv.keys], [v[:, :, :h] for v in ekv.values], ekv.positions[:h], None, h, "text", ()
        )
        iso_memo: dict = {}
        outside = len(whole.questions) - len(conv.questions)  # evidence beyond max_tokens, or none / unresolved
        questions = []
        skipped = {"outside_window": outside, "category": 0, "no_answer": 0, "no_candidate": 0, "no_negative": 0}
        qs = conv.questions[: self.max_questions] if self.max_questions else conv.questions
        skipped["over_max_questions"] = len(conv.questions) - len(qs)
        for k, qa in enumerate(qs):
            if qa.category not in (1, 2, 3):
                skipped["category"] += 1
                continue
            if not qa.answer.strip():
                skipped["no_answer"] += 1
                continue
            cands, ev_session = carriers(conv, qa)
            if not cands:
                skipped["no_candidate"] += 1
                continue
            neg = hard_negative(conv, k)
            if neg is None:
                skipped["no_negative"] += 1
                continue
            top = cands[:TOP]
            ids = [c["id"] for c in sorted(top, key=lambda c: c["index"])]
            caches = {
                "none": header,
                "text": serve(ekv, ids, "text", model=rt.model),
                "isolated": serve(ekv, ids, "isolated", model=rt.model, isolated_memo=iso_memo),
                "harvested": serve(ekv, ids, "compact"),
                "gold": serve(ekv, list(qa.evidence), "text", model=rt.model),
            }
            served = [caches[a] for a in ARMS]
            q = tokenize_query(rt.tokenizer, rt.profile, QUESTION.format(question=qa.question))
            gen = read_out(
                rt.model,
                served,
                q,
                generate=[True] * len(ARMS),
                score=[False] * len(ARMS),
                max_new_tokens=self.max_new_tokens,
                stop_token_ids=rt.stop_token_ids,
                tokenizer=rt.tokenizer,
                max_context=rt.max_context,
            )
            flip = int(hashlib.sha256(qa.question.encode()).hexdigest(), 16) % 2 == 1
            first, second = (neg, qa.answer) if flip else (qa.answer, neg)
            cq = tokenize_query(
                rt.tokenizer, rt.profile, CHOICE.format(question=qa.question, first=first, second=second)
            )
            options = [qa.answer, neg]
            scored = read_out(
                rt.model,
                served,
                cq,
                generate=[False] * len(ARMS),
                score=[True] * len(ARMS),
                candidates=[encode(rt.tokenizer, " " + o) for o in options],
                candidate_texts=options,
                max_new_tokens=0,
                max_context=rt.max_context,
            )
            arms = {}
            for a, g, s in zip(ARMS, gen, scored):
                assert g.generation is not None  # asked for with generate=True
                answer = next((x.strip() for x in g.generation.text.splitlines() if x.strip()), "")
                margin = s.candidates[0].logprob - s.candidates[1].logprob
                arms[a] = {
                    "answer": answer,
                    "f1": round(token_f1(answer, qa.answer), 6),
                    "margin": round(margin, 6),
                    "correct": margin > 0,
                }
            questions.append(
                {
                    "k": k,
                    "question": qa.question,
                    "gold": qa.answer,
                    "negative": neg,
                    "category": qa.category,
                    "evidence": list(qa.evidence),
                    "evidence_session": ev_session,
                    "carriers": ids,
                    "strong": any(c["strong"] for c in top),
                    "n_candidates": len(cands),
                    "arms": arms,
                }
            )
        return {
            "index": item["index"],
            "conversation": conv.id,
            "n_questions_in_file": len(whole.questions),
            "n_turns": len(conv.turns),
            "history_end": log.history_end,
            "skipped": skipped,
            "questions": questions,
        }

    def summarize(self, records: Sequence[dict]) -> Summary:
        return summarize_harvest(records, self.tost_margin)

    def figure(self, records: Sequence[dict], path) -> None:
        from eventkv.probes.figures import pyplot, save_figure

        s = self.summarize(records).data
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7, 3.6))
        for j, stratum in enumerate(("all", "strong")):
            acc = s["accuracy"][stratum]
            xs = np.arange(len(ARMS)) + (j - 0.5) * 0.35
            ax.bar(xs, [acc[a]["estimate"] if acc.get(a) else 0 for a in ARMS], 0.35, label=stratum)
        ax.set_xticks(range(len(ARMS)), ARMS)
        ax.set_ylim(0, 1)
        ax.set_ylabel("forced-choice accuracy")
        ax.legend()
        save_figure(fig, path)


def summarize_harvest(records: Sequence[dict], margin: float = 0.05) -> Summary:
    """Forced-choice accuracy and F1 per arm (all questions and the strong stratum; cluster bootstrap
    over conversations), the primary contrast harvested - isolated on the strong stratum (cluster
    bootstrap + TOST on conversation means), harvested - text, every arm vs none and gold."""
    from eventkv.stats import cluster_bootstrap, format_p, tost

    qs = [(r["conversation"], q) for r in records for q in r["questions"]]
    data: dict = {"n_questions": len(qs), "accuracy": {}, "f1": {}, "contrasts": {}}
    rows = []
    for stratum in ("all", "strong"):
        sel = [(c, q) for c, q in qs if stratum == "all" or q["strong"]]
        data["accuracy"][stratum], data["f1"][stratum] = {}, {}
        for a in ARMS:
            if not sel:
                continue
            acc = cluster_bootstrap([float(q["arms"][a]["correct"]) for _, q in sel], [c for c, _ in sel])
            f1 = cluster_bootstrap([q["arms"][a]["f1"] for _, q in sel], [c for c, _ in sel])
            data["accuracy"][stratum][a], data["f1"][stratum][a] = acc.__dict__, f1.__dict__
            rows.append([stratum, a, str(len(sel)), _ci(acc), _ci(f1)])
    tables = [Table("Forced choice and token F1 by arm", ["stratum", "arm", "n", "accuracy [95%]", "F1 [95%]"], rows)]
    crow = []
    strong = [(c, q) for c, q in qs if q["strong"]]
    pairs = [("harvested", "isolated", "strong", True), ("harvested", "text", "strong", False)]
    pairs += [(a, "none", "all", False) for a in ARMS if a != "none"]
    pairs += [(a, "gold", "all", False) for a in ARMS if a not in ("gold", "none")]  # gold - none is above
    for x, y, stratum, primary in pairs:
        sel = strong if stratum == "strong" else qs
        if not sel:
            continue
        diff = [float(q["arms"][x]["correct"]) - float(q["arms"][y]["correct"]) for _, q in sel]
        clusters = [c for c, _ in sel]
        b = cluster_bootstrap(diff, clusters)
        by_conv: dict[str, list[float]] = {}
        for c, d in zip(clusters, diff):
            by_conv.setdefault(c, []).append(d)
        t = tost([float(np.mean(v)) for v in by_conv.values()], margin)
        key = f"{x}-{y}@{stratum}"
        flat = len(set(diff)) == 1  # every question the same difference: no spread to test
        data["contrasts"][key] = {**b.__dict__, "tost_p": t.p, "tost_n": t.n, "primary": primary, "no_spread": flat}
        tost_txt = "n/a" if t.p != t.p else format_p(t.p)
        if flat:
            tost_txt += f" (every difference {diff[0]:+g}: no spread)"
        crow.append(
            [("**primary** " if primary else "") + f"{x} - {y}", stratum, str(len(sel)), _ci(b, signed=True), tost_txt]
        )
    tables.append(
        Table(
            f"Contrasts of forced-choice accuracy (cluster bootstrap over conversations; TOST margin +-{margin} on "
            "conversation means)",
            ["contrast", "stratum", "n", "mean [95%]", "TOST p"],
            crow,
        )
    )
    n_conv = len(records)
    plural = "s" if n_conv != 1 else ""
    notes = [
        "Forced choice: the gold answer vs a hard negative (the nearest other question's answer), both named in the "
        "question, order fixed by a hash; correct when the gold answer's log-probability is higher.",
        "Strong: a carrier shares a word with the question that occurs in at most two sessions.",
        f"{n_conv} conversation{plural}, {sum(r.get('n_questions_in_file', 0) for r in records)} questions in the "
        f"file: {len(qs)} kept; skipped per reason: "
        + ", ".join(
            f"{k} {sum(r['skipped'].get(k, 0) for r in records)}" for k in (records[0]["skipped"] if records else {})
        ),
        "TOST p < 0.05 shows equivalence within the margin; a wide interval with a large TOST p is inconclusive, not a "
        "null. When every question has the same difference the test has no spread: its p is 0 inside the margin (1 "
        "outside) by construction, and the n of questions, not the p, says how much it rests on.",
    ]
    if not qs:
        notes.insert(
            0,
            "WARNING: no question passed the protocol's filters (see the skipped counts): there is no result here; "
            "raise --max-tokens (more sessions after the evidence) or use other data.",
        )
    return Summary(f"harvest: {len(qs)} questions from {n_conv} conversation{plural}", tables, notes=notes, data=data)


def _ci(b, signed: bool = False) -> str:
    return b.interval(signed=signed, single="one conversation")
