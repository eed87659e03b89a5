"""Relative dates resolved when an event is written: ``"I went there yesterday"`` said on 8 May 2023 becomes
``"I went there yesterday [7 May 2023]"``, so a served turn answers *when* without the model doing calendar
arithmetic over a session date it may not be served with.

Why: a memory serves a turn's rows long after the turn was said; a relative expression in it (``yesterday``,
``last week``, ``three years ago``) means something only against the date it was said on. LoCoMo's temporal
questions (Maharana et al. 2024, arXiv 2402.17753, section 4: category 2) are mostly such expressions resolved
against the session date (a question asks when something happened; its evidence turn says "yesterday" in a
session dated 8 May 2023; the gold answer is "7 May 2023"). A reader of 1-2B parameters rarely does that
arithmetic from a header; the date written next to the expression is in the turn's own rows wherever it is served.

Finding and resolving the expressions is the ``dateparser`` library's job (``dateparser.search.search_dates``
finds candidate spans, ``DateDataParser.get_date_data`` gives a span's date and granularity against a base date).
eventkv adds only what dialogue needs on top:

* an expression is resolved only when it is **relative**: its shortest sub-span that still parses to the same
  date contains one of :data:`RELATIVE_MARKERS` (``yesterday``, ``ago``, ``last``, ``next``, ...). Dialogue is full
  of words dateparser also reads as dates (``"we"`` as Wednesday, ``"now"``, ``"the sun"``, a bare ``"4 years"``);
  none of them carries a marker, so none is annotated. A bare weekday (``"on Friday"``) is ambiguous (this week's
  or last?) and is left alone.
* the resolved date is written at the expression's granularity (:func:`render_date`): a day as ``7 May 2023``, a
  week as ``the week of 2 June 2023``, a month as ``June 2023``, a year as ``2020``.
"""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass
from functools import lru_cache

from eventkv.errors import OptionError

#: words that make a date expression relative to when it was said (lower case, whole words)
RELATIVE_MARKERS = frozenset(
    {"yesterday", "tomorrow", "tonight", "ago", "last", "next", "this", "past", "previous", "coming"}
)

_WORD = re.compile(r"\S+")
#: where dateparser's spans are cut before an expression is read: it joins expressions across these
#: ("three years ago, and tomorrow" is one span to it, read as one date)
_JOINS = re.compile(r"[,;:!?.()]|\b(?:and|or|but|then|so|while|until|since)\b", re.IGNORECASE)


@dataclass(frozen=True)
class RelativeDate:
    """One relative date expression in a text.

    Attributes:
        start, end: the expression's character span in the text (``text[start:end]``).
        expression: ``text[start:end]``.
        date: the date it means against the reference date.
        period: its granularity as dateparser gives it: ``"day"``, ``"week"``, ``"month"`` or ``"year"``.
    """

    start: int
    end: int
    expression: str
    date: _dt.date
    period: str

    @property
    def rendered(self) -> str:
        """The date as it is written after the expression (:func:`render_date`)."""
        return render_date(self.date, self.period)


def render_date(date: _dt.date, period: str) -> str:
    """``date`` written at granularity ``period``: ``day`` -> ``"7 May 2023"``, ``week`` -> ``"the week of 2 June
    2023"``, ``month`` -> ``"June 2023"``, ``year`` -> ``"2020"`` (the form LoCoMo's gold answers use).

    Raises:
        OptionError: another period.
    """
    day = f"{date.day} {date:%B %Y}"
    if period == "day":
        return day
    if period == "week":
        return f"the week of {day}"
    if period == "month":
        return f"{date:%B %Y}"
    if period == "year":
        return f"{date.year}"
    raise OptionError("period", period, "give day, week, month or year.")


def reference_date(when: str | _dt.date | _dt.datetime) -> _dt.datetime:
    """The moment a text was written, from a date, a datetime or a date string in any form dateparser reads
    (``"1:56 pm on 8 May, 2023"``, ``"2023-05-08"``; a numeric date such as ``"08/05/2023"`` is read month first,
    dateparser's default: give a datetime or an ISO date where the order matters).

    Raises:
        OptionError: ``when`` is not a date, a datetime or a string dateparser reads as a date, or it is a relative
            date or one without its day (``"yesterday"``, ``"May 2023"``: no one day); the message names it.
    """
    if isinstance(when, _dt.datetime):
        return when
    if isinstance(when, _dt.date):
        return _dt.datetime(when.year, when.month, when.day)
    import dateparser

    parsed = dateparser.parse(when, languages=["en"]) if isinstance(when, str) and when.strip() else None
    if parsed is None:
        raise OptionError("when", when, "give a date such as '8 May 2023', '2023-05-08' or a datetime.")
    # a relative date ("yesterday") or one without its day ("May 2023") reads differently against another day
    other = dateparser.parse(when, languages=["en"], settings={"RELATIVE_BASE": parsed - _dt.timedelta(days=400)})
    if other is None or other.date() != parsed.date():
        raise OptionError(
            "when",
            when,
            "give the day itself ('8 May 2023', '2023-05-08' or a datetime): a relative date ('yesterday') or one "
            "without its day ('May 2023') is read against today's clock, so the same call would store another day "
            "tomorrow.",
        )
    return parsed


@lru_cache(maxsize=64)
def _parser(reference: _dt.datetime):
    from dateparser.date import DateDataParser

    # past first: an ambiguous expression in a memory's turn refers back more often than forward
    return DateDataParser(languages=["en"], settings={"RELATIVE_BASE": reference, "PREFER_DATES_FROM": "past"})


def _parse(span: str, reference: _dt.datetime) -> tuple[_dt.date, str] | None:
    data = _parser(reference).get_date_data(span)
    if data.date_obj is None or data.period not in ("day", "week", "month", "year"):
        return None
    return data.date_obj.date(), data.period


def _shortest(text: str, start: int, end: int, reference: _dt.datetime) -> RelativeDate | None:
    """The shortest run of whole words inside ``text[start:end]`` that parses to the span's own date and
    granularity and holds a relative marker; None when no such run exists."""
    whole = _parse(text[start:end], reference)
    if whole is None:
        return None
    words = [(m.start() + start, m.end() + start) for m in _WORD.finditer(text[start:end])]
    for length in range(1, len(words) + 1):
        for i in range(len(words) - length + 1):
            s, e = words[i][0], words[i + length - 1][1]
            # punctuation at the ends is not part of the expression ("yesterday," -> "yesterday")
            while e > s and not text[e - 1].isalnum():
                e -= 1
            while s < e and not text[s].isalnum():
                s += 1
            span = text[s:e]
            lowered = {w.lower() for w in re.findall(r"[A-Za-z]+", span)}
            if not lowered & RELATIVE_MARKERS or _parse(span, reference) != whole:
                continue
            return RelativeDate(s, e, span, whole[0], whole[1])
    return None


def relative_dates(text: str, when: str | _dt.date | _dt.datetime) -> list[RelativeDate]:
    """The relative date expressions in ``text`` said at ``when``, in text order (the module docstring says
    which expressions count).

    Raises:
        OptionError: ``when`` is not a date (:func:`reference_date`).
    """
    from dateparser.search import search_dates

    reference = reference_date(when)
    settings = {"RELATIVE_BASE": reference, "PREFER_DATES_FROM": "past"}
    out: list[RelativeDate] = []
    # dateparser joins expressions into one span ("three years ago, and tomorrow") and reads the whole as one date,
    # and it misses one right before a comma ("Last week, we met"): each piece between joining words and
    # punctuation is searched and read on its own
    cuts = [0] + [x for m in _JOINS.finditer(text) for x in (m.start(), m.end())]
    for s, e in zip(cuts[0::2], [*cuts[1::2], len(text)]):
        if not text[s:e].strip():
            continue
        cursor = s
        for span, _ in search_dates(text[s:e], languages=["en"], settings=settings) or []:
            start = text.find(span, cursor, e)
            if start < 0:  # dateparser normalised the span's text: nothing to anchor it to
                continue
            cursor = start + len(span)
            if (hit := _shortest(text, start, cursor, reference)) is not None:
                out.append(hit)
    return out


def resolve_relative_dates(text: str, when: str | _dt.date | _dt.datetime) -> str:
    """``text`` with the date each relative expression means written after it in brackets:
    ``"I went yesterday."`` at 8 May 2023 -> ``"I went yesterday [7 May 2023]."``. A text without relative
    expressions comes back unchanged.

    Raises:
        OptionError: ``when`` is not a date (:func:`reference_date`).
    """
    pieces, last = [], 0
    for hit in relative_dates(text, when):
        pieces += [text[last : hit.end], f" [{hit.rendered}]"]
        last = hit.end
    return "".join(pieces) + text[last:]


def dated_text(text: str, when: str | _dt.date | _dt.datetime, resolve: bool = True) -> str:
    """``text`` as a memory stores an event said at ``when``: the day it was said in brackets first, and with
    ``resolve`` each relative date expression followed by the date it means (:func:`resolve_relative_dates`):
    ``"I went yesterday."`` at 8 May 2023 -> ``"[8 May 2023] I went yesterday [7 May 2023]."``. The day in front
    serves a question about the turn itself; the resolved dates serve one about what the turn says happened.

    Raises:
        OptionError: ``when`` is not a date (:func:`reference_date`).
    """
    reference = reference_date(when)
    body = resolve_relative_dates(text, reference) if resolve else text
    return f"[{render_date(reference.date(), 'day')}] {body}"
