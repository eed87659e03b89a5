"""Which kernel a CPU float32 model's linear layers run on: oneDNN instead of torch's default MKL sgemm.

On a CPU, torch runs a float32 ``nn.Linear`` through MKL's sgemm (``aten::addmm``); oneDNN, which torch
already uses for bfloat16 linears, is reached for float32 only through its own op
``torch.ops.mkldnn._linear_pointwise`` (what torch's compiler emits for CPU linears). On the shapes a
donor pair and a served query run (one-token decode steps of 1-8 sequences, 20-450-token prefills)
one forward of qwen2.5-coder-1.5b (hidden size 1,536) on a 2-core AMD EPYC (AVX2 only, 2 threads) ran
1.2-2.3x faster on oneDNN where few tokens read all the weights (decode steps, 22-176-token forwards)
and even (0.88-1.14x across runs) on prefills of 276-458 tokens; on smollm2-135m (hidden size 576) the
two were even throughout (``benchmarks/cpu_linear.py``; the tables are in ``docs/devices.md``,
"CPU linear kernels").

The two differ only in the order of float32 sums: logits within 1.4e-4 (qwen2.5-coder-1.5b) and 1.9e-4
(smollm2-135m) on those forwards. A model
gets oneDNN linears from :func:`eventkv.models.load` where it computes in float32 on a CPU and the op is
there and agrees with ``F.linear`` on a probe; ``linear="torch"`` (or ``EVENTKV_LINEAR=torch``) keeps
torch's own. Only the forward is replaced (the module, its weight and any tied weight stay as they
are); a call that needs gradients, or gets another dtype or device, goes through ``F.linear``.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING

import torch

from eventkv.options import check_choice_or_env, env_value

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["LINEAR_CHOICES", "linear_kernel", "linear_kernel_of", "resolve_linear", "use_linear"]

LINEAR_CHOICES = ("auto", "onednn", "torch")
LINEAR_ENV = "EVENTKV_LINEAR"
"""Environment variable read when ``load(linear=None)``: one of :data:`LINEAR_CHOICES`."""

_PROBE_TOL = 1e-4  # relative: a float32 reduction of 64 terms reordered differs by ~1e-6


def _onednn_op():
    """``torch.ops.mkldnn._linear_pointwise`` where this torch has it with oneDNN, else None."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    w = self.weight
    if x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu" or w.device.type != "cpu":
        return torch.nn.functional.linear(x, w, self.bias)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):  # the op has no backward
        return torch.nn.functional.linear(x, w, self.bias)
    return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, "none", [], "")


def _agrees(op) -> str | None:
    """None when the op computes ``F.linear`` on a probe (with and without bias, 2D and 3D input), else why not."""
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(48, 64, generator=g), torch.randn(48, generator=g)
    x = torch.randn(2, 5, 64, generator=g)
    try:
        with torch.inference_mode():
            for args in ((x, w, b), (x[0], w, None)):
                got = op(*args, "none", [], "")
                want = torch.nn.functional.linear(*args)
                if got.shape != want.shape or not torch.allclose(got, want, rtol=_PROBE_TOL, atol=_PROBE_TOL):
                    return "oneDNN's linear disagreed with F.linear on a probe"
    except RuntimeError as e:
        return f"oneDNN's linear failed on a probe ({str(e).splitlines()[0]})"
    return None


def linear_kernel(model: PreTrainedModel, choice: str = "auto") -> tuple[str, str]:
    """The kernel ``model``'s linear layers should run on: ``("onednn" | "torch", reason)``.

    ``"auto"`` and ``"onednn"`` pick oneDNN for a float32 model on a CPU where torch has the op and it
    agrees with ``F.linear`` on a probe (``"onednn"`` where it cannot: torch's, with the reason);
    ``"torch"`` always keeps torch's.

    Raises:
        OptionError: a choice not in :data:`LINEAR_CHOICES`.
    """
    choice = resolve_linear(choice)
    if choice == "torch":
        return "torch", "requested"
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype != torch.float32:
        why = f"{str(param.dtype).removeprefix('torch.')} on {param.device.type}: torch's own kernels"
        return "torch", why + (" (oneDNN linears are for float32 on a CPU)" if choice == "onednn" else "")
    op = _onednn_op()
    if op is None:
        return "torch", "this torch has no oneDNN linear op"
    why_not = _agrees(op)
    if why_not is not None:
        return "torch", why_not
    return "onednn", f"{choice}: float32 on a CPU: oneDNN linears instead of MKL sgemm"


def resolve_linear(choice: str | None) -> str:
    """``choice``, or :data:`LINEAR_ENV`'s value when None (default ``"auto"``), checked.

    Raises:
        OptionError: a choice (or environment value) not in :data:`LINEAR_CHOICES`.
    """
    return check_choice_or_env("linear", choice, LINEAR_ENV, LINEAR_CHOICES)


def use_linear(model: PreTrainedModel, choice: str | None = None) -> tuple[str, str]:
    """Route every ``nn.Linear`` of ``model`` through the kernel :func:`linear_kernel` picks (in place);
    returns its ``(kernel, reason)``. ``choice`` None reads :data:`LINEAR_ENV` (default ``"auto"``).

    Raises:
        OptionError: a choice (or environment value) not in :data:`LINEAR_CHOICES`.
    """
    from_env = choice is None and bool(env_value(LINEAR_ENV))
    kernel, reason = linear_kernel(model, resolve_linear(choice))
    if from_env:
        reason = f"{reason} ({LINEAR_ENV})"
    model.eventkv_linear_kernel = kernel  # type: ignore[assignment]  # read by linear_kernel_of
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            if kernel == "onednn":
                module.forward = types.MethodType(_forward, module)  # type: ignore[method-assign]
            else:
                module.__dict__.pop("forward", None)  # back to the class's F.linear
    return kernel, reason


def linear_kernel_of(model: torch.nn.Module) -> str:
    """The kernel :func:`use_linear` gave ``model``'s linears: ``"onednn"``, or ``"torch"`` (also for a model
    it was never called on)."""
    return str(getattr(model, "eventkv_linear_kernel", "torch"))
