"""Batched prefill: several tokenized logs, each continuing its own prefix, in one forward pass.

The data path's :func:`eventkv.kv.prefill.prefill` computes one log at a time; on a GPU a batch of
one leaves most of the device idle. :func:`prefill_batch` computes the rows of several logs at once
Row ``i`` of the batch is laid out as

    [left pad (P - p_i rows) | prefix_i rows (p_i) | new tokens_i (n_i) | right pad (N - n_i)]

with ``P`` the longest prefix and ``N`` the longest continuation. The attention mask hides the left
pad; the right pad needs no mask, since causal attention keeps every real token from seeing the pad
tokens after it. Every real token is fed at its own log's position id. Padding lies outside every
real token's span of rows (before a row's prefix or after its last token), so the distances
counted in cache rows — what a sliding-window layer's window is measured in — are those of the
unbatched prefill, and each log's rows equal :func:`~eventkv.kv.prefill.prefill`'s up to float
rounding (the matmuls run at another shape; ``tests/test_batch_pairs.py`` states the tolerance).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from eventkv.errors import EventKVError
from eventkv.kv.log import HEADER_ID, TokenizedLog
from eventkv.kv.model import attention_masks, check_context, model_device, model_forward
from eventkv.kv.prefill import prefill
from eventkv.kv.rows import EventKV, cache_from_rows, cache_kv

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

__all__ = ["IsolatedRows", "encode_alone", "prefill_batch", "prefill_packed"]


@torch.inference_mode()
def prefill_batch(
    model: PreTrainedModel,
    jobs: Sequence[tuple[TokenizedLog, EventKV | None]],
    *,
    max_context: int | None = None,
    weights_digest: str = "unhashed",
) -> list[EventKV]:
    """Global prefill of several logs in one forward pass (Study 1, "Setting", per log; batched as
    in the module docstring).

    Args:
        model: a Hugging Face causal LM (eval mode).
        jobs: ``(log, prefix)`` pairs: ``prefix`` is an EventKV whose rows are the first rows of
            ``log`` (same token ids and positions), or None to prefill from the first row. One job
            is passed to :func:`~eventkv.kv.prefill.prefill` unchanged (bitwise the unbatched rows); a
            job whose prefix already holds every row of its log computes nothing (its EventKV is the
            prefix's rows under ``log``, as :func:`~eventkv.kv.prefill.prefill` returns it).
        max_context: the model's context in tokens; a longer history raises.
        weights_digest: recorded in each EventKV.

    Returns:
        one EventKV per job, in order: keys/values ``[1, kv_heads, log.n_rows, head_dim]`` per
        layer (the prefix's rows followed by the new ones), positions ``[log.n_rows]`` int64.

    Raises:
        EventKVError: no job; a history longer than the context; a prefix that is not a prefix of
            its log.
    """
    if not jobs:
        raise EventKVError("prefill_batch got no logs: give at least one (log, prefix) pair.")
    if len(jobs) == 1:
        log, prefix = jobs[0]
        return [prefill(model, log, prefix=prefix, max_context=max_context, weights_digest=weights_digest)]
    device = model_device(model)
    starts = _prefix_rows(jobs, max_context)
    whole = [k for k, ((log, _), p) in enumerate(zip(jobs, starts)) if p == log.n_rows]
    if whole:  # nothing to compute for these: prefill() would feed no token either
        rest = [k for k in range(len(jobs)) if k not in whole]
        made = (
            prefill_batch(model, [jobs[k] for k in rest], max_context=max_context, weights_digest=weights_digest)
            if rest
            else []
        )
        by_job = dict(zip(rest, made))
        for k in whole:
            log, prefix = jobs[k]
            by_job[k] = prefill(model, log, prefix=prefix, max_context=max_context, weights_digest=weights_digest)
        return [by_job[k] for k in range(len(jobs))]
    n_new = [log.n_rows - p for (log, _), p in zip(jobs, starts)]
    big_p, big_n = max(starts), max(n_new)

    id_rows, pos_rows, mask_rows = [], [], []
    for (log, _), p, n in zip(jobs, starts, n_new):
        own = log.position_ids[p:]
        id_rows.append(log.input_ids[p:] + [0] * (big_n - n))  # right pad: token 0, never attended to
        pos_rows.append(own + [own[-1] + 1 + j for j in range(big_n - n)])  # pad positions: after the last real one
        mask_rows.append([False] * (big_p - p) + [True] * (p + big_n))
    ids = torch.tensor(id_rows, dtype=torch.long, device=device)
    pos = torch.tensor(pos_rows, dtype=torch.long, device=device)
    mask = torch.tensor(mask_rows, dtype=torch.bool, device=device)
    cache = _left_padded_cache(jobs, starts, big_p)
    model_forward(model, ids, pos, cache, mask, logits_to_keep=1)
    return _new_rows(jobs, n_new, big_p, cache, weights_digest)


#: an event's rows encoded alone after a header, as :func:`eventkv.kv.serve.serve`'s ``isolated_memo`` holds them:
#: keys and values per layer ``[1, kv_heads, n_tokens, head_dim]``, positions ``[n_tokens]`` (int64, CPU)
IsolatedRows = tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]


@torch.inference_mode()
def prefill_packed(
    model: PreTrainedModel,
    jobs: Sequence[tuple[TokenizedLog, EventKV | None]],
    alone: Sequence[tuple[int, Sequence[int], int]],
    *,
    max_context: int | None = None,
    weights_digest: str = "unhashed",
) -> tuple[list[EventKV], list[IsolatedRows]]:
    """:func:`prefill_batch`'s forward with events encoded alone (:func:`encode_alone`) packed into its rows:
    the isolated control of Study 1 ("Setting") computed in a prefill that runs anyway, so it costs its
    tokens and not a forward of its own.

    Each event rides in the row of the job it names, after that job's new tokens and at its own positions,
    under a 4D attention mask: it sees the job's header rows and its own earlier tokens, nothing else,
    and no token of the job sees it. Distances for sliding-window layers are those of the event's
    unbatched encoding (``[header | event]``), so the rows equal :func:`encode_alone`'s, and every job's
    rows :func:`prefill_batch`'s, up to float rounding (the matmuls run at other shapes and the
    attention under an explicit mask; ``tests/test_batch_pairs.py`` states the tolerance).

    Args:
        model: a Hugging Face causal LM (eval mode) whose attention takes a 4D mask (``sdpa``, ``eager``).
        jobs: ``(log, prefix)`` pairs as for :func:`prefill_batch`; a job whose prefix holds every row of
            its log may carry events (its row then computes only theirs).
        alone: ``(job index, token ids, first position)`` per event: encoded after that job's header
            (its log's ``"<header>"`` span) at positions ``first, first + 1, ...``.
        max_context, weights_digest: as for :func:`prefill_batch`.

    Returns:
        ``(EventKVs, isolated)``: one EventKV per job, in order, as :func:`prefill_batch` returns them, and
        one :data:`IsolatedRows` per event of ``alone``, in order. With no event, :func:`prefill_batch`'s
        EventKVs and an empty list.

    Raises:
        EventKVError: as :func:`prefill_batch`; an event with no tokens or naming no job; an attention
            implementation that takes no 4D mask.
    """
    if not alone:
        return prefill_batch(model, jobs, max_context=max_context, weights_digest=weights_digest), []
    if not jobs:
        raise EventKVError("prefill_packed got no logs: give at least one (log, prefix) pair.")
    for k, (job, tokens, _) in enumerate(alone):
        if not 0 <= job < len(jobs) or not tokens:
            raise EventKVError(
                f"event {k} to encode alone names job {job} of {len(jobs)} with {len(tokens)} tokens: "
                "give a job index in range and at least one token."
            )
    device = model_device(model)
    starts = _prefix_rows(jobs, max_context)
    n_new = [log.n_rows - p for (log, _), p in zip(jobs, starts)]
    segments: list[list[tuple[int, int]]] = [[] for _ in jobs]  # per row: (event, offset among the new tokens)
    width = list(n_new)
    for k, (job, tokens, _) in enumerate(alone):
        segments[job].append((k, width[job]))
        width[job] += len(tokens)
    big_p, big_q, b = max(starts), max(width), len(jobs)
    kv = big_p + big_q
    j = torch.arange(big_q, device=device).unsqueeze(1)
    key = torch.arange(kv, device=device).unsqueeze(0)
    back = big_p + j - key  # [q, kv]: how many rows back each key lies, in a row's own layout
    visible = torch.zeros(b, big_q, kv, dtype=torch.bool, device=device)
    distance = back.expand(b, -1, -1).clone()
    id_rows, pos_rows = [], []
    for i, ((log, _), p) in enumerate(zip(jobs, starts)):
        left, h = big_p - p, log.span(HEADER_ID).n_tokens
        visible[i] = (key >= left) & (back >= 0)
        ids, pos = list(log.input_ids[p:]), list(log.position_ids[p:])
        for k, a in segments[i]:
            _, tokens, first = alone[k]
            m = len(tokens)
            visible[i, a : a + m] = False
            visible[i, a : a + m, left : left + h] = True
            visible[i, a : a + m, big_p + a : big_p + a + m] = back[a : a + m, big_p + a : big_p + a + m] >= 0
            # a header row's distance in the event's own encoding: h rows of header, then the event
            distance[i, a : a + m, left : left + h] = h + (j[a : a + m] - a) - (key[:, left : left + h] - left)
            ids += list(tokens)
            pos += list(range(first, first + m))
        last = pos[-1] if pos else log.position_ids[-1]
        pad = big_q - len(ids)
        id_rows.append(ids + [0] * pad)  # right pad: token 0, never attended to by a real token
        pos_rows.append(pos + [last + 1 + t for t in range(pad)])
    masks = attention_masks(model, visible, distance)
    cache = _left_padded_cache(jobs, starts, big_p)
    model_forward(
        model,
        torch.tensor(id_rows, dtype=torch.long, device=device),
        torch.tensor(pos_rows, dtype=torch.long, device=device),
        cache,
        masks,
        logits_to_keep=1,
    )
    ekvs = _new_rows(jobs, n_new, big_p, cache, weights_digest)
    cache_keys, cache_values = cache_kv(cache)
    isolated: list[IsolatedRows] = [([], [], torch.empty(0))] * len(alone)
    for i, row in enumerate(segments):
        for k, a in row:
            _, tokens, first = alone[k]
            s, e = big_p + a, big_p + a + len(tokens)
            isolated[k] = (
                [layer[i : i + 1, :, s:e].contiguous() for layer in cache_keys],
                [layer[i : i + 1, :, s:e].contiguous() for layer in cache_values],
                torch.arange(first, first + len(tokens), dtype=torch.long, device="cpu"),
            )
    return ekvs, isolated


def _prefix_rows(jobs: Sequence[tuple[TokenizedLog, EventKV | None]], max_context: int | None) -> list[int]:
    """Each job's prefix row count, after checking its history against the context and its prefix
    against its log.

    Raises:
        EventKVError: a history longer than the context; a prefix that is not a prefix of its log.
    """
    starts = []
    for k, (log, prefix) in enumerate(jobs):
        check_context(log.history_end, max_context)
        p = 0 if prefix is None else prefix.n_rows
        if prefix is not None and (
            p > log.n_rows
            or prefix.log.input_ids[:p] != log.input_ids[:p]
            or prefix.positions.tolist() != log.position_ids[:p]
        ):
            raise EventKVError(
                f"log {k}: the prefix EventKV's rows are not the first rows of this log "
                f"(token ids or positions differ)."
            )
        starts.append(p)
    return starts


def _left_padded_cache(
    jobs: Sequence[tuple[TokenizedLog, EventKV | None]], starts: Sequence[int], big_p: int
) -> DynamicCache:
    """A cache of ``len(jobs)`` rows, row ``i`` holding ``big_p - starts[i]`` zero rows and then job ``i``'s
    prefix rows (``[batch, kv_heads, big_p, head_dim]`` per layer); an empty cache when no job has a prefix."""
    from transformers import DynamicCache

    if not big_p:
        return DynamicCache()
    ref = next(prefix for _, prefix in jobs if prefix is not None)  # its rows set the pad's dtype and shape
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for layer in range(ref.n_layers):
        k0, v0 = ref.keys[layer], ref.values[layer]
        pad_k = k0.new_zeros(len(jobs), k0.shape[1], big_p, k0.shape[3])
        pad_v = v0.new_zeros(len(jobs), v0.shape[1], big_p, v0.shape[3])
        for i, ((_, prefix), p) in enumerate(zip(jobs, starts)):
            if prefix is not None:
                pad_k[i, :, big_p - p :] = prefix.keys[layer][0]
                pad_v[i, :, big_p - p :] = prefix.values[layer][0]
        keys.append(pad_k)
        values.append(pad_v)
    return cache_from_rows(keys, values)


def _new_rows(
    jobs: Sequence[tuple[TokenizedLog, EventKV | None]],
    n_new: Sequence[int],
    big_p: int,
    cache: DynamicCache,
    weights_digest: str,
) -> list[EventKV]:
    """Each job's EventKV after a batched forward: its prefix's rows followed by the ``n_new[i]`` rows the
    forward wrote at cache rows ``big_p ...`` of batch row ``i``."""
    out = []
    cache_keys, cache_values = cache_kv(cache)
    for i, ((log, prefix), n) in enumerate(zip(jobs, n_new)):
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        for layer_k, layer_v in zip(cache_keys, cache_values):
            new_k = layer_k[i : i + 1, :, big_p : big_p + n]
            new_v = layer_v[i : i + 1, :, big_p : big_p + n]
            if prefix is not None:
                ks.append(torch.cat([prefix.keys[len(ks)], new_k], dim=2))
                vs.append(torch.cat([prefix.values[len(vs)], new_v], dim=2))
            else:
                ks.append(new_k.contiguous())
                vs.append(new_v.contiguous())
        positions = torch.tensor(log.position_ids, dtype=torch.long, device="cpu")  # an EventKV's live on the CPU
        out.append(EventKV(log, ks, vs, positions, weights_digest))
    return out


@torch.inference_mode()
def encode_alone(
    model: PreTrainedModel,
    header: EventKV,
    events: Sequence[tuple[Sequence[int], int]],
) -> list[tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]]:
    """Encode events each alone after the header, at their own positions, in one forward: the
    isolated control of Study 1 ("Setting": an event's rows with no other event in view), batched.

    Row ``i`` of the batch is the header's rows followed by event ``i``'s tokens at positions
    ``pos_start, pos_start + 1, ...``, right-padded to the longest event (causal attention keeps the
    pad out of every real token's view). The rows equal :func:`eventkv.kv.serve.serve`'s one-at-a-time
    ``isolated`` encoding up to float rounding.

    Args:
        header: an EventKV whose rows are the header (e.g. :meth:`Runtime.header_kv`'s); only
            ``log.span("<header>")``'s rows are used.
        events: ``(token ids, first position)`` per event.

    Returns:
        per event, in the form :func:`eventkv.kv.serve.serve`'s ``isolated_memo`` holds: keys and values
        per layer ``[1, kv_heads, n_tokens, head_dim]``, and positions ``[n_tokens]`` (int64, CPU).

    Raises:
        EventKVError: no event, or an event with no tokens.
    """
    if not events or any(len(tokens) == 0 for tokens, _ in events):
        raise EventKVError("encode_alone needs at least one event, and no event without tokens.")
    device = model_device(model)
    span = header.log.span(HEADER_ID)
    h, b, n = span.n_tokens, len(events), max(len(tokens) for tokens, _ in events)
    keys = [k[:, :, span.row_start : span.row_end].expand(b, -1, -1, -1).contiguous() for k in header.keys]
    values = [v[:, :, span.row_start : span.row_end].expand(b, -1, -1, -1).contiguous() for v in header.values]
    cache = cache_from_rows(keys, values)
    ids = torch.tensor([list(t) + [0] * (n - len(t)) for t, _ in events], dtype=torch.long, device=device)
    pos = torch.tensor([list(range(p, p + n)) for _, p in events], dtype=torch.long, device=device)
    model_forward(model, ids, pos, cache, logits_to_keep=1)
    out = []
    cache_keys, cache_values = cache_kv(cache)
    for i, (tokens, p) in enumerate(events):
        m = len(tokens)
        out.append(
            (
                [k[i : i + 1, :, h : h + m].contiguous() for k in cache_keys],
                [v[i : i + 1, :, h : h + m].contiguous() for v in cache_values],
                torch.arange(p, p + m, dtype=torch.long, device="cpu"),  # an EventKV's positions live on the CPU
            )
        )
    return out
