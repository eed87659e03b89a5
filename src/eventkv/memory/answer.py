"""Answering a question from served rows (Study 1, "Setting": sparse serving, then a readout): the
checks of a query's arguments, and the query's two phases. :func:`prepare` serves the question's
served sets (:func:`eventkv.kv.serve.serve`) into a :class:`PreparedQuery`, which holds everything the
readout needs and no reference to its memory; :func:`answer_prepared` reads several prepared
queries out in one batched readout (:func:`eventkv.kv.readout.read_out`: left-padded, each row at its
own positions, each query at its own length), so queries of different memories, from different
clients, are answered together. The memory resolves each plan's served ids and prefills pending
events (``EventMemory.prepare_query``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Sequence, cast

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.blend import BlendSchedule
from eventkv.kv.decoding import Decoding
from eventkv.kv.log import HEADER_ID, tokenize_query
from eventkv.kv.model import check_context
from eventkv.kv.readout import Readout
from eventkv.kv.readout import read_out as read_out_caches
from eventkv.kv.rows import EventKV
from eventkv.kv.serve import (
    SERVE_MODES,
    PositionMode,
    ServedCache,
    ServeMode,
    serve,
)
from eventkv.memory.chat import chat_tail_ids
from eventkv.memory.query import QueryOptions
from eventkv.memory.records import MemoryAnswer, MemoryRecord
from eventkv.models.encoding import encode
from eventkv.options import check_max_new_tokens

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.models.profile import LoadedModel


def check_query(
    plans: Sequence, max_new_tokens: int, candidates: Sequence[str] | None, options: QueryOptions
) -> tuple[list, list[str]]:
    """The plans (``(select, mode)`` pairs) and candidates of a query, checked with its serving options
    (``options.positions`` resolved): ``(plans, candidates)``.

    Raises:
        OptionError: no plan, a plan that is not a pair or names an unknown mode, a bad serving option
            (:meth:`eventkv.memory.query.QueryOptions.check_serving`), ``max_new_tokens`` < 1, empty or
            repeated candidates.
    """
    plans = list(plans)
    if not plans:
        raise OptionError("plans", plans, "give at least one (select, mode) plan.")
    for plan in plans:
        if not isinstance(plan, tuple) or len(plan) != 2:
            raise OptionError("plans", plan, f"give (select, mode) pairs with mode one of {', '.join(SERVE_MODES)}.")
        if plan[1] not in SERVE_MODES:
            raise OptionError("mode", plan[1], f"use one of {', '.join(SERVE_MODES)}.")
    options.check_serving([plan[1] for plan in plans])
    check_max_new_tokens(max_new_tokens)
    cands = list(candidates or [])
    if any(not isinstance(c, str) or not c.strip() for c in cands) or len(set(cands)) != len(cands):
        raise OptionError("candidates", cands, "give distinct, non-empty candidate answers.")
    return plans, cands


def served_end(header_len: int, records: Mapping[str, MemoryRecord], served_ids: Sequence[Sequence[str]]) -> int:
    """The first position after the header and the served rows of the longest served set: where the question
    starts under ``positions="contiguous"`` (:func:`eventkv.kv.serve.serve`) and in mode ``text``."""
    return max(header_len + sum(records[i].n_rows for i in ids) for ids in served_ids)


def question_ids(
    lm: LoadedModel,
    question: str,
    history_end: int,
    max_new_tokens: int,
    positions: str = "original",
    messages: Sequence[Mapping] | None = None,
) -> list[int]:
    """The question's token ids (chat tail included: :func:`eventkv.kv.log.tokenize_query`), or with
    ``messages`` the conversation's (:func:`eventkv.memory.chat.chat_tail_ids`: the same ids for one
    user message), checked to fit after ``history_end`` (where the question starts: the whole
    history's end when the rows are served at their ``positions="original"``) with room for
    ``max_new_tokens``.

    Raises:
        EventKVError: the question past the model's context; at the original positions the message names
            ``positions="contiguous"``, the fix for a history longer than the context.
        OptionError: no room left for ``max_new_tokens``; bad messages (:func:`eventkv.memory.chat.check_messages`).
    """
    q = chat_tail_ids(lm, messages) if messages is not None else tokenize_query(lm.tokenizer, lm.profile, question)
    end, ctx = history_end, lm.profile.max_context
    if positions == "original" and ctx is not None and end + len(q) > ctx:
        raise EventKVError(
            f"the history ends at position {end} and the question takes {len(q)} more, past the model's context "
            f"of {ctx} tokens: rows served at their original positions cannot be read there. Query with "
            f'positions="contiguous" (the served rows re-rotated to follow the header), or with mode "text".'
        )
    check_context(end + len(q), ctx, what="history plus question")
    if ctx is not None and end + len(q) + max_new_tokens > ctx:
        raise OptionError(
            "max_new_tokens",
            max_new_tokens,
            f"the history and the question take {end + len(q)} of the model's {ctx} positions: give at most "
            f"{ctx - end - len(q)} new tokens.",
        )
    return q


@dataclass
class PreparedQuery:
    """One question on one memory, served and ready to be read out: phase one of a query
    (``EventMemory.prepare_query``); :func:`answer_prepared` is phase two, for several at once. It
    holds no reference to its memory (the memory may be closed before the readout).

    Attributes:
        served: one served cache per plan (per layer ``[1, kv_heads, rows, head_dim]``, on the model's device).
        query_ids: the question's token ids (chat tail included), read after each cache's ``next_position``.
        max_new_tokens: the greedy decoding budget (tokens).
        candidates: answers scored by log-probability (nats); empty: none.
        keep_logits: keep each generated step's logits ``[vocab]`` (float32).
        positions: per plan, ``(id, first position, width)`` of each served event where the question saw it.
        timings_ms: per plan, wall milliseconds of ``prefill`` (the lazy prefill, shared by the plans) and
            ``serve`` (that plan's served cache).
        version: the memory's version when it was served (``EventMemory.version``).
        decoding: how its answers are decoded (:class:`eventkv.kv.decoding.Decoding`: sampling, stop strings,
            a step callback; None: greedy).
        plans: per plan, the plan it was served by (:meth:`eventkv.memory.query.QueryOptions.plan`); empty when
            not given.
    """

    served: list[ServedCache]
    query_ids: list[int]
    max_new_tokens: int
    candidates: list[str] = field(default_factory=list)
    keep_logits: bool = False
    positions: list[list[tuple[str, int, int]]] = field(default_factory=list)
    timings_ms: list[dict[str, float]] = field(default_factory=list)
    version: int = 0
    decoding: Decoding | None = None
    plans: list[dict[str, Any]] = field(default_factory=list)

    @property
    def batch_key(self) -> tuple:
        """Prepared queries with one key can be read out in one batch (:func:`answer_prepared`): the
        candidates are scored against every cache of a readout, and logits are kept for all or none."""
        return (tuple(self.candidates), self.keep_logits)


def prepare(
    lm: LoadedModel,
    ekv: EventKV,
    served_ids: Sequence[Sequence[str]],
    modes: Sequence[ServeMode],
    q: Sequence[int],
    *,
    records: Mapping[str, MemoryRecord],
    isolated: dict,
    prefill_ms: float,
    max_new_tokens: int,
    candidates: Sequence[str],
    keep_logits: bool,
    positions: PositionMode = "original",
    sequences: Sequence[Sequence[str] | None] | None = None,
    recompute: float | None = None,
    blend_schedule: BlendSchedule | None = None,
    decoding: Decoding | None = None,
    version: int = 0,
    plans: Sequence[dict[str, Any]] = (),
) -> PreparedQuery:
    """Serve ``ekv``'s rows of each served set under its mode, for the question ``q``: the
    :class:`PreparedQuery` that :func:`answer_prepared` reads out.

    Args:
        records: the memory's records by id (the served events' positions and widths).
        isolated: the memo of isolated encodings (``serve(..., isolated_memo=)``), kept by the memory.
        prefill_ms: the lazy prefill's time, reported in every answer's ``timings_ms``.
        positions: ``original`` | ``contiguous`` (:func:`eventkv.kv.serve.serve`); each answer's ``positions``
            reports where its events were served.
        sequences: per plan, the served events in the order their rows are laid out under contiguous
            positions (``serve(..., sequence=)``), or None (log order); None: log order for every plan.
        recompute: the fraction of served tokens each ``blend`` plan recomputes (None: the default, 0.15).
        blend_schedule: which tokens each ``blend`` plan recomputes on which layer (None: ``once``;
            :data:`eventkv.kv.blend.BlendSchedule`).
        decoding: how every plan's answer is decoded (:class:`eventkv.kv.decoding.Decoding`; None: greedy).
        version: the memory's version, kept in the prepared query.
        plans: per plan, the plan it was served by (:meth:`eventkv.memory.query.QueryOptions.plan`), kept for
            the answers.
    """
    caches, timings = [], []
    seqs = list(sequences) if sequences is not None else [None] * len(served_ids)
    for ids, mode, seq in zip(served_ids, modes, seqs):
        t1 = time.perf_counter()
        fraction, schedule = (recompute, blend_schedule) if mode == "blend" else (None, None)
        caches.append(
            serve(
                ekv,
                ids,
                mode,
                model=lm.model,
                isolated_memo=isolated,
                positions=positions,
                sequence=seq,
                recompute=fraction,
                blend_schedule=schedule,
            )
        )
        timings.append({"prefill": prefill_ms, "serve": 1e3 * (time.perf_counter() - t1)})
    return PreparedQuery(
        served=caches,
        query_ids=list(q),
        max_new_tokens=max_new_tokens,
        candidates=list(candidates),
        keep_logits=keep_logits,
        decoding=decoding,
        positions=[served_positions(ekv, sc, records) for sc in caches],
        timings_ms=timings,
        version=version,
        plans=[dict(p) for p in plans],
    )


def answer_prepared(lm: LoadedModel, prepared: Sequence[PreparedQuery]) -> list[list[MemoryAnswer]]:
    """Read prepared queries out, batched: the queries with one :attr:`PreparedQuery.batch_key` in
    one :func:`eventkv.kv.readout.read_out` (every plan of every query a cache of the batch, each with
    its own question, decoding budget and :class:`eventkv.kv.decoding.Decoding`), the others in one
    readout per key. Each answer equals the query read out alone within float tolerance (tested:
    greedy tokens equal, logits within 1e-4 in float32), while decoding costs about one batched pass:
    on a CPU a decode step reads the weights once whatever the batch size.

    Returns:
        per prepared query, in order, one :class:`MemoryAnswer` per plan. ``timings_ms``: ``prefill``
        and ``serve`` the query's own, ``decode`` its batch's whole readout (shared).

    Raises:
        EventKVError: as :func:`eventkv.kv.readout.read_out` (e.g. history + question + a candidate past the
            model's context); one bad query fails its whole readout (read it out alone to tell).
    """
    out: list[list[MemoryAnswer]] = [[] for _ in prepared]
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(prepared):
        groups.setdefault(p.batch_key, []).append(i)
    for idx in groups.values():
        first = prepared[idx[0]]
        caches = [(i, sc) for i in idx for sc in prepared[i].served]
        cands = [encode(lm.tokenizer, c) for c in first.candidates]
        t2 = time.perf_counter()
        outs = read_out_caches(
            lm.model,
            [sc for _, sc in caches],
            [prepared[i].query_ids for i, _ in caches],
            generate=[True] * len(caches),
            score=[bool(cands)] * len(caches),
            candidates=cands,
            candidate_texts=list(first.candidates),
            max_new_tokens=[prepared[i].max_new_tokens for i, _ in caches],
            stop_token_ids=lm.profile.stop_token_ids,
            tokenizer=lm.tokenizer,
            max_context=lm.profile.max_context,
            keep_logits=first.keep_logits,
            decoding=[prepared[i].decoding for i, _ in caches],
        )
        decode_ms = 1e3 * (time.perf_counter() - t2)
        for (i, sc), o in zip(caches, outs):
            out[i].append(_answer(prepared[i], len(out[i]), sc, o, decode_ms))
    return out


def _answer(p: PreparedQuery, plan: int, sc: ServedCache, o: Readout, decode_ms: float) -> MemoryAnswer:
    """The :class:`MemoryAnswer` of plan ``plan`` of ``p``, read out as ``o``."""
    gen = o.generation
    assert gen is not None  # answer_prepared generates for every cache
    return MemoryAnswer(
        text=gen.text,
        generation=gen,
        candidates=o.candidates,
        served_ids=list(sc.served),
        positions=p.positions[plan],
        n_rows_served=sc.n_visible,
        n_query_tokens=len(p.query_ids),
        timings_ms={**p.timings_ms[plan], "decode": decode_ms},
        plan=dict(p.plans[plan]) if p.plans else {},
    )


def served_positions(
    ekv: EventKV, served: ServedCache, records: Mapping[str, MemoryRecord]
) -> list[tuple[str, int, int]]:
    """``(id, first position, width)`` of each served event where the query saw it: its stored position and
    width (budget included) at original positions; under ``positions="contiguous"`` its first served
    position and its rows (a budget's gap is closed up there)."""
    if served.position_mode == "original" or served.mode == "native":
        # served events are stored ones: only a forgotten event has no position
        return [(i, cast(int, records[i].position), records[i].width) for i in served.served]
    out, row = [], ekv.log.span(HEADER_ID).n_tokens
    for i in served.served:
        n = ekv.log.span(i).n_tokens
        out.append((i, int(served.positions[row]), n))
        row += n
    return out
