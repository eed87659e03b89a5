"""A probe's part of the memory contract (Study 1, "The memory contract"): its rows of contract.md
and its section of contract.json.

Every contract probe has a classmethod ``contract_section(summary) -> ContractSection`` that turns
its own :class:`~eventkv.probes.base.Summary` (the statistics of its records, nothing else) into

* :class:`ContractRow`\\ s — ``[clause, measure, measured, interval / test, study]``, already
  formatted; the report lists them in the battery's probe order;
* one JSON section (``key`` and ``data``) of contract.json;
* optionally the figure it contributes to ``OUT/figures/``.

The keys of ``summary.data`` a probe reads stay inside that probe's module; the report
(:mod:`eventkv.studies.materialization.contract.report`) only assembles the sections. This module also holds the shared
formatters of the contract's cells (:func:`proportion`, :func:`d_value`, :func:`d_tests`,
:data:`GRADED`).

Example::

    >>> s = ContractSection("updates", {"readout": "logits"})
    >>> s.rows.append(ContractRow("updates", "stale-value leak", "0/4", "n/a", "0/96"))
    >>> list(s.rows[0])
    ['updates', 'stale-value leak', '0/4', 'n/a', '0/96']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, NamedTuple, Protocol

from eventkv.probes.base import Summary
from eventkv.stats import format_p
from eventkv.studies.materialization.pairs import describe_d

#: the study column of a graded row (donor shift d): Study 1 reports follow:anti only
GRADED = "(study: follow:anti only)"


class ContractRow(NamedTuple):
    """One row of the contract table (every cell already formatted text)."""

    clause: str
    """the contract clause (``trigger``, ``landing``, ...)"""
    measure: str
    """what is counted, with which readout"""
    measured: str
    """the figure measured on this model"""
    test: str
    """its Wilson 95% interval or its test (the "interval / test" column)"""
    study: str
    """Study 1's figure for the same clause (8B-class checkpoints)"""


@dataclass
class ContractSection:
    """One probe's part of the contract.

    Attributes:
        key: the section's name in contract.json (``donor_pair``, ``trigger``, ``landing``,
            ``capacity``, ``programming``, ``updates``).
        data: the section itself (JSON-able once NaN becomes null; the report does that).
        rows: the probe's rows of the contract table, in order.
        figure: ``(file name, draw)``: ``draw(path)`` writes the probe's contract figure (PNG) to
            ``path``; None when the probe has none.
    """

    key: str
    data: dict
    rows: list[ContractRow] = field(default_factory=list)
    figure: tuple[str, Callable[[Path], object]] | None = None


class ContractProbe(Protocol):
    """A probe that contributes to the memory contract (every probe of the battery)."""

    name: ClassVar[str]

    @classmethod
    def contract_section(cls, summary: Summary) -> ContractSection:
        """The probe's rows and JSON section, from its own summary (``summarize(records)``)."""
        ...


def proportion(d: dict | None) -> str:
    """A Wilson proportion dict (``rate``, ``low``, ``high``, ``k``, ``n``) as
    ``rate [low, high] (k/n)``; ``n/a`` when missing or empty."""
    if not d or not d.get("n"):
        return "n/a"
    return f"{d['rate']:.3f} [{d['low']:.3f}, {d['high']:.3f}] ({d['k']}/{d['n']})"


def d_tests(d: dict | None) -> str:
    """A :func:`~eventkv.studies.materialization.pairs.d_stats` dict as ``sign p = ..., Wilcoxon p = ... (n pairs)``;
    ``n/a`` when missing."""
    if not d:
        return "n/a"
    return f"sign p = {format_p(d['sign_p'])}, Wilcoxon p = {format_p(d['wilcoxon_p'])} ({d['n']} pairs)"


def d_value(d: dict | None) -> str:
    """A :func:`~eventkv.studies.materialization.pairs.d_stats` dict as its counts and median d (nats); says so when
    the arm had no candidate readout."""
    return describe_d(d) if d else "n/a (no candidate readout)"
