"""Donor-pair throughput: pairs per hour of eventkv's donor-pair probe against the study's way, measured
in one run on the same model, dtype, threads and pairs.

    python benchmarks/donor_pair_throughput.py --model qwen2.5-coder-1.5b --dtype float32 --threads 2 --pairs 6

Three ways are timed on every pair, in a rotating order (so a slower or busier stretch of the
machine falls on each of them alike):

* ``study``: Study 1's own way (Part A of its causal probe): per variant the whole history is
  prefilled from scratch (header included), then greedy generation at batch 1 for {decoy, root}
  served compactly and for every event (:func:`study_pair`);
* ``eventkv all arms``: ``eventkv run donor-pair`` with kv, isolated, text-all, kv-all (both
  readouts: greedy generation and candidate log-probs);
* ``eventkv kv,isolated``: ``eventkv run donor-pair --arms kv,isolated`` — lazy prefill stops each
  variant after the root, both readouts.

With ``--batch-pairs N`` (N > 1) a fourth way runs the kv,isolated arms N pairs at a time
(``DonorPair.run_batch``: histories prefilled and read out in one batch).

Prints one line per pair and way, then per way: mean seconds per pair, pairs per hour and the
ratio of its pairs per hour to the study's. Model load and one warm-up pair per way are excluded.
``--profile`` prints a cProfile of the eventkv ways.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from eventkv.errors import EventKVError
from eventkv.models import load
from eventkv.options import check_batch_pairs
from eventkv.probes import Runtime
from eventkv.studies.materialization.donor_pair import DonorPair

ALL_ARMS = ("kv", "isolated", "text-all", "kv-all")
LAZY_ARMS = ("kv", "isolated")


def study_pair(rt: Runtime, probe: DonorPair, item: dict) -> float:
    """One donor pair the study's way, on eventkv's data path: per variant the header and every event
    prefilled from scratch, then greedy generation at batch 1 (up to ``probe.max_new_tokens`` tokens)
    for {decoy, root} served compactly and for every event. Returns wall seconds."""
    from eventkv.log import TokenizedLog, tokenize_query
    from eventkv.prefill import prefill
    from eventkv.readout import generate
    from eventkv.serve import serve

    t = time.perf_counter()
    ids = [probe.event_id(i) for i in range(probe.n_events)]
    header = rt.header_ids(probe.instruction)
    toks = [[rt.encode(e) for e in ev] for ev in item["events"]]
    m = item["source_slot"]
    budget = max(len(toks[0][m]), len(toks[1][m]))
    query = tokenize_query(rt.tokenizer, rt.profile, item["question"])
    for v in (0, 1):
        log = TokenizedLog(header, ids, toks[v], [budget if i == m else None for i in range(probe.n_events)])
        ekv = prefill(rt.model, log)
        for served in ([probe.event_id(probe.decoy_slot), probe.event_id(probe.root_slot)], "all"):
            generate(
                rt.model,
                serve(ekv, served, "compact"),
                query,
                max_new_tokens=probe.max_new_tokens,
                stop_token_ids=rt.stop_token_ids,
            )
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--pairs", type=int, default=6, help="timed pairs per way (after one warm-up pair)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batch-pairs", type=int, default=1, help="also time kv,isolated N pairs at a time (N > 1)")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the eventkv ways")
    args = ap.parse_args()
    check_batch_pairs(args.batch_pairs)
    if args.threads:
        torch.set_num_threads(args.threads)

    t = time.perf_counter()
    lm = load(args.model, dtype=args.dtype, device=args.device)
    cpu = torch.cpu.get_capabilities().get("cpu_name") if hasattr(torch.cpu, "get_capabilities") else None
    print(
        f"model {args.model} ({lm.profile.dtype}, {args.device}) loaded in {time.perf_counter() - t:.1f} s; "
        f"torch threads {torch.get_num_threads()}; CPU {cpu or 'unknown'}, kernels "
        f"{torch.backends.cpu.get_cpu_capability()}"
    )
    rt = Runtime(lm.model, lm.tokenizer, lm.profile)
    probes = {
        "eventkv all arms": DonorPair(max_new_tokens=args.max_new_tokens, arm_names=ALL_ARMS),
        "eventkv kv,isolated": DonorPair(max_new_tokens=args.max_new_tokens, arm_names=LAZY_ARMS),
    }
    study = DonorPair(max_new_tokens=args.max_new_tokens)
    items = study.items(args.seed, range(args.pairs + 1))
    warm, timed = items[0], items[1:]

    ways = {"study": lambda it: study_pair(rt, study, it)}
    for name, probe in probes.items():
        ways[name] = lambda it, p=probe: _timed(lambda: p.run_item(rt, it))
    for way in ways.values():  # warm-up: header prefill, allocator, kernels
        way(warm)

    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    secs: dict[str, list[float]] = {name: [] for name in ways}
    names = list(ways)
    for k, it in enumerate(timed):
        for j in range(len(names)):
            name = names[(k + j) % len(names)]
            if prof is not None and name != "study":
                prof.enable()
            s = ways[name](it)
            if prof is not None:
                prof.disable()
            secs[name].append(s)
            print(f"pair {it['index']}: {name:<22} {s:7.2f} s")

    if args.batch_pairs > 1:
        name = f"eventkv kv,isolated batch {args.batch_pairs}"
        p = probes["eventkv kv,isolated"]
        p.run_batch(rt, items[: min(args.batch_pairs, len(items))])  # warm-up at the batch shape
        per = []
        for a in range(0, len(timed), args.batch_pairs):
            chunk = timed[a : a + args.batch_pairs]
            s = _timed(lambda c=chunk: p.run_batch(rt, c))
            per.extend([s / len(chunk)] * len(chunk))
            print(f"pairs {chunk[0]['index']}-{chunk[-1]['index']}: {name} {s:7.2f} s")
        secs[name] = per

    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    base = statistics.mean(secs["study"])
    print(f"\n{'way':<32} {'s/pair':>8} {'pairs/hour':>11} {'vs study':>9}")
    for name, s in secs.items():
        mean = statistics.mean(s)
        print(f"{name:<32} {mean:8.2f} {3600 / mean:11.0f} {base / mean:8.2f}x")


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    try:
        main()
    except EventKVError as e:  # a bad option or an unusable device: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
