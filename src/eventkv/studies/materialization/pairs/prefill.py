"""Tokenizing and prefilling a donor pair's histories (Study 1, "Donor pair"): the two variants
of a history with shared positions (:func:`tokenize_pair`), and the prefills of one item sharing
their common leading events (:class:`PrefillCache`, :func:`shared_log`, :func:`leading_log`)."""

from __future__ import annotations

from typing import Sequence

from eventkv.errors import EventKVError
from eventkv.kv.log import TokenizedLog
from eventkv.kv.rows import EventKV
from eventkv.probes.base import Runtime
from eventkv.studies.materialization.pairs.arms import event_id


def tokenize_pair(
    rt: Runtime, instruction: str, texts: Sequence[Sequence[str]], pad: dict | None = None
) -> list[TokenizedLog]:
    """The two variants of one history as TokenizedLogs with shared positions: a slot whose tokens
    differ gets the longer length as its budget; a slot in ``pad`` gets the longest tokenization
    of its alternatives (and of its own texts)."""
    n = len(texts[0])
    if len(texts[1]) != n:
        raise EventKVError("the two variants of a history must have the same number of events.")
    header = rt.header_ids(instruction)
    toks = [[rt.encode(t) for t in ev] for ev in texts]
    pad = {int(k): v for k, v in (pad or {}).items()}
    budgets: list[int | None] = []
    for i in range(n):
        width = None
        if toks[0][i] != toks[1][i]:
            width = max(len(toks[0][i]), len(toks[1][i]))
        if i in pad:
            width = max([len(toks[0][i]), len(toks[1][i])] + [len(rt.encode(t)) for t in pad[i]])
        budgets.append(width)
    ids = [event_id(i) for i in range(n)]
    return [TokenizedLog(header, ids, toks[v], budgets) for v in (0, 1)]


class PrefillCache:
    """Prefills of one item, sharing work: the header rows come from the runtime (once per run);
    each variant's prefill continues the longest already-computed prefix with the same tokens
    and positions (so the events before the first difference are computed once per item)."""

    def __init__(self, rt: Runtime, instruction: str) -> None:
        self.rt, self.instruction = rt, instruction
        self._done: list[EventKV] = []

    def prefill(self, log: TokenizedLog) -> EventKV:
        """The EventKV of ``log`` (keys/values ``[1, kv_heads, rows, head_dim]`` per layer),
        continuing the longest computed prefix or returning an identical earlier prefill."""
        done, prefix = self.plan(log)
        if done is not None:
            return done
        return self.add(self.rt.prefill(log, prefix=prefix))

    def plan(self, log: TokenizedLog) -> tuple[EventKV | None, EventKV]:
        """``(done, prefix)`` for ``log``: an identical earlier prefill (``done``, nothing to compute),
        else None and the longest computed prefix to continue (the header's rows at least)."""
        ids, pos = log.input_ids, log.position_ids
        best, best_n = self.rt.header_kv(self.instruction), None
        for ekv in self._done:
            n = _common_events(ekv.log, log)
            if n and (best_n is None or n > best_n):
                best, best_n = ekv, n
        if best_n is not None:
            if best_n == len(log.event_ids) and best.log.input_ids == ids and best.log.position_ids == pos:
                return best, best
            if best_n < len(best.log.event_ids):
                best = _truncate(best, best_n)
        return None, best

    def add(self, ekv: EventKV) -> EventKV:
        """Keep ``ekv`` (a prefill of this item) for later prefills to continue; returns it."""
        self._done.append(ekv)
        return ekv

    def prefill_shared(self, pair: Sequence[TokenizedLog]) -> None:
        """Prefill the events both variants begin with (same tokens and positions) as a prefix of
        its own, which both variants' prefills then continue: the donor-pair probe's order of
        forwards (header, shared events, each variant's remainder). Nothing when the variants
        differ in their first event or not at all."""
        shared = shared_log(pair)
        if shared is not None:
            self.prefill(shared)


def shared_log(pair: Sequence[TokenizedLog]) -> TokenizedLog | None:
    """The header and the events both variants begin with (same tokens and positions), or None when
    they differ in their first event or not at all (see :meth:`PrefillCache.prefill_shared`)."""
    n = _common_events(pair[0], pair[1])
    return leading_log(pair[0], n) if 0 < n < len(pair[0].event_ids) else None


def _common_events(a: TokenizedLog, b: TokenizedLog) -> int:
    """Number of leading events with the same tokens and positions in both logs (0 if the headers differ)."""
    if a.header_ids != b.header_ids:
        return 0
    n = 0
    for i in range(min(len(a.event_ids), len(b.event_ids))):
        sa, sb = a.spans[i + 1], b.spans[i + 1]
        if a.event_tokens[i] != b.event_tokens[i] or sa.pos_start != sb.pos_start or a.event_ids[i] != b.event_ids[i]:
            break
        n += 1
    return n


def leading_log(log: TokenizedLog, n_events: int) -> TokenizedLog:
    """The header and the first ``n_events`` events of ``log`` (same tokens, budgets, positions)."""
    return TokenizedLog(log.header_ids, log.event_ids[:n_events], log.event_tokens[:n_events], log.budgets[:n_events])


def _truncate(ekv: EventKV, n_events: int) -> EventKV:
    """The EventKV of the header and the first ``n_events`` events of ``ekv`` (rows shared)."""
    sub = leading_log(ekv.log, n_events)
    r = sub.n_rows
    return EventKV(
        sub, [k[:, :, :r] for k in ekv.keys], [v[:, :, :r] for v in ekv.values], ekv.positions[:r], ekv.weights_digest
    )
