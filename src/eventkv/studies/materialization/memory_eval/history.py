"""A LoCoMo conversation as ``eventkv memory eval`` (:mod:`eventkv.studies.materialization.memory_eval`) holds
it and asks it: the memory's events and instruction header (:func:`history_events`, :data:`INSTRUCTION`,
:data:`HEADED_INSTRUCTION`), its memory prefilled once and reopened by a restarted run (:func:`open_history`),
a selector's served set at a budget (:func:`served_set`), and the question as LoCoMo's evaluation asks it
(:func:`question_prompt`, :data:`NOT_MENTIONED`) with the short answer read from a generation (:func:`first_line`)."""

from __future__ import annotations

import shutil
import weakref
from pathlib import Path
from typing import Any

from eventkv.memory.query import QueryOptions

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
INSTRUCTION = (
    "The events below are the turns of a conversation, in order, each with its session date and speaker. "
    "Answer questions about the conversation."
)
HEADED_INSTRUCTION = (
    "The events below are the turns of a conversation, in order, each session opened by a header with its "
    "date; each turn names its speaker. Answer questions about the conversation."
)
#: LoCoMo's evaluation scripts for open models ask for a short answer in a few words, not a complete or lengthy
#: sentence, in the conversation's own words where possible (task_eval/evaluate_llama2.py); token F1 counts every
#: extra word of a sentence answer against it
QUESTION = (
    "Question: {question}\nAnswer in a few words, not a complete sentence, using the conversation's own words where "
    "possible."
)
#: LoCoMo's evaluation scripts (task_eval) append this to category-2 (temporal) questions
TEMPORAL_SUFFIX = " Use DATE of CONVERSATION to answer with an approximate date."
#: LoCoMo's category-5 forced choice: this abstention against the question's adversarial answer
NOT_MENTIONED = "Not mentioned in the conversation"


def question_prompt(question: str, category: int) -> str:
    """The question as the eval asks it (LoCoMo's category-2 suffix; :data:`QUESTION`)."""
    return QUESTION.format(question=question + (TEMPORAL_SUFFIX if category == 2 else ""))


def first_line(text: str) -> str:
    """The first non-empty line of a generation, stripped (the short answer)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def served_set(
    mem,
    question: str,
    selector: str,
    budget: float,
    *,
    k: int | None = None,
    neighbours: int = 0,
    with_headers: bool = False,
) -> list[str]:
    """The served set (event ids, history order) of one selector at one budget (a fraction of the
    view's rows), as :meth:`eventkv.memory.EventMemory.select` chooses it under these
    :class:`eventkv.memory.QueryOptions` (never over the budget).

    Raises:
        OptionError: an unknown selector or a bad shaping value.
    """
    options = QueryOptions(k=k, selector=selector, budget=budget, neighbours=neighbours, with_headers=with_headers)
    return mem.selection().select(question, options)


def history_events(conv, with_headers: bool, resolve_dates: bool = False) -> list:
    """The memory events of a conversation's turns (the package docstring): one per turn, dated; with
    ``with_headers`` a header event (id ``session-N``, tag ``"header"``) before each session's turns,
    which are then undated; with ``resolve_dates`` each relative date expression of a dated turn is followed
    by the date it means against its session's date (:func:`eventkv.memory.dates.resolve_relative_dates`).
    Returns ``[(session, [MemoryEvent, ...]), ...]`` in history order."""
    from dataclasses import replace

    from eventkv.memory import MemoryEvent
    from eventkv.memory.dates import resolve_relative_dates
    from eventkv.studies.materialization.dialogue import session_header_text

    sessions: list[tuple[int, list]] = []
    for t in conv.turns:
        if not sessions or sessions[-1][0] != t.session:
            head = []
            if with_headers:
                text = session_header_text(t.session, t.date_time)
                head = [MemoryEvent(text, id=f"session-{t.session}", tags=("header",))]
            sessions.append((t.session, head))
        if resolve_dates and t.date_time:
            t = replace(t, text=resolve_relative_dates(t.text, t.date_time))
        sessions[-1][1].append(MemoryEvent(t.event_text(dated=not with_headers), id=t.id))
    return sessions


#: the memories :func:`open_history` opened in this process, by directory (a store takes one writer)
_OPEN: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def open_history(
    directory: Path, lm, instruction: str, sessions: list, rows: str = "native", window: int | None = None
) -> Any:
    """The memory of one history in ``directory``, its rows stored in format ``rows``: reopened when it holds a
    prefix of these events (the same ids and texts, in order; the missing sessions are then added), else built
    afresh (a store made by another model, header or row format, or for another history, is removed); every
    session is added with its rows prefilled and committed, so a kill loses at most the session in flight. A handle this
    process opened on ``directory`` before is closed first. ``window``: the positions each prefill forward spans at
    most (header + recent rows + new tokens, :class:`eventkv.kv.windowed.PrefillWindow`), so a row past it is computed
    with only the header and the rows just before it in view; None: the model's context. A store does not record
    its window: give one directory per window.

    Raises:
        StoreDamaged: the store is damaged (:meth:`EventMemory.open`).
        OptionError: ``window`` not a whole number in [2, the model's context].
        EventKVError: another process holds the store; as :meth:`EventMemory.create` and
            :meth:`EventMemory.add`.
    """
    import json

    from eventkv.kv.windowed import PrefillWindow
    from eventkv.memory import EventMemory
    from eventkv.memory.identity import model_identity

    span = None if window is None else PrefillWindow.for_context(lm.profile.max_context, size=window)

    key = str(directory.resolve())
    if key in _OPEN:
        _OPEN[key].close()  # this process's earlier handle (another probe object) holds the writer lock
    want = [(e.id, e.text) for _, evs in sessions for e in evs]
    mem = None
    if directory.exists():
        manifest = directory / "manifest.json"
        made = json.loads(manifest.read_text()) if manifest.is_file() else {}
        same = (
            all(made.get(k) == v for k, v in model_identity(lm).items())
            and made.get("instruction") == instruction
            and made.get("rows", "native") == rows
        )
        if same:  # a store of this model and header: any other error (damage, a live writer) is raised
            mem = EventMemory.open(directory, lm, window=span)
            have = [(r.id, r.text) for r in mem.list()]
            if have != want[: len(have)]:
                mem.close()
                mem = None
        if mem is None:  # made for another history or model (a run folder taken over), or never completed
            shutil.rmtree(directory)
    if mem is None:
        directory.parent.mkdir(parents=True, exist_ok=True)
        mem = EventMemory.create(directory, lm, namespace="eval", instruction=instruction, rows=rows, window=span)
    _OPEN[key] = mem
    done = len(mem.list())
    seen = 0
    for _, evs in sessions:
        if seen + len(evs) > done:
            mem.add(evs[max(0, done - seen) :], prefill=True)
        seen += len(evs)
    mem.prefill()  # events left pending by an earlier process
    return mem
