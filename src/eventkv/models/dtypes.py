"""Choosing the dtype a model computes in: ``"auto"`` picks bfloat16 only where the hardware computes it
natively and, on a CPU without AMX, only where a measured bf16 matmul is clearly faster than float32."""

from __future__ import annotations

import functools
import platform
import time

import torch

from eventkv.errors import OptionError
from eventkv.models import devices
from eventkv.options import DTYPE_CHOICES

__all__ = ["bf16_matmul_ratio", "native_bf16", "resolve_dtype", "torch_dtype"]

BF16_FASTER = 0.8
"""``auto`` takes bfloat16 on an AVX512-BF16 CPU without AMX only where its matmul takes at most this
fraction of the float32 time (:func:`bf16_matmul_ratio`); a margin, so that timing noise near 1.0 does
not flip the choice between runs of one machine."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def native_bf16(device: str | torch.device = "cpu") -> tuple[bool, str]:
    """Whether ``device`` computes bfloat16 natively, and what was detected (one line).

    CUDA: where the GPU has bf16 arithmetic (Ampere and later:
    ``torch.cuda.is_bf16_supported(including_emulation=False)``).
    CPU: only where the CPU has AVX512-BF16 or AMX-BF16 (read from cpuinfo through
    ``torch.cpu.get_capabilities()``). Without them bf16 is converted in software: on an AVX2-only
    AMD EPYC a 700-token prefill of qwen2.5-coder-1.5b took 116 s in bf16 vs 19 s in float32.
    With AVX512-BF16 but no AMX the flag is not enough: the bf16 matmul is timed against float32
    (:func:`bf16_matmul_ratio`, once per process) and bf16 counts as native only where it takes at
    most :data:`BF16_FASTER` of the float32 time. Measured: an AMD EPYC with avx512_bf16 prefills
    in bf16 in 0.28x the float32 time, while on an Intel Xeon (family 6 model 207) whose hypervisor
    hides AMX a [512, 1536] x [1536, 8960] bf16 matmul took 1.8x the float32 time (1 thread).
    torch's own kernel level (``ATEN_CPU_CAPABILITY``) is reported but not used: the
    matmuls go through oneDNN, which uses AVX512-BF16 whatever that variable says (measured on an
    AMD EPYC with avx512_bf16 under ``ATEN_CPU_CAPABILITY=avx2``: bf16 prefill 0.28x the float32
    time; ``benchmarks/dtype_prefill.py``).
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        if not devices.cuda_available():
            return False, "CUDA requested but not available"
        name = torch.cuda.get_device_name(dev)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"CUDA device {name} has native bf16"
        return False, f"CUDA device {name} has no native bf16 (pre-Ampere)"
    if dev.type != "cpu":
        return False, f"device type {dev.type!r}: bf16 speed not known"
    caps = torch.cpu.get_capabilities()
    kernels = torch.backends.cpu.get_cpu_capability()
    cpu = caps.get("cpu_name") or platform.processor() or "this CPU"
    flags = [f for f in ("avx512_bf16", "amx_bf16") if caps.get(f)]
    if not flags:
        return False, f"CPU {cpu} has no native bf16 (no avx512_bf16 or amx_bf16; torch kernels {kernels})"
    if "amx_bf16" not in flags:
        ratio = bf16_matmul_ratio()
        if ratio > BF16_FASTER:
            return False, (
                f"CPU {cpu} has avx512_bf16 but no amx_bf16, and its bf16 matmul took {ratio:.2f}x the float32 "
                f"time (bf16 is taken at <= {BF16_FASTER}x; torch kernels {kernels})"
            )
        return True, f"CPU {cpu} has avx512_bf16 (bf16 matmul {ratio:.2f}x the float32 time; torch kernels {kernels})"
    return True, f"CPU {cpu} has {'+'.join(flags)} (torch kernels {kernels})"


@functools.cache
def bf16_matmul_ratio(rows: int = 256, width: int = 1536, reps: int = 7) -> float:
    """The time of a bfloat16 matmul ``[rows, width] x [width, 4*width]`` on this CPU as a fraction of the
    same matmul's float32 time: best of ``reps`` interleaved runs of each, on one thread (a busy second
    core would otherwise make it noisy: best-of-7 on one thread gave 1.59-1.72 in four runs on a loaded
    2-core Xeon, where 2 threads and 3 runs gave 0.81-1.33); about 1 s in all. Measured once per process
    (cached): the choice of ``dtype="auto"`` must not change within a run. Below 1: bf16 is faster.
    """
    gen = torch.Generator().manual_seed(0)
    a32 = torch.randn(rows, width, generator=gen)
    w32 = torch.randn(width, 4 * width, generator=gen)
    a16, w16 = a32.to(torch.bfloat16), w32.to(torch.bfloat16)
    best = {torch.float32: float("inf"), torch.bfloat16: float("inf")}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _time_matmuls(best, reps, ((torch.float32, (a32, w32)), (torch.bfloat16, (a16, w16))))
    finally:
        torch.set_num_threads(threads)
    return best[torch.bfloat16] / best[torch.float32]


def _time_matmuls(best: dict, reps: int, pairs) -> None:
    """Fill ``best[dtype]`` with the fastest of ``reps`` timed ``a @ w`` per ``(dtype, (a, w))`` pair."""
    for rep in range(reps + 1):  # round 0 warms oneDNN's kernels up and is not counted
        for dt, (a, w) in pairs:
            t0 = time.perf_counter()
            a @ w
            if rep:
                best[dt] = min(best[dt], time.perf_counter() - t0)


def resolve_dtype(dtype: str, device: str | torch.device = "cpu") -> tuple[str, str]:
    """Resolve a dtype choice to ``(dtype name, reason)``.

    ``"auto"`` becomes ``"bfloat16"`` where `native_bf16` says the device computes it natively,
    else ``"float32"``; any other supported name is returned as is with reason ``"requested"``.

    Raises:
        OptionError: a dtype not in `DTYPE_CHOICES` (an ``EventKVError`` naming the ``dtype`` field).
    """
    if dtype == "auto":
        native, why = native_bf16(device)
        return ("bfloat16" if native else "float32"), f"auto: {why}"
    torch_dtype(dtype)
    return dtype, "requested"


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a resolved name (``"float32"``, ``"bfloat16"`` or ``"float16"``; not ``"auto"``).

    Raises:
        OptionError: any other name (an ``EventKVError`` naming the ``dtype`` field).
    """
    if dtype not in _DTYPES:
        raise OptionError("dtype", dtype, f"not supported; use one of {', '.join(DTYPE_CHOICES)}.")
    return _DTYPES[dtype]
