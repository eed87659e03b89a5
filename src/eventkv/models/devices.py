"""Choosing the device a model runs on: ``"auto"`` is the CUDA GPU when torch sees one, else the CPU.

Where a model runs is provenance, not part of what a result *is*: a run's identity names its dtype
(bfloat16 and float32 give materially different numbers), while the device, like the CPU's kernels and
the thread count, only changes the rounding of one dtype's reductions. See ``docs/devices.md``.
"""

from __future__ import annotations

import torch

from eventkv.errors import OptionError
from eventkv.options import check_device

__all__ = ["cuda_available", "resolve_device"]


def cuda_available() -> bool:
    """Whether torch sees a usable CUDA GPU (``torch.cuda.is_available()``), under one name.

    Why a function of our own: the test suite pins it to False outside the tests marked ``cuda``, so
    that ``auto`` is the CPU there on every machine and the CPU tests' expected values hold on a GPU
    machine too (``tests/conftest.py``).
    """
    return torch.cuda.is_available()


def resolve_device(device: str = "auto") -> tuple[str, str]:
    """Resolve a device choice to ``(torch device string, reason)``.

    ``"auto"`` becomes ``"cuda"`` (torch's current GPU, normally ``cuda:0``) when :func:`cuda_available`,
    else ``"cpu"``; ``"cpu"``, ``"cuda"`` and ``"cuda:N"`` are kept when this machine has them. The reason
    says what was found, e.g. ``"auto: CUDA device NVIDIA H200"`` or ``"auto: no CUDA device (torch.cuda
    .is_available() is False)"``; ``"requested"`` for ``cpu``.

    Raises:
        OptionError: a value other than auto, cpu, cuda or cuda:N; ``cuda``/``cuda:N`` where torch sees no
            CUDA GPU (no GPU, no driver, or a CPU-only torch build), or ``cuda:N`` past the last GPU.
    """
    check_device(device)
    if device == "cpu":
        return "cpu", "requested"
    have = cuda_available()
    if device == "auto":
        if not have:
            return "cpu", "auto: no CUDA device (torch.cuda.is_available() is False)"
        return "cuda", f"auto: CUDA device {torch.cuda.get_device_name()}"
    if not have:
        raise OptionError(
            "device",
            device,
            "torch sees no CUDA GPU here (torch.cuda.is_available() is False: no GPU, no driver, or a CPU-only "
            "torch build); use cpu, or auto (which picks the CPU here).",
        )
    index = int(device.partition(":")[2] or torch.cuda.current_device())
    count = torch.cuda.device_count()
    if index >= count:
        have_list = ", ".join(f"cuda:{i}" for i in range(count))
        raise OptionError(
            "device", device, f"this machine has {count} CUDA GPU(s) ({have_list}); use one of them, cpu or auto."
        )
    return device, f"requested: CUDA device {torch.cuda.get_device_name(index)}"
