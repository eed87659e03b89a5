"""What a tool call of ``eventkv mcp`` costs over stdio, against the same verb in the library, in one run.

1. The library, in this process: ``--events`` synthetic agent turns (as ``service_load.py``'s) added
   one at a time (lazy: no prefill), one warm-up query (it prefills the history), then ``--calls``
   searches (BM25, ``--k``) and ``--calls`` queries (greedy, ``--new-tokens``).
2. The same sequence through ``eventkv mcp --store`` over stdio with the MCP SDK's client
   (``add_memory``, ``query_memory``, ``search_memory``) on a fresh store of the same model, dtype and
   torch threads; this process idles meanwhile.

Printed: the median and p90 latency (ms) of each verb on both paths, the MCP / library ratio of the
medians, and how many query answers are equal (greedy tokens).

    python benchmarks/mcp_latency.py [--model smollm2-135m] [--events 40] [--calls 20] [--k 4]
        [--new-tokens 8] [--threads 2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np
import torch
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client
from service_load import event_text, question

from eventkv.memory import EventMemory
from eventkv.models import load

START = "from eventkv.cli import main; import sys; sys.argv[0] = 'eventkv'; main()"


def stats(xs: list[float]) -> str:
    return f"median {statistics.median(xs):8.1f} ms, p90 {float(np.percentile(xs, 90)):8.1f} ms"


def workload(seed: int, events: int, calls: int) -> tuple[list[str], list[str]]:
    rng = random.Random(seed)
    return [event_text(rng, i) for i in range(events)], [question(rng) for _ in range(calls)]


def library(args, root: Path, texts: list[str], questions: list[str]) -> tuple[dict, list]:
    lm = load(args.model, dtype=args.dtype)
    times: dict[str, list[float]] = {"add": [], "search": [], "query": []}
    answers = []
    with EventMemory.create(root / "default" / "default", lm, namespace="default") as mem:
        for t in texts:
            t0 = time.perf_counter()
            mem.add([t])
            times["add"].append(1e3 * (time.perf_counter() - t0))
        mem.query(questions[0], k=args.k, max_new_tokens=args.new_tokens)  # warm-up: the lazy prefill
        for q in questions:
            t0 = time.perf_counter()
            mem.search(q, k=args.k)
            times["search"].append(1e3 * (time.perf_counter() - t0))
        for q in questions:
            t0 = time.perf_counter()
            answers.append(mem.query(q, k=args.k, max_new_tokens=args.new_tokens).generation.tokens)
            times["query"].append(1e3 * (time.perf_counter() - t0))
    return times, answers


def over_mcp(args, root: Path, texts: list[str], questions: list[str]) -> tuple[dict, list]:
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "")}
    cmd = ["-c", START, "mcp", "--model", args.model, "--store", str(root), "--dtype", args.dtype]
    cmd += ["--threads", str(args.threads)]
    params = StdioServerParameters(command=sys.executable, args=cmd, env=env)
    times: dict[str, list[float]] = {"add": [], "search": [], "query": []}
    answers = []

    async def call(s: ClientSession, key: str | None, tool: str, arguments: dict):
        t0 = time.perf_counter()
        r = await s.call_tool(tool, arguments)
        if key is not None:
            times[key].append(1e3 * (time.perf_counter() - t0))
        if r.is_error:
            raise SystemExit(f"{tool} failed: {r.content[0].text}")
        return r.structured_content

    async def main():
        async with stdio_client(params) as (read, write), ClientSession(read, write) as s:
            await s.initialize()
            for t in texts:
                await call(s, "add", "add_memory", {"text": t})
            q0 = {"question": questions[0], "k": args.k, "max_new_tokens": args.new_tokens}
            await call(s, None, "query_memory", q0)  # warm-up: the lazy prefill
            for q in questions:
                await call(s, "search", "search_memory", {"query": q, "k": args.k})
            for q in questions:
                out = await call(
                    s, "query", "query_memory", {"question": q, "k": args.k, "max_new_tokens": args.new_tokens}
                )
                answers.append(out["tokens"])

    anyio.run(main)
    return times, answers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--events", type=int, default=40)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    texts, questions = workload(args.seed, args.events, args.calls)
    with tempfile.TemporaryDirectory() as tmp:
        lib, lib_answers = library(args, Path(tmp) / "lib", texts, questions)
        mcp, mcp_answers = over_mcp(args, Path(tmp) / "mcp", texts, questions)
    print(
        f"model {args.model}, {args.dtype}, {args.threads} torch threads; {args.events} events added one at a "
        f"time, {args.calls} searches and queries (k={args.k}, {args.new_tokens} new tokens)"
    )
    for verb in ("add", "search", "query"):
        ratio = statistics.median(mcp[verb]) / statistics.median(lib[verb])
        print(f"{verb:6s}  library {stats(lib[verb])}   MCP stdio {stats(mcp[verb])}   MCP / library {ratio:.2f}x")
    same = sum(a == b for a, b in zip(lib_answers, mcp_answers))
    print(f"query answers equal (greedy tokens): {same}/{len(lib_answers)}")


if __name__ == "__main__":
    main()
