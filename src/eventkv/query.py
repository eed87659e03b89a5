"""One query end to end: tokenize a log, prefill it (or reuse its stored EventKV), serve a
served set, read out the answer. The path behind ``eventkv query``."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from eventkv.cache_dir import cache_root
from eventkv.errors import EventKVError
from eventkv.log import EventLog, encode, tokenize, tokenize_query
from eventkv.prefill import EventKV, prefill
from eventkv.readout import CandidateScore, Generation, candidate_logprobs, generate
from eventkv.serve import serve


@dataclass
class Answer:
    """What a query returned: the generation, the candidate scores (if asked), and bookkeeping
    (rows served, whether the EventKV was reused, its directory)."""

    generation: Generation
    candidates: list[CandidateScore] = field(default_factory=list)
    served: tuple[str, ...] = ()
    mode: str = "compact"
    n_rows_served: int = 0
    n_rows_total: int = 0
    reused: bool = False
    store: Path | None = None


def store_dir_for(lm, tlog) -> Path:
    """Default EventKV store of a (model, dtype, tokenized log): a content-addressed directory
    under ``cache_root()/kv``."""
    key = json.dumps([lm.profile.weights_digest, lm.profile.dtype, tlog.to_dict()], sort_keys=True)
    return cache_root() / "kv" / hashlib.sha256(key.encode()).hexdigest()[:24]


def prefill_or_load(lm, log: EventLog, store: Path | None = None, chunk_size: int | None = None) -> tuple[EventKV, bool, Path]:
    """Tokenize and globally prefill ``log``, reusing the EventKV stored at ``store`` when it was made
    from the same tokens by the same weights. Returns (EventKV, reused?, store directory).

    Raises:
        EventKVError: history longer than the model's context.
    """
    tlog = tokenize(log, lm.tokenizer, lm.profile)
    store = Path(store) if store else store_dir_for(lm, tlog)
    if (store / "eventkv.json").is_file():
        try:
            ekv = EventKV.load(store, expect_digest=lm.profile.weights_digest)
            if ekv.log.to_dict() == tlog.to_dict() and ekv.dtype == lm.profile.dtype:
                return ekv, True, store
        except EventKVError:
            pass  # stale or corrupted: prefill again and overwrite
    ekv = prefill(lm.model, tlog, chunk_size=chunk_size, max_context=lm.profile.max_context,
                  weights_digest=lm.profile.weights_digest)
    ekv.save(store)
    return ekv, False, store


def answer(lm, log: EventLog, served: str | Sequence[str], question: str, *, mode: str = "compact",
           candidates: Sequence[str] = (), max_new_tokens: int = 64, store: Path | None = None,
           chunk_size: int | None = None) -> Answer:
    """Answer ``question`` from the rows of the served events of ``log`` (Study 1, "Setting").

    Args:
        lm: a ``LoadedModel`` (``eventkv.models.load``).
        served: event ids or ``"all"``; mode: compact | native | isolated | text.
        candidates: optional answer strings to score (full continuations, log-probabilities in nats).

    Raises:
        EventKVError: unknown event id, empty served set, bad mode, history beyond the context.
    """
    ekv, reused, store = prefill_or_load(lm, log, store, chunk_size)
    sc = serve(ekv, served, mode, model=lm.model)
    q = tokenize_query(lm.tokenizer, lm.profile, question)
    gen = generate(lm.model, sc, q, max_new_tokens=max_new_tokens, stop_token_ids=lm.profile.stop_token_ids,
                   tokenizer=lm.tokenizer, max_context=lm.profile.max_context)
    scores = []
    if candidates:
        scores = candidate_logprobs(lm.model, sc, q, [encode(lm.tokenizer, c) for c in candidates],
                                    texts=list(candidates), max_context=lm.profile.max_context)
    return Answer(gen, scores, sc.served, mode, sc.n_visible, ekv.n_rows, reused, store)
