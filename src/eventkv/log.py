"""Event logs and their tokenization: the first arrow of the data path.

An agent history is a **header** (the chat template's opening up to the user content, plus
an optional fixed task instruction) followed by **events**. Each event is tokenized on its
own, so its token span is exact and no BPE merge crosses an event boundary
(Study 1, "Setting"). An event may carry a **position budget**: it occupies that many
positions (RoPE ids) whatever its token count, so every later event keeps the same
positions when this event's text changes (Study 1, "Donor pair").

Vocabulary: *rows* are cache slots (indices into the stored K/V), *positions* are the
RoPE position ids those rows were computed at. In a TokenizedLog rows are contiguous;
positions skip the unused part of any budget.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

from eventkv.errors import EventKVError

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.models import ModelProfile

HEADER_ID = "<header>"


def read_jsonl(path: str | Path, what: str, hint: str):
    """Yield ``(line number, line, parsed object)`` for each non-blank line of a JSONL file.

    Raises:
        EventKVError: the path is missing or a directory, or a line is not valid JSON.
    """
    p = Path(path)
    if p.is_dir():
        raise EventKVError(f"{what} {str(p)!r} is a directory: give the path of a JSONL file ({hint}).")
    if not p.is_file():
        raise EventKVError(f"{what} {str(p)!r} does not exist: give the path of a JSONL file ({hint}).")
    for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EventKVError(f"{p}:{n} is not valid JSON ({exc.msg}): write one JSON object per line.") from None
        yield n, line, obj


@dataclass(frozen=True)
class Event:
    """One event of an agent history.

    Attributes:
        id: unique name of the event within its log (used in served sets).
        text: the event's text, exactly as it enters the prompt.
        role: optional label; when given the event is rendered as ``"{role}: {text}"``.
        budget: optional position budget in tokens (>= the event's token count).
    """

    id: str
    text: str
    role: str | None = None
    budget: int | None = None

    def render(self) -> str:
        """The prompt text of this event: ``[role + ": "] + text + "\\n"`` (the newline ends the event)."""
        body = f"{self.role}: {self.text}" if self.role else self.text
        return body if body.endswith("\n") else body + "\n"


@dataclass
class EventLog:
    """An ordered list of events plus an optional task instruction placed in the header.

    Raises:
        EventKVError: empty log, duplicate or empty event ids, or a non-positive budget.
    """

    events: list[Event]
    instruction: str = ""

    def __post_init__(self) -> None:
        if not self.events:
            raise EventKVError("the event log is empty: give at least one event (one JSON object per line).")
        seen: set[str] = set()
        for ev in self.events:
            if not ev.id:
                raise EventKVError(f"an event has an empty id (text {ev.text[:40]!r}): give every event a unique 'id'.")
            if ev.id == HEADER_ID:
                raise EventKVError(f"event id {HEADER_ID!r} is reserved for the header: rename that event.")
            if ev.id in seen:
                raise EventKVError(f"duplicate event id {ev.id!r}: event ids must be unique within a log.")
            if ev.budget is not None and ev.budget <= 0:
                raise EventKVError(f"event {ev.id!r} has budget {ev.budget}: a position budget must be a positive token count.")
            seen.add(ev.id)

    @property
    def ids(self) -> list[str]:
        return [ev.id for ev in self.events]

    @classmethod
    def from_jsonl(cls, path: str | Path, instruction: str = "") -> "EventLog":
        """Read a log from a JSONL file: one event per line with keys ``id``, ``text`` and optional
        ``role`` and ``budget``. Blank lines are skipped.

        Raises:
            EventKVError: missing file, a line that is not JSON, a missing ``id``/``text``, or an empty log.
        """
        p = Path(path)
        events = []
        for n, line, obj in read_jsonl(p, "event log", "one event per line"):
            if not isinstance(obj, dict) or "id" not in obj or "text" not in obj:
                raise EventKVError(f"{p}:{n} needs keys 'id' and 'text' (got {line[:60]!r}).")
            budget = obj.get("budget")
            events.append(Event(id=str(obj["id"]), text=str(obj["text"]), role=obj.get("role"),
                                budget=int(budget) if budget is not None else None))
        if not events:
            raise EventKVError(f"event log {str(p)!r} has no events: write one JSON object per line.")
        return cls(events, instruction=instruction)


@dataclass(frozen=True)
class Span:
    """Where one event (or the header) lives. Rows are ``[row_start, row_end)``; its tokens sit at
    positions ``pos_start .. pos_start + n_tokens - 1``; it reserves ``width`` positions
    (its budget, or its token count)."""

    event_id: str
    row_start: int
    row_end: int
    pos_start: int
    width: int

    @property
    def n_tokens(self) -> int:
        return self.row_end - self.row_start


@dataclass
class TokenizedLog:
    """Token ids of a header and events, each tokenized on its own, with rows and positions.

    Attributes:
        header_ids: token ids of the header (chat head + instruction), at positions 0..h-1.
        event_ids: event names, in order.
        event_tokens: token ids per event.
        budgets: position budget per event (None = its token count).
    Derived: ``spans`` (header first), ``input_ids`` (all rows, length R), ``position_ids``
    (length R), ``history_end`` (first position after the full history: where queries start).
    """

    header_ids: list[int]
    event_ids: list[str]
    event_tokens: list[list[int]]
    budgets: list[int | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.budgets:
            self.budgets = [None] * len(self.event_ids)
        if not (len(self.event_ids) == len(self.event_tokens) == len(self.budgets)):
            raise EventKVError("event_ids, event_tokens and budgets must have one entry per event.")
        if not self.event_ids:
            raise EventKVError("the event log is empty: give at least one event.")
        spans = [Span(HEADER_ID, 0, len(self.header_ids), 0, len(self.header_ids))]
        row, pos = len(self.header_ids), len(self.header_ids)
        for eid, toks, budget in zip(self.event_ids, self.event_tokens, self.budgets):
            if not toks:
                raise EventKVError(f"event {eid!r} tokenizes to no tokens: give it some text.")
            width = len(toks) if budget is None else budget
            if width < len(toks):
                raise EventKVError(
                    f"event {eid!r} has {len(toks)} tokens but a position budget of {budget}: "
                    f"raise its budget to at least {len(toks)}.")
            spans.append(Span(eid, row, row + len(toks), pos, width))
            row += len(toks)
            pos += width
        self.spans: list[Span] = spans
        self._by_id = {s.event_id: s for s in spans}
        self.history_end: int = pos
        self.n_rows: int = row

    @classmethod
    def from_ids(cls, header_ids: Sequence[int], events: Iterable[tuple[str, Sequence[int], int | None]]) -> "TokenizedLog":
        """Build from token ids directly: ``events`` yields ``(id, token_ids, budget)``."""
        evs = list(events)
        return cls(list(header_ids), [e[0] for e in evs], [list(e[1]) for e in evs], [e[2] for e in evs])

    @property
    def input_ids(self) -> list[int]:
        out = list(self.header_ids)
        for toks in self.event_tokens:
            out.extend(toks)
        return out

    @property
    def position_ids(self) -> list[int]:
        out: list[int] = []
        for s in self.spans:
            out.extend(range(s.pos_start, s.pos_start + s.n_tokens))
        return out

    def span(self, event_id: str) -> Span:
        """The span of one event (or of ``HEADER_ID``).

        Raises:
            EventKVError: unknown event id (the message lists a few known ids).
        """
        try:
            return self._by_id[event_id]
        except KeyError:
            known = ", ".join(self.event_ids[:8]) + (" ..." if len(self.event_ids) > 8 else "")
            raise EventKVError(f"unknown event id {event_id!r}: the log's events are {known}.") from None

    def to_dict(self) -> dict:
        return {"header_ids": self.header_ids, "event_ids": self.event_ids,
                "event_tokens": self.event_tokens, "budgets": self.budgets}

    @classmethod
    def from_dict(cls, d: dict) -> "TokenizedLog":
        return cls(list(d["header_ids"]), list(d["event_ids"]), [list(t) for t in d["event_tokens"]], list(d["budgets"]))


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` alone, without special tokens (so pieces concatenate exactly)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def header_text(profile: "ModelProfile", instruction: str = "") -> str:
    """The header: the chat template's head (up to the user content) plus the task instruction
    (followed by a newline when non-empty)."""
    if instruction and not instruction.endswith("\n"):
        instruction += "\n"
    return profile.chat_head + instruction


def tokenize(log: EventLog, tokenizer, profile: "ModelProfile") -> TokenizedLog:
    """Tokenize a log: the header once, then each event's rendered text on its own.

    Budgets given as ``Event.budget`` carry over. Study 1, "Setting" and "Donor pair".

    Raises:
        EventKVError: an event that tokenizes to nothing, or is longer than its budget.
    """
    header = encode(tokenizer, header_text(profile, log.instruction))
    return TokenizedLog(header, log.ids, [encode(tokenizer, ev.render()) for ev in log.events],
                        [ev.budget for ev in log.events])


def tokenize_query(tokenizer, profile: "ModelProfile", question: str) -> list[int]:
    """Token ids of a query: the question, then the chat template's tail (end of the user turn and
    the assistant opener), so generation starts as the assistant's reply."""
    return encode(tokenizer, question + profile.chat_tail)
