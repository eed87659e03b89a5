"""Which kernel a CPU half-precision model's attention runs on: float32 matmuls around a float32 softmax
for short queries instead of torch's fused SDPA kernel.

On a CPU, torch's ``scaled_dot_product_attention`` in bfloat16 is slow where few query tokens meet the
cache. On a 2-core AMD EPYC with AVX512-BF16 (2 threads, qwen2.5-coder-1.5b's 12 query and 2 KV heads
of 128 channels), one layer's attention as transformers calls SDPA against the matmul path: a one-token
decode step over 700 rows 0.71 against 0.10 ms, over 16,000 rows 17 against 1.4 ms; 5 sequences of 3
tokens (a decode step with its draft) over 640 rows 2.1-7.7 (across runs) against 0.6 ms; a 40-token question over
16,000 rows 60 against 31 ms; 128 tokens over 4,000 rows 22 against 19 ms; 229 tokens over 596 rows
10.5 against 10.5 ms, and 512 over 512 9.8 against 10.0 ms. So the matmul path takes a call of at most
:data:`MATMUL_QUERY` query tokens, SDPA the longer ones (``benchmarks/cpu_attention.py``; the table is
in ``docs/devices.md``, "CPU attention kernels"). On a whole model at 8,000 cached rows a one-token
decode step took 160 instead of 378 ms. A float32 model keeps SDPA for every call: the studies'
faithfulness gates and float32 tables are made on it.

The matmul path is the formula of transformers' eager attention (scores, softmax, weighted values)
computed in float32 — as SDPA's kernel computes inside — rather than eager's bfloat16 scores, whose
rounding (about 0.06 on a score of 10) puts the output 1.4-2.6x further from a float64 reference than
SDPA's; in float32 its output is as far from that reference as SDPA's (both are rounded once, to the
model's dtype, at the end). The query heads that share a KV head are stacked into one matrix, so each
key and value is read once and never repeated per query head. Any call the path does not cover — a
float32 or GPU tensor, gradients, dropout in training, a logit soft-cap, attention sinks or a position
bias, a longer query, more than :data:`MATMUL_SCORES` scores — goes to transformers'
``sdpa_attention_forward`` unchanged.

A model gets the matmul path from :func:`eventkv.models.load` where it computes in bfloat16 or float16
on a CPU with SDPA attention (``attention="auto"``, the default, or ``"matmul"``, which says why where it
cannot apply); ``attention="sdpa"`` (or ``EVENTKV_ATTENTION=sdpa``) keeps SDPA for every call. The
attention function is registered with transformers (``AttentionInterface``) under :data:`MATMUL_ATTENTION`,
with SDPA's mask builder, so any model transformers builds with SDPA can use it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from eventkv.options import check_choice_or_env, env_value

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "ATTENTION_CHOICES",
    "ATTENTION_ENV",
    "MATMUL_ATTENTION",
    "MATMUL_QUERY",
    "MATMUL_SCORES",
    "attention_kernel",
    "float32_attention",
    "matmul_attention",
    "resolve_attention",
    "use_attention",
]

ATTENTION_CHOICES = ("auto", "matmul", "sdpa")
ATTENTION_ENV = "EVENTKV_ATTENTION"
"""Environment variable read when ``load(attention=None)``: one of :data:`ATTENTION_CHOICES`."""

MATMUL_ATTENTION = "eventkv_matmul"
"""The name the matmul attention function is registered under (``model.config._attn_implementation``)."""

MATMUL_QUERY = 128
"""The longest query (new tokens of a forward) the matmul path takes: on the AMD EPYC above it was
1.2-2x faster than SDPA from 40 to 138 tokens, even at 229 and slower at 512."""

MATMUL_SCORES = 1 << 26
"""The most float32 scores (batch x query heads x query tokens x keys: 256 MiB) one call of the matmul
path holds at once; a larger call goes to SDPA, whose kernel works in blocks."""

_HALF = (torch.bfloat16, torch.float16)


def matmul_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention as transformers' eager formula in float32, one matmul per KV head group, for a short
    half-precision query on a CPU; every other call through transformers' ``sdpa_attention_forward``.

    Args:
        module: the attention layer (its ``is_causal`` is read when no mask is given).
        query: ``[batch, q_heads, q, head_dim]``.
        key, value: ``[batch, kv_heads, kv, head_dim]``; ``q_heads`` a multiple of ``kv_heads``.
        attention_mask: bool ``[batch, 1, q, kv]`` (True = attend), an additive float mask of that shape,
            or None (causal when the layer is and ``q`` > 1, which transformers leaves to the kernel only
            where ``q`` equals ``kv``; SDPA takes any other such call).
        dropout: attention dropout (only in training, where SDPA takes the call).
        scaling: the score scale (default ``head_dim ** -0.5``).

    Returns:
        ``(output, None)``: output ``[batch, q, q_heads, head_dim]``, contiguous, in the query's dtype.
    """
    b, heads, q, d = query.shape
    kv_heads, kv = key.shape[1], key.shape[2]
    if (
        query.device.type != "cpu"
        or query.dtype not in _HALF
        or key.dtype != query.dtype
        or heads % kv_heads
        or q > MATMUL_QUERY
        or b * heads * q * kv > MATMUL_SCORES
        or (torch.is_grad_enabled() and query.requires_grad)
        or (dropout and module.training)
        or kwargs.get("softcap") is not None
        or kwargs.get("s_aux") is not None
        or kwargs.get("sinks") is not None
        or kwargs.get("position_bias") is not None
        or (attention_mask is None and q > 1 and kv != q)  # SDPA's own reading of a causal call with a cache
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    flag = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if flag is None else bool(flag)
    scale = d**-0.5 if scaling is None else scaling
    return float32_attention(query, key, value, attention_mask, scale, causal), None


def float32_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    """The matmul path's computation, at any length: scores, softmax and weighted values in float32, the
    query heads of each KV head stacked into one matrix (:func:`matmul_attention` bounds where it is used).

    Args:
        query: ``[batch, q_heads, q, head_dim]``; key, value: ``[batch, kv_heads, kv, head_dim]``.
        attention_mask: as :func:`matmul_attention`'s; None hides the later keys when ``causal`` and
            ``q`` > 1 (the query's tokens being the last ``q`` of ``kv`` = ``q`` keys).
        scale: the score scale.

    Returns:
        ``[batch, q, q_heads, head_dim]``, contiguous, in the query's dtype.
    """
    b, heads, q, d = query.shape
    kv_heads, kv = key.shape[1], key.shape[2]
    group = heads // kv_heads
    # query heads h*group .. h*group+group-1 read KV head h (transformers' repeat_kv order): stack them
    stacked = query.reshape(b, kv_heads, group * q, d).float()
    scores = torch.matmul(stacked, key.float().transpose(-1, -2)).view(b, heads, q, kv).mul_(scale)
    if attention_mask is None:
        if q > 1 and causal:
            later = torch.ones(q, kv, dtype=torch.bool, device=query.device).triu_(1)
            scores.masked_fill_(later, torch.finfo(torch.float32).min)
    elif attention_mask.dtype == torch.bool:
        # the float32 minimum, not -inf: a row with no visible key (padding) averages instead of NaN
        scores.masked_fill_(~attention_mask, torch.finfo(torch.float32).min)
    else:
        scores.add_(attention_mask)
    probs = torch.softmax(scores, dim=-1).view(b, kv_heads, group * q, kv)
    out = torch.matmul(probs, value.float()).view(b, heads, q, d)
    return out.to(query.dtype).transpose(1, 2).contiguous()


AttentionInterface.register(MATMUL_ATTENTION, matmul_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(MATMUL_ATTENTION, sdpa_mask)


def resolve_attention(choice: str | None) -> str:
    """``choice``, or :data:`ATTENTION_ENV`'s value when None (default ``"auto"``), checked.

    Raises:
        OptionError: a choice (or environment value) not in :data:`ATTENTION_CHOICES`.
    """
    return check_choice_or_env("attention", choice, ATTENTION_ENV, ATTENTION_CHOICES)


def attention_kernel(model: PreTrainedModel, choice: str = "auto") -> tuple[str, str]:
    """The kernel ``model``'s attention should run on: ``("matmul" | "sdpa" | <its implementation>, reason)``.

    ``"auto"`` and ``"matmul"`` pick the matmul path for a bfloat16 or float16 model on a CPU whose
    attention is SDPA (``"matmul"`` where it cannot: the model's own, with the reason); ``"sdpa"`` keeps
    SDPA. A model loaded with another implementation (``"eager"``, flash attention) keeps it.

    Raises:
        OptionError: a choice not in :data:`ATTENTION_CHOICES`.
    """
    choice = resolve_attention(choice)
    current = model.config.get_text_config(decoder=True)._attn_implementation
    if current not in ("sdpa", MATMUL_ATTENTION):
        return current, f"{current} as loaded (the matmul path replaces SDPA only)"
    if choice == "sdpa":
        return "sdpa", "requested"
    param = next(model.parameters())
    if param.device.type != "cpu" or param.dtype not in _HALF:
        why = f"{str(param.dtype).removeprefix('torch.')} on {param.device.type}: torch's SDPA"
        return "sdpa", why + (" (the matmul path is for bfloat16 and float16 on a CPU)" if choice == "matmul" else "")
    return "matmul", (
        f"{choice}: {str(param.dtype).removeprefix('torch.')} on a CPU: float32 matmul attention for queries of "
        f"at most {MATMUL_QUERY} tokens, SDPA for longer ones"
    )


def use_attention(model: PreTrainedModel, choice: str | None = None) -> tuple[str, str]:
    """Switch ``model``'s attention to the kernel :func:`attention_kernel` picks (in place); returns its
    ``(kernel, reason)``. ``choice`` None reads :data:`ATTENTION_ENV` (default ``"auto"``).

    Raises:
        OptionError: a choice (or environment value) not in :data:`ATTENTION_CHOICES`.
    """
    from_env = choice is None and bool(env_value(ATTENTION_ENV))
    kernel, reason = attention_kernel(model, resolve_attention(choice))
    if from_env:
        reason = f"{reason} ({ATTENTION_ENV})"
    if kernel == "matmul":
        model.set_attn_implementation(MATMUL_ATTENTION)
    elif kernel == "sdpa":
        model.set_attn_implementation("sdpa")
    return kernel, reason
