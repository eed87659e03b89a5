"""CPU linear kernels: one forward of a model at the shapes a donor pair and a served query run, on two
kernels measured in one run, alternating.

    python benchmarks/cpu_linear.py --model qwen2.5-coder-1.5b --threads 2
    python benchmarks/cpu_linear.py --model qwen2.5-coder-1.5b --threads 2 --dtype bfloat16

``--dtype float32`` (the default): the float32 model's linear layers on torch's own kernel (MKL sgemm) and on
oneDNN (``eventkv.models.kernels``, what ``load`` gives a float32 model on a CPU). ``--dtype bfloat16``: the
bfloat16 model (torch runs its CPU linears on oneDNN, with AMX tiles where the CPU has them and oneDNN may use
them) against the float32 model on oneDNN, i.e. what ``--dtype bfloat16`` costs against ``--dtype float32``
per shape. oneDNN's instruction set can be capped for a whole run with its own environment variable, e.g.
``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`` (bf16 without AMX, as on a CPU that has avx512_bf16 only); the first
line says what the CPU has and the cap.

Per shape ``[batch, tokens]`` (fresh forward, no cache, logits of the last token): the best of
``--repeats`` times of each kernel, their ratio, and the largest logit difference between the two.
The last line is the ratio of the sums of those best times over the shapes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from eventkv.errors import EventKVError
from eventkv.models import load
from eventkv.models.kernels import use_linear

SHAPES = [(1, 1), (2, 1), (3, 1), (4, 1), (8, 1), (2, 22), (3, 43), (1, 176), (2, 138), (2, 229)]
SMOKE_SHAPES = [(1, 1), (4, 1), (2, 22)]


def main() -> None:
    ap = argparse.ArgumentParser(
        description="One forward per shape with the linears on torch's kernel and on oneDNN, in one run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2-135m", help="packaged alias or local model directory")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (None: torch's own count)")
    ap.add_argument("--repeats", type=int, default=3, help="timed forwards per shape and kernel (the best counts)")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="float32: torch's kernel vs oneDNN; bfloat16: the bf16 model vs the float32 one on oneDNN",
    )
    ap.add_argument("--smoke", action="store_true", help="three small shapes, one repeat")
    args = ap.parse_args()
    if args.repeats < 1:
        raise EventKVError(f"--repeats {args.repeats}: time at least 1 forward per shape.")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtype == "float32":  # one model, its linears switched between the two kernels
        lm = load(args.model, dtype="float32", device="cpu", linear="torch")
        ways = {"torch": lm.model, "onednn": lm.model}
        labels = ("torch ms", "oneDNN ms", "torch's kernel / oneDNN")
    else:  # two models: the bf16 one on torch's kernel (oneDNN inside torch), the float32 one on oneDNN
        lm = load(args.model, dtype="bfloat16", device="cpu")
        ways = {"bf16": lm.model, "onednn": load(args.model, dtype="float32", device="cpu", linear="onednn").model}
        labels = ("bf16 ms", "f32 ms", "bfloat16 / float32 (oneDNN)")
    model = lm.model
    cpu = torch.cpu.get_capabilities().get("cpu_name") if hasattr(torch.cpu, "get_capabilities") else None
    amx = getattr(torch.cpu, "_is_amx_tile_supported", lambda: None)()
    bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: None)()
    print(
        f"model {args.model} ({args.dtype}, cpu); torch {torch.__version__}, threads {torch.get_num_threads()}; "
        f"CPU {cpu or 'unknown'}, kernels {torch.backends.cpu.get_cpu_capability()}; avx512_bf16 {bf16}, "
        f"AMX tiles {amx}; ONEDNN_MAX_CPU_ISA {os.environ.get('ONEDNN_MAX_CPU_ISA') or 'unset'}"
    )
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    repeats = 1 if args.smoke else args.repeats
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = {s: torch.randint(0, vocab, s, generator=g) for s in shapes}
    best: dict[tuple[str, tuple[int, int]], float] = {}
    logits: dict[tuple[str, tuple[int, int]], torch.Tensor] = {}
    for _ in range(repeats):
        for kernel, way in ways.items():
            if args.dtype == "float32":
                got, why = use_linear(way, kernel)
                if got != kernel:
                    raise EventKVError(f"linears on {kernel} are not available here: {why}")
            for s in shapes:
                with torch.inference_mode():
                    way(input_ids=ids[s], use_cache=False, logits_to_keep=1)  # warm: allocator, kernel choice
                    t = time.perf_counter()
                    out = way(input_ids=ids[s], use_cache=False, logits_to_keep=1).logits.float()
                    dt = time.perf_counter() - t
                best[kernel, s] = min(dt, best.get((kernel, s), float("inf")))
                logits[kernel, s] = out
    first, second = ways
    print(f"{'forward [batch, tokens]':<24} {labels[0]:>9} {labels[1]:>10} {'ratio':>7} {'max |dlogit|':>13}")
    for s in shapes:
        a, b = best[first, s], best[second, s]
        diff = (logits[first, s] - logits[second, s]).abs().max().item()
        print(f"{str(list(s)):<24} {a * 1000:9.0f} {b * 1000:10.0f} {a / b:6.2f}x {diff:13.1e}")
    total_a = sum(best[first, s] for s in shapes)
    total_b = sum(best[second, s] for s in shapes)
    print(f"sum over the shapes of the best times, {labels[2]}: {total_a / total_b:.2f}x")


if __name__ == "__main__":
    try:
        main()
    except EventKVError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
