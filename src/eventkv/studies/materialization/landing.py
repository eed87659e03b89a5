"""Landing (Study 1, "The memory contract" — Landing): where does materialised state live?

One donor pair per item, over two histories that share the donor-pair layout (decoy at slot 0,
source ``register S set to state v`` in 8..11, fillers elsewhere):

* ``main``: root ``register M mirrors register S`` (slot 13), **reference edge**
  ``register T mirrors register M`` (slot 16) and a **benign mention** of the root's entity
  ``register M passed a routine check`` (slot 19);
* ``chain``: the same root and edge, and at slot 19 a third link ``register U mirrors register T``
  (a depth-3 chain S -> M -> T -> U). Its history length differs from ``main``'s, which is what
  the position control is for.

Arms (compact serving unless named otherwise; the source is never served):

* ``root`` {decoy, root}, asks M; ``root+mention`` {decoy, root, mention}, asks M — the
  modulation of root donor sensitivity by a co-served benign mention;
* ``edge`` {decoy, edge}, asks T; ``edge+root`` {decoy, root, edge}, asks T — does the edge carry
  the value, or route back to the root?
* ``factorial`` {decoy, root, mention} with the mention's rows taken from the *other* variant's
  prefill (root donor x mention donor; with ``root+mention`` this fills the 2x2 table);
* ``chain3`` {decoy, link 3}, asks U; ``chain3+links`` {decoy, root, edge, link 3}, asks U;
* position control: ``root@pos`` and ``chain3@pos`` — the same as ``root`` and ``chain3`` with the
  query at the item's common position (the larger of the two histories' ends), so the query's
  absolute position is the same in all ``@pos`` arms;
* ``text`` (main, every event, asks M) and ``text-chain`` (chain, every event, asks U):
  comprehension.

Factorial statistic: with ``P[r, m]`` the candidate probability of variant A's value when the
root's rows come from variant r and the mention's from variant m, per pair
``root effect = ½(P[A,A] − P[B,A] + P[A,B] − P[B,B])`` and
``mention effect = ½(P[A,A] − P[A,B] + P[B,A] − P[B,B])``; each is reported with a t interval,
and the mention effect gets a TOST equivalence test with margin ``tost_margin`` (default .075).
With the generation readout alone, P is the indicator "answered A's value".
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar, Sequence

from eventkv.options import check_float
from eventkv.probes.base import Runtime, Summary, Table, register
from eventkv.stats import format_p, mean_effect, tost
from eventkv.studies.materialization.contract_rows import (
    GRADED,
    ContractRow,
    ContractSection,
    d_tests,
    d_value,
    proportion,
)
from eventkv.studies.materialization.donor_pair import INSTRUCTION, NAMES, QUESTION, event_text, last_state, menu
from eventkv.studies.materialization.pairs import (
    PairArm,
    PairLayout,
    PairProbe,
    PairRequest,
    PairRun,
    candidate_share,
    outcome_tables,
    pair_record,
    pair_stats,
    primary_readout,
)

STATES = ("ONLINE", "OFFLINE")


@register
@dataclass
class Landing(PairLayout, PairProbe):
    """Root vs reference edge, co-served mention, root x mention factorial, depth-3 chains."""

    name: ClassVar[str] = "landing"
    smoke_options: ClassVar[dict] = {
        "max_new_tokens": 3,
        "n_events": 10,
        "source_slots": (2, 3),
        "root_slot": 5,
        "edge_slot": 7,
        "mention_slot": 9,
    }

    root_slot: int = 13
    edge_slot: int = 16
    mention_slot: int = 19
    tost_margin: float = 0.075
    readout: str = "both"
    max_new_tokens: int = 64
    instruction: str = INSTRUCTION
    answer_prefix: str = "Answer:"

    def validate(self) -> None:
        self.check_layout(("root", self.root_slot), ("edge", self.edge_slot), ("mention", self.mention_slot))
        check_float(
            "tost_margin", self.tost_margin, "give a margin strictly between 0 and 1 (e.g. 0.075).", low=0, high=1
        )
        self.check_readout()

    def pair_arms(self) -> list[PairArm]:
        P = PairArm
        return [
            P("root", "main", ("decoy", "root"), question="M", description="{decoy, root}, asks M"),
            P(
                "root+mention",
                "main",
                ("decoy", "root", "mention"),
                question="M",
                description="co-served benign mention",
            ),
            P(
                "edge",
                "main",
                ("decoy", "edge"),
                question="T",
                description="reference edge T mirrors M, without the root",
            ),
            P("edge+root", "main", ("decoy", "root", "edge"), question="T", description="edge served with the root"),
            P(
                "factorial",
                "main",
                ("decoy", "root", "mention"),
                question="M",
                swap=("mention",),
                description="root rows of this variant, mention rows of the other",
            ),
            P("chain3", "chain", ("decoy", "link3"), question="U", description="depth-3 link alone, asks U"),
            P(
                "chain3+links",
                "chain",
                ("decoy", "root", "edge", "link3"),
                question="U",
                description="whole chain served",
            ),
            P(
                "root@pos",
                "main",
                ("decoy", "root"),
                question="M",
                fixed_position=True,
                description="root, query at the common position",
            ),
            P(
                "chain3@pos",
                "chain",
                ("decoy", "link3"),
                question="U",
                fixed_position=True,
                description="chain3, query at the common position",
            ),
            P("text", "main", "all", "prefill", question="M", description="comprehension, asks M"),
            P("text-chain", "chain", "all", "prefill", question="U", description="comprehension of the chain, asks U"),
        ]

    def _item(self, seed: int, index: int) -> dict:
        rng = random.Random(f"landing:{seed}:{index}")
        dec, src, m, t, u = rng.sample(NAMES, 5)
        slot = rng.randint(*self.source_slots)
        a, b = rng.sample(STATES, 2)
        dv = rng.choice(STATES)
        others = [r for r in NAMES if r not in (dec, src, m, t, u)]
        fill = {
            i: f"register {rng.choice(others)} refreshed to {rng.randrange(100, 1000)}" for i in range(self.n_events)
        }
        hist: dict[str, list[list[str]]] = {"main": [], "chain": []}
        for value in (a, b):
            body = dict(fill)
            body[self.decoy_slot] = f"register {dec} set to state {dv}"
            body[slot] = f"register {src} set to state {value}"
            body[self.root_slot] = f"register {m} mirrors register {src}"
            body[self.edge_slot] = f"register {t} mirrors register {m}"
            main, chain = dict(body), dict(body)
            main[self.mention_slot] = f"register {m} passed a routine check"
            chain[self.mention_slot] = f"register {u} mirrors register {t}"
            hist["main"].append([event_text(i, main[i]) for i in range(self.n_events)])
            hist["chain"].append([event_text(i, chain[i]) for i in range(self.n_events)])
        mn = menu(STATES)
        return {
            "index": index,
            "names": {"decoy": dec, "source": src, "root": m, "edge": t, "link3": u},
            "source_slot": slot,
            "values": [a, b],
            "decoy_value": dv,
            "candidates": list(STATES),
            "histories": hist,
            "roles": {
                "main": {
                    "decoy": self.decoy_slot,
                    "root": self.root_slot,
                    "edge": self.edge_slot,
                    "mention": self.mention_slot,
                },
                "chain": {
                    "decoy": self.decoy_slot,
                    "root": self.root_slot,
                    "edge": self.edge_slot,
                    "link3": self.mention_slot,
                },
            },
            "questions": {k: QUESTION.format(register=r, menu=mn) for k, r in (("M", m), ("T", t), ("U", u))},
        }

    def request(self, item: dict) -> PairRequest:
        return PairRequest(item, lambda x: last_state(x, STATES))

    def finish(self, rt: Runtime, item: dict, run: PairRun) -> dict:
        return pair_record(item, run, item["histories"])

    def summarize(self, records: Sequence[dict]) -> Summary:
        return summarize_landing(records, self)

    def figure(self, records: Sequence[dict], path) -> None:
        from eventkv.studies.materialization.figures import arm_bars

        arm_bars(records, [a.name for a in self.pair_arms()], primary_readout(self.readouts), "landing", path)

    @classmethod
    def contract_section(cls, summary: Summary) -> ContractSection:
        """The landing clause of the memory contract (Study 1, "The memory contract" — Landing: the
        root carries the donor signal, the reference edge routes back to it, a co-served benign
        mention drops root sensitivity 41% -> 22%): root, edge and mention sensitivities, their
        graded d, the factorial's mention effect with its TOST, the depth-3 chain and the position
        control, on the primary readout. The JSON section ``landing`` holds the primary readout's
        arms, every arm's d and the factorial. Rates are proportions, d in nats.

        Raises:
            KeyError: ``summary`` is not a landing summary.
        """
        la = summary.data
        ro = la["primary"]
        a = la["arms"]

        def prev(arm: str) -> dict:
            return a[f"{arm}/{ro}"]["prevalence"]

        def rate(arm: str) -> dict:
            return a[f"{arm}/{ro}"]["rate"]

        rows = [
            ContractRow(
                "landing",
                f"root donor sensitivity, {{decoy, root}} ({ro})",
                proportion(prev("root")).split(" [")[0],
                proportion(prev("root")),
                "root carries the donor signal",
            ),
            ContractRow(
                "landing",
                "reference edge T mirrors M: sensitivity without / with the root",
                f"{prev('edge')['rate']:.3f} / {prev('edge+root')['rate']:.3f}",
                f"{proportion(prev('edge'))} / {proportion(prev('edge+root'))}",
                "edge mostly routes back to the root",
            ),
            ContractRow(
                "landing",
                "co-served benign mention: root sensitivity without -> with",
                f"{prev('root')['rate']:.3f} -> {prev('root+mention')['rate']:.3f}",
                proportion(prev("root+mention")),
                "41% -> 22% (Qwen3)",
            ),
        ]
        if "d/root" in a:
            rows.append(
                ContractRow(
                    "landing",
                    "graded donor shift d: root alone -> with the co-served mention",
                    f"{d_value(a['d/root'])} -> {d_value(a.get('d/root+mention'))}",
                    f"root {d_tests(a['d/root'])}; root+mention {d_tests(a.get('d/root+mention'))}",
                    GRADED,
                )
            )
            rows.append(
                ContractRow(
                    "landing",
                    "graded donor shift d: reference edge without / with the root",
                    f"{d_value(a.get('d/edge'))} / {d_value(a.get('d/edge+root'))}",
                    f"edge {d_tests(a.get('d/edge'))}; edge+root {d_tests(a.get('d/edge+root'))}",
                    GRADED,
                )
            )
        f = la.get(f"factorial/{ro}")
        if f:
            m = f["mention"]
            rows.append(
                ContractRow(
                    "landing",
                    f"mention-donor effect (root x mention factorial), TOST margin {f['margin']}",
                    f"{m['mean']:+.3f}" if m["n"] else "n/a",
                    f"95% CI [{m['low']:+.3f}, {m['high']:+.3f}], TOST p = {format_p(f['tost_mention_p'])}; "
                    f"root effect {f['root']['mean']:+.3f}"
                    + (
                        "; the root effect is itself equivalent to 0, so this equivalence is vacuous here"
                        if f["tost_root_p"] < 0.05
                        else ""
                    ),
                    "equivalence test, margin .075",
                )
            )
        rows.append(
            ContractRow(
                "landing",
                "depth-3 chain: follow rate, link alone / whole chain",
                f"{rate('chain3')['rate']:.3f} / {rate('chain3+links')['rate']:.3f}",
                f"{proportion(rate('chain3'))} / {proportion(rate('chain3+links'))}",
                "multi-hop chains (depth 3)",
            )
        )
        rows.append(
            ContractRow(
                "landing",
                "position control: root follow rate, own / common query position",
                f"{rate('root')['rate']:.3f} / {rate('root@pos')['rate']:.3f}",
                f"{proportion(rate('root'))} / {proportion(rate('root@pos'))}",
                "query position held fixed",
            )
        )
        data = {
            "readout": ro,
            "arms": {k: v for k, v in a.items() if k.endswith(f"/{ro}")},
            "d": {k.removeprefix("d/"): v for k, v in a.items() if k.startswith("d/")},
            "factorial": f,
        }
        return ContractSection("landing", data, rows)


def factorial_effects(records: Sequence[dict], readout: str) -> tuple[list[float], list[float]]:
    """Per pair, the root-donor and mention-donor effects on P(variant A's value) (module docstring)."""
    roots, mentions = [], []
    for r in records:
        a = r["values"][0]

        def p(arm: str, v: str, r=r, a=a) -> float:
            out = r["arms"][arm][v]
            if readout == "logits":
                return candidate_share(out, a)
            return 1.0 if out.get("answer") == a else 0.0

        aa, bb = p("root+mention", "A"), p("root+mention", "B")
        ab, ba = p("factorial", "A"), p("factorial", "B")  # factorial A: root A, mention B; B: root B, mention A
        roots.append(0.5 * ((aa - ba) + (ab - bb)))
        mentions.append(0.5 * ((aa - ab) + (ba - bb)))
    return roots, mentions


def summarize_landing(records: Sequence[dict], probe: Landing) -> Summary:
    """Outcome table per arm, the root x mention factorial (effects, TOST), and the comparisons
    the study reads: root vs root+mention sensitivity, edge vs edge+root, chain3 vs chain3@pos."""
    arms = probe.pair_arms()
    data: dict = {"pairs": len(records), "primary": primary_readout(probe.readouts), "arms": {}}
    caption = f"Landing: outcomes per arm ({len(records)} pairs)"
    tables = outcome_tables(records, arms, probe.readouts, caption, data["arms"])
    tests = []
    frows = []
    for ro in probe.readouts:
        roots, mentions = factorial_effects(records, ro)
        re_, me_ = mean_effect(roots), mean_effect(mentions)
        t = tost(mentions, probe.tost_margin)
        tr = tost(roots, probe.tost_margin)
        data[f"factorial/{ro}"] = {
            "root": re_.__dict__,
            "mention": me_.__dict__,
            "tost_mention_p": t.p,
            "tost_root_p": tr.p,
            "margin": probe.tost_margin,
        }
        frows.append([ro, re_.describe(), me_.describe(), format_p(t.p), format_p(tr.p)])
        tests.append(f"{ro}: mention-donor effect, {t.describe()}")
        tests.append(f"{ro}: root-donor effect, t-test vs 0: {re_.describe()}")
    unit = "P(A's value) from candidate shares (logits) or answer indicators (generate)"
    tables.append(
        Table(
            f"Root donor x mention donor factorial ({unit})",
            [
                "readout",
                "root effect [95% CI]",
                "mention effect [95% CI]",
                f"TOST p, mention (margin {probe.tost_margin})",
                "TOST p, root",
            ],
            frows,
        )
    )
    crow = []
    for ro in probe.readouts:
        for a1, a2, what in (
            ("root", "root+mention", "co-served mention"),
            ("edge", "edge+root", "root beside the edge"),
            ("root", "root@pos", "query at common position"),
            ("chain3", "chain3@pos", "query at common position"),
            ("chain3", "chain3+links", "whole chain served"),
        ):
            s1, s2 = pair_stats(records, a1, ro), pair_stats(records, a2, ro)
            crow.append([ro, f"{a1} -> {a2}", what, s1["prevalence"].describe(2), s2["prevalence"].describe(2)])
    tables.append(
        Table(
            "Donor sensitivity (follow + anti) in the comparisons the study reads",
            ["readout", "arms", "change", "sensitive before", "sensitive after"],
            crow,
        )
    )
    notes = [
        "factorial: P[r, m] is the probability of variant A's value when the root's rows come from variant r and the "
        "mention's rows from variant m; the mention effect is equivalent to zero when the TOST p < .05.",
        "@pos arms answer with the query at the larger of the two histories' ends (same absolute position for every "
        "@pos arm of a pair); other arms answer right after their own history.",
    ]
    return Summary(f"landing: {len(records)} pairs", tables, tests, notes, data)
