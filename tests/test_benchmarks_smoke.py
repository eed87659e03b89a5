"""The GPU benchmark runs end to end on the CPU (``--smoke``: a 2-layer Qwen3 config), so it is
known to work before it first meets a GPU."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def run_benchmark(script: str, args: list[str], timeout: float):
    """Run ``benchmarks/<script>`` with ``args``; its exit must be 0. Returns ``(one, lines)``: ``one(pattern)``
    is the match of the one stdout line that matches ``pattern`` (it fails unless exactly one does); ``lines``
    the stdout's lines."""
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()

    def one(pattern: str) -> re.Match:
        hits = [m for m in map(re.compile(pattern).match, lines) if m]
        assert len(hits) == 1, f"{pattern!r}: {len(hits)} lines in\n{out.stdout}"
        return hits[0]

    return one, lines


@pytest.mark.slow
def test_gpu_throughput_smoke():
    one, lines = run_benchmark("gpu_throughput.py", ["--smoke", "--device", "cpu"], 600)
    assert one(r"device: .*\(cpu, \d+ torch threads\); dtype float32; torch ")
    assert one(r"model: Qwen3ForCausalLM from qwen3-8b\.json \(smoke shape\), random weights: 2 layers, hidden 64, ")
    assert one(r"tokenizer: ")
    assert float(one(r"matmul ceiling: 1024x1024x1024 float32 GEMM: ([\d.e+-]+) TFLOP/s").group(1)) > 0
    # three lengths, each: a prefill line, a serve line and its speed-ups
    prefills = [re.match(r"prefill L=(\d+): .* = ([\d,]+) tokens/s; .* of the matmul ceiling", ln) for ln in lines]
    lengths = [int(m.group(1)) for m in prefills if m]
    assert len(lengths) == 3 and lengths == sorted(lengths) and lengths[0] >= 256
    for n in lengths:
        one(rf"serve L={n}: \d+ of \d+ events served, 8 new tokens: from the EventKV on the device [\d.]+ ms; ")
        one(rf"serve L={n} speed-up over re-prefill: on the device [\d.]+x, stored [\d.]+x")
    one(r"donor pairs, batch 1 \(run_item; arms kv, isolated; both readouts; 4 new tokens\): 2 pairs, .* pairs/hour")
    one(r"donor pairs, batch 2 \(run_batch; .* pairs/hour")
    one(r"donor pairs, the study's way \(study_pair\b.*: 2 pairs, .* pairs/hour")
    one(r"donor pairs speed-up over the study's way: batch 1 [\d.]+x")


def test_cpu_attention_smoke():
    """The CPU attention benchmark's small mode: its header, one line per shape with both kernels' times, their
    ratio and each one's error against float64 within a few bfloat16 roundings, and the summed line."""
    from eventkv.models.attention import MATMUL_QUERY

    one, lines = run_benchmark("cpu_attention.py", ["--smoke", "--threads", "1"], 300)
    assert one(r"bfloat16, 12 query / 2 KV heads of 128; torch .*; matmul path up to \d+ query tokens$")
    rows = [
        re.match(r"(\[\d+, \d+, \d+\]) +([\d.]+) +([\d.]+) +([\d.]+)x +([\d.e+-]+) +([\d.e+-]+)$", ln) for ln in lines
    ]
    rows = [m for m in rows if m]
    long = MATMUL_QUERY + 8  # a prefill past the matmul path's length
    assert [m.group(1) for m in rows] == ["[1, 1, 64]", "[2, 3, 64]", "[1, 40, 96]", f"[1, {long}, {long}]"]
    for m in rows:  # times are printed, not checked: one call each on a machine that may be busy
        sdpa_err, matmul_err = float(m.group(5)), float(m.group(6))
        # a bfloat16 output rounds at 2**-8 of its largest value: both kernels within four roundings of float64
        assert sdpa_err < 4 * 2**-8 and matmul_err < 4 * 2**-8
    assert one(r"summed +[\d.]+ +[\d.]+ +[\d.]+x$")


@pytest.mark.slow
def test_service_load_smoke(tmp_path):
    """The service load benchmark end to end on the tiny model: one client count, batching off and on,
    a few requests; every table line, the lazy prefills together and one at a time, the ratios and bounds,
    no errors and no acknowledged add lost."""
    from service_fixtures import save_sharp_model

    model = save_sharp_model(tmp_path / "model")
    script = str(BENCHMARKS / "service_load.py")
    help_ = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=300)
    assert help_.returncode == 0 and "--max-batch" in help_.stdout and "--clients" in help_.stdout
    args = ["--model", str(model), "--clients", "2", "--seconds", "1", "--max-requests", "6", "--memories", "2"]
    args += ["--events", "3", "--queries", "2", "--k", "2", "--new-tokens", "2", "--threads", "1", "--max-batch", "4"]
    args += ["--repeats", "1"]
    one, lines = run_benchmark("service_load.py", args, 1200)

    one(r"model .* float32, 1 threads; history 3 events, \d+ positions")
    one(r"query latency over 2 queries \(median ms\): HTTP [\d.]+, library [\d.]+; same answers in 2/2")
    one(r"load: 2 memories, mix query 60 / add 25 / update 15, k 2, 2 new tokens, 1 s per cell")
    for mb in (1, 4):
        row = one(rf"\s+2\s+{mb}\s+(\d+)\s+[\d.]+(?:\s+[\d.na]+){{4}}\s+0\s+\d+\s+\d+\s+0\s+[\d.na]+$")
        assert 1 <= int(row.group(1)) <= 6
    one(r"2 clients: requests/s [\d.]+x \([\d.]+ / [\d.]+\), query p50 ([\d.]+x|n/a), query p99 ([\d.]+x|n/a)")
    costs = (
        r"a query's costs \(library, median ms\): prepare \d+ \(BM25, served cache, question ids\); readout at batch "
    )
    one(
        costs + r"1: \d+ \(\d+ a query\), 2: \d+ \(\d+ a query\), 4: \d+ \(\d+ a query\); add \d+ .*lazy prefill -?\d+$"
    )
    for b in (2, 4):
        one(rf"lazy prefill of {b} memories, together / one at a time: [\d.]+x \(\d+ / \d+ ms, one pending add each\)$")
    for name in ("this mix", "queries only"):
        one(rf"most that batching can give \({name}; .*\): batch 2 [\d.]+x, batch 4 [\d.]+x$")
    too = r"most batching can give on the mix, lazy prefills batched too \(.*at most 2, .*\): "
    one(too + r"batch 2 [\d.]+x, batch 4 [\d.]+x$")
    one(r"mean batch reached: 2 clients ([\d.]+|nan)$")
    one(r"errors \(non-2xx other than 503\): 0; acknowledged adds lost: 0")
    one(r"HTTP overhead \(median query latency, HTTP / library\): [\d.]+x")


@pytest.mark.slow
def test_service_scale_smoke():
    """The Ray Serve scaling benchmark end to end on the tiny model and a local Ray cluster of 2 CPUs: the
    three arms (plain process, 1 replica, 2 replicas), each with a few requests and no errors; the three
    ratios once each, and no memory answered by more than one replica."""
    pytest.importorskip("ray.serve")
    args = ["--memories", "4", "--events", "2", "--clients", "2", "--seconds", "2", "--max-requests", "8"]
    args += ["--new-tokens", "2", "--k", "2", "--mix", "50,50"]  # at this seed both clients add and query
    one, _ = run_benchmark("service_scale.py", args, 600)

    one(r"cpu: .+ \(\d+ cores\); torch threads 1 per server and per replica; Ray cluster 2 CPUs; model tiny float32$")
    sizing = one(r"sizing: KV ([\d,]+) bytes a memory \(2 events, \d+ rows; .*\) = ([\d,]+) memories per GiB ")
    assert int(sizing.group(1).replace(",", "")) > 0 and int(sizing.group(2).replace(",", "")) > 0
    one(r"load: 2 clients, 4 memories \(a random one a request\), mix query 50 / add 50, k 2, 2 new tokens, 2 s ")
    for arm in ("process", "ray 1 replica", "ray 2 replicas"):
        row = one(rf"{arm}\s+(\d+)\s+[\d.]+(?:\s+[\d.na]+){{4}}\s+(\d+)\s+(\d+)$")
        assert 1 <= int(row.group(1)) <= 8 and row.group(2) == row.group(3) == "0", row.group(0)
    for arm, replicas in (("ray 1 replica", 1), ("ray 2 replicas", 2)):
        held = one(rf"{arm}: replicas that answered (\d+); memories per replica [\d /]+; .* replica: (\d+)$")
        assert 1 <= int(held.group(1)) <= replicas and held.group(2) == "0", held.group(0)
    for name in (
        "throughput, 2 replicas / 1 replica",
        "throughput, Ray 1 replica / plain process",
        "p50 latency, Ray 1 replica / plain process",
    ):
        assert float(one(rf"{re.escape(name)}: (\d+\.\d\d)x$").group(1)) > 0


@pytest.mark.slow
def test_memory_fleet_smoke():
    """The many-memories benchmark end to end on the tiny model: 12 memories in native and in int4 rows,
    each server keeping 4 open, 1 and 2 clients; the sizing lines (int4 smaller on disk, the same RAM),
    every table row with cold and warm requests and no error, each GET matching the store, and the ratios
    of the formats that ran (no native / int8 line without int8)."""
    args = ["--memories", "12", "--turns", "8", "--max-open", "4", "--clients", "1,2", "--seconds", "2"]
    args += ["--rows", "native,int4", "--open-sample", "6"]
    one, lines = run_benchmark("memory_fleet.py", args, 600)

    one(r"cpu: .+ \(\d+ cores\); torch threads 1 here and per server; model tiny float32 \(2 layers, ")
    one(r"fleet: 12 memories per format, each 8 dialogue turns in sessions of 10 \(one prefilled add each\), ")
    disk, ram, idle = {}, {}, {}
    for fmt in ("native", "int4"):
        m = one(
            rf"{fmt}: built in [\d.]+ s; disk ([\d,]+) bytes a memory \(segments [\d,]+\) = [\d,]+ memories per GiB; "
            r"RAM of an open memory's rows in use ([\d,]+) bytes \(rows [\d,]+ in float32, dequantized in every "
            r"format, plus a quantized store's packed tensors\) = [\d,]+ memories per GiB; released \(release_rows: "
            r"packed tensors only, native keeps its rows\) ([\d,]+) bytes = [\d,]+ memories per GiB; open [\d.]+ ms "
            r"\(sha256; size check only [\d.]+ ms\), close [\d.]+ ms \(median of 6\)$"
        )
        disk[fmt], ram[fmt], idle[fmt] = (int(g.replace(",", "")) for g in m.groups())
        rows = one(rf"{fmt}: GET /v1/memories/ID reported rows {fmt} and bytes_on_disk equal to the store's files for ")
        assert "for 12/12 memories" in rows.string
        for clients in (1, 2):
            row = one(rf"{fmt}\s+{clients}\s+(\d+)\s+[\d.]+(?:\s+[\d.na]+){{2}}\s+(\d+)(?:\s+[\d.na]+){{2}}\s+(\d+)")
            total, cold, _ = (int(g) for g in row.groups())
            assert total >= 1 and 1 <= cold <= total and row.string.split()[-1] == "0", row.string
    assert 0 < disk["int4"] < disk["native"] and ram["int4"] > ram["native"] > 0  # in use: rows + packed
    assert idle["native"] == ram["native"] and 0 < idle["int4"] < idle["native"] / 2
    assert float(one(r"RAM of a released open memory's rows, native / int4: (\d+\.\d\d)x$").group(1)) > 2
    one(r"load: 12 memories per format \(a random one a request\), --max-open 4, BM25 k 8 within 256 rows, ")
    assert one(r"errors \(non-2xx and failed connections\): (\d+)$").group(1) == "0"
    assert not any(line.startswith("disk bytes per memory, native / int8") for line in lines)
    assert float(one(r"disk bytes per memory, native / int4: (\d+\.\d\d)x$").group(1)) > 1
    assert float(one(r"open time, native / int4: (\d+\.\d\d)x$").group(1)) > 0
    for clients in (1, 2):
        one(rf"cold p50 latency at {clients} clients, native / int4: (\d+\.\d\dx|n/a)$")
    assert lines[-1].startswith("cold p50 latency at 2 clients")


FAKE_STUDY = {
    "__init__.py": "raise ImportError('the package init imports a module that is not shipped')\n",
    "llm_hf.py": """
import torch
from transformers import AutoModelForCausalLM


class HFBackend:
    def __init__(self, model_path=None, dtype=torch.bfloat16):
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
""",
    "kv_causal.py": """
import argparse
import json

import torch

from kvmemory.llm_hf import HFBackend


def encode_variant(llm, n):
    with torch.no_grad():
        llm.model(input_ids=torch.arange(1, n + 1)[None])


def ask(llm, steps):
    with torch.no_grad():
        llm.model(input_ids=torch.tensor([[5, 6, 7]]))
        for _ in range(steps):
            llm.model(input_ids=torch.tensor([[8]]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--out")
    args = ap.parse_args()
    llm = HFBackend()
    torch.cuda.synchronize()
    for it in range(args.items):
        for n in (10, 12):  # Part A: both variants, root and full of each
            encode_variant(llm, n)
            ask(llm, 2)
            ask(llm, 2)
        for n in (30, 30):  # Part B: not timed
            encode_variant(llm, n)
            ask(llm, 5)
        torch.cuda.empty_cache()
    print("the script's own output")
    json.dump({"seed": args.seed}, open(args.out, "w"))
""",
}


@pytest.mark.slow
def test_donor_pair_throughput_times_the_study_script_s_part_a(tmp_path, tiny_dir):
    """``--study-repo`` on a stand-in of the study's repository with the same interface (its package
    ``__init__`` failing, CUDA-only calls, Part A then Part B per item): only Part A's calls are timed
    and counted — 10 + 12 prefill tokens of the histories and 4 x 3 of the questions, 4 x 2 decode steps
    — and the script's row is the baseline; without it, the baseline is said to be a re-implementation."""
    package = tmp_path / "repo" / "kvmemory"
    package.mkdir(parents=True)
    for name, text in FAKE_STUDY.items():
        (package / name).write_text(text)
    common = ["--model", str(tiny_dir), "--pairs", "2", "--max-new-tokens", "2", "--threads", "1"]
    study = ["--study-repo", str(tmp_path / "repo"), "--study-onednn"]
    one, _ = run_benchmark("donor_pair_throughput.py", [*common, *study], 600)
    one(r"model .* loaded in .*; linears on onednn$")
    one(r"study's script: .*repo \(kvmemory\.kv_causal, Part A\), model directory ")
    for pair in (1, 2):
        one(rf"pair {pair}: study's script +[\d.]+ s, 8 decode steps, 34 prefill tokens$")
        one(rf"pair {pair}: study's script, oneDNN linears +[\d.]+ s, 8 decode steps, 34 prefill tokens$")
    one(r"baseline of the ratios: study's script$")
    one(r"study's script +[\d.]+ +\d+ +8 +34 +1\.00x$")
    assert float(one(r"study's script, oneDNN linears +[\d.]+ +\d+ +8 +34 +([\d.]+)x$").group(1)) > 0
    for way in (r"study \(re-implemented\)", "eventkv all arms", "eventkv kv,isolated"):
        assert float(one(rf"{way} +[\d.]+ +\d+ +\d+ +\d+ +([\d.]+)x$").group(1)) > 0
    for way in ("study's script", r"study \(re-implemented\)", "eventkv all arms", "eventkv kv,isolated"):
        row = one(rf"{way} +([\d.]+) +([\d.]+) +([\d.]+) +(-?[\d.]+) +(\d+)%$")
        total, prefill, decode, rest = (float(row.group(i)) for i in range(1, 5))
        assert prefill > 0 and decode >= 0 and abs(prefill + decode + rest - total) <= 0.002  # rounding of 3 decimals
    one, _ = run_benchmark("donor_pair_throughput.py", [*common, "--linear", "torch"], 600)
    one(r"model .* loaded in .*; linears on torch$")
    one(r"baseline: 'study \(re-implemented\)' is the study's way re-implemented on eventkv's data path, not ")
    one(r"baseline of the ratios: study \(re-implemented\)$")


def test_cpu_linear_smoke(tiny_dir):
    one, _ = run_benchmark("cpu_linear.py", ["--model", str(tiny_dir), "--smoke", "--threads", "1"], 300)
    one(r"model .* \(float32, cpu\); torch .*, threads 1; CPU ")
    for shape in (r"\[1, 1\]", r"\[4, 1\]", r"\[2, 22\]"):
        row = one(rf"{shape} +\d+ +\d+ +([\d.]+)x +([\d.e+-]+)$")
        assert float(row.group(1)) > 0 and float(row.group(2)) < 1e-3
    assert float(one(r"sum over the shapes of the best times, torch's kernel / oneDNN: ([\d.]+)x$").group(1)) > 0
    bf16, _ = run_benchmark(
        "cpu_linear.py", ["--model", str(tiny_dir), "--smoke", "--threads", "1", "--dtype", "bfloat16"], 300
    )
    bf16(r"model .* \(bfloat16, cpu\); .*; avx512_bf16 .*, AMX tiles .*; ONEDNN_MAX_CPU_ISA ")
    row = bf16(r"\[2, 22\] +\d+ +\d+ +([\d.]+)x +([\d.e+-]+)$")
    assert float(row.group(1)) > 0 and float(row.group(2)) < 1.0  # bf16 logits against float32's: bf16 rounding
    assert float(bf16(r"sum over the shapes of the best times, bfloat16 / float32 \(oneDNN\): ([\d.]+)x$").group(1)) > 0


@pytest.mark.slow
def test_memory_scale_row_formats_smoke(tmp_path):
    """The memory scale benchmark end to end on the tiny model, two sizes, native and int4 rows: native's
    blocks and summary as with native alone, a block per size for int4 at the same history, and the format
    lines last (int4's store smaller than native's, hit rates and recalls in [0, 1]); with ``--rows native``
    alone, no format line."""
    from eventkv.testing import save_sharp_model

    model = save_sharp_model(tmp_path / "model")
    common = ["--model", str(model), "--sizes", "600,1200", "--batch-events", "2", "--needles", "3"]
    common += ["--selectors", "bm25", "--new-tokens", "4", "--threads", "1"]
    one, lines = run_benchmark("memory_scale.py", [*common, "--rows", "native,int4"], 300)
    one(r".* float32, torch threads 1, context 4096; selectors bm25$")
    one(r"row formats native, int4: one memory each, grown with the same events; native's blocks first$")
    native = [
        re.match(r"history (\d+) rows \(fits the context; grown in \d+ s\), (\d) needles asked", ln) for ln in lines
    ]
    int4 = [
        re.match(r"history (\d+) rows, rows int4 \(grown in [\d.]+ s\), (\d) needles asked, budget 256", ln)
        for ln in lines
    ]
    native_at = [(int(m.group(1)), int(m.group(2))) for m in native if m]
    assert len(native_at) == 2 and native_at == [(int(m.group(1)), int(m.group(2))) for m in int4 if m], lines
    assert native_at[0][0] >= 600 and native_at[1][0] >= 1200 and native_at[1][1] == 3
    for fmt in ("native", "int4"):
        stores = [
            re.match(rf"  store  {fmt} rows: ([\d,]+) bytes on disk, segment files ([\d,]+) bytes$", ln) for ln in lines
        ]
        assert len([m for m in stores if m]) == 2
    assert len([ln for ln in lines if re.match(r"  rows  median +\d+ ms per query$", ln)]) == 2  # int4's blocks
    # native's blocks: every arm timed and its answer read out (both sizes fit the tiny model's context)
    arm = r"  (rows|text|full) +median +\d+ ms per query, KV bytes served +[\d,]+, answer has the code ([\d.]+)$"
    read = [re.match(arm, ln) for ln in lines]
    assert sorted(m.group(1) for m in read if m) == ["full", "full", "rows", "rows", "text", "text"]
    assert all(0 <= float(m.group(2)) <= 1 for m in read if m)
    one(r"rows latency, largest vs smallest history: [\d.]+x \(1200 vs 600 tokens\)$")
    one(r"full vs rows KV bytes at 1200: [\d.]+x$")
    one(r"recall bm25: 600: [\d.]+, 1200: [\d.]+$")
    for size in (600, 1200):
        # float32 rows against 4 bits and float16 scales: the segments shrink >3x, the whole store (database too) >1.5x
        assert float(one(rf"disk bytes, native / int4 at {size}: ([\d.]+)x$").group(1)) > 1.5
        assert float(one(rf"segment bytes, native / int4 at {size}: ([\d.]+)x$").group(1)) > 3
        for name in ("hit rate", "recall"):
            m = one(rf"{name} at {size} \(bm25\): native ([\d.]+), int4 ([\d.]+)$")
            assert all(0 <= float(v) <= 1 for v in m.groups())
        one(rf"rows latency at {size}: native \d+ ms, int4 \d+ ms$")
        one(rf"growth at {size}: native [\d.]+ s, int4 [\d.]+ s$")
    # native alone: the same lines as native's in the run above (timings aside), no format line
    _, alone = run_benchmark("memory_scale.py", [*common, "--rows", "native"], 300)
    kept = [p for p in "\n".join(lines).split("\n\n") if ", rows int4 " not in p]  # blocks apart: blank lines
    kept = ["\n".join(ln for ln in p.split("\n") if not ln.startswith(("row formats ", "  store  "))) for p in kept]
    kept[-1] = kept[-1].split("\ndisk bytes, native / ")[0]

    def timings_blanked(text: str) -> str:
        return re.sub(r" +\d+ ms|[\d.]+x|grown in \d+ s", "#", text)

    assert timings_blanked("\n".join(alone)) == timings_blanked("\n\n".join(kept))


@pytest.mark.slow
def test_question_budgets_smoke():
    """The per-question budget benchmark on the shipped demo dialogue: every fixed budget and adaptive rule has
    a table line with rows, recall and precision, each adaptive rule its nearest fixed budget and interval."""
    from eventkv.studies.materialization.memory_eval import DEMO_DATA

    args = ["--data", DEMO_DATA, "--model", "smollm2-135m", "--conversations", "1", "--questions-per-conversation"]
    args += ["6", "--max-tokens", "600", "--bm25-ratios", "0.5", "--dense-margins", "0.1"]
    one, lines = run_benchmark("question_budgets.py", args, 300)
    n = int(one(r"(\d+) questions of categories 1-4 from 1 conversations; cap 0.1").group(1))
    assert n >= 1
    rows = [ln for ln in lines if ln.startswith("| bm25") or ln.startswith("| dense")]
    assert len(rows) == 2 * 12 + 2  # 12 fixed budgets per selector and the two adaptive rules
    for ln in rows:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert float(cells[1]) >= 0 and 0 <= float(cells[2]) <= 1 and 0 <= float(cells[3]) <= 1
    assert int(one(r"\| bm25 fixed 10% \| (\d+) \|").group(1)) > 0  # a 0.5% budget of a short demo history fits no turn
    cut = r"\| \d+ \| [\d.]+ \| [\d.]+ \| [\d.]+%: \d+, [\d.]+ \| [+-][\d.]+ \[[+-][\d.]+, [+-][\d.]+\] \|$"
    one(r"\| bm25 >= 0.5 x best " + cut)
    one(r"\| dense >= best - 0.1 " + cut)


def _draft_benchmark():
    """``benchmarks/draft_model.py`` as a module (its counting functions)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("draft_model_benchmark", BENCHMARKS / "draft_model.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_draft_benchmark_counts_prompt_lookup_forwards_by_hand():
    """Source 1..7, answer 3 4 5 6 7 then the stop token 0: the question's forward gives 3; the draft of `3`'s
    match is 4 5 (both kept, 6 the model's own); the bigram 5 6 drafts 7 3 (7 kept, the stop the model's own)."""
    bench = _draft_benchmark()
    assert bench.lookup_rounds([1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 0], {0}, 64) == [1, 3, 3]
    assert bench.lookup_rounds([1, 2], [3, 4, 0], {0}, 64) == [1, 1, 1]  # nothing to copy: one token a forward


def test_draft_benchmark_counts_a_draft_model_that_is_always_right():
    """A draft model drafting its own greedy continuation of the source: every round keeps its k tokens and one
    of the model's, so T tokens take 1 + ceil((T - 1) / (k + 1)) forwards, and k forwards of the draft a round
    plus one catch-up after each round whose draft was kept whole."""
    from eventkv.testing import tiny_model

    bench = _draft_benchmark()
    model = tiny_model("llama").eval()
    source = [5, 17, 42, 8, 99, 23, 61]
    with torch.inference_mode():
        out = model.generate(torch.tensor([source]), max_new_tokens=10, do_sample=False, eos_token_id=None)
    answer = out[0, len(source) :].tolist()
    assert len(answer) == 10
    for k in (1, 2, 4):
        rounds, steps = bench.draft_rounds(model, source, answer, k, set(), 64)
        n = 1 + math.ceil((len(answer) - 1) / (k + 1))
        assert len(rounds) == n and rounds[0] == 1
        assert steps == (n - 1) * k + (n - 2)


def test_draft_benchmark_smoke(tiny_dir):
    """The draft benchmark end to end on the tiny model, drafting for itself: per answer its forwards each
    way (none more than plain decoding's, a token a forward), and the totals with their ratio."""
    args = ["--model", str(tiny_dir), "--dtype", "float32", "--draft", str(tiny_dir), "--draft-dtype", "float32"]
    one, lines = run_benchmark("draft_model.py", [*args, "--pairs", "1", "--min-tokens", "1", "--repeats", "1"], 300)
    one(r"model .* \(float32\), draft .* \(float32\); 2 threads, ")
    rows = [re.search(r"forwards plain (\d+), lookup (\d+), draft (\d+) ", ln) for ln in lines]
    counts = [tuple(map(int, m.groups())) for m in rows if m]
    assert counts and all(lk <= plain and dr <= plain for plain, lk, dr in counts)
    total = one(r"total over (\d+) answers: plain [\d.]+ s, prompt lookup [\d.]+ s, draft model [\d.]+ s; .* ([\d.]+)x")
    assert int(total.group(1)) == len(counts) and float(total.group(2)) > 0


@pytest.mark.slow
def test_evidence_rows_smoke(tiny_dir, tmp_path, monkeypatch, capsys):
    """The evidence-rows benchmark on a tiny memory eval run: every way on every question, and its reproduction of
    the run's own rows arm scores each question as the run did."""
    import json

    from cli_fixtures import run_cli

    from eventkv.studies.materialization.memory_eval import DEMO_DATA

    out = tmp_path / "run"
    args = ["memory", "eval", "--data", DEMO_DATA, "--model", str(tiny_dir), "--conversations", "1"]
    args += ["--questions-per-conversation", "3", "--max-tokens", "600", "--budgets", "50%", "--selectors", "bm25"]
    args += ["--arms", "rows,gold", "--max-new-tokens", "3", "--dtype", "float32", "--no-progress", "--out", str(out)]
    code, text, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, text + err
    records = [json.loads(x) for x in (out / "records.jsonl").read_text().splitlines()]
    done = [r for r in records if "arms" in r]
    one, lines = run_benchmark(
        "evidence_rows.py", [str(out), "--window", "400", "--original", "--threads", "1", "--max-new-tokens", "3"], 300
    )
    one(rf".* \(float32\), conversation {done[0]['conversation']}, {len(done)} questions$")
    ways = ["evidence: rows", "evidence: text", "header + evidence: rows", "header + evidence: text"]
    ways += ["served set (run): rows", "evidence: rows (window 400)", "header + evidence: rows (window 400)"]
    ways += ["served set (run): rows (window 400)"]
    ways += ["evidence: rows at original positions", "header + evidence: rows at original positions"]
    for way in ways:
        mean = float(one(rf"{re.escape(way)} +([\d.]+) +{len(done)}$").group(1))
        assert 0 <= mean <= 1
    served = [re.search(r"served set \(run\): rows ([\d.]+);", ln) for ln in lines]
    run_f1 = [round(r["arms"]["rows:bm25@50%/contiguous"]["f1"], 2) for r in done]
    assert [float(m.group(1)) for m in served if m] == run_f1
    one(r"header \+ evidence: rows - text: [+-][\d.]+ \(\d+:\d+, Wilcoxon p .*, n \d+\)$")
    bad = subprocess.run(
        [sys.executable, str(BENCHMARKS / "evidence_rows.py"), str(tmp_path / "none")], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "error:" in bad.stderr and "Traceback" not in bad.stderr
