"""``eventkv memory eval``: EventMemory on real multi-session dialogue (LoCoMo), measured as an
agent-memory user asks (PROTOCOLS.md, "The memory, measured as its users would"): at what fraction
of the history's rows does the memory answer like the whole history, and is serving stored rows
better than re-prefilling the retrieved turns as text?

**History.** Each conversation, whole (``max_tokens=0``) or truncated to its first ``max_tokens``
tokens of turns (:func:`eventkv.studies.materialization.dialogue.truncate`: each turn counted as its dated event;
only the questions whose evidence lies inside are kept), becomes one
:class:`~eventkv.memory.EventMemory`, prefilled once, session by session (each session's events are
one ``add(..., prefill=True)``). Events: one per turn, ``"[session 3, 1:56 pm on 8 May, 2023]
Caroline: text"``; with ``with_headers``, one header event per session (tagged ``"header"``, text
:func:`eventkv.studies.materialization.dialogue.session_header_text`, carrying the session's date) before its turns,
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
  ``recompute``), when ``arm_names`` includes ``blend``; ``blend-layerwise``, ``blend-epic`` and ``blend-suffix``
  the same under the ``layerwise``, ``epic`` and ``suffix`` recompute schedules (``blend_schedule``,
  :mod:`eventkv.kv.blend`);
* ``full`` — every stored row; ``gold`` — the evidence turns (and their session headers) as text.

A positioned arm (rows, isolated, blend) served in contiguous positions carries the suffix
``/contiguous`` (``rows:bm25@5%/contiguous``). With ``order="relevance"`` the text arms and the
``/contiguous`` arms serve their set as :meth:`EventMemory.query` with ``order="relevance"`` serves
it (selected again by the arm's selector at its budget, each shaping unit one block at its event's
rank, with session headers each session's served turns one block after its header, the best-ranked
last before the question); ``full``, ``gold`` and arms at original positions
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
(:mod:`eventkv.studies.materialization.answer_metric`), by the data's integer category 1-4; category 5 apart. Statistics
(:func:`summarize_memory_eval`): see ``docs/memory.md`` for the tables.

Item ``i`` is question slot ``i % Q`` of conversation ``i // Q`` (``Q`` questions per
conversation, drawn with the seed from the conversation's eligible questions); a conversation
with fewer eligible questions records the missing slots as ``skipped``.

The package, by job (every name is re-exported here):

* :mod:`.arms` — the arm kinds, budgets and names (:class:`ArmSpec`, :func:`arm_spec`, :func:`parse_arm`,
  :func:`parse_budget`, :func:`budget_label`), how an arm is served (:class:`ArmPlan`) and the readout
  batches (:func:`length_groups`);
* :mod:`.history` — a conversation's events and memory (:func:`history_events`, :func:`open_history`),
  a selector's served set (:func:`served_set`) and the question as asked (:func:`question_prompt`);
* :mod:`.probe` — the probe (:class:`MemoryEval`): options, arm grid, memories, records;
* :mod:`.summary` — the statistics and tables (:func:`summarize_memory_eval`) and the figure;
* :mod:`.redact` — a run folder without the dataset's text (:func:`redact_run`).
"""

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
    parse_arm,
    parse_budget,
)
from eventkv.studies.materialization.memory_eval.history import (
    CATEGORIES,
    HEADED_INSTRUCTION,
    INSTRUCTION,
    NOT_MENTIONED,
    QUESTION,
    TEMPORAL_SUFFIX,
    first_line,
    history_events,
    open_history,
    question_prompt,
    served_set,
)
from eventkv.studies.materialization.memory_eval.probe import DEMO_DATA, QUESTION_ROOM, MemoryEval
from eventkv.studies.materialization.memory_eval.redact import DATASET_TEXT, redact_run
from eventkv.studies.materialization.memory_eval.summary import (
    HEADLINE_BUDGET,
    TURN_BINS,
    memory_eval_figure,
    summarize_memory_eval,
)

__all__ = [
    "ARM_KINDS",
    "BLEND_SCHEDULE",
    "CATEGORIES",
    "CONTROL_KINDS",
    "DATASET_TEXT",
    "DEFAULT_BUDGETS",
    "DEFAULT_KINDS",
    "DEMO_DATA",
    "FUSED",
    "HEADED_INSTRUCTION",
    "HEADLINE_BUDGET",
    "INSTRUCTION",
    "NOT_MENTIONED",
    "POSITIONED",
    "POSITIONS",
    "QUESTION",
    "QUESTION_ROOM",
    "SELECTOR_ORDER",
    "SERVE_MODE",
    "TEMPORAL_SUFFIX",
    "TURN_BINS",
    "ArmPlan",
    "ArmSpec",
    "MemoryEval",
    "arm_spec",
    "budget_label",
    "first_line",
    "history_events",
    "length_groups",
    "memory_eval_figure",
    "open_history",
    "parse_arm",
    "parse_budget",
    "question_prompt",
    "redact_run",
    "served_set",
    "summarize_memory_eval",
]
