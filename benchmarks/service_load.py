"""The memory service under load over loopback, measured in one run.

1. A memory with a synthetic agent history (default 40 events, ~2,400 tokens, eagerly prefilled)
   is built with the library, and its store is copied: the server serves one copy, the library
   opens the other, so both answer from identical stores.
2. HTTP overhead: the same queries (BM25 top-k, greedy, ``--new-tokens``) alternately through HTTP
   (:class:`eventkv.client.Client`) and through the library in this process, with the same
   torch threads; the server idles while the library runs and the other way round.
3. Load: ``--clients`` asyncio httpx clients for ``--seconds`` seconds (and at most ``--max-requests``
   requests), each looping over a mix of queries, adds and updates on the served memory; per route
   requests, p50 / p99 latency and status codes. Then every acknowledged add (2xx) is looked up.

Printed last: requests/s, errors (non-2xx other than 503), deliberate 503s, acknowledged writes
lost, and `HTTP overhead (median query latency, HTTP / library): N.NNx`.

    python benchmarks/service_load.py [--model smollm2-135m] [--clients 8] [--seconds 60]
        [--events 40] [--queries 20] [--k 8] [--new-tokens 8] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter, defaultdict
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


async def load_phase(url, mid, clients, seconds, max_requests, k, new_tokens, seed, event_ids):
    """``clients`` loops of query (60%) / add (25%) / update (15%) until the time or count is up."""
    lat = defaultdict(list)
    codes = Counter()
    acked: list[str] = []
    n = 0
    deadline = time.perf_counter() + seconds

    async def one(client_no: int):
        nonlocal n
        rng = random.Random(seed * 100 + client_no)
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            while time.perf_counter() < deadline and n < max_requests:
                n += 1
                op = rng.choices(("query", "add", "update"), (60, 25, 15))[0]
                if op == "query":
                    path, body = (
                        f"/v1/memories/{mid}/query",
                        {"question": question(rng), "k": k, "max_new_tokens": new_tokens},
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
                lat[op].append(time.perf_counter() - t0)
                codes[(op, r.status_code)] += 1
                if op == "add" and r.status_code == 201:
                    acked.extend(a["id"] for a in r.json()["added"])
                if r.status_code == 503:
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(clients)))
    return lat, codes, acked, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--max-requests", type=int, default=5000)
    ap.add_argument("--events", type=int, default=40)
    ap.add_argument("--queries", type=int, default=20)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(args.seed)
    lm = load(args.model, dtype="float32")
    work = Path(tempfile.mkdtemp(prefix="eventkv-service-load-"))
    served, local = work / "served", work / "local"
    with EventMemory.create(served / "default" / "load", lm, namespace="default") as mem:
        ids = [a.id for a in mem.add([event_text(rng, i) for i in range(args.events)], prefill=True)]
        history = mem.stats().history_end
    shutil.copytree(served, local)
    print(f"model {args.model} float32, {args.threads} threads; history {args.events} events, {history} positions")
    srv = ServerProcess(args.model, served, "--dtype", "float32", "--threads", str(args.threads), "--log-level", "info")
    try:
        questions = [question(rng) for _ in range(args.queries)]
        http_ms, lib_ms = [], []
        with Client(srv.url, "load") as remote, EventMemory.open(local / "default" / "load", lm) as lib:
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
        print(
            f"query latency over {len(questions)} queries (median ms): HTTP {statistics.median(http_ms):.1f}, "
            f"library {statistics.median(lib_ms):.1f}; same answers in {len(questions)}/{len(questions)}"
        )
        lat, codes, acked, wall = asyncio.run(
            load_phase(
                srv.url, "load", args.clients, args.seconds, args.max_requests, args.k, args.new_tokens, args.seed, ids
            )
        )
        with Client(srv.url, "load") as remote:
            listed = {r.id for r in remote.list(include_superseded=True)}
        lost = [i for i in acked if i not in listed]
        assert srv.stop() == 0
    finally:
        srv.kill()
        shutil.rmtree(work, ignore_errors=True)
    total = sum(codes.values())
    print(f"\nload: {args.clients} clients, {wall:.1f} s, {total} requests")
    print(f"{'route':8} {'n':>5} {'p50 ms':>8} {'p99 ms':>8}  status codes")
    for op in ("query", "add", "update"):
        xs = [1e3 * x for x in lat[op]]
        status = ", ".join(f"{c}: {v}" for (o, c), v in sorted(codes.items()) if o == op)
        print(f"{op:8} {len(xs):5d} {percentile(xs, 50):8.1f} {percentile(xs, 99):8.1f}  {status}")
    errors = sum(v for (o, c), v in codes.items() if not 200 <= c < 300 and c != 503)
    busy = sum(v for (o, c), v in codes.items() if c == 503)
    print(f"\nrequests/s: {total / wall:.2f}")
    print(f"errors (non-2xx other than 503): {errors}; deliberate 503s: {busy}")
    print(f"acknowledged adds: {len(acked)}, lost: {len(lost)}")
    ratio = statistics.median(http_ms) / statistics.median(lib_ms)
    print(f"HTTP overhead (median query latency, HTTP / library): {ratio:.3f}x")


if __name__ == "__main__":
    main()
