"""Sweeps: one plan of models × probes × seeds × options, run into one run folder each, on one of three
backends (``serial``, ``process``, ``ray``) that write the same records.

- :mod:`.plan` — the plan (YAML), expanded into named runs and checked before anything loads;
- :mod:`.worker` — the worker every backend runs: loads a model once, computes a run's items;
- :mod:`.backends` — where workers run: this process, spawned processes, or Ray actors;
- :mod:`.run` — the sweep itself: describe, open every folder through the runner, pool the items.

See docs/sweep.md.
"""

from eventkv.options import BACKENDS
from eventkv.sweep.plan import Plan, PlannedRun, load_plan, parse_plan
from eventkv.sweep.run import RunResult, SweepOptions, run_sweep

__all__ = ["BACKENDS", "Plan", "PlannedRun", "RunResult", "SweepOptions", "load_plan", "parse_plan", "run_sweep"]
