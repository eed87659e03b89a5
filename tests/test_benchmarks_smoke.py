"""The GPU benchmark runs end to end on the CPU (``--smoke``: a 2-layer Qwen3 config), so it is
known to work before it first meets a GPU."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_gpu_throughput_smoke():
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_throughput.py"), "--smoke", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()

    def one(pattern: str) -> re.Match:
        hits = [m for m in map(re.compile(pattern).match, lines) if m]
        assert len(hits) == 1, f"{pattern!r}: {len(hits)} lines in\n{out.stdout}"
        return hits[0]

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
