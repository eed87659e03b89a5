"""``eventkv audit``: the eviction audit on donor-pair histories (Study 1, "The
corollary for eviction research").

An eviction ablation that drops a source event and keeps its accuracy does not show the source
was unnecessary: rows kept after a global prefill may carry state computed from it, and the same
eviction under chunked or streaming encoding — no global prefill — then fails. Per donor pair
(the items of ``eventkv run donor-pair`` with the same seed: two histories that differ only in the
value the source event writes, a root event that mirrors it) and per policy x compression ratio:

* each variant's global prefill is captured (:func:`eventkv.eviction.capture.capture_prefill`)
  and the policy's per-(layer, KV head) keep masks computed on it; the source is **evicted** when
  no layer and no head keeps any of its rows, in both variants;
* the question is answered (forced choice between the states, candidate log-probs after
  ``answer_prefix``) under three conditions: ``full`` (every row), ``global`` (the kept rows of the
  global prefill, per-head masked native serving) and ``isolated`` (every event re-encoded alone
  at its positions — what chunked/streaming encoding stores — with the same masks);
* **accuracy held** in a condition when both variants answer their own source value (``follow``);
* the donor statistic ``d`` on the kept rows (global): log-odds shift toward each variant's value;
* an **ablation false negative**: source evicted, accuracy held (global), and ``d > 0`` — the
  kept rows still carry the evicted source's state.

The policies score the history with the window at its end (the question is not in the prefill:
the memory prefills history once and asks later), as a query-agnostic compressor would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Sequence, cast

import numpy as np

from eventkv.errors import OptionError
from eventkv.probes.base import Arm, Probe, Runtime, Summary, Table

if TYPE_CHECKING:
    from eventkv.studies.materialization.donor_pair import DonorPair

CONDITIONS = ("full", "global", "isolated")


def _windows(policy) -> list[int]:
    """The observation windows ``policy`` and the policies inside it (``Policy.members``) read."""
    found = [policy.window] if isinstance(getattr(policy, "window", None), int) else []
    for inner in policy.members():
        found += _windows(inner)
    return found


#: what KVzip's reconstruction pass asks before the history's tokens are read again (arXiv 2505.23416, Section 3)
RECONSTRUCTION_PROMPT = "Repeat the previous context exactly."


@dataclass
class EvictionAudit(Probe):
    """Options (all part of a run's identity): ``policies`` (names, or names with settings:
    ``snapkv(window=64,kernel=5,pooling=avg)``, :func:`eventkv.eviction.specs.parse_policy_spec`) and ``ratios``
    (compression ratios: fraction of rows evicted), ``window`` (observation window of the attention-based policies),
    ``sinks`` (StreamingLLM), ``states``, ``answer_prefix``, ``n_events``/``root_slot``/
    ``source_slots`` (the donor-pair layout)."""

    name: ClassVar[str] = "audit"
    #: 2: SnapKV's and PyramidKV's defaults are window 64, kernel 5, avg pooling (version 1: 32, 7, max) and
    #: ``--window`` defaults to 64, so a bare ``snapkv`` names other rows than in version 1
    record_version: ClassVar[int] = 2
    smoke_options: ClassVar[dict] = {"policies": ("streaming", "knorm"), "ratios": (0.5,), "window": 8}

    policies: tuple[str, ...] = ("streaming", "snapkv", "knorm")
    ratios: tuple[float, ...] = (0.5, 0.75)
    window: int = 64
    sinks: int = 4
    states: tuple[str, ...] = ("ONLINE", "OFFLINE")
    answer_prefix: str = "Answer:"
    n_events: int = 24
    root_slot: int = 13
    source_slots: tuple[int, int] = (8, 11)
    _donor: DonorPair | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.policies, self.ratios = tuple(self.policies), tuple(float(r) for r in self.ratios)
        # options arrive as JSON lists; validate (the DonorPair it builds) checks source_slots is a (lo, hi) pair
        self.states, self.source_slots = tuple(self.states), cast("tuple[int, int]", tuple(self.source_slots))
        self.validate()

    def options(self) -> dict:
        return {k: v for k, v in super().options().items() if not k.startswith("_")}

    def validate(self) -> None:
        from eventkv.eviction.specs import POLICIES, parse_policy_spec
        from eventkv.options import check_int
        from eventkv.studies.materialization.donor_pair import DonorPair

        if not self.policies or len(set(self.policies)) != len(self.policies):
            raise OptionError(
                "policies", ",".join(self.policies), f"give distinct policies: {', '.join(POLICIES)}.", flag="--policy"
            )
        for spec in self.policies:  # a name, or a name with settings: snapkv(window=64,kernel=5,pooling=avg)
            parse_policy_spec(spec)
        if not self.ratios or any(not 0 <= r < 1 for r in self.ratios) or len(set(self.ratios)) != len(self.ratios):
            raise OptionError(
                "ratios",
                self.ratios,
                "give distinct compression ratios in [0, 1): the fraction of rows evicted.",
                flag="--ratio",
            )
        check_int("window", self.window, "observe at least 1 token.", flag="--window")
        check_int("sinks", self.sinks, "keep at least 0 sink positions.", minimum=0, flag="--sinks")
        for spec in self.policies:  # each policy checks its own parameters: refused here as in the library
            try:
                policy = self._policy(spec, 0)
                for ratio in self.ratios:  # a setting that cannot apply a ratio (Finch's chunk)
                    policy.check_ratio(ratio)
            except OptionError as e:  # a setting inside the spec: name the spec, not a flag the command lacks
                if e.flag == "--policy":
                    raise
                raise OptionError("policies", spec, str(e), flag="--policy") from None
            window = max(_windows(policy), default=0)
            if window > self.window:  # every policy reads the one capture of --window queries, nested ones too
                nested = " (a policy inside it, when it names none: SnapKV's default window is 64)"
                raise OptionError(
                    "window",
                    self.window,
                    f"{spec} reads the last {window} queries{nested if policy.members() else ''}: give --window "
                    f"{window} or more, or the window in the spec.",
                    flag="--window",
                )
        self._donor = DonorPair(
            n_events=self.n_events,
            root_slot=self.root_slot,
            source_slots=self.source_slots,
            states=self.states,
            readout="logits",
            answer_prefix=self.answer_prefix,
            arm_names=("kv",),
        )

    def check_model(self, rt: Runtime) -> None:
        """Each policy's per-layer settings (a list per layer: ``per-layer``, ``per-layer-ratio``, duo's
        ``pattern``) against the model's layer count, before the run directory is made.

        Raises:
            OptionError: naming the spec (``--policy``) and the model's layer count.
        """
        for spec in self.policies:
            try:
                self._policy(spec, 0).check_layers(rt.profile.num_layers)
            except OptionError as e:
                raise OptionError("policies", spec, str(e), flag="--policy") from None

    def arms(self) -> list[Arm]:
        return [
            Arm("full", "all", "native", ("logits",), "every row of the global prefill"),
            Arm("global", "all", "native", ("logits",), "the policy's kept rows of the global prefill (per head)"),
            Arm("isolated", "all", "isolated", ("logits",), "every event encoded alone, the same rows kept"),
        ]

    def items(self, seed: int, indices: Sequence[int]) -> list[dict]:
        assert self._donor is not None  # built by validate(), which __post_init__ runs
        return self._donor.items(seed, indices)  # the donor-pair probe's items, same seed, same pairs

    def _policy(self, spec: str, index: int):
        """The policy of ``spec`` (a name, or a name with settings), its settings over the audit's own for that
        name: ``sinks`` for streaming, ``window`` for snapkv, pyramidkv and finch, the item's index as random's seed."""
        from eventkv.eviction.specs import parse_policy_spec, policy_from_spec

        name, _ = parse_policy_spec(spec)
        opts = {
            "streaming": {"sinks": self.sinks},
            "snapkv": {"window": self.window},
            "pyramidkv": {"window": self.window},
            "finch": {"window": self.window},
            "random": {"seed": index},
        }
        return policy_from_spec(spec, **opts.get(name, {}))

    def run_item(self, rt: Runtime, item: dict) -> dict:
        from eventkv.eviction.capture import capture_prefill, capture_reconstruction
        from eventkv.eviction.masked import read_out_masked
        from eventkv.eviction.policies import keep_mask, last_queries
        from eventkv.kv.log import tokenize_query
        from eventkv.kv.serve import serve
        from eventkv.studies.materialization.donor_pair import INSTRUCTION
        from eventkv.studies.materialization.pairs import donor_d, event_id, outcome, tokenize_pair

        logs = tokenize_pair(rt, INSTRUCTION, item["events"])
        a, b = item["values"]
        query = tokenize_query(rt.tokenizer, rt.profile, item["question"])
        cands = [rt.encode(" " + s) for s in self.states]
        opts: dict[str, Any] = {
            "candidates": cands,
            "candidate_texts": list(self.states),
            "answer_prefix_ids": rt.encode(self.answer_prefix),
            "max_context": rt.max_context,
        }
        # each variant's own source rows: the two values may tokenize to different lengths
        spans = [log.span(event_id(item["source_slot"])) for log in logs]
        src_rows = [slice(sp.row_start, sp.row_end) for sp in spans]

        def logprobs(readout) -> dict[str, float]:
            lps: dict[str, float] = {}
            for c in readout.candidates:
                lps.setdefault(c.text, round(c.logprob, 6))
            return lps

        captured, isolated, full, rebuilt = [], [], [], []
        # a policy that reads every prefill query (H2O's) gets them all captured; KVzip's, a reconstruction pass
        made = [self._policy(p, item["index"]) for p in self.policies]
        shortest = min(log.n_rows for log in logs)
        for spec, policy in zip(self.policies, made):
            window = max(_windows(policy), default=0)
            if window > shortest:  # the capture holds at most the history's rows as queries
                raise OptionError(
                    "window",
                    window,
                    f"{spec} reads the last {window} queries and pair {item['index']}'s history has {shortest} rows: "
                    f"give a window of at most {shortest} (--window, or the window in the spec).",
                    flag="--window",
                )
        every = any(p.needs_all_queries for p in made)
        repeat = RECONSTRUCTION_PROMPT if any(p.needs_reconstruction for p in made) else None
        for log in logs:
            window = max(self.window, log.n_rows) if every else self.window
            ekv, caps = capture_prefill(rt.model, log, window=window, max_context=rt.max_context)
            captured.append((ekv, caps))
            if repeat is not None:
                prompt = tokenize_query(rt.tokenizer, rt.profile, repeat)
                rebuilt.append(capture_reconstruction(rt.model, ekv, log, prompt, caps))
            isolated.append(serve(ekv, "all", "isolated", model=rt.model))
            full.append(logprobs(read_out_masked(rt.model, ekv, {}, query, **opts)))  # no mask: every row
        rec = {
            "index": item["index"],
            "values": item["values"],
            "source_slot": item["source_slot"],
            "source_rows": [[sp.row_start, sp.row_end] for sp in spans],
            "n_rows": [log.n_rows for log in logs],
            "full": {"logprobs": full, "outcome": _outcome(full, a, b, outcome)},
            "cells": {},
        }
        for pname in self.policies:
            policy = self._policy(pname, item["index"])
            for ratio in self.ratios:
                cell: dict[str, Any] = {"source_kept_cells": [], "kept_fraction": []}
                answers: dict[str, list[dict[str, float]]] = {"global": [], "isolated": []}
                for n, ((ekv, caps), iso, rows) in enumerate(zip(captured, isolated, src_rows)):
                    if policy.needs_reconstruction:
                        caps = rebuilt[n]
                    elif not policy.needs_all_queries:  # the others read the last --window queries, as always
                        caps = [last_queries(c, self.window) for c in caps]
                    try:
                        masks = [keep_mask(policy, c, ratio) for c in caps]
                        channels = [policy.key_channels(c, ratio) for c in caps]  # ThinK prunes key channels
                    except OptionError as e:  # a setting of the spec that this history cannot meet: name the spec
                        if e.flag == "--policy":
                            raise
                        raise OptionError("policies", pname, str(e), flag="--policy") from None
                    pruned = None if all(ch is None for ch in channels) else channels
                    cell["source_kept_cells"].append(int(sum(int(m[:, rows].sum()) for m in masks)))
                    cell.setdefault("source_cells", []).append(int(sum(m[:, rows].numel() for m in masks)))
                    cell["kept_fraction"].append(round(float(np.mean([m.float().mean().item() for m in masks])), 6))
                    answers["global"].append(
                        logprobs(read_out_masked(rt.model, ekv, masks, query, key_channels=pruned, **opts))
                    )
                    answers["isolated"].append(
                        logprobs(read_out_masked(rt.model, iso, masks, query, key_channels=pruned, **opts))
                    )
                evicted = all(k == 0 for k in cell["source_kept_cells"])
                d = donor_d(answers["global"][0], answers["global"][1], a, b)
                outs = {c: _outcome(answers[c], a, b, outcome) for c in ("global", "isolated")}
                cell.update(
                    source_evicted=evicted,
                    logprobs=answers,
                    outcomes=outs,
                    d=round(d, 6),
                    false_negative=evicted and outs["global"] == "follow" and d > 0,
                )
                rec["cells"][f"{pname}@{ratio:g}"] = cell
        return rec

    def summarize(self, records: Sequence[dict]) -> Summary:
        return summarize_audit(records, self)

    def figure(self, records: Sequence[dict], path) -> None:
        import textwrap

        from eventkv.probes.figures import pyplot, save_figure

        s = self.summarize(records).data
        plt = pyplot()
        # one small panel per policy spec (any number of them stays readable), the same axes and legend in each
        cols = min(4, len(self.policies))
        rows = -(-len(self.policies) // cols)
        fig, axes = plt.subplots(  # at least 7.5 inches wide: the legend's two columns fit
            rows, cols, figsize=(max(3.0 * cols, 7.5), 2.5 * rows + 0.6), sharex=True, sharey=True, squeeze=False
        )
        for ax, pname in zip(axes.flat, self.policies):
            cells = [c for c in s["cells"] if c["policy"] == pname]
            xs = [c["ratio"] for c in cells]
            ax.axhline(s["full"]["rate"], color="grey", lw=1)
            ax.plot(xs, [c["accuracy"]["global"]["rate"] for c in cells], "o-", color="C0")
            ax.plot(xs, [c["accuracy"]["isolated"]["rate"] for c in cells], "s--", color="C1")
            ax.plot(xs, [c["false_negative"]["rate"] for c in cells], "x:", color="C3")
            lines = textwrap.wrap(pname, 34)
            if len(lines) > 3:  # a long spec (a list per layer): its first lines, then an ellipsis
                lines = [*lines[:2], lines[2][:33] + "…"]
            ax.set_title("\n".join(lines), fontsize=8)
            ax.set_ylim(-0.03, 1.03)
            ax.tick_params(labelsize=7)
        for ax in axes.flat[len(self.policies) :]:
            ax.axis("off")
        for ax in axes[-1]:
            ax.set_xlabel("compression ratio", fontsize=8)
        for ax in axes[:, 0]:
            ax.set_ylabel("rate of pairs", fontsize=8)
        handles = [
            plt.Line2D([], [], color="grey", lw=1),
            plt.Line2D([], [], color="C0", marker="o"),
            plt.Line2D([], [], color="C1", marker="s", ls="--"),
            plt.Line2D([], [], color="C3", marker="x", ls=":"),
        ]
        labels = [
            "accuracy, full cache",
            "accuracy, kept rows (global prefill)",
            "accuracy, kept rows re-encoded (isolated)",
            "ablation false negatives",
        ]
        height = 2.5 * rows + 0.6  # inches: 0.6 above the panels for the legend
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1.0), ncol=2, fontsize=8, frameon=False)
        save_figure(fig, path, rect=(0, 0, 1, 1 - 0.6 / height))


def _outcome(lps: Sequence[dict], a: str, b: str, outcome) -> str:
    choice = [max(x, key=x.__getitem__) if x else None for x in lps]
    return outcome(choice[0], choice[1], a, b)


def summarize_audit(records: Sequence[dict], probe: EvictionAudit | None = None) -> Summary:
    """Per policy x ratio: accuracy in the three conditions (Wilson), the source-evicted rate, the
    false-negative rate (Wilson), global vs isolated (McNemar on the held/not-held pairs), the
    pooled d over source-evicted items (sign and Wilcoxon tests)."""
    from eventkv.stats import format_p, mcnemar_exact, median, sign_test_d, wilcoxon_d, wilson

    n = len(records)
    full = wilson(sum(r["full"]["outcome"] == "follow" for r in records), n)
    keys = list(records[0]["cells"]) if records else []
    rows, cells = [], []
    for key in keys:
        pname, ratio = key.rsplit("@", 1)
        cs = [r["cells"][key] for r in records]
        held = {c: [x["outcomes"][c] == "follow" for x in cs] for c in ("global", "isolated")}
        acc = {c: wilson(sum(v), n) for c, v in held.items()}
        evicted = wilson(sum(x["source_evicted"] for x in cs), n)
        kept_share = [k / t for x in cs for k, t in zip(x["source_kept_cells"], x.get("source_cells", [])) if t]
        rows_kept = [f for x in cs for f in x.get("kept_fraction", [])]
        fn = wilson(sum(x["false_negative"] for x in cs), n)
        g_only = sum(g and not i for g, i in zip(held["global"], held["isolated"]))
        i_only = sum(i and not g for g, i in zip(held["global"], held["isolated"]))
        mc = mcnemar_exact(g_only, i_only)
        ds = [x["d"] for x in cs if x["source_evicted"]]
        sign = sign_test_d(ds) if ds else None
        wil = wilcoxon_d(ds) if ds else None
        cells.append(
            {
                "policy": pname,
                "ratio": float(ratio),
                "accuracy": {c: acc[c].__dict__ for c in acc},
                "source_evicted": evicted.__dict__,
                "source_cells_kept": float(np.mean(kept_share)) if kept_share else None,
                "rows_kept": float(np.mean(rows_kept)) if rows_kept else None,
                "false_negative": fn.__dict__,
                "mcnemar_p": mc.p_value,
                "global_only": g_only,
                "isolated_only": i_only,
                "d_evicted": {
                    "n": len(ds),
                    "median": median(ds) if ds else None,
                    "sign_p": sign.p_value if sign else None,
                    "wilcoxon_p": wil.p_value if wil else None,
                },
            }
        )
        if ds:
            assert sign is not None and wil is not None  # both tested above whenever ds is non-empty
            d_cell = (
                f"{median(ds):+.3f} (n={len(ds)}); sign p {format_p(sign.p_value)}, Wilcoxon p "
                f"{format_p(wil.p_value) if wil.p_value == wil.p_value else 'n/a'}"
            )
        else:
            d_cell = "n/a (source never evicted)"
        rows.append(
            [
                pname,
                ratio,
                acc["global"].describe(2),
                acc["isolated"].describe(2),
                f"{np.mean(rows_kept):.3f}" if rows_kept else "n/a",
                evicted.describe(2),
                f"{np.mean(kept_share):.3f}" if kept_share else "n/a",
                fn.describe(2),
                f"{g_only}:{i_only}, p {format_p(mc.p_value) if mc.p_value == mc.p_value else 'n/a'}",
                d_cell,
            ]
        )
    tables = [
        Table(
            f"Eviction audit on donor pairs (accuracy with the full cache: {full.describe(2)})",
            [
                "policy",
                "ratio",
                "accuracy, kept rows (global)",
                "accuracy, kept rows re-encoded (isolated)",
                "rows kept (mean)",
                "source evicted",
                "source cells kept (mean)",
                "ablation false negatives",
                "global:isolated only (McNemar)",
                "median d when evicted",
            ],
            rows,
        )
    ]
    notes = [
        "Accuracy: both variants of a pair answer their own source value (forced choice between the states).",
        "An ablation false negative: the policy evicted every row of the source in every layer and head, accuracy "
        "held on the kept rows of the global prefill, and the kept rows still lean toward the source's value "
        "(d > 0). The isolated column is the same eviction under chunked/streaming encoding.",
        "Compression ratio: the fraction of rows evicted per layer and KV head (the header counts as rows), unless "
        "a note below says otherwise for a policy; rows kept: the share of (layer, KV head, row) cells kept, mean "
        "over pairs and variants.",
        "Source cells kept: the share of the source's (layer, KV head, row) cells the policy kept, mean over pairs and "
        "variants; a per-head policy rarely evicts every cell, so read it beside the source-evicted rate.",
    ]
    if probe is not None:
        for spec in probe.policies:
            use = probe._policy(spec, 0).ratio_use()
            if use:
                notes.append(f"{spec}: the ratio is {use}.")
    if n and full.rate < 0.75:
        notes.insert(
            0,
            f"WARNING: with the full cache only {full.k}/{n} pairs are answered right: the model does not solve the "
            "task, so accuracy that holds or falls under eviction says little; use a model that solves it.",
        )
    return Summary(
        f"audit: {n} donor pairs, {len(keys)} policy x ratio cells",
        tables,
        notes=notes,
        data={"n": n, "full": full.__dict__, "cells": cells},
    )
