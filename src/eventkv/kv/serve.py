"""Sparse serving: build the cache a query is answered from (Study 1, "Setting").

A query is answered from the header rows plus the rows of a **served set** of events.
Modes:

* ``compact`` — only the kept rows are in the cache, at their original position ids
  (slot index != position id). On sliding-window layers (Gemma 3) the window is counted in
  rows of this compact cache: a sliding layer sees the last ``window - 1`` *served* rows.
  This is what a system that physically evicts rows presents.
* ``native`` — every row of the full history stays in the cache and the dropped rows are
  masked out of attention. On sliding-window layers the window is counted in rows of the
  full history, so a served row older than ``window - 1`` rows is invisible to those layers
  (it still reaches the full-attention layers). This is what an eviction-by-masking system
  presents. For models without sliding layers compact and native give the same logits.
* ``isolated`` — control: each served event is encoded alone after the header, at its
  original positions, so its rows never saw the rest of the history (what chunked or
  streaming encoding produces). Compact layout.
* ``text`` — control: the header and the served events re-prefilled as plain text at
  contiguous positions; the query follows right after (the comprehension arm).
* ``blend`` — selective recompute (CacheBlend, Yao et al. 2024, arXiv 2405.16444): the compact
  rows, with the ``recompute`` fraction (default 0.15) of served event tokens whose K/V deviate most
  on an early layer, once the served events see only each other, re-prefilled through every layer
  at their original positions; the rest reused (:mod:`eventkv.kv.blend`). ``blend_schedule`` picks
  which tokens are recomputed on which layer: ``once`` (the default: the above), ``layerwise``
  (CacheBlend's gradual filtering, a set narrowing layer by layer), ``epic`` (the first tokens of
  each served event, EPIC's LegoLink) or ``suffix`` (the last served tokens, nearest the query).
  ``recompute=0`` is ``compact``; ``recompute=1`` equals a fresh prefill of header + served events at
  their original positions. Compact layout.

In compact, native, isolated and blend modes the query starts at the first position after the
*full* history (``log.history_end``).

Positions (``positions=``):

* ``original`` (default) — every served row keeps the position id it was computed at, gaps
  where unserved events were included; the query starts after the full history. This is the
  project's protocol: what the rows saw and where they sit are exactly as in the global prefill.
* ``contiguous`` — an opt-in departure from that protocol, for histories longer than the model's
  context: the header keeps its positions ``0 .. h-1`` and the served rows (in log order) are
  re-rotated to ``h, h+1, ...`` (:func:`eventkv.kv.rope.rerotate`: RoPE is a rotation whose angle is
  linear in the position, Su et al. 2021, arXiv 2104.09864, so moving a key costs one rotation
  and no forward; exact up to float rounding); the query starts right after the served rows. The
  served cache then spans ``rows`` positions, not the history's length, so a history past the
  window can still be answered from a served set that fits it. What changes: the distances
  between the served rows and between them and the query are those of a short contiguous text,
  not those of the history (the rows' contents still are what the global prefill computed).
  Valid for ``compact``, ``isolated`` (each event encoded alone at its original positions,
  then re-rotated) and ``blend`` (the stored rows re-rotated first and the chosen tokens recomputed
  at the contiguous positions, as CacheBlend places its chunks, so that recomputing every token is
  the ``text`` mode's fresh prefill); ``text`` is contiguous already (accepted, nothing changes); ``native`` keeps
  every row of the history and refuses it. On Gemma 3's sliding layers a compact cache already
  counts the window in served rows, so contiguous positions only make the positions agree with it.

Order (``sequence=``, contiguous positions only): the served events' rows are laid out after the header
in log order by default; ``sequence`` lists the served events in another order, and each event's rows
(a block, in their own order) are placed in that order before the re-rotation, so the event listed last
sits right before the query (``text`` re-prefills the events in that order). The rows' contents stay
what the prefill computed in log order; only where they sit changes. At original positions the order
of rows changes nothing the model computes (each row keeps its position; attention is a sum over rows),
so ``sequence`` is refused there. ``EventMemory.query(order="relevance")`` builds the sequence from the
selector's ranking (Liu et al. 2023, "Lost in the Middle", arXiv 2307.03172, sections 2-3).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, MutableMapping, Sequence, get_args

import torch
from transformers import DynamicCache

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.blend import BlendSchedule, blend, check_recompute, check_schedule
from eventkv.kv.log import HEADER_ID, check_sequence
from eventkv.kv.model import model_device, model_forward
from eventkv.kv.rope import rerotatable, rerotate
from eventkv.kv.rows import EventKV, LayerRows, cache_from_rows, cache_kv

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ServeMode = Literal["compact", "native", "isolated", "text", "blend"]
"""How a served set is presented to the query (see the module docstring)."""
SERVE_MODES: tuple[ServeMode, ...] = get_args(ServeMode)
PositionMode = Literal["original", "contiguous"]
"""Where the served rows sit (see the module docstring): at their original positions, or re-rotated to
contiguous positions after the header."""
POSITION_MODES: tuple[PositionMode, ...] = get_args(PositionMode)
CONTIGUOUS_MODES: tuple[ServeMode, ...] = ("compact", "isolated", "blend", "text")
"""The serving modes that accept ``positions="contiguous"`` (``text`` is contiguous already)."""
DEFAULT_POSITIONS: PositionMode = "contiguous"
"""Where a memory serves its rows when no ``positions`` is given (``EventMemory.query``, the HTTP and chat
surfaces, MCP, ``eventkv query``): contiguous, where the served rows answer like the same turns re-prefilled as
text (``docs/memory.md``, "Serving positions"), unless :func:`default_positions` says the model or a plan cannot
(then ``original``). :func:`serve` itself keeps ``original``, the studies' protocol."""
ServeOrder = Literal["log", "relevance"]
"""The order of the served events' rows under contiguous positions: ``log`` (history order) or ``relevance``
(increasing selector score, the most relevant event last before the question: ``EventMemory.query``)."""
SERVE_ORDERS: tuple[ServeOrder, ...] = get_args(ServeOrder)
ALL = "all"


@dataclass
class ServedCache:
    """The rows a query is answered from.

    Attributes:
        keys, values: per layer ``[1, kv_heads, rows, head_dim]``, on the model's device.
        positions: ``[rows]`` int64 position ids of the rows, on the CPU (bookkeeping, as in an EventKV).
        visible: ``[rows]`` bool attention visibility (native mode) on the rows' device, or None when all
            rows are visible.
        next_position: position id of the first query token.
        mode: the serving mode; served: the served event ids, in the order of their rows (log order unless
            :func:`serve` was given a ``sequence``).
        position_mode: ``original`` (rows at the positions they were computed at) or ``contiguous`` (header
            then served rows at consecutive positions; ``positions`` and ``next_position`` say so).
    """

    keys: list[LayerRows]
    values: list[LayerRows]
    positions: torch.Tensor
    visible: torch.Tensor | None
    next_position: int
    mode: ServeMode
    served: tuple[str, ...]
    position_mode: PositionMode = "original"

    @property
    def n_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def n_visible(self) -> int:
        return self.n_rows if self.visible is None else int(self.visible.sum())

    def to_cache(self, batch: int = 1) -> DynamicCache:
        """A fresh ``DynamicCache`` over these rows (tensors shared, never modified), expanded to ``batch``."""
        if batch == 1:
            return cache_from_rows(self.keys, self.values)
        return cache_from_rows(
            [k.expand(batch, -1, -1, -1) for k in self.keys], [v.expand(batch, -1, -1, -1) for v in self.values]
        )

    def attention_mask(self, n_new: int, batch: int = 1) -> torch.Tensor | None:
        """``[batch, rows + n_new]`` bool mask by cache row for a forward of ``n_new`` tokens, or None."""
        if self.visible is None:
            return None
        m = torch.cat([self.visible, torch.ones(n_new, dtype=torch.bool, device=self.visible.device)])
        return m.unsqueeze(0).expand(batch, -1)


def resolve_served(ekv: EventKV, served: str | Sequence[str]) -> tuple[str, ...]:
    """Validate a served set and return it in log order. ``"all"`` means every event.

    Raises:
        EventKVError: empty served set, or an unknown event id.
    """
    if isinstance(served, str):
        served = ekv.log.event_ids if served == ALL else [s for s in served.split(",") if s.strip()]
    served = [s.strip() for s in served]
    if not served:
        raise EventKVError("the served set is empty: serve at least one event id (or 'all').")
    for s in served:
        if s == HEADER_ID:
            raise EventKVError(f"{HEADER_ID!r} is always served: list only event ids.")
        ekv.log.span(s)  # raises on unknown ids
    wanted = set(served)
    return tuple(e for e in ekv.log.event_ids if e in wanted)


def check_position_mode(positions, mode: str) -> PositionMode:
    """``positions`` checked against the serving ``mode``.

    Raises:
        OptionError: ``positions`` not one of :data:`POSITION_MODES`, or ``"contiguous"`` with ``native``
            (which keeps every row of the history where it is).
    """
    if positions not in POSITION_MODES:
        raise OptionError("positions", positions, f"use one of {', '.join(POSITION_MODES)}.")
    if positions == "contiguous" and mode not in CONTIGUOUS_MODES:
        raise OptionError(
            "positions",
            positions,
            f"serving mode {mode!r} keeps every row of the history at its position and cannot serve contiguous "
            f"positions: use positions='original', or a mode among {', '.join(CONTIGUOUS_MODES)}.",
        )
    return positions


def default_positions(model: PreTrainedModel, modes: Sequence[str]) -> PositionMode:
    """The positions a query without ``positions`` is served at: :data:`DEFAULT_POSITIONS` (contiguous), or
    ``original`` when a plan's mode keeps every row in place (``native``) or the model's RoPE cannot be
    re-rotated exactly (:func:`eventkv.kv.rope.rerotatable`: ``dynamic`` NTK or ``longrope`` scaling, partial
    rotary), so that the default never refuses a query the original positions can answer."""
    if any(m not in CONTIGUOUS_MODES for m in modes) or not rerotatable(model):
        return "original"
    return DEFAULT_POSITIONS


def check_order(order, positions) -> ServeOrder:
    """``order`` checked against ``positions``.

    Raises:
        OptionError: ``order`` not one of :data:`SERVE_ORDERS`, or ``"relevance"`` with ``positions="original"``
            (rows at their original positions give the same answer in any order).
    """
    if order not in SERVE_ORDERS:
        raise OptionError("order", order, f"use one of {', '.join(SERVE_ORDERS)}.")
    if order == "relevance" and positions != "contiguous":
        raise OptionError(
            "order",
            order,
            f"positions={positions!r} keeps every served row at the position it was computed at, so the order of "
            "the rows changes nothing the model computes: use positions='contiguous' with order='relevance', or "
            "order='log'.",
        )
    return order


def reordered(served: ServedCache, header_rows: int, widths: Sequence[int], sequence: Sequence[str]) -> ServedCache:
    """``served`` (compact layout: the header's rows, then each served event's ``widths`` rows in
    ``served.served`` order) with the events' row blocks laid out in ``sequence`` order instead; positions
    move with their rows (nothing is re-rotated here: :func:`to_contiguous` does that).

    Args:
        header_rows: the header's rows at the front (they stay first).
        widths: rows of each event of ``served.served``, in that order.
        sequence: the same event ids in the new order.
    """
    dev = served.positions.device  # the rows' device: the indices select on it
    start, blocks = header_rows, {}
    for eid, n in zip(served.served, widths):
        blocks[eid] = torch.arange(start, start + n, device=dev)
        start += n
    rows = torch.cat([torch.arange(header_rows, device=dev)] + [blocks[e] for e in sequence])
    return ServedCache(
        _select(served.keys, rows),
        _select(served.values, rows),
        served.positions[rows],
        None,
        served.next_position,
        served.mode,
        tuple(sequence),
        served.position_mode,
    )


def to_contiguous(model: PreTrainedModel, served: ServedCache, header_rows: int) -> ServedCache:
    """``served`` (compact layout, header rows first) with its rows after the header re-rotated to the positions
    right after the header's (:func:`eventkv.kv.rope.rerotate`) and the query placed right after them.

    Args:
        header_rows: the header's rows at the front of ``served`` (they keep their positions).

    Returns:
        a ServedCache sharing the values (and the header's keys where no row moves), ``position_mode``
        ``"contiguous"``, ``next_position`` = the header's first position + rows.
    """
    start = int(served.positions[0]) if served.n_rows else 0
    to = served.positions.clone()
    to[header_rows:] = torch.arange(header_rows, served.n_rows, dtype=to.dtype, device="cpu") + start
    keys = rerotate(model, served.keys, served.positions, to)
    return ServedCache(
        keys, served.values, to, served.visible, start + served.n_rows, served.mode, served.served, "contiguous"
    )


def _select(tensors: list[torch.Tensor], rows: torch.Tensor) -> list[torch.Tensor]:
    """Rows ``rows`` (``[n]`` int64, any device: moved once) of each ``[1, kv_heads, rows, head_dim]`` tensor."""
    rows = rows.to(tensors[0].device)
    return [t.index_select(2, rows) for t in tensors]


@torch.inference_mode()
def serve(
    ekv: EventKV,
    served: str | Sequence[str],
    mode: ServeMode = "compact",
    model: PreTrainedModel | None = None,
    *,
    isolated_memo: MutableMapping[tuple, tuple] | None = None,
    positions: PositionMode = "original",
    sequence: Sequence[str] | None = None,
    # selective recompute (mode "blend")
    recompute: float | None = None,
    blend_schedule: BlendSchedule | None = None,
) -> ServedCache:
    """Build the served cache for a served set (Study 1, "Setting": sparse serving and controls).

    Args:
        ekv: the globally prefilled log.
        served: event ids (any order; duplicates ignored) or ``"all"``.
        mode: ``compact`` | ``native`` | ``isolated`` | ``text`` | ``blend`` (see the module docstring).
        model: required for ``isolated``, ``text`` and ``blend`` (they run new forwards) and for
            ``positions="contiguous"`` (re-rotation uses its rotary embedding).
        isolated_memo: optional store of isolated encodings, keyed by ``(event id, first position,
            token ids)`` and holding the event's rows (per layer ``[1, kv_heads, n_tokens, head_dim]``
            keys and values, ``[n_tokens]`` positions): an event already encoded alone is taken from
            it instead of being encoded again (what a chunked-encoding store keeps: each chunk's KV
            once). Valid for one header, i.e. for the EventKVs of one memory; holds at most one copy of
            each event's rows.
        positions: ``original`` (every row at the position it was computed at; the query after the full
            history) or ``contiguous`` (header at ``0 .. h-1``, served rows re-rotated to ``h, h+1, ...``, the
            query right after them: see the module docstring). ``contiguous`` is for ``compact``, ``isolated``
            and ``blend`` (the stored rows re-rotated first, then blended at the contiguous positions, so
            ``recompute=1`` equals ``text``); with ``text`` it changes nothing (text is contiguous already).
        sequence: ``positions="contiguous"`` only: the served events (each once) in the order their rows are
            laid out after the header, the last right before the query (see the module docstring, "Order");
            ``text`` re-prefills them in that order. None: log order.
        recompute: mode ``blend`` only: the fraction of served event tokens recomputed, in [0, 1]
            (None: :data:`eventkv.kv.blend.DEFAULT_RECOMPUTE`, 0.15).
        blend_schedule: mode ``blend`` only: which tokens are recomputed on which layer, ``once`` | ``layerwise`` |
            ``epic`` | ``suffix`` (:data:`eventkv.kv.blend.BlendSchedule`; None: ``once``).

    Returns:
        ServedCache with header + served rows (compact/isolated/text/blend) or all rows (native); its
        ``served`` lists the events in the order of their rows (log order unless ``sequence`` is given).

    Raises:
        EventKVError: unknown mode, empty served set, unknown event id, or a missing model; a rope type
            :func:`eventkv.kv.rope.rerotate` cannot re-rotate exactly (``contiguous``); a ``sequence`` that does not
            list the served events once each.
        OptionError: an unknown ``positions``, or ``contiguous`` with ``native``; a ``sequence`` with
            ``positions="original"``; ``recompute`` outside
            [0, 1], or given with a mode other than ``blend``; an unknown ``blend_schedule``, or one given with a
            mode other than ``blend``.

    Example (``ekv`` prefilled as in :func:`eventkv.kv.prefill.prefill`'s example):

        >>> from eventkv.testing import tiny_lm
        >>> from eventkv.kv.log import Event, EventLog, tokenize
        >>> from eventkv.kv.prefill import prefill
        >>> lm = tiny_lm("llama")
        >>> events = [Event("a", "register A set to ON"), Event("b", "register B mirrors A")]
        >>> ekv = prefill(lm.model, tokenize(EventLog(events), lm.tokenizer, lm.profile))
        >>> served = serve(ekv, ["b"])  # compact: header + b's rows, at their original positions
        >>> served.n_rows, served.next_position  # rows in the cache; position of the first query token
        (27, 48)
        >>> native = serve(ekv, "b", mode="native")  # every row stays, a's rows are masked out
        >>> native.n_rows, native.n_visible
        (48, 27)
        >>> moved = serve(ekv, ["b"], model=lm.model, positions="contiguous")  # b's rows right after the header
        >>> moved.positions[:3].tolist(), moved.positions[-1].item(), moved.next_position
        ([0, 1, 2], 26, 27)
        >>> blended = serve(ekv, ["b"], mode="blend", model=lm.model, recompute=0.5)  # half of b's tokens recomputed
        >>> blended.n_rows, blended.next_position  # the compact layout
        (27, 48)
    """
    if mode not in SERVE_MODES:
        raise EventKVError(f"unknown serving mode {mode!r}: use one of {', '.join(SERVE_MODES)}.")
    check_position_mode(positions, mode)
    if sequence is not None:
        check_order("relevance", positions)  # any order but the log's is refused at the original positions
    fraction = check_recompute(recompute, mode)
    schedule = check_schedule(blend_schedule, mode)
    if positions == "contiguous" and mode == "blend":
        if model is None:
            raise EventKVError("positions='contiguous' re-rotates the served keys and needs the model: pass model=...")
        assert fraction is not None and schedule is not None  # check_recompute / check_schedule give blend both
        ids = resolve_served(ekv, served)
        seq = check_sequence(ids, sequence) if sequence is not None else ids
        b = blend(model, ekv, ids, fraction, schedule=schedule, positions="contiguous", sequence=seq)
        start = int(b.positions[0]) if b.positions.numel() else 0
        return ServedCache(
            b.keys, b.values, b.positions, None, start + int(b.positions.shape[0]), mode, seq, "contiguous"
        )
    if positions == "contiguous" and mode != "text":
        if model is None:
            raise EventKVError("positions='contiguous' re-rotates the served keys and needs the model: pass model=...")
        original = serve(
            ekv, served, mode, model, isolated_memo=isolated_memo, recompute=recompute, blend_schedule=blend_schedule
        )
        h = ekv.log.span(HEADER_ID).n_tokens
        if sequence is not None:
            seq = check_sequence(original.served, sequence)
            widths = [ekv.log.span(e).n_tokens for e in original.served]
            original = reordered(original, h, widths, seq)
        return to_contiguous(model, original, h)
    ids = resolve_served(ekv, served)
    if sequence is not None:  # text: re-prefilled in the given order
        ids = check_sequence(ids, sequence)
    log = ekv.log
    if mode == "compact":
        rows = ekv.rows_of(ids)
        return ServedCache(
            _select(ekv.keys, rows), _select(ekv.values, rows), ekv.positions[rows], None, log.history_end, mode, ids
        )
    if mode == "native":
        dev = ekv.keys[0].device
        visible = torch.zeros(ekv.n_rows, dtype=torch.bool, device=dev)
        visible[ekv.rows_of(ids).to(dev)] = True
        return ServedCache(list(ekv.keys), list(ekv.values), ekv.positions, visible, log.history_end, mode, ids)
    if model is None:
        raise EventKVError(f"serving mode {mode!r} re-encodes events and needs the model: pass model=...")
    if mode == "blend":
        assert fraction is not None and schedule is not None  # check_recompute / check_schedule give blend both
        b = blend(model, ekv, ids, fraction, schedule=schedule)
        return ServedCache(b.keys, b.values, ekv.positions[b.rows], None, log.history_end, mode, ids)
    device = model_device(model)
    header = log.span(HEADER_ID)
    hrows = slice(header.row_start, header.row_end)  # the header's rows are contiguous: views, no index
    if mode == "isolated":
        header_keys = [k[:, :, hrows] for k in ekv.keys]
        header_values = [v[:, :, hrows] for v in ekv.values]
        keys, values = header_keys, header_values
        row_positions = [ekv.positions[hrows]]
        h = header.n_tokens
        for eid in ids:
            span = log.span(eid)
            tokens = log.event_tokens[log.event_ids.index(eid)]
            key = (eid, span.pos_start, tuple(tokens))
            event_rows = isolated_memo.get(key) if isolated_memo is not None else None
            if event_rows is None:
                cache = cache_from_rows(header_keys, header_values)
                pos = torch.arange(span.pos_start, span.pos_start + span.n_tokens, device=device).unsqueeze(0)
                model_forward(model, torch.tensor([tokens], device=device), pos, cache, logits_to_keep=1)
                cache_keys, cache_values = cache_kv(cache)
                event_rows = (
                    [k[:, :, h:] for k in cache_keys],
                    [v[:, :, h:] for v in cache_values],
                    torch.arange(span.pos_start, span.pos_start + span.n_tokens, device="cpu"),  # no copy back
                )
                if isolated_memo is not None:  # copies, so the header rows of this forward are not kept
                    isolated_memo[key] = event_rows = (
                        [t.clone() for t in event_rows[0]],
                        [t.clone() for t in event_rows[1]],
                        event_rows[2],
                    )
            keys = [torch.cat([k, r], dim=2) for k, r in zip(keys, event_rows[0])]
            values = [torch.cat([v, r], dim=2) for v, r in zip(values, event_rows[1])]
            row_positions.append(event_rows[2])
        return ServedCache(keys, values, torch.cat(row_positions), None, log.history_end, mode, ids)
    # text: header + served events re-prefilled at contiguous positions
    toks = list(log.header_ids)
    for eid in ids:
        toks.extend(log.event_tokens[log.event_ids.index(eid)])
    cache = DynamicCache()
    pos = torch.arange(len(toks), device=device).unsqueeze(0)
    model_forward(model, torch.tensor([toks], device=device), pos, cache, logits_to_keep=1)
    return ServedCache(
        *cache_kv(cache),
        torch.arange(len(toks), device="cpu"),
        None,
        len(toks),
        mode,
        ids,
        positions,
    )
