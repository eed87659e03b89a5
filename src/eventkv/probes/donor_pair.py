"""The donor-pair probe (Study 1, "Donor pair"): do served rows carry state from an event that
is no longer served?

An item is a **pair** of register histories identical except for the value the **source**
event writes (``register S set to state v`` vs ``v'``). The source slot gets a position budget
equal to its longest tokenization over the two values, so every later event sits at the same
positions in both variants. A later **root** (``register M mirrors register S``) names no value;
a **decoy** (slot 0) writes a value to another register. The source is never served.

Layout (every number an option; slot ``i`` is rendered ``<step i+1>``):
``n_events`` = 24, decoy at slot 0, source in a seeded slot of 8..11, root at slot 13, every
other slot a filler ``register X refreshed to NNN``. Decoy variants:

* ``independent`` (default): one decoy value drawn uniformly from the states, the same in both
  variants (it can equal either variant's value) — the served tokens are byte-identical.
* ``opposite``: each variant's decoy holds the *other* variant's value. The served decoy then
  differs between the variants, so the pair is no longer served-identical and "follow" is
  confounded with decoy elimination; provided to reproduce that confound, flagged in the summary.
* ``none``: the decoy event names no state (``register D completed a routine self-test``).

Arms, all answered from one global prefill per variant (see :meth:`DonorPair.arms`):

* ``kv`` — compact serving of {decoy, root} from the global prefill (the test arm).
* ``isolated`` — the same served set, each event encoded alone after the header at its
  original positions (no materialization possible: with an identical served set this arm's
  cache is the *same* for both variants, so it can only answer constant; d = 0 exactly).
* ``text-all`` — every event: the comprehension arm. It is the global prefill itself continued
  by the query, i.e. the history as text with the log's token rows and position ids (the
  source's budget leaves a gap of a few unused positions; no other difference from plain text).
* ``kv-all`` — every event served through :func:`eventkv.serve.serve` (compact). It is the same
  computation as ``text-all`` (no second prefill, no second readout): the probe checks, per
  variant, that the served rows, their positions and the query position are bitwise those of
  the prefill that ``text-all`` reads, records the result, and the summary reports it. (That the
  KV path reproduces a fresh prefill's logits is the faithfulness gate of ``tests/test_gates.py``.)

Readouts: greedy generation (``max_new_tokens``, with an instruction to end on the state word;
the *last* state word in the output is the answer) and candidate log-probabilities (each state,
with a leading space, scored as the full continuation of the query plus ``answer_prefix``;
the answer is the most probable one).

Per pair and readout: **follow** (each variant answers its own source value), **anti** (each
answers the other's), **constant** (both give the same state), **other** (anything else, e.g. no
state word). From candidate scores: ``d = ½([lo(a|A) - lo(a|B)] + [lo(b|B) - lo(b|A)])`` where
``lo(v|X)`` is the log-odds of state v among the candidates in variant X; for two states both
brackets are equal. d > 0 means the answer leans toward the omitted source's value.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.log import TokenizedLog, tokenize_query
from eventkv.options import check_choices, check_max_new_tokens, check_slots
from eventkv.probes.base import Arm, Probe, Runtime, Summary, Table, register
from eventkv.readout import read_out
from eventkv.serve import ServedCache, serve
from eventkv.stats import format_p, median, require_finite, sign_test, sign_test_d, wilcoxon_d, wilson

NAMES = ("ALPHA", "BETA", "GAMMA", "DELTA", "OMEGA", "SIGMA", "KAPPA", "THETA", "LAMBDA", "EPSILON")
INSTRUCTION = (
    "You are reviewing a completed agent trajectory. Use it to answer the question precisely.\n\n"
    "Task: run register maintenance and report values faithfully.\n\nTrajectory:"
)
QUESTION = (
    "\nQuestion: What state is register {register} in? Answer {menu}. Locate the mirror statement "
    "for that register, then end your answer with the final state word."
)
DECOYS = ("independent", "opposite", "none")
OUTCOMES = ("follow", "anti", "constant", "other")
ARM_NAMES = ("kv", "isolated", "text-all", "kv-all")
VARIANTS = ("A", "B")


def event_text(slot: int, body: str) -> str:
    """One event as the study renders it: ``<step i>`` / ``action: reg_op()`` / ``observation: ...``."""
    return f"<step {slot + 1}>\naction: reg_op()\nobservation: {body}\n"


def menu(states: Sequence[str]) -> str:
    """``"ONLINE or OFFLINE"``; ``"A, B or C"`` for more states."""
    return states[0] if len(states) == 1 else ", ".join(states[:-1]) + " or " + states[-1]


def last_state(text: str, states: Sequence[str]) -> str | None:
    """The last state word in ``text`` (case-insensitive, whole words), in its canonical spelling,
    or None when there is none."""
    alts = "|".join(re.escape(s) for s in sorted(states, key=len, reverse=True))
    hits = list(re.finditer(rf"(?<![A-Za-z0-9])({alts})(?![A-Za-z0-9])", text, flags=re.IGNORECASE))
    if not hits:
        return None
    word = hits[-1].group(1).upper()
    return next(s for s in states if s.upper() == word)


def outcome(answer_a: str | None, answer_b: str | None, a: str, b: str) -> str:
    """Pair outcome from the two variants' answers (variant A's source wrote ``a``, B's ``b``)."""
    if answer_a == a and answer_b == b:
        return "follow"
    if answer_a == b and answer_b == a:
        return "anti"
    if answer_a is not None and answer_a == answer_b:
        return "constant"
    return "other"


def log_odds(logprobs: dict[str, float], state: str) -> float:
    """log-odds of ``state`` among the candidates: ``lp(state) - logsumexp(lp(others))`` (nats)."""
    others = [v for k, v in logprobs.items() if k != state]
    m = max(others)
    return logprobs[state] - (m + math.log(sum(math.exp(v - m) for v in others)))


def donor_d(lp_a: dict[str, float], lp_b: dict[str, float], a: str, b: str) -> float:
    """The continuous donor statistic d of one pair (see the module docstring)."""
    return 0.5 * ((log_odds(lp_a, a) - log_odds(lp_b, a)) + (log_odds(lp_b, b) - log_odds(lp_a, b)))


@register
@dataclass
class DonorPair(Probe):
    """Donor pairs over register histories (Study 1, "Donor pair"). Fields are the options."""

    name: ClassVar[str] = "donor-pair"
    smoke_options: ClassVar[dict] = {"max_new_tokens": 4}

    n_events: int = 24
    decoy_slot: int = 0
    source_slots: tuple[int, int] = (8, 11)
    root_slot: int = 13
    decoy: str = "independent"
    states: tuple[str, ...] = ("ONLINE", "OFFLINE")
    registers: tuple[str, ...] = NAMES
    readout: str = "both"
    max_new_tokens: int = 64
    arm_names: tuple[str, ...] = ARM_NAMES
    instruction: str = INSTRUCTION
    question: str = QUESTION
    answer_prefix: str = "Answer:"

    def __post_init__(self) -> None:
        self.source_slots = tuple(self.source_slots)
        self.states = tuple(self.states)
        self.registers = tuple(self.registers)
        self.arm_names = tuple(self.arm_names)
        self.validate()

    # ------------------------------------------------------------------ recipe
    def validate(self) -> None:
        check_slots(
            n_events=self.n_events, decoy_slot=self.decoy_slot, source_slots=self.source_slots, root_slot=self.root_slot
        )
        n, lo, hi = self.n_events, *self.source_slots
        if n < 3:
            raise OptionError("n_events", n, "a donor pair needs at least 3 events (decoy, source, root).")
        for what, s in (
            ("decoy_slot", self.decoy_slot),
            ("root_slot", self.root_slot),
            ("source_slots", self.source_slots),
        ):
            if not all(0 <= v < n for v in (s if isinstance(s, tuple) else (s,))):
                raise OptionError(what, s, f"outside the history's slots 0..{n - 1}: choose slots below n_events={n}.")
        if lo > hi:
            raise OptionError("source_slots", self.source_slots, "the first slot must not exceed the last (e.g. 8-11).")
        if not hi < self.root_slot:
            raise OptionError(
                "root_slot", self.root_slot, f"the root must come after every source slot (last {hi}): move it later."
            )
        if lo <= self.decoy_slot <= hi or self.decoy_slot == self.root_slot:
            raise OptionError(
                "decoy_slot",
                self.decoy_slot,
                f"collides with the source slots {lo}-{hi} or the root {self.root_slot}: move it.",
            )
        if self.decoy not in DECOYS:
            raise OptionError("decoy", self.decoy, f"use one of {', '.join(DECOYS)}.")
        if (
            len(self.states) < 2
            or not all(isinstance(s, str) and s.strip() for s in self.states)
            or len(set(s.upper() for s in self.states)) != len(self.states)
        ):
            raise OptionError("states", self.states, "give at least two distinct state words (e.g. ONLINE,OFFLINE).")
        if len(set(self.registers)) < 4:
            raise EventKVError("registers: give at least 4 distinct register names (decoy, source, root and a filler).")
        if self.readout not in ("generate", "logits", "both"):
            raise OptionError("readout", self.readout, "use generate, logits or both.")
        check_max_new_tokens(self.max_new_tokens)
        check_choices("arm_names", self.arm_names, ARM_NAMES, required=("kv",), flag="--arms", what="arms")
        if "kv-all" in self.arm_names and "text-all" not in self.arm_names:
            raise OptionError(
                "arm_names",
                self.arm_names,
                "kv-all is checked against text-all; add text-all or drop kv-all.",
                flag="--arms",
            )

    @property
    def readouts(self) -> tuple[str, ...]:
        return ("generate", "logits") if self.readout == "both" else (self.readout,)

    def arms(self) -> list[Arm]:
        ro = self.readouts
        table = {
            "kv": Arm("kv", ("decoy", "root"), "compact", ro, "global prefill, compact serving of {decoy, root}"),
            "isolated": Arm("isolated", ("decoy", "root"), "isolated", ro, "{decoy, root}, each encoded alone"),
            "text-all": Arm("text-all", "all", "prefill", ro, "all events as text: comprehension"),
            "kv-all": Arm("kv-all", "all", "compact", (), "all events via serve(): rows checked equal to text-all's"),
        }
        return [table[a] for a in ARM_NAMES if a in self.arm_names]

    def items(self, seed: int, indices: Sequence[int]) -> list[dict]:
        return [self._item(seed, i) for i in indices]

    def _item(self, seed: int, index: int) -> dict:
        rng = random.Random(f"donor-pair:{seed}:{index}")
        dec, src, root = rng.sample(self.registers, 3)
        slot = rng.randint(*self.source_slots)
        a, b = rng.sample(self.states, 2)
        if self.decoy == "independent":
            d = rng.choice(self.states)
            decoys = [d, d]
        elif self.decoy == "opposite":
            decoys = [b, a]
        else:
            decoys = [None, None]
        others = [r for r in self.registers if r not in (dec, src, root)]
        fill = {
            i: f"register {rng.choice(others)} refreshed to {rng.randrange(100, 1000)}" for i in range(self.n_events)
        }
        events = []
        for value, dv in zip((a, b), decoys):
            body = dict(fill)
            body[self.decoy_slot] = (
                f"register {dec} set to state {dv}"
                if dv is not None
                else f"register {dec} completed a routine self-test"
            )
            body[slot] = f"register {src} set to state {value}"
            body[self.root_slot] = f"register {root} mirrors register {src}"
            events.append([event_text(i, body[i]) for i in range(self.n_events)])
        return {
            "index": index,
            "registers": {"decoy": dec, "source": src, "root": root},
            "source_slot": slot,
            "values": [a, b],
            "decoy_values": decoys,
            "events": events,
            "question": self.question.format(register=root, menu=menu(self.states)),
        }

    @staticmethod
    def event_id(slot: int) -> str:
        return f"e{slot:02d}"

    # ------------------------------------------------------------------ running
    def run_item(self, rt: Runtime, item: dict) -> dict:
        """Prefill the pair (header reused, shared part once, each variant's remainder once),
        build every arm's served cache, answer all of them in one batched readout, and return the
        pair's record."""
        ids = [self.event_id(i) for i in range(self.n_events)]
        header = rt.header_ids(self.instruction)
        toks = [[rt.encode(t) for t in ev] for ev in item["events"]]
        budgets = [
            max(len(toks[0][i]), len(toks[1][i])) if toks[0][i] != toks[1][i] else None for i in range(self.n_events)
        ]
        logs = [TokenizedLog(header, ids, toks[v], budgets) for v in (0, 1)]
        shared = next(i for i in range(self.n_events) if toks[0][i] != toks[1][i])
        prefix = rt.header_kv(self.instruction)
        if shared > 0:
            prefix = rt.prefill(TokenizedLog(header, ids[:shared], toks[0][:shared], budgets[:shared]), prefix=prefix)
        ekvs = [rt.prefill(log, prefix=prefix) for log in logs]

        served_ids = [self.event_id(self.decoy_slot), self.event_id(self.root_slot)]
        served_identical = all(toks[0][s] == toks[1][s] for s in (self.decoy_slot, self.root_slot))
        arms = {a.name: a for a in self.arms()}
        entries: list[tuple[str, tuple[int, ...], ServedCache]] = []  # (arm, variants answered, cache)
        for v, ekv in enumerate(ekvs):
            entries.append(("kv", (v,), serve(ekv, served_ids, "compact")))
            entries.append(
                (
                    "text-all",
                    (v,),
                    ServedCache(ekv.keys, ekv.values, ekv.positions, None, ekv.log.history_end, "prefill", tuple(ids)),
                )
            )
        if "isolated" in arms:
            if served_identical:  # identical served tokens at identical positions: one encoding answers both
                entries.append(("isolated", (0, 1), serve(ekvs[0], served_ids, "isolated", model=rt.model)))
            else:
                entries += [("isolated", (v,), serve(ekvs[v], served_ids, "isolated", model=rt.model)) for v in (0, 1)]
        entries = [e for e in entries if e[0] in arms and e[0] != "kv-all"]
        check = None
        if "kv-all" in arms:  # kv-all: every event served through serve(); same rows => same readouts as text-all
            same = []
            for ekv in ekvs:
                s = serve(ekv, "all", "compact")
                same.append(
                    s.next_position == ekv.log.history_end
                    and torch.equal(s.positions, ekv.positions)
                    and all(torch.equal(x, y) for x, y in zip(s.keys + s.values, ekv.keys + ekv.values))
                )
            check = {"rows_and_positions_equal": all(same)}

        query = tokenize_query(rt.tokenizer, rt.profile, item["question"])
        cands = [rt.encode(" " + s) for s in self.states]
        results = read_out(
            rt.model,
            [e[2] for e in entries],
            query,
            generate=["generate" in arms[e[0]].readouts for e in entries],
            score=["logits" in arms[e[0]].readouts for e in entries],
            candidates=cands,
            candidate_texts=list(self.states),
            answer_prefix_ids=rt.encode(self.answer_prefix),
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=rt.stop_token_ids,
            tokenizer=rt.tokenizer,
            max_context=rt.max_context,
        )

        answers: dict[str, list[dict | None]] = {a: [None, None] for a in arms}
        for (arm, variants, _), res in zip(entries, results):
            out: dict = {}
            if res.generation is not None:
                g = res.generation
                out.update(
                    text=g.text, n_tokens=len(g.tokens), stopped=g.stopped, answer=last_state(g.text, self.states)
                )
            if res.candidates:
                lps = {c.text: c.logprob for c in res.candidates}
                out.update(logprobs=lps, choice=max(lps, key=lps.get))
            for v in variants:
                answers[arm][v] = out

        a, b = item["values"]
        outcomes, d = {}, {}
        for arm in arms:
            if arm == "kv-all":
                continue
            A, B = answers[arm]
            outcomes[arm] = {}
            if "generate" in self.readouts:
                outcomes[arm]["generate"] = outcome(A["answer"], B["answer"], a, b)
            if "logits" in self.readouts:
                outcomes[arm]["logits"] = outcome(A["choice"], B["choice"], a, b)
                d[arm] = donor_d(A["logprobs"], B["logprobs"], a, b)

        served_rows = {}
        for arm in arms:
            sv = served_ids if arms[arm].served != "all" else ids
            served_rows[arm] = {
                "events": list(sv),
                "rows": [len(header) + sum(len(toks[v][ids.index(e)]) for e in sv) for v in (0, 1)],
            }
        spans = {e: [logs[0].span(e).pos_start, logs[0].span(e).n_tokens] for e in served_ids}
        return {
            "index": item["index"],
            "registers": item["registers"],
            "source_slot": item["source_slot"],
            "values": item["values"],
            "decoy_values": item["decoy_values"],
            "question": item["question"],
            "events": {"A": item["events"][0], "B": item["events"][1]},
            "budgets": {self.event_id(i): bb for i, bb in enumerate(budgets) if bb is not None},
            "history_end": logs[0].history_end,
            "served": served_rows,
            "served_positions": spans,
            "served_identical": served_identical,
            "arms": {arm: {"A": answers[arm][0], "B": answers[arm][1]} for arm in arms if arm != "kv-all"},
            "outcomes": outcomes,
            "d": d,
            "kv_all_vs_text_all": check,
        }

    # ------------------------------------------------------------------ statistics
    def summarize(self, records: Sequence[dict]) -> Summary:
        return summarize_donor_pairs(records, self)

    def figure(self, records: Sequence[dict], path) -> None:
        from eventkv.probes.figures import donor_pair_figure

        donor_pair_figure(records, path)


def summarize_donor_pairs(records: Sequence[dict], probe: DonorPair) -> Summary:
    """The donor-pair statistics from records alone (Study 1, "Donor pair"): per arm and readout
    the outcome counts, prevalence (sensitive/all, Wilson 95%), the exact sign test follow vs
    anti, and for d the sign test on d != 0 and the Wilcoxon signed-rank test; comprehension is
    the text-all follow rate (both variants answered correctly)."""
    n = len(records)
    arms = [a.name for a in probe.arms() if a.name != "kv-all"]
    data: dict = {"pairs": n, "outcomes": {}, "d": {}}
    rows, tests = [], []
    for arm in arms:
        for ro in probe.readouts:
            c = {o: sum(1 for r in records if r["outcomes"][arm][ro] == o) for o in OUTCOMES}
            sens = c["follow"] + c["anti"]
            prev = wilson(sens, n)
            st = sign_test(
                c["follow"],
                c["anti"],
                ("follow", "anti"),
                name=f"{arm}/{ro}: exact two-sided sign test, follow vs anti among donor-sensitive pairs",
            )
            data["outcomes"][f"{arm}/{ro}"] = {**c, "prevalence": prev.__dict__, "p": st.p_value}
            rows.append(
                [
                    arm,
                    ro,
                    str(n),
                    str(c["follow"]),
                    str(c["anti"]),
                    str(c["constant"]),
                    str(c["other"]),
                    prev.describe(),
                    format_p(st.p_value),
                ]
            )
            if arm == "kv":
                tests.append(st.describe())
    outcome_table = Table(
        f"Donor pairs: outcomes per arm ({n} pairs)",
        [
            "arm",
            "readout",
            "pairs",
            "follow",
            "anti",
            "constant",
            "other",
            "sensitive (Wilson 95%)",
            "p (follow vs anti)",
        ],
        rows,
    )
    tables = [outcome_table]
    if "logits" in probe.readouts:
        drows = []
        for arm in arms:
            d = require_finite(
                [r["d"][arm] for r in records],
                f"donor statistic d of arm {arm!r}",
                labels=[f"item {r['index']}" for r in records],
            )
            s, w = sign_test_d(d), wilcoxon_d(d)
            data["d"][arm] = {
                "values": d,
                "n": len(d),
                "median": median(d),
                "sign_p": s.p_value,
                "wilcoxon_p": w.p_value,
                "pos": s.counts["d>0"],
                "neg": s.counts["d<0"],
                "zero": s.counts["d=0 dropped"],
            }
            drows.append(
                [
                    arm,
                    str(len(d)),
                    f"{median(d):+.3f}" if d else "n/a",
                    str(s.counts["d>0"]),
                    str(s.counts["d<0"]),
                    str(s.counts["d=0 dropped"]),
                    format_p(s.p_value),
                    format_p(w.p_value),
                ]
            )
            if arm == "kv":
                tests += [s.describe(), w.describe() + f" (median d = {median(d):+.3f} nats)"]
        tables.append(
            Table(
                "Donor statistic d (candidate log-odds, nats)",
                ["arm", "pairs", "median d", "d>0", "d<0", "d=0", "p sign", "p Wilcoxon"],
                drows,
            )
        )
    comp_rows = []
    if "text-all" in arms:
        for ro in probe.readouts:
            k = sum(1 for r in records if r["outcomes"]["text-all"][ro] == "follow")
            p = wilson(k, n)
            data[f"comprehension/{ro}"] = p.__dict__
            comp_rows.append([ro, p.describe()])
            tests.append(
                f"text-all/{ro}: comprehension rate (both variants answered correctly), Wilson 95%: {p.describe()}"
            )
        tables.append(Table("Comprehension (text-all)", ["readout", "rate [Wilson 95%] (pairs)"], comp_rows))
    notes = [
        "follow: each variant answers its own (unserved) source's value; anti: each answers the other's; "
        "constant: the same state both times; other: no state word or another value. sensitive = follow + anti.",
        "d = log-odds of the donor's value in its own variant minus in the other variant (candidate readout); "
        "d > 0 leans toward the omitted source.",
    ]
    checks = [r["kv_all_vs_text_all"] for r in records if r.get("kv_all_vs_text_all")]
    if checks:
        same = sum(1 for c in checks if c["rows_and_positions_equal"])
        data["kv_all_check"] = {"equal": same, "n": len(checks)}
        notes.append(
            f"kv-all (every event through serve()) has rows and positions bitwise equal to text-all's in "
            f"{same}/{len(checks)} pairs, so its answers are text-all's."
        )
    if probe.decoy == "opposite":
        notes.append(
            "decoy=opposite: the served decoy differs between the two variants, so these are not served-identical "
            "pairs and 'follow' is confounded with decoy elimination."
        )
    return Summary(f"donor-pair: {n} pairs", tables, tests, notes, data)
