"""CPU linear kernels: one forward of a model at the shapes a donor pair and a served query run, with its
linear layers on torch's own kernel (MKL sgemm for float32) and on oneDNN (``eventkv.models.kernels``),
measured in one run, the two kernels alternating.

    python benchmarks/cpu_linear.py --model qwen2.5-coder-1.5b --threads 2

Per shape ``[batch, tokens]`` (fresh forward, no cache, logits of the last token): the best of
``--repeats`` times of each kernel, their ratio, and the largest logit difference between the two.
The last line is the ratio of the sums of those best times over the shapes.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from eventkv.errors import EventKVError
from eventkv.models import load
from eventkv.models.kernels import use_linear

SHAPES = [(1, 1), (4, 1), (8, 1), (2, 22), (3, 43), (1, 176), (2, 138), (2, 229)]
SMOKE_SHAPES = [(1, 1), (4, 1), (2, 22)]


def main() -> None:
    ap = argparse.ArgumentParser(
        description="One forward per shape with the linears on torch's kernel and on oneDNN, in one run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2-135m", help="packaged alias or local model directory")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (None: torch's own count)")
    ap.add_argument("--repeats", type=int, default=3, help="timed forwards per shape and kernel (the best counts)")
    ap.add_argument("--smoke", action="store_true", help="three small shapes, one repeat")
    args = ap.parse_args()
    if args.repeats < 1:
        raise EventKVError(f"--repeats {args.repeats}: time at least 1 forward per shape.")
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load(args.model, dtype="float32", device="cpu", linear="torch")
    model = lm.model
    cpu = torch.cpu.get_capabilities().get("cpu_name") if hasattr(torch.cpu, "get_capabilities") else None
    print(
        f"model {args.model} (float32, cpu); torch {torch.__version__}, threads {torch.get_num_threads()}; "
        f"CPU {cpu or 'unknown'}, kernels {torch.backends.cpu.get_cpu_capability()}"
    )
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    repeats = 1 if args.smoke else args.repeats
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = {s: torch.randint(0, vocab, s, generator=g) for s in shapes}
    best: dict[tuple[str, tuple[int, int]], float] = {}
    logits: dict[tuple[str, tuple[int, int]], torch.Tensor] = {}
    for _ in range(repeats):
        for kernel in ("torch", "onednn"):
            got, why = use_linear(model, kernel)
            if got != kernel:
                raise EventKVError(f"linears on {kernel} are not available here: {why}")
            for s in shapes:
                with torch.inference_mode():
                    model(input_ids=ids[s], use_cache=False, logits_to_keep=1)  # warm: allocator, kernel choice
                    t = time.perf_counter()
                    out = model(input_ids=ids[s], use_cache=False, logits_to_keep=1).logits
                    dt = time.perf_counter() - t
                best[kernel, s] = min(dt, best.get((kernel, s), float("inf")))
                logits[kernel, s] = out
    print(f"{'forward [batch, tokens]':<24} {'torch ms':>9} {'oneDNN ms':>10} {'ratio':>7} {'max |dlogit|':>13}")
    for s in shapes:
        a, b = best["torch", s], best["onednn", s]
        diff = (logits["torch", s] - logits["onednn", s]).abs().max().item()
        print(f"{str(list(s)):<24} {a * 1000:9.0f} {b * 1000:10.0f} {a / b:6.2f}x {diff:13.1e}")
    total_a = sum(best["torch", s] for s in shapes)
    total_b = sum(best["onednn", s] for s in shapes)
    print(f"sum over the shapes of the best times, torch's kernel / oneDNN: {total_a / total_b:.2f}x")


if __name__ == "__main__":
    try:
        main()
    except EventKVError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
