"""``eventkv memory eval``: EventMemory on real multi-session dialogue (LoCoMo), measured as an
agent-memory user asks (PROTOCOLS.md, "The memory, measured as its users would"): at what fraction
of the history's rows does the memory answer like the whole history, and is serving stored rows
better than re-prefilling the retrieved turns as text?

**History.** Each conversation, whole (``max_tokens=0``) or truncated to its first ``max_tokens``
tokens of turns (:func:`eventkv.memory.dialogue.truncate`: each turn counted as its dated event;
only the questions whose evidence lies inside are kept), becomes one
:class:`~eventkv.memory.EventMemory`, prefilled once, session by session (each session's events are
one ``add(..., prefill=True)``). Events: one per turn, ``"[session 3, 1:56 pm on 8 May, 2023]
Caroline: text"``; with ``with_headers``, one header event per session (tagged ``"header"``, text
:func:`eventkv.memory.dialogue.session_header_text`, carrying the session's date) before its turns,
which are then rendered without the date (``"[session 3] Caroline: text"``), and selection serves
every served turn's session header (``select(..., with_headers=True)``).

The memories are kept under the run's directory (``memories/c<N>``; a temporary directory when
the probe runs outside a run folder) and reopened by a restarted run
(:meth:`EventMemory.open`), so a killed run neither re-prefills a conversation nor loses more
than the session in flight.

**Arms** of one question, for each budget ``b`` (a fraction of the history's rows, the header
excluded) and each positions mode (``positions``: ``contiguous``, the default, ``original`` or ``both``):

* ``rows:<selector>@<b>`` — the selector's served set (:meth:`EventMemory.select` with ``k``,
  ``selector``, ``budget=b``, ``neighbours``, ``with_headers``), its stored rows served (compact);
* ``text:<control>@<b>`` — a control selector's same served set re-prefilled as text (RAG);
* ``isolated:<control>@<b>`` — the same set, each event encoded alone (chunk-wise precomputed KV);
* ``blend:<control>@<b>`` — the same set's rows with a fraction recomputed (serve mode ``blend``,
  ``recompute``), when ``arm_names`` includes ``blend``; ``blend-layerwise`` and ``blend-epic`` the same
  under the ``layerwise`` and ``epic`` recompute schedules (``blend_schedule``, :mod:`eventkv.blend`);
* ``full`` — every stored row; ``gold`` — the evidence turns (and their session headers) as text.

A positioned arm (rows, isolated, blend) served in contiguous positions carries the suffix
``/contiguous`` (``rows:bm25@5%/contiguous``). With ``order="relevance"`` the text arms and the
``/contiguous`` arms serve their set as :meth:`EventMemory.query` with ``order="relevance"`` serves
it (selected again by the arm's selector at its budget, each shaping unit one block at its event's
rank, the best-ranked last before the question); ``full``, ``gold`` and arms at original positions
keep history order, and the arm names stay the same (the run's options record the order). The
question is asked as LoCoMo's ``task_eval`` scripts ask it: a category-2 (temporal) question gets
:data:`TEMPORAL_SUFFIX`; a category-5 (adversarial) question also scores the forced choice
:data:`NOT_MENTIONED` against the adversarial answer (full-continuation log-probs, nats).

**Readout.** The arms' served caches are read out in batches grouped by length
(:func:`length_groups`: sorted by rows, a cache joins a batch while padding stays at most
``max_padding`` of the padded batch), so the whole-history ``full`` cache does not pad every small
one; plans that need other serving keywords (positions, recompute, the selector and budget of a set
served in relevance order) are never batched together.
``batch_arms=False`` reads out each arm alone (each arm's latency its own).

Metric: LoCoMo's token F1 and exact match after its answer normalization
(:mod:`eventkv.memory.metrics`), by the data's integer category 1-4; category 5 apart. Statistics
(:func:`summarize_memory_eval`): see ``docs/memory.md`` for the tables.

Item ``i`` is question slot ``i % Q`` of conversation ``i // Q`` (``Q`` questions per
conversation, drawn with the seed from the conversation's eligible questions); a conversation
with fewer eligible questions records the missing slots as ``skipped``.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import weakref
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Sequence

import numpy as np

from eventkv.errors import EventKVError, OptionError
from eventkv.options import (
    DIALOGUE_FORMATS,
    SELECTORS,
    check_choices,
    check_int,
    check_max_new_tokens,
    check_optional_int,
    is_int,
)
from eventkv.probes.base import Arm, Probe, Runtime, Summary, Table
from eventkv.serve import SERVE_ORDERS
from eventkv.studies.materialization.dialogue_data import DialogueData

#: the kinds of arm; ``arm_names`` picks among them (``rows`` required)
ARM_KINDS = ("rows", "text", "isolated", "blend", "blend-layerwise", "blend-epic", "full", "gold")
DEFAULT_KINDS = ("rows", "text", "isolated", "full", "gold")
#: kinds served from the control selectors' sets besides their rows
CONTROL_KINDS = ("text", "isolated", "blend", "blend-layerwise", "blend-epic")
#: kinds whose served cache depends on the positions mode
POSITIONED = ("rows", "isolated", "blend", "blend-layerwise", "blend-epic")
#: the serve mode of each kind
SERVE_MODE = {
    "rows": "compact",
    "text": "text",
    "isolated": "isolated",
    "blend": "blend",
    "blend-layerwise": "blend",
    "blend-epic": "blend",
    "full": "compact",
    "gold": "text",
}
#: the recompute schedule (``blend_schedule``) of each blend kind; None: the serve mode's default
BLEND_SCHEDULE = {"blend": None, "blend-layerwise": "layerwise", "blend-epic": "epic"}
#: the order selectors are listed in (others follow, by name); the fused one is the default control
SELECTOR_ORDER = ("bm25", "dense", "attention", "hybrid", "rerank")
FUSED = "hybrid"
DEFAULT_BUDGETS = (0.025, 0.05, 0.1, 0.2)
POSITIONS = ("original", "contiguous", "both")
#: positions kept free after the history for the question and its answer (the context check)
QUESTION_ROOM = 256
#: the headline's budget (PROTOCOLS.md: "F1(rows at 10 %) / F1(full)")
HEADLINE_BUDGET = 0.1
#: a tiny LoCoMo-format file of invented dialogue shipped with eventkv (smoke tests, a first try)
DEMO_DATA = str(files("eventkv") / "data" / "locomo-demo.json")
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
INSTRUCTION = (
    "The events below are the turns of a conversation, in order, each with its session date and speaker. "
    "Answer questions about the conversation."
)
HEADED_INSTRUCTION = (
    "The events below are the turns of a conversation, in order, each session opened by a header with its "
    "date; each turn names its speaker. Answer questions about the conversation."
)
QUESTION = "Question: {question}\nAnswer in a few words, using the conversation's own words where possible."
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


def budget_label(fraction: float) -> str:
    """``0.025`` -> ``"2.5%"`` (the budget as arm names and tables write it)."""
    return f"{100 * fraction:g}%"


def parse_budget(text: str) -> float:
    """A budget as the CLI takes it: ``"5%"`` or ``"0.05"`` -> 0.05 (a fraction of the history's rows).

    Raises:
        OptionError: not a percentage or a fraction in (0, 1] (a row count is refused: it means a
            different fraction for every history).
    """
    s = text.strip()
    try:
        value = float(s[:-1]) / 100 if s.endswith("%") else float(s)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise OptionError(
            "budgets",
            text,
            "give each budget as a percentage or a fraction of the history's rows in (0, 1], e.g. 2.5%,5%,10%,20% "
            "(row counts are not taken: a fraction means the same for every history).",
        )
    return value


@dataclass(frozen=True)
class ArmSpec:
    """One arm of the grid: its name, kind, selector and budget (None for ``full`` and ``gold``) and
    the positions mode it is served in (``"original"`` for every kind not in :data:`POSITIONED`)."""

    name: str
    kind: str
    selector: str | None = None
    budget: float | None = None
    positions: str = "original"


def arm_spec(kind: str, selector: str | None = None, budget: float | None = None, positions: str = "original"):
    """The :class:`ArmSpec` named ``kind[:selector@budget][/contiguous]`` (see the module docstring)."""
    name = kind if selector is None or budget is None else f"{kind}:{selector}@{budget_label(budget)}"
    if positions == "contiguous" and kind in POSITIONED:
        name += "/contiguous"
    else:
        positions = "original"
    return ArmSpec(name, kind, selector, budget, positions)


def parse_arm(name: str) -> ArmSpec:
    """The :class:`ArmSpec` of an arm name (the inverse of :func:`arm_spec`)."""
    base, _, suffix = name.partition("/")
    kind, _, rest = base.partition(":")
    if not rest:
        return ArmSpec(name, kind)
    selector, _, label = rest.rpartition("@")
    return arm_spec(kind, selector, float(label.rstrip("%")) / 100, suffix or "original")


class ArmPlan(NamedTuple):
    """How one arm of a question is served: ``served`` (event ids in history order, or ``"all"``), the serve
    ``mode``, ``positions``, the blend ``schedule`` (None: the default), and ``relevance``: the arm's
    ``(selector, budget)`` when its set is served in relevance order (the memory selects it again with
    these and lays it out by rank), None when served in history order."""

    served: list[str] | str
    mode: str
    positions: str
    schedule: str | None = None
    relevance: tuple[str, float] | None = None


def length_groups(lengths: Sequence[int], max_padding: float) -> list[list[int]]:
    """Indices of ``lengths`` (rows of each served cache) grouped for batched readouts: sorted by
    length, each joins the current group while the group's padding (the rows added to bring every
    cache to the longest, as a fraction of the padded batch's rows) stays at most ``max_padding``;
    else it starts a new group. ``max_padding=1`` gives one group, ``0`` groups equal lengths only.
    Groups come shortest first, each in ascending length."""
    groups: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: (lengths[j], j)):
        trial = current + [i]
        padded = lengths[i] * len(trial)
        if current and padded - sum(lengths[j] for j in trial) > max_padding * padded:
            groups.append(current)
            trial = [i]
        current = trial
    return groups + ([current] if current else [])


def _count(n: int, noun: str) -> str:
    """``"1 question"``, ``"3 questions"``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


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
    view's rows): ``mem.select(question, k=k, selector=selector, budget=budget, neighbours=neighbours,
    with_headers=with_headers)`` (:meth:`eventkv.memory.EventMemory.select`: never over the budget).

    Raises:
        OptionError: an unknown selector or a bad shaping value.
    """
    return mem.select(question, k=k, selector=selector, budget=budget, neighbours=neighbours, with_headers=with_headers)


def history_events(conv, with_headers: bool) -> list:
    """The memory events of a conversation's turns (module docstring): one per turn, dated; with
    ``with_headers`` a header event (id ``session-N``, tag ``"header"``) before each session's turns,
    which are then undated. Returns ``[(session, [MemoryEvent, ...]), ...]`` in history order."""
    from eventkv.memory import MemoryEvent
    from eventkv.memory.dialogue import session_header_text

    sessions: list[tuple[int, list]] = []
    for t in conv.turns:
        if not sessions or sessions[-1][0] != t.session:
            head = []
            if with_headers:
                text = session_header_text(t.session, t.date_time)
                head = [MemoryEvent(text, id=f"session-{t.session}", tags=("header",))]
            sessions.append((t.session, head))
        sessions[-1][1].append(MemoryEvent(t.event_text(dated=not with_headers), id=t.id))
    return sessions


#: the memories :func:`open_history` opened in this process, by directory (a store takes one writer)
_OPEN: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def open_history(directory: Path, lm, instruction: str, sessions: list) -> Any:
    """The memory of one history in ``directory``: reopened when it holds a prefix of these events
    (the same ids and texts, in order; the missing sessions are then added), else built afresh (a store
    made by another model or header, or for another history, is removed); every session is added with
    its rows prefilled and committed, so a kill loses at most the session in flight. A handle this
    process opened on ``directory`` before is closed first.

    Raises:
        StoreDamaged: the store is damaged (:meth:`EventMemory.open`).
        EventKVError: another process holds the store; as :meth:`EventMemory.create` and
            :meth:`EventMemory.add`.
    """
    import json

    from eventkv.memory import EventMemory
    from eventkv.memory.store import model_identity

    key = str(directory.resolve())
    if key in _OPEN:
        _OPEN[key].close()  # this process's earlier handle (another probe object) holds the writer lock
    want = [(e.id, e.text) for _, evs in sessions for e in evs]
    mem = None
    if directory.exists():
        manifest = directory / "manifest.json"
        made = json.loads(manifest.read_text()) if manifest.is_file() else {}
        same = all(made.get(k) == v for k, v in model_identity(lm).items()) and made.get("instruction") == instruction
        if same:  # a store of this model and header: any other error (damage, a live writer) is raised
            mem = EventMemory.open(directory, lm)
            have = [(r.id, r.text) for r in mem.list()]
            if have != want[: len(have)]:
                mem.close()
                mem = None
        if mem is None:  # made for another history or model (a run folder taken over), or never completed
            shutil.rmtree(directory)
    if mem is None:
        directory.parent.mkdir(parents=True, exist_ok=True)
        mem = EventMemory.create(directory, lm, namespace="eval", instruction=instruction)
    _OPEN[key] = mem
    done = len(mem.list())
    seen = 0
    for _, evs in sessions:
        if seen + len(evs) > done:
            mem.add(evs[max(0, done - seen) :], prefill=True)
        seen += len(evs)
    mem.prefill()  # events left pending by an earlier process
    return mem


@dataclass
class _History:
    conv: Any
    sessions: list
    n_tokens: int  # header + events


@dataclass
class MemoryEval(DialogueData, Probe):
    """Options (all part of a run's identity): ``data`` (LoCoMo JSON path) and its ``data_digest``
    (sha256, filled in when empty), ``conversations``, ``questions_per_conversation``, ``max_tokens``
    (history tokens per conversation; 0 = the whole conversation), ``selectors`` (names in
    :data:`eventkv.options.SELECTORS`; empty = every registered one), ``budgets`` (fractions of the
    history's rows, header excluded), ``controls`` (the selectors whose served sets also get the text /
    isolated / blend arms; empty = ``"hybrid"`` when listed, else the first selector), ``positions``
    (``contiguous`` (default) | ``original`` | ``both``), ``order`` (``log`` | ``relevance``: the order the text
    arms and the ``/contiguous`` arms serve their sets in; module docstring), ``neighbours``,
    ``with_headers``, ``k`` (at most ``k`` events ranked per served set besides the budget; None = fill
    to the budget), ``recompute`` (the blend arm's fraction; None = the serve mode's default),
    ``max_new_tokens``, ``arm_names`` (the arm kinds, :data:`ARM_KINDS`), ``batch_arms``,
    ``max_padding`` (:func:`length_groups`), ``timing`` (record wall-clock latencies; off, records
    depend only on the seed and index).

    Record (version 4), one per question: ``index``, ``conversation``, ``slot``, ``question``,
    ``gold``, ``category``, ``evidence``, ``history_rows`` (header excluded), ``choice`` (category 5),
    ``selection`` (per ``"<selector>@<budget>"``: ``ids``, ``rows``, ``recall`` = the fraction of the
    evidence ids served), ``arms`` (per arm name: ``answer``, ``f1``, ``em``, ``n_rows`` (the served
    cache's rows, header included), ``rows`` (header excluded), ``fraction`` (rows / history_rows),
    ``kv_bytes`` (n_rows x layers x 2 x kv_heads x head_dim x dtype bytes), ``n_tokens``, ``empty``
    (true when the served set was empty: f1 0, nothing read out), ``served_order`` (an arm served in
    relevance order only: the served event ids in the order their rows were laid out), category 5:
    ``abstain_margin``, ``abstains``) and ``timing`` (``serve``, ``readout`` in ms and ``batch``, the readout
    batch's size, per arm); a skipped slot: ``skipped`` with the reason."""

    name: ClassVar[str] = "memory-eval"
    record_version: ClassVar[int] = 4
    smoke_options: ClassVar[dict] = {
        "data": DEMO_DATA,
        "conversations": 1,
        "questions_per_conversation": 2,
        "max_tokens": 400,
        "budgets": (0.5,),
        "max_new_tokens": 3,
        "timing": False,
    }

    conversations: int = 2
    questions_per_conversation: int = 30
    max_tokens: int = 4000
    selectors: tuple[str, ...] = ()
    budgets: tuple[float, ...] = DEFAULT_BUDGETS
    controls: tuple[str, ...] = ()
    positions: str = "contiguous"
    order: str = "log"
    neighbours: int = 0
    with_headers: bool = False
    k: int | None = None
    recompute: float | None = None
    max_new_tokens: int = 24
    arm_names: tuple[str, ...] = DEFAULT_KINDS
    batch_arms: bool = True
    max_padding: float = 0.5
    timing: bool = True

    def __post_init__(self) -> None:
        self.arm_names = tuple(self.arm_names)
        self.budgets = tuple(float(b) if is_int(b) or isinstance(b, float) else b for b in self.budgets)
        if not self.selectors:
            names = SELECTORS.names()
            self.selectors = tuple(n for n in SELECTOR_ORDER if n in names) + tuple(
                sorted(n for n in names if n not in SELECTOR_ORDER)
            )
        self.selectors = tuple(self.selectors)
        if not self.controls:
            self.controls = (FUSED,) if FUSED in self.selectors else self.selectors[:1]
        self.controls = tuple(self.controls)
        self._open: tuple[int, Any] | None = None
        self._histories: dict[int, _History] = {}
        self._loaded: list | None = None
        self._run_dir: Path | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._row_bytes: int | None = None
        self.validate()

    # ------------------------------------------------------------------ options
    def validate(self) -> None:
        if not self.data:
            raise OptionError("data", self.data, "give the LoCoMo JSON file (e.g. locomo10.json).", flag="--data")
        path = Path(self.data)
        if not path.is_file():
            raise OptionError("data", self.data, "no such file: give the path of a LoCoMo JSON file.", flag="--data")
        self.pin_data_digest(path)
        check_int("conversations", self.conversations, "evaluate at least 1 conversation.")
        check_int("questions_per_conversation", self.questions_per_conversation, "ask at least 1 question.")
        if not is_int(self.max_tokens) or 0 < self.max_tokens < 16 or self.max_tokens < 0:
            raise OptionError("max_tokens", self.max_tokens, "keep at least 16 tokens of history, or 0 for all of it.")
        check_choices(
            "selectors", self.selectors, SELECTORS.names(), flag="--selectors", what="selectors (the registered ones)"
        )
        b = self.budgets
        if not b or len(set(b)) != len(b) or not all(isinstance(x, float) and 0 < x <= 1 for x in b):
            raise OptionError(
                "budgets", b, "give distinct fractions of the history's rows in (0, 1], e.g. 2.5%,5%,10%,20%."
            )
        check_choices(
            "controls", self.controls, self.selectors, flag="--controls", what="control selectors among --selectors"
        )
        if self.positions not in POSITIONS:
            raise OptionError("positions", self.positions, f"give one of {', '.join(POSITIONS)}.")
        if self.order not in SERVE_ORDERS:
            raise OptionError(
                "order",
                self.order,
                "give log (the served turns in history order) or relevance (the text and /contiguous arms' turns "
                "in increasing selector score, the best-ranked last before the question).",
            )
        check_int("neighbours", self.neighbours, "give a whole number of neighbouring turns >= 0.", minimum=0)
        if not isinstance(self.with_headers, bool):
            raise OptionError("with_headers", self.with_headers, "give true or false.")
        check_optional_int("k", self.k, "give a whole number of events >= 1, or leave k out (fill to the budget).")
        if self.recompute is not None and (
            isinstance(self.recompute, bool)
            or not isinstance(self.recompute, (int, float))
            or not 0 <= self.recompute <= 1
        ):
            raise OptionError("recompute", self.recompute, "give the fraction of rows blend recomputes, in [0, 1].")
        check_max_new_tokens(self.max_new_tokens)
        check_choices("arm_names", self.arm_names, ARM_KINDS, required=("rows",), flag="--arms", what="arms")
        if not 0 <= self.max_padding <= 1 or isinstance(self.max_padding, bool):
            raise OptionError("max_padding", self.max_padding, "give a fraction in [0, 1].")
        n = len(self._conversations())
        if self.conversations > n:
            raise OptionError(
                "conversations", self.conversations, f"{self.data!r} holds {n} conversations: ask for {n} or fewer."
            )

    def _conversations(self):
        """The file's conversations, parsed once per probe (validate and every memory read them)."""
        if self._loaded is None:
            self._loaded = DIALOGUE_FORMATS.get("locomo")(self.data)
        return self._loaded

    def max_items(self) -> int:
        return self.conversations * self.questions_per_conversation

    def position_modes(self) -> tuple[str, ...]:
        return ("original", "contiguous") if self.positions == "both" else (self.positions,)

    def instruction(self) -> str:
        return HEADED_INSTRUCTION if self.with_headers else INSTRUCTION

    def served_order(self, arm: ArmSpec) -> str:
        """The order ``arm``'s served set is laid out in: :attr:`order` for a selector's set served at
        contiguous positions (a ``/contiguous`` arm, or ``text``: re-prefilled contiguously), else ``"log"``
        (``full``, ``gold`` and arms at original positions, whose rows keep their positions)."""
        contiguous = arm.kind == "text" or arm.positions == "contiguous"
        return self.order if arm.selector is not None and contiguous else "log"

    def grid(self) -> list[ArmSpec]:
        """Every arm of a question, in table order: per budget the rows of each selector (each
        positions mode), then the control kinds of each control; then ``full`` and ``gold``."""
        out = []
        for b in self.budgets:
            out += [arm_spec("rows", s, b, p) for s in self.selectors for p in self.position_modes()]
            for c in self.controls:
                for kind in (k for k in CONTROL_KINDS if k in self.arm_names):
                    modes = self.position_modes() if kind in POSITIONED else ("original",)
                    out += [arm_spec(kind, c, b, p) for p in modes]
        return out + [arm_spec(k) for k in ("full", "gold") if k in self.arm_names]

    def check_model(self, rt: Runtime) -> None:
        """Refuse a history that passes the model's context where it must fit: in original positions
        (the question comes after the whole history), or for the ``full`` arm (every row served)."""
        ctx = rt.max_context
        if ctx is None:
            return
        header = len(rt.header_ids(self.instruction()))
        for c in range(self.conversations):
            h = self._history(rt, c)
            if h.n_tokens + QUESTION_ROOM <= ctx:
                continue
            size = f"conversation {h.conv.id!r} keeps {h.n_tokens - header} tokens of history"
            if "original" in self.position_modes():
                raise OptionError(
                    "max_tokens",
                    self.max_tokens,
                    f"{size}: with the header and {QUESTION_ROOM} tokens for the question it passes the model's "
                    f"context of {ctx} tokens in original positions: give --positions contiguous (or --max-tokens "
                    f"{ctx - header - QUESTION_ROOM} or fewer).",
                )
            if "full" in self.arm_names:
                raise OptionError(
                    "arm_names",
                    self.arm_names,
                    f"{size}, past the model's context of {ctx} tokens: the full arm cannot serve it; leave full "
                    "out of --arms (or lower --max-tokens).",
                    flag="--arms",
                )

    def use_run_directory(self, directory) -> None:
        self._run_dir = Path(directory)

    def arms(self) -> list[Arm]:
        served = {"full": "all", "gold": "evidence"}
        encoding = {"text": "prefill", "gold": "prefill", "isolated": "isolated"}
        return [
            Arm(a.name, served.get(a.kind, "selected"), encoding.get(a.kind, "compact"), ("generate",))
            for a in self.grid()
        ]

    # ------------------------------------------------------------------ items
    def items(self, seed: int, indices: Sequence[int]) -> list[dict]:
        q = self.questions_per_conversation
        return [{"index": i, "conversation": i // q, "slot": i % q, "seed": seed} for i in indices]

    def _history(self, rt: Runtime, c: int) -> _History:
        """Conversation ``c`` as the memory holds it (truncated; its events by session; tokens with the
        header), tokenized once per probe."""
        if c not in self._histories:
            from eventkv.log import Event, encode
            from eventkv.memory.dialogue import truncate

            conv = self._conversations()[c]
            conv = truncate(conv, rt.tokenizer, self.max_tokens or sys.maxsize)  # 0: every turn
            sessions = history_events(conv, self.with_headers)
            n = len(rt.header_ids(self.instruction()))
            n += sum(len(encode(rt.tokenizer, Event(e.id, e.text).render())) for _, evs in sessions for e in evs)
            self._histories[c] = _History(conv, sessions, n)
        return self._histories[c]

    def _store_root(self) -> Path:
        if self._run_dir is not None:
            return self._run_dir / "memories"
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="eventkv-memory-eval-")
        return Path(self._tmp.name)

    def _memory(self, rt: Runtime, c: int, seed: int):
        """Conversation ``c``'s history, memory and sampled questions. One memory is open at a time
        (items come conversation by conversation): opening the next closes the last."""
        if self._open is None or self._open[0] != c:
            from eventkv.models import LoadedModel

            if self._open is not None:
                self._open[1][1].close()
                self._open = None
            h = self._history(rt, c)
            lm = LoadedModel(rt.model, rt.tokenizer, rt.profile)
            mem = open_history(self._store_root() / f"c{c}", lm, self.instruction(), h.sessions)
            questions = list(h.conv.questions)
            random.Random(f"memory-eval:{seed}:{c}").shuffle(questions)
            self._open = (c, (h, mem, questions[: self.questions_per_conversation]))
        return self._open[1]

    def _kv_row_bytes(self, rt: Runtime) -> int:
        """Bytes of one stored row over every layer: layers x 2 (K, V) x kv_heads x head_dim x dtype bytes."""
        if self._row_bytes is None:
            import torch

            from eventkv.models.introspect import profile_for

            p = profile_for(rt.model, None, "kv rows")
            size = torch.empty((), dtype=getattr(torch, p.dtype)).element_size()
            self._row_bytes = p.num_layers * 2 * p.num_kv_heads * p.head_dim * size
        return self._row_bytes

    def run_item(self, rt: Runtime, item: dict) -> dict:
        from eventkv.memory.metrics import score_answer

        h, mem, questions = self._memory(rt, item["conversation"], item["seed"])
        rec = {"index": item["index"], "conversation": h.conv.id, "slot": item["slot"]}
        if item["slot"] >= len(questions):
            what = f"the first {self.max_tokens} tokens" if self.max_tokens else "the conversation"
            return {**rec, "skipped": f"{len(questions)} eligible questions in {what}"}
        qa = questions[item["slot"]]
        prompt = question_prompt(qa.question, qa.category)
        trap = (qa.adversarial_answer or qa.answer) if qa.category == 5 else None
        candidates = [NOT_MENTIONED, trap] if trap and trap.strip() and trap != NOT_MENTIONED else None
        header = len(mem.header_ids)
        n_rows = {r.id: r.n_rows for r in mem.list()}
        history_rows = sum(n_rows.values())
        fits = h.n_tokens + QUESTION_ROOM <= (rt.max_context or h.n_tokens + QUESTION_ROOM)
        evidence = set(qa.evidence)

        selection = {}
        for s in self.selectors:
            for b in self.budgets:
                ids = served_set(
                    mem, qa.question, s, b, k=self.k, neighbours=self.neighbours, with_headers=self.with_headers
                )
                selection[f"{s}@{budget_label(b)}"] = {
                    "ids": ids,
                    "rows": sum(n_rows[i] for i in ids),
                    "recall": round(len(evidence & set(ids)) / len(evidence), 6),
                }
        # gold: the evidence turns, and with headers their sessions' header events
        heads = {f"session-{t.session}" for t in h.conv.turns if t.id in evidence} if self.with_headers else set()
        gold = [e.id for _, evs in h.sessions for e in evs if e.id in evidence or e.id in heads]

        specs = self.grid()
        plans: dict[str, ArmPlan] = {}
        for a in specs:
            if a.kind == "full":
                served: list[str] | str = "all"
            elif a.kind == "gold":
                served = gold
            else:
                served = selection[f"{a.selector}@{budget_label(a.budget or 0)}"]["ids"]
            positions = a.positions if a.kind in POSITIONED or fits else "contiguous"
            relevance = None
            if self.served_order(a) == "relevance":
                positions, relevance = "contiguous", (a.selector or "", a.budget or 0.0)
            plans[a.name] = ArmPlan(served, SERVE_MODE[a.kind], positions, BLEND_SCHEDULE.get(a.kind), relevance)
        answers, serve_ms, readout_ms, batch = {}, {}, {}, {}
        for group in self._groups(plans, n_rows, history_rows, header):
            first = plans[group[0]]
            kw: dict = {"candidates": candidates, "max_new_tokens": self.max_new_tokens}
            if first.positions != "original":
                kw["positions"] = first.positions
            if first.mode == "blend" and self.recompute is not None:
                kw["recompute"] = self.recompute
            if first.schedule is not None:
                kw["blend_schedule"] = first.schedule
            selects: list[list[str] | str | None]
            question, selects = prompt, [plans[a].served for a in group]
            if first.relevance is not None:
                # the memory selects the set again, as served_set did (same question, selector and shaping), so
                # each shaping unit (a turn with its neighbours and session header) is laid out as one block at
                # its turn's rank (relevance_order); the question selects and ranks, the prompt is read as the
                # one user message (the same token ids as question=prompt: eventkv.memory.chat.chat_tail_ids)
                selector, budget = first.relevance
                kw |= {"order": "relevance", "selector": selector, "budget": budget, "k": self.k}
                kw |= {"neighbours": self.neighbours, "with_headers": self.with_headers}
                kw["messages"] = [{"role": "user", "content": prompt}]
                question, selects = qa.question, [None] * len(group)
            outs = mem.query_batch(question, [(s, plans[a].mode) for s, a in zip(selects, group)], **kw)
            for name, ans in zip(group, outs):
                if first.relevance is not None and sorted(ans.served_ids) != sorted(plans[name].served):
                    raise EventKVError(
                        f"selector {first.relevance[0]!r} served another set for arm {name!r} when asked again with "
                        "the same question: a selector must rank deterministically; run with --order log."
                    )
                answers[name] = ans
                serve_ms[name] = round(ans.timings_ms["serve"], 3)
                readout_ms[name] = round(ans.timings_ms["decode"], 3)
                batch[name] = len(group)
        arms = {}
        row_bytes = self._kv_row_bytes(rt)
        for a in specs:
            if a.name not in answers:  # an empty served set: nothing to read out
                arms[a.name] = {"answer": "", "f1": 0.0, "em": False, "n_rows": header, "rows": 0, "fraction": 0.0}
                arms[a.name].update({"kv_bytes": header * row_bytes, "n_tokens": 0, "empty": True})
                continue
            ans = answers[a.name]
            answer = first_line(ans.text)
            score = score_answer(answer, qa.answer, qa.category)
            arms[a.name] = {
                "answer": answer,
                "f1": score.f1,
                "em": score.exact,
                "n_rows": ans.n_rows_served,
                "rows": ans.n_rows_served - header,
                "fraction": round((ans.n_rows_served - header) / history_rows, 6),
                "kv_bytes": ans.n_rows_served * row_bytes,
                "n_tokens": len(ans.generation.tokens),
            }
            if plans[a.name].relevance is not None:
                arms[a.name]["served_order"] = list(ans.served_ids)
            if candidates:
                margin = ans.candidates[0].logprob - ans.candidates[1].logprob
                arms[a.name]["abstain_margin"] = round(margin, 6)
                arms[a.name]["abstains"] = margin > 0
        return {
            **rec,
            "question": qa.question,
            "gold": qa.answer,
            "category": qa.category,
            "evidence": list(qa.evidence),
            "history_rows": history_rows,
            **({"choice": candidates} if candidates else {}),
            "selection": selection,
            "arms": arms,
            **({"timing": {"serve": serve_ms, "readout": readout_ms, "batch": batch}} if self.timing else {}),
        }

    def _groups(self, plans: dict[str, ArmPlan], n_rows: dict, history_rows: int, header: int) -> list[list[str]]:
        """The arm names in readout batches: arms with an empty served set left out; arms needing other
        serving keywords (positions, blend's recompute and schedule, the selector and budget of a set served
        in relevance order) apart; within those, :func:`length_groups` (``batch_arms=False``: one arm a batch)."""
        keyed: dict[tuple, list[str]] = {}
        for name, plan in plans.items():
            if plan.served != "all" and not plan.served:
                continue
            keyed.setdefault((plan.positions, plan.mode == "blend", plan.schedule, plan.relevance), []).append(name)
        out = []
        for names in keyed.values():
            if not self.batch_arms:
                out += [[n] for n in names]
                continue
            lengths = [
                header + (history_rows if plans[n].served == "all" else sum(n_rows[i] for i in plans[n].served))
                for n in names
            ]
            out += [[names[i] for i in g] for g in length_groups(lengths, self.max_padding)]
        return out

    # ------------------------------------------------------------------ statistics
    def summarize(self, records: Sequence[dict]) -> Summary:
        return summarize_memory_eval(records, self)

    def figure(self, records: Sequence[dict], path) -> None:
        from eventkv.probes.figures import pyplot, save_figure

        s = self.summarize(records).data
        plt = pyplot()
        fig, ax = plt.subplots(figsize=(7.5, 4.2))
        lines: dict[str, list[tuple[float, float]]] = {}
        for name, b in s["f1"].items():
            a = parse_arm(name)
            if b is None or a.budget is None:
                continue
            line = f"{a.kind}:{a.selector}" + ("/contiguous" if a.positions == "contiguous" else "")
            lines.setdefault(line, []).append((100 * a.budget, b["estimate"]))
        for line, pts in lines.items():
            pts.sort()
            style = "-" if line.startswith("rows") else "--"
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", label=line)
        for ref, colour in (("full", "black"), ("gold", "#d95f02")):
            if s["f1"].get(ref):
                ax.axhline(s["f1"][ref]["estimate"], color=colour, linestyle=":", label=ref)
        ax.set_xscale("log")
        budgets = sorted({x for pts in lines.values() for x, _ in pts})
        if budgets:  # the budgets as plain percentages, not matplotlib's log-scale 5x10^0
            ax.set_xticks(budgets, [f"{x:g}%" for x in budgets])
            ax.xaxis.set_minor_formatter(plt.NullFormatter())
        ax.set_xlabel("served fraction of the history's rows (%, header excluded)")
        ax.set_ylabel("token F1 (categories 1-4)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7, ncol=2)
        ax.set_title(
            f"memory eval: {_count(s['n_questions'], 'question')}, {_count(s['n_conversations'], 'conversation')}"
        )
        save_figure(fig, path)


def _with_ci(b) -> str:
    """``mean [low, high]`` of a cluster bootstrap; with one cluster there is no interval to give."""
    return "n/a" if b is None else b.interval(single="one conversation")


#: the bins of "F1 against the number of served turns": (fewest, most) turns, None: no upper bound
TURN_BINS: tuple[tuple[int, int | None], ...] = ((1, 5), (6, 10), (11, 20), (21, 40), (41, 80), (81, None))


def _served_turns(ids: Sequence[str]) -> list[str]:
    """The turns among served event ids: every id but the session headers' (``session-N``, as
    :func:`history_events` names them)."""
    return [i for i in ids if not i.startswith("session-")]


def _bin_label(low: int, high: int | None) -> str:
    return f"{low}+" if high is None else f"{low}-{high}"


def _f1_by_turns(pairs: Sequence[tuple[int, float]]) -> dict[str, dict]:
    """Mean F1 and count of ``(served turns, F1)`` pairs per :data:`TURN_BINS` bin, by label
    (``"1-5"``, ..., ``"81+"``), in bin order; a bin no pair falls in is left out, as are pairs with no turn."""
    out = {}
    for low, high in TURN_BINS:
        xs = [f for n, f in pairs if n >= low and (high is None or n <= high)]
        if xs:
            out[_bin_label(low, high)] = {"f1": float(np.mean(xs)), "n": len(xs)}
    return out


def _percentiles(xs: Sequence[float]) -> tuple[float, float]:
    p50, p95 = (float(x) for x in np.percentile(xs, [50, 95]))
    return p50, p95


def _arm_order(names) -> list[str]:
    """Arm names in table order: by budget (full and gold last), then rows before the control kinds."""
    kinds = {k: i for i, k in enumerate(ARM_KINDS)}
    first: dict[str, int] = {}
    for i, n in enumerate(names):
        first.setdefault(n, i)

    def key(n: str):
        a = parse_arm(n)
        return (a.budget is None, a.budget or 0, kinds.get(a.kind, 9), first[n])

    return sorted(first, key=key)


def summarize_memory_eval(records: Sequence[dict], probe: MemoryEval | None = None) -> Summary:
    """Tables (``docs/memory.md``): the headline, F1 / EM per arm (categories 1-4, cluster-bootstrap
    95% intervals; per category; category 5 apart), paired differences per budget (rows - text, rows -
    isolated, rows - blend for the controls, rows - full for every selector; with both positions
    modes, contiguous - original), cost per arm (rows, served fraction, KV bytes, latency p50/p95,
    tokens), evidence recall and precision and served turns per selector and budget (precision: the
    evidence turns served over the turns served, session headers not counted; over the questions with a
    turn served), and the rows arms' F1 against the number of turns served (:data:`TURN_BINS`; every rows
    arm pooled, and per positions mode when both are present; ``gold`` for reference)."""
    from eventkv.stats import cluster_bootstrap, cluster_bootstrap_ratio, format_p, wilcoxon_d, wilson

    done = [r for r in records if "arms" in r]
    main = [r for r in done if r["category"] in (1, 2, 3, 4)]
    adversarial = [r for r in done if r["category"] == 5]
    arms = _arm_order([a for r in done for a in r["arms"]])
    arms = [a for a in arms if all(a in r["arms"] for r in done)]
    specs = {a: parse_arm(a) for a in arms}
    clusters = [r["conversation"] for r in main]
    data: dict = {
        "n_questions": len(main),
        "n_adversarial": len(adversarial),
        "n_skipped": len(records) - len(done),
        "n_conversations": len(set(clusters)),
        "f1": {},
        "em": {},
        "paired": {},
        "abstention": {},
        "cost": {},
        "latency_ms": {},
        "recall": {},
        "precision": {},
        "served_turns": {},
        "f1_by_turns": {},
        "headline": None,
        "reach_text": {},
        "n_empty": {},
    }

    def f1s(a: str) -> list[float]:
        return [r["arms"][a]["f1"] for r in main]

    rows = []
    for a in arms:
        f1 = f1s(a)
        em = [float(r["arms"][a]["em"]) for r in main]
        b = cluster_bootstrap(f1, clusters) if f1 else None
        data["f1"][a] = b.__dict__ if b else None
        data["em"][a] = float(np.mean(em)) if em else None
        data["n_empty"][a] = sum(bool(r["arms"][a].get("empty")) for r in done)
        by_cat = []
        for c in (1, 2, 3, 4):
            xs = [r["arms"][a]["f1"] for r in main if r["category"] == c]
            by_cat.append(f"{np.mean(xs):.3f} ({len(xs)})" if xs else "n/a")
        adv = [r["arms"][a]["f1"] for r in adversarial]
        chose = [r["arms"][a]["abstains"] for r in adversarial if "abstains" in r["arms"][a]]
        if chose:
            w = wilson(sum(chose), len(chose))
            data["abstention"][a] = {"k": w.k, "n": w.n, "rate": w.rate, "low": w.low, "high": w.high}
        rows.append(
            [
                a,
                _with_ci(b),
                f"{np.mean(em):.3f}" if em else "n/a",
                *by_cat,
                f"{np.mean(adv):.3f} ({len(adv)})" if adv else "n/a",
                wilson(sum(chose), len(chose)).describe(2) if chose else "n/a",
            ]
        )
    f1_table = Table(
        "Token F1 by arm (categories 1-4; cluster bootstrap 95%, clusters = conversations)",
        [
            "arm",
            "F1 [95%]",
            "EM",
            *[f"{c} {CATEGORIES[c]} (n)" for c in (1, 2, 3, 4)],
            "5: answer abstains (n)",
            "5: chooses 'not mentioned' [Wilson 95%]",
        ],
        rows,
    )

    # ---- paired differences, per budget
    pairs: list[tuple[str, str]] = []
    for a, s in specs.items():
        if s.kind != "rows":
            continue
        for kind in CONTROL_KINDS:
            other = arm_spec(kind, s.selector, s.budget, s.positions).name
            if other in specs:
                pairs.append((a, other))
        if "full" in specs:
            pairs.append((a, "full"))
        if s.positions == "contiguous" and arm_spec("rows", s.selector, s.budget).name in specs:
            pairs.append((a, arm_spec("rows", s.selector, s.budget).name))
    paired_rows = []
    for a, other in pairs if main else []:
        diff = [x - y for x, y in zip(f1s(a), f1s(other))]
        b = cluster_bootstrap(diff, clusters)
        test = wilcoxon_d(diff, what=f"F1 {a} - {other}")
        better, worse = sum(x > 0 for x in diff), sum(x < 0 for x in diff)
        data["paired"][f"{a} - {other}"] = {
            **b.__dict__,
            "wilcoxon_p": test.p_value,
            "n_nonzero": test.counts["n"],
            "better": better,
            "worse": worse,
        }
        budget = specs[a].budget
        paired_rows.append(
            [
                budget_label(budget) if budget is not None else "",
                f"{a} - {other}",
                f"{b.estimate:+.3f}",
                "n/a" if b.n_clusters < 2 else f"[{b.low:+.3f}, {b.high:+.3f}]",
                f"{better}:{worse}",
                "n/a" if test.p_value != test.p_value else format_p(test.p_value),
                str(len(diff)),
            ]
        )

    # ---- cost
    cost_rows = []
    timed = [r for r in done if "serve" in r.get("timing", {})]
    for a in arms:
        n = [r["arms"][a]["rows"] for r in done]
        frac = [r["arms"][a]["fraction"] for r in done]
        kv = [r["arms"][a]["kv_bytes"] for r in done]
        toks = [r["arms"][a]["n_tokens"] for r in done]
        data["cost"][a] = {
            "rows": float(np.mean(n)),
            "fraction": float(np.mean(frac)),
            "kv_bytes": float(np.mean(kv)),
            "n_tokens": float(np.mean(toks)),
        }
        serve = [r["timing"]["serve"][a] for r in timed if a in r["timing"]["serve"]]
        readout = [r["timing"]["readout"][a] for r in timed if a in r["timing"]["readout"]]
        lat = ["", "", "", ""]
        if serve:
            s50, s95 = _percentiles(serve)
            r50, r95 = _percentiles(readout)
            data["latency_ms"][a] = {"serve_p50": s50, "serve_p95": s95, "readout_p50": r50, "readout_p95": r95}
            lat = [f"{s50:.0f}", f"{s95:.0f}", f"{r50:.0f}", f"{r95:.0f}"]
        cost_rows.append(
            [
                a,
                f"{np.mean(n):.0f}",
                f"{100 * np.mean(frac):.1f}%",
                f"{np.mean(kv) / 2**20:.2f}",
                *lat,
                f"{np.mean(toks):.1f}",
                str(len(done)),
            ]
        )

    # ---- evidence recall and precision of each selector's served sets
    recall_rows = []
    keys = list(dict.fromkeys(k for r in main for k in r.get("selection", {})))
    for key in keys:
        got = [r for r in main if key in r["selection"]]
        rec = [r["selection"][key]["recall"] for r in got]
        b = cluster_bootstrap(rec, [r["conversation"] for r in got])
        frac = [r["selection"][key]["rows"] / r["history_rows"] for r in got]
        data["recall"][key] = {**b.__dict__, "fraction": float(np.mean(frac))}
        turns = [(r, _served_turns(r["selection"][key]["ids"])) for r in got]
        served = [(r, t) for r, t in turns if t]  # precision of an empty set is undefined: left out
        prec = [len(set(t) & set(r["evidence"])) / len(t) for r, t in served]
        bp = cluster_bootstrap(prec, [r["conversation"] for r, _ in served]) if prec else None
        data["precision"][key] = bp.__dict__ if bp else None
        data["served_turns"][key] = float(np.mean([len(t) for _, t in turns]))
        selector, _, label = key.rpartition("@")
        recall_rows.append(
            [
                selector,
                label,
                _with_ci(b),
                _with_ci(bp) + ("" if len(prec) == len(rec) else f" (n={len(prec)})"),
                f"{data['served_turns'][key]:.1f}",
                f"{100 * np.mean(frac):.1f}%",
                str(len(rec)),
            ]
        )

    # ---- F1 of the rows arms against the number of turns their served set held
    by_mode: dict[str, list[tuple[int, float]]] = {}  # positions mode -> (served turns, F1) per question and arm
    for a, s in specs.items():
        if s.kind != "rows":
            continue
        key = f"{s.selector}@{budget_label(s.budget or 0)}"
        for r in main:
            if key in r.get("selection", {}):
                n_turns = len(_served_turns(r["selection"][key]["ids"]))
                by_mode.setdefault(s.positions, []).append((n_turns, r["arms"][a]["f1"]))
    pooled = [p for ps in by_mode.values() for p in ps]
    n_empty = sum(n == 0 for n, _ in pooled)
    data["f1_by_turns"] = {
        "all": _f1_by_turns(pooled),
        "positions": {m: _f1_by_turns(ps) for m, ps in by_mode.items()},
        "n_empty": n_empty,
        "gold": None,
    }
    turns_rows = [[label, f"{v['f1']:.3f}", str(v["n"])] for label, v in data["f1_by_turns"]["all"].items()]
    if turns_rows and "gold" in specs:
        gold_turns = [len(set(r["evidence"])) for r in main]
        gold = {"f1": float(np.mean(f1s("gold"))), "served_turns": float(np.mean(gold_turns)), "n": len(main)}
        data["f1_by_turns"]["gold"] = gold
        turns_rows.append(
            [f"gold (evidence: {gold['served_turns']:.1f} turns, mean)", f"{gold['f1']:.3f}", str(len(main))]
        )
    modes = [m for m in ("original", "contiguous") if m in by_mode]
    mode_rows = []
    if len(modes) == 2:
        per_mode = data["f1_by_turns"]["positions"]
        for low, high in TURN_BINS:
            label = _bin_label(low, high)
            cells = [per_mode[m].get(label) for m in modes]
            if any(cells):
                mode_rows.append([label, *(f"{c['f1']:.3f} ({c['n']})" if c else "" for c in cells)])

    # ---- headline: the best selector's rows at the headline budget, over full; where rows reach text
    headline_rows = []
    budgets = sorted({s.budget for s in specs.values() if s.kind == "rows" and s.budget is not None})
    if main and budgets:
        at = min(budgets, key=lambda b: (abs(b - HEADLINE_BUDGET), b))
        candidates = [a for a, s in specs.items() if s.kind == "rows" and s.budget == at]
        best = max(candidates, key=lambda a: (float(np.mean(f1s(a))), -arms.index(a)))
        line = [f"best rows at {budget_label(at)}", best, f"{np.mean(f1s(best)):.3f}"]
        if "full" in specs:
            ratio = cluster_bootstrap_ratio(f1s(best), f1s("full"), clusters)
            data["headline"] = {"arm": best, "budget": at, "f1": float(np.mean(f1s(best))), **ratio.__dict__}
            data["headline"]["full_f1"] = float(np.mean(f1s("full")))
            line.append(f"{data['headline']['full_f1']:.3f}")
            full_zero = data["headline"]["full_f1"] == 0
            line.append("n/a (full F1 is 0)" if full_zero else ratio.interval(single="one conversation"))
        else:
            data["headline"] = {"arm": best, "budget": at, "f1": float(np.mean(f1s(best)))}
            line += ["n/a", "n/a"]
        headline_rows.append(line)
    reach_rows = []
    for sel in dict.fromkeys(s.selector for s in specs.values() if s.kind == "text" and main):
        reached = None
        for bud in budgets:
            t_name = arm_spec("text", sel, bud).name
            r_name = next(
                (
                    n
                    for n in (arm_spec("rows", sel, bud).name, arm_spec("rows", sel, bud, "contiguous").name)
                    if n in specs
                ),
                "",
            )
            rows_f1 = np.mean(f1s(r_name)) if r_name else 0.0
            if r_name and t_name in specs and rows_f1 > 0 and rows_f1 >= np.mean(f1s(t_name)):  # 0 = 0 is no reach
                reached = bud
                break
        data["reach_text"][sel] = reached
        reach_rows.append(
            [f"rows reach text ({sel})", budget_label(reached) if reached else "at no budget", "", "", ""]
        )

    tables = []
    if headline_rows or reach_rows:
        tables.append(
            Table(
                "Headline: F1 of the best selector's rows at the budget nearest 10% as a fraction of full "
                "(ratio of means, cluster bootstrap 95%); the smallest budget at which rows' mean F1 reaches text's",
                ["", "arm / budget", "F1", "full F1", "rows / full [95%]"],
                headline_rows + reach_rows,
            )
        )
    tables.append(f1_table)
    if paired_rows:
        tables.append(
            Table(
                "Paired F1 differences per budget (same questions)",
                [
                    "budget",
                    "difference",
                    "mean",
                    "95% CI (cluster bootstrap)",
                    "better:worse",
                    "Wilcoxon p (questions)",
                    "n",
                ],
                paired_rows,
            )
        )
    batched = bool(timed) and any(max(r["timing"].get("batch", {"": 1}).values()) > 1 for r in timed)
    tables.append(
        Table(
            "Cost per arm (rows and served fraction: header excluded; KV: the served cache, header included; "
            "latency in ms, wall clock, the one global prefill excluded"
            + ("; arms read out in one batch share the readout time)" if batched else ")"),
            [
                "arm",
                "rows (mean)",
                "served fraction",
                "KV MiB (mean)",
                "serve p50",
                "serve p95",
                "readout p50",
                "readout p95",
                "tokens generated (mean)",
                "n",
            ],
            cost_rows,
        )
    )
    if recall_rows:
        tables.append(
            Table(
                "Evidence recall and precision of each selector's served set (recall: the fraction of the question's "
                "evidence turns served; precision: the fraction of the served turns that are evidence, session headers "
                "not counted, over the questions with a turn served; categories 1-4, cluster bootstrap 95%)",
                [
                    "selector",
                    "budget",
                    "recall [95%]",
                    "precision [95%]",
                    "served turns (mean)",
                    "served fraction (mean)",
                    "n",
                ],
                recall_rows,
            )
        )
    if turns_rows:
        tables.append(
            Table(
                "F1 against the number of served turns (session headers not counted): every rows arm of every "
                "selector and budget"
                + (" and both positions modes" if len(modes) == 2 else "")
                + " pooled, one value per question and arm (categories 1-4)"
                + (f"; {_count(n_empty, 'empty served set')} left out" if n_empty else "")
                + ("; gold: the evidence turns as text, for reference" if data["f1_by_turns"]["gold"] else ""),
                ["served turns", "F1 (mean)", "n"],
                turns_rows,
            )
        )
    if mode_rows:
        tables.append(
            Table(
                "F1 against the number of served turns, per positions mode (rows arms of every selector and budget "
                "pooled; F1 mean (n))",
                ["served turns", *modes],
                mode_rows,
            )
        )
    data["batched_readout"] = batched
    n_conv = data["n_conversations"]
    title = (
        f"memory-eval: {_count(len(main), 'question')} (categories 1-4) from {_count(n_conv, 'conversation')}"
        + (f", {len(adversarial)} adversarial" if adversarial else "")
        + (f", {data['n_skipped']} slots skipped" if data["n_skipped"] else "")
    )
    notes = [
        "rows:S@B: selector S's served set at budget B (a fraction of the history's rows, header excluded) served "
        "as its stored rows; text / isolated / blend: the same set re-prefilled as text / each event encoded alone / "
        "rows with a fraction recomputed; /contiguous: served at contiguous positions; full: every stored row; "
        "gold: the evidence turns as text.",
        "F1 and EM: LoCoMo's token F1 after its answer normalization (eventkv.memory.metrics), by the data's "
        "integer category.",
        "Category 5 (adversarial): 'answer abstains' scores the generated answer by LoCoMo's keyword rule; "
        "'chooses' is LoCoMo's forced choice between 'Not mentioned in the conversation' and the adversarial "
        "answer, by log-probability. Both apart from the F1 of categories 1-4.",
        "Wilcoxon p treats the questions as independent (zero differences dropped); the cluster bootstrap "
        f"resamples the {_count(n_conv, 'conversation')}. Neither corrects for the number of comparisons.",
    ]
    if probe is not None and probe.order == "relevance":
        notes.append(
            "Order relevance: the text and /contiguous arms serve their turns in increasing selector score (each "
            "turn's unit, its neighbours and session header, one block; the best-ranked last before the question); "
            "full, gold and the arms at original positions in history order."
        )
    empty = {a: n for a, n in data["n_empty"].items() if n}
    if empty:
        notes.append(
            "Served sets left empty by their budget (scored F1 0, nothing read out): "
            + ", ".join(f"{a} {n}" for a, n in empty.items())
            + "."
        )
    if 1 < n_conv < 5:
        notes.append(
            f"With {n_conv} conversations the cluster bootstrap draws from only {n_conv**n_conv} ordered "
            "resamples of whole conversations: its intervals show the spread between these conversations, not a "
            "95% interval for the population of dialogues; evaluate more conversations for that."
        )
    return Summary(title, tables, notes=notes, data=data)


DATASET_TEXT = ("question", "gold", "choice")
"""Record fields that quote the dialogue data (LoCoMo's questions, answers, forced-choice options);
with each arm's ``answer`` (the model's reply, which often quotes the conversation) they are what
:func:`redact_run` drops. Every statistic of the summary is computed without them."""


def redact_run(source: str | Path, dest: str | Path) -> int:
    """Copy the run folder ``source`` into ``dest`` without the dataset's text: its ``manifest.json`` and
    each record of ``records.jsonl`` less :data:`DATASET_TEXT` and the arms' answers (scores, rows, KV
    bytes, timings, served ids and evidence ids kept). LoCoMo's licence (CC BY-NC 4.0) lets its text be
    read, not redistributed: the redacted folder can be shared or committed, reported
    (``eventkv report DEST``) and resumed (the same ``eventkv memory eval`` command with ``--out DEST``
    computes only the items it lacks; the memories are prefilled again). A record cut short by a kill
    is left out. Returns the number of records written.

    Raises:
        EventKVError: ``source`` is not a run folder (no ``manifest.json``), ``dest`` is ``source``, or
            ``dest`` already holds records.
    """
    from eventkv.errors import EventKVError
    from eventkv.files import fsync_path
    from eventkv.probes.runner import RECORDS, RUN_MANIFEST, load_records

    src, dst = Path(source), Path(dest)
    if not (src / RUN_MANIFEST).is_file():
        raise EventKVError(f"{str(src)!r} is not a run folder (no {RUN_MANIFEST}): give the --out of a memory eval.")
    if dst.resolve() == src.resolve():
        raise EventKVError(f"{str(dst)!r} is the run folder itself: give another destination to redact into.")
    if (dst / RECORDS).is_file() and (dst / RECORDS).stat().st_size:
        raise EventKVError(f"{str(dst)!r} already holds {RECORDS}: give a new or empty destination.")
    dst.mkdir(parents=True, exist_ok=True)
    lines = []
    for rec in load_records(src):
        out = {k: v for k, v in rec.items() if k not in DATASET_TEXT}
        if "arms" in out:
            out["arms"] = {n: {k: v for k, v in arm.items() if k != "answer"} for n, arm in out["arms"].items()}
        lines.append(json.dumps(out) + "\n")
    tmp = dst / f".{RECORDS}.tmp"
    tmp.write_text("".join(lines))
    fsync_path(tmp)
    shutil.copyfile(src / RUN_MANIFEST, dst / RUN_MANIFEST)
    fsync_path(dst / RUN_MANIFEST)
    tmp.replace(dst / RECORDS)
    fsync_path(dst)
    return len(lines)
