"""The memory-contract battery (Study 1, "The memory contract", "Programmed carriers", "Updates"):
run every contract probe on one model, resumably, and write the contract.

``run_contract`` runs donor-pair, trigger-bank, landing, access, carriers and patch, each into
its own run directory ``OUT/<probe>/`` through the probe runner's records and manifests (so each
is resumable, refuses other settings, and ``eventkv report OUT/<probe>`` re-renders it), under
one progress display. It then writes

* ``OUT/contract.md`` — one row per contract clause: the measured figure, its interval or
  test, and the study's figure beside it; followed by every probe's summary;
* ``OUT/contract.json`` — the machine-readable contract: which constructions write and how
  strongly, the capacity envelope, landing, programming and update figures;
* ``OUT/figures/`` — write-through vs comprehension (``trigger.png``), access recovery vs chance
  (``access.png``), patch vs re-prefill time against L (``patch.png``).

Item counts per probe follow from ``--items N`` (see :func:`plan`); ``--quick`` is a smaller
preset with the candidate-logit readout only.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from eventkv.files import write_json_atomic
from eventkv.options import check_int
from eventkv.probes.base import Runtime, get_probe
from eventkv.probes.pairs import describe_d
from eventkv.probes.runner import (
    MANIFEST,
    environment,
    load_records,
    open_run,
    progress_bar,
    render,
    run_items,
)
from eventkv.stats import format_p

CONTRACT_PROBES = ("donor-pair", "trigger-bank", "landing", "access", "carriers", "patch")


@dataclass(frozen=True)
class Step:
    """One probe of the battery: its name, options and item count."""

    probe: str
    options: dict
    items: int


def plan(items: int = 24, quick: bool = False) -> list[Step]:
    """The battery for ``--items N``: donor pairs N; trigger bank 16 x max(2, N // 4) pairs
    (N // 4 per construction); landing N; access 4 x max(2, N // 2) (N // 2 per cardinality);
    carriers N; patch 4 x max(2, N // 4) over lengths 16, 32, 64, 128 events. Both readouts,
    64 new tokens. ``quick``: candidate logits only (no generation), trigger bank 2 per
    construction, access 4 per cardinality, patch lengths 16, 32, 64, and N as given for the rest
    (default 8).

    Raises:
        OptionError: ``items`` is not a whole number >= 2.
    """
    check_int("items", items, "the contract needs at least 2 items per probe.", minimum=2)
    if quick:
        ro = {"readout": "logits"}
        return [
            Step("donor-pair", ro, items),
            Step("trigger-bank", ro, 32),
            Step("landing", ro, items),
            Step("access", ro, 16),
            Step("carriers", ro, items),
            Step("patch", {**ro, "lengths": (16, 32, 64), "timing_repeats": 1}, 6),
        ]
    return [
        Step("donor-pair", {}, items),
        Step("trigger-bank", {}, 16 * max(2, items // 4)),
        Step("landing", {}, items),
        Step("access", {}, 4 * max(2, items // 2)),
        Step("carriers", {}, items),
        Step("patch", {"lengths": (16, 32, 64, 128), "timing_repeats": 1}, 4 * max(2, items // 4)),
    ]


def run_contract(
    rt: Runtime,
    *,
    model: str,
    out: str | Path,
    items: int = 24,
    quick: bool = False,
    seed: int = 0,
    console=None,
    progress: bool = True,
    only: tuple[str, ...] = CONTRACT_PROBES,
) -> dict:
    """Run the battery into ``out`` (resuming every probe directory) and write the contract.

    Returns:
        the contract dict (also written to ``out/contract.json``).

    Raises:
        EventKVError: a probe directory made with other settings, or a probe/model error.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    steps = [s for s in plan(items, quick) if s.probe in only]
    jobs = []
    for s in steps:
        probe = get_probe(s.probe)(**s.options)
        jobs.append(
            (s, probe, out / s.probe, *open_run(probe, rt, model=model, items=s.items, seed=seed, out=out / s.probe))
        )
    write_json_atomic(
        out / "contract-manifest.json",
        {
            "model": model,
            "items": items,
            "quick": quick,
            "seed": seed,
            "dtype": str(getattr(rt.profile, "dtype", "")).removeprefix("torch."),
            "dtype_reason": getattr(rt.profile, "dtype_reason", ""),
            "environment": environment(),
            "plan": [{"probe": s.probe, "options": probe.options(), "items": s.items} for s, probe, *_ in jobs],
        },
    )

    total = sum(s.items for s in steps)
    left = sum(len(j[4]) for j in jobs)
    with progress_bar(progress, console) as bar:
        task = bar.add_task("contract", total=total, completed=total - left) if bar else None
        for s, probe, d, manifest, todo in jobs:

            def describe(i: int, s=s) -> None:
                bar.update(task, description=f"contract: {s.probe} item {i + 1}/{s.items}")

            run_items(
                probe,
                rt,
                seed,
                d,
                manifest,
                todo,
                before=describe if bar else None,
                after=(lambda i: bar.advance(task)) if bar else None,
            )
    summaries = {s.probe: render(out / s.probe) for s in steps}
    return write_contract(out, model, summaries, quick=quick)


def provenance(out: Path, probes) -> dict:
    """Model, dtype, seed and compute time of a contract directory, from its probes' manifests:
    ``{"dtype", "seed", "seconds": {probe: s}, "total_seconds", "torch_threads": [...]}`` (seconds
    summed over every invocation that computed items)."""
    info: dict = {"seconds": {}, "torch_threads": set()}
    for p in probes:
        m = json.loads((out / p / MANIFEST).read_text())
        info.setdefault("dtype", m["identity"].get("dtype"))
        info.setdefault("seed", m["identity"].get("seed"))
        inv = m.get("invocations", [])
        info["seconds"][p] = round(sum(i.get("seconds", 0) for i in inv), 1)
        info["torch_threads"] |= {i["torch_threads"] for i in inv if "torch_threads" in i}
    info["total_seconds"] = round(sum(info["seconds"].values()), 1)
    info["torch_threads"] = sorted(info["torch_threads"])
    return info


def _hms(s: float) -> str:
    h, rem = divmod(int(round(s)), 3600)
    return f"{h} h {rem // 60} min" if h else f"{rem // 60} min {rem % 60} s"


# ---------------------------------------------------------------------------------------- the contract
def _p(d: dict | None) -> str:
    """A Wilson proportion dict as ``rate [low, high] (k/n)``."""
    if not d or not d.get("n"):
        return "n/a"
    return f"{d['rate']:.3f} [{d['low']:.3f}, {d['high']:.3f}] ({d['k']}/{d['n']})"


def _dtest(d: dict | None) -> str:
    """A :func:`~eventkv.probes.pairs.d_stats` dict as ``sign p = ..., Wilcoxon p = ...``."""
    if not d:
        return "n/a"
    return f"sign p = {format_p(d['sign_p'])}, Wilcoxon p = {format_p(d['wilcoxon_p'])} ({d['n']} pairs)"


def _dval(d: dict | None) -> str:
    return describe_d(d) if d else "n/a (no candidate readout)"


GRADED = "(study: follow:anti only)"


def _get(summaries: dict, probe: str) -> dict | None:
    s = summaries.get(probe)
    return s.data if s is not None else None


def contract_rows(summaries: dict) -> tuple[list[list[str]], dict]:
    """One row per clause — ``[clause, measure, measured, interval / test, study]`` — and the
    machine-readable contract."""
    rows: list[list[str]] = []
    js: dict = {}

    def add(clause, measure, value, detail, study):
        rows.append([clause, measure, value, detail, study])

    dp = _get(summaries, "donor-pair")
    if dp:
        ro = "logits" if "kv/logits" in dp["outcomes"] else "generate"
        o = dp["outcomes"][f"kv/{ro}"]
        add(
            "materialization (donor pair)",
            f"kv follow:anti ({ro}), sensitive share",
            f"{o['follow']}:{o['anti']}",
            f"p = {format_p(o['p'])}; sensitive {_p(o['prevalence'])}",
            "99:0, p = 3.2e-30 (Qwen3-8B); 130:0 of 256",
        )
        dd = dp.get("d", {}).get("kv")
        dd = {k: v for k, v in dd.items() if k != "values"} if dd else None
        if dd:
            add(
                "materialization (donor pair)",
                "graded donor shift d (kv, candidate log-odds)",
                _dval(dd),
                _dtest(dd),
                GRADED,
            )
        js["donor_pair"] = {
            "readout": ro,
            "follow": o["follow"],
            "anti": o["anti"],
            "p": o["p"],
            "prevalence": o["prevalence"],
            "d": dd,
        }

    tb = _get(summaries, "trigger-bank")
    if tb:
        ro = tb["primary"]
        cons = {k: v[ro] for k, v in tb["constructions"].items() if ro in v}
        comp = [v["comprehension"]["rate"] for v in cons.values() if "comprehension" in v]
        wt = {k: v["write_through"] for k, v in cons.items()}
        writes = {
            k: bool(v["follow"] > v["anti"] and not math.isnan(v["p_sign"]) and v["p_sign"] < 0.05)
            for k, v in cons.items()
        }
        if comp:
            add(
                "trigger",
                f"comprehension over {len(comp)} constructions ({ro})",
                f"mean {sum(comp) / len(comp):.3f}",
                f"min {min(comp):.3f}, max {max(comp):.3f}",
                ".98 mean (min .77)",
            )
        rates = [v["rate"] for v in wt.values()]
        best = max(wt, key=lambda k: wt[k]["rate"])
        add(
            "trigger",
            f"write-through over {len(rates)} constructions ({ro})",
            f"{min(rates):.3f} to {max(rates):.3f}",
            f"best: {best} {_p(wt[best])}",
            "from chance to .95",
        )
        add(
            "trigger",
            "constructions that write (follow > anti, sign test p < .05)",
            f"{sum(writes.values())}/{len(writes)}",
            ", ".join(k for k, w in writes.items() if w) or "none",
            "none writes on all three recent checkpoints",
        )
        pooled = tb.get("d/kv")
        lo = tb["constructions"]
        dpos = [
            k for k, v in lo.items() if v.get("logits", {}).get("p_d", math.nan) < 0.05 and v["logits"]["median_d"] > 0
        ]
        if pooled:
            add(
                "trigger",
                "graded write-through: kv donor shift d, 16 constructions pooled",
                _dval(pooled),
                f"{_dtest(pooled)}; constructions with d > 0 at sign p < .05: {len(dpos)}/{len(lo)}"
                + (f" ({', '.join(dpos)})" if dpos else ""),
                GRADED,
            )
        dis = [
            k
            for k, v in cons.items()
            if v.get("p_dissociation", math.nan) < 0.05 and v.get("text_only", 0) > v.get("kv_only", 0)
        ]
        sp = tb.get(f"spearman/{ro}")
        add(
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
        js["trigger"] = {
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

    la = _get(summaries, "landing")
    if la:
        ro = la["primary"]
        a = la["arms"]
        prev = lambda arm: a[f"{arm}/{ro}"]["prevalence"]  # noqa: E731
        add(
            "landing",
            f"root donor sensitivity, {{decoy, root}} ({ro})",
            _p(prev("root")).split(" [")[0],
            _p(prev("root")),
            "root carries the donor signal",
        )
        add(
            "landing",
            "reference edge T mirrors M: sensitivity without / with the root",
            f"{prev('edge')['rate']:.3f} / {prev('edge+root')['rate']:.3f}",
            f"{_p(prev('edge'))} / {_p(prev('edge+root'))}",
            "edge mostly routes back to the root",
        )
        add(
            "landing",
            "co-served benign mention: root sensitivity without -> with",
            f"{prev('root')['rate']:.3f} -> {prev('root+mention')['rate']:.3f}",
            _p(prev("root+mention")),
            "41% -> 22% (Qwen3)",
        )
        if "d/root" in a:
            add(
                "landing",
                "graded donor shift d: root alone -> with the co-served mention",
                f"{_dval(a['d/root'])} -> {_dval(a.get('d/root+mention'))}",
                f"root {_dtest(a['d/root'])}; root+mention {_dtest(a.get('d/root+mention'))}",
                GRADED,
            )
            add(
                "landing",
                "graded donor shift d: reference edge without / with the root",
                f"{_dval(a.get('d/edge'))} / {_dval(a.get('d/edge+root'))}",
                f"edge {_dtest(a.get('d/edge'))}; edge+root {_dtest(a.get('d/edge+root'))}",
                GRADED,
            )
        f = la.get(f"factorial/{ro}")
        if f:
            m = f["mention"]
            add(
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
        add(
            "landing",
            "depth-3 chain: follow rate, link alone / whole chain",
            f"{a[f'chain3/{ro}']['rate']['rate']:.3f} / {a[f'chain3+links/{ro}']['rate']['rate']:.3f}",
            f"{_p(a[f'chain3/{ro}']['rate'])} / {_p(a[f'chain3+links/{ro}']['rate'])}",
            "multi-hop chains (depth 3)",
        )
        add(
            "landing",
            "position control: root follow rate, own / common query position",
            f"{a[f'root/{ro}']['rate']['rate']:.3f} / {a[f'root@pos/{ro}']['rate']['rate']:.3f}",
            f"{_p(a[f'root/{ro}']['rate'])} / {_p(a[f'root@pos/{ro}']['rate'])}",
            "query position held fixed",
        )
        js["landing"] = {
            "readout": ro,
            "arms": {k: v for k, v in a.items() if k.endswith(f"/{ro}")},
            "d": {k.removeprefix("d/"): v for k, v in a.items() if k.startswith("d/")},
            "factorial": f,
        }

    ac = _get(summaries, "access")
    if ac:
        ro = ac["primary"]
        study = {
            "binary": ".934 (chance .5)",
            "compass": ".223 (chance .25)",
            "phonetic": ".156 (chance .125)",
            "number": "0/192 exact",
        }
        env = {}
        for card in ("binary", "compass", "phonetic", "number"):
            r = ac["recovery"].get(f"{card}/kv/{ro}")
            if not r:
                continue
            add(
                "access",
                f"{card}: kv recovery per answer ({r['measure']}, {ro})",
                f"{r['rate']['rate']:.3f}",
                f"{_p(r['rate'])}; chance {r['chance']:.3g}, p(> chance) = {format_p(r['p'])}",
                study[card],
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
        js["capacity"] = {
            "readout": ro,
            "payloads": env,
            "largest_payload_above_chance": next(
                (c for c in ("number", "phonetic", "compass", "binary") if env.get(c, {}).get("above_chance")), None
            ),
        }

    ca = _get(summaries, "carriers")
    if ca:
        ro = ca["primary"]
        a = ca["arms"]
        kinds = [k for k in ("passive", "binding", "directive", "compute") if f"{k}+row/{ro}" in a]
        rate = lambda arm: a[f"{arm}/{ro}"]["rate"]  # noqa: E731
        add(
            "programming",
            f"shared row alone ({ro}, fixed query position)",
            f"{rate('row')['rate']:.3f}",
            _p(rate("row")),
            ".00",
        )
        if kinds:
            best = max(kinds, key=lambda k: rate(f"{k}+row")["rate"])
            add(
                "programming",
                "best answer-free carrier beside the row (highest follow rate; a tie names the first)",
                f"{rate(best + '+row')['rate']:.3f}",
                f"{best}: {_p(rate(best + '+row'))}; alone {_p(rate(best))}",
                "+ carrier .42; recovery .06 -> .51",
            )
        if kinds and "d/row" in a:
            bd = max(kinds, key=lambda k: a.get(f"d/{k}+row", {}).get("median", -math.inf))
            add(
                "programming",
                f"graded: donor shift d, shared row alone vs the best (by median d) of {len(kinds)} carriers "
                "beside it (not corrected for the choice)",
                f"{round(a['d/row']['median'], 3) + 0.0:+.3f} vs "
                f"{round(a[f'd/{bd}+row']['median'], 3) + 0.0:+.3f} nats ({bd})",
                f"row {_dval(a['d/row'])}, {_dtest(a['d/row'])}; {bd}+row {_dval(a[f'd/{bd}+row'])}, "
                f"{_dtest(a[f'd/{bd}+row'])}",
                GRADED,
            )
        if "explicit/" + ro in a:
            add(
                "programming",
                "explicit value (upper bound)",
                f"{rate('explicit')['rate']:.3f}",
                _p(rate("explicit")),
                "1.00",
            )
        js["programming"] = {
            "readout": ro,
            "follow_rate": {k.rsplit("/", 1)[0]: v["rate"] for k, v in a.items() if k.endswith(f"/{ro}")},
            "d": {k.removeprefix("d/"): v for k, v in a.items() if k.startswith("d/")},
        }

    pa = _get(summaries, "patch")
    if pa:
        ro = pa["primary"]
        ls, ln = pa["leak"].get(f"patch-served/{ro}"), pa["leak"].get(f"patch-not-served/{ro}")
        add("updates", f"stale-value leak, patch served ({ro})", f"{ls['k']}/{ls['n']}", _p(ls), "0/96")
        add("updates", "stale-value leak, patch not served", f"{ln['k']}/{ln['n']}", _p(ln), "(stale rows alone)")
        pts = {k: v for k, v in pa["timing"].items() if not k.startswith("slope/")}
        if pts:
            big = max(pts.values(), key=lambda p: p["L_tokens"])
            add(
                "updates",
                f"update time at L = {big['L_tokens']:.0f} tokens: patch vs re-prefill",
                f"{big['patch_ms']:.0f} ms vs {big['rewrite_ms']:.0f} ms",
                f"log-log slopes: patch {pa['timing'].get('slope/patch_ms', math.nan):.2f}, "
                f"re-prefill {pa['timing'].get('slope/rewrite_ms', math.nan):.2f}",
                "77 ms vs 1033 ms at L ~ 9.2k",
            )
        js["updates"] = {"readout": ro, "leak": pa["leak"], "timing": pa["timing"]}
    return rows, js


def write_contract(out: Path, model: str, summaries: dict, quick: bool = False) -> dict:
    """Write contract.md, contract.json and the figures from the probes' summaries."""
    from eventkv.probes.base import Table
    from eventkv.probes.figures import access_figure, patch_figure, trigger_scatter

    rows, js = contract_rows(summaries)
    figs = out / "figures"
    figs.mkdir(exist_ok=True)
    written = []
    for probe, fn, name in (
        ("trigger-bank", trigger_scatter, "trigger.png"),
        ("access", access_figure, "access.png"),
        ("patch", patch_figure, "patch.png"),
    ):
        if probe in summaries:
            fn(summaries[probe].data, figs / name)
            written.append(name)
    prov = provenance(out, summaries)
    js = {
        "model": model,
        "quick": quick,
        "pairs": {k: len(load_records(out / k)) for k in summaries},
        "provenance": prov,
        **js,
    }
    write_json_atomic(out / "contract.json", _clean(js))
    table = Table(
        f"Memory contract of {model}",
        ["clause", "measure", "measured", "interval / test", "study (Qwen3-8B et al.)"],
        rows,
    )
    md = [
        f"# Memory contract: {model}",
        "",
        (
            "Preset: --quick (candidate-logit readout only, few items per cell: intervals are wide; the sign tests can "
            "detect only large effects)."
            if quick
            else "Preset: full."
        ),
        "",
        f"Model {model}, {prov['dtype']}, seed {prov['seed']}; pairs per probe: "
        + ", ".join(f"{k} {v}" for k, v in js["pairs"].items())
        + f". Compute time {_hms(prov['total_seconds'])} ("
        + ", ".join(f"{k} {_hms(v)}" for k, v in prov["seconds"].items())
        + ")"
        + (f", torch threads {', '.join(map(str, prov['torch_threads']))}" if prov["torch_threads"] else "")
        + ".",
        "",
        table.to_markdown(),
        "",
        "Figures: " + ", ".join(f"[{n}](figures/{n})" for n in written),
        "",
    ]
    md += [f"![{n}](figures/{n})" for n in written] + [""]
    md += [
        "Study figures are from Study 1 (8B-class checkpoints, one A100): not directly comparable with a small "
        "checkpoint or a CPU's timings. Graded rows (donor shift d) are eventkv's candidate-log-odds readout; "
        "the study reports follow:anti only. See docs/contract.md in the eventkv repository for how to read this "
        "table.",
        "",
    ]
    for s in summaries.values():
        md += ["---", "", s.data.get("markdown", s.to_markdown()).replace("\n# ", "\n## ").replace("# ", "## ", 1), ""]
    (out / "contract.md").write_text("\n".join(md))
    js["markdown_table"] = table.to_markdown()
    return js


def _clean(x):
    """NaN to None (valid JSON), recursively; tuples to lists."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, float) and math.isnan(x):
        return None
    return x
