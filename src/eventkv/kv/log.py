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

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from eventkv.errors import EventKVError
from eventkv.models.encoding import encode

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.models.profile import ModelProfile

HEADER_ID = "<header>"


def read_jsonl(path: str | Path, what: str, hint: str):
    """Yield ``(line number, line, parsed object)`` for each non-blank line of a JSONL file.

    Raises:
        EventKVError: the path is missing or a directory, the file is not UTF-8, or a line is not valid JSON.
    """
    p = Path(path)
    if p.is_dir():
        raise EventKVError(f"{what} {str(p)!r} is a directory: give the path of a JSONL file ({hint}).")
    if not p.is_file():
        raise EventKVError(f"{what} {str(p)!r} does not exist: give the path of a JSONL file ({hint}).")
    raw = p.read_bytes()
    try:
        text = raw.decode("utf-8-sig")  # a leading byte-order mark (Windows editors) is dropped
    except UnicodeDecodeError as exc:
        line_no = raw.count(b"\n", 0, exc.start) + 1
        raise EventKVError(
            f"{what} {str(p)!r} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}, line {line_no}): "
            f"save it as UTF-8 ({hint})."
        ) from None
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            raise EventKVError(f"{p}:{n} is not valid JSON ({exc.msg}): write one JSON object per line.") from None
        except _DuplicateKey as exc:
            raise EventKVError(
                f"{p}:{n} gives the key {exc.key!r} twice: give each key once (JSON would silently keep the last)."
            ) from None
        yield n, line, obj


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """``json.loads`` hook: a JSON object, refusing a key given twice (json keeps the last silently)."""
    seen: set[str] = set()
    for k, _ in pairs:
        if k in seen:
            raise _DuplicateKey(k)
        seen.add(k)
    return dict(pairs)


class EventSchema(BaseModel):
    """The schema of one event, written once and used by every reader (JSONL logs, the library's
    :class:`Event`): keys ``id``, ``text``, ``role``, ``budget`` and no others, each of its exact
    JSON type (no coercion: ``"budget": "3"`` or ``2.5`` is refused, not converted)."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    id: str = Field(min_length=1)
    text: str
    role: str | None = None
    budget: int | None = Field(default=None, ge=1)

    @field_validator("id", "text", "role")
    @classmethod
    def _not_blank(cls, v: str | None) -> str | None:
        if v is not None and not v.strip():
            raise ValueError("blank")
        return v

    @field_validator("id")
    @classmethod
    def _servable_id(cls, v: str) -> str:
        # a served set is written "e1,e2" on the command line (ids stripped): an id with a comma or
        # surrounding spaces could never be served.
        if "," in v or v != v.strip():
            raise ValueError("not servable")
        return v


_FIELD_RULES = {
    "id": 'give a non-empty string without commas or surrounding spaces, unique within the log (e.g. "e1")',
    "text": "give the event's text as a non-empty string",
    "role": 'give a non-empty string (e.g. "user") or leave the key out',
    "budget": "give a whole number of positions >= 1 (at least the event's token count), or leave the key out",
}


def check_record(schema: type[BaseModel], obj, where: str, rules: dict[str, str], what: str):
    """Validate one JSON record against a pydantic ``schema`` (strict, no extra keys), turning the
    first problem into one line.

    Args:
        where: how to name the record (``"events.jsonl:3"``, ``"event 'e1'"``).
        rules: per field, what is allowed and how to fix it (every field of ``schema``).
        what: what one record is, for the not-an-object message (``"an event"``).

    Returns:
        the validated ``schema`` instance.

    Raises:
        EventKVError: naming the record, the field, the bad value and what is allowed.
    """
    keys = ", ".join(repr(k) for k in rules)
    if not isinstance(obj, dict):
        raise EventKVError(f"{where} is {type(obj).__name__} {_short(obj)}: {what} is a JSON object with keys {keys}.")
    try:
        return schema.model_validate(obj)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = str(err["loc"][0]) if err["loc"] else "?"
        more = f" (and {exc.error_count() - 1} more problem(s))" if exc.error_count() > 1 else ""
        if err["type"] == "missing":
            msg = f"{where} has no {key!r}: {rules[key]}"
        elif err["type"] == "extra_forbidden":
            msg = f"{where} has an unknown key {key!r}: the keys of {what} are {', '.join(rules)}"
        else:
            at = "".join(f"[{i}]" for i in err["loc"][1:])
            msg = f"{where} has {key}{at} = {_short(err['input'])}: {rules.get(key, err['msg'])}"
        raise EventKVError(msg + more + ".") from None


def check_event(obj, where: str) -> EventSchema:
    """Validate one event record (a dict, e.g. a parsed JSONL line) against :class:`EventSchema`.

    Raises:
        EventKVError: one line naming the record, the field, the bad value and what is allowed.
    """
    return check_record(EventSchema, obj, where, _FIELD_RULES, "an event")


def _short(v) -> str:
    r = json.dumps(v) if isinstance(v, (str, int, float, list, dict, bool, type(None))) else repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


@dataclass(frozen=True)
class Event:
    """One event of an agent history.

    Attributes:
        id: unique name of the event within its log (used in served sets).
        text: the event's text, exactly as it enters the prompt.
        role: optional label; when given the event is rendered as ``"{role}: {text}"``.
        budget: optional position budget in tokens (>= the event's token count).

    Raises:
        EventKVError: a field of the wrong type or out of range (see :class:`EventSchema`).
    """

    id: str
    text: str
    role: str | None = None
    budget: int | None = None

    def __post_init__(self) -> None:
        check_event(
            {k: v for k, v in self.__dict__.items() if v is not None or k in ("id", "text")},
            f"event {self.id!r}" if isinstance(self.id, str) and self.id else "an event",
        )

    def render(self) -> str:
        """The prompt text of this event: ``[role + ": "] + text + "\\n"`` (the newline ends the event)."""
        body = f"{self.role}: {self.text}" if self.role else self.text
        return body if body.endswith("\n") else body + "\n"


@dataclass
class EventLog:
    """An ordered list of events plus an optional task instruction placed in the header.

    Raises:
        EventKVError: empty log, a duplicate or reserved event id (each event checks its own fields).
    """

    events: list[Event]
    instruction: str = ""

    def __post_init__(self) -> None:
        if not self.events:
            raise EventKVError("the event log is empty: give at least one event (one JSON object per line).")
        if not isinstance(self.instruction, str):
            raise EventKVError(f"instruction {_short(self.instruction)}: give the task instruction as a string.")
        seen: set[str] = set()
        for ev in self.events:
            if not isinstance(ev, Event):
                raise EventKVError(
                    f"{_short(ev)} is not an Event: build each event with eventkv.kv.log.Event(id=..., text=...)."
                )
            if ev.id == HEADER_ID:
                raise EventKVError(f"event id {HEADER_ID!r} is reserved for the header: rename that event.")
            if ev.id in seen:
                raise EventKVError(f"duplicate event id {ev.id!r}: event ids must be unique within a log.")
            seen.add(ev.id)

    @property
    def ids(self) -> list[str]:
        return [ev.id for ev in self.events]

    @classmethod
    def from_jsonl(cls, path: str | Path, instruction: str = "") -> "EventLog":
        """Read a log from a JSONL file: one event per line with keys ``id``, ``text`` and optional
        ``role`` and ``budget``. Blank lines are skipped.

        Raises:
            EventKVError: missing file, a file that is not UTF-8, a line that is not JSON, a line that
                breaks :class:`EventSchema` (missing or unknown key, wrong type, empty text, budget < 1),
                a duplicate id, or an empty log.
        """
        p = Path(path)
        events = []
        first_line: dict[str, int] = {}
        for n, _line, obj in read_jsonl(p, "event log", "one event per line"):
            ev = check_event(obj, f"{p}:{n}")
            if ev.id in first_line:
                raise EventKVError(
                    f"{p}:{n} repeats event id {ev.id!r} (first on line {first_line[ev.id]}): event ids "
                    f"must be unique within a log."
                )
            first_line[ev.id] = n
            events.append(Event(id=ev.id, text=ev.text, role=ev.role, budget=ev.budget))
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
                    f"raise its budget to at least {len(toks)}."
                )
            spans.append(Span(eid, row, row + len(toks), pos, width))
            row += len(toks)
            pos += width
        self.spans: list[Span] = spans
        self._by_id = {s.event_id: s for s in spans}
        self.history_end: int = pos
        self.n_rows: int = row

    @classmethod
    def from_ids(
        cls, header_ids: Sequence[int], events: Iterable[tuple[str, Sequence[int], int | None]]
    ) -> "TokenizedLog":
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
        return {
            "header_ids": self.header_ids,
            "event_ids": self.event_ids,
            "event_tokens": self.event_tokens,
            "budgets": self.budgets,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "TokenizedLog":
        return cls(
            list(d["header_ids"]), list(d["event_ids"]), [list(t) for t in d["event_tokens"]], list(d["budgets"])
        )


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
    return TokenizedLog(
        header, log.ids, [encode(tokenizer, ev.render()) for ev in log.events], [ev.budget for ev in log.events]
    )


def tokenize_query(tokenizer, profile: "ModelProfile", question: str) -> list[int]:
    """Token ids of a query: the question, then the chat template's tail (end of the user turn and
    the assistant opener), so generation starts as the assistant's reply."""
    return encode(tokenizer, question + profile.chat_tail)


def check_sequence(ids: Sequence[str], sequence: Sequence[str]) -> tuple[str, ...]:
    """``sequence`` checked to list exactly the served events ``ids`` (each once), as a tuple.

    Raises:
        EventKVError: an event of ``sequence`` not served, a served event missing, or one listed twice.
    """
    seq = tuple(s.strip() for s in sequence)
    if sorted(seq) != sorted(ids):
        raise EventKVError(
            f"the served order {list(seq)} does not list the served events {list(ids)} once each: give every "
            "served event exactly once."
        )
    return seq
