"""Many memories on one server, per row format: their disk, their RAM, the cost to open one, and query
latency when most of them are closed, measured in one run.

1. Build: for each format of ``--rows`` (default native, int8, int4), ``--memories`` memories (default
   200) made with the library (``EventMemory.create(..., rows=FORMAT)``), each a synthetic dialogue
   history shaped like a LoCoMo conversation: two speakers, sessions of ``--session-turns`` turns, each
   session a header event with its date (``[session 3 begins: 1:56 pm on 8 May, 2023]``) and then its
   turns (``[session 3] Speaker: text``), ``--turns`` turns in all, the sentences invented from small
   word lists seeded per memory (memory ``i`` holds the same text in every format). Each session is
   one ``add(..., prefill=True)``, as the memory evaluation builds its histories, so every memory is
   fully prefilled. Each format has its own store root laid out as ``eventkv serve --store`` reads it
   (``ROOT/default/MEMORY_ID``).
2. Sizing, per format: the bytes on disk of a memory (every file of its store after it is closed,
   mean; its segment files apart) and the memories a GiB of disk holds; the RAM an open memory's rows
   take in use (``EventMemory.rows_bytes``: its rows dequantized to the model's dtype in every format, plus a
   quantized store's packed tensors) and released (after ``release_rows()``, what ``eventkv serve --max-hot``
   leaves of the memories it did not use lately: a quantized store's packed tensors only; a native store keeps
   its rows), its event table, BM25 index and SQLite connection not counted, and the memories a GiB of RAM
   holds either way; the cost
   to open a memory (``EventMemory.open`` with the sha256 check of every segment, as the server opens
   them, and with the size check only) and to close it: median ms over ``--open-sample`` memories drawn
   at random, the formats in turn on each, every store's files in the page cache (just written).
3. Load: a fresh ``eventkv serve`` per format on its store root (float32, ``--threads`` torch threads,
   ``--max-open`` memories kept open, the least recently used one closed beyond it; the other options
   their defaults), all of them up together, each idle but while it is under load. On each, before the
   load, every memory's ``GET /v1/memories/{id}`` must report the format and the bytes of the store's
   files (which then include the SQLite ``-shm`` / ``-wal`` files the server's read-only connection
   leaves: printed as the bytes over the store at rest), and one query warms the server up (not timed).
   Then for each client count of ``--clients`` (default 1, 8, 16) the formats one after another, so
   they see the same machine: that many closed-loop clients (an asyncio httpx loop each) send queries
   for ``--seconds`` seconds (at most ``--max-requests``), each on a memory drawn at random: BM25 top
   ``--k`` within ``--budget-rows`` rows, greedy, ``--new-tokens`` new tokens. A request is *cold* when
   its memory was not among the ``--max-open`` memories most recently sent a request on that server (a
   client-side LRU of the server's size, updated as each request is sent, kept across client counts),
   else *warm*. Per cell: requests, requests/s, p50 / p99 latency of all requests, of cold and of warm
   ones, and errors (every answer that is not 2xx and every connection that failed).

Printed first: the CPU, the torch threads and the model; then a sizing line per format; the load table,
a line per format on its GETs and the error count. Printed last, each on a line of its own, ratios of
this run (a line only where both of its formats ran): ``disk bytes per memory, native / int8: N.NNx``,
``disk bytes per memory, native / int4: N.NNx``, ``open time, native / int4: N.NNx`` (with the sha256
check), ``RAM of a released open memory's rows, native / int4: N.NNx`` and ``cold p50 latency at N
clients, native / int4: N.NNx`` for each client count.

    python benchmarks/memory_fleet.py [--model tiny] [--memories 200] [--rows native,int8,int4]
        [--turns 40] [--session-turns 10] [--max-open 16] [--clients 1,8,16] [--seconds 10]
        [--max-requests 5000] [--k 8] [--budget-rows 256] [--new-tokens 8] [--open-sample 20]
        [--threads 1] [--seed 0]

``--model tiny`` (the default) is the tiny random Llama with its output layer scaled by 30, saved to a
temporary model directory; any other value is handed to ``eventkv serve --model`` (e.g. smollm2-135m).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import gc
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from service_load import Tally, ratio
from service_scale import cpu_model

from eventkv.kv.quant import ROW_FORMATS
from eventkv.memory import EventMemory, MemoryEvent
from eventkv.models import load
from eventkv.service.server import ServerProcess
from eventkv.testing import save_sharp_model

NAMESPACE = "default"

# the word lists the dialogues are made of (invented; no dataset text)
NAMES = ("Mara", "Jonas", "Ilse", "Tariq", "Noor", "Felix", "Ana", "Kwame", "Yuki", "Bruno", "Leila", "Oskar")
PLACES = ("the lake", "Lisbon", "the old market", "Kyoto", "the hills", "the library", "Porto", "the beach")
THINGS = (
    "a pottery class",
    "the marathon",
    "a new guitar",
    "the community garden",
    "a road trip",
    "a book club",
    "the charity run",
    "a painting",
    "the camping gear",
    "a job interview",
    "the dog shelter",
    "a cooking course",
)
DONE = ("started", "finished", "signed up for", "talked about", "tried", "planned", "gave up on", "showed my sister")
PEOPLE = ("my sister", "my neighbour", "an old friend", "my kids", "my coworker", "my partner", "my mentor")
FEELINGS = ("proud", "nervous", "excited", "tired but happy", "a bit lost", "grateful", "surprised")
WHEN = ("last weekend", "yesterday", "two days ago", "last month", "this morning", "on Friday", "last summer")


def session_date(when: dt.datetime) -> str:
    """A session's date as LoCoMo writes it: ``1:56 pm on 8 May, 2023``."""
    hour, half = when.hour % 12 or 12, "am" if when.hour < 12 else "pm"
    return f"{hour}:{when.minute:02d} {half} on {when.day} {when:%B}, {when.year}"


def turn_text(rng: random.Random, other: str) -> str:
    """One invented sentence or two of a speaker talking to ``other``."""
    thing, place, person = rng.choice(THINGS), rng.choice(PLACES), rng.choice(PEOPLE)
    templates = (
        f"I {rng.choice(DONE)} {thing} {rng.choice(WHEN)}, and I feel {rng.choice(FEELINGS)} about it.",
        f"Hey {other}! {rng.choice(WHEN).capitalize()} I went to {place} with {person}.",
        f"Have you ever thought about {thing}? {person.capitalize()} keeps asking me about it.",
        f"That sounds great, {other}. I {rng.choice(DONE)} {thing} near {place} {rng.choice(WHEN)}.",
        f"Honestly I was {rng.choice(FEELINGS)} when {person} {rng.choice(DONE)} {thing}.",
        f"We should go to {place} together; I could bring {person} and we could talk about {thing}.",
    )
    return rng.choice(templates)


def dialogue(seed: int, turns: int, session_turns: int) -> tuple[tuple[str, str], list[list[MemoryEvent]]]:
    """The speakers and the sessions (each a list of events, its dated header first) of one invented
    dialogue of ``turns`` turns, ``session_turns`` turns a session (the last one may hold fewer)."""
    rng = random.Random(seed)
    a, b = rng.sample(NAMES, 2)
    when = dt.datetime(2023, 1, 1) + dt.timedelta(days=rng.randrange(300), minutes=rng.randrange(8 * 60, 22 * 60))
    sessions: list[list[MemoryEvent]] = []
    for s, start in enumerate(range(0, turns, session_turns), 1):
        events = [MemoryEvent(f"[session {s} begins: {session_date(when)}]", id=f"session-{s}", tags=("header",))]
        for t in range(start, min(turns, start + session_turns)):
            speaker, other = (a, b) if t % 2 == 0 else (b, a)
            text = f"[session {s}] {speaker}: {turn_text(rng, other)}"
            events.append(MemoryEvent(text, id=f"D{s}:{t - start + 1}"))
        sessions.append(events)
        when += dt.timedelta(days=rng.randrange(3, 21), minutes=rng.randrange(-180, 180))
    return (a, b), sessions


def question(rng: random.Random, speakers: tuple[str, str]) -> str:
    """A question about a dialogue between ``speakers``."""
    who, thing = rng.choice(speakers), rng.choice(THINGS)
    return rng.choice(
        (
            f"When did {who} talk about {thing}?",
            f"Who went to {rng.choice(PLACES)} with {who}?",
            f"How does {who} feel about {thing}?",
        )
    )


def store_bytes(d: Path) -> tuple[int, int]:
    """``(every file, the segment files)`` of the store in ``d``, in bytes."""
    files = [f for f in d.rglob("*") if f.is_file()]
    return sum(f.stat().st_size for f in files), sum(f.stat().st_size for f in files if f.parent.name == "segments")


@dataclass
class Fleet:
    """One format's memories: their store root, and what step 2 measured of them."""

    rows_format: str
    root: Path
    build_s: float = 0.0
    rows: list[int] = field(default_factory=list)  # each memory's rows, header included
    disk: list[int] = field(default_factory=list)  # each memory's bytes on disk
    segments: list[int] = field(default_factory=list)  # each memory's segment files, bytes
    open_ms: float = float("nan")  # median, sha256 check
    open_size_ms: float = float("nan")  # median, size check only
    close_ms: float = float("nan")  # median
    get_extra: list[int] = field(default_factory=list)  # each memory's GET bytes_on_disk over its bytes at rest
    hot: list[int] = field(default_factory=list)  # each open memory's rows_bytes in use
    idle: list[int] = field(default_factory=list)  # each open memory's rows_bytes after release_rows()

    @property
    def disk_mean(self) -> float:
        return statistics.fmean(self.disk)


def build(lm, fleet: Fleet, mids: list[str], args) -> None:
    """Every memory of ``fleet`` under ``fleet.root/default``, each session one prefilled add."""
    t0 = time.perf_counter()
    for i, mid in enumerate(mids):
        _, sessions = dialogue(args.seed * 1_000_003 + i, args.turns, args.session_turns)
        d = fleet.root / NAMESPACE / mid
        with EventMemory.create(d, lm, namespace=NAMESPACE, rows=fleet.rows_format) as mem:
            for events in sessions:
                mem.add(events, prefill=True)
            stats = mem.stats()
            assert stats.prefilled_up_to == stats.history_end, stats  # every event prefilled
            fleet.rows.append(stats.rows)
            fleet.hot.append(mem.rows_bytes)
            mem.release_rows()  # a quantized store's memory keeps its packed tensors only; a native one its rows
            fleet.idle.append(mem.rows_bytes)
        disk, seg = store_bytes(d)
        fleet.disk.append(disk)
        fleet.segments.append(seg)
    fleet.build_s = time.perf_counter() - t0


def open_costs(lm, fleets: list[Fleet], mids: list[str], sample: int, seed: int) -> None:
    """Median ms to open a memory (sha256 check, then the size check only) and to close it, over ``sample``
    memories drawn at random, the formats taken in turn on each (so a change in the machine's load hits
    them alike); every store was written just before (its files in the page cache)."""
    picked = random.Random(seed).sample(mids, min(sample, len(mids)))
    times: dict[tuple[str, str], list[float]] = defaultdict(list)
    for mid in picked:
        for fleet in fleets:
            d = fleet.root / NAMESPACE / mid
            for verify in ("full", "size"):
                t0 = time.perf_counter()
                mem = EventMemory.open(d, lm, verify=verify)
                times[(fleet.rows_format, verify)].append(1e3 * (time.perf_counter() - t0))
                t0 = time.perf_counter()
                mem.close()
                times[(fleet.rows_format, "close")].append(1e3 * (time.perf_counter() - t0))
    for fleet in fleets:
        fleet.open_ms, fleet.open_size_ms, fleet.close_ms = (
            statistics.median(times[(fleet.rows_format, what)]) for what in ("full", "size", "close")
        )


@dataclass
class Cell(Tally):
    """What one (format, client count) load measured: ``lat`` and ``codes`` keyed by ``cold`` / ``warm``
    (``codes`` status 0: the connection failed)."""

    rows_format: str
    clients: int

    @property
    def errors(self) -> int:
        return sum(v for (_, c), v in self.codes.items() if not 200 <= c < 300)

    def count(self, op: str) -> int:
        return len(self.lat[op])


class RecentlyUsed:
    """The client side's picture of the server's open memories: the ``size`` memories most recently
    sent a request."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._order: OrderedDict[str, None] = OrderedDict()

    def touch(self, mid: str) -> bool:
        """Record a request on ``mid``; whether it is warm (``mid`` among the ``size`` most recent before it)."""
        warm = mid in self._order
        self._order[mid] = None
        self._order.move_to_end(mid)
        while len(self._order) > self.size:
            self._order.popitem(last=False)
        return warm


async def load_phase(url: str, mids: list[str], speakers: dict, cell: Cell, lru: RecentlyUsed, args) -> None:
    """``cell.clients`` closed-loop clients, each query on a memory drawn at random, until the time or the
    count is up; fills ``cell``."""
    n = 0
    deadline = time.perf_counter() + args.seconds

    async def one(client_no: int) -> None:
        nonlocal n
        rng = random.Random(args.seed * 7919 + cell.clients * 100 + client_no)
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            while time.perf_counter() < deadline and n < args.max_requests:
                n += 1
                mid = rng.choice(mids)
                op = "warm" if lru.touch(mid) else "cold"
                body = {
                    "question": question(rng, speakers[mid]),
                    "selector": "bm25",
                    "k": args.k,
                    "budget_rows": args.budget_rows,
                    "max_new_tokens": args.new_tokens,
                }
                t0 = time.perf_counter()
                try:
                    r = await http.post(f"/v1/memories/{mid}/query", json=body)
                    status = r.status_code
                except httpx.TransportError:
                    status = 0
                cell.lat[op].append(time.perf_counter() - t0)
                cell.codes[(op, status)] += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(cell.clients)))
    cell.wall = time.perf_counter() - t0


def check_gets(http: httpx.Client, fleet: Fleet, mids: list[str]) -> None:
    """Every memory's ``GET /v1/memories/ID``: its row format, and bytes on disk equal to its store's files
    (with the SQLite files the server's read leaves: their bytes go to ``fleet.get_extra``).

    Raises:
        RuntimeError: a memory whose answer disagrees.
    """
    for mid, disk in zip(mids, fleet.disk):
        got = http.get(f"/v1/memories/{mid}")
        got.raise_for_status()
        out = got.json()
        now, _ = store_bytes(fleet.root / NAMESPACE / mid)
        if out["rows"] != fleet.rows_format or out["stats"]["bytes_on_disk"] != now:
            raise RuntimeError(
                f"{fleet.rows_format} {mid}: the server reports rows {out['rows']!r} and "
                f"{out['stats']['bytes_on_disk']} bytes on disk; its files hold {now}"
            )
        fleet.get_extra.append(now - disk)


def serve_fleets(
    args, model: str, fleets: list[Fleet], mids: list[str], speakers: dict, counts: list[int]
) -> list[Cell]:
    """A fresh server on each fleet's store root, all of them up together (each idle but while it is under
    load): every memory's ``GET`` checked, one warm-up query (not timed); then for each client count the
    formats' loads back to back, so they see the same machine; SIGTERM. Returns the cells.

    Raises:
        RuntimeError: a memory's GET disagrees with step 2, or a server did not stop cleanly.
    """
    common = ("--dtype", "float32", "--threads", str(args.threads), "--log-level", "info")
    servers: list[ServerProcess] = []
    lrus = [RecentlyUsed(args.max_open) for _ in fleets]
    cells: list[Cell] = []
    try:
        for fleet, lru in zip(fleets, lrus):
            servers.append(ServerProcess(model, fleet.root, *common, "--max-open", str(args.max_open), timeout=600))
            with httpx.Client(base_url=servers[-1].url, timeout=600) as http:
                check_gets(http, fleet, mids)
                lru.touch(mids[0])
                body = {"question": question(random.Random(0), speakers[mids[0]]), "k": args.k, "max_new_tokens": 1}
                http.post(f"/v1/memories/{mids[0]}/query", json=body).raise_for_status()
        for n in counts:
            for fleet, srv, lru in zip(fleets, servers, lrus):
                cells.append(Cell(fleet.rows_format, n))
                asyncio.run(load_phase(srv.url, mids, speakers, cells[-1], lru, args))
        for fleet, srv in zip(fleets, servers):
            code = srv.stop(timeout=180)
            if code != 0:
                raise RuntimeError(f"the {fleet.rows_format} server exited with {code} on SIGTERM")
    except BaseException:
        for srv in servers:
            print(srv.log()[-4000:], file=sys.stderr)
        raise
    finally:
        for srv in servers:
            srv.kill()
    return cells


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny: the sharpened tiny random Llama; else eventkv's --model")
    ap.add_argument("--memories", type=int, default=200, help="memories of each row format")
    ap.add_argument("--rows", default="native,int8,int4", help="row formats, comma-separated")
    ap.add_argument("--turns", type=int, default=40, help="dialogue turns of each memory")
    ap.add_argument("--session-turns", type=int, default=10, help="turns of each session (one prefilled add)")
    ap.add_argument("--max-open", type=int, default=16, help="the server's --max-open")
    ap.add_argument("--clients", default="1,8,16", help="client counts, comma-separated")
    ap.add_argument("--seconds", type=float, default=10.0, help="seconds of load per format and client count")
    ap.add_argument("--max-requests", type=int, default=5000, help="requests per format and client count at most")
    ap.add_argument("--k", type=int, default=8, help="events a query serves at most (BM25 top-k)")
    ap.add_argument("--budget-rows", type=int, default=256, help="rows a query serves at most, header excluded")
    ap.add_argument("--new-tokens", type=int, default=8, help="greedy new tokens of a query")
    ap.add_argument("--open-sample", type=int, default=20, help="memories whose open and close are timed")
    ap.add_argument("--threads", type=int, default=1, help="torch threads here and in each server")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    formats = args.rows.split(",")
    counts = [int(c) for c in args.clients.split(",")]
    if not set(formats) <= set(ROW_FORMATS) or len(set(formats)) != len(formats):
        ap.error(f"give --rows as distinct formats among {', '.join(ROW_FORMATS)}")
    if min(args.memories, args.turns, args.session_turns, args.max_open, args.open_sample, args.threads) < 1:
        ap.error("give --memories, --turns, --session-turns, --max-open, --open-sample and --threads >= 1")
    if min(counts) < 1 or min(args.k, args.budget_rows, args.new_tokens, args.max_requests) < 1:
        ap.error("give client counts, --k, --budget-rows, --new-tokens and --max-requests >= 1")
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="eventkv-memory-fleet-"))
    mids = [f"fleet-{i:04d}" for i in range(args.memories)]
    speakers = {mid: dialogue(args.seed * 1_000_003 + i, 1, 1)[0] for i, mid in enumerate(mids)}
    fleets = [Fleet(f, work / f) for f in formats]
    cells: list[Cell] = []
    try:
        model = str(save_sharp_model(work / "model")) if args.model == "tiny" else args.model
        lm = load(model, dtype="float32")
        p = lm.profile
        row_bytes = p.num_layers * 2 * p.num_kv_heads * p.head_dim * getattr(torch, p.dtype).itemsize
        print(
            f"cpu: {cpu_model()} ({os.cpu_count()} cores); torch threads {args.threads} here and per server; "
            f"model {args.model} {p.dtype} ({p.num_layers} layers, {p.num_kv_heads} KV heads, head_dim {p.head_dim})"
        )
        for fleet in fleets:
            build(lm, fleet, mids, args)
        open_costs(lm, fleets, mids, args.open_sample, args.seed)
        rows = statistics.fmean(fleets[0].rows)
        print(
            f"fleet: {args.memories} memories per format, each {args.turns} dialogue turns in sessions of "
            f"{args.session_turns} (one prefilled add each), {rows:,.0f} rows on average (header included)"
        )
        ram = rows * row_bytes
        for f in fleets:
            hot, idle = statistics.fmean(f.hot), statistics.fmean(f.idle)
            print(
                f"{f.rows_format}: built in {f.build_s:.1f} s; disk {f.disk_mean:,.0f} bytes a memory "
                f"(segments {statistics.fmean(f.segments):,.0f}) = {2**30 / f.disk_mean:,.0f} memories per GiB; "
                f"RAM of an open memory's rows in use {hot:,.0f} bytes (rows {ram:,.0f} in {p.dtype}, dequantized in "
                f"every format, plus a quantized store's packed tensors) = {2**30 / hot:,.0f} memories per GiB; "
                f"released (release_rows: packed tensors only, native keeps its rows) {idle:,.0f} bytes = "
                f"{2**30 / idle:,.0f} memories per GiB; open {f.open_ms:.1f} ms (sha256; size check only "
                f"{f.open_size_ms:.1f} ms), close {f.close_ms:.1f} ms (median of {min(args.open_sample, len(mids))})"
            )
        del lm
        gc.collect()
        cells = serve_fleets(args, model, fleets, mids, speakers, counts)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"\nload: {args.memories} memories per format (a random one a request), --max-open {args.max_open}, "
        f"BM25 k {args.k} within {args.budget_rows} rows, {args.new_tokens} new tokens, {args.seconds:g} s per cell; "
        f"latencies in ms; cold: the memory was not among the {args.max_open} most recently queried"
    )
    print(
        f"{'rows':<6} {'clients':>7} {'requests':>8} {'req/s':>7} {'all p50':>8} {'all p99':>8} {'cold':>5} "
        f"{'cold p50':>8} {'cold p99':>8} {'warm':>5} {'warm p50':>8} {'warm p99':>8} {'errors':>6}"
    )
    for c in sorted(cells, key=lambda c: (formats.index(c.rows_format), c.clients)):
        print(
            f"{c.rows_format:<6} {c.clients:7d} {c.total:8d} {c.rate:7.2f} {c.ms(None, 50):8.1f} {c.ms(None, 99):8.1f} "
            f"{c.count('cold'):5d} {c.ms('cold', 50):8.1f} {c.ms('cold', 99):8.1f} {c.count('warm'):5d} "
            f"{c.ms('warm', 50):8.1f} {c.ms('warm', 99):8.1f} {c.errors:6d}"
        )
    for f in fleets:
        extra = statistics.fmean(f.get_extra)
        print(
            f"{f.rows_format}: GET /v1/memories/ID reported rows {f.rows_format} and bytes_on_disk equal to the "
            f"store's files for {len(f.get_extra)}/{args.memories} memories, {extra:,.0f} bytes more than at rest "
            "(the SQLite -shm / -wal files its read-only connection leaves)"
        )
    print(f"errors (non-2xx and failed connections): {sum(c.errors for c in cells)}")
    by = {f.rows_format: f for f in fleets}
    for other in ("int8", "int4"):
        if "native" in by and other in by:
            print(f"disk bytes per memory, native / {other}: {ratio(by['native'].disk_mean, by[other].disk_mean)}")
    if "native" in by and "int4" in by:
        print(f"open time, native / int4: {ratio(by['native'].open_ms, by['int4'].open_ms)}")
        idle = (statistics.fmean(by[f].idle) for f in ("native", "int4"))
        print(f"RAM of a released open memory's rows, native / int4: {ratio(*idle)}")
        cell = {(c.rows_format, c.clients): c for c in cells}
        for n in counts:
            native, int4 = cell[("native", n)], cell[("int4", n)]
            print(
                f"cold p50 latency at {n} clients, native / int4: {ratio(native.ms('cold', 50), int4.ms('cold', 50))}"
            )


if __name__ == "__main__":
    main()
