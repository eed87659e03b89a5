"""Probes: declarative recipes over the data path (see :mod:`eventkv.probes.base`).

This package is the framework only; the studies' probes live in :mod:`eventkv.studies`. Probes are
declared in the ``eventkv.probes`` entry-point group (pyproject.toml);
:func:`get_probe` imports one by name and :func:`load_probes` imports them all into :data:`PROBES`.
"""

from eventkv.probes.base import PROBES, Arm, Probe, Runtime, Summary, Table, get_probe, load_probes, register

__all__ = ["PROBES", "Arm", "Probe", "Runtime", "Summary", "Table", "get_probe", "load_probes", "register"]
