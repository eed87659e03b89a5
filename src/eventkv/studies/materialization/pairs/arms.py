"""The arms of a donor pair (Study 1, "Donor pair"): :class:`PairArm` (which history, which
roles served how, which question), the event ids of slots (:func:`event_id`), and which events of
a history an arm reads (:func:`served_ids`, :func:`events_read`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from eventkv.errors import EventKVError
from eventkv.kv.log import TokenizedLog
from eventkv.probes.base import Arm, Readout


@dataclass(frozen=True)
class PairArm:
    """One arm of a multi-history donor pair.

    Attributes:
        name: the arm's name in records and tables.
        history: which of the item's histories it is answered from.
        served: roles of that history to serve, or ``"all"``.
        encoding: ``compact`` (rows of the global prefill), ``isolated`` (each served event
            encoded alone) or ``prefill`` (the global prefill continued by the query: text).
        question: which of the item's questions it asks.
        swap: roles whose rows come from the *other* variant's prefill (compact only): the
            landing factorial serves the root of one variant beside the mention of the other.
        fixed_position: ask at the item's common query position (see the module docstring).
        query_at: where the question starts when ``fixed_position`` is off: ``"history"`` (the first position
            after the whole history, every served row at its original position) or ``"last-served"`` (right
            after the last served token, as the first study's scripts place it: their ``_greedy_pos`` starts
            the question at the largest served position + 1).
        description: one line for tables and docs.
    """

    name: str
    history: str
    served: tuple[str, ...] | str
    encoding: str = "compact"
    question: str = "main"
    swap: tuple[str, ...] = ()
    fixed_position: bool = False
    query_at: str = "history"
    description: str = ""

    def arm(self, readouts: Sequence[Readout]) -> Arm:
        return Arm(
            self.name,
            self.served,
            self.encoding if self.encoding != "prefill" else "prefill",
            tuple(readouts),
            self.description,
        )


def event_id(slot: int) -> str:
    """The id of the event in ``slot`` (0-based) of a donor-pair history: ``e00``, ``e01``, ..."""
    return f"e{slot:02d}"


def served_ids(item: dict, arm: PairArm, log: TokenizedLog) -> list[str]:
    """The event ids ``arm`` serves from ``log`` (its history's variant A; the ids are the same in B).

    Raises:
        EventKVError: a role the arm serves that its history does not have.
    """
    if arm.served == "all":
        return list(log.event_ids)
    roles = item["roles"][arm.history]
    missing = [r for r in arm.served if r not in roles]
    if missing:
        raise EventKVError(f"arm {arm.name!r} serves role(s) {missing} missing from history {arm.history!r}.")
    return [event_id(roles[r]) for r in arm.served]


def events_read(arms: Sequence[PairArm], item: dict, log: TokenizedLog, history: str) -> tuple[int | None, bool]:
    """``(n, everything)`` for one history: ``n`` leading events hold every event its subset-serving
    arms read (served or swapped, by history order; None when that is the whole history or there is
    no such arm), and ``everything`` says whether an arm reads every event (``prefill`` encoding or
    ``served="all"``). The lead is always prefilled first and the rest continues it."""
    mine = [a for a in arms if a.history == history]
    everything = any(a.encoding == "prefill" or a.served == "all" for a in mine)
    roles = item["roles"][history]
    idx = [
        log.event_ids.index(event_id(roles[r]))
        for a in mine
        if not (a.encoding == "prefill" or a.served == "all")
        for r in (*a.served, *a.swap)
        if r in roles and event_id(roles[r]) in log.event_ids
    ]
    n = max(idx) + 1 if idx else None
    return (None if n == len(log.event_ids) else n), everything
