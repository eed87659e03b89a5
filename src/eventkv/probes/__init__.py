"""Probes: declarative recipes over the data path (see :mod:`eventkv.probes.base`).

Every probe is registered in :data:`PROBES`; importing this package registers them all.
"""

from eventkv.probes.base import PROBES, Arm, Probe, Runtime, Summary, Table, get_probe, register
from eventkv.probes.donor_pair import DonorPair

__all__ = ["PROBES", "Arm", "DonorPair", "Probe", "Runtime", "Summary", "Table", "get_probe", "register"]
