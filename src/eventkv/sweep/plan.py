"""A sweep plan: models × probes × seeds × options, read from YAML and expanded into named runs.

A plan names every run folder with one template; expanding it gives one :class:`PlannedRun` per
combination, each an ordinary probe run (the folder an ``eventkv run`` of the same settings writes
and resumes). The whole plan is checked before anything loads: every probe option through the
probe's own validation, every run option through :meth:`RunOptions.validate`, the folder template,
and that no two runs share a folder.

    >>> plan = parse_plan({"models": ["/m/tinyA"], "seeds": [0, 1], "items": 4, "dtype": "float32",
    ...                    "probes": [{"probe": "donor-pair", "options": {"max_new_tokens": 4}}]})
    >>> [r.out.as_posix() for r in plan.runs]
    ['runs/donor-pair/tinyA-float32-seed0', 'runs/donor-pair/tinyA-float32-seed1']

The format (docs/sweep.md; an example in examples/sweep.yaml)::

    out: runs/demo/{label}/{model}-{dtype}-seed{seed}   # folder template (default: eventkv run's folder)
    models: [smollm2-135m, qwen2.5-coder-0.5b]           # aliases, HF directories, hub ids or GGUF files
    seeds: [0, 1]
    items: 16                                            # run options shared by every run
    dtype: float32
    grid: {dtype: [float32, bfloat16]}                   # optional: run options to cross with everything
    threads: 2                                           # optional: torch threads of each worker
    probes:
      - probe: donor-pair
        options: {max_new_tokens: 16}                    # probe options and per-entry run options
      - probe: access
        label: access-root{root_slot}                    # {label} in out (default: the probe's name)
        grid: {root_slot: [13, 14]}                      # one run per value; name the key in label or out
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eventkv.errors import EventKVError, OptionError, cli_message, show_value
from eventkv.options import check_ints, check_optional_int
from eventkv.probes.run_options import RUN_DIR, RUNS, RunOptions

if TYPE_CHECKING:
    from eventkv.probes.base import Probe

#: RunOptions fields a sweep sets itself: ``model`` and ``seed`` from the plan's lists, ``out`` from its
#: template, ``threads`` per worker (the plan's top-level ``threads`` or the CLI), ``progress`` for the sweep
#: batch_pairs: a sweep's workers compute one item per request (see docs/sweep.md)
SWEEP_FIELDS = ("model", "seed", "out", "threads", "progress", "batch_pairs")

DEFAULT_OUT = (RUNS / "{label}" / RUN_DIR).as_posix()
"""The default folder template: ``runs/<label>/<model>-<dtype>-seed<seed>``, where ``eventkv run`` puts the
same run (label = the probe's name unless the entry gives one)."""

ENTRY_KEYS = ("probe", "label", "options", "grid")
"""What one entry of ``probes`` may hold."""


def run_keys() -> tuple[str, ...]:
    """The run options a plan may set (top level, ``grid``, or an entry's ``options`` / ``grid``): every
    :class:`RunOptions` field but those the sweep sets itself (:data:`SWEEP_FIELDS`), e.g. ``items``,
    ``dtype``, ``device``."""
    return tuple(f.name for f in dataclasses.fields(RunOptions) if f.name not in SWEEP_FIELDS)


def top_keys() -> tuple[str, ...]:
    """What the top level of a plan may hold."""
    return ("out", "models", "seeds", "threads", "grid", "probes", *run_keys())


@dataclass(frozen=True)
class PlannedRun:
    """One run of a sweep: a probe with its options, and the run options (``out`` = its folder).

    Attributes:
        label: the entry's label (the probe's name unless the plan gives one).
        probe: the registered probe's name.
        options: the probe's options as the plan gives them (the probe's defaults fill the rest).
        run: model, items, seed, out, dtype (and every other RunOptions field the plan sets);
            ``threads`` None (the sweep sets threads per worker) and ``progress`` False.
        where: the plan entry it came from, for messages (``plan.yaml: probes[1] (access)``).
    """

    label: str
    probe: str
    options: dict
    run: RunOptions
    where: str = ""

    @property
    def out(self) -> Path:
        assert self.run.out is not None  # the plan sets every run's folder
        return Path(self.run.out)

    @property
    def model_key(self) -> tuple:
        """What a worker loads: the run options other than items, seed and out (model, dtype, device ...).
        Runs with the same key share one loaded model."""
        return tuple(
            (f.name, getattr(self.run, f.name))
            for f in dataclasses.fields(RunOptions)
            if f.name not in ("items", "seed", "out", "threads", "progress")
        )

    def make_probe(self) -> Probe:
        """The probe object (its options validated by the probe itself).

        Raises:
            EventKVError: an unknown probe or option, or a bad option value (naming this run's plan entry).
        """
        from eventkv.probes.base import get_probe

        cls = get_probe(self.probe)
        return _checked(self.where, lambda: cls(**self.options))


@dataclass(frozen=True)
class Plan:
    """An expanded, checked sweep plan.

    Attributes:
        runs: every run, in plan order (models outermost, then entries, grids, seeds).
        threads: torch threads of each worker when the CLI gives none (None: the backend's default).
        source: where the plan came from (its file name), for messages.
    """

    runs: tuple[PlannedRun, ...]
    threads: int | None = None
    source: str = "plan"

    def describe(self) -> list[list[str]]:
        """One row per run: folder, probe, model, seed, items, the options the plan sets."""
        rows = []
        for r in self.runs:
            opts = ", ".join(f"{k}={show_value(v)}" for k, v in r.options.items())
            run = ", ".join(f"{k}={show_value(getattr(r.run, k))}" for k in run_keys() if k != "items")
            rows.append([r.out.as_posix(), r.probe, r.run.model, str(r.run.seed), str(r.run.items), opts, run])
        return rows


def load_plan(path: str | Path, check_devices: bool = True) -> Plan:
    """Read a YAML plan file and expand and check it (see :func:`parse_plan`).

    Raises:
        EventKVError: the file cannot be read or is not YAML (naming the line), or any error of
            :func:`parse_plan`.
    """
    import yaml

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EventKVError(f"plan {str(path)!r}: cannot be read ({exc}): give a YAML plan file.") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise EventKVError(f"{path}: not valid YAML{where} ({problem}): fix the plan file.") from None
    return parse_plan(data, source=str(path), check_devices=check_devices)


def parse_plan(data: Any, source: str = "plan", check_devices: bool = True) -> Plan:
    """Expand a plan (the parsed YAML) into its runs and check every one before anything loads.

    ``check_devices=False`` leaves out the check that this machine has each run's device (a Ray cluster's
    workers may have GPUs the machine that reads the plan lacks); the workers' model load checks it then,
    before any folder is written. ``{dtype}`` in a template is then ``auto`` resolved as on a CPU.

    Raises:
        EventKVError: naming the plan (``source``), the entry and the bad key or value and the fix: an
            unknown key, a missing or empty ``models`` / ``seeds`` / ``probes``, an unknown probe or
            probe option, a probe option or run option the probe or :meth:`RunOptions.validate`
            refuses, a template field that is not defined, two runs with the same folder.
    """
    from eventkv.probes.base import get_probe

    if not isinstance(data, dict):
        raise EventKVError(
            f"{source}: a plan is a YAML mapping with models, seeds and probes (see docs/sweep.md); "
            f"got {type(data).__name__}."
        )
    _known_keys(source, data, top_keys(), "the top level of a plan")
    models = _models(source, data.get("models"))
    seeds = _checked(
        source,
        lambda: check_ints("seeds", _as_list(data.get("seeds")), "give a list of distinct whole-number seeds >= 0."),
    )
    threads = _checked(
        source,
        lambda: check_optional_int("threads", data.get("threads"), "give the torch threads of each worker (>= 1)."),
    )
    template = data.get("out", DEFAULT_OUT)
    if not isinstance(template, str) or not template.strip():
        raise EventKVError(f"{source}: out {show_value(template)}: give a folder template, e.g. {DEFAULT_OUT!r}.")
    base_run = {k: data[k] for k in run_keys() if k in data}
    top_grid = _grid(source, data.get("grid", {}), run_keys(), "the top-level grid (run options only)")
    entries = data.get("probes")
    if not isinstance(entries, list) or not entries:
        raise EventKVError(
            f"{source}: probes {show_value(entries)}: give a list of entries, e.g. "
            "[{probe: donor-pair, options: {max_new_tokens: 16}}]."
        )

    runs = []
    for model in models:
        for n, entry in enumerate(entries):
            if not isinstance(entry, dict):
                entry = {"probe": entry} if isinstance(entry, str) else entry
            if not isinstance(entry, dict):
                raise EventKVError(f"{source}: probes[{n}] {show_value(entry)}: give a mapping with a probe name.")
            name = entry.get("probe")
            where = f"{source}: probes[{n}] ({name})"
            _known_keys(where, entry, ENTRY_KEYS, "an entry of probes")
            if not isinstance(name, str):
                raise EventKVError(f"{where}: probe {show_value(name)}: give a registered probe's name.")
            cls = _checked(where, lambda name=name: get_probe(name))
            label = entry.get("label", name)
            if not isinstance(label, str):
                raise EventKVError(f"{where}: label {show_value(label)}: give a name (a template like out's).")
            fields = tuple(f.name for f in dataclasses.fields(cls) if f.init)
            allowed = (*fields, *run_keys())
            options = entry.get("options", {})
            if not isinstance(options, dict):
                raise EventKVError(f"{where}: options {show_value(options)}: give a mapping of option: value.")
            _known_keys(where, options, allowed, f"{name}'s options or a run option", "option")
            grid = _grid(where, entry.get("grid", {}), allowed, f"{name}'s options or a run option")
            for top in _product(top_grid):
                for own in _product(grid):
                    settings = {**base_run, **top, **options, **own}
                    probe_opts = {k: v for k, v in settings.items() if k in fields}
                    run_opts = {k: v for k, v in settings.items() if k not in fields}
                    for seed in seeds:
                        runs.append(
                            _planned(
                                where,
                                template,
                                cls,
                                label,
                                model,
                                seed,
                                probe_opts,
                                run_opts,
                                {**top, **own},
                                check_devices,
                            )
                        )
    _refuse_duplicates(source, runs)
    return Plan(tuple(runs), threads, source)


def _planned(where, template, cls, label, model, seed, probe_opts, run_opts, varied, check_devices) -> PlannedRun:
    """One checked run: the probe built and validated, RunOptions validated against it, its label and folder
    named from their templates."""
    if "items" not in run_opts:
        raise EventKVError(f"{where}: items is not given: set items (items per run) at the plan's top level.")
    probe = _checked(where, lambda: cls(**probe_opts))
    run = _checked(where, lambda: RunOptions(model=model, seed=seed, progress=False, **run_opts))
    fields = {
        "probe": cls.name,
        "model": Path(model).name,
        "seed": seed,
        **{k: getattr(run, k) for k in run_keys()},
        **varied,
    }
    # without the device check, every other option is validated as if the run were on this machine's CPU
    here = run if check_devices or "device" not in run_keys() else dataclasses.replace(run, device="cpu")
    fields["dtype"] = _checked(where, here.resolved_dtype)
    label = _format(where, "label", label, fields)
    if not label.strip() or "/" in label:
        raise EventKVError(f"{where}: label {label!r}: give a non-empty name without '/'.")
    out = Path(_format(where, "out", template, {**fields, "label": label}))
    run = dataclasses.replace(run, out=out)
    _checked(where, lambda: dataclasses.replace(here, out=out).validate(probe))
    return PlannedRun(label, cls.name, dict(probe_opts), run, where)


def _format(where: str, what: str, template: str, fields: dict) -> str:
    """``template`` with its ``{field}``s filled from ``fields``.

    Raises:
        EventKVError: a field that is not defined, or one with a format spec, conversion or index.
    """
    for _, field, spec, conv in string.Formatter().parse(template):
        if field is not None and (not field or not field.isidentifier() or spec or conv):
            shown = f"{{{field}{'!' + conv if conv else ''}{':' + spec if spec else ''}}}"
            raise EventKVError(
                f"{where}: {what} {template!r}: field {shown} is not allowed: write plain fields such as "
                "{probe}, {label}, {model}, {dtype}, {seed}."
            )
    try:
        return string.Formatter().vformat(template, (), _Fields(fields, where, what))
    except (ValueError, IndexError) as exc:
        raise EventKVError(
            f"{where}: {what} {template!r}: not a template ({exc}); write fields as {{model}}."
        ) from None


class _Fields(dict):
    """The template's fields; a missing one is an error naming the fields there are."""

    def __init__(self, fields: dict, where: str, what: str) -> None:
        super().__init__({k: _text(v) for k, v in fields.items()})
        self.where, self.what = where, what

    def __missing__(self, key):
        known = ", ".join(f"{{{k}}}" for k in self)
        raise EventKVError(
            f"{self.where}: {self.what} template field {{{key}}} is not defined: use {known} "
            "(a grid key is a field of its entry's runs)."
        )


def _text(value) -> str:
    """A template field's text: lists as ``8-11``, None as ``none``."""
    if isinstance(value, (list, tuple)):
        return "-".join(map(_text, value))
    return "none" if value is None else str(value)


def _models(source: str, models) -> list[str]:
    models = _as_list(models)
    if not models or not all(isinstance(m, str) and m.strip() for m in models) or len(set(models)) != len(models):
        raise EventKVError(
            f"{source}: models {show_value(models)}: give a list of distinct model names (packaged aliases, "
            "HF directories, hub ids or GGUF files), e.g. [smollm2-135m]."
        )
    return models


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _grid(where: str, grid, allowed: tuple[str, ...], what: str) -> dict[str, list]:
    if not isinstance(grid, dict):
        raise EventKVError(f"{where}: grid {show_value(grid)}: give a mapping of option: [values].")
    _known_keys(where, grid, allowed, what, "grid key")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise EventKVError(
                f"{where}: grid {key} {show_value(values)}: give a non-empty list of values, e.g. {key}: [a, b]."
            )
    return grid


def _product(grid: dict[str, list]) -> list[dict]:
    """Every combination of the grid's values, first key outermost (``[{}]`` for an empty grid)."""
    return [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]


def _known_keys(where: str, mapping: dict, allowed: tuple[str, ...], what: str, key_word: str = "key") -> None:
    for key in mapping:
        if key not in allowed:
            hint = ""
            if key == "batch_pairs":
                hint = " (a sweep's workers compute one item per request; --batch-pairs is for eventkv run)"
            elif key in SWEEP_FIELDS:
                hint = " (the sweep sets it: threads at the plan's top level or with --threads)"
            raise EventKVError(f"{where}: unknown {key_word} {key!r}{hint}: {what} takes {', '.join(allowed)}.")


def _checked(where: str, make):
    """``make()``, with a project error or a bad keyword prefixed by the plan entry it came from."""
    try:
        return make()
    except OptionError as exc:
        raise EventKVError(f"{where}: {exc}") from None
    except EventKVError as exc:
        raise EventKVError(f"{where}: {cli_message(exc)}") from None
    except TypeError as exc:  # a value of the wrong kind that a probe's __post_init__ could not take
        raise EventKVError(f"{where}: {exc}: fix that option's value in the plan.") from None


def _refuse_duplicates(source: str, runs: list[PlannedRun]) -> None:
    seen: dict[str, PlannedRun] = {}
    for r in runs:
        key = os.path.normcase(os.path.abspath(r.out))
        if key in seen:
            first = seen[key]
            raise EventKVError(
                f"{source}: two runs would write the same folder {r.out.as_posix()!r} ({_name(first)} and "
                f"{_name(r)}): put what tells them apart into the out template, e.g. a grid key, {{label}}, "
                "{model} or {seed}, or give one entry a label."
            )
        seen[key] = r


def _name(r: PlannedRun) -> str:
    opts = "".join(f", {k}={show_value(v)}" for k, v in r.options.items())
    return f"{r.label}: {r.run.model}, seed {r.run.seed}{opts}"
