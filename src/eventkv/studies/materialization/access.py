"""Access (Study 1, "The memory contract" — Access): how much of a value survives materialisation?

The donor-pair layout (decoy slot 0, source in 8..11, root ``register M mirrors register S`` at
13, fillers) with payloads of growing cardinality. Item ``i`` uses cardinality ``i mod 4``:

* ``binary``: ONLINE / OFFLINE (chance .5);
* ``compass``: NORTH / EAST / SOUTH / WEST (chance .25);
* ``phonetic``: ALFA BRAVO CHARLIE DELTA ECHO FOXTROT GOLF HOTEL (chance .125);
* ``number``: a 3-digit value 100..999 (exact-match chance 1/900), read by generation (the last
  3-digit number in the output) and by a **first-digit** candidate-logit probe over 1..9
  (chance 1/9). The two variants' numbers are drawn with different first digits so the first-digit
  probe can tell them apart.

Menus are enumerated in the question (``Answer one of: NORTH, EAST, SOUTH or WEST``; numbers:
``Answer with the 3-digit number``). The decoy is **independent**: a value drawn from the same
payload space, the same text in both variants (so the served tokens are byte-identical).

Arms: ``kv`` (compact {decoy, root}) and ``text`` (every event: comprehension). Recovery is
per answer (each variant's answer equal to its own source value; 2 answers per pair), reported
with a Wilson 95% interval and an exact one-sided binomial test against the chance rate; the
pair-level donor-pair outcomes are reported beside it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Sequence

from eventkv.options import check_choices
from eventkv.probes.base import Runtime, Summary, Table, register
from eventkv.stats import format_p, wilson
from eventkv.studies.materialization.contract_rows import ContractRow, ContractSection, proportion
from eventkv.studies.materialization.donor_pair import INSTRUCTION, event_text, last_state, menu
from eventkv.studies.materialization.figures import access_figure
from eventkv.studies.materialization.pairs import (
    D_CAPTION,
    PairArm,
    PairLayout,
    PairProbe,
    PairRequest,
    PairRun,
    correct,
    outcome_tables,
    pair_record,
    primary_readout,
    variant_events,
)

PAYLOADS = {
    "binary": ("ONLINE", "OFFLINE"),
    "compass": ("NORTH", "EAST", "SOUTH", "WEST"),
    "phonetic": ("ALFA", "BRAVO", "CHARLIE", "DELTA", "ECHO", "FOXTROT", "GOLF", "HOTEL"),
    "number": tuple(str(d) for d in range(1, 10)),  # candidates: first digits
}
CARDINALITIES = ("binary", "compass", "phonetic", "number")
CHANCE = {"binary": 1 / 2, "compass": 1 / 4, "phonetic": 1 / 8, "number": 1 / 900, "number/first-digit": 1 / 9}
#: register names that are no payload word
REGISTERS = ("OMEGA", "SIGMA", "KAPPA", "THETA", "LAMBDA", "EPSILON", "GAMMA", "BETA", "ZETA", "IOTA")
QUESTION = (
    "\nQuestion: What {what} does register {register} hold? {answer} Locate the mirror statement for that "
    "register, then end your answer with the final {word}."
)


def last_number(text: str) -> str | None:
    """The last standalone 3-digit number in ``text``, or None."""
    hits = re.findall(r"(?<!\d)(\d{3})(?!\d)", text)
    return hits[-1] if hits else None


@register
@dataclass
class Access(PairLayout, PairProbe):
    """Payload cardinality: binary, 4-way, 8-way, 3-digit numbers."""

    name: ClassVar[str] = "access"
    smoke_options: ClassVar[dict] = {"max_new_tokens": 3, "n_events": 8, "source_slots": (2, 3), "root_slot": 5}

    root_slot: int = 13
    cardinalities: tuple[str, ...] = CARDINALITIES
    readout: str = "both"
    max_new_tokens: int = 64
    instruction: str = INSTRUCTION
    answer_prefix: str = "Answer:"

    def validate(self) -> None:
        self.check_layout(("root", self.root_slot))
        check_choices("cardinalities", self.cardinalities, CARDINALITIES, what="payload cardinalities")
        self.check_readout()

    def pair_arms(self) -> list[PairArm]:
        return [
            PairArm("kv", "main", ("decoy", "root"), description="compact {decoy, root}"),
            PairArm("text", "main", "all", "prefill", description="every event as text: comprehension"),
        ]

    def _item(self, seed: int, index: int) -> dict:
        rng = random.Random(f"access:{seed}:{index}")
        card = self.cardinalities[index % len(self.cardinalities)]
        dec, src, root = rng.sample(REGISTERS, 3)
        slot = rng.randint(*self.source_slots)
        if card == "number":
            num_a = rng.randrange(100, 1000)
            num_b = rng.choice([x for x in range(100, 1000) if str(x)[0] != str(num_a)[0]])
            a, b, dv = str(num_a), str(num_b), str(rng.randrange(100, 1000))
            gold = [a[0], b[0]]
            what, answer, word = "value", "Answer with the 3-digit number.", "number"
            body_of = lambda reg, v: f"register {reg} set to value {v}"  # noqa: E731
        else:
            space = PAYLOADS[card]
            a, b = rng.sample(space, 2)
            dv = rng.choice(space)
            gold = [a, b]
            what = "state"
            answer = f"Answer {menu(space)}." if card == "binary" else f"Answer one of: {menu(space)}."
            word = "state word"
            body_of = lambda reg, v: f"register {reg} set to state {v}"  # noqa: E731
        others = [r for r in REGISTERS if r not in (dec, src, root)]
        fill = {
            i: f"register {rng.choice(others)} refreshed to {rng.randrange(100, 1000)}" for i in range(self.n_events)
        }
        events = []
        for value in (a, b):
            body = dict(fill)
            body[self.decoy_slot] = body_of(dec, dv)
            body[slot] = body_of(src, value)
            body[self.root_slot] = f"register {root} mirrors register {src}"
            events.append([event_text(i, body[i]) for i in range(self.n_events)])
        return {
            "index": index,
            "cardinality": card,
            "names": {"decoy": dec, "source": src, "root": root},
            "source_slot": slot,
            "values": [a, b],
            "gold_candidates": gold,
            "decoy_value": dv,
            "candidates": list(PAYLOADS[card]),
            "histories": {"main": events},
            "roles": {"main": {"decoy": self.decoy_slot, "root": self.root_slot}},
            "questions": {"main": QUESTION.format(what=what, register=root, answer=answer, word=word)},
        }

    def request(self, item: dict) -> PairRequest:
        card = item["cardinality"]
        return PairRequest(item, last_number if card == "number" else (lambda t: last_state(t, PAYLOADS[card])))

    def finish(self, rt: Runtime, item: dict, run: PairRun) -> dict:
        events = variant_events(item["histories"]["main"])
        return pair_record(item, run, events, after_index=("cardinality",), after_values=("gold_candidates",))

    def summarize(self, records: Sequence[dict]) -> Summary:
        return summarize_access(records, self)

    def figure(self, records: Sequence[dict], path) -> None:
        access_figure(self.summarize(records).data, path)

    @classmethod
    def contract_section(cls, summary: Summary) -> ContractSection:
        """The access clause of the memory contract (Study 1, "The memory contract" — Access:
        binary .934, 4-way .223, 8-way .156, 3-digit numbers 0/192 exact): per payload, kv recovery
        per answer on the primary readout with its Wilson interval and the exact binomial test
        against chance. The JSON section ``capacity`` holds, per payload, recovery, chance,
        p(> chance), ``above_chance`` (p < .05) and the kv arm's d, plus the largest payload above
        chance; with the candidate readout primary, ``number_exact`` adds generation's exact match
        when it ran. Also the figure ``access.png``. Rates are proportions, d in nats.

        Raises:
            KeyError: ``summary`` is not an access summary.
        """
        ac = summary.data
        ro = ac["primary"]
        study = {
            "binary": ".934 (chance .5)",
            "compass": ".223 (chance .25)",
            "phonetic": ".156 (chance .125)",
            "number": "0/192 exact",
        }
        rows, env = [], {}
        for card in CARDINALITIES:
            r = ac["recovery"].get(f"{card}/kv/{ro}")
            if not r:
                continue
            rows.append(
                ContractRow(
                    "access",
                    f"{card}: kv recovery per answer ({r['measure']}, {ro})",
                    f"{r['rate']['rate']:.3f}",
                    f"{proportion(r['rate'])}; chance {r['chance']:.3g}, p(> chance) = {format_p(r['p'])}",
                    study[card],
                )
            )
            env[card] = {
                "measure": r["measure"],
                "recovery": r["rate"],
                "chance": r["chance"],
                "p_above_chance": r["p"],
                "above_chance": bool(r["p"] < 0.05),
                "d": ac.get("arms", {}).get(card, {}).get("d/kv"),
            }
            if card == "number" and ro == "logits":
                g = ac["recovery"].get("number/kv/generate")
                if g:
                    env["number_exact"] = {"recovery": g["rate"], "chance": g["chance"], "p_above_chance": g["p"]}
        data = {
            "readout": ro,
            "payloads": env,
            "largest_payload_above_chance": next(
                (c for c in reversed(CARDINALITIES) if env.get(c, {}).get("above_chance")), None
            ),
        }
        return ContractSection("capacity", data, rows, figure=("access.png", partial(access_figure, ac)))


def recovery_rows(records: Sequence[dict], readouts: Sequence[str]) -> tuple[list[list[str]], dict]:
    """Per cardinality, arm and readout: per-answer recovery (Wilson 95%) and the exact one-sided
    binomial test against chance (``scipy.stats.binomtest(k, n, chance, alternative="greater")``)."""
    from scipy import stats as st

    rows, data = [], {}
    for card in CARDINALITIES:
        rs = [r for r in records if r["cardinality"] == card]
        if not rs:
            continue
        for arm in ("kv", "text"):
            for ro in readouts:
                label = (
                    "first-digit" if (card == "number" and ro == "logits") else ("exact" if card == "number" else "")
                )
                chance = CHANCE["number/first-digit"] if label == "first-digit" else CHANCE[card]
                k = sum(sum(correct(r, arm, ro)) for r in rs)
                n = 2 * len(rs)
                w = wilson(k, n)
                p = float(st.binomtest(k, n, chance, alternative="greater").pvalue)
                data[f"{card}/{arm}/{ro}"] = {"rate": w.__dict__, "chance": chance, "p": p, "measure": label or "exact"}
                rows.append(
                    [card + (f" ({label})" if label else ""), arm, ro, f"{chance:.3g}", w.describe(3), format_p(p)]
                )
    return rows, data


def summarize_access(records: Sequence[dict], probe: Access) -> Summary:
    rows, data = recovery_rows(records, probe.readouts)
    tables = [
        Table(
            f"Access: recovery per answer vs chance ({len(records)} pairs, 2 answers each)",
            ["payload", "arm", "readout", "chance", "recovery [Wilson 95%]", "p (> chance, exact binomial)"],
            rows,
        )
    ]
    d: dict = {"recovery": data, "primary": primary_readout(probe.readouts), "arms": {}}
    for card in CARDINALITIES:
        rs = [r for r in records if r["cardinality"] == card]
        if rs:
            sub: dict = {}
            caption = f"{card}: donor-pair outcomes"
            tables += outcome_tables(rs, probe.pair_arms(), probe.readouts, caption, sub, f"{card}: " + D_CAPTION)
            d["arms"][card] = sub
    notes = [
        "recovery counts each variant's answer (2 per pair, not independent within a pair: the Wilson interval "
        "treats them as independent and is therefore somewhat narrow); the pair-level outcome tables are exact.",
        "number: 'exact' = the generated 3-digit number equals the source's; 'first-digit' = the candidate probe over "
        "1..9 picks the source's first digit.",
    ]
    return Summary(f"access: {len(records)} pairs", tables, [], notes, d)
