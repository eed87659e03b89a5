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
* ``kv-all`` — every event served through :func:`eventkv.kv.serve.serve` (compact). It is the same
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

The probe is a recipe over the pair engine of :mod:`eventkv.studies.materialization.pairs` (the one the contract
probes run on): :func:`~eventkv.studies.materialization.pairs.run_pair` tokenizes, prefills, serves, reads out and
scores (:func:`~.pairs.outcome`, :func:`~.pairs.donor_d`); the probe
adds the ``kv-all`` check and writes its record.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.serve import serve
from eventkv.options import check_choices
from eventkv.probes.base import Arm, Runtime, Summary, Table, register
from eventkv.stats import format_p, median, require_finite, sign_test, sign_test_d, wilcoxon_d, wilson
from eventkv.studies.materialization.contract_rows import (
    GRADED,
    ContractRow,
    ContractSection,
    d_tests,
    d_value,
    proportion,
)
from eventkv.studies.materialization.pairs import (
    OUTCOME_COLUMNS,
    OUTCOMES,
    PairArm,
    PairLayout,
    PairProbe,
    PairRequest,
    PairRun,
    event_id,
)

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
ARM_NAMES = ("kv", "isolated", "text-all", "kv-all")


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


#: where the kv and isolated arms' question starts: right after the served {decoy, root} tokens (the default, as the
#: first study's scripts ask: ``kv_causal.py`` and ``kv_poscontrol.py`` start the question at the largest served
#: position + 1), or after the whole history (the rows at their original positions, the question where a memory
#: asks it)
QUERY_AT = ("last-served", "history")


@register
@dataclass
class DonorPair(PairLayout, PairProbe):
    """Donor pairs over register histories (Study 1, "Donor pair"). Fields are the options; the
    layout fields (``n_events``, ``decoy_slot``, ``source_slots``) come from :class:`PairLayout`,
    and the pair engine :func:`~eventkv.studies.materialization.pairs.run_pair` answers the arms."""

    name: ClassVar[str] = "donor-pair"
    smoke_options: ClassVar[dict] = {"max_new_tokens": 4}
    # the engine's options: the probe's order of forwards and its record's ``stopped``
    shared_prefix: ClassVar[bool] = True
    record_stopped: ClassVar[bool] = True
    #: 4: the kv and isolated arms ask right after the served tokens (``query_at="last-served"``), where version 3
    #: asked after the whole history; every record names each arm's ``query_position``; 5: the isolated
    #: events ride in the shared prefill's forward (the pair engine's version 4), which moves rows by float rounding;
    #: 6: greedy answers draft from their arm's served text (prompt lookup) and finished answers leave the decode
    #: batch, which moves the generated answers' logits by float rounding (rows and candidate scores unchanged)
    record_version: ClassVar[int] = 6
    prompt_lookup: ClassVar[bool] = True

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
    query_at: str = "last-served"

    # ------------------------------------------------------------------ recipe
    def validate(self) -> None:
        """Raises OptionError (naming the field) on a bad layout (the decoy may sit anywhere that
        is neither a source slot nor the root), decoy, states, registers, readout, max new tokens
        or arms."""
        self.check_layout(("root", self.root_slot), decoy_first=False)
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
        self.check_readout()
        if self.query_at not in QUERY_AT:
            raise OptionError("query_at", self.query_at, f"use one of {', '.join(QUERY_AT)}.")
        check_choices("arm_names", self.arm_names, ARM_NAMES, required=("kv",), flag="--arms", what="arms")
        if "kv-all" in self.arm_names and "text-all" not in self.arm_names:
            raise OptionError(
                "arm_names",
                self.arm_names,
                "kv-all is checked against text-all; add text-all or drop kv-all.",
                flag="--arms",
            )

    def pair_arms(self) -> list[PairArm]:
        """The arms the engine answers: ``kv``, ``isolated`` and ``text-all`` among ``arm_names``."""
        served, at = ("decoy", "root"), self.query_at
        table = {
            "kv": PairArm(
                "kv",
                "main",
                served,
                "compact",
                query_at=at,
                description="global prefill, compact serving of {decoy, root}",
            ),
            "isolated": PairArm(
                "isolated", "main", served, "isolated", query_at=at, description="{decoy, root}, each encoded alone"
            ),
            "text-all": PairArm("text-all", "main", "all", "prefill", description="all events as text: comprehension"),
        }
        return [table[a] for a in ARM_NAMES if a in self.arm_names and a in table]

    def arms(self) -> list[Arm]:
        """The answered arms, then ``kv-all`` (no readout: its rows are checked equal to text-all's)."""
        arms = super().arms()
        if "kv-all" in self.arm_names:
            arms.append(Arm("kv-all", "all", "compact", (), "all events via serve(): rows checked equal to text-all's"))
        return arms

    def _item(self, seed: int, index: int) -> dict:
        rng = random.Random(f"donor-pair:{seed}:{index}")
        dec, src, root = rng.sample(self.registers, 3)
        slot = rng.randint(*self.source_slots)
        a, b = rng.sample(self.states, 2)
        decoys: list[str | None]
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

    event_id = staticmethod(event_id)

    # ------------------------------------------------------------------ running
    def request(self, item: dict) -> PairRequest:
        """The pair the engine answers: the item's one history (decoy and root served) and its
        question, the states as candidates."""
        pair = {
            "values": item["values"],
            "histories": {"main": item["events"]},
            "roles": {"main": {"decoy": self.decoy_slot, "root": self.root_slot}},
            "questions": {"main": item["question"]},
            "candidates": list(self.states),
        }
        return PairRequest(pair, lambda text: last_state(text, self.states))

    def finish(self, rt: Runtime, item: dict, run: PairRun) -> dict:
        """The pair's record from the engine's run (header reused, shared events prefilled once,
        each variant's remainder once; every arm's served cache answered in one batched readout),
        with ``kv-all`` checked against ``text-all``."""
        logs, ekvs = run.logs["main"], run.prefills["main"]
        served_ids = [event_id(self.decoy_slot), event_id(self.root_slot)]
        served = {
            arm: {"events": list(logs[0].event_ids) if s["events"] == "all" else s["events"], "rows": s["rows"]}
            for arm, s in run.served.items()
        }
        check = None
        if "kv-all" in self.arm_names:  # every event served through serve(); same rows => text-all's readouts
            served["kv-all"] = {"events": list(logs[0].event_ids), "rows": list(served["text-all"]["rows"])}
            check = {"rows_and_positions_equal": all(_serves_the_prefill(ekv) for ekv in ekvs)}
        rec = {
            "index": item["index"],
            "registers": item["registers"],
            "source_slot": item["source_slot"],
            "values": item["values"],
            "decoy_values": item["decoy_values"],
            "question": item["question"],
            "events": {"A": item["events"][0], "B": item["events"][1]},
            "budgets": {event_id(i): bb for i, bb in enumerate(logs[0].budgets) if bb is not None},
            "history_end": logs[0].history_end,
            "served": served,
            "served_positions": {e: [logs[0].span(e).pos_start, logs[0].span(e).n_tokens] for e in served_ids},
            "served_identical": all(
                logs[0].event_tokens[s] == logs[1].event_tokens[s] for s in (self.decoy_slot, self.root_slot)
            ),
            "arms": {arm: {"A": a, "B": b} for arm, (a, b) in run.answers.items()},
            "outcomes": run.outcomes,
            "d": run.d,
            "kv_all_vs_text_all": check,
        }
        rec["query_position"] = dict(run.query_position)
        return rec

    # ------------------------------------------------------------------ statistics
    def summarize(self, records: Sequence[dict]) -> Summary:
        return summarize_donor_pairs(records, self)

    def figure(self, records: Sequence[dict], path) -> None:
        from eventkv.studies.materialization.figures import donor_pair_figure

        donor_pair_figure(records, path)

    @classmethod
    def contract_section(cls, summary: Summary) -> ContractSection:
        """The donor-pair probe's contract: the materialization clause (Study 1, "The memory
        contract": the donor pair, 99:0 on Qwen3-8B) — kv follow:anti with its sign test and sensitive
        share, and the graded donor shift d of the kv arm when the candidate readout ran.

        Raises:
            KeyError: ``summary`` is not a donor-pair summary (no ``outcomes``).
        """
        dp = summary.data
        ro = "logits" if "kv/logits" in dp["outcomes"] else "generate"
        o = dp["outcomes"][f"kv/{ro}"]
        rows = [
            ContractRow(
                "materialization (donor pair)",
                f"kv follow:anti ({ro}), sensitive share",
                f"{o['follow']}:{o['anti']}",
                f"p = {format_p(o['p'])}; sensitive {proportion(o['prevalence'])}",
                "99:0, p = 3.2e-30 (Qwen3-8B); 130:0 of 256",
            )
        ]
        dd = dp.get("d", {}).get("kv")
        dd = {k: v for k, v in dd.items() if k != "values"} if dd else None
        if dd:
            rows.append(
                ContractRow(
                    "materialization (donor pair)",
                    "graded donor shift d (kv, candidate log-odds)",
                    d_value(dd),
                    d_tests(dd),
                    GRADED,
                )
            )
        data = {
            "readout": ro,
            "follow": o["follow"],
            "anti": o["anti"],
            "p": o["p"],
            "prevalence": o["prevalence"],
            "d": dd,
        }
        return ContractSection("donor_pair", data, rows)


def _serves_the_prefill(ekv) -> bool:
    """The ``kv-all`` check: every event served through :func:`eventkv.kv.serve.serve` (compact) gives
    bitwise the prefill's rows (keys/values ``[1, kv_heads, rows, head_dim]`` per layer), its
    positions and its query position, so ``kv-all``'s readouts are ``text-all``'s."""
    s = serve(ekv, "all", "compact")
    return (
        s.next_position == ekv.log.history_end
        and torch.equal(s.positions, ekv.positions)
        and all(torch.equal(x, y) for x, y in zip(s.keys + s.values, ekv.keys + ekv.values))
    )


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
        [*OUTCOME_COLUMNS, "sensitive (Wilson 95%)", "p (follow vs anti)"],
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
    where = {
        "last-served": "right after the last served token (query_at last-served, where the first study asks)",
        "history": "after the whole history (query_at history, where a memory asks)",
    }[probe.query_at]
    notes.append(f"kv and isolated asked {where}; text-all after the whole history.")
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
