"""bfloat16 vs float32 prefill on this machine, measured in one run: what `--dtype auto` decides on.

Loads a packaged model (default qwen2.5-coder-1.5b) once per dtype, prefills the same ~N-token
event log (default 700 tokens, the size of a donor-pair history) and prints the median seconds of
each, `bf16 / float32: N.NNx` (below 1 = bf16 faster), the CPU kind torch reports, and what
`resolve_dtype("auto")` picks here with its reason. Run it also under `ATEN_CPU_CAPABILITY=avx2`
to see torch's AVX2 kernels on the same CPU.

    python benchmarks/dtype_prefill.py [--model qwen2.5-coder-1.5b] [--tokens 700] [--repeats 2] [--threads N]
"""

from __future__ import annotations

import argparse
import gc

import torch
from serve_vs_prefill import make_log, timed

from eventkv.kv.log import tokenize
from eventkv.kv.prefill import prefill
from eventkv.models import load, resolve_dtype


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--tokens", type=int, default=700)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    caps = torch.cpu.get_capabilities()
    print(
        f"CPU {caps.get('cpu_name')}: avx512_bf16={caps.get('avx512_bf16')} amx_bf16={caps.get('amx_bf16')}, "
        f"torch kernels {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"
    )
    seconds = {}
    for dtype in ("float32", "bfloat16"):
        lm = load(args.model, dtype=dtype)
        tlog = tokenize(make_log(lm.tokenizer, lm.profile, args.tokens), lm.tokenizer, lm.profile)
        prefill(lm.model, tlog)  # warm-up
        seconds[dtype], _ = timed(lambda m=lm.model, t=tlog: prefill(m, t), args.repeats)
        print(f"{dtype}: prefill of {tlog.n_rows} tokens, median {seconds[dtype]:.2f} s over {args.repeats}")
        del lm
        gc.collect()
    print(f"bf16 / float32: {seconds['bfloat16'] / seconds['float32']:.2f}x")
    chosen, why = resolve_dtype("auto")
    print(f"--dtype auto here: {chosen} ({why})")


if __name__ == "__main__":
    main()
