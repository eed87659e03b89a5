"""Windowed prefill: the rows of a history longer than the model's context.

A history whose positions fit the window is prefilled in one causal pass (:func:`eventkv.kv.prefill.prefill`).
Past the window, the events are prefilled in **chunks**, each one causal forward over a context of the
**header rows** (the attention sinks) plus the **most recent rows** that fit, placed right after the header:
the StreamingLLM idea (Xiao et al. 2023, "Efficient Streaming Language Models with Attention Sinks",
arXiv 2309.17453, sections 3.2 and 4: keep the first tokens and a rolling window of recent ones, positions
assigned within the cache) applied to prefill. The recent rows' keys are re-rotated
(:func:`eventkv.kv.rope.rerotate`) from their whole-history positions to positions that follow the header;
the chunk's tokens are computed at the positions that continue them; its new keys are re-rotated back to
the chunk's whole-history positions before they are kept. So every kept key is rotated at its row's
position in the whole history, windowed or not: one invariant for every row.

What such rows lose: a chunk's rows never attended to the events older than its window (only the
header and the recent rows); what reaches them of older events is only what the recent rows'
own states carry (each computed in its own window), so they are not the rows a model with a longer
context computes (tested: apart by > 1e-3 on a tiny Llama). Within the one-pass part they are.

The chunks are a function of the history alone (not of when prefill runs): from the first event
past the fit, events are packed greedily, an event joining the open chunk while it ends within
``window.chunk`` positions of the chunk's first event. A chunk prefilled in several calls (events
added one by one) sees the same context in each call, so its rows equal one call's up to float
rounding (its own earlier rows rotated there and back).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.log import TokenizedLog
from eventkv.kv.model import model_device, model_forward
from eventkv.kv.prefill import prefill
from eventkv.kv.rope import rerotate
from eventkv.kv.rows import EventKV, cache_from_rows, cache_kv
from eventkv.options import is_int

if TYPE_CHECKING:
    from transformers import PreTrainedModel

#: the default chunk as a fraction of the window: a quarter (smollm2-135m: 2,048 new tokens per forward over
#: a context of up to 6,144 recent positions after the header)
CHUNK_FRACTION = 4


@dataclass(frozen=True)
class PrefillWindow:
    """How a history past the model's context is prefilled (see the module docstring).

    Attributes:
        size: positions one forward spans: header + recent rows + the chunk's new tokens; at most the
            model's context (the default: all of it; a prefill forward holds no query, so nothing is
            reserved for one).
        chunk: positions of new events one chunk covers at most (default ``size // 4``); the recent rows
            fill ``size - header - chunk`` positions, so a smaller chunk gives each row a longer past
            and costs more forwards.
    """

    size: int
    chunk: int

    @classmethod
    def for_context(cls, max_context: int, size: int | None = None, chunk: int | None = None) -> "PrefillWindow":
        """The window for a model of ``max_context`` tokens: ``size`` (default ``max_context``) and
        ``chunk`` (default ``size // 4``).

        Raises:
            OptionError: ``size`` not a whole number in [2, max_context], ``chunk`` not one in [1, size).
        """
        size = max_context if size is None else size
        if not is_int(size) or not 2 <= size <= max_context:
            raise OptionError(
                "window", size, f"give the prefill window as a whole number of positions in [2, {max_context}]."
            )
        chunk = max(1, size // CHUNK_FRACTION) if chunk is None else chunk
        if not is_int(chunk) or not 1 <= chunk < size:
            raise OptionError("window_chunk", chunk, f"give the chunk as a whole number of positions in [1, {size}).")
        return cls(size, chunk)

    def max_event(self, header_len: int) -> int:
        """The widest event (positions) this window can prefill: ``size - header_len``."""
        return self.size - header_len


@dataclass(frozen=True)
class Chunk:
    """One windowed forward (:func:`plan_chunks`).

    Attributes:
        first, last: the chunk's events, ``log.event_ids[first:last]``.
        row_start, row_end: their rows.
        context_row: the first recent row of the context (rows ``context_row:row_start`` are seen,
            with the header's); ``row_start`` when the chunk fills the window alone.
        shift: positions subtracted from whole-history positions in the forward (``>= 0``): the recent
            rows start right after the header.
    """

    first: int
    last: int
    row_start: int
    row_end: int
    context_row: int
    shift: int


def check_window(window: "PrefillWindow | None", max_context: int) -> PrefillWindow:
    """``window`` checked against the model's context (None: :meth:`PrefillWindow.for_context`).

    Raises:
        OptionError: not a PrefillWindow, or one whose size passes ``max_context``.
    """
    if window is None:
        return PrefillWindow.for_context(max_context)
    if not isinstance(window, PrefillWindow):
        raise OptionError("window", window, "give a PrefillWindow (PrefillWindow.for_context(...)) or None.")
    return PrefillWindow.for_context(max_context, window.size, window.chunk)


def fits(log: TokenizedLog, window: PrefillWindow) -> int:
    """The number of leading events whose positions end within ``window.size``: prefilled in one pass."""
    n = 0
    for span in log.spans[1:]:
        if span.pos_start + span.width > window.size:
            break
        n += 1
    return n


def plan_chunks(log: TokenizedLog, window: PrefillWindow) -> list[Chunk]:
    """The chunks of the events past the one-pass part (:func:`fits`), in history order (empty when the
    whole history fits).

    Raises:
        EventKVError: an event wider than ``window.size`` minus the header (no window holds it).
    """
    h = len(log.header_ids)
    spans = log.spans[1:]
    for span in spans:
        if span.width > window.max_event(h):
            raise EventKVError(
                f"event {span.event_id!r} takes {span.width} positions but the prefill window holds "
                f"{window.size} with a {h}-position header: split the event into events of at most "
                f"{window.max_event(h)} positions."
            )
    positions = log.position_ids
    chunks, i = [], fits(log, window)
    while i < len(spans):
        first = spans[i]
        end = first.pos_start + max(window.chunk, first.width)  # positions the chunk may reach
        j = i + 1
        while j < len(spans) and spans[j].pos_start + spans[j].width <= first.pos_start + window.chunk:
            j += 1
        low = end - (window.size - h)  # the oldest position the window keeps
        row = first.row_start
        while row > h and positions[row - 1] >= low:
            row -= 1
        start_pos = positions[row] if row < first.row_start else first.pos_start
        chunks.append(Chunk(i, j, first.row_start, spans[j - 1].row_end, row, start_pos - h))
        i = j
    return chunks


def _rows(parts: Sequence[Sequence[torch.Tensor]], layer: int, start: int, end: int) -> torch.Tensor:
    """Rows ``start:end`` of layer ``layer`` across ``parts`` (each per layer ``[1, kv_heads, rows, head_dim]``,
    in row order), concatenated."""
    out, at = [], 0
    for part in parts:
        n = int(part[layer].shape[2])
        a, b = max(start - at, 0), min(end - at, n)
        if a < b:
            out.append(part[layer][:, :, a:b])
        at += n
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


@torch.inference_mode()
def windowed_prefill(
    model: PreTrainedModel,
    log: TokenizedLog,
    window: PrefillWindow,
    *,
    prefix: EventKV | None = None,
    weights_digest: str = "unhashed",
) -> EventKV:
    """The rows of ``log`` (header + events at their whole-history positions), windowed past
    ``window.size`` (the module docstring; StreamingLLM, arXiv 2309.17453).

    A log whose history ends within ``window.size`` gives exactly :func:`eventkv.kv.prefill.prefill`'s
    rows (the same call). Past it, each :class:`Chunk` of :func:`plan_chunks` is one forward.

    Args:
        model: a Hugging Face causal LM (eval mode) with RoPE.
        log: the TokenizedLog; its positions may run past the model's context.
        window: the :class:`PrefillWindow`.
        prefix: an EventKV whose rows are the first rows of ``log`` (e.g. the stored history): those rows
            are reused, the rest computed (a chunk begun in ``prefix`` continues with the same context).
        weights_digest: kept in the EventKV.

    Returns:
        EventKV with ``log.n_rows`` rows per layer; ``positions`` are the log's whole-history positions and
        every key is rotated at its row's position.

    Raises:
        EventKVError: an event wider than the window minus the header; a prefix that is not a prefix of
            the log; a RoPE :func:`eventkv.kv.rope.rerotate` cannot re-rotate.
    """
    chunks = plan_chunks(log, window)
    if not chunks:
        return prefill(model, log, prefix=prefix, weights_digest=weights_digest)
    n_fit = chunks[0].row_start
    p = prefix.n_rows if prefix is not None else 0
    if p < n_fit:  # the one-pass part first, continuing from the prefix
        head = TokenizedLog(
            log.header_ids,
            log.event_ids[: chunks[0].first],
            log.event_tokens[: chunks[0].first],
            log.budgets[: chunks[0].first],
        )
        prefix = prefill(model, head, prefix=prefix, weights_digest=weights_digest)
        p = prefix.n_rows
    assert prefix is not None  # the one-pass part has at least the header
    if prefix.log.input_ids[:p] != log.input_ids[:p] or prefix.positions.tolist() != log.position_ids[:p]:
        raise EventKVError(
            "the prefix EventKV's rows are not the first rows of this log (token ids or positions differ)."
        )
    device = model_device(model)
    h = len(log.header_ids)
    ids, positions = log.input_ids, torch.tensor(log.position_ids, dtype=torch.long, device="cpu")
    parts: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [(list(prefix.keys), list(prefix.values))]
    n_layers = len(prefix.keys)
    for chunk in chunks:
        if chunk.row_end <= p:
            continue
        a = max(chunk.row_start, p)  # the chunk's first row to compute (earlier ones are in the prefix)
        keys_parts = [k for k, _ in parts]
        values_parts = [v for _, v in parts]
        keys = [_rows(keys_parts, i, 0, h) for i in range(n_layers)]
        values = [_rows(values_parts, i, 0, h) for i in range(n_layers)]
        if a > chunk.context_row:  # the recent rows, moved to follow the header
            recent = positions[chunk.context_row : a]
            old = [_rows(keys_parts, i, chunk.context_row, a) for i in range(n_layers)]
            moved = rerotate(model, old, recent, recent - chunk.shift)
            keys = [torch.cat([k, m], dim=2) for k, m in zip(keys, moved)]
            values = [torch.cat([v, _rows(values_parts, i, chunk.context_row, a)], dim=2) for i, v in enumerate(values)]
        cache = cache_from_rows(keys, values)
        new_pos = positions[a : chunk.row_end]
        model_forward(
            model,
            torch.tensor([ids[a : chunk.row_end]], dtype=torch.long, device=device),
            (new_pos - chunk.shift).unsqueeze(0).to(device),
            cache,
            logits_to_keep=1,
        )
        ck, cv = cache_kv(cache)
        seen = h + (a - chunk.context_row)
        back = rerotate(model, [k[:, :, seen:] for k in ck], new_pos - chunk.shift, new_pos)
        parts.append((back, [v[:, :, seen:] for v in cv]))
        p = chunk.row_end
    keys = [torch.cat([k[i] for k, _ in parts], dim=2) for i in range(n_layers)]
    values = [torch.cat([v[i] for _, v in parts], dim=2) for i in range(n_layers)]
    return EventKV(log, keys, values, positions, weights_digest)


__all__ = ["CHUNK_FRACTION", "Chunk", "PrefillWindow", "check_window", "fits", "plan_chunks", "windowed_prefill"]
