"""CPU attention kernels: torch's SDPA against eventkv's matmul attention (`eventkv.models.attention`), one
layer's attention per call shape, measured in one run.

    python benchmarks/cpu_attention.py --dtype bfloat16 --threads 2
    python benchmarks/cpu_attention.py --smoke    # four small shapes, one timed call each: that it runs

The heads default to qwen2.5-coder-1.5b's (12 query heads, 2 KV heads, 128 channels). The shapes are the
calls a donor pair and a served memory query make: decode steps (one token, or a token and its two-token
prompt-lookup draft) of 1-8 sequences over 700-16,000 rows, questions of 40-43 tokens, prefills of
128-229 tokens (the matmul path takes queries of at most ``MATMUL_QUERY`` tokens; longer ones are timed
too, through the path itself, to show why). SDPA is called as transformers calls it (its
``sdpa_attention_forward``): a one-token step without a mask, as transformers passes it for sequences
without padding, every other call with a causal bool mask. Per shape: the best of ``--repeats`` calls of each, their
ratio (SDPA / matmul: above 1 the matmul path is faster), and each one's largest difference from float64
SDPA relative to the reference's largest value.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eventkv.models.attention import MATMUL_QUERY, float32_attention, matmul_attention

# (sequences, query tokens, rows before and including the query)
SHAPES = (
    (1, 1, 700),
    (5, 1, 640),
    (5, 3, 640),
    (8, 1, 2000),
    (1, 1, 16000),
    (1, 3, 16000),
    (5, 43, 639),
    (1, 40, 1600),
    (1, 40, 16000),
    (2, 128, 600),
    (1, 128, 4000),
    (2, 138, 367),
    (2, 229, 596),
    (1, 512, 512),
)
#: ``--smoke``: a decode step, a draft step, a question and a prefill past ``MATMUL_QUERY``, on few rows
SMOKE_SHAPES = ((1, 1, 64), (2, 3, 64), (1, 40, 96), (1, MATMUL_QUERY + 8, MATMUL_QUERY + 8))


class _Layer(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _best(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1000


def main() -> None:
    ap = argparse.ArgumentParser(
        description="torch's SDPA against eventkv's matmul attention on a CPU, per call shape."
    )
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 or float16 (the matmul path's dtypes)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (None: torch's own count)")
    ap.add_argument("--heads", type=int, default=12, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=2, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=128, help="channels per head")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per kernel and shape (the best is kept)")
    ap.add_argument("--smoke", action="store_true", help="four small shapes, one timed call each (that it runs)")
    args = ap.parse_args()
    shapes, repeats = (SMOKE_SHAPES, 1) if args.smoke else (SHAPES, args.repeats)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    layer = _Layer(args.heads // args.kv_heads)
    scale = args.head_dim**-0.5
    cpu = torch.cpu.get_capabilities().get("cpu_name") if hasattr(torch.cpu, "get_capabilities") else None
    print(
        f"{args.dtype}, {args.heads} query / {args.kv_heads} KV heads of {args.head_dim}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; CPU {cpu or 'unknown'}, "
        f"kernels {torch.backends.cpu.get_cpu_capability()}; matmul path up to {MATMUL_QUERY} query tokens"
    )
    head = ("SDPA ms", "matmul ms", "SDPA/matmul", "SDPA err", "matmul err")
    print(f"{'[seqs, q, rows]':<18} {head[0]:>9} {head[1]:>10} {head[2]:>12} {head[3]:>9} {head[4]:>11}")
    total = [0.0, 0.0]
    g = torch.Generator().manual_seed(0)
    for b, q, kv in shapes:
        query = torch.randn(b, args.heads, q, args.head_dim, generator=g).to(dtype)
        key, value = (torch.randn(b, args.kv_heads, kv, args.head_dim, generator=g).to(dtype) for _ in range(2))
        a, m, errs = _shape(layer, query, key, value, scale, repeats)
        total[0] += a
        total[1] += m
        print(f"{str([b, q, kv]):<18} {a:9.2f} {m:10.2f} {a / m:11.2f}x {errs[0]:9.1e} {errs[1]:11.1e}")
    print(f"{'summed':<18} {total[0]:9.2f} {total[1]:10.2f} {total[0] / total[1]:11.2f}x")


def _shape(layer, query, key, value, scale: float, repeats: int) -> tuple[float, float, list[float]]:
    """SDPA's and the matmul path's best milliseconds on one call shape, and each one's largest difference
    from float64 SDPA relative to the reference's largest value."""
    b, heads, q, _ = query.shape
    kv = key.shape[2]
    full = torch.ones(q, kv, dtype=torch.bool).tril(kv - q)[None, None].expand(b, 1, q, kv)
    mask = None if q == 1 else full

    def sdpa():
        return sdpa_attention_forward(layer, query, key, value, mask, scaling=scale)[0]

    def mm():
        if q > MATMUL_QUERY:  # the path's computation itself, past the length it hands to SDPA
            return float32_attention(query, key, value, mask, scale, causal=True)
        return matmul_attention(layer, query, key, value, mask, scaling=scale)[0]

    groups = heads // key.shape[1]
    ref = torch.nn.functional.scaled_dot_product_attention(
        query.double(),
        key.double().repeat_interleave(groups, 1),
        value.double().repeat_interleave(groups, 1),
        attn_mask=full,
    ).transpose(1, 2)
    top = ref.abs().max().item()
    errs = [(f().double() - ref).abs().max().item() / top for f in (sdpa, mm)]
    return _best(sdpa, repeats), _best(mm, repeats), errs


if __name__ == "__main__":
    main()
