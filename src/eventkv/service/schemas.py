"""The service's request and response bodies: pydantic models with field limits,
so a body out of bounds is a 422 before any work is queued. Responses mirror the library's records
(:mod:`eventkv.memory.records`) field for field."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StringConstraints

from eventkv.kv.blend import BlendSchedule
from eventkv.kv.quant import RowFormat
from eventkv.memory.query import MemoryQuery, QueryOptions
from eventkv.memory.records import Added, Hit, MemoryAnswer, MemoryRecord, MemoryStats
from eventkv.options import CARRIER_KINDS, SELECTORS
from eventkv.wire import MAX_NAME, NAME_PATTERN

MAX_TEXT = 32_000  # characters of one event's text or one question
MAX_EVENTS = 512  # events in one batch add
MAX_ID = 200  # characters of an event id
Name = Annotated[str, StringConstraints(pattern=NAME_PATTERN, max_length=MAX_NAME)]
Text = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TEXT, pattern=r"\S")]  # not blank
#: an event id travels in URL paths: no ``/`` (no URL could name it) and no NUL
EventId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID, pattern=r"^[^/\x00]+$")]
Tag = Annotated[str, StringConstraints(min_length=1, max_length=100)]


def pydantic_rule(error: dict) -> str:
    """The rule one pydantic error states, in the library's wording: its message with only its first
    letter lowered (``Input should be ...`` -> ``input should be ...``; a pattern such as ``\\S`` or
    a name such as ``JSON`` keeps its case) and no final period."""
    msg = str(error.get("msg", "")).rstrip(".")
    return msg[:1].lower() + msg[1:] if msg[1:2].islower() else msg


def json_invalid(error: dict) -> str | None:
    """The message of a request body that is not JSON (FastAPI's ``json_invalid`` error, located at a
    character of the body rather than at a field), without a final period; None for any other error."""
    if error.get("type") != "json_invalid":
        return None
    char = next((x for x in error.get("loc", ()) if isinstance(x, int)), None)
    at = f" at character {char}" if char is not None else ""
    why = (error.get("ctx") or {}).get("error") or pydantic_rule(error)
    return f"the body is not valid JSON{at}: {why}; send a JSON object"


def _whole(value: object) -> object:
    """A float with no fractional part as an int: JSON Schema's ``integer`` includes ``3.0``, and a
    client that sends it means 3; strings and booleans still fail the strict int check."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Whole numbers within pydantic's ``ge``/``le`` limits, as JSON Schema's ``integer``: ``3`` or ``3.0``, never
# ``"3"`` or ``true``. (The limits come before the validator, so the schema shows them as ``minimum``/``maximum``.)
_WHOLE = BeforeValidator(_whole)
Version = Annotated[
    int,
    Field(ge=0),
    _WHOLE,
    Field(description="the memory's version this write expects (409 when it moved on)"),
]
Budget = Annotated[int, Field(ge=1, le=1_000_000), _WHOLE]  # rows of one event's budget
TopK = Annotated[int, Field(ge=1, le=10_000), _WHOLE]  # events selected
When = Annotated[str, StringConstraints(min_length=1, max_length=100)]  # a date string, read by dateparser
BudgetRows = Annotated[int, Field(ge=1), _WHOLE]  # rows of the served set
MaxNewTokens = Annotated[int, Field(ge=1, le=4096), _WHOLE]
Neighbours = Annotated[int, Field(ge=0, le=10_000), _WHOLE]  # events served on each side of a chosen one
BudgetFraction = Annotated[float, Field(gt=0, le=1)]  # of the view's rows, header excluded
if TYPE_CHECKING:
    CarrierKind = str  # the registry's names are known only at import
    SelectorName = str
else:
    CarrierKind = Literal[("auto", *CARRIER_KINDS.names())]
    SelectorName = Literal[SELECTORS.names()]  # a name only: a Selector object does not travel


class _Body(BaseModel):
    # strict: "3" is not a number, 1 is not a boolean (as the event files' schema)
    model_config = ConfigDict(extra="forbid", strict=True)


class CreateMemory(_Body):
    id: Name | None = Field(None, description="memory id (default: generated)")
    namespace: Name | None = Field(None, description="must equal the request's namespace when given")
    model: str | None = Field(None, max_length=500, description="when given, must name the served model")
    instruction: str | None = Field(None, max_length=MAX_TEXT)
    contract: dict | None = Field(None, description="the model's contract.json (for carrier kind='auto')")
    rows: RowFormat = Field(
        "native",
        description="the format the memory stores its rows in, for its life: native (the model's rows), int8 or "
        "int4 (quantized as KIVI lays rows out: keys per channel, values per token; docs/memory.md, Row formats)",
    )


class EventIn(_Body):
    text: Text
    role: Annotated[str, StringConstraints(min_length=1, max_length=100)] | None = None
    id: EventId | None = None
    tags: list[Tag] = Field(default_factory=list, max_length=64)
    budget: Budget | None = None
    kind: Literal["event", "carrier"] = "event"
    when: When | None = Field(
        None, description="when the event happened (e.g. '2023-05-08'): stored as '[8 May 2023] text', dates resolved"
    )


class AddEvents(_Body):
    events: list[EventIn] = Field(min_length=1, max_length=MAX_EVENTS)
    prefill: bool = False
    expected_version: Version | None = None


class Write(_Body):
    expected_version: Version | None = None


class UpdateEvent(Write):
    text: Text
    prefill: bool = False
    when: When | None = Field(
        None, description="when the change happened: the patch is stored dated, as an added event"
    )


class PinEvent(Write):
    pinned: bool = True


class CarrierIn(Write):
    sources: list[EventId] = Field(min_length=1, max_length=64)
    subject: Text
    kind: CarrierKind = "auto"
    prefill: bool = False


class Shaping(_Body):
    """The served set's selection and shaping (``EventMemory.select``'s keywords; docs/memory.md)."""

    k: TopK | None = Field(
        None, description="at most this many ranked events; null: fill the budget (none given: the default budget)"
    )
    budget_rows: BudgetRows | None = Field(None, description="rows of the served events, header excluded")
    selector: SelectorName | None = Field(None, description="a registered selector (null: the memory's)")
    budget: BudgetFraction | None = Field(None, description="the budget as a fraction of the view's rows")
    neighbours: Neighbours = Field(0, description="events served on each side of every chosen one")
    with_headers: bool = Field(True, description="serve the group header (tag 'header') of every served event")

    def options(self, **serving: Any) -> QueryOptions:
        """The body's shaping, with ``serving`` (mode, positions, order, ...), as the memory's one options
        type (:class:`eventkv.memory.query.QueryOptions`)."""
        return QueryOptions(
            k=self.k,
            budget_rows=self.budget_rows,
            selector=self.selector,
            budget=self.budget,
            neighbours=self.neighbours,
            with_headers=self.with_headers,
            **serving,
        )


class SelectIn(Shaping):
    question: Text


class SearchIn(Shaping):
    """A search: the served set's events ranked with their scores (``EventMemory.search``)."""

    query: Text = Field(description="the question or search text")


class QueryIn(Shaping):
    question: Text
    select: Literal["all", "view"] | list[EventId] | None = Field(None, max_length=10_000)
    mode: Literal["compact", "native", "isolated", "text", "blend"] = "compact"
    candidates: list[Annotated[str, StringConstraints(min_length=1, max_length=2_000)]] | None = Field(
        None, max_length=64, json_schema_extra={"uniqueItems": True}
    )
    max_new_tokens: MaxNewTokens = 32
    # serving positions (eventkv.kv.serve): "contiguous" re-rotates the served rows right after the header;
    # null: the memory's default (eventkv.kv.serve.default_positions), recorded in the answer's plan
    positions: Literal["original", "contiguous"] | None = None
    # the served rows' order under contiguous positions: "relevance" puts the most relevant event last; null:
    # relevance for a selector's choice at contiguous positions, else log, recorded in the answer's plan
    order: Literal["log", "relevance"] | None = None
    # selective recompute (mode "blend")
    recompute: float | None = Field(
        None, ge=0.0, le=1.0, description="mode 'blend': the fraction of served tokens recomputed (None: 0.15)"
    )
    blend_schedule: BlendSchedule | None = Field(
        None,
        description="mode 'blend': which tokens are recomputed on which layer: once (None: the default), layerwise "
        "(CacheBlend's gradual filtering), epic (the first tokens of each served event) or suffix (the last served "
        "tokens, nearest the query)",
    )

    def query(self) -> MemoryQuery:
        """The body as the memory's query (:class:`eventkv.memory.query.MemoryQuery`)."""
        serving = dict(
            mode=self.mode,
            positions=self.positions,
            order=self.order,
            recompute=self.recompute,
            blend_schedule=self.blend_schedule,
        )
        return MemoryQuery(
            self.question,
            select=self.select,
            options=self.options(**serving),
            candidates=self.candidates,
            max_new_tokens=self.max_new_tokens,
        )


# ---------------------------------------------------------------------- responses
# The library's record dataclasses are the response schemas (pydantic validates stdlib dataclasses):
# one definition of an event record, an acknowledgement and the counts, in the library and over HTTP.
AddedOut = Added
RecordOut = MemoryRecord
StatsOut = MemoryStats
HitOut = Hit


class MemoryOut(BaseModel):
    id: str
    namespace: str
    model: str
    instruction: str
    rows: str = Field(description="the row format of its store: native, int8 or int4")
    version: int
    stats: StatsOut


class DamagedMemoryOut(BaseModel):
    """A memory of the namespace whose store fails its checks (``GET /v1/memories`` lists it instead of
    failing the whole listing; every route of that memory answers 409 ``damaged``)."""

    id: str
    namespace: str
    damaged: str = Field(description="what is damaged and how to recover (as the 409's message)")


class CandidateOut(BaseModel):
    text: str
    tokens: list[int]
    logprob: float
    token_logprobs: list[float]
    prob: float


class AnswerOut(BaseModel):
    text: str
    tokens: list[int]
    stopped: bool
    candidates: list[CandidateOut]
    served_ids: list[str]
    positions: list[tuple[str, int, int]]
    n_rows_served: int
    timings_ms: dict[str, float]
    version: int
    plan: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def from_answer(cls, answer: MemoryAnswer, version: int) -> AnswerOut:
        """The answer body of ``answer`` (what ``EventMemory.query`` returned), with the memory's
        ``version`` when it was answered."""
        return cls(
            text=answer.text,
            tokens=list(answer.generation.tokens),
            stopped=answer.generation.stopped,
            candidates=[
                CandidateOut(
                    text=c.text,
                    tokens=list(c.tokens),
                    logprob=c.logprob,
                    token_logprobs=list(c.token_logprobs),
                    prob=c.prob,
                )
                for c in answer.candidates
            ],
            served_ids=answer.served_ids,
            positions=[(eid, first, width) for eid, first, width in answer.positions],
            n_rows_served=answer.n_rows_served,
            timings_ms=answer.timings_ms,
            version=version,
            plan=answer.plan,
        )


class CarrierOut(BaseModel):
    kind: str | None
    added: AddedOut | None
    pinned: list[str]
    reason: str
    version: int


class WriteOut(BaseModel):
    """A write's acknowledgement: the memory's version after it, and what the verb returned."""

    version: int
    added: list[AddedOut] = Field(default_factory=list)
    rows: int | None = None


class ErrorOut(BaseModel):
    """Every error answer's body: ``code`` names the kind (the table in docs/service.md), ``message``
    says what was wrong and how to fix it."""

    code: str
    message: str


class HealthOut(BaseModel):
    status: Literal["ok"]
    model: str
    queue_depth: int
