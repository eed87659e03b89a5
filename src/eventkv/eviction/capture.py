"""Capture what the eviction rules read, during one global prefill: per layer
the queries (after RoPE) of the last ``window`` tokens, the attention's scale and the rotary
frequencies, beside the rows the prefill stores. The capture is an attention function registered
under eventkv's own name (``AttentionInterface.register``) and switched on for one model for the
duration of the prefill — nothing else in the process is patched."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from eventkv.eviction.policies import LayerCapture
from eventkv.kv.log import HEADER_ID
from eventkv.kv.model import check_context, model_device, model_forward
from eventkv.kv.prefill import prefill
from eventkv.kv.rows import EventKV, cache_from_rows, cache_kv

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from eventkv.kv.log import TokenizedLog

CAPTURE = "eventkv_capture"
_ACTIVE: dict[Any, Any] | None = None  # the capture in progress: layer -> {"q", "scaling"}


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa attention, recording the layer's last-window queries ``[q_heads, window, head_dim]``."""
    if _ACTIVE is not None:
        slot = _ACTIVE.setdefault(module.layer_idx, {})
        w = _ACTIVE["__window__"]
        q = query[0, :, -w:].detach().float().cpu()
        slot["q"] = q if "q" not in slot else torch.cat([slot["q"], q], dim=1)[:, -w:]
        slot["scaling"] = kwargs.get("scaling")
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(CAPTURE, _capture_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(CAPTURE, sdpa_mask)


def _attention_modules(model) -> list:
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]


@contextmanager
def capturing(model: PreTrainedModel, window: int) -> Iterator[dict[Any, Any]]:
    """A scope in which every forward of ``model`` records, per layer index, its queries after RoPE (``"q"``:
    ``[q_heads, <= window, head_dim]`` float32 on the CPU, the latest ``window`` over the scope's forwards, appended
    forward by forward), the attention's scale (``"scaling"``) and the first forward's rotary cos/sin (``"rope"``).
    A caller may pop a layer's ``"q"`` to start its window again. The model's attention implementation is restored
    on exit."""
    global _ACTIVE
    previous = model.config._attn_implementation
    _ACTIVE = {"__window__": window}
    hooks = []

    def rope_hook(module, args, kwargs):
        pe = kwargs.get("position_embeddings")
        if pe is not None and "rope" not in _ACTIVE.setdefault(module.layer_idx, {}):
            _ACTIVE[module.layer_idx]["rope"] = (pe[0][0].detach().double().cpu(), pe[1][0].detach().double().cpu())

    for m in _attention_modules(model):
        hooks.append(m.register_forward_pre_hook(rope_hook, with_kwargs=True))
    model.set_attn_implementation(CAPTURE)
    try:
        yield _ACTIVE
    finally:
        model.set_attn_implementation(previous)
        for h in hooks:
            h.remove()
        _ACTIVE = None


def _rope_of(cos: torch.Tensor, sin: torch.Tensor, positions: list[int]) -> tuple[torch.Tensor, float] | None:
    """``(inv_freq [d/2], attention_scaling)`` from the first forward's cos/sin rows ``[q, d]``: the
    scale is cos at position 0, the frequencies are the angles at position 1 (< pi, no wrap)."""
    if len(positions) < 2 or positions[0] != 0 or positions[1] != 1:
        return None
    scale = float(cos[0, 0])
    half = cos.shape[-1] // 2
    inv_freq = torch.atan2(sin[1, :half], cos[1, :half])
    if not math.isfinite(scale) or scale <= 0:
        return None
    return inv_freq, scale


@torch.inference_mode()
def capture_prefill(
    model: PreTrainedModel, log: TokenizedLog, *, window: int = 64, max_context: int | None = None
) -> tuple[EventKV, list[LayerCapture]]:
    """Global prefill of ``log`` (one pass, :func:`eventkv.kv.prefill.prefill`) plus what the eviction
    rules read, per layer.

    Returns:
        the EventKV and one :class:`LayerCapture` per layer (keys/values ``[kv_heads, rows, head_dim]``
        float32 on CPU, the log's positions, the last ``window`` queries, scale, rope, event of each row).

    Raises:
        EventKVError: as :func:`eventkv.kv.prefill.prefill`.
    """
    with capturing(model, window) as seen:
        ekv = prefill(model, log, max_context=max_context)
    # the eviction rules compute on the CPU (eventkv.eviction.policies): what they read is copied there
    positions = torch.tensor(log.position_ids, dtype=torch.long, device="cpu")
    event_of_row = torch.full((log.n_rows,), -1, dtype=torch.long, device="cpu")
    for i, eid in enumerate(log.event_ids):
        span = log.span(eid)
        event_of_row[span.row_start : span.row_end] = i
    header = log.span(HEADER_ID)
    assert header.row_start == 0
    qpos = positions[-window:]
    # each layer's output projection (the model's own tensor, not a copy), for rules that weigh a row by what its
    # value adds to the layer's output
    out_proj = [m.o_proj.weight.detach() for m in _attention_modules(model) if hasattr(m, "o_proj")]
    captures = []
    for layer, (k, v) in enumerate(zip(ekv.keys, ekv.values)):
        slot = seen.get(layer, {})
        rope = _rope_of(slot["rope"][0], slot["rope"][1], log.position_ids) if "rope" in slot else None
        q = slot.get("q")
        captures.append(
            LayerCapture(
                layer=layer,
                keys=k[0].float().cpu(),
                values=v[0].float().cpu(),
                positions=positions,
                queries=q,
                query_positions=qpos[-q.shape[1] :] if q is not None else None,
                scaling=slot.get("scaling"),
                rope=rope,
                event_of_row=event_of_row,
                n_layers=len(ekv.keys),
                out_proj=out_proj[layer] if layer < len(out_proj) else None,
            )
        )
    return ekv, captures


@torch.inference_mode()
def capture_reconstruction(
    model: PreTrainedModel, ekv: EventKV, log: TokenizedLog, prompt_ids: list[int], captures: list[LayerCapture]
) -> list[LayerCapture]:
    """The captures of a reconstruction pass (KVzip, Kim et al., arXiv 2505.23416, Section 3): after the
    history's rows, the model reads ``prompt_ids`` (a request to repeat the context, e.g. the chat-wrapped "Repeat
    the previous context exactly.") and then the history's event tokens again, at the positions after the
    history; each row is then scored by the attention the repeated tokens pay it. The history's rows are not
    changed (the pass runs on a copy of the cache).

    Args:
        ekv, log: the history's rows and its tokenized log (as :func:`capture_prefill` returns and reads).
        prompt_ids: the request's token ids.
        captures: the history's :func:`capture_prefill` captures, one per layer.

    Returns:
        ``captures`` with, per layer, ``queries`` / ``query_positions`` the pass's (``[q_heads, R, head_dim]``,
        ``R = len(prompt_ids) + the events' tokens``) and ``extra_keys`` / ``extra_positions`` its keys after RoPE.

    Raises:
        EventKVError: the pass past the model's context (:func:`eventkv.kv.model.check_context`).
    """
    ids = list(prompt_ids) + [t for toks in log.event_tokens for t in toks]
    start = log.history_end
    check_context(start + len(ids), getattr(model.config, "max_position_embeddings", None), what="reconstruction")
    device = model_device(model)
    cache = cache_from_rows([k.clone() for k in ekv.keys], [v.clone() for v in ekv.values])
    input_ids = torch.tensor([ids], device=device)
    positions = torch.arange(start, start + len(ids), device=device)[None]
    with capturing(model, len(ids)) as seen:
        model_forward(model, input_ids, positions, cache, logits_to_keep=1)
    every_key, _ = cache_kv(cache)  # per layer [1, kv_heads, rows + R, head_dim]
    out = []
    for layer, c in enumerate(captures):
        q = seen[layer]["q"]
        keys = every_key[layer][0, :, -len(ids) :].float().cpu()
        pos = positions[0].cpu()
        out.append(dataclasses.replace(c, queries=q, query_positions=pos, extra_keys=keys, extra_positions=pos))
    return out
