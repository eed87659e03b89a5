"""The memory service on Ray Serve replicas against the plain process, and 2 replicas against 1, in one run.

1. A local Ray cluster of ``--cpus`` CPUs is started in this process (on 127.0.0.1); the servers of the
   Ray arms join it with ``--ray-address``, and it is shut down at the end.
2. A store of ``--memories`` memories, each a synthetic agent history of ``--events`` events (eagerly
   prefilled), is built once with the library; every arm serves a fresh copy of it. From it, the
   sizing: a memory's KV bytes (its segment files, which an open memory holds in RAM) and how many
   such memories fit in a GiB of a replica's RAM, next to the model's weights each replica loads once.
3. Three arms, one after another, each a fresh ``eventkv serve`` (float32, ``--threads`` torch threads
   per server or replica): (a) the plain process, ``--backend process``; (b) ``--backend ray
   --replicas 1`` and (c) ``--backend ray --replicas 2``, each replica reserving ``--threads`` of the
   cluster's CPUs and keeping ``--memories-per-replica`` memories open (default: every memory, so none
   is evicted). Before the load every memory is queried twice, not counted: the first query opens it
   (on the replica the router picks), the second comes after the router has heard which replica holds
   it. The server is stopped (SIGTERM) after its arm, so its Serve application is deleted and its CPUs
   freed before the next one starts.
4. Load: ``--clients`` closed-loop clients (an asyncio httpx loop each), every request on a memory drawn
   at random, a query (BM25 top ``--k``, greedy, ``--new-tokens`` new tokens) or an add of one event
   (``--mix``), for ``--seconds`` seconds (at most ``--max-requests`` requests). Per arm: requests/s,
   p50 / p99 latency of all requests and of queries, errors (every answer that is not 2xx, 503
   included, and every connection that failed), 503s among them, and for the Ray arms the replicas
   that answered (header ``x-eventkv-replica``), how many memories each one answered and how many
   memories were answered by more than one replica (0 when none is evicted and no replica fails).

Printed first: the CPU, the torch threads and the cluster's CPUs, then the sizing line. Printed last,
each on a line of its own, ratios of this run: `throughput, 2 replicas / 1 replica: N.NNx`,
`throughput, Ray 1 replica / plain process: N.NNx` and `p50 latency, Ray 1 replica / plain process:
N.NNx` (p50 of all requests).

    python benchmarks/service_scale.py [--model tiny] [--cpus 2] [--memories 32] [--events 12]
        [--memories-per-replica 32] [--clients 16] [--mix 80,20] [--k 8] [--new-tokens 8]
        [--seconds 30] [--max-requests 5000] [--threads 1]

``--model tiny`` (the default) is the tiny random Llama with its output layer scaled by 30, saved to a
temporary model directory; any other value is handed to ``eventkv serve --model`` (e.g. smollm2-135m).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch
from service_load import Tally, event_text, question, ratio

from eventkv.memory import EventMemory
from eventkv.models import load
from eventkv.service.server import ServerProcess
from eventkv.testing import save_sharp_model

OPS = ("query", "add")
NAMESPACE = "default"


@dataclass
class Arm(Tally):
    """What one server measured. ``replicas``: 0 for the plain process. ``codes`` status 0: the
    connection failed."""

    name: str
    replicas: int
    answered_by: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))  # memory -> replica -> n

    def record(self, op: str, memory: str, status: int, replica: str | None, seconds: float) -> None:
        self.lat[op].append(seconds)
        self.codes[(op, status)] += 1
        if replica is not None:
            self.answered_by[memory][replica] += 1

    @property
    def errors(self) -> int:
        return sum(v for (_, c), v in self.codes.items() if not 200 <= c < 300)

    def held(self) -> Counter:
        """Replica -> memories it answered for (warm-up included)."""
        return Counter(r for by in self.answered_by.values() for r in by)

    @property
    def moved(self) -> int:
        """Memories answered by more than one replica (warm-up included)."""
        return sum(len(by) > 1 for by in self.answered_by.values())


def cpu_model() -> str:
    """The CPU's name from ``/proc/cpuinfo`` (its first ``model name``), or what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"


def start_cluster(cpus: int):
    """``ray.init`` of a local cluster of ``cpus`` CPUs on 127.0.0.1 (nothing else joins it); the module."""
    import ray

    # Ray waits a fixed 30 s for its raylet to register at start-up, which a loaded machine can miss:
    # a failed start is shut down and tried again, up to three times
    for attempt in range(3):
        try:
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
            break
        except Exception as exc:  # Ray raises a bare Exception for this time-out
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
    return ray


def stop_cluster(ray) -> None:
    """Remove the Serve instance the servers started (its controller outlives them), then stop Ray."""
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def build_store(lm, root: Path, mids: list[str], events: int, seed: int) -> tuple[int, int]:
    """``len(mids)`` memories under ``root/default``, each ``events`` synthetic events, prefilled.
    Returns the mean rows and the mean bytes of the KV segment files of a memory."""
    rows, kv_bytes = [], []
    for i, mid in enumerate(mids):
        rng = random.Random(seed * 1000 + i)
        d = root / NAMESPACE / mid
        with EventMemory.create(d, lm, namespace=NAMESPACE) as mem:
            mem.add([event_text(rng, j) for j in range(events)], prefill=True)
            rows.append(mem.stats().rows)
        kv_bytes.append(sum(f.stat().st_size for f in (d / "segments").glob("*.safetensors")))
    return round(sum(rows) / len(rows)), round(sum(kv_bytes) / len(kv_bytes))


async def load_phase(url: str, mids: list[str], arm: Arm, args, replica_header: str) -> None:
    """``args.clients`` loops of query / add (``args.mix``), each request on a memory drawn at random,
    until the time or the count is up; fills ``arm``."""
    n = 0
    deadline = time.perf_counter() + args.seconds

    async def one(client_no: int) -> None:
        nonlocal n
        rng = random.Random(args.seed * 100 + client_no)
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            while time.perf_counter() < deadline and n < args.max_requests:
                n += 1
                mid = rng.choice(mids)
                op = rng.choices(OPS, args.mix)[0]
                if op == "query":
                    path = f"/v1/memories/{mid}/query"
                    body = {"question": question(rng), "k": args.k, "max_new_tokens": args.new_tokens}
                else:
                    path, body = f"/v1/memories/{mid}/events", {"events": [{"text": event_text(rng, 1000 + n)}]}
                t0 = time.perf_counter()
                try:
                    r = await http.post(path, json=body)
                except httpx.TransportError:
                    arm.record(op, mid, 0, None, time.perf_counter() - t0)
                    continue
                arm.record(op, mid, r.status_code, r.headers.get(replica_header), time.perf_counter() - t0)
                if r.status_code == 503:
                    await asyncio.sleep(float(r.headers.get("retry-after", "1")))

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(args.clients)))
    arm.wall = time.perf_counter() - t0


def run_arm(args, model: str, pristine: Path, work: Path, mids: list[str], arm: Arm, flags: list[str]) -> None:
    """One fresh server (``flags`` after the common ones) on a fresh copy of the store: warm-up, load,
    SIGTERM; fills ``arm``.

    Raises:
        RuntimeError: the server did not stop cleanly (its last output in the message).
    """
    from eventkv.service.cluster.replica import REPLICA_HEADER

    store = work / f"arm-{arm.replicas}"
    shutil.copytree(pristine, store)
    common = ("--dtype", "float32", "--threads", str(args.threads), "--log-level", "info")
    srv = ServerProcess(model, store, *common, *flags, timeout=600)
    try:
        with httpx.Client(base_url=srv.url, timeout=600) as http:
            for _ in range(2):  # warm-up, not timed: opens each memory, then finds it where it was opened
                for mid in mids:
                    body = {"question": "Who handles the demo?", "k": args.k, "max_new_tokens": 1}
                    r = http.post(f"/v1/memories/{mid}/query", json=body)
                    r.raise_for_status()
                    if REPLICA_HEADER in r.headers:
                        arm.answered_by[mid][r.headers[REPLICA_HEADER]] += 1
        asyncio.run(load_phase(srv.url, mids, arm, args, REPLICA_HEADER))
        code = srv.stop(timeout=180)
        if code != 0:
            raise RuntimeError(f"{arm.name}: the server exited with {code} on SIGTERM:\n" + "".join(srv.lines[-30:]))
    except BaseException:
        print("".join(srv.lines[-30:]), file=sys.stderr)
        raise
    finally:
        srv.kill()
        shutil.rmtree(store, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny: the sharpened tiny random Llama; else eventkv's --model")
    ap.add_argument("--cpus", type=int, default=2, help="CPUs of the local Ray cluster started here")
    ap.add_argument("--memories", type=int, default=32, help="memories in the store")
    ap.add_argument("--events", type=int, default=12, help="events of each memory")
    ap.add_argument(
        "--memories-per-replica", type=int, default=None, help="memories kept open per replica (default: --memories)"
    )
    ap.add_argument("--clients", type=int, default=16, help="closed-loop clients")
    ap.add_argument("--mix", default="80,20", help="weights of query, add")
    ap.add_argument("--k", type=int, default=8, help="events a query serves at most (BM25 top-k)")
    ap.add_argument("--new-tokens", type=int, default=8, help="greedy new tokens of a query")
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds of load per arm")
    ap.add_argument("--max-requests", type=int, default=5000, help="requests per arm at most")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (and Ray CPUs) per server or replica")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.mix = [float(w) for w in args.mix.split(",")]
    per_replica = args.memories if args.memories_per_replica is None else args.memories_per_replica
    if len(args.mix) != 2 or min(args.mix) < 0 or sum(args.mix) <= 0:
        ap.error("give --mix as two weights >= 0 (query, add), not both 0")
    if min(args.memories, args.events, args.clients, args.threads, args.max_requests, per_replica) < 1:
        ap.error("give --memories, --events, --clients, --threads, --max-requests, --memories-per-replica >= 1")
    if 2 * args.threads > args.cpus:
        ap.error(f"2 replicas of --threads {args.threads} need --cpus {2 * args.threads} at least")
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="eventkv-service-scale-"))
    ray = None
    arms: list[Arm] = []
    try:
        model = str(save_sharp_model(work / "model")) if args.model == "tiny" else args.model
        lm = load(model, dtype="float32")
        weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
        pristine = work / "pristine"
        mids = [f"scale-{i}" for i in range(args.memories)]
        rows, kv = build_store(lm, pristine, mids, args.events, args.seed)
        del lm
        print(
            f"cpu: {cpu_model()} ({os.cpu_count()} cores); torch threads {args.threads} per server and per replica; "
            f"Ray cluster {args.cpus} CPUs; model {args.model} float32"
        )
        print(
            f"sizing: KV {kv:,} bytes a memory ({args.events} events, {rows} rows; its segment files, held in RAM "
            f"while open) = {2**30 / kv:,.0f} memories per GiB of replica RAM, on top of the model's weights "
            f"({weights / 2**20:,.1f} MiB) that every replica loads"
        )
        ray = start_cluster(args.cpus)
        address = ray.get_runtime_context().gcs_address
        plans = [
            (Arm("process", 0), ["--backend", "process"]),
            *(
                (
                    Arm(f"ray {n} replica{'s' if n > 1 else ''}", n),
                    ["--backend", "ray", "--ray-address", address, "--replicas", str(n)]
                    + ["--memories-per-replica", str(per_replica)],
                )
                for n in (1, 2)
            ),
        ]
        for arm, flags in plans:
            run_arm(args, model, pristine, work, mids, arm, flags)
            arms.append(arm)
    finally:
        if ray is not None:
            stop_cluster(ray)
        shutil.rmtree(work, ignore_errors=True)

    mix = " / ".join(f"{op} {w:g}" for op, w in zip(OPS, args.mix))
    print(
        f"\nload: {args.clients} clients, {args.memories} memories (a random one a request), mix {mix}, k {args.k}, "
        f"{args.new_tokens} new tokens, {args.seconds:g} s per arm; {per_replica} memories kept open per replica"
    )
    print(
        f"{'arm':<15} {'requests':>8} {'req/s':>7} {'all p50':>8} {'all p99':>8} {'query p50':>9} {'query p99':>9} "
        f"{'errors':>6} {'503s':>5}"
    )
    for a in arms:
        print(
            f"{a.name:<15} {a.total:8d} {a.rate:7.2f} {a.ms(None, 50):8.1f} {a.ms(None, 99):8.1f} "
            f"{a.ms('query', 50):9.1f} {a.ms('query', 99):9.1f} {a.errors:6d} {a.busy:5d}"
        )
    for a in arms:
        if a.replicas:
            held = a.held()
            print(
                f"{a.name}: replicas that answered {len(held)}; memories per replica "
                f"{' / '.join(str(n) for _, n in held.most_common())}; "
                f"memories answered by more than one replica: {a.moved}"
            )
    proc, one, two = arms
    print(f"throughput, 2 replicas / 1 replica: {ratio(two.rate, one.rate)}")
    print(f"throughput, Ray 1 replica / plain process: {ratio(one.rate, proc.rate)}")
    print(f"p50 latency, Ray 1 replica / plain process: {ratio(one.ms(None, 50), proc.ms(None, 50))}")


if __name__ == "__main__":
    main()
