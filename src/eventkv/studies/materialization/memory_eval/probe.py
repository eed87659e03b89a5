"""The probe of ``eventkv memory eval`` (:mod:`eventkv.studies.materialization.memory_eval`): its options, the
arm grid of a question, the memories kept under the run folder, and each question's record from its arms'
batched readouts (:class:`MemoryEval`)."""

from __future__ import annotations

import random
import sys
import tempfile
from dataclasses import InitVar, dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any, ClassVar, Sequence, cast

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.quant import check_row_format
from eventkv.kv.serve import SERVE_ORDERS, PositionMode, ServeMode
from eventkv.memory.answer import answer_prepared
from eventkv.memory.query import MemoryQuery, QueryOptions
from eventkv.options import (
    DIALOGUE_FORMATS,
    SELECTORS,
    check_choices,
    check_int,
    check_max_new_tokens,
    check_optional_int,
    is_int,
)
from eventkv.probes.base import Arm, Probe, Runtime, Summary
from eventkv.studies.materialization.dialogue_data import DialogueData
from eventkv.studies.materialization.memory_eval.arms import (
    ARM_KINDS,
    BLEND_SCHEDULE,
    CONTROL_KINDS,
    DEFAULT_BUDGETS,
    DEFAULT_KINDS,
    FUSED,
    POSITIONED,
    POSITIONS,
    SELECTOR_ORDER,
    SERVE_MODE,
    ArmPlan,
    ArmSpec,
    arm_spec,
    budget_label,
    length_groups,
)
from eventkv.studies.materialization.memory_eval.history import (
    CATEGORIES,
    HEADED_INSTRUCTION,
    INSTRUCTION,
    NOT_MENTIONED,
    first_line,
    history_events,
    open_history,
    question_prompt,
    served_set,
)
from eventkv.studies.materialization.memory_eval.summary import memory_eval_figure, summarize_memory_eval

#: positions kept free after the history for the question and its answer (the context check)
QUESTION_ROOM = 256
#: a tiny LoCoMo-format file of invented dialogue shipped with eventkv (smoke tests, a first try)
DEMO_DATA = str(files("eventkv") / "data" / "locomo-demo.json")


@dataclass
class _History:
    conv: Any
    sessions: list
    n_tokens: int  # header + events


@dataclass
class MemoryEval(DialogueData, Probe):
    """Options (all part of a run's identity): ``data`` (LoCoMo JSON path) and its ``data_digest`` (sha256, filled
    in when empty), ``conversations``, ``questions_per_conversation``, ``max_tokens`` (history tokens per
    conversation; 0 = the whole conversation), ``selectors`` (names in :data:`eventkv.options.SELECTORS`; empty =
    every registered one), ``budgets`` (fractions of the history's rows, header excluded), ``controls`` (the
    selectors whose served sets also get the text / isolated / blend arms; empty = ``"hybrid"`` when listed, else
    the first selector), ``positions`` (``contiguous`` (default) | ``original`` | ``both``), ``order``
    (``relevance`` (default) | ``log``: the order the text arms and the ``/contiguous`` arms serve their sets in;
    the package docstring), ``neighbours``, ``with_headers`` (default on, the memory's default plan: a header event
    before each session, the turns undated; off: the date in every turn), ``resolve_dates`` (default on, as the
    memory stores a dated event: each relative date expression of a turn followed by the date it means against its
    session's date, :func:`eventkv.memory.dates.resolve_relative_dates`; the turns kept by ``max_tokens`` are the
    same either way), ``prefill_window`` (the positions each prefill forward of a memory spans at most: header +
    recent rows + new tokens, so a row past it is computed with only the header and the rows just before it in
    view, :class:`eventkv.kv.windowed.PrefillWindow`; None, the default: the model's context, one global prefill
    where the history fits; left out of the run's identity when None),
    ``categories`` (LoCoMo categories the questions are drawn from; empty = every category), ``rows`` (the memories'
    row format, :data:`eventkv.kv.quant.ROW_FORMATS`; ``kv_bytes`` stays the served rows' native bytes), ``k`` (at
    most ``k`` events ranked per served set besides the budget; None = fill to the budget), ``recompute`` (the blend
    arm's fraction; None = the serve mode's default), ``max_new_tokens``, ``arm_names`` (the arm kinds,
    :data:`ARM_KINDS`), ``batch_arms``, ``max_padding`` (:func:`length_groups`), ``timing`` (record wall-clock
    latencies; off, records depend only on the seed and index).

    Record (version 4), one per question: ``index``, ``conversation``, ``slot``, ``question``,
    ``gold``, ``category``, ``evidence``, ``history_rows`` (header excluded), ``choice`` (category 5),
    ``selection`` (per ``"<selector>@<budget>"``: ``ids``, ``rows``, ``recall`` = the fraction of the
    evidence ids served), ``arms`` (per arm name: ``answer``, ``f1``, ``em``, ``n_rows`` (the served
    cache's rows, header included), ``rows`` (header excluded), ``fraction`` (rows / history_rows),
    ``kv_bytes`` (n_rows x layers x 2 x kv_heads x head_dim x dtype bytes), ``n_tokens``, ``positions``
    (where the rows were served, ``original`` or ``contiguous``, as the answer's plan records it), ``empty``
    (true when the served set was empty: f1 0, nothing read out), ``served_order`` (an arm served in
    relevance order only: the served event ids in the order their rows were laid out), category 5:
    ``abstain_margin``, ``abstains``) and ``timing`` (``serve``, ``readout`` in ms and ``batch``, the readout
    batch's size, per arm); a skipped slot: ``skipped`` with the reason."""

    name: ClassVar[str] = "memory-eval"
    #: 8: the question asks for a few words, not a complete sentence (:data:`QUESTION`), as LoCoMo's own evaluation
    #: does; 7: a question's arms that need different serving keywords (positions, blend's schedule) share one batched
    #: readout (6 read each key's arms out apart), so greedy answers move by float rounding; 6: an int8/int4 memory
    #: quantizes the values of every row after the header. A folder of another version does not resume
    record_version: ClassVar[int] = 8
    smoke_options: ClassVar[dict] = {
        "data": DEMO_DATA,
        "conversations": 1,
        "questions_per_conversation": 2,
        "max_tokens": 400,
        "budgets": (0.5,),
        "max_new_tokens": 3,
        "timing": False,
        # relevance order reads the prompt as a chat message, which the registry test's stand-in profile (no chat
        # scaffold) cannot render; tests/test_memory_eval.py runs it on a whole profile
        "order": "log",
    }

    conversations: int = 2
    questions_per_conversation: int = 30
    max_tokens: int = 4000
    selectors: tuple[str, ...] = ()
    budgets: tuple[float, ...] = DEFAULT_BUDGETS
    controls: tuple[str, ...] = ()
    positions: str = "contiguous"
    order: str = "relevance"
    neighbours: int = 0
    with_headers: bool = True
    resolve_dates: bool = True
    prefill_window: int | None = None
    categories: tuple[int, ...] = ()
    rows: str = "native"
    k: int | None = None
    recompute: float | None = None
    max_new_tokens: int = 24
    arm_names: tuple[str, ...] = DEFAULT_KINDS
    batch_arms: bool = True
    max_padding: float = 0.5
    timing: bool = True
    #: built to read records only (:meth:`for_records`): the data file is not opened
    records_only: InitVar[bool] = False

    def __post_init__(self, records_only: bool = False) -> None:
        self._records_only = records_only
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
        self.categories = tuple(self.categories)
        self._open: tuple[int, Any] | None = None
        self._histories: dict[int, _History] = {}
        self._loaded: list | None = None
        self._run_dir: Path | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._row_bytes: int | None = None
        self.validate()

    @classmethod
    def for_records(cls, options: dict) -> MemoryEval:
        """The probe of a run's recorded options, to summarize and draw its records without the LoCoMo file
        (its summary reads the records alone): a redacted or copied run folder reports anywhere."""
        return cls(**options, records_only=True)

    # ------------------------------------------------------------------ options
    def validate(self) -> None:
        if not self.data:
            raise OptionError("data", self.data, "give the LoCoMo JSON file (e.g. locomo10.json).", flag="--data")
        if not self._records_only:
            self._check_data()
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
        check_row_format(self.rows)
        if not isinstance(self.resolve_dates, bool):
            raise OptionError("resolve_dates", self.resolve_dates, "give true or false.")
        check_optional_int(
            "prefill_window",
            self.prefill_window,
            "give the prefill window as a whole number of positions >= 2, or leave it out (the model's context).",
            minimum=2,
            flag="--prefill-window",
        )
        if len(set(self.categories)) != len(self.categories) or not all(
            is_int(c) and c in CATEGORIES for c in self.categories
        ):
            raise OptionError(
                "categories",
                self.categories,
                f"give distinct LoCoMo categories among {', '.join(map(str, CATEGORIES))} (e.g. 2 for temporal), "
                "or none for every category.",
                flag="--categories",
            )
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

    def _check_data(self) -> None:
        """The data file exists, its digest is pinned, and it holds the conversations asked for."""
        path = Path(self.data)
        if not path.is_file():
            raise OptionError("data", self.data, "no such file: give the path of a LoCoMo JSON file.", flag="--data")
        self.pin_data_digest(path)
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
        if self.prefill_window is not None and self.prefill_window > ctx:
            raise OptionError(
                "prefill_window",
                self.prefill_window,
                f"the model's context is {ctx} positions: give a prefill window of at most {ctx}.",
                flag="--prefill-window",
            )
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

    def options(self) -> dict:
        # an option at its default of None stays out of the identity, so folders made before it existed resume
        return {k: v for k, v in super().options().items() if not (k == "prefill_window" and v is None)}

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
            from eventkv.kv.log import Event
            from eventkv.models.encoding import encode
            from eventkv.studies.materialization.dialogue import truncate

            conv = self._conversations()[c]
            conv = truncate(conv, rt.tokenizer, self.max_tokens or sys.maxsize)  # 0: every turn
            sessions = history_events(conv, self.with_headers, self.resolve_dates)
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
            mem = open_history(
                self._store_root() / f"c{c}",
                lm,
                self.instruction(),
                h.sessions,
                rows=self.rows,
                window=self.prefill_window,
            )
            questions = [q for q in h.conv.questions if not self.categories or q.category in self.categories]
            random.Random(f"memory-eval:{seed}:{c}").shuffle(questions)
            self._open = (c, (h, mem, questions[: self.questions_per_conversation]))
        return self._open[1]

    def _kv_row_bytes(self, rt: Runtime) -> int:
        """Bytes of one stored row over every layer: layers x 2 (K, V) x kv_heads x head_dim x dtype bytes."""
        if self._row_bytes is None:
            from eventkv.models.introspect import profile_for

            self._row_bytes = profile_for(rt.model, None, "kv rows").kv_row_bytes
        return self._row_bytes

    def run_item(self, rt: Runtime, item: dict) -> dict:
        from eventkv.studies.materialization.answer_metric import score_answer

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
        for readout in self._readouts(plans, n_rows, history_rows, header):
            # each serving key's arms served as one query, every query of the readout read out in one batch
            prepared = [mem.prepare_query(self._query(qa, prompt, candidates, plans, group)) for group in readout]
            for group, outs in zip(readout, answer_prepared(mem.lm, prepared)):
                for name, ans in zip(group, outs):
                    relevance = plans[name].relevance
                    if relevance is not None and sorted(ans.served_ids) != sorted(plans[name].served):
                        raise EventKVError(
                            f"selector {relevance[0]!r} served another set for arm {name!r} when asked again with "
                            "the same question: a selector must rank deterministically; run with --order log."
                        )
                    answers[name] = ans
                    serve_ms[name] = round(ans.timings_ms["serve"], 3)
                    readout_ms[name] = round(ans.timings_ms["decode"], 3)
                    batch[name] = sum(len(g) for g in readout)
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
                "positions": ans.plan["positions"],
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

    def _query(self, qa, prompt: str, candidates, plans: dict[str, ArmPlan], group: list[str]) -> MemoryQuery:
        """The arms ``group`` of a question, which share one serving key (:meth:`_readouts`), as one query."""
        first = plans[group[0]]
        # the arm's positions, always given: the memory's default is not the arm's
        options = QueryOptions(positions=cast(PositionMode, first.positions))
        if first.mode == "blend" and self.recompute is not None:
            options = options.with_(recompute=self.recompute)
        if first.schedule is not None:
            options = options.with_(blend_schedule=first.schedule)
        selects: list[list[str] | str | None]
        question, selects, messages = prompt, [plans[a].served for a in group], None
        if first.relevance is not None:
            # the memory selects the set again, as served_set did (same question, selector and shaping), so
            # each shaping unit (a turn with its neighbours), or with headers each session's served turns, is
            # laid out as one block at its best turn's rank (relevance_order); the question selects and ranks,
            # the prompt is read as the one user message (the same token ids as question=prompt:
            # eventkv.memory.chat.chat_tail_ids)
            selector, budget = first.relevance
            options = options.with_(
                order="relevance",
                selector=selector,
                budget=budget,
                k=self.k,
                neighbours=self.neighbours,
                with_headers=self.with_headers,
            )
            messages = [{"role": "user", "content": prompt}]
            question, selects = qa.question, [None] * len(group)
        return MemoryQuery(
            question,
            plans=[(s, cast(ServeMode, plans[a].mode)) for s, a in zip(selects, group)],
            options=options,
            candidates=candidates,
            max_new_tokens=self.max_new_tokens,
            messages=messages,
        )

    def _readouts(
        self, plans: dict[str, ArmPlan], n_rows: dict, history_rows: int, header: int
    ) -> list[list[list[str]]]:
        """The arm names of a question in readouts: arms with an empty served set left out; the others in batches by
        length (:func:`length_groups` over every arm; ``batch_arms=False``: one arm a readout), each split by the
        serving keywords its arms need (positions, blend's recompute and schedule, the selector and budget of a set
        served in relevance order) into groups served as one query each; a readout's queries are read out in one
        batch (:func:`eventkv.memory.answer_prepared`)."""
        names = [n for n, p in plans.items() if p.served == "all" or p.served]
        if not self.batch_arms:
            return [[[n]] for n in names]
        lengths = [
            header + (history_rows if plans[n].served == "all" else sum(n_rows[i] for i in plans[n].served))
            for n in names
        ]
        out = []
        for g in length_groups(lengths, self.max_padding):
            keyed: dict[tuple, list[str]] = {}
            for i in g:
                p = plans[names[i]]
                keyed.setdefault((p.positions, p.mode == "blend", p.schedule, p.relevance), []).append(names[i])
            out.append(list(keyed.values()))
        return out

    # ------------------------------------------------------------------ statistics
    def summarize(self, records: Sequence[dict]) -> Summary:
        return summarize_memory_eval(records, self)

    def figure(self, records: Sequence[dict], path) -> None:
        memory_eval_figure(self.summarize(records).data, path)
