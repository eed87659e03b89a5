"""Probes: declarative recipes over the data path (see :mod:`eventkv.probes.base`).

Every probe is registered in :data:`PROBES` by its module; :func:`load_probes` imports them all
(``eventkv.probes.base.PROBE_MODULES``).
"""

from eventkv.probes.base import PROBES, Arm, Probe, Runtime, Summary, Table, get_probe, load_probes, register
from eventkv.probes.donor_pair import DonorPair

__all__ = ["PROBES", "Arm", "DonorPair", "Probe", "Runtime", "Summary", "Table", "get_probe", "load_probes", "register"]
