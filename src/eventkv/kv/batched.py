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
from eventkv.kv.model import check_context, model_device, model_forward
from eventkv.kv.prefill import prefill
from eventkv.kv.rows import EventKV, cache_from_rows, cache_kv

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["encode_alone", "prefill_batch"]


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
    big_p, big_n, b = max(starts), max(n_new), len(jobs)

    id_rows, pos_rows, mask_rows = [], [], []
    for (log, _), p, n in zip(jobs, starts, n_new):
        own = log.position_ids[p:]
        id_rows.append(log.input_ids[p:] + [0] * (big_n - n))  # right pad: token 0, never attended to
        pos_rows.append(own + [own[-1] + 1 + j for j in range(big_n - n)])  # pad positions: after the last real one
        mask_rows.append([False] * (big_p - p) + [True] * (p + big_n))
    ids = torch.tensor(id_rows, dtype=torch.long, device=device)
    pos = torch.tensor(pos_rows, dtype=torch.long, device=device)
    mask = torch.tensor(mask_rows, dtype=torch.bool, device=device)
    if big_p:
        ref = next(prefix for _, prefix in jobs if prefix is not None)  # its rows set the pad's dtype and shape
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for layer in range(ref.n_layers):
            k0, v0 = ref.keys[layer], ref.values[layer]
            pad_k = k0.new_zeros(b, k0.shape[1], big_p, k0.shape[3])
            pad_v = v0.new_zeros(b, v0.shape[1], big_p, v0.shape[3])
            for i, ((_, prefix), p) in enumerate(zip(jobs, starts)):
                if prefix is not None:
                    pad_k[i, :, big_p - p :] = prefix.keys[layer][0]
                    pad_v[i, :, big_p - p :] = prefix.values[layer][0]
            keys.append(pad_k)
            values.append(pad_v)
        cache = cache_from_rows(keys, values)
    else:
        from transformers import DynamicCache

        cache = DynamicCache()
    model_forward(model, ids, pos, cache, mask, logits_to_keep=1)
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
