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

The algorithm here, hand-written from the papers' method sections (no code from their repositories):

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

**Schedules** (``schedule``, :data:`BlendSchedule`; the default, ``once``, is the behaviour above):

* ``once`` — the set is chosen once, on ``select_layer``, and recomputed on every layer.
* ``layerwise`` — CacheBlend's "gradual filtering" (§4.3): the set narrows layer by layer. The initial set,
  ``min(1, 2 x recompute)`` of the served tokens (:data:`LAYERWISE_START`; the paper asks only for a
  "slightly higher" initial fraction), is chosen as in step 2 and recomputed on layers ``0 .. select_layer``;
  on each layer from ``select_layer`` on, the tokens still recomputed are ranked by their deviation on that
  layer (their recomputed minus their stored K/V, as in step 1) and the top ones are kept for the next layer,
  the fraction falling in a straight line to ``recompute`` on the last layer (:func:`layer_fractions`; a
  model with no layer after ``select_layer`` keeps ``recompute`` throughout, which is ``once``). On a layer,
  a token outside the set contributes its stored rows. One forward carries the initial set through every
  layer (a transformers forward runs one token set through all layers) with a cache that, on each layer,
  swaps the dropped tokens' new K/V for their stored rows before attention and narrows the set
  (``Cache.update`` is the only per-layer seam that sees them): the rows are those of per-layer forwards
  (tested against them), the compute is that of the initial set on every layer, not the paper's saving.
* ``epic`` — EPIC's "LegoLink" (Hu et al. 2024, "EPIC: Efficient Position-Independent Context Caching for
  Serving Large Language Models", arXiv 2410.15332, §4): the first ``ceil(recompute x t)`` tokens of each
  served event of ``t`` tokens, chosen by position (no deviation forward), recomputed on every layer as
  in step 3. EPIC recomputes a fixed number of tokens per chunk; a fraction of each event keeps
  ``recompute`` one budget across schedules.
* ``suffix`` — the last ``ceil(recompute x n)`` served tokens in serving order, recomputed on every layer as in
  step 3 (no deviation forward): the rows before them serve as they are and the suffix is prefilled fresh over
  them, as text would be. Which tokens those are is the serving order's choice: in log order the latest
  events; under ``positions="contiguous"`` with a ``sequence`` in relevance order (the memory's default plan,
  the best-ranked event last) the best-ranked events, re-read in full where their own rows answer worse
  than their text (``docs/memory.md``, "Where rows trail text"). Not a method of either paper: the
  question's nearest served tokens recomputed, where CacheBlend recomputes the most deviating ones and EPIC
  the first of each chunk.

Why not a library: LMCache's blending is tied to vLLM's paged-attention kernels (no transformers path), and
kvpress pins transformers < 5.3 (eventkv runs on 5.2x).

Exact ends, every schedule: ``recompute=0`` runs no forward and gives the ``compact`` rows; ``recompute=1``
recomputes every served token and equals a fresh prefill of header + served events at their original
positions (tested on every tiny architecture: rows and a following query's logits within 1e-4 in float32).

**What the recompute moves towards.** CacheBlend's stored chunks were encoded with *less* context than the
answer needs (each chunk alone), so a fresh prefill is the better cache and recompute closes the gap. Here
the stored rows were computed with *more* context (the whole history, of which the served set is a part):
a fresh prefill of header + served events drops what the rows took from the unserved events. Measured on
tiny random models (6 layers, weights N(0, 0.08), 10 events, 6 served sets of 3; KL of the next-token
distribution over a 13-token query, nats): no bug; every schedule moves the rows towards the fresh
prefill, and no set in any model ended further from it than ``compact``; recomputed tokens attending to
stale rows cost 1-10% of that KL against splicing in the fresh rows themselves; and the rows move away from
the whole history's (Llama: KL from the whole history 0.013 for ``compact``, 0.015 / 0.024 for ``once`` at
0.15 / 0.3, 0.093 at 1.0). Random weights give no answers to score, and on LoCoMo a fresh prefill of the
served turns at contiguous positions (``text``) beats rows, so the loss of blend against rows there may
come from where the recompute runs: at the original positions, across the gaps left by unserved events.
``docs/memory.md`` ("Selective recompute") gives the table.

**Positions** (``positions=``): every step above runs at the rows' original positions by default. Under
``contiguous`` the served rows are laid out after the header (in log order, or in ``sequence``), their stored
keys re-rotated to the positions right after the header (:func:`eventkv.kv.rope.rerotate`) before step 1, and
steps 1 and 3 run at those positions: CacheBlend's placement of reused chunks, so that ``recompute=1`` is a
fresh prefill of header + served events at contiguous positions (the ``text`` serving mode; tested like the
original-positions end). The default stays ``once`` until a LoCoMo measurement shows a schedule
beating plain rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Sequence, get_args

import torch
from transformers import DynamicCache

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.log import HEADER_ID, check_sequence
from eventkv.kv.model import attention_masks, forward_until, model_device, model_forward
from eventkv.kv.rope import rerotate
from eventkv.kv.rows import EventKV, LayerRows, cache_from_rows, cache_kv

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DEFAULT_RECOMPUTE = 0.15
"""The fraction of served event tokens recomputed when none is given (CacheBlend's operating point, §6)."""
SELECT_LAYER = 1
"""The decoder layer (0-based) whose K/V deviation chooses the tokens: the first one whose K/V depend on context."""
BlendSchedule = Literal["once", "layerwise", "epic", "suffix"]
"""Which served tokens are recomputed on which layer (see the module docstring): ``once`` (chosen on
``select_layer``, recomputed on every layer), ``layerwise`` (CacheBlend's gradual filtering, §4.3), ``epic``
(the first tokens of each served event: EPIC's LegoLink), ``suffix`` (the last served tokens, nearest the
query)."""
BlendPositions = Literal["original", "contiguous"]
"""Where a blend runs: at the rows' original positions, or re-rotated to contiguous positions after the header."""
BLEND_SCHEDULES: tuple[BlendSchedule, ...] = get_args(BlendSchedule)
DEFAULT_SCHEDULE: BlendSchedule = "once"
"""The schedule when none is given."""
LAYERWISE_START = 2.0
"""``layerwise``: the initial set is this many times the target fraction (capped at every token); the paper
(§4.3) asks only for an initial fraction "slightly higher" than the target and leaves the value open."""


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


def check_schedule(schedule, mode: str = "blend") -> BlendSchedule | None:
    """The recompute schedule for serving mode ``mode``: None for any mode but ``blend``; for ``blend`` the
    given schedule, or :data:`DEFAULT_SCHEDULE` when None.

    Raises:
        OptionError: a schedule with another mode, or one not in :data:`BLEND_SCHEDULES`.
    """
    if mode != "blend":
        if schedule is not None:
            raise OptionError(
                "blend_schedule",
                schedule,
                f"blend_schedule is an option of mode 'blend' only (mode is {mode!r}): leave it out.",
            )
        return None
    if schedule is None:
        return DEFAULT_SCHEDULE
    if schedule not in BLEND_SCHEDULES:
        raise OptionError("blend_schedule", schedule, f"use one of {', '.join(BLEND_SCHEDULES)}.")
    return schedule


def n_recomputed(recompute: float, n_tokens: int) -> int:
    """How many of ``n_tokens`` served tokens ``recompute`` chooses: ``ceil(recompute * n_tokens)``, the product
    rounded to 9 decimals first (so float noise never adds a token)."""
    return min(n_tokens, math.ceil(round(recompute * n_tokens, 9)))


@dataclass
class Blend:
    """The blended rows of a served set, in the ``compact`` layout.

    Attributes:
        keys, values: per layer ``[1, kv_heads, rows, head_dim]`` (header rows, then the served events'
            rows in serving order), on the model's device.
        rows: ``[rows]`` int64 on the CPU, the EventKV row of each served row.
        positions: ``[rows]`` int64 on the CPU, the position each served row is rotated at (the original ones,
            or ``h0, h0+1, ...`` from the header's first position under ``positions="contiguous"``).
        chosen: ``[c]`` int64 on the CPU, ascending: the tokens the recompute forward ran (for ``layerwise``, the
            initial set), as indices into the served event tokens (0 = the first served event's first token;
            the header not counted).
        deviation: ``[n_tokens]`` float32 on the CPU, each served event token's deviation on the selection
            layer, or None when no deviation forward ran (``recompute`` 0, an initial set of every token,
            schedules ``epic`` and ``suffix``).
        layer_chosen: per layer ``[c_layer]`` int64 on the CPU, ascending: the tokens whose rows on that layer are
            recomputed ones (the others keep their stored rows); ``chosen`` on every layer but for ``layerwise``.
    """

    keys: list[LayerRows]
    values: list[LayerRows]
    rows: torch.Tensor
    positions: torch.Tensor
    chosen: torch.Tensor
    deviation: torch.Tensor | None
    layer_chosen: list[torch.Tensor]


def causal_masks(
    model: PreTrainedModel, key_order: torch.Tensor, query_order: torch.Tensor
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4D additive attention mask(s) of a forward whose keys are not in position order
    (:func:`eventkv.kv.model.attention_masks`).

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


@dataclass
class _Layout:
    """The served set laid out as it will be served: header rows, then each served event's rows in serving order.

    ``rows`` ``[h + n]`` (EventKV rows, CPU), ``positions`` ``[h + n]`` (the positions the rows are served and
    recomputed at, CPU), ``ids`` (the token id of each row), ``keys`` / ``values`` per layer
    ``[1, kv_heads, h + n, head_dim]`` (the stored rows, keys re-rotated to ``positions``), ``h`` header rows,
    ``widths`` each served event's token count in serving order."""

    rows: torch.Tensor
    positions: torch.Tensor
    ids: list[int]
    keys: list[LayerRows]
    values: list[LayerRows]
    h: int
    widths: list[int]


def _layout(
    model: PreTrainedModel,
    ekv: EventKV,
    served: Sequence[str],
    positions: BlendPositions,
    sequence: Sequence[str] | None,
) -> _Layout:
    if positions not in ("original", "contiguous"):
        raise OptionError("positions", positions, "use 'original' or 'contiguous'.")
    if sequence is not None and positions != "contiguous":
        raise OptionError(
            "sequence", list(sequence), "a serving order other than the log's needs positions='contiguous'."
        )
    order = list(served) if sequence is None else list(check_sequence(served, sequence))
    header = ekv.log.span(HEADER_ID)
    spans = [header] + [ekv.log.span(e) for e in order]
    rows = torch.cat([torch.arange(s.row_start, s.row_end, device="cpu") for s in spans])
    stored_at = ekv.positions[rows]
    if positions == "contiguous":
        start = int(stored_at[0]) if rows.numel() else 0
        at = torch.arange(start, start + int(rows.shape[0]), dtype=stored_at.dtype, device="cpu")
    else:
        at = stored_at
    device = ekv.keys[0].device
    sel = rows.to(device)
    keys = [k.index_select(2, sel) for k in ekv.keys]  # copies: the blend writes into them, never into the EventKV
    values = [v.index_select(2, sel) for v in ekv.values]
    if positions == "contiguous":
        keys = rerotate(model, keys, stored_at, at)
    ids = [ekv.log.input_ids[r] for r in rows.tolist()]
    return _Layout(rows, at, ids, keys, values, header.n_tokens, [s.n_tokens for s in spans[1:]])


def _deviation(model: PreTrainedModel, lay: _Layout, select_layer: int) -> torch.Tensor:
    n_layers = len(lay.keys)
    if not 0 <= select_layer < n_layers:
        raise EventKVError(f"select_layer {select_layer} is not a layer of this {n_layers}-layer model.")
    device = model_device(model)
    h = lay.h
    n = int(lay.rows.shape[0]) - h
    ids = torch.tensor([lay.ids[h:]], device=device)
    pos = lay.positions[h:].to(device).unsqueeze(0)
    cache = cache_from_rows([k[:, :, :h] for k in lay.keys], [v[:, :, :h] for v in lay.values])
    order = torch.arange(h + n, device=device)
    mask = causal_masks(model, order, order[h:])
    with forward_until(model.get_decoder().layers[select_layer]):  # layers after the selection layer are not needed
        model_forward(model, ids, pos, cache, mask, logits_to_keep=1)
    keys, values = cache_kv(cache)
    dk = keys[select_layer][:, :, h:].float() - lay.keys[select_layer][:, :, h:].to(keys[select_layer].device).float()
    dv = (
        values[select_layer][:, :, h:].float()
        - lay.values[select_layer][:, :, h:].to(keys[select_layer].device).float()
    )
    return (dk.square().sum(dim=(0, 1, 3)) + dv.square().sum(dim=(0, 1, 3))).sqrt().cpu()


@torch.inference_mode()
def kv_deviation(
    model: PreTrainedModel,
    ekv: EventKV,
    served: Sequence[str],
    select_layer: int = SELECT_LAYER,
    *,
    positions: BlendPositions = "original",
    sequence: Sequence[str] | None = None,
) -> torch.Tensor:
    """Each served event token's K/V deviation on ``select_layer`` (step 1 of the module docstring).

    Args:
        served: event ids in log order (as :func:`eventkv.kv.serve.resolve_served` returns them).
        positions: where the served tokens are run and their stored rows compared: ``original`` (the positions they
            were prefilled at) or ``contiguous`` (right after the header, the stored keys re-rotated there).
        sequence: ``contiguous`` only: the served events in serving order (None: log order).

    Returns:
        ``[n_tokens]`` float32 on the CPU, in serving order (the header not counted).

    Raises:
        EventKVError: ``select_layer`` outside the model's layers; a ``sequence`` that does not list the served
            events once each.
        OptionError: an unknown ``positions``; a ``sequence`` with ``original`` positions.
    """
    return _deviation(model, _layout(model, ekv, served, positions, sequence), select_layer)


def choose(deviation: torch.Tensor, recompute: float) -> torch.Tensor:
    """The tokens to recompute (step 2): indices ``[c]`` int64, ascending, of the
    ``n_recomputed(recompute, n)`` largest of ``deviation`` ``[n]`` (ties to the lower index)."""
    c = n_recomputed(recompute, int(deviation.shape[0]))
    order = torch.sort(deviation, descending=True, stable=True).indices
    return order[:c].sort().values


def layer_fractions(recompute: float, n_layers: int, select_layer: int = SELECT_LAYER) -> list[float]:
    """``layerwise``: the fraction of served event tokens recomputed on each of ``n_layers`` layers.

    The initial set, ``start = min(1, LAYERWISE_START * recompute)``, on layers ``0 .. select_layer``; then a
    straight line in the layer index from ``start`` on ``select_layer`` to ``recompute`` on the last layer (CacheBlend
    §4.3, "gradual filtering": a somewhat larger set on the first layers, narrowed layer by layer to the target).
    A model with no layer after ``select_layer`` gets ``recompute`` on every layer (the ``once`` schedule).

    Returns:
        ``n_layers`` fractions in [0, 1], non-increasing; the last is ``recompute``.
    """
    last = n_layers - 1
    if last <= select_layer:
        return [recompute] * n_layers
    start = min(1.0, LAYERWISE_START * recompute)
    out = [start + (recompute - start) * max(0, layer - select_layer) / (last - select_layer) for layer in range(last)]
    return [*out, recompute]


def choose_first(event_tokens: Sequence[int], recompute: float) -> torch.Tensor:
    """``epic``: the first ``n_recomputed(recompute, t)`` tokens of each served event of ``t`` tokens (EPIC: Hu et al.
    2024, arXiv 2410.15332, §4, "LegoLink": the first tokens of each separately encoded chunk are the ones whose
    attention goes wrong when chunks are joined, so those are recomputed).

    Args:
        event_tokens: each served event's token count, in log order.

    Returns:
        ``[c]`` int64 on the CPU, ascending, indices into the served event tokens.

    EPIC recomputes a fixed number of tokens per chunk; here the count is the same fraction of every event (at
    least one token of each event when ``recompute > 0``), so that ``recompute`` means the same budget in every
    schedule.
    """
    parts, start = [], 0
    for t in event_tokens:
        parts.append(torch.arange(start, start + n_recomputed(recompute, t), device="cpu"))  # bookkeeping: row ranks
        start += t
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long, device="cpu")


class _NarrowingCache(DynamicCache):
    """``layerwise``: a cache that narrows the recomputed set on each layer as the recompute forward runs.

    Why a cache subclass: a transformers forward runs one set of tokens through every layer; its only per-layer
    seam that sees the new keys and values before attention is ``Cache.update``. The forward carries the initial
    set through every layer; on each layer the keys and values of the tokens already dropped are replaced, before
    they are cached and attended to, by their stored rows (so every token attends to exactly the rows a per-layer
    forward would give it; a dropped token's own hidden state runs on, unused), and the tokens still recomputed
    are ranked by their deviation from their stored rows on this layer, the top ``counts[layer + 1]`` kept.

    Args:
        keys, values: per layer ``[1, kv_heads, rows, head_dim]``, the cache's rows (the header and the served
            tokens outside the initial set).
        stored_keys, stored_values: per layer ``[1, kv_heads, c, head_dim]``, the stored rows of the initial set.
        counts: per layer, how many tokens are recomputed on it (non-increasing, ``counts[0] == c``).
        select_layer: narrowing starts after this layer.
    """

    def __init__(
        self,
        keys: Sequence[LayerRows],
        values: Sequence[LayerRows],
        stored_keys: Sequence[LayerRows],
        stored_values: Sequence[LayerRows],
        counts: list[int],
        select_layer: int,
    ) -> None:
        super().__init__(ddp_cache_data=list(zip(keys, values)))
        self.stored_keys, self.stored_values = stored_keys, stored_values
        self.counts, self.select_layer = counts, select_layer
        c = counts[0]
        self.live = torch.ones(c, dtype=torch.bool, device=stored_keys[0].device)
        self.layer_live: list[torch.Tensor] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        live = self.live
        self.layer_live.append(live.cpu())
        sk, sv = self.stored_keys[layer_idx], self.stored_values[layer_idx]
        keep = live.view(1, 1, -1, 1)
        key_states, value_states = torch.where(keep, key_states, sk), torch.where(keep, value_states, sv)
        nxt = layer_idx + 1
        if layer_idx >= self.select_layer and nxt < len(self.counts) and self.counts[nxt] < int(live.sum()):
            dk = (key_states.float() - sk.float()).square().sum(dim=(0, 1, 3))
            dv = (value_states.float() - sv.float()).square().sum(dim=(0, 1, 3))
            dev = (dk + dv).sqrt().masked_fill(~live, -1.0)  # dropped tokens rank last
            top = torch.sort(dev, descending=True, stable=True).indices[: self.counts[nxt]]
            self.live = torch.zeros_like(live).index_fill_(0, top, True)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@torch.inference_mode()
def blend(
    model: PreTrainedModel,
    ekv: EventKV,
    served: Sequence[str],
    recompute: float = DEFAULT_RECOMPUTE,
    *,
    select_layer: int = SELECT_LAYER,
    schedule: BlendSchedule = DEFAULT_SCHEDULE,
    positions: BlendPositions = "original",
    sequence: Sequence[str] | None = None,
) -> Blend:
    """The served set's rows with a ``recompute`` fraction of the served tokens recomputed (the module
    docstring's steps; CacheBlend, arXiv 2405.16444, §4; schedule ``epic``: EPIC, arXiv 2410.15332, §4).

    Args:
        served: event ids in log order (as :func:`eventkv.kv.serve.resolve_served` returns them).
        recompute: fraction of the served event tokens recomputed, in [0, 1] (0: the stored rows, no forward;
            1: every token, no deviation forward); for ``layerwise``, the fraction on the last layer.
        select_layer: the decoder layer whose deviation chooses the tokens (``once``, ``layerwise``).
        schedule: ``once`` | ``layerwise`` | ``epic`` | ``suffix`` (:data:`BlendSchedule`, the module docstring).
        positions: ``original`` (every step at the positions the rows were prefilled at) or ``contiguous`` (the
            stored keys re-rotated to the positions right after the header first, then every step at those
            positions, as CacheBlend places its chunks: ``recompute=1`` is then a fresh prefill of header +
            served events at contiguous positions, the ``text`` serving mode).
        sequence: ``contiguous`` only: the served events (each once) in the order their rows are laid out after
            the header (None: log order).

    Returns:
        :class:`Blend` (compact layout: header rows, then the served events' rows in serving order).

    Raises:
        OptionError: ``recompute`` outside [0, 1]; an unknown ``schedule`` or ``positions``; a ``sequence`` with
            ``original`` positions.
        EventKVError: ``select_layer`` outside the model's layers; rows of another dtype or device than the
            model's; a ``sequence`` that does not list the served events once each.
    """
    recompute = check_recompute(recompute) or 0.0
    schedule = check_schedule(schedule) or DEFAULT_SCHEDULE
    lay = _layout(model, ekv, served, positions, sequence)
    keys, values, rows, h = lay.keys, lay.values, lay.rows, lay.h
    device = ekv.keys[0].device
    n_layers = len(keys)
    n = int(rows.shape[0]) - h
    counts = [n_recomputed(recompute, n)] * n_layers
    if schedule == "layerwise":
        counts = [n_recomputed(f, n) for f in layer_fractions(recompute, n_layers, select_layer)]
    c = counts[0]
    deviation = None
    if c == 0:
        chosen = torch.zeros(0, dtype=torch.long, device="cpu")  # bookkeeping: row ranks
    elif c == n:
        chosen = torch.arange(n, device="cpu")
    elif schedule == "epic":
        chosen = choose_first(lay.widths, recompute)
    elif schedule == "suffix":
        chosen = torch.arange(n - c, n, device="cpu")  # bookkeeping: row ranks
    else:
        deviation = _deviation(model, lay, select_layer)
        chosen = choose(deviation, c / n if schedule == "layerwise" else recompute)
    c = int(chosen.shape[0])
    if c == 0:
        return Blend(keys, values, rows, lay.positions, chosen, deviation, [chosen] * n_layers)
    mdev = model_device(model)
    keep = torch.ones(n, dtype=torch.bool, device="cpu")
    keep[chosen] = False
    cached = torch.cat([torch.arange(h, device="cpu"), h + torch.nonzero(keep).squeeze(1)])  # ranks in the served cache
    ranks = h + chosen
    cached_keys = [k.index_select(2, cached.to(device)) for k in keys]
    cached_values = [v.index_select(2, cached.to(device)) for v in values]
    narrowing = schedule == "layerwise" and counts[-1] < c
    if narrowing:
        at = ranks.to(device)
        cache: DynamicCache = _NarrowingCache(
            cached_keys,
            cached_values,
            [k.index_select(2, at) for k in keys],
            [v.index_select(2, at) for v in values],
            counts,
            select_layer,
        )
    else:
        cache = cache_from_rows(cached_keys, cached_values)
    ids = torch.tensor([[lay.ids[r] for r in ranks.tolist()]], device=mdev)
    pos = lay.positions[ranks].to(mdev).unsqueeze(0)
    mask = causal_masks(model, torch.cat([cached, ranks]).to(mdev), ranks.to(mdev))
    model_forward(model, ids, pos, cache, mask, logits_to_keep=1)
    new_keys, new_values = cache_kv(cache)
    at = ranks.to(device)
    for layer in range(n_layers):
        keys[layer].index_copy_(2, at, new_keys[layer][:, :, -c:])
        values[layer].index_copy_(2, at, new_values[layer][:, :, -c:])
    layer_chosen = (
        [chosen[live] for live in cache.layer_live] if isinstance(cache, _NarrowingCache) else [chosen] * n_layers
    )
    return Blend(keys, values, rows, lay.positions, chosen, deviation, layer_chosen)
