"""The splice probe (Study 2, "Controlled splice"): accuracy of prompt tasks when the
user-content span's K/V are spliced at layers >= a cutoff, from a decoding step, per arm.

Readouts (option ``readout``): ``generate`` — greedy generation scored on its first non-empty
line by the matcher ``match`` (``word``, the default: the answer as a whole word and no competing
option/number; ``exact``: the line equals the answer; see :mod:`eventkv.studies.splice.tasks`);
``choice`` — for items with options, forced choice over the spliced cache
(:func:`eventkv.studies.splice.splice_choice`): correct iff the gold option's full continuation has the
highest log-probability. The choice readout splices from decoding step 0 only.

One item = one prompt. Per item the clean prefill + clean greedy decode and the scaffold donor's
rows are computed once (:mod:`eventkv.studies.splice.engine`); every (arm, cutoff, step) cell is then a batched
splice + decode over those rows. The record holds the clean answer and one entry per cell.

Statistics (:meth:`SpliceProbe.summarize`): per cell, accuracy with a Wilson 95% interval, and
McNemar's exact test against clean on the same items (:func:`mcnemar_exact`). Figures: accuracy
vs cutoff per arm with Wilson bands and the clean line (``figure.png``), and a cutoff x decoding
step heatmap of the scaffold arm (``heatmap.png``).

Registered as probe ``splice`` in :data:`eventkv.probes.PROBES` when this module is imported, so
the probe runner (manifest.json / records.jsonl / summary.md, resumable) runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Sequence, get_args

from eventkv.errors import EventKVError, OptionError
from eventkv.models.encoding import encode
from eventkv.options import check_choices, check_int, check_ints, check_max_new_tokens
from eventkv.probes.base import Probe, Summary, Table, register
from eventkv.stats import format_p, mcnemar_exact, wilson
from eventkv.studies.splice.engine import (
    ARMS,
    DEFAULT_FILLER,
    TAILS,
    Splice,
    SplicePrompt,
    clean_run,
    donor_rows,
    filler_ids,
    splice_choice,
    splice_sweep,
)
from eventkv.studies.splice.tasks import MATCHERS, TASKS, builtin_items, load_jsonl, outcome_decided, score

LAYER_SETS = ("from", "only")
SpliceReadout = Literal["generate", "choice"]
"""How a splice cell is answered: greedy generation, or forced choice among the item's options."""
SPLICE_READOUTS: tuple[SpliceReadout, ...] = get_args(SpliceReadout)
#: built-in tasks whose items carry options (the ones the forced-choice readout can score)
TASKS_WITH_OPTIONS = ("choose", "sentiment")
SPLICE_ARMS = tuple(a for a in ARMS if a != "clean")


def parse_cutoffs(text: str, n_layers: int) -> list[int]:
    """``"all"`` = ``0 .. n_layers`` (``n_layers`` splices nothing: a built-in check that equals
    clean); else a comma list of ints, ``a-b`` ranges allowed, negative values count from
    ``n_layers`` (``-4`` = the last four layers).

    Raises:
        EventKVError: an unparseable value or a cutoff outside ``0 .. n_layers``.
    """
    if text.strip() == "all":
        return list(range(n_layers + 1))
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            if "-" in part[1:]:
                a, b = part[0] + part[1:].split("-", 1)[0], part[1:].split("-", 1)[1]
                if int(b) < int(a):
                    raise EventKVError(
                        f"--cutoffs {text!r}: the range {part!r} runs backwards; write it low-high ({b}-{a})."
                    )
                vals = list(range(int(a), int(b) + 1))
            else:
                vals = [int(part)]
        except ValueError:
            raise EventKVError(
                f"--cutoffs {text!r}: give 'all' or comma-separated layer numbers/ranges like 0,4,8-12."
            ) from None
        for v in vals:
            v = n_layers + v if v < 0 else v
            if not 0 <= v <= n_layers:
                raise EventKVError(
                    f"--cutoffs: cutoff {v} is outside 0..{n_layers} for this {n_layers}-layer model "
                    f"({n_layers} = splice nothing)."
                )
            if v not in out:
                out.append(v)
    if not out:
        raise EventKVError(f"--cutoffs {text!r}: give 'all' or at least one layer number.")
    return sorted(out)


def _n_layers(model) -> int:
    return int(model.config.get_text_config().num_hidden_layers)


@register
@dataclass
class SpliceProbe(Probe):
    """Options (all part of a run's identity):

    task: a built-in task (:data:`eventkv.studies.splice.tasks.TASKS`) or ``"jsonl"`` with ``task_file``.
    cutoffs: ``"all"`` or a comma list (see :func:`parse_cutoffs`).
    steps: decoding steps the splice takes effect from (0 = before the first token).
    arm_names: splice arms (clean is always run as the reference).
    filler: the scaffold's filler text (repeated, truncated to the span's token length).
    heads: KV heads to splice (None = all).
    layer_set: ``from`` = layers >= cutoff (the study's splice); ``only`` = the cutoff layer alone.
    tail: ``clean`` | ``spliced`` (see :mod:`eventkv.studies.splice.engine`).
    max_new_tokens: greedy generation budget. batch_size: splices per batched decode.
    early_exit: end a generation once its outcome under ``match`` is fixed
    (:func:`eventkv.studies.splice.tasks.outcome_decided`); scores are unchanged, recorded texts are cut there.
    match: ``word`` | ``exact`` — how a generation is scored (:func:`eventkv.studies.splice.tasks.score`).
    readout: ``generate`` | ``choice`` (forced choice among the item's options, step 0 only).
    """

    name: ClassVar[str] = "splice"
    record_version: ClassVar[int] = 2
    smoke_options: ClassVar[dict] = {
        "cutoffs": "0,2",
        "steps": (0, 1),
        "arm_names": ("scaffold", "mask"),
        "max_new_tokens": 3,
    }

    task: str = "lookup"
    task_file: str | None = None
    task_digest: str | None = None
    cutoffs: str = "all"
    steps: tuple[int, ...] = (0,)
    arm_names: tuple[str, ...] = ("scaffold", "zero-kv", "mask")
    filler: str = DEFAULT_FILLER
    heads: tuple[int, ...] | None = None
    layer_set: str = "from"
    tail: str = "clean"
    max_new_tokens: int = 16
    batch_size: int = 16
    early_exit: bool = True
    match: str = "word"
    readout: SpliceReadout = "generate"

    def __post_init__(self) -> None:
        self.steps = tuple(self.steps)
        self.arm_names = tuple(self.arm_names)
        if self.heads is not None:
            self.heads = tuple(self.heads)

    def validate(self) -> None:
        if self.task != "jsonl" and self.task not in TASKS:
            raise EventKVError(
                f"unknown task {self.task!r}: use one of {', '.join(TASKS)} or the path of a JSONL file."
            )
        if self.task == "jsonl" and not self.task_file:
            raise EventKVError("task 'jsonl' needs a task file: pass --task path/to/items.jsonl.")
        check_choices("arm_names", self.arm_names, SPLICE_ARMS, flag="--arms", what="splice arms (clean is always run)")
        check_ints("steps", self.steps, "give distinct decoding steps >= 0 (0 = before the first token), e.g. 0,1,2.")
        if self.heads is not None:
            check_ints("heads", self.heads, "give distinct KV head indices >= 0, e.g. 0,1 (or leave it out for all).")
        if not isinstance(self.filler, str) or not self.filler:
            raise OptionError(
                "filler",
                self.filler,
                "give a non-empty scaffold filler text (or leave it out for the default sentence).",
            )
        if self.layer_set not in LAYER_SETS:
            raise EventKVError(f"--layer-set {self.layer_set!r}: use one of {', '.join(LAYER_SETS)}.")
        parse_cutoffs(self.cutoffs, 1 << 20)  # syntax now; the bounds need the model's layer count (check_model)
        if self.tail not in TAILS:
            raise EventKVError(f"--tail {self.tail!r}: use one of {', '.join(TAILS)}.")
        check_max_new_tokens(self.max_new_tokens)
        check_int("batch_size", self.batch_size, "decode at least 1 splice per batch.")
        if self.match not in MATCHERS:
            raise EventKVError(f"--match {self.match!r}: use one of {', '.join(MATCHERS)}.")
        if self.readout not in SPLICE_READOUTS:
            raise EventKVError(f"--readout {self.readout!r}: use one of {', '.join(SPLICE_READOUTS)}.")
        if self.readout == "choice":
            if self.task != "jsonl" and self.task not in TASKS_WITH_OPTIONS:
                raise EventKVError(
                    f"--readout choice needs items with options: task {self.task!r} has none; use "
                    f"{' or '.join(TASKS_WITH_OPTIONS)}, a JSONL file with 'options', or --readout generate."
                )
            if self.steps != (0,):
                raise EventKVError(
                    f"--readout choice splices before the first answer token: use --steps 0 "
                    f"(got {','.join(map(str, self.steps))})."
                )
        if max(self.steps) >= self.max_new_tokens:
            raise EventKVError(
                f"--steps {max(self.steps)} is not below --max-new-tokens {self.max_new_tokens}: "
                "a splice from that step could never take effect; raise --max-new-tokens."
            )

    def max_items(self) -> int | None:
        if self.task != "jsonl":
            return None
        assert self.task_file is not None  # validate() requires a task file for task "jsonl"
        return len(load_jsonl(self.task_file))

    def check_model(self, rt) -> None:
        """The options that need the model: every cutoff within ``0 .. n_layers`` and every KV head below the
        model's KV heads per layer (the runner calls this before it writes anything)."""
        parse_cutoffs(self.cutoffs, _n_layers(rt.model))
        kv_heads = getattr(rt.profile, "num_kv_heads", None)
        if self.heads is not None and kv_heads is not None and max(self.heads) >= kv_heads:
            raise OptionError(
                "heads", self.heads, f"this model has {kv_heads} KV heads per layer: give heads 0..{kv_heads - 1}."
            )

    # ------------------------------------------------------------------------- items
    def items(self, seed: int, indices: Sequence[int]) -> list[dict]:
        if self.task != "jsonl":
            return builtin_items(self.task, seed, indices)
        assert self.task_file is not None  # validate() requires a task file for task "jsonl"
        data = load_jsonl(self.task_file)
        out = []
        for i in indices:
            if not 0 <= i < len(data):
                raise EventKVError(
                    f"--items asks for item {i} but {self.task_file!r} holds {len(data)} items: "
                    f"use --items {len(data)} or fewer."
                )
            out.append(data[i])
        return out

    def cells(self, n_layers: int) -> list[Splice]:
        cuts = parse_cutoffs(self.cutoffs, n_layers)
        out = []
        for arm in self.arm_names:
            for c in cuts:
                layers = tuple(range(c, n_layers)) if self.layer_set == "from" else ((c,) if c < n_layers else ())
                for t in self.steps:
                    out.append(Splice(arm, layers, self.heads, t))
        return out

    # ------------------------------------------------------------------------- one item
    def run_item(self, rt, item: dict) -> dict:
        model, tok = rt.model, rt.tokenizer
        n_layers = _n_layers(model)
        prompt = SplicePrompt.from_text(tok, rt.profile, item["prompt"])
        if self.readout == "choice":
            return self._run_item_choice(rt, item, prompt, n_layers)
        stops = rt.stop_token_ids
        decided = None
        if self.early_exit:

            def decided(toks: list[int]) -> bool:
                return outcome_decided(tok.decode(toks, skip_special_tokens=True), item, self.match)

        run = clean_run(
            model,
            prompt,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=stops,
            max_context=rt.max_context,
            decided=decided,
        )
        donors = self._donors(model, tok, run, prompt)
        cuts = parse_cutoffs(self.cutoffs, n_layers)
        cells = self.cells(n_layers)
        results = splice_sweep(
            model,
            run,
            cells,
            max_new_tokens=self.max_new_tokens,
            stop_token_ids=stops,
            donors=donors,
            tail=self.tail,
            batch_size=self.batch_size,
            decided=decided,
        )
        clean_text = tok.decode(run.tokens, skip_special_tokens=True)
        ok, pred = score(clean_text, item, self.match)
        rec_cells = []
        i = 0
        for arm in self.arm_names:
            for c in cuts:
                for t in self.steps:
                    r = results[i]
                    i += 1
                    text = tok.decode(r.tokens, skip_special_tokens=True)
                    good, p = score(text, item, self.match)
                    rec_cells.append(
                        {"arm": arm, "cutoff": c, "step": t, "pred": p, "correct": good, "effect": r.took_effect}
                    )
        return self._record(item, n_layers, prompt, {"text": clean_text, "pred": pred, "correct": ok}, rec_cells)

    def _donors(self, model, tok, run, prompt: SplicePrompt) -> dict:
        if "scaffold" not in self.arm_names:
            return {}
        return {"scaffold": donor_rows(model, run, filler_ids(tok, len(prompt.span_ids), self.filler))}

    def _record(self, item: dict, n_layers: int, prompt: SplicePrompt, clean: dict, cells: list[dict]) -> dict:
        lo, hi = prompt.span_rows
        return {
            "index": item["index"],
            "prompt": item["prompt"],
            "answer": item["answer"],
            "n_layers": n_layers,
            "span_rows": [lo, hi],
            "prompt_rows": prompt.n_rows,
            "clean": clean,
            "cells": cells,
        }

    def _run_item_choice(self, rt, item: dict, prompt: SplicePrompt, n_layers: int) -> dict:
        """Forced choice among the item's options, clean and per cell, over the same prompt rows."""
        model, tok = rt.model, rt.tokenizer
        opts = list(item.get("options") or [])
        if item["answer"] not in opts:
            raise EventKVError(
                f"--readout choice: item {item['index']} has options {opts} that do not include its "
                f"answer {item['answer']!r}; give every item 'options' containing the answer."
            )
        run = clean_run(model, prompt, max_new_tokens=0, max_context=rt.max_context)
        donors = self._donors(model, tok, run, prompt)
        cells = self.cells(n_layers)
        opt_ids = [option_ids(tok, rt.profile, o) for o in opts]
        scores = splice_choice(
            model, run, [Splice("clean")] + cells, opt_ids, donors=donors, tail=self.tail, batch_size=self.batch_size
        )

        def entry(lps: list[float]) -> dict:
            best = max(range(len(opts)), key=lambda c: lps[c])
            gold = opts.index(item["answer"])  # correct iff the gold option is strictly highest
            return {
                "pred": opts[best],
                "correct": all(lps[gold] > lp for c, lp in enumerate(lps) if c != gold),
                "logprobs": {o: lp for o, lp in zip(opts, lps)},
            }

        rec_cells = [
            {"arm": s.arm, "cutoff": c, "step": s.step, **entry(lps), "effect": True}
            for (s, c), lps in zip(zip(cells, self._cell_cutoffs(n_layers)), scores[1:])
        ]
        return self._record(item, n_layers, prompt, entry(scores[0]), rec_cells)

    def _cell_cutoffs(self, n_layers: int) -> list[int]:
        """The cutoff of each cell of :meth:`cells`, in order."""
        cuts = parse_cutoffs(self.cutoffs, n_layers)
        return [c for _ in self.arm_names for c in cuts for _ in self.steps]

    # ------------------------------------------------------------------------- statistics
    def summarize(self, records: Sequence[dict]) -> Summary:
        return summarize_splice(records, self)

    def figure(self, records: Sequence[dict], path) -> None:
        from eventkv.studies.splice.figures import accuracy_figure, heatmap_figure

        table = cell_table(records)
        accuracy_figure(table, path)
        heatmap_figure(table, Path(path).with_name("heatmap.png"))


def option_ids(tokenizer, profile, option: str) -> list[int]:
    """Token ids of an option as the answer's continuation right after the prompt: the option's
    text alone when the prompt's tail ends in whitespace (a chat template's ``assistant\\n``), else
    with one leading space (a plain-text scaffold's ``Assistant:``)."""
    tail = profile.chat_tail
    return encode(tokenizer, option if tail[-1:].isspace() else " " + option)


def _readout_note(probe: "SpliceProbe | None") -> str:
    if probe is not None and probe.readout == "choice":
        return (
            "readout: forced choice among the item's options over the spliced cache (sum of the option's token "
            "log-probabilities right after the prompt; correct iff the gold option scores highest)"
        )
    if probe is not None and probe.match == "exact":
        return "readout: greedy generation; exact match of its first non-empty line (surrounding punctuation stripped)"
    return (
        "readout: greedy generation; matcher 'word' (a readout-validity choice made before any splice result was "
        "seen): the first non-empty line is correct iff it contains the answer as a whole word/number "
        "(case-insensitive unless the item is case-sensitive) and no other option (items with options) or "
        "other number (numeric answers without options); 'exact' (line == answer) is available via --match exact"
    )


def cell_table(records: Sequence[dict]) -> dict:
    """``{(arm, cutoff, step): {"k", "n", "clean_only", "arm_only"}}`` plus ``("clean",) -> {"k", "n"}``."""
    out: dict = {("clean",): {"k": sum(r["clean"]["correct"] for r in records), "n": len(records)}}
    for r in records:
        c0 = r["clean"]["correct"]
        for c in r["cells"]:
            key = (c["arm"], c["cutoff"], c["step"])
            d = out.setdefault(key, {"k": 0, "n": 0, "clean_only": 0, "arm_only": 0})
            d["n"] += 1
            d["k"] += int(c["correct"])
            d["clean_only"] += int(c0 and not c["correct"])
            d["arm_only"] += int(c["correct"] and not c0)
    return out


def summarize_splice(records: Sequence[dict], probe: SpliceProbe | None = None) -> Summary:
    """Tables per decoding step: rows = cutoff, columns = arms: accuracy [Wilson 95%] and McNemar's
    exact p against clean (same items)."""
    table = cell_table(records)
    clean = wilson(table[("clean",)]["k"], table[("clean",)]["n"])
    arms = list(dict.fromkeys(k[0] for k in table if len(k) == 3))
    cutoffs = sorted({k[1] for k in table if len(k) == 3})
    steps = sorted({k[2] for k in table if len(k) == 3})
    n_layers = records[0]["n_layers"] if records else 0
    tables: list[Table] = []
    data: dict[str, Any] = {"clean": clean.__dict__, "cells": {}}
    for t in steps:
        rows = []
        for c in cutoffs:
            row = [str(c)]
            for a in arms:
                d = table.get((a, c, t))
                if d is None:
                    row.append("")
                    continue
                p = wilson(d["k"], d["n"])
                test = mcnemar_exact(d["clean_only"], d["arm_only"])
                row.append(
                    f"{p.rate:.3f} [{p.low:.2f}, {p.high:.2f}] p={format_p(test.p_value)} "
                    f"({d['clean_only']}/{d['arm_only']})"
                )
                data["cells"][f"{a}|{c}|{t}"] = {
                    "k": d["k"],
                    "n": d["n"],
                    "rate": p.rate,
                    "low": p.low,
                    "high": p.high,
                    "p": test.p_value,
                    "clean_only": d["clean_only"],
                    "arm_only": d["arm_only"],
                }
            rows.append(row)
        tables.append(
            Table(
                f"decoding step {t}: accuracy [Wilson 95%], McNemar exact p vs clean "
                f"(clean-only/arm-only discordant items); clean = {clean.describe()}",
                ["cutoff"] + arms,
                rows,
            )
        )
    notes = [
        f"{len(records)} items; model with {n_layers} layers; cutoff c splices layers >= c "
        f"({n_layers} = nothing spliced, must equal clean)"
        + ("" if probe is None or probe.layer_set == "from" else "; layer set 'only': layer c alone"),
        "span = the user content of the chat prompt; scaffold = the same template with filler "
        f"{(probe.filler if probe else DEFAULT_FILLER)!r} repeated and truncated to the span's token length, "
        "computed at the same positions over the clean head rows",
        "step t: the first t generated tokens are the clean ones; the splice applies from the forward that "
        "predicts token t; tail rows "
        + (
            "keep their clean K/V"
            if probe is None or probe.tail == "clean"
            else "are recomputed over the spliced cache"
        ),
        "zero-k / zero-kv: a zero key still takes attention weight exp(0); 'mask' removes the span from "
        "attention in the spliced layers only",
        _readout_note(probe),
    ]
    data["arms"], data["cutoffs"], data["steps"] = arms, cutoffs, steps
    return Summary("splice", tables, tests=[], notes=notes, data=data)
