"""The trigger bank (Study 1, "The memory contract" — Trigger): which carrier constructions write
state into their own rows?

Sixteen constructions, each a donor pair whose value-free **carrier** event is served while the
events that hold the value are not:

* mirror family (8 verbs): ``register M mirrors|tracks|copies|matches|follows|shadows register S``,
  ``register M is kept equal to register S``, ``register M is synchronized with register S``;
  the dropped source is ``register S set to state ONLINE|OFFLINE``.
* flag family (8 phrasings): an **operand** event ``sensor S measured G; the alert threshold is T``
  and a **verdict** event ``check on sensor S: EXCEEDED|NORMAL``, both dropped; the carrier says
  ``flag F was set according to | in line with | reflecting | recording the check on sensor S``,
  ``... was assigned from | written from | made consistent with | updated accordingly with the check
  on sensor S``; the answers are EXCEEDED / NORMAL (G above or below T).

Item ``i`` uses construction ``i mod 16``; everything else (names, slots, values, fillers, the
independent decoy) is drawn from ``(seed, i)`` by the same draws for every construction, so the
constructions see identically distributed histories.

Position padding (so position is not a confound across constructions): the carrier slot gets a
position budget equal to the longest tokenization of the 16 carrier texts for the item's names;
likewise the decoy slot and the two source-block slots (source + filler in the mirror family,
operand + verdict in the flag family) get the longest tokenization over both families' texts.
Every event after the source block — the carrier, the fillers and the query — therefore sits at
the same positions whichever construction the item uses (the budget leaves unused positions,
it adds no pad tokens; Study 1, "Donor pair").

Arms (same pairs): ``kv`` — compact serving of {decoy, carrier} from the global prefill: its
follow rate is the **write-through rate**; ``text`` — every event as text (the global prefill
continued by the query): its follow rate is the **comprehension rate**; optional ``isolated``.
Statistics per construction: both rates with Wilson 95% intervals, the exact sign test follow vs
anti (kv), and the **dissociation**: an exact McNemar test on the pairs where the two arms
disagree (text follows but kv does not, vs the reverse); across constructions, the Spearman
correlation between write-through and comprehension.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Sequence

from eventkv.errors import OptionError
from eventkv.options import check_choices
from eventkv.probes.base import Runtime, Summary, Table, register
from eventkv.stats import format_p, median, require_finite, sign_test, sign_test_d
from eventkv.studies.materialization.contract_rows import (
    GRADED,
    ContractRow,
    ContractSection,
    d_tests,
    d_value,
    proportion,
)
from eventkv.studies.materialization.donor_pair import INSTRUCTION, NAMES, QUESTION, event_text, last_state, menu
from eventkv.studies.materialization.figures import trigger_scatter
from eventkv.studies.materialization.pairs import (
    PairArm,
    PairLayout,
    PairProbe,
    PairRequest,
    PairRun,
    d_stats,
    describe_d,
    pair_record,
    pair_stats,
    primary_readout,
    variant_events,
)

MIRROR_VERBS = (
    "mirrors",
    "tracks",
    "copies",
    "matches",
    "follows",
    "shadows",
    "is kept equal to",
    "is synchronized with",
)
FLAG_PHRASES = (
    "was set according to",
    "was set in line with",
    "was set reflecting",
    "was set recording",
    "was assigned from",
    "was written from",
    "was made consistent with",
    "was updated accordingly with",
)
CONSTRUCTIONS = tuple(("mirror", v) for v in MIRROR_VERBS) + tuple(("flag", p) for p in FLAG_PHRASES)
MIRROR_STATES = ("ONLINE", "OFFLINE")
FLAG_STATES = ("EXCEEDED", "NORMAL")
FLAG_QUESTION = (
    "\nQuestion: What value does flag {flag} hold? Answer {menu}. Locate the statement for that flag, "
    "then end your answer with the final value word."
)
ARM_NAMES = ("kv", "text", "isolated")


def carrier_text(family: str, phrase: str, target: str, source: str) -> str:
    """The carrier body of one construction (names no value)."""
    if family == "mirror":
        return f"register {target} {phrase} register {source}"
    return f"flag {target} {phrase} the check on sensor {source}"


@register
@dataclass
class TriggerBank(PairLayout, PairProbe):
    """The 16-construction trigger bank. Fields are the options."""

    name: ClassVar[str] = "trigger-bank"
    smoke_options: ClassVar[dict] = {"max_new_tokens": 3, "n_events": 8, "source_slots": (2, 3), "carrier_slot": 5}

    carrier_slot: int = 13
    readout: str = "both"
    max_new_tokens: int = 64
    arm_names: tuple[str, ...] = ("kv", "text")
    instruction: str = INSTRUCTION
    answer_prefix: str = "Answer:"

    def validate(self) -> None:
        self.check_layout(("carrier", self.carrier_slot))
        hi = self.source_slots[1]
        if not hi + 1 < self.carrier_slot:  # the source block is the source event and the one after it
            raise OptionError(
                "carrier_slot",
                self.carrier_slot,
                f"the carrier must come after the source block (slots up to {hi + 1}: each source is followed by "
                f"its echo): move it later.",
            )
        self.check_readout()
        check_choices("arm_names", self.arm_names, ARM_NAMES, required=("kv",), flag="--arms", what="arms")

    def pair_arms(self) -> list[PairArm]:
        table = {
            "kv": PairArm("kv", "main", ("decoy", "carrier"), description="write-through: serve {decoy, carrier}"),
            "text": PairArm("text", "main", "all", "prefill", description="comprehension: every event as text"),
            "isolated": PairArm(
                "isolated", "main", ("decoy", "carrier"), "isolated", description="{decoy, carrier}, each encoded alone"
            ),
        }
        return [table[a] for a in ARM_NAMES if a in self.arm_names]

    def _item(self, seed: int, index: int) -> dict:
        rng = random.Random(f"trigger-bank:{seed}:{index}")
        family, phrase = CONSTRUCTIONS[index % len(CONSTRUCTIONS)]
        dec, src, tgt = rng.sample(NAMES, 3)
        slot = rng.randint(*self.source_slots)
        first = rng.randrange(2)  # which answer variant A holds (index into the family's states)
        decoy_idx = rng.randrange(2)
        threshold = rng.randrange(200, 800)
        margins = (rng.randrange(20, 150), rng.randrange(20, 150))
        others = [r for r in NAMES if r not in (dec, src, tgt)]
        fill = {
            i: f"register {rng.choice(others)} refreshed to {rng.randrange(100, 1000)}" for i in range(self.n_events)
        }
        states = MIRROR_STATES if family == "mirror" else FLAG_STATES
        a, b = states[first], states[1 - first]

        def source_block(fam: str, k: int) -> tuple[str, str]:
            if fam == "mirror":
                return f"register {src} set to state {MIRROR_STATES[k]}", fill[slot + 1]
            g = threshold + margins[0] if FLAG_STATES[k] == "EXCEEDED" else threshold - margins[1]
            return (
                f"sensor {src} measured {g}; the alert threshold is {threshold}",
                f"check on sensor {src}: {FLAG_STATES[k]}",
            )

        def decoy_text(fam: str) -> str:
            return (
                f"register {dec} set to state {MIRROR_STATES[decoy_idx]}"
                if fam == "mirror"
                else f"flag {dec} set to {FLAG_STATES[decoy_idx]}"
            )

        events = []
        for k in (first, 1 - first):
            body = dict(fill)
            body[self.decoy_slot] = decoy_text(family)
            body[slot], body[slot + 1] = source_block(family, k)
            body[self.carrier_slot] = carrier_text(family, phrase, tgt, src)
            events.append([event_text(i, body[i]) for i in range(self.n_events)])
        pad = {
            self.decoy_slot: [event_text(self.decoy_slot, decoy_text(f)) for f in ("mirror", "flag")],
            slot: [event_text(slot, source_block(f, k)[0]) for f in ("mirror", "flag") for k in (0, 1)],
            slot + 1: [event_text(slot + 1, source_block(f, k)[1]) for f in ("mirror", "flag") for k in (0, 1)],
            self.carrier_slot: [event_text(self.carrier_slot, carrier_text(f, p, tgt, src)) for f, p in CONSTRUCTIONS],
        }
        q = (
            QUESTION.format(register=tgt, menu=menu(states))
            if family == "mirror"
            else FLAG_QUESTION.format(flag=tgt, menu=menu(states))
        )
        return {
            "index": index,
            "construction": phrase,
            "family": family,
            "names": {"decoy": dec, "source": src, "target": tgt},
            "source_slot": slot,
            "values": [a, b],
            "decoy_value": states[decoy_idx],
            "candidates": list(states),
            "histories": {"main": events},
            "roles": {"main": {"decoy": self.decoy_slot, "carrier": self.carrier_slot}},
            "pad": {"main": {str(k): v for k, v in pad.items()}},
            "questions": {"main": q},
        }

    def request(self, item: dict) -> PairRequest:
        return PairRequest(item, lambda t: last_state(t, item["candidates"]))

    def finish(self, rt: Runtime, item: dict, run: PairRun) -> dict:
        return pair_record(item, run, variant_events(item["histories"]["main"]), after_index=("construction", "family"))

    def summarize(self, records: Sequence[dict]) -> Summary:
        return summarize_trigger_bank(records, self.readouts, [a.name for a in self.pair_arms()])

    def figure(self, records: Sequence[dict], path) -> None:
        s = self.summarize(records)
        trigger_scatter(s.data, path)

    @classmethod
    def contract_section(cls, summary: Summary) -> ContractSection:
        """The trigger clause of the memory contract (Study 1, "The memory contract" — Trigger:
        comprehension .98 mean, write-through from chance to .95): mean comprehension and the range
        of write-through over the constructions (primary readout), the constructions that write
        (kv follow > anti, sign test p < .05), the pooled graded d and the dissociation count with
        Spearman's rho; the JSON section ``trigger`` holds every construction. Also the figure
        ``trigger.png`` (write-through vs comprehension). Rates are proportions, d in nats.

        Raises:
            KeyError: ``summary`` is not a trigger-bank summary.
            ValueError: the summary has no construction for its primary readout.
        """
        tb = summary.data
        ro = tb["primary"]
        cons = {k: v[ro] for k, v in tb["constructions"].items() if ro in v}
        comp = [v["comprehension"]["rate"] for v in cons.values() if "comprehension" in v]
        wt = {k: v["write_through"] for k, v in cons.items()}
        writes = {
            k: bool(v["follow"] > v["anti"] and not math.isnan(v["p_sign"]) and v["p_sign"] < 0.05)
            for k, v in cons.items()
        }
        rows = []
        if comp:
            rows.append(
                ContractRow(
                    "trigger",
                    f"comprehension over {len(comp)} constructions ({ro})",
                    f"mean {sum(comp) / len(comp):.3f}",
                    f"min {min(comp):.3f}, max {max(comp):.3f}",
                    ".98 mean (min .77)",
                )
            )
        rates = [v["rate"] for v in wt.values()]
        best = max(wt, key=lambda k: wt[k]["rate"])
        rows.append(
            ContractRow(
                "trigger",
                f"write-through over {len(rates)} constructions ({ro})",
                f"{min(rates):.3f} to {max(rates):.3f}",
                f"best: {best} {proportion(wt[best])}",
                "from chance to .95",
            )
        )
        rows.append(
            ContractRow(
                "trigger",
                "constructions that write (follow > anti, sign test p < .05)",
                f"{sum(writes.values())}/{len(writes)}",
                ", ".join(k for k, w in writes.items() if w) or "none",
                "none writes on all three recent checkpoints",
            )
        )
        pooled = tb.get("d/kv")
        lo = tb["constructions"]
        dpos = [
            k for k, v in lo.items() if v.get("logits", {}).get("p_d", math.nan) < 0.05 and v["logits"]["median_d"] > 0
        ]
        if pooled:
            rows.append(
                ContractRow(
                    "trigger",
                    "graded write-through: kv donor shift d, 16 constructions pooled",
                    d_value(pooled),
                    f"{d_tests(pooled)}; constructions with d > 0 at sign p < .05: {len(dpos)}/{len(lo)}"
                    + (f" ({', '.join(dpos)})" if dpos else ""),
                    GRADED,
                )
            )
        dis = [
            k
            for k, v in cons.items()
            if v.get("p_dissociation", math.nan) < 0.05 and v.get("text_only", 0) > v.get("kv_only", 0)
        ]
        sp = tb.get(f"spearman/{ro}")
        rows.append(
            ContractRow(
                "trigger",
                "dissociation: comprehended but not written (McNemar p < .05)",
                f"{len(dis)}/{len(cons)}",
                (
                    f"Spearman rho(write-through, comprehension) = {sp['rho']:+.2f}, p = {format_p(sp['p'])}"
                    if sp
                    else "Spearman not computed (a rate is constant)"
                ),
                "comprehension high everywhere, write-through varies",
            )
        )
        data = {
            "readout": ro,
            "constructions": {
                k: {
                    "family": v["family"],
                    "writes": writes[k],
                    "write_through": v["write_through"],
                    "comprehension": v.get("comprehension"),
                    "follow": v["follow"],
                    "anti": v["anti"],
                    "p_sign": v["p_sign"],
                    "p_dissociation": v.get("p_dissociation"),
                    "median_d": lo[k].get("logits", {}).get("median_d"),
                    "p_d": lo[k].get("logits", {}).get("p_d"),
                    "writes_graded": k in dpos,
                }
                for k, v in cons.items()
            },
            "d_pooled": pooled,
        }
        return ContractSection("trigger", data, rows, figure=("trigger.png", partial(trigger_scatter, tb)))


def dissociation(records: Sequence[dict], readout: str):
    """Exact McNemar test (sign test on the discordant pairs): text follows but kv does not, vs
    kv follows but text does not."""
    t_not_k = sum(
        1 for r in records if r["outcomes"]["text"][readout] == "follow" and r["outcomes"]["kv"][readout] != "follow"
    )
    k_not_t = sum(
        1 for r in records if r["outcomes"]["kv"][readout] == "follow" and r["outcomes"]["text"][readout] != "follow"
    )
    return sign_test(t_not_k, k_not_t, ("text only", "kv only"), name="exact McNemar test, text-only vs kv-only follow")


def summarize_trigger_bank(records: Sequence[dict], readouts: Sequence[str], arms: Sequence[str]) -> Summary:
    """Per construction and readout: write-through (kv follow rate) and comprehension (text follow
    rate) with Wilson 95% intervals, the kv sign test, the McNemar dissociation, the kv d sign test;
    across constructions, Spearman's rho between the two rates."""
    from scipy import stats as st

    data: dict = {
        "pairs": len(records),
        "readouts": list(readouts),
        "primary": primary_readout(readouts),
        "constructions": {},
    }
    tables, tests = [], []
    for ro in readouts:
        rows, wts, comps = [], [], []
        for fam, phrase in CONSTRUCTIONS:
            rs = [r for r in records if r["construction"] == phrase]
            if not rs:
                continue
            kv = pair_stats(rs, "kv", ro)
            row = {
                "family": fam,
                "n": kv["n"],
                "write_through": kv["rate"].__dict__,
                "follow": kv["follow"],
                "anti": kv["anti"],
                "p_sign": kv["sign"].p_value,
            }
            cells = [fam, phrase, str(kv["n"]), kv["rate"].describe(2)]
            if "text" in arms:
                tx = pair_stats(rs, "text", ro)
                dis = dissociation(rs, ro)
                row.update(
                    comprehension=tx["rate"].__dict__,
                    p_dissociation=dis.p_value,
                    text_only=dis.counts["text only"],
                    kv_only=dis.counts["kv only"],
                )
                cells += [tx["rate"].describe(2)]
                wts.append(kv["rate"].rate)
                comps.append(tx["rate"].rate)
            cells += [f"{kv['follow']}:{kv['anti']}", format_p(kv["sign"].p_value)]
            if "text" in arms:
                cells += [f"{row['text_only']}:{row['kv_only']}", format_p(row["p_dissociation"])]
            if ro == "logits":
                ds = require_finite(
                    [r["d"]["kv"] for r in rs],
                    f"donor statistic d of arm 'kv', construction {phrase!r}",
                    labels=[f"item {r['index']}" for r in rs],
                )
                sd = sign_test_d(ds)
                row.update(median_d=median(ds), p_d=sd.p_value)
                cells += [f"{round(median(ds), 2) + 0.0:+.2f}", format_p(sd.p_value)]
            rows.append(cells)
            data["constructions"].setdefault(phrase, {})[ro] = row
        cols = ["family", "construction", "pairs", "write-through [Wilson 95%]"]
        if "text" in arms:
            cols += ["comprehension [Wilson 95%]"]
        cols += ["follow:anti (kv)", "p sign"]
        if "text" in arms:
            cols += ["text-only:kv-only", "p McNemar"]
        if ro == "logits":
            cols += ["median d", "p sign (d)"]
        tables.append(
            Table(
                f"Trigger bank, {ro} readout: write-through (kv, served {{decoy, carrier}}) and comprehension (text)",
                cols,
                rows,
            )
        )
        if "text" in arms and len(wts) >= 3:
            finite = [(w, c) for w, c in zip(wts, comps) if not (math.isnan(w) or math.isnan(c))]
            if len({w for w, _ in finite}) > 1 and len({c for _, c in finite}) > 1:
                rho = st.spearmanr([w for w, _ in finite], [c for _, c in finite])
                data[f"spearman/{ro}"] = {"rho": float(rho.statistic), "p": float(rho.pvalue), "n": len(finite)}
                tests.append(
                    f"{ro}: Spearman correlation of write-through and comprehension over {len(finite)} "
                    f"constructions: rho = {float(rho.statistic):+.3f}, p = {format_p(float(rho.pvalue))}"
                )
            else:
                tests.append(
                    f"{ro}: Spearman correlation not computed (one of the rates is constant across constructions)"
                )
    pooled = d_stats(records, "kv")
    if pooled:
        data["d/kv"] = pooled
        tests.append(
            f"kv, all constructions pooled: donor shift {describe_d(pooled)}; exact sign test p = "
            f"{format_p(pooled['sign_p'])}, Wilcoxon p = {format_p(pooled['wilcoxon_p'])}"
        )
    notes = [
        "write-through = pairs where the kv arm answers each variant's own (unserved) value; comprehension = the "
        "same for the text arm. A construction that is comprehended but does not write shows as a significant "
        "McNemar dissociation (text-only >> kv-only).",
        "Positions: the carrier, decoy and source-block slots carry position budgets equal to the longest "
        "tokenization over all 16 constructions, so later events and the query sit at the same positions "
        "whatever the construction.",
    ]
    return Summary(
        f"trigger-bank: {len(records)} pairs over {len({r['construction'] for r in records})} constructions",
        tables,
        tests,
        notes,
        data,
    )
