"""Choosing the dtype a model computes in: ``"auto"`` picks bfloat16 only where the hardware has it natively."""

from __future__ import annotations

import platform

import torch

from eventkv.errors import OptionError
from eventkv.models import devices
from eventkv.options import DTYPE_CHOICES

__all__ = ["native_bf16", "resolve_dtype", "torch_dtype"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def native_bf16(device: str | torch.device = "cpu") -> tuple[bool, str]:
    """Whether ``device`` computes bfloat16 natively, and what was detected (one line).

    CUDA: where the GPU has bf16 arithmetic (Ampere and later:
    ``torch.cuda.is_bf16_supported(including_emulation=False)``).
    CPU: only where the CPU has AVX512-BF16 or AMX-BF16 (read from cpuinfo through
    ``torch.cpu.get_capabilities()``). Without them bf16 is converted in software: on an AVX2-only
    AMD EPYC a 700-token prefill of qwen2.5-coder-1.5b took 116 s in bf16 vs 19 s in float32.
    torch's own kernel level (``ATEN_CPU_CAPABILITY``) is reported and, on a CPU without AMX, not
    used: the matmuls go through oneDNN, which uses AVX512-BF16 whatever that variable says (measured
    on an AMD EPYC with avx512_bf16 under ``ATEN_CPU_CAPABILITY=avx2``: bf16 prefill 0.28x the float32
    time; ``benchmarks/dtype_prefill.py``). On a CPU with AMX-BF16 whose torch kernels are held below
    AVX512 (``ATEN_CPU_CAPABILITY=avx2``) bf16 is not native: torch 2.13's CPU attention (scaled dot
    product, flash kernel) packs bf16 for AMX there and refuses sequences of ~100 tokens and more
    (``RuntimeError: pack_vnni2 is only supported when avx512 is supported``; seen on an Intel Xeon
    with amx_bf16), so ``auto`` is float32.
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
    if caps.get("amx_bf16") and not kernels.upper().startswith("AVX512"):
        return False, (
            f"CPU {cpu} has {'+'.join(flags)} but torch kernels {kernels} (ATEN_CPU_CAPABILITY): torch's bf16 "
            "attention needs AVX512 kernels on an AMX CPU"
        )
    return True, f"CPU {cpu} has {'+'.join(flags)} (torch kernels {kernels})"


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
