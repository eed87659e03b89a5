"""Serving a donor pair's arms (Study 1, "Donor pair"): the served cache of each arm of an item
from its history's two prefills (:func:`serve_arm`), compact serving with rows swapped in from the
other variant (:func:`serve_mixed`, the landing factorial), and the events isolated arms serve
(:func:`isolated_events`; taken from a prefill where they come first, :func:`leading_rows`; or encoded in one
forward of their own, :func:`encode_isolated`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Sequence

import torch

from eventkv.errors import EventKVError
from eventkv.kv.log import HEADER_ID, TokenizedLog
from eventkv.kv.rows import EventKV
from eventkv.kv.serve import ServedCache, serve
from eventkv.probes.base import Runtime
from eventkv.studies.materialization.pairs.arms import PairArm, event_id, served_ids

if TYPE_CHECKING:
    from eventkv.kv.batched import IsolatedRows


def serve_mixed(own: EventKV, other: EventKV, served: Sequence[str], swap: Sequence[str]) -> ServedCache:
    """Compact serving of ``served`` where the events in ``swap`` take their rows from ``other``
    (a prefill of the other variant, with the same positions for those events).

    Returns:
        ServedCache of header + served rows in log order (keys/values ``[1, kv_heads, rows, head_dim]``).

    Raises:
        EventKVError: a swapped event whose positions differ between the two prefills.
    """
    order = [HEADER_ID] + [e for e in own.log.event_ids if e in set(served)]
    ks: list[list[torch.Tensor]] = [[] for _ in own.keys]
    vs: list[list[torch.Tensor]] = [[] for _ in own.keys]
    ps: list[torch.Tensor] = []
    for e in order:
        src = other if e in swap else own
        s = src.log.span(e)
        if e in swap and (s.pos_start, s.n_tokens) != (own.log.span(e).pos_start, own.log.span(e).n_tokens):
            raise EventKVError(f"event {e!r} sits at different positions in the two variants: it cannot be swapped.")
        for layer in range(len(ks)):  # a span's rows are contiguous: a slice, on whatever device they live
            ks[layer].append(src.keys[layer][:, :, s.row_start : s.row_end])
            vs[layer].append(src.values[layer][:, :, s.row_start : s.row_end])
        ps.append(src.positions[s.row_start : s.row_end])
    return ServedCache(
        [torch.cat(k, dim=2) for k in ks],
        [torch.cat(v, dim=2) for v in vs],
        torch.cat(ps),
        None,
        own.log.history_end,
        "compact",
        tuple(order[1:]),
    )


def isolated_events(
    items: Sequence[dict], arms: Sequence[PairArm], logs: list[dict]
) -> dict[tuple, tuple[int, list[int], int]]:
    """Every event an isolated arm serves, over all items and variants, keyed as an ``isolated_memo`` of
    :func:`eventkv.kv.serve.serve` is (event id, first position, token ids): ``(item index, token ids,
    first position)`` each, the first item that serves it."""
    wanted: dict[tuple, tuple[int, list[int], int]] = {}
    for i, item in enumerate(items):
        for arm in arms:
            if arm.encoding != "isolated":
                continue
            for log in logs[i][arm.history]:
                for e in served_ids(item, arm, logs[i][arm.history][0]):
                    tokens = log.event_tokens[log.event_ids.index(e)]
                    wanted.setdefault(
                        (e, log.span(e).pos_start, tuple(tokens)), (i, list(tokens), log.span(e).pos_start)
                    )
    return wanted


def leading_rows(key: tuple, prefills: Sequence[EventKV]) -> IsolatedRows | None:
    """The isolated encoding of the event ``key`` names (as :func:`isolated_events` keys it) taken from a
    prefill whose first event it is: an event right after the header, encoded alone after the header, is
    the same computation as the prefill's own rows for it (rows equal up to float rounding). None when no
    prefill in ``prefills`` begins with it.

    Returns:
        keys and values per layer ``[1, kv_heads, n_tokens, head_dim]`` (views of the prefill's rows),
        positions ``[n_tokens]`` int64 — or None.
    """
    e, first, tokens = key
    for ekv in prefills:
        log = ekv.log
        if log.event_ids[:1] == [e] and tuple(log.event_tokens[0]) == tokens and log.span(e).pos_start == first:
            s = log.span(e)
            return (
                [k[:, :, s.row_start : s.row_end] for k in ekv.keys],
                [v[:, :, s.row_start : s.row_end] for v in ekv.values],
                ekv.positions[s.row_start : s.row_end],
            )
    return None


def encode_isolated(
    rt: Runtime, instruction: str, wanted: dict[tuple, tuple[int, list[int], int]]
) -> dict[tuple, IsolatedRows]:
    """The events of ``wanted`` (as :func:`isolated_events` gives them) encoded alone after the header in one forward
    of their own (:func:`eventkv.kv.batched.encode_alone`), as an ``isolated_memo`` for
    :func:`eventkv.kv.serve.serve`. The pair engine packs these events into its prefill rounds instead
    (:func:`eventkv.kv.batched.prefill_packed`) where the model takes a 4D mask, and comes here for the rest."""
    from eventkv.kv.batched import encode_alone

    if not wanted:
        return {}
    events = [(tokens, first) for _, tokens, first in wanted.values()]
    return dict(zip(wanted, encode_alone(rt.model, rt.header_kv(instruction), events)))


def serve_arm(
    rt: Runtime,
    item: dict,
    arm: PairArm,
    logs: list[TokenizedLog],
    pair: list[EventKV],
    common: int,
    memo: dict | None = None,
) -> tuple[list[tuple[tuple[int, ...], ServedCache]], int, dict]:
    """One arm of one item: ``([(variants answered, served cache)], query position, served
    record)`` — one cache per variant, or one for both (an isolated arm whose served tokens are the
    same in both variants)."""
    log0 = logs[0]
    ids = served_ids(item, arm, log0)
    swap = [event_id(item["roles"][arm.history][r]) for r in arm.swap]
    caches: list[tuple[tuple[int, ...], ServedCache]]
    if arm.encoding == "prefill":
        caches = [
            (
                (v,),
                ServedCache(
                    e.keys,
                    e.values,
                    e.positions,
                    None,
                    e.log.history_end,
                    # the arm's own mode name: the global prefill continued, which no serve() mode produces
                    "prefill",  # type: ignore[arg-type]
                    tuple(e.log.event_ids),
                ),
            )
            for v, e in enumerate(pair)
        ]
    elif arm.encoding == "isolated":
        idx = [log0.event_ids.index(e) for e in ids]
        if all(logs[0].event_tokens[j] == logs[1].event_tokens[j] for j in idx):
            # identical served tokens at identical positions: one encoding answers both variants
            caches = [((0, 1), serve(pair[0], ids, "isolated", model=rt.model, isolated_memo=memo))]
        else:
            caches = [((v,), serve(pair[v], ids, "isolated", model=rt.model, isolated_memo=memo)) for v in (0, 1)]
    elif swap:
        caches = [((v,), serve_mixed(pair[v], pair[1 - v], ids, swap)) for v in (0, 1)]
    else:
        caches = [((v,), serve(pair[v], ids, "compact")) for v in (0, 1)]
    if arm.fixed_position:
        p = common
    elif arm.query_at == "last-served" and arm.served != "all":
        p = max(log0.span(e).pos_start + log0.span(e).n_tokens for e in ids)  # the served tokens' end
    else:
        p = log0.history_end
    rec = {
        "events": ids if arm.served != "all" else "all",
        "swap": swap,
        "rows": [len(log.header_ids) + sum(log.span(e).n_tokens for e in ids) for log in logs],
    }
    return [(vs, dataclasses.replace(sc, next_position=p)) for vs, sc in caches], p, rec
