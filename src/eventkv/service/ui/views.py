"""What the inspector's pages show, computed without HTML: a memory's timeline page (filtered, paged), the
history strip (where the served rows lie in the whole history), each selector's rank and score of the served
events, the answer's tokens with their log-probabilities, the served-fraction/latency log of a memory's recent
queries and its figure, and the run folders given to the server (``eventkv serve --report``)."""

from __future__ import annotations

import base64
import io
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from eventkv.errors import EventKVError
from eventkv.memory.records import MemoryAnswer, MemoryRecord

#: events on one page of a timeline
PAGE_SIZE = 100
#: bins of the history strip: one ``<rect>`` each, whatever the history's length
STRIP_BINS = 240
#: queries kept per memory for the served-fraction/latency figure
LOG_SIZE = 200
#: the selectors whose rank and score the query view shows for every served event
RANKED_BY = ("bm25", "dense", "attention", "hybrid")


@dataclass(frozen=True)
class TimelineRow:
    """One event on a timeline page: its record, what patches it (``patched_by``: the patch ids, newest
    last), whether it is a group header (tag ``header``), and the served state of the page's last query
    (``served``: its place in the served set, 1-based, or None)."""

    record: MemoryRecord
    patched_by: tuple[str, ...]
    header: bool
    served: int | None

    @property
    def positions(self) -> str:
        """Its RoPE positions as ``first–last`` (``-`` once forgotten)."""
        r = self.record
        return "-" if r.position is None else f"{r.position}–{r.position + max(r.width, 1) - 1}"

    @property
    def state(self) -> str:
        """``forgotten``, ``deleted``, ``superseded`` or ``live``."""
        r = self.record
        if r.forgotten:
            return "forgotten"
        if r.deleted:
            return "deleted"
        return "superseded" if self.patched_by else "live"


@dataclass(frozen=True)
class TimelinePage:
    """One page of a memory's timeline: ``rows`` (:class:`TimelineRow`), the page number (1-based), the
    pages, the events that matched the filter, and the events of the whole history."""

    rows: list[TimelineRow]
    page: int
    pages: int
    matched: int
    total: int


def timeline(
    records: Sequence[MemoryRecord],
    page: int = 1,
    text: str = "",
    served: Sequence[str] = (),
    served_only: bool = False,
) -> TimelinePage:
    """Page ``page`` (1-based; past the last: the last) of ``records`` (every stored event in history order,
    patches, deleted and forgotten ones included) filtered by ``text`` (case-insensitive, in the id, text,
    role or tags) and, with ``served_only``, to the ids of ``served``; :data:`PAGE_SIZE` events a page.

    Cost: one pass over the records (a 20,000-event history is filtered in milliseconds; the read of the
    committed table dominates: ``benchmarks/ui_timeline.py``)."""
    patched: dict[str, list[str]] = {}
    for r in records:
        if r.supersedes is not None:
            patched.setdefault(r.supersedes, []).append(r.id)
    place = {eid: n for n, eid in enumerate(served, start=1)}
    needle = text.strip().lower()

    def matches(r: MemoryRecord) -> bool:
        if served_only and r.id not in place:
            return False
        if not needle:
            return True
        hay = " ".join((r.id, r.text or "", r.role or "", *r.tags)).lower()
        return needle in hay

    kept = [r for r in records if matches(r)]
    pages = max(1, math.ceil(len(kept) / PAGE_SIZE))
    page = min(max(1, page), pages)
    rows = [
        TimelineRow(r, tuple(patched.get(r.id, ())), "header" in r.tags, place.get(r.id))
        for r in kept[(page - 1) * PAGE_SIZE : page * PAGE_SIZE]
    ]
    return TimelinePage(rows, page, pages, len(kept), len(records))


@dataclass(frozen=True)
class StripBin:
    """One bin of the history strip: its x and width in percent of the history's rows, how many of its
    events were served, and the first and last event id in it (the bin's tooltip)."""

    x: float
    width: float
    served: int
    events: int
    first: str
    last: str


def strip(records: Sequence[MemoryRecord], served: Sequence[str], bins: int = STRIP_BINS) -> list[StripBin]:
    """The history strip: the stored rows of ``records`` in :data:`STRIP_BINS` equal bins of rows, each with
    the count of served events whose first row falls in it, so a served set is seen against the whole
    history in one picture whatever its length (an empty list when no event has rows)."""
    stored = [r for r in records if r.row_start is not None and r.n_rows > 0]
    if not stored:
        return []
    first = min(r.row_start for r in stored if r.row_start is not None)
    end = max(r.row_start + r.n_rows for r in stored if r.row_start is not None)
    span = max(1, end - first)
    width = span / bins
    chosen = set(served)
    out: dict[int, list] = {}
    for r in stored:
        b = min(bins - 1, int((r.row_start - first) / width))  # type: ignore[operator]  # filtered above
        slot = out.setdefault(b, [0, 0, r.id, r.id])
        slot[0] += r.id in chosen
        slot[1] += 1
        slot[3] = r.id
    return [StripBin(100 * b / bins, 100 / bins, s, n, a, z) for b, (s, n, a, z) in sorted(out.items())]


def selector_ranks(selection: Any, question: str, names: Sequence[str] = RANKED_BY) -> dict[str, Any]:
    """(worker thread) Each selector's ranking of the whole view for ``question``: per name, ``{event id:
    (rank, score)}`` (rank 1 = best; a patched event under its latest patch's id), or the message of the
    :class:`eventkv.errors.EventKVError` that selector raised (a library or model it needs is missing), and
    the milliseconds it took under ``"<name>_ms"``.

    Args:
        selection: the memory's :class:`eventkv.memory.query.Selection`.
    """
    from eventkv.memory.query import QueryOptions

    out: dict[str, Any] = {}
    every = max(1, len(selection.table.view_ids()))  # k = the whole view: every event ranked
    for name in names:
        t0 = time.perf_counter()
        try:
            _, ranking, _, _ = selection.choose(question, QueryOptions(k=every, selector=name), True)
            out[name] = {r.id: (n, float(r.score)) for n, r in enumerate(ranking, start=1)}
        except EventKVError as exc:
            out[name] = str(exc)
        out[f"{name}_ms"] = 1000 * (time.perf_counter() - t0)
    return out


@dataclass(frozen=True)
class Token:
    """One generated token: its text piece and log-probability (nats) under the served rows."""

    text: str
    logprob: float


def answer_tokens(tokenizer: Any, answer: MemoryAnswer) -> list[Token]:
    """The answer's greedy tokens with their log-probabilities (nats; from the logits the query kept:
    ``keep_logits=True``), each decoded alone (an empty list when no logits were kept)."""
    import torch

    gen = answer.generation
    out = []
    for tok, logits in zip(gen.tokens, gen.logits):
        lp = torch.log_softmax(logits.float(), dim=-1)[tok].item()
        out.append(Token(tokenizer.decode([tok]), lp))
    return out


@dataclass
class QueryLog:
    """The served fraction and latency of each memory's recent queries (:data:`LOG_SIZE` per memory, in
    this process only; kept for the memory page's figure). Thread-safe."""

    size: int = LOG_SIZE
    entries: dict[str, deque] = field(default_factory=dict)
    drawn: dict[str, tuple] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, key: str, answer: MemoryAnswer, view_rows: int) -> None:
        """Record one answer on memory ``key`` (``<namespace>/<id>``): the fraction of the view's rows it
        served (header included in both), its wall time in ms (prefill + serve + decode), and its plan's
        mode and positions."""
        total = sum(answer.timings_ms.get(k, 0.0) for k in ("prefill", "serve", "decode"))
        entry = (
            time.time(),
            answer.n_rows_served / max(1, view_rows),
            total,
            str(answer.plan.get("mode", "")),
            str(answer.plan.get("positions", "")),
        )
        with self.lock:
            self.entries.setdefault(key, deque(maxlen=self.size)).append(entry)

    def figure(self, key: str) -> str | None:
        """:func:`log_figure` of memory ``key``'s entries, drawn again only after a new entry (a figure
        takes ~0.1-0.2 s to draw, and the memory page asks for it after every write and query)."""
        entries = self.of(key)
        stamp = (len(entries), entries[-1][0]) if entries else None
        with self.lock:
            kept = self.drawn.get(key)
            if kept is not None and kept[0] == stamp:
                return kept[1]
        svg = log_figure(entries)
        with self.lock:
            self.drawn[key] = (stamp, svg)
        return svg

    def of(self, key: str) -> list[tuple]:
        """The recorded ``(unix time, served fraction, ms, mode, positions)`` of memory ``key``, oldest first."""
        with self.lock:
            return list(self.entries.get(key, ()))


def log_figure(entries: Sequence[tuple]) -> str | None:
    """An SVG figure (matplotlib) of ``entries`` (:meth:`QueryLog.of`): served fraction (x, % of the view's
    rows) against latency (y, ms), one colour per serving mode and positions; None with no entries."""
    if not entries:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5.2, 3.0), dpi=100)
    ax = fig.add_subplot()
    groups: dict[str, list[tuple[float, float]]] = {}
    for _, frac, ms, mode, positions in entries:
        groups.setdefault(f"{mode} · {positions}" if positions else mode, []).append((100 * frac, ms))
    for label, pts in sorted(groups.items()):
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=18, label=label)
    ax.set_xlabel("rows served, % of the memory's rows")
    ax.set_ylabel("latency (ms)")
    last = "the last query" if len(entries) == 1 else f"the last {len(entries)} queries"
    ax.set_title(f"{last} of this memory", fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]  # inline: no XML prologue


class Snapshots:
    """The committed snapshots of the memories the pages show (:func:`eventkv.memory.reader.read_memory`), kept
    while their store is unchanged: a 20,000-event table takes about a second to read and check, and every
    fragment of a page reads it. A snapshot is reused while the store's database, its write-ahead log and its
    manifest have the same inode, size and mtime (ns) as when it was read (any commit changes the log or, once
    checkpointed, the database); otherwise it is read again, with every check. The ``size`` most recently
    used are kept. Thread-safe. The JSON routes read uncached: a damaged segment file a commit did not touch
    shows on the page at the next commit or the next server start, and at once through the API."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self.kept: dict[Path, tuple[tuple, Any]] = {}
        self.lock = threading.Lock()

    @staticmethod
    def stamp(d: Path) -> tuple:
        from eventkv.memory.store import DATABASE

        out: list[tuple[int, int, int] | None] = []
        for name in (DATABASE, DATABASE + "-wal", "manifest.json"):
            try:
                st = (d / name).stat()
                out.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except FileNotFoundError:
                out.append(None)
        return tuple(out)

    def read(self, d: Path) -> Any:
        """The snapshot of the memory in ``d``.

        Raises:
            StoreDamaged, EventKVError: as :func:`eventkv.memory.reader.read_memory` (nothing is kept then).
        """
        from eventkv.memory.reader import read_memory

        stamp = self.stamp(d)
        with self.lock:
            hit = self.kept.get(d)
            if hit is not None and hit[0] == stamp:
                self.kept[d] = self.kept.pop(d)  # most recently used last
                return hit[1]
        snap = read_memory(d)
        with self.lock:
            self.kept[d] = (stamp, snap)
            while len(self.kept) > self.size:
                self.kept.pop(next(iter(self.kept)))
        return snap


@dataclass(frozen=True)
class Report:
    """A folder given with ``eventkv serve --report``: its name, its summary as HTML (``summary.md`` or
    ``contract.md``, rendered by markdown-it), and its PNG figures as data URIs (so a page fetched with the
    bearer token carries them: an ``<img>`` request cannot)."""

    name: str
    html: str
    figures: list[tuple[str, str]]


def read_report(folder: Path) -> Report:
    """The :class:`Report` of ``folder`` (read on each request: a run still writing shows its latest state).

    Raises:
        EventKVError: the folder is gone or unreadable.
    """
    from markdown_it import MarkdownIt

    try:
        md = next((folder / n for n in ("summary.md", "contract.md") if (folder / n).is_file()), None)
        text = md.read_text(encoding="utf-8") if md is not None else ""
        pngs = sorted(folder.glob("*.png")) + sorted((folder / "figures").glob("*.png"))
        figures = [(p.name, "data:image/png;base64," + base64.b64encode(p.read_bytes()).decode()) for p in pngs]
    except OSError as exc:
        raise EventKVError(f"the report folder {folder.name!r} cannot be read ({exc.strerror}).") from None
    # html=False: a summary's own HTML is shown as text, never run in the page
    return Report(folder.name, MarkdownIt("commonmark", {"html": False}).enable("table").render(text), figures)


def human_bytes(n: int) -> str:
    """``n`` bytes as B, KiB, MiB or GiB (one decimal)."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"
