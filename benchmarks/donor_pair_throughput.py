"""Donor-pair throughput: pairs per hour, and the ratio of a pair's wall time to the time of its
forward passes (the floor: the probe's prefills, isolated encodings, query forwards, candidate
forwards and decode steps, timed inside ``model.forward``).

    python benchmarks/donor_pair_throughput.py --model smollm2-135m --dtype float32 --pairs 6

Prints one line per pair, then ``pairs/hour: N`` and ``ratio to forward-pass floor: R.RRx``.
Every arm of the probe runs (kv, isolated, text-all, kv-all), both readouts, 64 new tokens.
Study 1's own script (two prefills, four short generations per pair, no isolated/text arms)
does about 270 pairs/hour with qwen2.5-coder-1.5b in bfloat16 on a 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from eventkv.models import load
from eventkv.probes import DonorPair, Runtime
from eventkv.probes.base import ForwardTimer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--pairs", type=int, default=6, help="timed pairs (after one warm-up pair)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the timed pairs")
    ap.add_argument(
        "--baseline",
        action="store_true",
        help="also time the same pairs the way Study 1's script runs them (per variant a full "
        "prefill; generations for kv and text-all one at a time; no isolated arm, no candidates)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    t = time.perf_counter()
    lm = load(args.model, dtype=args.dtype)
    print(
        f"model {args.model} ({args.dtype}) loaded in {time.perf_counter() - t:.1f} s; "
        f"torch threads {torch.get_num_threads()}"
    )
    rt = Runtime(lm.model, lm.tokenizer, lm.profile)
    probe = DonorPair(max_new_tokens=args.max_new_tokens)
    items = probe.items(args.seed, range(args.pairs + 1))

    probe.run_item(rt, items[0])  # warm-up: header prefill, allocator, kernels
    walls, fwds = [], []
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    for it in items[1:]:
        timer = ForwardTimer()
        with timer.installed(rt.model):
            t = time.perf_counter()
            rec = probe.run_item(rt, it)
            wall = time.perf_counter() - t
        gen = sum(rec["arms"][a][v].get("n_tokens", 0) for a in rec["arms"] for v in "AB")
        walls.append(wall)
        fwds.append(timer.seconds)
        print(
            f"pair {it['index']}: {wall:6.2f} s wall, {timer.seconds:6.2f} s in {timer.calls} forwards "
            f"(ratio {wall / timer.seconds:.3f}); history {rec['history_end']} positions; "
            f"{gen} tokens generated over the arms"
        )
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    mean = statistics.mean(walls)
    print(f"mean pair time: {mean:.2f} s (forward passes {statistics.mean(fwds):.2f} s)")
    print(f"pairs/hour: {3600 / mean:.0f}")
    print(f"ratio to forward-pass floor: {sum(walls) / sum(fwds):.3f}x")
    if args.baseline:
        base = [baseline_pair(rt, probe, it) for it in items[1:]]
        for it, b in zip(items[1:], base):
            print(f"baseline pair {it['index']}: {b:6.2f} s wall")
        print(
            f"baseline pairs/hour: {3600 / statistics.mean(base):.0f} (study-style: 2 full prefills, "
            f"4 one-at-a-time generations, no isolated arm, no candidate scoring)"
        )
        print(f"speed-up over baseline: {statistics.mean(base) / mean:.2f}x")


def baseline_pair(rt: Runtime, probe: DonorPair, item: dict) -> float:
    """One pair the study's way, on eventkv's data path: header + all events prefilled from scratch
    per variant, then greedy generation (batch 1) for {decoy, root} served compactly and for every
    event. Returns wall seconds."""
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


if __name__ == "__main__":
    main()
