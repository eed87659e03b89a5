r"""Prompt tasks with exact-match answers for the splice probe (Study 2), built in and offline.

Every built-in task is generated from ``(seed, index)`` alone (``random.Random`` seeded with a
string naming the task, seed and index), so item ``i`` is the same in every run and a run can be
resumed or extended item by item. An item is a dict ``{"index", "prompt", "answer", "options",
"case_sensitive"}``: ``prompt`` is the user content (the splice span), ``answer`` the exact answer.

Scoring (:func:`score`) reads the generation's **first non-empty line** (leading/trailing whitespace
and the characters in :data:`STRIP` removed from both ends; a line of only those is empty) with one
of two matchers (:data:`MATCHERS`):

* ``word`` (default) — the line is correct iff it contains the answer as a whole word/number
  (``(?<!\w)answer(?!\w)``, case-insensitive unless the item is case-sensitive) **and** it names no
  competitor: for items with options, no other option occurs as a whole word; for items without
  options whose answer is a number, no other number occurs (every number in the line must equal
  the answer). So "The value of K3 is violin." scores correct for ``violin``, while a line that
  lists several candidates ("positive or negative", "42 or 43", "12 + 30 = 42") scores wrong.
  Items without options and with a word answer (``lookup``, ``copy``) have no competitor check.
* ``exact`` — the line must equal the answer (the original readout). Instruction-tuned models
  often answer in a sentence and base models with a word of their own, which ``exact`` scores as
  wrong even when the answer is right; ``word`` was adopted as the default for that reason (a
  readout-validity decision made before any splice result was looked at), and ``exact`` is kept
  for comparison.

Items with options can also be read out by forced choice (the probe's ``readout="choice"``).

Tasks (:data:`TASKS`):

* ``lookup`` — a 5-row table of ``CODE: word`` lines; asks the word of one code.
* ``arithmetic`` — ``a + b`` with ``a, b`` in 10..49.
* ``choose`` — which of three words belongs to a named category (options listed in the prompt).
* ``copy`` — repeat a word exactly, or write it in capital letters (case-sensitive).
* ``sentiment`` — a one-sentence review built from fixed positive/negative word lists.

A user dataset is a JSONL file, one object per line: ``{"prompt", "answer", "options"?,
"case_sensitive"?}`` (:func:`load_jsonl`).
"""

from __future__ import annotations

import hashlib
import random
import re
import string
from pathlib import Path
from typing import Callable, Sequence

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from eventkv.errors import EventKVError
from eventkv.kv.log import check_record, read_jsonl

STRIP = ".,;:!?\"'`*()[]"
MATCHERS = ("exact", "word")
_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?!\w)")

WORDS = (
    "apple",
    "river",
    "candle",
    "garden",
    "mirror",
    "pencil",
    "rocket",
    "violin",
    "window",
    "silver",
    "forest",
    "bottle",
    "castle",
    "dragon",
    "jacket",
    "marble",
    "orange",
    "planet",
    "saddle",
    "tunnel",
)
CATEGORIES = {
    "fruit": ("apple", "banana", "cherry", "grape", "lemon", "mango", "peach", "plum"),
    "animal": ("tiger", "horse", "rabbit", "eagle", "whale", "zebra", "monkey", "wolf"),
    "tool": ("hammer", "wrench", "shovel", "saw", "drill", "chisel", "pliers", "axe"),
    "color": ("red", "blue", "green", "yellow", "purple", "black", "white", "brown"),
    "vehicle": ("car", "truck", "bicycle", "train", "boat", "bus", "airplane", "tractor"),
}
POSITIVE = ("wonderful", "excellent", "great", "delightful", "superb", "lovely", "fantastic", "amazing")
NEGATIVE = ("terrible", "awful", "horrible", "dreadful", "poor", "disappointing", "bad", "miserable")
SUBJECTS = ("the food", "the movie", "the service", "the hotel", "the book", "the concert", "the room", "the game")


def _rng(task: str, seed: int, index: int) -> random.Random:
    return random.Random(f"eventkv-splice/{task}/{seed}/{index}")


def _item(index: int, prompt: str, answer: str, options: Sequence[str] = (), case_sensitive: bool = False) -> dict:
    return {
        "index": index,
        "prompt": prompt,
        "answer": answer,
        "options": list(options),
        "case_sensitive": case_sensitive,
    }


def lookup(seed: int, index: int) -> dict:
    r = _rng("lookup", seed, index)
    codes: list[str] = []
    while len(codes) < 5:
        c = r.choice(string.ascii_uppercase) + str(r.randint(1, 9))
        if c not in codes:
            codes.append(c)
    values = r.sample(WORDS, 5)
    k = r.randrange(5)
    table = "\n".join(f"{c}: {v}" for c, v in zip(codes, values))
    prompt = f"Here is a table.\n{table}\nWhat is the value of {codes[k]}? Answer with the value only."
    return _item(index, prompt, values[k])


def arithmetic(seed: int, index: int) -> dict:
    r = _rng("arithmetic", seed, index)
    a, b = r.randint(10, 49), r.randint(10, 49)
    return _item(index, f"What is {a} + {b}? Answer with the number only.", str(a + b))


def choose(seed: int, index: int) -> dict:
    r = _rng("choose", seed, index)
    cats = sorted(CATEGORIES)
    target = r.choice(cats)
    others = r.sample([c for c in cats if c != target], 2)
    opts = [r.choice(CATEGORIES[target])] + [r.choice(CATEGORIES[c]) for c in others]
    answer = opts[0]
    r.shuffle(opts)
    prompt = f"Which of these words is a {target}: {', '.join(opts)}? Answer with the word only."
    return _item(index, prompt, answer, opts)


def copy(seed: int, index: int) -> dict:
    r = _rng("copy", seed, index)
    word = r.choice(WORDS)
    if r.random() < 0.5:
        return _item(index, f"Repeat this word exactly: {word}", word, case_sensitive=True)
    return _item(
        index,
        f"Write the word {word} in capital letters. Answer with the word only.",
        word.upper(),
        case_sensitive=True,
    )


def sentiment(seed: int, index: int) -> dict:
    r = _rng("sentiment", seed, index)
    label = r.choice(("positive", "negative"))
    adj = r.choice(POSITIVE if label == "positive" else NEGATIVE)
    subject = r.choice(SUBJECTS)
    prompt = (
        f"Review: {subject[0].upper() + subject[1:]} was {adj}.\n"
        "Is this review positive or negative? Answer with one word: positive or negative."
    )
    return _item(index, prompt, label, ("positive", "negative"))


TASKS: dict[str, Callable[[int, int], dict]] = {
    "lookup": lookup,
    "arithmetic": arithmetic,
    "choose": choose,
    "copy": copy,
    "sentiment": sentiment,
}


def builtin_items(task: str, seed: int, indices: Sequence[int]) -> list[dict]:
    """Items ``indices`` of a built-in task.

    Raises:
        EventKVError: an unknown task name.
    """
    if task not in TASKS:
        raise EventKVError(f"unknown task {task!r}: use one of {', '.join(TASKS)} or the path of a JSONL file.")
    return [TASKS[task](seed, int(i)) for i in indices]


class TaskItemSchema(BaseModel):
    """One line of a user task file: ``prompt`` and ``answer`` (non-blank strings), optional
    ``options`` (distinct non-blank strings that include the answer) and ``case_sensitive`` (a JSON
    boolean). Strict: no coercion (``"case_sensitive": "no"`` is refused, not read as true) and no
    other keys."""

    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)

    prompt: str
    answer: str
    case_sensitive: bool = False  # before options: the options' check reads it
    options: list[str] = []

    @field_validator("prompt", "answer")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("blank")
        return v

    @field_validator("options")
    @classmethod
    def _distinct_with_the_answer(cls, v: list[str], info: ValidationInfo) -> list[str]:
        norm = (lambda t: t.strip()) if info.data.get("case_sensitive") else (lambda t: t.strip().lower())  # noqa: E731
        if any(not o.strip() for o in v) or len({norm(o) for o in v}) != len(v):
            raise ValueError("blank or repeated option")
        if v and "answer" in info.data and norm(info.data["answer"]) not in {norm(o) for o in v}:
            raise ValueError("answer not among options")
        return v


_TASK_RULES = {
    "prompt": "give the prompt as a non-empty string",
    "answer": "give the answer as a non-empty string (one of 'options' when the item has options)",
    "options": "give a list of distinct non-empty strings that includes the answer, or leave the key out",
    "case_sensitive": "give true or false (a JSON boolean), or leave the key out",
}


def load_jsonl(path: str | Path) -> list[dict]:
    """Read a user dataset: one JSON object per line checked against :class:`TaskItemSchema`.
    Blank lines are skipped; items are indexed in file order.

    Raises:
        EventKVError: missing file, a file that is not UTF-8, a line that is not JSON or breaks
            the schema (the message names the line, the field and the bad value), or no items.
    """
    p = Path(path)
    items: list[dict] = []
    for n, _line, obj in read_jsonl(p, "task file", "'prompt' and 'answer' per line"):
        t = check_record(TaskItemSchema, obj, f"{p}:{n}", _TASK_RULES, "a task item")
        items.append(_item(len(items), t.prompt, t.answer, t.options, t.case_sensitive))
    if not items:
        raise EventKVError(f"task file {str(p)!r} holds no items: write one JSON object per line.")
    return items


def file_digest(path: str | Path) -> str:
    """sha256 of a task file (part of a run's identity, so a changed file is not mixed in)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def first_line(text: str) -> str:
    """The first non-empty line of ``text``, stripped of whitespace and of :data:`STRIP` at both ends."""
    for line in text.splitlines():
        s = line.strip().strip(STRIP).strip()
        if s:
            return s
    return ""


def _whole(text: str, word: str, case_sensitive: bool) -> bool:
    """``word`` occurs in ``text`` as a whole word/number (not inside a longer word)."""
    flags = 0 if case_sensitive else re.IGNORECASE
    return re.search(r"(?<!\w)" + re.escape(word) + r"(?!\w)", text, flags) is not None


def _is_number(text: str) -> bool:
    return _NUMBER.fullmatch(text) is not None


def _word_match(line: str, item: dict) -> bool:
    ans = item["answer"].strip().strip(STRIP).strip()
    cs = bool(item.get("case_sensitive"))
    if not ans or not _whole(line, ans, cs):
        return False
    norm = (lambda x: x) if cs else str.casefold
    others = [o.strip() for o in item.get("options") or [] if norm(o.strip()) != norm(ans)]
    if others:
        return not any(_whole(line, o, cs) for o in others if o)
    if _is_number(ans):
        return all(float(n) == float(ans) for n in _NUMBER.findall(line))
    return True


def score(text: str, item: dict, match: str = "word") -> tuple[bool, str]:
    """(correct, prediction) of a generation: the first non-empty line (the prediction) scored by
    ``match`` — ``"word"`` (answer as a whole word, no competing option/number) or ``"exact"``
    (line equals the answer); see the module docstring.

    Raises:
        EventKVError: an unknown matcher.
    """
    if match not in MATCHERS:
        raise EventKVError(f"unknown matcher {match!r}: use one of {', '.join(MATCHERS)}.")
    pred = first_line(text)
    if match == "word":
        return _word_match(pred, item), pred
    ans = item["answer"].strip().strip(STRIP).strip()
    if item.get("case_sensitive"):
        return pred == ans, pred
    return pred.casefold() == ans.casefold(), pred


def outcome_decided(text: str, item: dict, match: str = "word") -> bool:
    """True when the outcome of a generation starting with ``text`` is already fixed under
    ``match``, whatever tokens follow. Used to end decoding early; never changes a score.

    Both matchers: decided once the first non-empty line is complete (a newline follows it).
    ``exact`` also: decided as soon as the line so far can no longer equal the answer (after
    :func:`score`'s normalization, any tail may only be whitespace or :data:`STRIP` characters).
    ``word`` has no such shortcut: any continuation of an open line can add the answer or a
    competitor.
    """
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if not line.strip().strip(STRIP).strip():
            continue
        if i < len(lines) - 1:
            return True
        if match == "word":
            return False
        y = line.lstrip().lstrip(STRIP).lstrip()
        if "\ufffd" in y:  # a partial multi-byte character: wait for the rest
            return False
        ans = item["answer"].strip().strip(STRIP).strip()
        if not item.get("case_sensitive"):
            y, ans = y.casefold(), ans.casefold()
        if ans.startswith(y):
            return False
        if y.startswith(ans) and all(ch.isspace() or ch in STRIP for ch in y[len(ans) :]):
            return False
        return True
    return False
