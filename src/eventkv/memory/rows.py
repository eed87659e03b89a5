"""The in-memory K/V rows of a memory's stored history: loaded from the store's segment files,
replaced after each commit, sliced for a new segment file, cut where ``forget`` removes an event.

Rows are the data path's :class:`eventkv.kv.rows.EventKV` (per layer ``[1, kv_heads, rows,
head_dim]`` keys and values, ``[rows]`` RoPE position ids), one row per token of the header and of
every prefilled event, in history order (row ``i`` of the history is row ``i`` here). No SQL and no
model here: the caller computes rows (:func:`eventkv.kv.prefill.prefill`) and commits them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from eventkv.errors import StoreDamaged
from eventkv.kv.log import TokenizedLog
from eventkv.kv.quant import decode_rows
from eventkv.kv.rows import EventKV
from eventkv.memory.records import MemoryRecord

#: reads one segment row's file: per layer keys and values ``[kv_heads, rows, head_dim]``, positions ``[rows]``, and
#: the tensors the file holds
ReadSegment = Callable[..., tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class ForgetCut:
    """Where ``forget`` cuts the rows (Study 1's privacy path: the rows from the first forgotten event
    on are dropped, the later events recomputed).

    Attributes:
        kept: rows ``:keep`` (the header and the events before the first forgotten one), or None when
            ``keep`` is 0 (the header is recomputed too).
        keep: rows kept.
        start: first row of the new segment (where the first dropped segment began; ``<= keep``).
        drop_files: segment files holding a row from ``keep`` on (unlinked by the commit).
        later: the later events to recompute, up to the last one that had rows.
        seqs: the events the new segment holds: the kept ones from ``start`` on, then ``later``.
    """

    kept: EventKV | None
    keep: int
    start: int
    drop_files: list[str]
    later: list[MemoryRecord]
    seqs: list[int]


class RowCache:
    """A memory's rows in memory (:attr:`ekv`, None before the first prefill) and the isolated
    encodings of served events (:attr:`isolated`, the memo :func:`eventkv.kv.serve.serve` keeps for
    ``mode="isolated"``; keyed by id, position and tokens, emptied whenever rows are relaid out).

    A store of a quantized row format (``int8`` / ``int4``, :mod:`eventkv.kv.quant`) also keeps each segment's
    tensors as the file holds them (:attr:`packed`, a quarter to a half of the rows' bytes): :meth:`release`
    drops the dequantized rows, and :attr:`ekv` rebuilds them from the packed tensors at its next use (no disk
    read). A native store keeps only its rows (they are what the file holds)."""

    def __init__(self, rows_format: str = "native") -> None:
        self._ekv: EventKV | None = None
        self._n_rows = 0
        #: quantized stores: ``(first row, the segment's tensors)`` in row order
        self.packed: list[tuple[int, dict[str, torch.Tensor]]] = []
        self._format = rows_format
        self._released: tuple[TokenizedLog, torch.device, str, int] | None = None
        self.isolated: dict[tuple, tuple] = {}

    @property
    def ekv(self) -> EventKV | None:
        """The rows (rebuilt from :attr:`packed` after :meth:`release`)."""
        if self._ekv is None and self._released is not None:
            log, device, digest, n_layers = self._released
            keys: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
            values: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
            for _, tensors in self.packed:
                k, v = decode_rows(tensors, self._format, n_layers)
                for i in range(n_layers):
                    keys[i].append(k[i])
                    values[i].append(v[i])
            self._ekv = EventKV(
                log,
                [torch.cat(k, dim=1).unsqueeze(0).to(device) for k in keys],
                [torch.cat(v, dim=1).unsqueeze(0).to(device) for v in values],
                torch.cat([t["positions"] for _, t in self.packed]),
                digest,
            )
            self._released = None
        return self._ekv

    @property
    def n_rows(self) -> int:
        """Rows held (0 before the first prefill)."""
        return self._n_rows

    def held_bytes(self) -> int:
        """Bytes of the rows held in RAM: the dequantized rows (unless released) and the packed tensors."""
        packed = sum(t.numel() * t.element_size() for _, ts in self.packed for t in ts.values())
        if self._ekv is None:
            return packed
        rows = sum(t.numel() * t.element_size() for t in self._ekv.keys + self._ekv.values)
        return packed + rows + self._ekv.positions.numel() * self._ekv.positions.element_size()

    def release(self) -> int:
        """Drop the dequantized rows of a quantized store (kept packed; rebuilt at the next use of :attr:`ekv`)
        and the isolated encodings. Returns the bytes freed (0 for a native store, whose rows are the only copy,
        and when nothing is held)."""
        if self._ekv is None or not self.packed:
            return 0
        before = self.held_bytes()
        ekv = self._ekv
        self._released = (ekv.log, ekv.keys[0].device, ekv.weights_digest, ekv.n_layers)
        self._ekv = None
        self.isolated.clear()
        return before - self.held_bytes()

    def relaid_out(self) -> None:
        """Forget the isolated encodings (events moved, or rows were reloaded)."""
        self.isolated.clear()

    def commit(self, ekv: EventKV | None, start: int = 0, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """After a commit: the rows are ``ekv``; ``tensors`` (a quantized store's new segment, rows ``start:``)
        replaces every packed segment from ``start`` on."""
        if ekv is None:
            self.packed = []
        elif tensors is not None and self._format != "native":
            self.packed = [(s, t) for s, t in self.packed if s < start] + [(start, tensors)]
        self._ekv, self._released = ekv, None
        self._n_rows = ekv.n_rows if ekv is not None else 0

    def load(
        self,
        segments: Sequence,
        read: ReadSegment,
        n_layers: int,
        log: TokenizedLog | None,
        device: torch.device,
        weights_digest: str,
        corrupt: Callable[[str], StoreDamaged],
    ) -> None:
        """Read every segment (``segments``: the store's rows, by first row) with ``read(seg, n_layers)``,
        check the rows line up with ``log`` (the prefilled events; None when none is) and keep them on
        ``device`` (a store of a quantized row format also keeps each segment's tensors: :attr:`packed`).

        Raises:
            StoreDamaged: ``corrupt(what)``: events marked prefilled without a segment, a gap between
                segments, or rows whose positions do not match ``log``.
        """
        if not segments:
            if log is not None:
                raise corrupt(f"{len(log.event_ids)} events are marked prefilled but no segment exists")
            return
        keys: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        values: list[list[torch.Tensor]] = [[] for _ in range(n_layers)]
        positions, total, packed = [], 0, []
        for seg in segments:
            if seg["row_start"] != total:
                raise corrupt(f"segment {seg['file']!r} starts at row {seg['row_start']}, not {total}")
            k, v, p, tensors = read(seg, n_layers)
            if self._format != "native":
                packed.append((total, tensors))
            for i in range(n_layers):
                keys[i].append(k[i])
                values[i].append(v[i])
            positions.append(p)
            total += seg["n_rows"]
        pos = torch.cat(positions)
        if log is None or log.n_rows != total or pos.tolist() != log.position_ids:
            raise corrupt(f"the segments hold {total} rows that do not line up with the prefilled events")
        self.relaid_out()
        self.packed = packed
        self.commit(
            EventKV(
                log,
                [torch.cat(k, dim=1).unsqueeze(0).to(device) for k in keys],
                [torch.cat(v, dim=1).unsqueeze(0).to(device) for v in values],
                pos,
                weights_digest,
            )
        )

    def cut_for_forget(
        self,
        segments: Sequence,
        before: Sequence[MemoryRecord],
        remaining: Sequence[MemoryRecord],
        first: int,
        log: Callable[[Sequence[MemoryRecord]], TokenizedLog],
    ) -> ForgetCut:
        """The rows plan of forgetting events from seq ``first`` on (:class:`ForgetCut`).

        Args:
            segments: the store's segment rows, by first row.
            before: the stored events before ``first`` (history order).
            remaining: every stored event that stays (history order).
            first: the seq of the first forgotten event.
            log: the tokenized log of a list of stored events (header first).
        """
        keep = 0
        if before:
            last = before[-1]
            assert last.row_start is not None  # a stored event (not forgotten) has its rows' place
            keep = last.row_start + last.n_rows
        drop = [s for s in segments if s["row_start"] + s["n_rows"] > keep]
        start = min(s["row_start"] for s in drop)  # the new segment starts where the first dropped one did
        later_with_rows = [r for r in remaining if r.seq > first and r.prefilled]
        later = [r for r in remaining if first < r.seq <= later_with_rows[-1].seq] if later_with_rows else []
        return ForgetCut(
            kept=self.truncated(log(before), keep) if keep else None,
            keep=keep,
            start=start,
            drop_files=[s["file"] for s in drop],
            later=later,
            seqs=[r.seq for r in before if r.row_start >= start] + [r.seq for r in later],
        )

    def truncated(self, log: TokenizedLog, n: int) -> EventKV:
        """Rows ``:n`` as an EventKV of ``log`` (which must hold exactly ``n`` rows)."""
        ekv = self.ekv
        assert ekv is not None  # cut_for_forget runs only when a forgotten event had rows, so rows are loaded
        return EventKV(
            log,
            [k[:, :, :n] for k in ekv.keys],
            [v[:, :, :n] for v in ekv.values],
            ekv.positions[:n],
            ekv.weights_digest,
        )


def tail(ekv: EventKV, start: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Rows ``start:`` of ``ekv`` as a segment holds them: per layer keys and values ``[kv_heads, rows,
    head_dim]`` (batch dimension dropped) and positions ``[rows]``."""
    return [k[0, :, start:] for k in ekv.keys], [v[0, :, start:] for v in ekv.values], ekv.positions[start:]


def with_tail(ekv: EventKV, start: int, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> EventKV:
    """``ekv`` with rows ``start:`` replaced by ``keys`` / ``values`` (per layer ``[kv_heads, rows - start,
    head_dim]``, as :meth:`eventkv.memory.store.Store.write_segment` returns the rows a segment holds), moved to
    the device and dtype of ``ekv``'s rows."""
    new_keys = [
        torch.cat((k[:, :, :start], nk.to(k.device, k.dtype).unsqueeze(0)), dim=2) for k, nk in zip(ekv.keys, keys)
    ]
    new_values = [
        torch.cat((v[:, :, :start], nv.to(v.device, v.dtype).unsqueeze(0)), dim=2) for v, nv in zip(ekv.values, values)
    ]
    return EventKV(ekv.log, new_keys, new_values, ekv.positions, ekv.weights_digest, dict(ekv.meta))


def contiguous(records: Sequence[MemoryRecord], header_len: int) -> list[tuple[int, int, int]]:
    """``(seq, position, row_start)`` of each record laid out one after another from the header's
    end (each takes its ``width`` positions and ``n_rows`` rows): where forget moves later events."""
    out, pos, row = [], header_len, header_len
    for r in records:
        out.append((r.seq, pos, row))
        pos, row = pos + r.width, row + r.n_rows
    return out
