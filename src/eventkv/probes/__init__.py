"""Probes: declarative recipes over the data path (see :mod:`eventkv.probes.base`).

Probes are declared in the ``eventkv.probes`` entry-point group (pyproject.toml);
:func:`get_probe` imports one by name and :func:`load_probes` imports them all into :data:`PROBES`.
"""

from eventkv.probes.base import PROBES, Arm, Probe, Runtime, Summary, Table, get_probe, load_probes, register
from eventkv.probes.donor_pair import DonorPair

__all__ = ["PROBES", "Arm", "DonorPair", "Probe", "Runtime", "Summary", "Table", "get_probe", "load_probes", "register"]
