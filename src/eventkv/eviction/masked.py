"""Native serving with a per-(layer, KV head) keep mask: every row stays in the
cache at its position and each head of each layer attends only to the rows its mask keeps — what
a per-head eviction policy (SnapKV, Knorm, ...) presents, without moving a row. An attention
function registered under eventkv's own name applies the masks; it is switched on for one model
only inside :func:`head_masked`."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Sequence

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from eventkv.errors import EventKVError
from eventkv.kv.model import model_device
from eventkv.kv.readout import Readout, read_out
from eventkv.kv.serve import ServedCache, serve

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from eventkv.kv.rows import EventKV

HEAD_MASKED = "eventkv_head_masked"
_MASKS: dict[int, torch.Tensor] | None = None  # layer -> [kv_heads, rows] bool, while head_masked is active


def masked_attention(module, query, key, value, attention_mask, **kwargs):
    """sdpa attention where the first ``rows`` key columns of layer ``module.layer_idx`` are hidden
    per KV head by the active mask (the query's own and later columns stay visible).

    Shapes: query ``[batch, q_heads, q, head_dim]``; key/value ``[batch, kv_heads, kv, head_dim]``;
    attention_mask bool ``[batch, 1, q, kv]`` (or None); mask ``[kv_heads, rows]`` with rows <= kv.
    """
    mask = None if _MASKS is None else _MASKS.get(module.layer_idx)
    if mask is not None:
        b, q_heads, q, _ = query.shape
        kv = key.shape[2]
        rows = mask.shape[1]
        group = q_heads // mask.shape[0]
        per_head = torch.ones(q_heads, kv, dtype=torch.bool, device=query.device)
        per_head[:, :rows] = mask.repeat_interleave(group, dim=0)  # on the model's device (head_masked)
        per_head = per_head[None, :, None, :].expand(b, q_heads, q, kv)
        if attention_mask is None:  # sdpa_mask left causality to is_causal: spell it out
            cols = torch.arange(kv, device=query.device)
            last = kv - q + torch.arange(q, device=query.device)
            attention_mask = per_head & (cols[None, :] <= last[:, None])[None, None]
        elif attention_mask.dtype == torch.bool:
            attention_mask = attention_mask & per_head
        else:  # an additive float mask
            attention_mask = attention_mask.masked_fill(~per_head, torch.finfo(attention_mask.dtype).min)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register(HEAD_MASKED, masked_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(HEAD_MASKED, sdpa_mask)


@contextmanager
def head_masked(model: PreTrainedModel, masks: dict[int, torch.Tensor]):
    """Inside the block, ``model``'s attention hides, per layer and KV head, the cache rows whose
    mask entry is False (``masks[layer]``: ``[kv_heads, rows]`` bool, on any device: moved to the
    model's once, here, not in every forward; a layer without a mask sees every row). Not re-entrant;
    one model at a time.

    Raises:
        EventKVError: a mask that is not 2-D bool.
    """
    global _MASKS
    for layer, m in masks.items():
        if m.dtype != torch.bool or m.ndim != 2:
            raise EventKVError(
                f"the mask of layer {layer} must be [kv_heads, rows] bool, got {m.dtype} {tuple(m.shape)}."
            )
    if _MASKS is not None:
        raise EventKVError("head_masked is already active: nest no head-masked readouts.")
    previous = model.config._attn_implementation
    dev = model_device(model)
    _MASKS = {layer: m.to(dev) for layer, m in masks.items()}
    model.set_attn_implementation(HEAD_MASKED)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
        _MASKS = None


def read_out_masked(
    model: PreTrainedModel,
    cache: EventKV | ServedCache,
    masks: Sequence[torch.Tensor] | dict[int, torch.Tensor],
    query_ids: Sequence[int],
    *,
    key_channels: Sequence[torch.Tensor | None] | None = None,
    **options: Any,
) -> Readout:
    """Answer a query from every row of ``cache`` — an EventKV (native serving of its global
    prefill) or a ServedCache holding every row (e.g. :func:`eventkv.kv.serve.serve` in ``isolated``
    mode over ``"all"``), rows at their positions — with each layer's heads restricted to their kept
    rows (``masks``: per layer ``[kv_heads, rows]`` bool, as :func:`eventkv.eviction.keep_mask`
    gives). ``key_channels``: per layer ``[kv_heads, head_dim]`` bool, the key channels kept (the others read as
    0 in every row, as ThinK prunes them: :meth:`eventkv.eviction.Policy.key_channels`), or None. ``options`` go to
    :func:`eventkv.kv.readout.read_out`; with ``candidates`` the candidates are scored, else the answer is
    generated.

    Raises:
        EventKVError: a mask of another head or row count than the cache's layer; as :func:`read_out`.
    """
    served = serve(cache, "all", "native") if not isinstance(cache, ServedCache) else cache
    if key_channels is not None:
        keys = [
            k if ch is None else k * ch.to(device=k.device, dtype=k.dtype)[None, :, None, :]
            for k, ch in zip(served.keys, key_channels)
        ]
        served = dataclasses.replace(served, keys=keys)
    by_layer = dict(masks) if isinstance(masks, dict) else dict(enumerate(masks))
    for layer, m in by_layer.items():
        shape = (served.keys[layer].shape[1], served.n_rows)
        if tuple(m.shape) != shape:
            raise EventKVError(
                f"the mask of layer {layer} is {tuple(m.shape)}, the cache's layer is {shape} (KV heads, rows): "
                "give one [kv_heads, rows] mask per layer."
            )
    score = bool(options.get("candidates"))
    with head_masked(model, by_layer):
        return read_out(model, [served], query_ids, generate=[not score], score=[score], **options)[0]
