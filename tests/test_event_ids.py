"""The event-id rule (:func:`eventkv.memory.records.canonical_event_id`) over the whole Unicode range
of the running Python, one general category at a time: an id holds at least one character that
shows (a letter, number, punctuation mark or symbol that is neither default-ignorable nor a blank
symbol) and does not start with a combining mark; control, format, private-use, surrogate and
separator characters are refused anywhere. Ids people write (CJK, Arabic, emoji, decomposed
accents, Devanagari conjuncts, digits only) stay accepted. Model-free: the rule is called directly;
tests/test_memory_integrity.py covers it through the library, over HTTP and in the client."""

from __future__ import annotations

import re
import unicodedata
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eventkv.errors import OptionError
from eventkv.memory.records import BLANK_SYMBOLS, MARK_CATEGORIES, canonical_event_id, shows

#: every general category of the Unicode standard
CATEGORIES = {
    *("Lu", "Ll", "Lt", "Lm", "Lo"),
    *("Mn", "Mc", "Me"),
    *("Nd", "Nl", "No"),
    *("Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po"),
    *("Sm", "Sc", "Sk", "So"),
    *("Zs", "Zl", "Zp"),
    *("Cc", "Cf", "Cs", "Co", "Cn"),
}
SHOWING = sorted(c for c in CATEGORIES if c[0] in "LNPS")
INVISIBLE = ("Cc", "Cf", "Cs", "Co", "Zl", "Zp")


@pytest.fixture(scope="module")
def by_category() -> dict[str, list[str]]:
    """Every code point 0..0x10FFFF, as a one-character string, grouped by its general category."""
    groups: dict[str, list[str]] = defaultdict(list)
    for cp in range(0x110000):
        ch = chr(cp)
        groups[unicodedata.category(ch)].append(ch)
    return groups


def refusal(value: str) -> str | None:
    """The message ``canonical_event_id(value)`` refuses ``value`` with; None when it is accepted."""
    try:
        canonical_event_id(value)
    except OptionError as e:
        return str(e)
    return None


def u(ch: str) -> str:
    return f"U+{ord(ch):04X}"


def test_the_range_holds_every_category(by_category):
    assert set(by_category) == CATEGORIES
    assert sum(map(len, by_category.values())) == 0x110000


@pytest.mark.parametrize("category", SHOWING)
def test_letters_numbers_punctuation_and_symbols_show_alone_and_first(by_category, category):
    """A character of a showing category is an id alone and may start one, whenever it may follow a
    letter (the invisible and look-alike rules, which hold wherever it stands); the exceptions are
    exactly the blank symbols."""
    blank, accepted = [], 0
    for ch in by_category[category]:
        after = refusal("a" + ch)  # a letter first: only the invisible and look-alike rules can refuse
        alone, first = refusal(ch), refusal(ch + "a")
        assert (first is None) == (after is None), (u(ch), after, first)
        if after is None and alone is not None:
            blank.append(ord(ch))
            assert f"it holds no character that shows ({u(ch)} {unicodedata.name(ch)} is " in alone, alone
        else:
            assert (alone is None) == (after is None), (u(ch), after, alone)
        accepted += alone is None
    assert blank == sorted(cp for cp in BLANK_SYMBOLS if unicodedata.category(chr(cp)) == category)
    assert accepted > 0


@pytest.mark.parametrize("category", sorted(MARK_CATEGORIES))
def test_a_combining_mark_may_follow_a_character_but_never_start_an_id(by_category, category):
    after_ok = 0
    for ch in by_category[category]:
        alone, first, after = refusal(ch), refusal(ch + "a"), refusal("a" + ch)
        assert alone is not None and first is not None, u(ch)
        if after is None:
            after_ok += 1
            lead = unicodedata.normalize("NFC", ch)[0]  # U+0340 is named as its NFC form U+0300
            for msg in (alone, first):
                assert f"it starts with {u(lead)} {unicodedata.name(lead)} (a combining mark" in msg, msg
        else:  # a default-ignorable mark (U+034F, the variation selectors): refused wherever it stands
            assert f"it holds {u(ch)}" in after, after
    assert after_ok > 0


def test_spaces_show_only_between_characters_that_show(by_category):
    allowed = []
    for ch in by_category["Zs"]:
        alone = refusal(ch)
        assert alone is not None, u(ch)
        if refusal("a" + ch) is None:  # the rest are NFKC look-alikes of U+0020 (no-break, em, ideographic ...)
            allowed.append(ch)
            assert refusal(ch + "a") is None and refusal(f"a{ch}b") is None
            assert refusal(ch * 3) is not None and "is a space)" in alone, alone
    assert allowed == [" ", "\u1680"]


@pytest.mark.parametrize("category", INVISIBLE)
def test_characters_that_do_not_show_are_refused_anywhere(by_category, category):
    for ch in by_category[category]:
        msg = refusal(ch)
        assert msg is not None and f"it holds {u(ch)}" in msg and "which does not show" in msg, (u(ch), msg)


def test_unassigned_code_points_are_no_id_alone(by_category):
    for ch in by_category["Cn"]:
        msg = refusal(ch)
        assert msg is not None, u(ch)
        assert "an unassigned code point" in msg or "a default-ignorable character" in msg, msg
    assert refusal("a\u0378") is None  # after a character that shows, as before


#: the ids that look like nothing -> what the refusal says
NOTHING = {
    "\u0301": "it starts with U+0301 COMBINING ACUTE ACCENT (a combining mark, which has no character before it",
    "\u2800": "it holds no character that shows (U+2800 BRAILLE PATTERN BLANK is a braille cell with no dot raised",
    "\U0001d159": "it holds no character that shows (U+1D159 MUSICAL SYMBOL NULL NOTEHEAD is a notehead with no glyph",
    "\u0301a": "it starts with U+0301 COMBINING ACUTE ACCENT",
    "\u093f\u0915": "it starts with U+093F DEVANAGARI VOWEL SIGN I (a combining mark",
    "\u20e3": "it starts with U+20E3 COMBINING ENCLOSING KEYCAP (a combining mark",
    "   ": "it holds no character that shows (the first, U+0020 SPACE, is a space)",
    " \u0301": "it holds no character that shows (the first, U+0020 SPACE, is a space)",
    "\u2800\u2800 ": "it holds no character that shows (the first, U+2800 BRAILLE PATTERN BLANK, is a braille cell",
    "": "it is empty: give a letter, number, punctuation mark or symbol",
}


@pytest.mark.parametrize("eid", list(NOTHING), ids=[ascii(k) for k in NOTHING])
def test_ids_that_look_like_nothing_name_the_character_and_the_fix(eid):
    with pytest.raises(OptionError) as e:
        canonical_event_id(eid)
    assert str(e.value).startswith(f"event id {eid!r}: {NOTHING[eid]}"), str(e.value)
    assert "letter, number, punctuation mark or symbol" in str(e.value)
    assert e.value.field == "event id" and e.value.value == eid


#: ids people write, and their stored (NFC) form: accepted before the rule, and still
ACCEPTED = {
    "dana": "dana",
    "42": "42",
    "東京の会議": "東京の会議",
    "مرحبا": "مرحبا",
    "😀": "😀",
    "👍🏽": "👍🏽",  # an emoji and its skin-tone modifier (Sk)
    "🇵🇹": "🇵🇹",
    "jose\u0301": "jos\u00e9",  # decomposed: the mark follows its letter
    "e\u0301": "\u00e9",
    "क्ष": "क्ष",  # Devanagari conjunct: a virama (Mn) between two consonants
    "नमस्ते": "नमस्ते",
    "1\u20e3": "1\u20e3",  # a digit in an enclosing keycap (Me)
    "한국어": "한국어",
    "\u1100\u1161": "\uac00",  # Hangul jamo that compose
    "Привет": "Привет",
    "ไทย": "ไทย",
    "a b": "a b",
    "a\u2800b": "a\u2800b",  # a blank cell between characters that show
    "-": "-",
    "#": "#",
    "Ω": "Ω",
}


@pytest.mark.parametrize("eid", list(ACCEPTED), ids=[ascii(k) for k in ACCEPTED])
def test_ids_people_write_stay_accepted(eid):
    assert canonical_event_id(eid) == ACCEPTED[eid]


#: a few characters of each kind the rule tells apart, so a short text often holds them
PICKS = st.sampled_from(["a", "1", "-", "😀", "\u0301", "\u093f", "\u20e3", "\u2800", "\U0001d159", " ", "\u0378"])


@settings(max_examples=400, deadline=None)
@given(st.text(st.one_of(st.characters(), PICKS), max_size=6))
def test_an_accepted_id_holds_a_character_that_shows_and_starts_with_no_mark(value):
    msg = refusal(value)
    if msg is None:
        eid = canonical_event_id(value)
        assert eid == unicodedata.normalize("NFC", value)
        assert any(shows(ch) for ch in eid), ascii(eid)
        assert unicodedata.category(eid[0]) not in MARK_CATEGORIES, ascii(eid)
    else:
        assert re.match(rf"^event id {re.escape(repr(value))}: it (holds|starts with|is empty)", msg), msg
