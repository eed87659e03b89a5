"""The data-file options of the probes that read dialogue data (harvest, memory-eval): the file
and its sha256, both part of a run's identity."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class DialogueData:
    """A mixin for ``@dataclass`` probes that read a dialogue data file: list it before
    :class:`~eventkv.probes.base.Probe`. Its fields come first, in this order, followed by the
    probe's own; the names are the options dictionary's keys a run folder stores in its manifest
    and compares on resume: never rename them.

    Attributes:
        data: the path of the data file (or folder, for formats that read one).
        data_digest: its sha256 (``"dir"`` for a folder), filled in by :meth:`pin_data_digest`
            when empty: a changed file is another run.
    """

    data: str = ""
    data_digest: str = ""

    def pin_data_digest(self, path: str | Path | None = None) -> None:
        """Fill in ``data_digest`` from the file ``path`` (default ``data``; the error message names
        it as given) with :func:`eventkv.files.data_digest`.

        Raises:
            EventKVError: the file's sha256 is not the recorded ``data_digest`` (the data changed
                since the run started; the message names the fix: a new ``--out``).
        """
        from eventkv.files import data_digest

        self.data_digest = data_digest(self.data if path is None else path, self.data_digest)
