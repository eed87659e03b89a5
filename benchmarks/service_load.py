"""The memory service under load over loopback, batching on vs off, measured in one run.

1. A memory with a synthetic agent history (default 40 events, ~2,400 tokens, eagerly prefilled)
   is built with the library; every server below serves fresh copies of its store, and the library
   opens another copy, so all answer from identical stores.
2. HTTP overhead: the same queries (BM25 top-k, greedy, ``--new-tokens``) alternately through HTTP
   (:class:`eventkv.client.Client`) and through the library in this process, with the same
   torch threads; the server idles while the library runs and the other way round.
3. Costs, in the library on a copy of the store: a query's preparation (BM25, served cache, question
   ids) and its readout alone and in batches of 2, 4 and ``--max-batch``; an add's and an update's
   commit and the lazy prefill the memory's next query pays for it; and the lazy prefill of b
   memories (b = 2, 4, ``--max-batch``; copies of the store, each with one pending add, as the mix's
   writes leave them) done together in one batched forward (:func:`eventkv.memory.prefill_many`, as
   the server does for the memories of one query batch) against the same prefills one at a time.
   From them, the most batching can raise throughput on ``--mix`` and on queries alone (Amdahl's
   law: the writes and every query's preparation stay serial; only the readouts share a batch), and
   on ``--mix`` once more with the lazy prefills of a batch's memories (at most ``--memories`` of
   them) sharing one forward too, each write's lazy prefill scaled by the measured ratio together /
   one at a time.
4. Load, for each client count (default 1, 4, 8, 16) and each of ``--max-batch 1`` (one query at a
   time) and ``--max-batch N`` (queued queries answered in one batched readout): a fresh server on
   fresh copies of the store, ``--memories`` memories shared round-robin by the clients (1: every
   client on one memory), each client an asyncio httpx loop of queries, adds and updates (``--mix``)
   for ``--seconds`` seconds (at most ``--max-requests`` requests). Per cell: requests/s, p50 / p99
   latency of queries and of all requests, errors, deliberate 503s, acknowledged adds lost (each is
   looked up afterwards), and the mean batch the server read out (``eventkv_query_batch_size``).
   Both modes of a client count run back to back, so they see the same machine.

Printed last: each client count's ratios batched / unbatched (requests/s, query p50, query p99),
the ratio at 8 clients on a line of its own, the bounds of step 3 (``most batching can give on the
mix, lazy prefills batched too`` the one that counts the batched lazy prefills) next to the mean
batch each client count reached (closed-loop clients keep only so many queries queued at once), and
`HTTP overhead (median query latency, HTTP / library): N.NNx`.

    python benchmarks/service_load.py [--model smollm2-135m] [--clients 1,4,8,16] [--max-batch 8]
        [--seconds 30] [--memories 8] [--mix 60,25,15] [--events 40] [--queries 20] [--k 8]
        [--new-tokens 8] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import shutil
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import torch

from eventkv.client import Client
from eventkv.memory import EventMemory
from eventkv.models import load
from eventkv.service.server import ServerProcess

PEOPLE = ("Dana", "Ravi", "Mei", "Tomas", "Aiko", "Lena", "Omar", "Priya", "Jon", "Sofia")
PLACES = ("Lisbon", "Oslo", "Kyoto", "Austin", "Nairobi", "Porto", "Quito", "Tallinn", "Hanoi", "Perth")
THINGS = ("the quarterly report", "the grant proposal", "the team offsite", "the server migration", "the demo")
OPS = ("query", "add", "update")


def event_text(rng: random.Random, i: int) -> str:
    p, q = rng.sample(PEOPLE, 2)
    return (
        f"[turn {i}] {p} told the assistant that {q} will handle {rng.choice(THINGS)} from {rng.choice(PLACES)}; "
        f"the review is at {rng.randrange(8, 18)}:{rng.choice(('00', '15', '30', '45'))}, "
        f"ticket {rng.randrange(1000, 9999)}."
    )


def question(rng: random.Random) -> str:
    return f"Who handles what {rng.choice(PEOPLE)} mentioned, and from where?"


def percentile(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 and a == a and b == b else "n/a"


@dataclass(kw_only=True)
class Tally:
    """Requests of one load run: latencies by operation, statuses, wall time."""

    wall: float = 0.0
    lat: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))  # seconds, by op
    codes: Counter = field(default_factory=Counter)  # (op, status) -> count

    @property
    def total(self) -> int:
        return sum(self.codes.values())

    @property
    def rate(self) -> float:
        return self.total / self.wall if self.wall else float("nan")

    def ms(self, op: str | None, q: float) -> float:
        """The ``q``-th percentile latency of ``op`` (None: every request), in ms."""
        xs = [x for v in self.lat.values() for x in v] if op is None else self.lat[op]
        return percentile([1e3 * x for x in xs], q)

    @property
    def busy(self) -> int:
        return sum(v for (_, c), v in self.codes.items() if c == 503)


@dataclass
class Cell(Tally):
    """What one (client count, max batch) run measured."""

    clients: int
    max_batch: int
    lost: int = 0
    acked: int = 0
    mean_batch: float = float("nan")

    @property
    def errors(self) -> int:
        return sum(v for (_, c), v in self.codes.items() if not 200 <= c < 300 and c != 503)


async def load_phase(url, mids, cell: Cell, args, event_ids) -> list[tuple[str, str]]:
    """``cell.clients`` loops of query / add / update (``args.mix``) until the time or count is up;
    client ``i`` works on memory ``mids[i % len(mids)]``. Returns the acknowledged adds (memory, id)."""
    acked: list[tuple[str, str]] = []
    n = 0
    deadline = time.perf_counter() + args.seconds

    async def one(client_no: int):
        nonlocal n
        rng = random.Random(args.seed * 100 + client_no)
        mid = mids[client_no % len(mids)]
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            while time.perf_counter() < deadline and n < args.max_requests:
                n += 1
                op = rng.choices(OPS, args.mix)[0]
                if op == "query":
                    path, body = (
                        f"/v1/memories/{mid}/query",
                        {"question": question(rng), "k": args.k, "max_new_tokens": args.new_tokens},
                    )
                elif op == "add":
                    path, body = f"/v1/memories/{mid}/events", {"events": [{"text": f"client {client_no} note {n}."}]}
                else:
                    eid = rng.choice(event_ids)
                    path, body = (
                        f"/v1/memories/{mid}/events/{eid}/update",
                        {"text": f"update {n} by client {client_no}."},
                    )
                t0 = time.perf_counter()
                r = await http.post(path, json=body)
                cell.lat[op].append(time.perf_counter() - t0)
                cell.codes[(op, r.status_code)] += 1
                if op == "add" and r.status_code == 201:
                    acked.extend((mid, a["id"]) for a in r.json()["added"])
                if r.status_code == 503:
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(cell.clients)))
    cell.wall = time.perf_counter() - t0
    return acked


def batch_totals(metrics: str) -> tuple[float, float]:
    """``(sum, count)`` of the server's ``eventkv_query_batch_size`` histogram (queries per batched readout)."""
    got = dict(re.findall(r"^eventkv_query_batch_size_(sum|count) ([\d.e+-]+)$", metrics, re.M))
    return float(got.get("sum", 0)), float(got.get("count", 0))


def run_cell(args, pristine: Path, work: Path, mids: list[str], event_ids: list[str], cell: Cell) -> None:
    """One fresh server (``--max-batch cell.max_batch``) on fresh copies of the store, loaded by
    ``cell.clients`` clients; fills ``cell``."""
    store = work / f"cell-{cell.clients}-{cell.max_batch}"
    shutil.copytree(pristine, store)
    srv = ServerProcess(
        args.model,
        store,
        *("--dtype", "float32", "--threads", str(args.threads), "--log-level", "info"),
        *("--max-batch", str(cell.max_batch)),
        timeout=600,
    )
    try:
        with httpx.Client(base_url=srv.url, timeout=600) as http:
            for mid in mids:  # warm-up, not counted: each memory opened and its selector's index built
                body = {"question": "Who handles the demo?", "k": args.k, "max_new_tokens": 1}
                http.post(f"/v1/memories/{mid}/query", json=body).raise_for_status()
            s0, n0 = batch_totals(http.get("/metrics").text)  # the warm-up's batches
            acked = asyncio.run(load_phase(srv.url, mids, cell, args, event_ids))
            s1, n1 = batch_totals(http.get("/metrics").text)
            listed = {
                mid: {e["id"] for e in http.get(f"/v1/memories/{mid}/events?include_superseded=true").json()}
                for mid in mids
            }
        cell.mean_batch = (s1 - s0) / (n1 - n0) if n1 > n0 else float("nan")
        cell.acked, cell.lost = len(acked), sum(eid not in listed[mid] for mid, eid in acked)
        assert srv.stop() == 0
    finally:
        srv.kill()
        shutil.rmtree(store, ignore_errors=True)


def readout_sizes(max_batch: int) -> list[int]:
    """The batch sizes whose readout the costs phase times."""
    return sorted({1, 2, 4, max_batch})


def batch_costs(args, lm, store: Path, questions: list[str], event_ids: list[str]) -> dict[str, float]:
    """In the library, on a copy of the store: what one query costs before its readout (``prepare``:
    BM25, the served cache, the question's ids), its readout alone and in batches of 2, 4 and
    ``--max-batch``, and what an add and an update cost, the commit and the lazy prefill that the
    memory's next query pays for it. Medians, milliseconds."""
    from eventkv.memory import MemoryQuery, QueryOptions, answer_prepared

    def query(question: str) -> MemoryQuery:
        return MemoryQuery(question, options=QueryOptions(k=args.k), max_new_tokens=args.new_tokens)

    out: dict[str, list[float]] = defaultdict(list)
    with EventMemory.open(store, lm) as mem:

        def prepared(qs):
            ps = []
            for q in qs:
                t0 = time.perf_counter()
                ps.append(mem.prepare_query(query(q)))
                out["prepare"].append(1e3 * (time.perf_counter() - t0))
            return ps

        answer_prepared(lm, prepared(questions[:2]))  # warm-up, not counted
        out.clear()
        for _ in range(args.repeats):
            for b in readout_sizes(args.max_batch):
                ps = prepared(questions[:b])
                t0 = time.perf_counter()
                answer_prepared(lm, ps)
                out[f"readout {b}"].append(1e3 * (time.perf_counter() - t0))
        prepare_ms = statistics.median(out["prepare"])  # a query's cost with no write pending
        for i in range(args.repeats):
            for op in ("add", "update"):
                t0 = time.perf_counter()
                if op == "add":
                    mem.add([f"client 0 note {i}."])
                else:
                    mem.update(event_ids[i % len(event_ids)], f"update {i} by client 0.")
                out[op].append(1e3 * (time.perf_counter() - t0))
                t0 = time.perf_counter()
                mem.prepare_query(query(questions[0]))
                out[f"{op} lazy prefill"].append(1e3 * (time.perf_counter() - t0) - prepare_ms)
    return {key: statistics.median(xs) for key, xs in out.items()}


def prefill_costs(args, lm, source: Path, work: Path) -> dict[str, float]:
    """In the library, on ``--max-batch`` copies of the memory ``source`` (equal memories): the lazy prefill of
    ``b`` of them, each with one pending add (as the mix's writes leave a memory), done together in one batched
    forward (:func:`eventkv.memory.prefill_many`, as the server does for a query batch's memories) and the same
    prefills one at a time (:meth:`EventMemory.prefill` each), for each batch size of :func:`readout_sizes` from 2
    up. Each repeat adds one event to every memory before each arm and alternates which arm runs first (the
    histories grow by a few positions a round, the same in both arms). Medians, milliseconds: keys
    ``"prefill together {b}"`` and ``"prefill one at a time {b}"``."""
    from contextlib import ExitStack

    from eventkv.memory import prefill_many

    sizes = readout_sizes(args.max_batch)[1:]
    out: dict[str, list[float]] = defaultdict(list)
    n = 0

    def arm(mems: list[EventMemory], together: bool) -> float:
        nonlocal n
        n += 1
        for mem in mems:
            mem.add([f"client 0 note {n}."])
        assert all(mem.pending for mem in mems)
        t0 = time.perf_counter()
        if together:
            prefill_many(mems)
        else:
            for mem in mems:
                mem.prefill()
        ms = 1e3 * (time.perf_counter() - t0)
        assert not any(mem.pending for mem in mems)
        return ms

    with ExitStack() as stack:
        mems = []
        for i in range(max(sizes)):
            shutil.copytree(source, work / f"m{i}")
            mems.append(stack.enter_context(EventMemory.open(work / f"m{i}", lm)))
        arm(mems[:2], True)  # warm-up, not counted
        arm(mems[:2], False)
        for r in range(args.repeats):
            for b in sizes:
                for together in (True, False) if r % 2 == 0 else (False, True):
                    key = f"prefill {'together' if together else 'one at a time'} {b}"
                    out[key].append(arm(mems[:b], together))
    return {key: statistics.median(xs) for key, xs in out.items()}


def prefill_ratio(costs: dict[str, float], b: int, memories: int) -> float:
    """Lazy prefill together / one at a time for a batch of ``b`` queries on ``memories`` memories: at the largest
    measured size no larger than ``min(b, memories)`` (a batch holds at most that many memories); 1 below 2."""
    sizes = [s for s in range(2, min(b, memories) + 1) if f"prefill together {s}" in costs]
    if not sizes:
        return 1.0
    s = max(sizes)
    return costs[f"prefill together {s}"] / costs[f"prefill one at a time {s}"]


def bound(costs: dict[str, float], mix: list[float], b: int, lazy: float = 1.0) -> float:
    """The most that batching ``b`` queries at a time can raise throughput on this mix: the work per
    request with every query's readout shared by ``b`` queries, against one at a time (Amdahl's law
    over the measured costs; the writes and each query's preparation stay serial). ``lazy``: what the
    writes' lazy prefills cost batched, as a share of their cost one at a time (1: they stay serial;
    :func:`prefill_ratio`: the lazy prefills of a batch's memories share one forward)."""
    q, a, u = (w / sum(mix) for w in mix)
    commits = a * costs["add"] + u * costs["update"]
    prefills = a * costs["add lazy prefill"] + u * costs["update lazy prefill"]
    one = q * (costs["prepare"] + costs["readout 1"]) + commits + prefills
    batched = q * (costs["prepare"] + costs[f"readout {b}"] / b) + commits + lazy * prefills
    return one / batched


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", default="1,4,8,16", help="client counts, comma-separated")
    ap.add_argument("--max-batch", type=int, default=8, help="the batched servers' --max-batch (the others: 1)")
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds of load per client count and mode")
    ap.add_argument("--max-requests", type=int, default=5000, help="requests per client count and mode at most")
    ap.add_argument("--memories", type=int, default=8, help="memories the clients share round-robin (1: one)")
    ap.add_argument("--mix", default="60,25,15", help="weights of query, add, update")
    ap.add_argument("--events", type=int, default=40)
    ap.add_argument("--queries", type=int, default=20, help="queries of the HTTP overhead phase (0: skip it)")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="repeats of each measured cost (0: skip that phase)")
    args = ap.parse_args()
    counts = [int(c) for c in args.clients.split(",")]
    args.mix = [float(w) for w in args.mix.split(",")]
    if len(args.mix) != 3 or min(counts) < 1 or args.memories < 1 or args.max_batch < 2:
        ap.error("give --mix as three weights, client counts >= 1, --memories >= 1 and --max-batch >= 2")
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    lm = load(args.model, dtype="float32")
    work = Path(tempfile.mkdtemp(prefix="eventkv-service-load-"))
    pristine, local = work / "pristine", work / "local"
    mids = [f"load-{i}" for i in range(args.memories)]
    with EventMemory.create(pristine / "default" / mids[0], lm, namespace="default") as mem:
        ids = [a.id for a in mem.add([event_text(rng, i) for i in range(args.events)], prefill=True)]
        history = mem.stats().history_end
    for mid in mids[1:]:
        shutil.copytree(pristine / "default" / mids[0], pristine / "default" / mid)
    shutil.copytree(pristine, local)
    print(f"model {args.model} float32, {args.threads} threads; history {args.events} events, {history} positions")
    cells: list[Cell] = []
    http_ms, lib_ms = [], []
    try:
        if args.queries:
            store = work / "overhead"
            shutil.copytree(pristine, store)
            srv = ServerProcess(
                args.model,
                store,
                "--dtype",
                "float32",
                "--threads",
                str(args.threads),
                "--log-level",
                "info",
                timeout=600,
            )
            try:
                questions = [question(rng) for _ in range(args.queries)]
                with Client(srv.url, mids[0]) as remote, EventMemory.open(local / "default" / mids[0], lm) as lib:
                    for q in questions[:2]:  # warm-up, not counted
                        remote.query(q, k=args.k, max_new_tokens=args.new_tokens)
                        lib.query(q, k=args.k, max_new_tokens=args.new_tokens)
                    for q in questions:
                        t0 = time.perf_counter()
                        a = remote.query(q, k=args.k, max_new_tokens=args.new_tokens)
                        http_ms.append(1e3 * (time.perf_counter() - t0))
                        t0 = time.perf_counter()
                        b = lib.query(q, k=args.k, max_new_tokens=args.new_tokens)
                        lib_ms.append(1e3 * (time.perf_counter() - t0))
                        assert a.generation.tokens == b.generation.tokens, (q, a.text, b.text)
                assert srv.stop() == 0
            finally:
                srv.kill()
            print(
                f"query latency over {len(questions)} queries (median ms): HTTP {statistics.median(http_ms):.1f}, "
                f"library {statistics.median(lib_ms):.1f}; same answers in {len(questions)}/{len(questions)}"
            )
        costs: dict[str, float] = {}
        if args.repeats:
            shutil.copytree(pristine, work / "costs")
            costs = batch_costs(
                args, lm, work / "costs" / "default" / mids[0], [question(rng) for _ in range(args.max_batch)], ids
            )
            per = ", ".join(
                f"{b}: {costs[f'readout {b}']:.0f} ({costs[f'readout {b}'] / b:.0f} a query)"
                for b in readout_sizes(args.max_batch)
            )
            print(
                f"a query's costs (library, median ms): prepare {costs['prepare']:.0f} "
                f"(BM25, served cache, question ids); "
                f"readout at batch {per}; add {costs['add']:.0f} + its lazy prefill {costs['add lazy prefill']:.0f}; "
                f"update {costs['update']:.0f} + its lazy prefill {costs['update lazy prefill']:.0f}"
            )
            costs |= prefill_costs(args, lm, pristine / "default" / mids[0], work / "prefill")
            for b in readout_sizes(args.max_batch)[1:]:
                together, alone = costs[f"prefill together {b}"], costs[f"prefill one at a time {b}"]
                print(
                    f"lazy prefill of {b} memories, together / one at a time: {ratio(together, alone)} "
                    f"({together:.0f} / {alone:.0f} ms, one pending add each)"
                )
        for n in counts:
            for mb in (1, args.max_batch):
                cell = Cell(n, mb)
                run_cell(args, pristine, work, mids, ids, cell)
                cells.append(cell)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    mix = " / ".join(f"{op} {w:g}" for op, w in zip(OPS, args.mix))
    print(
        f"\nload: {args.memories} memories, mix {mix}, k {args.k}, {args.new_tokens} new tokens, "
        f"{args.seconds:g} s per cell"
    )
    head = (
        f"{'clients':>7} {'max-batch':>9} {'requests':>8} {'req/s':>7} {'query p50':>9} {'query p99':>9} "
        f"{'all p50':>8} {'all p99':>8} {'errors':>6} {'503s':>5} {'acked':>5} {'lost':>4} {'mean batch':>10}"
    )
    print(head)
    for c in cells:
        print(
            f"{c.clients:7d} {c.max_batch:9d} {c.total:8d} {c.rate:7.2f} {c.ms('query', 50):9.1f} "
            f"{c.ms('query', 99):9.1f} {c.ms(None, 50):8.1f} {c.ms(None, 99):8.1f} {c.errors:6d} {c.busy:5d} "
            f"{c.acked:5d} {c.lost:4d} {c.mean_batch:10.2f}"
        )
    print(f"\nbatched / unbatched (--max-batch {args.max_batch} / 1), latencies in ms:")
    by = {(c.clients, c.max_batch): c for c in cells}
    for n in counts:
        b, u = by[(n, args.max_batch)], by[(n, 1)]
        print(
            f"{n} clients: requests/s {ratio(b.rate, u.rate)} ({b.rate:.2f} / {u.rate:.2f}), "
            f"query p50 {ratio(b.ms('query', 50), u.ms('query', 50))}, "
            f"query p99 {ratio(b.ms('query', 99), u.ms('query', 99))}"
        )
    if 8 in counts:
        b, u = by[(8, args.max_batch)], by[(8, 1)]
        print(f"throughput at 8 clients, batched / unbatched: {ratio(b.rate, u.rate)}")
    if costs:
        for name, mix in (("this mix", args.mix), ("queries only", [1.0, 0.0, 0.0])):
            bounds = ", ".join(f"batch {b} {bound(costs, mix, b):.2f}x" for b in readout_sizes(args.max_batch)[1:])
            print(f"most that batching can give ({name}; writes and each query's prepare stay serial): {bounds}")
        bounds = ", ".join(
            f"batch {b} {bound(costs, args.mix, b, prefill_ratio(costs, b, args.memories)):.2f}x"
            for b in readout_sizes(args.max_batch)[1:]
        )
        print(
            f"most batching can give on the mix, lazy prefills batched too (a batch's memories, at most "
            f"{args.memories}, prefilled in one forward; commits and each query's prepare stay serial): {bounds}"
        )
        means = ", ".join(f"{c.clients} clients {c.mean_batch:.2f}" for c in cells if c.max_batch > 1)
        print(f"mean batch reached: {means}")
    errors = sum(c.errors for c in cells)
    lost = sum(c.lost for c in cells)
    print(f"errors (non-2xx other than 503): {errors}; acknowledged adds lost: {lost}")
    if http_ms:
        overhead = statistics.median(http_ms) / statistics.median(lib_ms)
        print(f"HTTP overhead (median query latency, HTTP / library): {overhead:.3f}x")


if __name__ == "__main__":
    main()
