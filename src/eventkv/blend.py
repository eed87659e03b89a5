"""Selective recompute of served rows: the ``blend`` serving mode (CacheBlend: Yao et al. 2024,
"CacheBlend: Fast Large Language Model Serving for RAG with Cached Knowledge Fusion", arXiv 2405.16444, §4).

A served event's stored rows were computed in the event's original context: the global prefill, where
it attended to every event before it. Served apart (header + the served events only), those rows are
stale where the event leaned on an event that is not served. CacheBlend's observation (§4.2-4.3):
the deviation of a token's K/V from a full prefill is concentrated on a few tokens, and the tokens
that deviate most on an early layer are largely the ones that deviate most on later layers; so
recomputing those few through every layer, and reusing the stored rows of all the others, recovers
most of a full re-prefill's quality at a fraction of its cost (the paper: ~15% of the tokens
recomputed, quality close to a full prefill, 2.2-3.3x lower time to first token).

The algorithm here, hand-written from the paper's method section (no code from its repository):

1. **Deviation** (one early layer, ``select_layer``, default 1). A forward of every served token
   (the header rows as the cache, the served tokens at their original positions, causal among
   themselves) through the first ``select_layer + 1`` decoder layers only (a hook stops the forward
   after that layer). Each token's deviation is the Frobenius norm, over KV heads and head dims, of
   its fresh minus its stored keys and values at that layer,
   ``sqrt(||K_fresh - K_stored||^2 + ||V_fresh - V_stored||^2)`` (float32). Layer 0 is never the
   default: its K/V depend on the token and its position only, so every deviation there is 0.
2. **Choice.** The ``ceil(recompute * n)`` tokens of largest deviation (``n`` served event tokens;
   ties go to the earlier row; the product is rounded to 9 decimals before the ceiling, so 0.15 x
   100 tokens chooses 15). The header is never chosen: it is a prefix of the global prefill, its
   rows are already the fresh ones.
3. **Recompute.** One forward of the chosen tokens only, through every layer, at their original
   positions, over a cache of the header rows and the stored rows of the unchosen served tokens, with
   a 4D attention mask that keeps causality by position: a chosen token sees the cached rows of lower
   positions and the chosen tokens of lower or equal positions, never a cached row of a higher
   position. On sliding-window layers (Gemma 3) the window is counted in rows of the served cache,
   as in ``compact`` serving (a second mask, passed by layer type). The served rows are the stored
   ones with the chosen tokens' rows replaced by the recomputed ones, in row order.

This differs from the paper in one simplification: the paper narrows the recomputed set layer by
layer ("gradual filtering", §4.3); here the set is chosen once, on ``select_layer``, and recomputed
through every layer. Why not a library: LMCache's blending is tied to vLLM's paged-attention kernels
(no transformers path), and kvpress pins transformers < 5.3 (eventkv runs on 5.2x).

Exact ends: ``recompute=0`` runs no forward and gives the ``compact`` rows; ``recompute=1``
recomputes every served token and equals a fresh prefill of header + served events at their
original positions (tested on every tiny architecture: rows and a following query's logits within
1e-4 in float32).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.log import HEADER_ID
from eventkv.prefill import (
    EventKV,
    LayerRows,
    attention_masks,
    cache_from_rows,
    cache_kv,
    forward_until,
    model_device,
    model_forward,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DEFAULT_RECOMPUTE = 0.15
"""The fraction of served event tokens recomputed when none is given (CacheBlend's operating point, §6)."""
SELECT_LAYER = 1
"""The decoder layer (0-based) whose K/V deviation chooses the tokens: the first one whose K/V depend on context."""


def check_recompute(recompute, mode: str = "blend") -> float | None:
    """The recompute fraction for serving mode ``mode``: None for any mode but ``blend``; for ``blend`` the
    given fraction, or :data:`DEFAULT_RECOMPUTE` when None.

    Raises:
        OptionError: a fraction with another mode, or a value that is not a number in [0, 1].
    """
    if mode != "blend":
        if recompute is not None:
            raise OptionError(
                "recompute",
                recompute,
                f"recompute is the fraction of mode 'blend' only (mode is {mode!r}): leave it out.",
            )
        return None
    if recompute is None:
        return DEFAULT_RECOMPUTE
    if isinstance(recompute, bool) or not isinstance(recompute, (int, float)) or not 0.0 <= recompute <= 1.0:
        raise OptionError(
            "recompute", recompute, "give the fraction of served tokens to recompute, a number in [0, 1]."
        )
    return float(recompute)


def n_recomputed(recompute: float, n_tokens: int) -> int:
    """How many of ``n_tokens`` served tokens ``recompute`` chooses: ``ceil(recompute * n_tokens)``, the product
    rounded to 9 decimals first (so float noise never adds a token)."""
    return min(n_tokens, math.ceil(round(recompute * n_tokens, 9)))


@dataclass
class Blend:
    """The blended rows of a served set, in the ``compact`` layout.

    Attributes:
        keys, values: per layer ``[1, kv_heads, rows, head_dim]`` (header rows, then the served events'
            rows in log order), on the model's device.
        rows: ``[rows]`` int64 on the CPU, the EventKV row of each served row.
        chosen: ``[c]`` int64 on the CPU, ascending: the recomputed tokens, as indices into the served event
            tokens (0 = the first served event's first token; the header not counted).
        deviation: ``[n_tokens]`` float32 on the CPU, each served event token's deviation on the selection
            layer, or None when no deviation forward ran (``recompute`` 0 or 1).
    """

    keys: list[LayerRows]
    values: list[LayerRows]
    rows: torch.Tensor
    chosen: torch.Tensor
    deviation: torch.Tensor | None


def causal_masks(
    model: PreTrainedModel, key_order: torch.Tensor, query_order: torch.Tensor
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4D additive attention mask(s) of a forward whose keys are not in position order
    (:func:`eventkv.prefill.attention_masks`).

    Args:
        key_order: ``[kv]`` int64, each key's rank in the served cache (cache rows, then the new tokens).
        query_order: ``[q]`` int64, each new token's rank.

    Raises:
        EventKVError: an attention implementation that takes no 4D mask (flash attention).

    Returns:
        ``[1, 1, q, kv]`` float (the model's dtype; 0 = attend, the dtype's minimum = masked): a query sees
        the keys of rank <= its own; for a model with sliding-window layers a dict by layer type whose
        ``"sliding_attention"`` mask also hides keys ``window`` or more ranks back.
    """
    diff = query_order.unsqueeze(1) - key_order.unsqueeze(0)  # [q, kv]
    return attention_masks(model, diff >= 0, diff)


@torch.inference_mode()
def kv_deviation(
    model: PreTrainedModel, ekv: EventKV, served: Sequence[str], select_layer: int = SELECT_LAYER
) -> torch.Tensor:
    """Each served event token's K/V deviation on ``select_layer`` (step 1 of the module docstring).

    Args:
        served: event ids in log order (as :func:`eventkv.serve.resolve_served` returns them).

    Returns:
        ``[n_tokens]`` float32 on the CPU, in row order (the header not counted).

    Raises:
        EventKVError: ``select_layer`` outside the model's layers.
    """
    n_layers = len(ekv.keys)
    if not 0 <= select_layer < n_layers:
        raise EventKVError(f"select_layer {select_layer} is not a layer of this {n_layers}-layer model.")
    device = model_device(model)
    h = ekv.log.span(HEADER_ID).n_tokens
    tok_rows = ekv.rows_of(served, include_header=False)
    n = int(tok_rows.shape[0])
    ids = torch.tensor([[ekv.log.input_ids[r] for r in tok_rows.tolist()]], device=device)
    pos = ekv.positions[tok_rows].to(device).unsqueeze(0)
    cache = cache_from_rows([k[:, :, :h] for k in ekv.keys], [v[:, :, :h] for v in ekv.values])
    order = torch.arange(h + n, device=device)
    mask = causal_masks(model, order, order[h:])

    with forward_until(model.get_decoder().layers[select_layer]):  # layers after the selection layer are not needed
        model_forward(model, ids, pos, cache, mask, logits_to_keep=1)
    keys, values = cache_kv(cache)
    rows = tok_rows.to(device)
    dk = keys[select_layer][:, :, h:].float() - ekv.keys[select_layer].index_select(2, rows).float()
    dv = values[select_layer][:, :, h:].float() - ekv.values[select_layer].index_select(2, rows).float()
    return (dk.square().sum(dim=(0, 1, 3)) + dv.square().sum(dim=(0, 1, 3))).sqrt().cpu()


def choose(deviation: torch.Tensor, recompute: float) -> torch.Tensor:
    """The tokens to recompute (step 2): indices ``[c]`` int64, ascending, of the
    ``n_recomputed(recompute, n)`` largest of ``deviation`` ``[n]`` (ties to the lower index)."""
    c = n_recomputed(recompute, int(deviation.shape[0]))
    order = torch.sort(deviation, descending=True, stable=True).indices
    return order[:c].sort().values


@torch.inference_mode()
def blend(
    model: PreTrainedModel,
    ekv: EventKV,
    served: Sequence[str],
    recompute: float = DEFAULT_RECOMPUTE,
    *,
    select_layer: int = SELECT_LAYER,
) -> Blend:
    """The served set's rows with the ``recompute`` fraction of most-deviating tokens recomputed (the module
    docstring's three steps; CacheBlend, arXiv 2405.16444, §4).

    Args:
        served: event ids in log order (as :func:`eventkv.serve.resolve_served` returns them).
        recompute: fraction of the served event tokens recomputed, in [0, 1] (0: the stored rows, no forward;
            1: every token, no deviation forward).
        select_layer: the decoder layer whose deviation chooses the tokens.

    Returns:
        :class:`Blend` (compact layout: header rows, then the served events' rows).

    Raises:
        OptionError: ``recompute`` outside [0, 1].
        EventKVError: ``select_layer`` outside the model's layers; rows of another dtype or device than the
            model's.
    """
    recompute = check_recompute(recompute) or 0.0
    rows = ekv.rows_of(served)
    device = ekv.keys[0].device
    keys = [k.index_select(2, rows.to(device)) for k in ekv.keys]
    values = [v.index_select(2, rows.to(device)) for v in ekv.values]
    h = ekv.log.span(HEADER_ID).n_tokens
    n = int(rows.shape[0]) - h
    c = n_recomputed(recompute, n)
    deviation = None
    if c == 0:
        chosen = torch.zeros(0, dtype=torch.long, device="cpu")  # bookkeeping: row ranks
    elif c == n:
        chosen = torch.arange(n, device="cpu")
    else:
        deviation = kv_deviation(model, ekv, served, select_layer)
        chosen = choose(deviation, recompute)
    c = int(chosen.shape[0])
    if c == 0:
        return Blend(keys, values, rows, chosen, deviation)
    mdev = model_device(model)
    keep = torch.ones(n, dtype=torch.bool, device="cpu")
    keep[chosen] = False
    cached = torch.cat([torch.arange(h, device="cpu"), h + torch.nonzero(keep).squeeze(1)])  # ranks in the served cache
    cache = cache_from_rows(
        [k.index_select(2, cached.to(device)) for k in keys], [v.index_select(2, cached.to(device)) for v in values]
    )
    ranks = h + chosen
    ids = torch.tensor([[ekv.log.input_ids[r] for r in rows[ranks].tolist()]], device=mdev)
    pos = ekv.positions[rows[ranks]].to(mdev).unsqueeze(0)
    mask = causal_masks(model, torch.cat([cached, ranks]).to(mdev), ranks.to(mdev))
    model_forward(model, ids, pos, cache, mask, logits_to_keep=1)
    new_keys, new_values = cache_kv(cache)
    at = ranks.to(device)
    for layer in range(len(keys)):
        keys[layer].index_copy_(2, at, new_keys[layer][:, :, -c:])
        values[layer].index_copy_(2, at, new_values[layer][:, :, -c:])
    return Blend(keys, values, rows, chosen, deviation)
