"""Programmed carriers (Study 1, "Programmed carriers"): can an event written on purpose carry
the state of an event that will be dropped?

A donor pair over register histories (decoy slot 0, source ``register S set to state v`` in
8..11, fillers). Slot 13 holds a **carrier** of one kind, written after the source; slot 17 holds
the **shared downstream row** ``register S was inspected by the operator`` (it names the entity, no
value). The question asks S's state; the source is never served. Carrier kinds:

* ``passive``: a passive note — ``note: register S was recorded earlier in this log``;
* ``binding``: a binding sentence — ``register S keeps the state it was set to at step k``;
* ``directive``: a directive tag — ``[remember] state of register S``;
* ``compute``: a natural-language compute note — ``note: to answer about register S later, look back
  at step k and take the state written there``;
* ``explicit``: the value itself — ``register S is in state v`` (NOT answer-free: the upper bound).

Every kind but ``explicit`` is **answer-free** (no state word, in any case) and **byte-identical**
across the two variants; :meth:`Carriers.items` asserts both for every item and raises otherwise.
The carrier slot's position budget is the longest tokenization over all kinds, so every later
event sits at the same positions whatever the kind; the ``none`` history has a filler there.

Arms, per kind K (query at the item's common position, ``fixed_position``, unless the option
``fix_query_position`` is off): ``K`` {decoy, carrier} — served alone; ``K+row`` {decoy, carrier,
row} — beside the shared downstream row. Baselines from the ``none`` history: ``row`` {decoy, row}
(the shared row alone) and ``text`` (every event: comprehension). Statistic per arm: donor-aligned
recovery = the follow rate (both variants answer their own source's value), with Wilson 95%
intervals and the sign test follow vs anti, as in the donor pair.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from typing import ClassVar, Sequence

from eventkv.errors import EventKVError
from eventkv.options import CARRIER_KINDS, check_choices
from eventkv.probes.base import Runtime, Summary, register
from eventkv.studies.materialization.contract_rows import (
    GRADED,
    ContractRow,
    ContractSection,
    d_tests,
    d_value,
    proportion,
)
from eventkv.studies.materialization.donor_pair import INSTRUCTION, NAMES, event_text, last_state, menu
from eventkv.studies.materialization.pairs import (
    PairArm,
    PairLayout,
    PairProbe,
    PairRequest,
    PairRun,
    outcome_tables,
    pair_record,
    primary_readout,
    variant_events,
)

STATES = ("ONLINE", "OFFLINE")
ANSWER_FREE = CARRIER_KINDS.names()
KINDS = (*ANSWER_FREE, "explicit")
QUESTION = (
    "\nQuestion: What state is register {register} in? Answer {menu}. Use what the trajectory says about "
    "that register, then end your answer with the final state word."
)


def carrier_body(kind: str, register: str, step: int, value: str) -> str:
    """The carrier text of one kind (``step`` is the 1-based step of the source; ``value`` is used
    by ``explicit`` only)."""
    if kind == "passive":
        return f"note: register {register} was recorded earlier in this log"
    if kind == "binding":
        return f"register {register} keeps the state it was set to at step {step}"
    if kind == "directive":
        return f"[remember] state of register {register}"
    if kind == "compute":
        return (
            f"note: to answer about register {register} later, look back at step {step} and take the state "
            f"written there"
        )
    if kind == "explicit":
        return f"register {register} is in state {value}"
    raise EventKVError(f"unknown carrier kind {kind!r}: use one of {', '.join(KINDS)}.")


def is_answer_free(text: str, states: Sequence[str] = STATES) -> bool:
    """True when ``text`` names none of the state words (case-insensitive, whole words)."""
    return not any(re.search(rf"(?<![A-Za-z]){re.escape(s)}(?![A-Za-z])", text, flags=re.IGNORECASE) for s in states)


@register
@dataclass
class Carriers(PairLayout, PairProbe):
    """Programmed carrier arms: passive note, binding sentence, directive tag, compute note, explicit value."""

    name: ClassVar[str] = "carriers"
    smoke_options: ClassVar[dict] = {
        "max_new_tokens": 3,
        "n_events": 10,
        "source_slots": (2, 3),
        "carrier_slot": 5,
        "row_slot": 8,
    }

    carrier_slot: int = 13
    row_slot: int = 17
    kinds: tuple[str, ...] = KINDS
    fix_query_position: bool = True
    readout: str = "both"
    max_new_tokens: int = 64
    instruction: str = INSTRUCTION
    answer_prefix: str = "Answer:"

    def validate(self) -> None:
        self.check_layout(("carrier", self.carrier_slot), ("row", self.row_slot))
        check_choices("kinds", self.kinds, KINDS, what="carrier kinds")
        self.check_readout()

    def pair_arms(self) -> list[PairArm]:
        fx = self.fix_query_position
        arms = [PairArm("row", "none", ("decoy", "row"), fixed_position=fx, description="shared downstream row alone")]
        for k in self.kinds:
            arms.append(PairArm(k, k, ("decoy", "carrier"), fixed_position=fx, description=f"{k} carrier served alone"))
            arms.append(
                PairArm(
                    f"{k}+row",
                    k,
                    ("decoy", "carrier", "row"),
                    fixed_position=fx,
                    description=f"{k} carrier beside the shared row",
                )
            )
        arms.append(
            PairArm("text", "none", "all", "prefill", fixed_position=fx, description="every event: comprehension")
        )
        return arms

    def _item(self, seed: int, index: int) -> dict:
        rng = random.Random(f"carriers:{seed}:{index}")
        dec, src = rng.sample(NAMES, 2)
        slot = rng.randint(*self.source_slots)
        a, b = rng.sample(STATES, 2)
        dv = rng.choice(STATES)
        others = [r for r in NAMES if r not in (dec, src)]
        fill = {
            i: f"register {rng.choice(others)} refreshed to {rng.randrange(100, 1000)}" for i in range(self.n_events)
        }
        hist: dict[str, list] = {}
        for kind in ("none",) + self.kinds:
            hist[kind] = []
            for value in (a, b):
                body = dict(fill)
                body[self.decoy_slot] = f"register {dec} set to state {dv}"
                body[slot] = f"register {src} set to state {value}"
                body[self.row_slot] = f"register {src} was inspected by the operator"
                if kind != "none":
                    body[self.carrier_slot] = carrier_body(kind, src, slot + 1, value)
                hist[kind].append([event_text(i, body[i]) for i in range(self.n_events)])
        for kind in self.kinds:  # the contract of a programmed carrier, checked on every item
            ca, cb = (hist[kind][v][self.carrier_slot] for v in (0, 1))
            if kind in ANSWER_FREE and not (ca == cb and is_answer_free(ca)):
                raise EventKVError(f"carrier {kind!r} is not answer-free and donor-identical: {ca!r} / {cb!r}.")
        pad = [event_text(self.carrier_slot, carrier_body(k, src, slot + 1, v)) for k in KINDS for v in STATES]
        pad.append(event_text(self.carrier_slot, fill[self.carrier_slot]))
        roles = {"decoy": self.decoy_slot, "carrier": self.carrier_slot, "row": self.row_slot}
        return {
            "index": index,
            "names": {"decoy": dec, "source": src},
            "source_slot": slot,
            "values": [a, b],
            "decoy_value": dv,
            "candidates": list(STATES),
            "histories": hist,
            "roles": {k: roles for k in hist},
            "pad": {k: {str(self.carrier_slot): pad} for k in hist},
            "questions": {"main": QUESTION.format(register=src, menu=menu(STATES))},
        }

    def request(self, item: dict) -> PairRequest:
        return PairRequest(item, lambda x: last_state(x, STATES))

    def finish(self, rt: Runtime, item: dict, run: PairRun) -> dict:
        carriers = {k: [item["histories"][k][v][self.carrier_slot] for v in (0, 1)] for k in self.kinds}
        return pair_record(item, run, variant_events(item["histories"]["none"]), carriers=carriers)

    def summarize(self, records: Sequence[dict]) -> Summary:
        data: dict = {"pairs": len(records), "primary": primary_readout(self.readouts), "arms": {}}
        tables = outcome_tables(
            records,
            self.pair_arms(),
            self.readouts,
            f"Programmed carriers: donor-aligned recovery (follow rate) per arm ({len(records)} pairs)",
            data["arms"],
        )
        pos = "at the item's common query position" if self.fix_query_position else "right after each history"
        notes = [
            "donor-aligned recovery = follow rate: both variants answer their own (unserved) source's value.",
            f"every arm asks S's state {pos}; 'explicit' states the value (not answer-free): the upper bound.",
            "the answer-free carriers are byte-identical in the two variants (checked when the items are built).",
        ]
        return Summary(f"carriers: {len(records)} pairs", tables, [], notes, data)

    def figure(self, records: Sequence[dict], path) -> None:
        from eventkv.studies.materialization.figures import arm_bars

        arm_bars(
            records, [a.name for a in self.pair_arms()], primary_readout(self.readouts), "programmed carriers", path
        )

    @classmethod
    def contract_section(cls, summary: Summary) -> ContractSection:
        """The programming clause of the memory contract (Study 1, "Programmed carriers": at a fixed
        query position the shared row alone recovers .00, + carrier .42, the explicit value 1.00):
        the shared row's follow rate, the best answer-free carrier beside it (highest follow rate; a
        tie names the first), the graded d of the row alone vs the best carrier by median d (not
        corrected for the choice), and the explicit upper bound, on the primary readout. The JSON
        section ``programming`` holds every arm's follow rate and d. Rates are proportions, d in
        nats.

        Raises:
            KeyError: ``summary`` is not a carriers summary.
        """
        ca = summary.data
        ro = ca["primary"]
        a = ca["arms"]
        kinds = [k for k in ANSWER_FREE if f"{k}+row/{ro}" in a]

        def rate(arm: str) -> dict:
            return a[f"{arm}/{ro}"]["rate"]

        rows = [
            ContractRow(
                "programming",
                f"shared row alone ({ro}, fixed query position)",
                f"{rate('row')['rate']:.3f}",
                proportion(rate("row")),
                ".00",
            )
        ]
        if kinds:
            best = max(kinds, key=lambda k: rate(f"{k}+row")["rate"])
            rows.append(
                ContractRow(
                    "programming",
                    "best answer-free carrier beside the row (highest follow rate; a tie names the first)",
                    f"{rate(best + '+row')['rate']:.3f}",
                    f"{best}: {proportion(rate(best + '+row'))}; alone {proportion(rate(best))}",
                    "+ carrier .42; recovery .06 -> .51",
                )
            )
        if kinds and "d/row" in a:
            bd = max(kinds, key=lambda k: a.get(f"d/{k}+row", {}).get("median", -math.inf))
            rows.append(
                ContractRow(
                    "programming",
                    f"graded: donor shift d, shared row alone vs the best (by median d) of {len(kinds)} carriers "
                    "beside it (not corrected for the choice)",
                    f"{round(a['d/row']['median'], 3) + 0.0:+.3f} vs "
                    f"{round(a[f'd/{bd}+row']['median'], 3) + 0.0:+.3f} nats ({bd})",
                    f"row {d_value(a['d/row'])}, {d_tests(a['d/row'])}; {bd}+row {d_value(a[f'd/{bd}+row'])}, "
                    f"{d_tests(a[f'd/{bd}+row'])}",
                    GRADED,
                )
            )
        if "explicit/" + ro in a:
            rows.append(
                ContractRow(
                    "programming",
                    "explicit value (upper bound)",
                    f"{rate('explicit')['rate']:.3f}",
                    proportion(rate("explicit")),
                    "1.00",
                )
            )
        data = {
            "readout": ro,
            "follow_rate": {k.rsplit("/", 1)[0]: v["rate"] for k, v in a.items() if k.endswith(f"/{ro}")},
            "d": {k.removeprefix("d/"): v for k, v in a.items() if k.startswith("d/")},
        }
        return ContractSection("programming", data, rows)
