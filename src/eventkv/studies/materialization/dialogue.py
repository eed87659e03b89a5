"""Real multi-session dialogue for the memory's evaluation: LoCoMo and REALTALK
conversations read from a user-supplied path into one data model, each turn an event whose text carries
its session, date and speaker.

Sources and the facts the loaders rely on:

- **LoCoMo** (Maharana et al. 2024, "Evaluating Very Long-Term Conversational Memory of LLM Agents",
  ACL 2024, arXiv 2402.17753; github snap-research/locomo, ``data/locomo10.json``). A JSON list of
  samples ``{"sample_id", "conversation", "qa", ...}`` (other keys such as ``event_summary``,
  ``observation``, ``session_summary`` are ignored). ``conversation`` holds ``speaker_a``,
  ``speaker_b``, ``session_N`` (a list of turns ``{"speaker", "dia_id", "text"}`` with optional
  ``img_url``, ``blip_caption``; other turn keys such as ``query``, ``re-download`` are ignored) and
  ``session_N_date_time`` (e.g. ``"1:56 pm on 8 May, 2023"``). Some files carry a
  ``session_N_date_time`` with no ``session_N`` list: such a session has no turns and is skipped.
  Each ``qa`` item has ``question``, ``answer`` (a string or a number), ``evidence`` (dia ids) and
  ``category``: 1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop, 5 adversarial; category 5 items
  may carry ``adversarial_answer`` and no ``answer``.
- **REALTALK** (Lee et al. 2025, "REALTALK: A 21-Day Real-World Dataset for Long-Term Conversation",
  arXiv 2502.13270; github danny911kr/REALTALK, ``data/Chat_<n>_<A>_<B>.json``). One JSON object per
  conversation: ``name`` = ``{"speaker_1", "speaker_2"}``, ``session_N`` lists of turns
  ``{"clean_text", "speaker", "date_time" ("29.12.2023, 22:42:04": the message's own time), "dia_id",
  "img_file" (list), "img_url" (list)}`` with ``blip_caption`` on turns that share a photo,
  ``session_N_date_time``, ``events_session_N`` (per-speaker event summaries, ignored) and ``qa`` items
  ``{"question", "answer", "evidence", "category"}`` (categories 1-3 in the released files; the
  repository does not define them). A REALTALK dia id's ``D`` number is not always its session number.

Evidence in both datasets is hand-written and sometimes irregular (``"D8:6; D9:17"``, ``"D:11:26"``,
ranges ``"D13:43-D13:46"``, a trailing ``"."``, an empty string or a bare ``"D"``). :func:`parse_evidence`
reads every id of the form ``D<a>:<b>`` in an evidence string (a stray ``:`` after the ``D`` accepted),
expands a range within one ``D`` number, and drops strings without an id. Ids that name no turn of the
conversation are kept as given: such a question never has all its evidence inside a conversation, so
:func:`truncate` drops it.

The loaders are listed by format name (``locomo``, ``realtalk``: ``--format``) in
:data:`eventkv.options.DIALOGUE_FORMATS`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.log import Event, check_record
from eventkv.models.encoding import encode

#: the text appended to a turn's text when it shares an image (``{caption}``: the dataset's BLIP caption)
IMAGE_NOTE = " [shares an image: {caption}]"
LOCOMO_CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}


@dataclass(frozen=True)
class Turn:
    """One turn of a dialogue: one event of the memory.

    Attributes:
        id: the dataset's dialogue id (``dia_id``, e.g. ``"D3:12"``), unique within its conversation.
        session: the session number ``N`` of the ``session_N`` list the turn is in (1-based).
        date_time: the session's date and time as the dataset writes it (REALTALK: the message's own
            time), ``""`` when the file gives none.
        speaker: the speaker's name as the dataset writes it.
        text: the turn's text; when the turn shares an image, :data:`IMAGE_NOTE` with its caption is
            appended.
    """

    id: str
    session: int
    date_time: str
    speaker: str
    text: str

    def event_text(self, dated: bool = True) -> str:
        """The event text of this turn: ``"[session 3, 1:56 pm on 8 May, 2023] Caroline: text"``
        (``"[session 3] ..."`` when there is no date, or with ``dated=False``: for a history whose
        session header events carry the dates, :func:`session_header_text`)."""
        when = f", {self.date_time}" if self.date_time and dated else ""
        return f"[session {self.session}{when}] {self.speaker}: {self.text}"


def session_header_text(session: int, date_time: str) -> str:
    """The text of a session's header event: ``"[session 3 begins: 1:56 pm on 8 May, 2023]"``
    (``"[session 3 begins]"`` without a date); the turns after it are rendered
    ``Turn.event_text(dated=False)``."""
    return f"[session {session} begins{': ' + date_time if date_time else ''}]"


@dataclass(frozen=True)
class QA:
    """One question about a conversation.

    Attributes:
        question: the question text.
        answer: the gold answer as a string (a number in the file becomes its ``str``); ``""`` for a
            LoCoMo category-5 (adversarial) question that has no ``answer`` (the right response is that
            the conversation does not say).
        evidence: the dia ids of the turns that hold the answer (:func:`parse_evidence`), may be empty.
        category: the dataset's category number (LoCoMo: :data:`LOCOMO_CATEGORIES`).
        adversarial_answer: LoCoMo category 5: the wrong answer the question invites, when given.
    """

    question: str
    answer: str
    evidence: tuple[str, ...]
    category: int
    adversarial_answer: str | None = None


@dataclass(frozen=True)
class Conversation:
    """A multi-session dialogue between two speakers, with its questions.

    Attributes:
        id: LoCoMo's ``sample_id`` (``"conv-26"``); REALTALK: the file's stem (``"Chat_1_Emi_Elise"``).
        speakers: the two speakers' names as the file gives them.
        turns: every turn, sessions in number order, turns in file order.
        questions: the questions in file order.
    """

    id: str
    speakers: tuple[str, ...]
    turns: list[Turn] = field(default_factory=list)
    questions: list[QA] = field(default_factory=list)


# ---------------------------------------------------------------- record schemas (pydantic, strict)
def _of_types(*types: type) -> Callable[[object], object]:
    """The check of a field that takes a value of one of ``types`` as it is (bool is not a number), reported
    under its own name when it does not (a pydantic union would report one error per member)."""

    def check(v: object) -> object:
        if v is not None and (isinstance(v, bool) or not isinstance(v, types)):
            raise ValueError("wrong type")
        if isinstance(v, list) and not all(isinstance(x, str) for x in v):
            raise ValueError("wrong type")
        return v

    return check


_Answer = Annotated[object, AfterValidator(_of_types(str, int, float))]
_Images = Annotated[object, AfterValidator(_of_types(list, str))]


class _Schema(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class LocomoTurn(_Schema):
    speaker: str = Field(min_length=1)
    dia_id: str = Field(min_length=1)
    text: str
    img_url: _Images = None
    blip_caption: str | None = None


class LocomoQA(_Schema):
    question: str = Field(min_length=1)
    answer: _Answer = None
    adversarial_answer: _Answer = None
    evidence: list[str]
    category: int = Field(ge=1, le=5)


class LocomoSample(_Schema):
    sample_id: str = Field(min_length=1)
    conversation: dict
    qa: list


class LocomoSpeakers(_Schema):
    speaker_a: str = Field(min_length=1)
    speaker_b: str = Field(min_length=1)


class RealtalkTurn(_Schema):
    clean_text: str
    speaker: str = Field(min_length=1)
    dia_id: str = Field(min_length=1)
    date_time: str | None = None
    img_url: _Images = None
    img_file: _Images = None
    blip_caption: str | None = None


class RealtalkQA(_Schema):
    question: str = Field(min_length=1)
    answer: _Answer
    evidence: list[str]
    category: int = Field(ge=1)


class RealtalkChat(_Schema):
    name: dict
    qa: list


class RealtalkNames(_Schema):
    speaker_1: str = Field(min_length=1)
    speaker_2: str = Field(min_length=1)


_TURN_RULES = {
    "speaker": "give the speaker's name as a non-empty string",
    "dia_id": 'give the turn\'s dialogue id as a non-empty string (e.g. "D1:3")',
    "text": "give the turn's text as a string",
    "clean_text": "give the turn's text as a string",
    "date_time": "give the message's date and time as a string, or leave the key out",
    "img_url": "give a list of image URLs (or one URL string), or leave the key out",
    "img_file": "give a list of image file names (or one string), or leave the key out",
    "blip_caption": "give the image caption as a string, or leave the key out",
}
_QA_RULES = {
    "question": "give the question as a non-empty string",
    "answer": "give the answer as a string or a number (LoCoMo category 5 may leave it out)",
    "adversarial_answer": "give the adversarial answer as a string, or leave the key out",
    "evidence": 'give a list of dialogue ids as strings (e.g. ["D1:3"]), possibly empty',
    "category": "give the category as a whole number (LoCoMo: 1-5)",
}
_SAMPLE_RULES = {
    "sample_id": 'give the sample\'s id as a non-empty string (e.g. "conv-26")',
    "conversation": "give an object with speaker_a, speaker_b, session_N and session_N_date_time",
    "qa": "give a list of question objects",
}
_SPEAKER_RULES = {
    "speaker_a": "give the first speaker's name as a non-empty string",
    "speaker_b": "give the second speaker's name as a non-empty string",
    "speaker_1": "give the first speaker's name as a non-empty string",
    "speaker_2": "give the second speaker's name as a non-empty string",
}
_CHAT_RULES = {
    "name": 'give an object {"speaker_1": ..., "speaker_2": ...}',
    "qa": "give a list of question objects",
}

_SESSION = re.compile(r"session_(\d+)$")
_SESSION_DATE = re.compile(r"session_(\d+)_date_time$")
_EVIDENCE_ID = re.compile(r"D:?(\d+):(\d+)(?:\s*-\s*D:?(\d+):(\d+))?")


def parse_evidence(items: list[str]) -> tuple[str, ...]:
    """Dialogue ids named by a list of evidence strings, in order, each once: every ``D<a>:<b>`` in each
    string (``"D:11:26"`` read as ``D11:26``), a range ``D<a>:<i>-D<a>:<j>`` expanded to ``i..j``;
    strings without an id (``""``, ``"D"``) contribute nothing. See the module docstring."""
    out: list[str] = []
    for item in items:
        for a, i, a2, j in _EVIDENCE_ID.findall(item):
            ids = [f"D{a}:{i}"]
            if a2:
                if a2 == a and int(i) <= int(j):
                    ids = [f"D{a}:{n}" for n in range(int(i), int(j) + 1)]
                else:
                    ids.append(f"D{a2}:{j}")
            out += [x for x in ids if x not in out]
    return tuple(out)


def _read_json(path: Path, what: str):
    if not path.is_file():
        raise EventKVError(f"{what} {str(path)!r} does not exist or is not a file: give the path of the JSON file.")
    try:
        return json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError:
        raise EventKVError(f"{what} {str(path)!r} is not UTF-8 text: give the dataset's JSON file.") from None
    except json.JSONDecodeError as exc:
        raise EventKVError(
            f"{what} {str(path)!r} is not valid JSON ({exc.msg} at line {exc.lineno}): give the dataset's JSON file."
        ) from None


def _caption(text: str, caption: str | None) -> str:
    return text + IMAGE_NOTE.format(caption=caption.strip()) if caption and caption.strip() else text


def _sessions(conv: dict, where: str) -> list[tuple[int, list, str]]:
    """``(N, turns, date_time)`` for each ``session_N`` list, by N; dates without a list are skipped."""
    lists, dates = {}, {}
    for key, value in conv.items():
        if m := _SESSION.match(key):
            if not isinstance(value, list):
                raise EventKVError(f"{where} has {key} of type {type(value).__name__}: give a list of turns.")
            lists[int(m.group(1))] = value
        elif m := _SESSION_DATE.match(key):
            if not isinstance(value, str):
                raise EventKVError(f"{where} has {key} of type {type(value).__name__}: give the date as a string.")
            dates[int(m.group(1))] = value
    return [(n, lists[n], dates.get(n, "")) for n in sorted(lists)]


def _unique_turns(turns: list[Turn], where: str) -> list[Turn]:
    seen: set[str] = set()
    for t in turns:
        if t.id in seen:
            raise EventKVError(f"{where} gives the dia_id {t.id!r} to two turns: each turn needs its own id.")
        seen.add(t.id)
    return turns


def load_locomo(path: str | Path) -> list[Conversation]:
    """Read a LoCoMo file (the ``locomo10.json`` format; module docstring) into conversations, in file
    order. Turn text: ``text``, plus the image caption (:data:`IMAGE_NOTE`) when ``blip_caption`` is a
    non-empty string.

    Raises:
        EventKVError: the file is missing or not JSON, or a record breaks the format; the message names
            the file, the sample and the field (e.g. ``"data.json: sample 'conv-1' session_2[4] has no
            'speaker': ..."``).
    """
    p = Path(path)
    data = _read_json(p, "LoCoMo file")
    if not isinstance(data, list):
        raise EventKVError(
            f"LoCoMo file {str(p)!r} holds a JSON {type(data).__name__}: LoCoMo is a JSON list of samples "
            '{"sample_id", "conversation", "qa"}.'
        )
    out = []
    for s, obj in enumerate(data):
        sample = check_record(LocomoSample, obj, f"{p}: sample [{s}]", _SAMPLE_RULES, "a LoCoMo sample")
        where = f"{p}: sample {sample.sample_id!r}"
        names = check_record(
            LocomoSpeakers, sample.conversation, f"{where} conversation", _SPEAKER_RULES, "a LoCoMo conversation"
        )
        turns = []
        for n, items, date in _sessions(sample.conversation, f"{where} conversation"):
            for i, item in enumerate(items):
                t = check_record(LocomoTurn, item, f"{where} session_{n}[{i}]", _TURN_RULES, "a LoCoMo turn")
                turns.append(Turn(t.dia_id, n, date, t.speaker, _caption(t.text, t.blip_caption)))
        questions = []
        for q, item in enumerate(sample.qa):
            r = check_record(LocomoQA, item, f"{where} qa[{q}]", _QA_RULES, "a LoCoMo question")
            if r.answer is None and r.category != 5:
                raise EventKVError(f"{where} qa[{q}] (category {r.category}) has no 'answer': {_QA_RULES['answer']}.")
            adv = None if r.adversarial_answer is None else str(r.adversarial_answer)
            answer = "" if r.answer is None else str(r.answer)
            questions.append(QA(r.question, answer, parse_evidence(r.evidence), r.category, adv))
        out.append(
            Conversation(sample.sample_id, (names.speaker_a, names.speaker_b), _unique_turns(turns, where), questions)
        )
    return out


def _chat_number(p: Path) -> tuple[int, str]:
    m = re.match(r"Chat_(\d+)", p.name)
    return (int(m.group(1)) if m else 0, p.name)


def load_realtalk(path: str | Path) -> list[Conversation]:
    """Read REALTALK conversations (module docstring): every ``Chat_*.json`` in a directory, in chat
    number order (``Chat_2`` before ``Chat_10``), or one such file. Turn text: ``clean_text``, plus the
    image caption (:data:`IMAGE_NOTE`) when ``blip_caption`` is a non-empty string; date: the turn's own
    ``date_time``, else its session's ``session_N_date_time``.

    Raises:
        EventKVError: the path is missing, a directory holds no ``Chat_*.json``, a file is not JSON, or a
            record breaks the format; the message names the file, the conversation and the field.
    """
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("Chat_*.json"), key=_chat_number)
        if not files:
            raise EventKVError(
                f"REALTALK directory {str(p)!r} holds no Chat_*.json file: give the directory of REALTALK's "
                "data/Chat_<n>_<A>_<B>.json files, or one of them."
            )
    elif p.is_file():
        files = [p]
    else:
        raise EventKVError(f"REALTALK path {str(p)!r} does not exist: give the directory of Chat_*.json files.")
    return [_realtalk_chat(f) for f in files]


def _realtalk_chat(p: Path) -> Conversation:
    data = _read_json(p, "REALTALK file")
    where = f"{p}: conversation {p.stem!r}"
    chat = check_record(RealtalkChat, data, where, _CHAT_RULES, "a REALTALK conversation")
    names = check_record(RealtalkNames, chat.name, f"{where} name", _SPEAKER_RULES, "a REALTALK name object")
    turns = []
    for n, items, date in _sessions(data, where):
        for i, item in enumerate(items):
            t = check_record(RealtalkTurn, item, f"{where} session_{n}[{i}]", _TURN_RULES, "a REALTALK turn")
            turns.append(Turn(t.dia_id, n, t.date_time or date, t.speaker, _caption(t.clean_text, t.blip_caption)))
    questions = []
    for q, item in enumerate(chat.qa):
        r = check_record(RealtalkQA, item, f"{where} qa[{q}]", _QA_RULES, "a REALTALK question")
        if r.answer is None:
            raise EventKVError(f"{where} qa[{q}] has answer = null: give the answer as a string or a number.")
        questions.append(QA(r.question, str(r.answer), parse_evidence(r.evidence), r.category))
    return Conversation(p.stem, (names.speaker_1, names.speaker_2), _unique_turns(turns, where), questions)


def turn_tokens(turn: Turn, tokenizer) -> int:
    """Tokens of ``turn`` as the memory's event log tokenizes it: ``Event(turn.id, turn.event_text())``
    rendered (its text and the closing newline) and encoded alone (:func:`eventkv.models.encoding.encode`)."""
    return len(encode(tokenizer, Event(turn.id, turn.event_text()).render()))


def truncate(conv: Conversation, tokenizer, max_tokens: int) -> Conversation:
    """The first turns of ``conv`` whose events fit in ``max_tokens`` tokens together (each turn counted
    alone by :func:`turn_tokens`; the header and the questions are not counted), and only the questions
    whose evidence lies entirely inside those turns. A question with empty evidence is dropped (nothing
    shows its answer is inside), and so is one whose evidence names an id of no turn.

    Each conversation is truncated to its first ``max_tokens`` tokens of turns.

    Raises:
        OptionError: ``max_tokens`` is not a whole number >= 1.
        EventKVError: not even the first turn fits (the message gives its token count).
    """
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise OptionError("max_tokens", max_tokens, "give a whole number of tokens >= 1.")
    kept, used = [], 0
    for turn in conv.turns:
        n = turn_tokens(turn, tokenizer)
        if used + n > max_tokens:
            break
        kept.append(turn)
        used += n
    if conv.turns and not kept:
        raise EventKVError(
            f"max_tokens {max_tokens} keeps no turn of conversation {conv.id!r}: its first turn alone is "
            f"{turn_tokens(conv.turns[0], tokenizer)} tokens; give a larger max_tokens."
        )
    ids = {t.id for t in kept}
    questions = [q for q in conv.questions if q.evidence and set(q.evidence) <= ids]
    return replace(conv, turns=kept, questions=questions)
