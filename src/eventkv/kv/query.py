"""One query end to end: tokenize a log, prefill it (or reuse its stored EventKV), serve a
served set, read out the answer. The path behind ``eventkv query``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence, TypedDict, Unpack

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.log import HEADER_ID, EventLog, tokenize, tokenize_query
from eventkv.kv.model import check_context, model_device
from eventkv.kv.prefill import prefill
from eventkv.kv.readout import CandidateScore, Generation, answer_served
from eventkv.kv.rows import EventKV
from eventkv.kv.serve import ALL, SERVE_MODES, PositionMode, ServeMode, check_position_mode, default_positions, serve
from eventkv.models.cache_dir import cache_root
from eventkv.options import check_chunk_size, check_max_new_tokens, check_out_dir

if TYPE_CHECKING:
    from eventkv.kv.log import TokenizedLog
    from eventkv.models import LoadedModel


@dataclass
class Answer:
    """What a query returned: the generation, the candidate scores (if asked), and bookkeeping
    (rows served, whether the EventKV was reused, its directory, where the served rows sat)."""

    generation: Generation
    candidates: list[CandidateScore] = field(default_factory=list)
    served: tuple[str, ...] = ()
    mode: ServeMode = "compact"
    n_rows_served: int = 0
    n_rows_total: int = 0
    reused: bool = False
    store: Path | None = None
    positions: PositionMode = "original"


def store_dir_for(lm: LoadedModel, tlog: TokenizedLog) -> Path:
    """Default EventKV store of a (model, dtype, tokenized log): a content-addressed directory
    under ``cache_root()/kv``."""
    key = json.dumps([lm.profile.weights_digest, lm.profile.dtype, tlog.to_dict()], sort_keys=True)
    return cache_root() / "kv" / hashlib.sha256(key.encode()).hexdigest()[:24]


def prefill_or_load(
    lm: LoadedModel,
    log: EventLog,
    store: Path | None = None,
    chunk_size: int | None = None,
    *,
    query_tokens: int = 0,
    max_new_tokens: int = 0,
    served: Sequence[str] | None = None,
) -> tuple[EventKV, bool, Path]:
    """Tokenize and globally prefill ``log``, reusing the EventKV stored at ``store`` when it was made
    from the same tokens by the same weights in the same dtype (on any device: a stored EventKV is read
    to the model's device). Returns (EventKV, reused?, store directory).

    The default store is content-addressed (model, dtype, tokens), so it only ever holds this very
    EventKV; a corrupted one there is prefilled again. A ``store`` given by the caller that holds a
    *different* EventKV (another log, model or dtype) is refused, never overwritten.

    ``query_tokens`` and ``max_new_tokens`` (tokens a query will add) are checked against the
    model's context *before* anything is computed or written: after the whole history, or with ``served``
    (the event ids a query serves at contiguous positions, or ``["all"]``) after the header and those events.

    Raises:
        EventKVError: history (+ query) longer than the model's context; a given ``store`` holding
            another EventKV (or a corrupted one).
        OptionError: ``max_new_tokens`` past the context left after history and query.
    """
    tlog = tokenize(log, lm.tokenizer, lm.profile)
    ctx = lm.profile.max_context
    check_context(tlog.history_end, ctx)
    if served is None:
        check_context(tlog.history_end + query_tokens, ctx, what="history plus query")
        used, taken = tlog.history_end + query_tokens, "the history and the query take"
    else:  # contiguous: the query follows the header and the served events
        ids = tlog.event_ids if list(served) == [ALL] else served
        used = tlog.span(HEADER_ID).n_tokens + sum(tlog.span(e).n_tokens for e in dict.fromkeys(ids)) + query_tokens
        taken = "the header, the served events and the query take"
    if ctx is not None and used + max_new_tokens > ctx:
        where = "" if served is None else " (contiguous positions)"
        raise OptionError(
            "max_new_tokens",
            max_new_tokens,
            f"{taken} {used} of the model's {ctx} positions{where}: give at most {ctx - used} new tokens.",
        )
    given = store is not None
    store = Path(store) if store is not None else store_dir_for(lm, tlog)
    check_out_dir(store, "store")
    if (store / "eventkv.json").is_file():
        try:
            ekv = EventKV.load(store, expect_digest=lm.profile.weights_digest, device=model_device(lm.model))
            if ekv.log.to_dict() == tlog.to_dict() and ekv.dtype == lm.profile.dtype:
                return ekv, True, store
            why = "another log" if ekv.log.to_dict() != tlog.to_dict() else f"{ekv.dtype} rows, not {lm.profile.dtype}"
        except EventKVError as exc:
            why = str(exc)
        if given:  # the caller's directory: never overwrite what it holds
            raise EventKVError(
                f"--store {str(store)!r} already holds a different EventKV ({why}): give another "
                f"directory, delete that one, or leave --store out (a content-addressed store)."
            )
    ekv = prefill(
        lm.model,
        tlog,
        chunk_size=chunk_size,
        max_context=lm.profile.max_context,
        weights_digest=lm.profile.weights_digest,
    )
    ekv.save(store)
    return ekv, False, store


class AnswerOptions(TypedDict, total=False):
    """The options of a query (:func:`answer`, :func:`check_query`); one left out takes its default in
    :data:`ANSWER_DEFAULTS`.

    Attributes:
        mode: compact | native | isolated | text (:data:`eventkv.kv.serve.SERVE_MODES`).
        candidates: answer strings to score (full continuations, log-probabilities in nats).
        max_new_tokens: greedy generation length limit (tokens, >= 1).
        chunk_size: prefill at most this many tokens per forward (None: the whole log at once).
        store: the EventKV's directory (None: content-addressed under ``$EVENTKV_CACHE/kv/``).
        positions: ``original`` | ``contiguous``: the served rows at their own positions, or re-rotated to
            the positions right after the header with the query right after them (:func:`eventkv.kv.serve.serve`);
            None (default): :func:`eventkv.kv.serve.default_positions` (contiguous unless the mode is ``native`` or
            the model's RoPE cannot be re-rotated exactly); :attr:`Answer.positions` records the one used.
    """

    mode: ServeMode
    candidates: Sequence[str]
    max_new_tokens: int
    chunk_size: int | None
    store: Path | None
    positions: PositionMode | None


ANSWER_DEFAULTS: AnswerOptions = {
    "mode": "compact",
    "candidates": (),
    "max_new_tokens": 64,
    "chunk_size": None,
    "store": None,
    "positions": None,
}
"""The default of every :class:`AnswerOptions` field."""


def _answer_options(function: str, options: AnswerOptions) -> AnswerOptions:
    """``options`` with the defaults of those left out.

    Raises:
        TypeError: a name that is no :class:`AnswerOptions` field (as Python does for an unknown keyword).
    """
    unknown = sorted(options.keys() - AnswerOptions.__annotations__.keys())
    if unknown:
        raise TypeError(f"{function}() got an unexpected keyword argument {unknown[0]!r}")
    return {**ANSWER_DEFAULTS, **options}


def check_query(log: EventLog, served: str | Sequence[str], question: str, **options: Unpack[AnswerOptions]) -> None:
    """Check a query's options against ``log`` before any model work (the CLI calls it before the model loads).

    Raises:
        OptionError: unknown mode, empty served set or an empty id in it (``e0,,e5``), empty
            question, empty or repeated candidate, ``max_new_tokens < 1``, ``chunk_size < 1``, a
            ``store`` that is a file, an unknown ``positions`` or ``contiguous`` with ``native``.
        EventKVError: a served event id that is not in the log.
    """
    opts = _answer_options("check_query", options)
    mode = opts["mode"]
    if mode not in SERVE_MODES:
        raise OptionError("mode", mode, f"use one of {', '.join(SERVE_MODES)}.")
    if opts["positions"] is not None:
        check_position_mode(opts["positions"], mode)
    ids = [s.strip() for s in (served.split(",") if isinstance(served, str) else served)]
    if isinstance(served, str) and served.strip() == ALL:
        ids = []
    elif not [s for s in ids if s]:
        raise OptionError(
            "served", served, "the served set is empty; give event ids separated by commas, or 'all'.", flag="--serve"
        )
    elif not all(ids):
        raise OptionError(
            "served",
            served,
            "an entry is empty (two commas in a row, or a trailing comma); give event ids separated by single commas.",
            flag="--serve",
        )
    known = set(log.ids)
    for s in ids:
        if s and s not in known and s != HEADER_ID:  # the header is serve()'s to refuse
            shown = ", ".join(log.ids[:8]) + (" ..." if len(log.ids) > 8 else "")
            raise EventKVError(f"unknown event id {s!r}: the log's events are {shown}.")
    if not isinstance(question, str) or not question.strip():
        raise OptionError("question", question, "give a non-empty question.")
    cands = list(opts["candidates"])
    if any(not isinstance(c, str) or not c.strip() for c in cands) or len(set(cands)) != len(cands):
        raise OptionError("candidates", cands, "give distinct, non-empty candidate answers.")
    check_max_new_tokens(opts["max_new_tokens"])
    check_chunk_size(opts["chunk_size"])
    check_out_dir(opts["store"], "store")


def answer(
    lm: LoadedModel, log: EventLog, served: str | Sequence[str], question: str, **options: Unpack[AnswerOptions]
) -> Answer:
    """Answer ``question`` from the rows of the served events of ``log`` (Study 1, "Setting").

    Args:
        lm: a ``LoadedModel`` (``eventkv.models.load``).
        served: event ids or ``"all"``.
        options: :class:`AnswerOptions` (mode, candidates, max_new_tokens, chunk_size, store, positions).

    Raises:
        EventKVError: unknown event id, empty served set, bad mode or another bad option (see
            :func:`check_query`), history beyond the context.
    """
    opts = _answer_options("answer", options)
    mode, candidates, max_new_tokens = opts["mode"], opts["candidates"], opts["max_new_tokens"]
    store, chunk_size, positions = opts["store"], opts["chunk_size"], opts["positions"]
    check_query(
        log,
        served,
        question,
        mode=mode,
        candidates=candidates,
        max_new_tokens=max_new_tokens,
        chunk_size=chunk_size,
        positions=positions,
    )
    if positions is None:  # checked first: bad options are refused before the model is touched
        positions = default_positions(lm.model, [mode])
    q = tokenize_query(lm.tokenizer, lm.profile, question)
    # contiguous: the query follows the served rows, so the context counts the header and the served events,
    # not the history's end
    if positions == "original":
        ids = None
    elif isinstance(served, str):
        ids = [ALL] if served.strip() == ALL else [s.strip() for s in served.split(",")]
    else:
        ids = list(served)
    ekv, reused, store = prefill_or_load(
        lm, log, store, chunk_size, query_tokens=len(q), max_new_tokens=max_new_tokens, served=ids
    )
    sc = serve(ekv, served, mode, model=lm.model, positions=positions)
    p = lm.profile
    [(gen, scores)] = answer_served(
        lm.model,
        lm.tokenizer,
        [sc],
        q,
        max_new_tokens=max_new_tokens,
        stop_token_ids=p.stop_token_ids,
        max_context=p.max_context,
        candidates=candidates,
    )
    return Answer(gen, scores, sc.served, mode, sc.n_visible, ekv.n_rows, reused, store, positions)
