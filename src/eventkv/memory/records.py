"""The plain data types of the memory's API: what a caller hands in (:class:`MemoryEvent`) and what
the verbs hand back (:class:`Added`, :class:`MemoryRecord`, :class:`MemoryStats`,
:class:`MemoryAnswer`, :class:`Hit`). No model code, no storage code: the eval and the HTTP service can import
them without loading anything."""

from __future__ import annotations

import datetime as _dt
import unicodedata
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from eventkv.errors import EventKVError, OptionError

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.kv.readout import CandidateScore, Generation

#: what an event row of the store is: an event added by ``add``, a patch appended by ``update``,
#: or a programmed carrier (an answer-free event written on purpose)
KINDS = ("event", "patch", "carrier")
#: the kinds a caller may ``add`` (patches are only appended by ``update``)
ADD_KINDS = ("event", "carrier")

#: character categories that do not show: control (Cc), format (Cf: zero-width space, joiners, bidi
#: controls, soft hyphen), lone surrogates (Cs), private use (Co), line and paragraph separators
INVISIBLE_CATEGORIES = {
    "Cc": "a control character",
    "Cf": "an invisible format character",
    "Cs": "a lone surrogate",
    "Co": "a private-use character",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
}
#: Unicode's Default_Ignorable_Code_Point characters outside those categories (DerivedCoreProperties.txt):
#: they render as nothing too (combining grapheme joiner, Hangul fillers, Khmer inherent vowels,
#: Mongolian and other variation selectors, tags)
_IGNORABLE = (
    (0x034F, 0x034F),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFFA0, 0xFFA0),
    (0xE0000, 0xE0FFF),
)
_IGNORABLE_POINTS = frozenset(cp for a, b in _IGNORABLE for cp in range(a, b + 1))
#: the first letter of the general categories of a character that shows on its own: letters (L*),
#: numbers (N*), punctuation (P*) and symbols (S*). Spaces (Zs) show only as a gap, combining marks
#: (M*) only on the character before them, unassigned code points (Cn) as nothing this Python knows.
SHOWING_CATEGORIES = frozenset("LNPS")
#: combining marks: nonspacing (Mn), spacing (Mc) and enclosing (Me); each marks the character before it
MARK_CATEGORIES = frozenset({"Mn", "Mc", "Me"})
#: characters of a showing category that render as an empty cell. No Unicode property marks a blank
#: glyph (they are not White_Space and not Default_Ignorable_Code_Point), so they are named here; the
#: blank Hangul fillers (Lo) are default-ignorable and refused with those.
BLANK_SYMBOLS = {
    0x2800: "a braille cell with no dot raised, which renders as an empty cell",
    0x1D159: "a notehead with no glyph, a base for stems and flags that renders as nothing",
}
ID_RULE = (
    "event ids are compared in Unicode NFC; an id holds at least one letter, number, punctuation mark or symbol "
    "that shows and does not start with a combining mark; control, format and default-ignorable characters and "
    "compatibility forms such as fullwidth letters are refused"
)


def _char(ch: str) -> str:
    name = unicodedata.name(ch, "")
    return f"U+{ord(ch):04X} {name}" if name else f"U+{ord(ch):04X}"


def _ignorable(cp: int) -> bool:
    return cp in _IGNORABLE_POINTS


def shows(ch: str) -> bool:
    """Whether the character ``ch`` shows on its own, by the Unicode data of the running Python
    (:data:`unicodedata.unidata_version`): its general category is a letter, number, punctuation
    mark or symbol (:data:`SHOWING_CATEGORIES`), and it is neither default-ignorable (the Hangul
    fillers are letters that render as nothing) nor one of the :data:`BLANK_SYMBOLS` (U+2800
    braille pattern blank). ``shows("a")``, ``shows("é")``, ``shows("😀")`` are true; ``shows(" ")``,
    ``shows("\\u0301")``, ``shows("\\u2800")`` are false."""
    cp = ord(ch)
    return unicodedata.category(ch)[0] in SHOWING_CATEGORIES and cp not in BLANK_SYMBOLS and not _ignorable(cp)


def _what(ch: str) -> str:
    """What ``ch``, a character that passed the invisible-character check but does not show, is."""
    cat = unicodedata.category(ch)
    if ord(ch) in BLANK_SYMBOLS:
        return BLANK_SYMBOLS[ord(ch)]
    if cat in MARK_CATEGORIES:
        return "a combining mark"
    return {"Zs": "a space", "Cn": "an unassigned code point"}.get(cat, f"of category {cat}")


def canonical_event_id(value: str) -> str:
    """The one form of an event id the memory stores and compares: ``value`` in Unicode NFC, so the
    composed and decomposed spellings of ``josé`` are one id.

    An id must look like something: it holds at least one character that :func:`shows` (a letter,
    number, punctuation mark or symbol by its Unicode general category) and does not start with a
    combining mark (Mn, Mc, Me: a mark has nothing before it to combine with). Marks after a base
    character stay allowed (``"e\\u0301"`` is ``"é"``; Devanagari ``"क्ष"``), and so do spaces inside
    an id that shows. Categories are those of the running Python's Unicode data
    (:data:`unicodedata.unidata_version`).

    Raises:
        OptionError: ``value`` holds a character that does not show (:data:`INVISIBLE_CATEGORIES`,
            Unicode's default-ignorable characters: U+200B zero-width space, U+202E right-to-left
            override, variation selectors, U+3164 Hangul filler) or one whose compatibility form
            (NFKC) differs, a look-alike of another id (fullwidth ``ｄａｎａ`` for ``dana``, U+00A0
            no-break space, the ligature ``ﬁ``); or ``value`` looks like nothing: it is empty, starts
            with a combining mark (a lone U+0301 combining acute accent), or holds only spaces, marks,
            unassigned code points and :data:`BLANK_SYMBOLS` (U+2800 braille pattern blank). The
            message names the character and the fix.
    """
    nfc = unicodedata.normalize("NFC", value)
    for ch in nfc:
        cat = unicodedata.category(ch)
        if cat in INVISIBLE_CATEGORIES or _ignorable(ord(ch)):
            what = INVISIBLE_CATEGORIES.get(cat, "a default-ignorable character")
            raise OptionError(
                "event id",
                value,
                f"it holds {_char(ch)} ({what}, which does not show): give the id without it ({ID_RULE}).",
                flag="event id",
            )
    if unicodedata.normalize("NFKC", nfc) != nfc:
        ch = next((c for c in nfc if unicodedata.normalize("NFKC", c) != c), nfc[0])
        raise OptionError(
            "event id",
            value,
            f"it holds {_char(ch)}, a look-alike of {unicodedata.normalize('NFKC', ch)!r}: write "
            f"{unicodedata.normalize('NFKC', nfc)!r} instead ({ID_RULE}).",
            flag="event id",
        )
    if not nfc:
        raise OptionError(
            "event id",
            value,
            f"it is empty: give a letter, number, punctuation mark or symbol ({ID_RULE}).",
            flag="event id",
        )
    if unicodedata.category(nfc[0]) in MARK_CATEGORIES:
        raise OptionError(
            "event id",
            value,
            f"it starts with {_char(nfc[0])} (a combining mark, which has no character before it to combine with): "
            f"put it after the letter it marks, or leave it out ({ID_RULE}).",
            flag="event id",
        )
    if not any(shows(ch) for ch in nfc):
        which = _char(nfc[0]) if len(nfc) == 1 else f"the first, {_char(nfc[0])},"
        raise OptionError(
            "event id",
            value,
            f"it holds no character that shows ({which} is {_what(nfc[0])}): give an id with at "
            f"least one letter, number, punctuation mark or symbol ({ID_RULE}).",
            flag="event id",
        )
    return nfc


@dataclass(frozen=True)
class MemoryEvent:
    """One event to add to a memory.

    Attributes:
        text: the event's text, exactly as it enters the prompt (non-blank).
        role: optional speaker label; the event is rendered ``"{role}: {text}"`` (as :class:`eventkv.kv.log.Event`).
        id: optional unique name (no commas, no surrounding spaces); ``None`` = the memory names it
            ``e{seq}``. Kept in its :func:`canonical_event_id` form (NFC; look-alike and invisible
            characters, and ids that look like nothing, refused when the event is made).
        tags: free labels kept with the event (JSON in the store; not part of the prompt).
        budget: optional position budget in tokens (>= the event's token count): the event reserves
            that many positions whatever its length (Study 1, "Donor pair").
        kind: ``"event"`` (default) or ``"carrier"`` (an answer-free carrier event).
        when: optional moment the event happened (a ``date``, a ``datetime`` or a date string dateparser reads;
            kept as its ISO form): the memory stores the text as :meth:`stored_text` writes it, the day in
            front and each relative date expression resolved against it (``docs/memory.md``, "Dates").
    """

    text: str
    role: str | None = None
    id: str | None = None
    tags: tuple[str, ...] = ()
    budget: int | None = None
    kind: str = "event"
    when: str | _dt.date | None = None

    def __post_init__(self) -> None:
        # every add (library, HTTP route, client) builds a MemoryEvent: the one place a new id takes its form
        if isinstance(self.id, str):
            object.__setattr__(self, "id", canonical_event_id(self.id))
        if self.when is not None:  # read once here, so a bad date is refused before anything is written
            from eventkv.memory.dates import reference_date

            object.__setattr__(self, "when", reference_date(self.when).isoformat())

    def stored_text(self) -> str:
        """The text the memory stores and prefills: :attr:`text`, or with :attr:`when`
        :func:`eventkv.memory.dates.dated_text` of it (``"[8 May 2023] I went yesterday [7 May 2023]."``)."""
        if self.when is None:
            return self.text
        from eventkv.memory.dates import dated_text

        return dated_text(self.text, str(self.when))

    @classmethod
    def coerce(cls, obj) -> "MemoryEvent":
        """A MemoryEvent from a MemoryEvent, a plain string (its text) or a dict with the field names.

        Raises:
            EventKVError: another type, a dict with an unknown key, tags that are not strings, or a
                kind other than ``event`` / ``carrier``.
        """
        if isinstance(obj, MemoryEvent):
            ev = obj
        elif isinstance(obj, str):
            ev = cls(text=obj)
        elif isinstance(obj, dict):
            unknown = sorted(set(obj) - {"text", "role", "id", "tags", "budget", "kind", "when"})
            if unknown:
                raise EventKVError(
                    f"event {obj!r:.80} has the unknown key(s) {', '.join(map(repr, unknown))}: "
                    "the keys of an event are text, role, id, tags, budget, kind, when."
                )
            if "text" not in obj:
                raise EventKVError(f"event {obj!r:.80} has no 'text': give the event's text.")
            tags = obj.get("tags") or ()
            if isinstance(tags, str):
                raise EventKVError(f"event tags {tags!r:.80}: give a list of non-empty strings, not one string.")
            ev = cls(**{**obj, "tags": tuple(tags)})
        else:
            raise EventKVError(
                f"{type(obj).__name__} {obj!r:.60} is not an event: "
                "give a MemoryEvent, a dict with 'text', or a string."
            )
        if isinstance(ev.tags, str) or not all(isinstance(t, str) and t for t in ev.tags):
            raise EventKVError(f"event tags {ev.tags!r:.80}: give a list of non-empty strings.")
        if ev.kind not in ADD_KINDS:
            raise EventKVError(
                f"event kind {ev.kind!r}: add events of kind {' or '.join(ADD_KINDS)} "
                "(patches are appended by update(event_id, text))."
            )
        return ev


@dataclass(frozen=True)
class Added:
    """An acknowledged add: the event's id, its first RoPE position id and the positions it reserves
    (``width`` = its budget, or its token count)."""

    id: str
    position: int
    width: int


@dataclass(frozen=True)
class MemoryRecord:
    """One row of the memory's event table, as stored.

    Attributes:
        seq: history order (1, 2, ...; never reused).
        id, kind: the event's name and kind (``event`` | ``patch`` | ``carrier``).
        text: its text (None once forgotten); role, tags, budget: as added.
        position: first RoPE position id (None once forgotten); width: positions reserved.
        row_start: first row of the stored history (header rows first); n_rows: rows = its tokens.
        prefilled: whether its rows are computed and stored (in segment ``segment``).
        supersedes: for a patch, the id of the event it updates.
        deleted, forgotten, pinned: its flags. created: UTC time of the add (ISO 8601).
    """

    seq: int
    id: str
    kind: str
    text: str | None
    role: str | None
    tags: tuple[str, ...]
    budget: int | None
    position: int | None
    width: int
    row_start: int | None
    n_rows: int
    segment: int | None
    supersedes: str | None
    deleted: bool
    forgotten: bool
    pinned: bool
    created: str

    @property
    def prefilled(self) -> bool:
        return self.segment is not None

    @property
    def live(self) -> bool:
        """Neither deleted nor forgotten."""
        return not (self.deleted or self.forgotten)


@dataclass(frozen=True)
class MemoryStats:
    """Sizes of a memory.

    Attributes:
        events: stored event rows that hold text (every kind, deleted included, forgotten excluded).
        live: events in the default served set (``view_ids()``).
        patches, deleted, forgotten, pinned, carriers: counts by flag / kind.
        rows: rows of the whole stored history, header included (what ``select="all"`` serves).
        rows_prefilled: rows computed and stored in segment files.
        prefilled_up_to: first RoPE position after the last prefilled event (the header's length
            when none is).
        history_end: first position after the whole history (where a query starts).
        segments: segment files. bytes_on_disk: every file of the store directory, in bytes.
        version: the store's write counter.
    """

    events: int
    live: int
    patches: int
    deleted: int
    forgotten: int
    pinned: int
    carriers: int
    rows: int
    rows_prefilled: int
    prefilled_up_to: int
    history_end: int
    segments: int
    bytes_on_disk: int
    version: int


@dataclass(frozen=True)
class Hit:
    """One event of a search (``EventMemory.search``): a served event with its text and its score under
    the selector that ranked the view.

    Attributes:
        id: the event's id (a patched event is served as its latest patch: the patch's id).
        text: its text, exactly as it enters the prompt (without the role prefix).
        score: its score under the selector (higher is better; the selector's own units, e.g. BM25's).
        rank: its place in the selector's ranking of the whole view, 1 = best.
        role, tags: as added. pinned: the event (or the event it patches) is pinned, so always served.
    """

    id: str
    text: str
    score: float
    rank: int
    role: str | None
    tags: tuple[str, ...]
    pinned: bool


@dataclass
class MemoryAnswer:
    """What ``EventMemory.query`` returned.

    Attributes:
        text: the greedy answer (decoded, stop token excluded).
        generation: the full :class:`eventkv.kv.readout.Generation` (tokens, stopped, logits if kept).
        candidates: candidate scores (log-probabilities in nats), when candidates were given.
        served_ids: the served events in the order they were served: history order, or under
            ``order="relevance"`` the order of their rows (the most relevant last); the header is always
            served besides, first.
        positions: ``(id, first position, width)`` of every served event, in ``served_ids``' order.
        n_rows_served: rows the query attended to (header included; in native mode the visible rows).
        n_query_tokens: tokens read after the served rows: the question and the chat tail (or the
            conversation, for a query with ``messages``).
        timings_ms: wall time in milliseconds of ``prefill`` (lazy prefill of pending events; 0 when
            none), ``serve`` (building the served cache) and ``decode`` (generation and scoring).
        plan: the plan the answer was served by (``select``, ``mode``, ``positions`` as resolved, ``order``;
            for a selector's choice ``selector``, ``k``, ``budget``, ``budget_rows``, ``neighbours``,
            ``with_headers``; for ``blend`` ``recompute`` and ``blend_schedule``; ``rows``, the memory's row
            format): :func:`eventkv.memory.answer.query_plan`.
    """

    text: str
    generation: Generation
    candidates: list[CandidateScore] = field(default_factory=list)
    served_ids: list[str] = field(default_factory=list)
    positions: list[tuple[str, int, int]] = field(default_factory=list)
    n_rows_served: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)
    n_query_tokens: int = 0
    plan: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CarrierResult:
    """What ``EventMemory.carrier`` did (Study 1, "Programmed carriers").

    Attributes:
        kind: the carrier kind written, or None when none was (the sources were pinned instead).
        added: the carrier event (id, position, width), or None.
        pinned: the source ids pinned as the text fallback (empty when a carrier was written).
        reason: why: the contract's figures behind the kind, or why no kind qualified.
    """

    kind: str | None
    added: Added | None
    pinned: tuple[str, ...]
    reason: str
