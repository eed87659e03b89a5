"""Served patches (Study 1, "Updates"): update a materialised history by appending a patch event
instead of rewriting it.

Item ``i`` is a register history of ``lengths[i mod len(lengths)]`` events (decoy at slot 0, the
source ``register S set to state OLD`` in the first third, fillers elsewhere), in two variants
with swapped OLD/NEW values. The value then changes to NEW, which can be recorded two ways:

* **patch**: append ``register S updated: now set to state NEW`` as a new event; only its ``p``
  tokens are computed, attending to the ``L`` stored rows: O(pL + p^2) attention;
* **rewrite**: edit the source event to NEW and re-prefill the whole history: O(L^2).

Timing (option ``timing``, on by default; wall-clock, so records are not bit-reproducible
when it is on): per item, variant A's original history is prefilled (not timed), then the patch
prefill on top of it and the full re-prefill of the rewritten history are each timed
``timing_repeats`` times (the minimum is kept, in milliseconds), at that item's L.

Leak (donor-pair scoring with the *new* values as gold: follow = both variants answer their NEW
value, anti = both answer their OLD one). Arms: ``patch-served`` {decoy, source, patch} — the stale
source served beside the patch; ``patch-not-served`` {decoy, source} from the same patched
prefill; ``patch-only`` {decoy, patch}; ``rewrite`` {decoy, source} of the re-prefilled rewritten
history; ``text`` (the patched history, every event). The **stale-value leak rate** of an arm is the
share of answers (2 per pair) equal to the OLD value, with a Wilson 95% interval.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from functools import partial
from typing import ClassVar, Sequence

from eventkv.kv.log import TokenizedLog
from eventkv.options import check_int, check_ints
from eventkv.probes.base import Runtime, Summary, Table, register
from eventkv.stats import wilson
from eventkv.studies.materialization.contract_rows import ContractRow, ContractSection, proportion
from eventkv.studies.materialization.donor_pair import INSTRUCTION, NAMES, QUESTION, event_text, last_state, menu
from eventkv.studies.materialization.figures import patch_figure
from eventkv.studies.materialization.pairs import (
    D_CAPTION,
    PairArm,
    PairProbe,
    PairRequest,
    PairRun,
    outcome_tables,
    pair_record,
    primary_readout,
    tokenize_pair,
    variant_events,
)

STATES = ("ONLINE", "OFFLINE")
PATCH = "register {register} updated: now set to state {value}"


@register
@dataclass
class Patch(PairProbe):
    """Patch event vs re-prefilling a rewritten history: time and stale-value leak."""

    name: ClassVar[str] = "patch"
    smoke_options: ClassVar[dict] = {"max_new_tokens": 3, "lengths": (6, 9), "timing": False}

    lengths: tuple[int, ...] = (24, 48, 96, 192)
    timing: bool = True
    timing_repeats: int = 2
    readout: str = "both"
    max_new_tokens: int = 64
    instruction: str = INSTRUCTION
    answer_prefix: str = "Answer:"

    def validate(self) -> None:
        check_ints(
            "lengths", self.lengths, "give distinct history lengths of at least 4 events (e.g. 24,48,96).", minimum=4
        )
        check_int("timing_repeats", self.timing_repeats, "time each update at least once.")
        self.check_readout()

    def pair_arms(self) -> list[PairArm]:
        return [
            PairArm("patch-served", "patched", ("decoy", "source", "patch"), description="stale source + patch"),
            PairArm("patch-not-served", "patched", ("decoy", "source"), description="stale source, patch dropped"),
            PairArm("patch-only", "patched", ("decoy", "patch"), description="patch without the source"),
            PairArm("rewrite", "rewritten", ("decoy", "source"), description="rewritten history, re-prefilled"),
            PairArm("text", "patched", "all", "prefill", description="patched history as text"),
        ]

    def _item(self, seed: int, index: int) -> dict:
        rng = random.Random(f"patch:{seed}:{index}")
        n = self.lengths[index % len(self.lengths)]
        dec, src = rng.sample(NAMES, 2)
        slot = rng.randint(1, max(1, n // 3))
        old_a, old_b = rng.sample(STATES, 2)
        dv = rng.choice(STATES)
        others = [r for r in NAMES if r not in (dec, src)]
        fill = {i: f"register {rng.choice(others)} refreshed to {rng.randrange(100, 1000)}" for i in range(n)}
        hist: dict[str, list[list[str]]] = {"patched": [], "rewritten": []}
        for old, new in ((old_a, old_b), (old_b, old_a)):
            body = dict(fill)
            body[0] = f"register {dec} set to state {dv}"
            body[slot] = f"register {src} set to state {old}"
            orig = [event_text(i, body[i]) for i in range(n)]
            hist["patched"].append(orig + [event_text(n, PATCH.format(register=src, value=new))])
            body[slot] = f"register {src} set to state {new}"
            hist["rewritten"].append([event_text(i, body[i]) for i in range(n)])
        return {
            "index": index,
            "n_events": n,
            "names": {"decoy": dec, "source": src},
            "source_slot": slot,
            "values": [old_b, old_a],
            "old_values": [old_a, old_b],
            "decoy_value": dv,
            "candidates": list(STATES),
            "histories": hist,
            "roles": {"patched": {"decoy": 0, "source": slot, "patch": n}, "rewritten": {"decoy": 0, "source": slot}},
            "questions": {"main": QUESTION.format(register=src, menu=menu(STATES))},
        }

    def request(self, item: dict) -> PairRequest:
        return PairRequest(item, lambda x: last_state(x, STATES))

    def finish(self, rt: Runtime, item: dict, run: PairRun) -> dict:
        events = {h: variant_events(v) for h, v in item["histories"].items()}
        rec = pair_record(item, run, events, after_index=("n_events",), after_values=("old_values",))
        if self.timing:
            rec["timing"] = self.time_updates(rt, item)
        return rec

    def time_updates(self, rt: Runtime, item: dict) -> dict:
        """Wall time (ms, minimum of ``timing_repeats``) of the patch prefill on top of the stored
        original history, and of the full re-prefill of the rewritten history (variant A)."""
        patched = tokenize_pair(rt, self.instruction, item["histories"]["patched"])[0]
        rewritten = tokenize_pair(rt, self.instruction, item["histories"]["rewritten"])[0]
        n = item["n_events"]
        orig_log = TokenizedLog(
            patched.header_ids, patched.event_ids[:n], patched.event_tokens[:n], patched.budgets[:n]
        )
        header = rt.header_kv(self.instruction)
        orig = rt.prefill(orig_log, prefix=header)
        t_patch, t_rewrite = math.inf, math.inf
        for _ in range(self.timing_repeats):
            t0 = time.perf_counter()
            rt.prefill(patched, prefix=orig)
            t_patch = min(t_patch, time.perf_counter() - t0)
            t0 = time.perf_counter()
            rt.prefill(rewritten, prefix=header)
            t_rewrite = min(t_rewrite, time.perf_counter() - t0)
        return {
            "L_tokens": orig_log.n_rows,
            "p_tokens": len(patched.event_tokens[n]),
            "patch_ms": round(1000 * t_patch, 3),
            "rewrite_ms": round(1000 * t_rewrite, 3),
            "rewrite_tokens": rewritten.n_rows - len(rewritten.header_ids),
        }

    def summarize(self, records: Sequence[dict]) -> Summary:
        return summarize_patch(records, self)

    def figure(self, records: Sequence[dict], path) -> None:
        patch_figure(self.summarize(records).data, path)

    @classmethod
    def contract_section(cls, summary: Summary) -> ContractSection:
        """The updates clause of the memory contract (Study 1, "Updates": stale value leaked 0/96
        with the patch served; patch 77 ms vs re-prefill 1033 ms at L ~ 9.2k): the stale-value leak
        with and without the patch served (primary readout), and the update time at the longest
        timed L (tokens; milliseconds, median over items) with both log-log slopes. The JSON section
        ``updates`` holds every leak rate and the timing table. Also the figure ``patch.png``.

        Raises:
            KeyError: ``summary`` is not a patch summary.
        """
        pa = summary.data
        ro = pa["primary"]
        ls, ln = pa["leak"].get(f"patch-served/{ro}"), pa["leak"].get(f"patch-not-served/{ro}")
        rows = [
            ContractRow(
                "updates", f"stale-value leak, patch served ({ro})", f"{ls['k']}/{ls['n']}", proportion(ls), "0/96"
            ),
            ContractRow(
                "updates",
                "stale-value leak, patch not served",
                f"{ln['k']}/{ln['n']}",
                proportion(ln),
                "(stale rows alone)",
            ),
        ]
        pts = {k: v for k, v in pa["timing"].items() if not k.startswith("slope/")}
        if pts:
            big = max(pts.values(), key=lambda p: p["L_tokens"])
            rows.append(
                ContractRow(
                    "updates",
                    f"update time at L = {big['L_tokens']:.0f} tokens: patch vs re-prefill",
                    f"{big['patch_ms']:.0f} ms vs {big['rewrite_ms']:.0f} ms",
                    f"log-log slopes: patch {pa['timing'].get('slope/patch_ms', math.nan):.2f}, "
                    f"re-prefill {pa['timing'].get('slope/rewrite_ms', math.nan):.2f}",
                    "77 ms vs 1033 ms at L ~ 9.2k",
                )
            )
        data = {"readout": ro, "leak": pa["leak"], "timing": pa["timing"]}
        return ContractSection("updates", data, rows, figure=("patch.png", partial(patch_figure, pa)))


def leak_rate(records: Sequence[dict], arm: str, readout: str):
    """Share of answers (2 per pair) equal to the variant's OLD value, Wilson 95%."""
    key = "answer" if readout == "generate" else "choice"
    k = sum(1 for r in records for v, old in zip("AB", r["old_values"]) if r["arms"][arm][v].get(key) == old)
    return wilson(k, 2 * len(records))


def summarize_patch(records: Sequence[dict], probe: Patch) -> Summary:
    import numpy as np

    arms = probe.pair_arms()
    data: dict = {
        "pairs": len(records),
        "primary": primary_readout(probe.readouts),
        "leak": {},
        "timing": {},
        "arms": {},
    }
    lrows = []
    for a in arms:
        for ro in probe.readouts:
            w = leak_rate(records, a.name, ro)
            data["leak"][f"{a.name}/{ro}"] = w.__dict__
            lrows.append([a.name, ro, w.describe(3)])
    tables = [
        Table(
            "Stale-value leak rate (answers equal to the OLD value; 2 per pair)",
            ["arm", "readout", "leak [Wilson 95%]"],
            lrows,
        ),
        *outcome_tables(
            records,
            arms,
            probe.readouts,
            "Update outcomes (follow = both variants answer their NEW value, anti = both their OLD one)",
            data["arms"],
            D_CAPTION.replace("own value", "own NEW value").replace("unserved source", "NEW value"),
        ),
    ]
    tests = []
    timed = [r for r in records if r.get("timing")]
    if timed:
        trows = []
        for L in sorted({r["n_events"] for r in timed}):
            ts = [r["timing"] for r in timed if r["n_events"] == L]
            med = lambda k, ts=ts: float(np.median([t[k] for t in ts]))  # noqa: E731
            row = {
                "events": L,
                "L_tokens": med("L_tokens"),
                "p_tokens": med("p_tokens"),
                "patch_ms": med("patch_ms"),
                "rewrite_ms": med("rewrite_ms"),
                "n": len(ts),
            }
            data["timing"][str(L)] = row
            trows.append(
                [
                    str(L),
                    f"{row['L_tokens']:.0f}",
                    f"{row['p_tokens']:.0f}",
                    str(len(ts)),
                    f"{row['patch_ms']:.1f}",
                    f"{row['rewrite_ms']:.1f}",
                    f"{row['rewrite_ms'] / max(row['patch_ms'], 1e-9):.1f}x",
                ]
            )
        tables.append(
            Table(
                "Update cost: patch event vs re-prefilling the rewritten history (median over items, ms)",
                ["events", "L (tokens)", "p (tokens)", "items", "patch ms", "re-prefill ms", "ratio"],
                trows,
            )
        )
        pts = list(data["timing"].values())
        if len(pts) >= 2:
            x = np.log([p["L_tokens"] for p in pts])
            for k in ("patch_ms", "rewrite_ms"):
                slope = float(np.polyfit(x, np.log([max(p[k], 1e-6) for p in pts]), 1)[0])
                data["timing"][f"slope/{k}"] = slope
                tests.append(
                    f"log-log slope of {k.replace('_ms', '')} time against L over {len(pts)} lengths: {slope:.2f} "
                    "(1 = linear, 2 = quadratic)"
                )
    notes = [
        "On a CPU at short L the weight-bound linear terms dominate both costs, so the re-prefill's slope is "
        "expected to sit "
        "between 1 and 2 and approaches 2 only at long L; the patch's cost grows with L through attention only.",
        "timings are wall-clock on this machine (minimum of the repeats, median over items).",
    ]
    return Summary(f"patch: {len(records)} pairs", tables, tests, notes, data)
