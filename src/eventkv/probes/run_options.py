"""The options every command that runs something shares (``eventkv run <probe>``, ``eventkv contract``,
``eventkv splice``): one frozen :class:`RunOptions` with its validation, its default output folder,
and the set-up of a run (torch threads, model load, :class:`~eventkv.probes.base.Runtime`).

Validation raises :class:`eventkv.errors.OptionError` naming the *field* (``threads 0: ...``); the CLI
prints the same error under the flag (``--threads 0: ...``, see :func:`eventkv.errors.cli_message`).
No heavy import at module level (torch and transformers load inside the methods that need them), so
the CLI's ``--help`` stays fast.

    >>> opts = RunOptions(model="/models/smollm2-135m", items=4, seed=7, dtype="float32")
    >>> opts.default_out("donor-pair").as_posix()
    'runs/donor-pair/smollm2-135m-float32-seed7'
    >>> RunOptions(model="m", items=1, threads=0).validate()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    eventkv.errors.OptionError: threads 0: give 1 to ... torch CPU threads ...
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from eventkv.options import check_batch_pairs, check_items, check_out_dir, check_threads

if TYPE_CHECKING:
    from eventkv.probes.base import Probe, Runtime, Summary

RUNS = Path("runs")
"""Where a run's output folder goes when ``out`` is left out (relative to the working directory)."""

RUN_DIR = "{model}-{dtype}-seed{seed}"
"""The default output folder name of a probe run, under ``runs/<probe>/``: ``{model}`` is the last part of
the model name or path, ``{dtype}`` the resolved dtype (``auto`` resolved), ``{seed}`` the seed."""


@dataclass(frozen=True)
class RunOptions:
    """What every run is made of, whatever it runs.

    Attributes:
        model: packaged alias, local HF directory, hub id or GGUF file (see :func:`eventkv.models.load`).
        items: how many items to run (a whole number >= 1; a probe or the contract may ask more).
        seed: item seed: item ``i`` depends only on the seed and ``i``.
        out: the run directory; None: :meth:`default_out` (see :meth:`with_default_out`).
        dtype: ``auto`` (resolved by :func:`eventkv.models.resolve_dtype`), ``float32``, ``bfloat16`` or
            ``float16``.
        threads: torch CPU threads, 1 .. the machine's logical cores; None: torch decides.
        progress: show a progress bar while items run.
        device: ``auto`` (the CUDA GPU when torch sees one, else the CPU; resolved by
            :func:`eventkv.models.resolve_device`), ``cpu``, ``cuda`` or ``cuda:N``. ``auto`` dtype is resolved
            for this device (bfloat16 on a GPU with native bf16). The device is provenance, not identity: it
            is recorded with every invocation in the manifest, and a run may be resumed on another device
            when its dtype is the same (``docs/devices.md``).
        batch_pairs: items computed in one batch by a probe that batches them (the pair probes:
            :meth:`~eventkv.probes.base.Probe.run_batch`). Records equal those of 1 up to float
            rounding; it is provenance (recorded per invocation), not identity.
    """

    model: str
    items: int
    seed: int = 0
    out: Path | None = None
    dtype: str = "auto"
    threads: int | None = None
    progress: bool = True
    device: str = "auto"
    batch_pairs: int = 1

    def validate(self, probe: Probe | None = None) -> None:
        """Check every option before anything loads or is written, in this order: the probe's own options
        (``probe.validate()``), ``items`` (against what ``probe`` can make), ``threads``, ``batch_pairs`` (above
        1 only for a probe that batches items), ``device`` (a CUDA device this machine lacks is refused here),
        ``dtype``, ``out`` (when given).

        Raises:
            OptionError: naming the field (``items``, ``threads``, ``batch_pairs``, ``device``, ``dtype``,
                ``out``) or the probe's option.
        """
        from eventkv.models import resolve_device, resolve_dtype
        from eventkv.probes.runner import check_run_items

        if probe is not None:
            probe.validate()
            check_run_items(probe, self.items)
        else:
            check_items(self.items)
        check_threads(self.threads)
        check_batch_pairs(self.batch_pairs)
        if probe is not None and self.batch_pairs > 1 and not probe.batches_items:
            from eventkv.errors import OptionError

            raise OptionError(
                "batch_pairs", self.batch_pairs, f"probe {probe.name!r} computes its items one at a time: use 1."
            )
        resolve_dtype(self.dtype, resolve_device(self.device)[0])
        check_out_dir(self.out)

    def resolved_dtype(self) -> str:
        """The dtype name the model loads in (``auto`` resolved for the device the model loads on).

        Raises:
            OptionError: an unknown ``dtype`` or a bad or missing ``device``.
        """
        from eventkv.models import resolve_device, resolve_dtype

        return resolve_dtype(self.dtype, resolve_device(self.device)[0])[0]

    def default_out(self, folder: str, name: str = RUN_DIR, **fields: str) -> Path:
        """``runs/FOLDER/NAME``, ``NAME`` a format string over ``{model}`` (the last part of the model name or
        path), ``{dtype}`` (resolved), ``{seed}`` and ``fields`` (e.g. ``task=``).

        Raises:
            OptionError: an unknown ``dtype``.
        """
        return (
            RUNS
            / folder
            / name.format(model=Path(self.model).name, dtype=self.resolved_dtype(), seed=self.seed, **fields)
        )

    def with_default_out(self, folder: str, name: str = RUN_DIR, **fields: str) -> RunOptions:
        """These options if ``out`` is given, else a copy whose ``out`` is :meth:`default_out`.

        Raises:
            OptionError: the default folder exists as a file (``out``), or an unknown ``dtype``.
        """
        if self.out is not None:
            return self
        out = self.default_out(folder, name, **fields)
        check_out_dir(out)
        return dataclasses.replace(self, out=out)

    def apply_threads(self) -> None:
        """Set torch's CPU threads to ``threads`` (None: leave torch's choice)."""
        if self.threads is not None:
            import torch

            torch.set_num_threads(self.threads)

    def load_runtime(self, console=None) -> Runtime:
        """Apply ``threads``, load ``model`` in ``dtype`` on ``device`` (a status line on the rich ``console``
        while it loads) and return the :class:`~eventkv.probes.base.Runtime` a probe runs on.

        Raises:
            EventKVError: the model cannot be found, fetched or loaded (see :func:`eventkv.models.load`).
        """
        from eventkv import models
        from eventkv.probes.base import Runtime

        self.apply_threads()
        what = f"loading {self.model} ({self.dtype}, device {self.device})"
        loading = console.status(what) if console else contextlib.nullcontext()
        with loading:
            lm = models.load(self.model, dtype=self.dtype, device=self.device)
        return Runtime(lm.model, lm.tokenizer, lm.profile)

    def run(self, probe: Probe, rt: Runtime, console=None) -> Summary:
        """Run ``probe`` on ``items`` items into ``out``, resumably (:func:`eventkv.probes.runner.run_probe`).

        Raises:
            OptionError: ``out`` is None (give it, or call :meth:`with_default_out` first).
            EventKVError: ``out`` holds a run made with other settings, or a probe/model error.
        """
        from eventkv.errors import OptionError
        from eventkv.probes.runner import run_probe

        if self.out is None:
            raise OptionError("out", None, "give a run directory, or call with_default_out(folder) first.")
        return run_probe(
            probe,
            rt,
            model=self.model,
            items=self.items,
            seed=self.seed,
            out=self.out,
            progress=self.progress,
            console=console,
            batch=self.batch_pairs,
        )
