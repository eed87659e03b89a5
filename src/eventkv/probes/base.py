"""The probe framework: a probe is a small declarative recipe over the data path.

A probe (a ``@dataclass`` whose fields are its options, every layout number among them) says

* how to build its **items** — deterministically from ``(seed, index)`` alone, so a run can be
  resumed item by item and ``--items 32`` extends ``--items 16`` with the same first 16 items;
* its **arms** — for each, a served set (event roles or ``"all"``), an encoding and the readouts
  it is answered with;
* how to turn one item into one JSON **record** (:meth:`Probe.run_item`), and
* its **statistic**: :meth:`Probe.summarize` turns records (and nothing else) into a
  :class:`Summary` table, so ``eventkv report DIR`` can re-render it from ``records.jsonl``.

Probes are listed in one registry (:data:`PROBES`, filled by :func:`register`); the test suite is
parametrised over it, so a probe is exercised on a tiny random model the moment it is registered.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Literal, Sequence, cast, get_args

import torch

from eventkv.errors import EventKVError
from eventkv.kv.log import TokenizedLog, header_text
from eventkv.kv.model import model_device
from eventkv.kv.prefill import prefill
from eventkv.kv.rows import EventKV, cache_kv
from eventkv.models.encoding import encode
from eventkv.registry import Registry, one_of

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

#: Encodings an arm can name (Study 1, "Setting"):
#: ``compact`` — the served events' rows from the global prefill, at their original positions;
#: ``isolated`` — each served event encoded alone after the header, at its original positions;
#: ``prefill`` — the global prefill itself, continued by the query (every row, no serving step).
ENCODINGS = ("compact", "native", "isolated", "prefill")
Readout = Literal["generate", "logits"]
"""How an arm is answered: greedy generation, or candidate log-probabilities (logits)."""
READOUTS: tuple[Readout, ...] = get_args(Readout)


@dataclass(frozen=True)
class Arm:
    """One arm of a probe: what is served, how it is encoded, how it is read out.

    Attributes:
        name: the arm's name in records and tables (``kv``, ``isolated``, ``text-all`` ...).
        served: event *roles* of the item (e.g. ``("decoy", "root")``) or ``"all"``.
        encoding: one of :data:`ENCODINGS`.
        readouts: the readouts this arm is answered with (subset of :data:`READOUTS`).
        description: one line for tables and docs.
    """

    name: str
    served: tuple[str, ...] | str
    encoding: str
    readouts: tuple[Readout, ...] = READOUTS
    description: str = ""

    def __post_init__(self) -> None:
        if self.encoding not in ENCODINGS:
            raise ValueError(f"arm {self.name!r}: unknown encoding {self.encoding!r}")


@dataclass
class Table:
    """One markdown table: a caption, a header and rows of already formatted strings."""

    caption: str
    columns: list[str]
    rows: list[list[str]]

    def to_markdown(self) -> str:
        out = [
            f"**{self.caption}**",
            "",
            "| " + " | ".join(self.columns) + " |",
            "|" + "|".join("---" for _ in self.columns) + "|",
        ]
        out.extend("| " + " | ".join(r) + " |" for r in self.rows)
        return "\n".join(out)


@dataclass
class Summary:
    """A probe's statistics: tables, then the tests (each naming the counts it ran on), then notes.

    ``data`` holds the same numbers machine-readably (for figures and assertions).
    """

    title: str
    tables: list[Table]
    tests: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)

    def to_markdown(self) -> str:
        out = [f"# {self.title}", ""]
        for t in self.tables:
            out += [t.to_markdown(), ""]
        if self.tests:
            out += ["Tests:", ""] + [f"- {t}" for t in self.tests] + [""]
        if self.notes:
            out += ["Notes:", ""] + [f"- {n}" for n in self.notes] + [""]
        return "\n".join(out)


class ForwardTimer:
    """Accumulates wall time spent inside ``model.forward`` (seconds) while installed — the
    probe's forward passes, against which a pair's total time is compared. Scoped: the hooks are
    removed on exit, always."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._t0 = 0.0

    @contextmanager
    def installed(self, model) -> Iterator["ForwardTimer"]:
        def pre(_m, _a, _k=None):
            self._t0 = time.perf_counter()

        def post(_m, _a, _k=None, _o=None):
            self.seconds += time.perf_counter() - self._t0
            self.calls += 1

        h1 = model.register_forward_pre_hook(pre)
        h2 = model.register_forward_hook(post)
        try:
            yield self
        finally:
            h1.remove()
            h2.remove()


@dataclass
class Runtime:
    """What a probe runs on: a model, its tokenizer and profile, plus the header rows computed
    once per run (``prefix=`` of every item's prefill).

    ``profile`` needs ``chat_head``, ``chat_tail``, ``stop_token_ids``, ``max_context``,
    ``weights_digest`` (an ``eventkv.models.ModelProfile``, or any object with those fields).
    """

    model: Any
    tokenizer: Any
    profile: Any
    _headers: dict = field(default_factory=dict, repr=False)

    @property
    def max_context(self) -> int | None:
        return getattr(self.profile, "max_context", None)

    @property
    def weights_digest(self) -> str:
        return getattr(self.profile, "weights_digest", "unhashed")

    @property
    def device(self) -> str:
        """Where the model runs (``"cpu"``, ``"cuda:0"``): its parameters' device, else the profile's
        (a stand-in model without parameters), else ``"unknown"``."""
        try:
            return str(model_device(self.model))
        except (AttributeError, StopIteration, TypeError):
            return str(getattr(self.profile, "device", "") or "unknown")

    @property
    def stop_token_ids(self) -> list[int]:
        return list(getattr(self.profile, "stop_token_ids", []) or [])

    def encode(self, text: str) -> list[int]:
        return encode(self.tokenizer, text)

    def header_ids(self, instruction: str) -> list[int]:
        """Token ids of the header (chat head + instruction)."""
        return encode(self.tokenizer, header_text(self.profile, instruction))

    def header_kv(self, instruction: str) -> EventKV:
        """The header's rows, prefilled once per instruction and reused across items."""
        ids = tuple(self.header_ids(instruction))
        if ids not in self._headers:
            # a TokenizedLog needs an event: prefill the header alone through the model directly
            self._headers[ids] = _prefill_header(self.model, list(ids), self.weights_digest)
        return self._headers[ids]

    def prefill(self, log: TokenizedLog, prefix: EventKV | None = None) -> EventKV:
        return prefill(self.model, log, prefix=prefix, max_context=self.max_context, weights_digest=self.weights_digest)


@torch.inference_mode()
def _prefill_header(model, header_ids: list[int], digest: str) -> EventKV:
    """An EventKV of the header rows only (positions 0..h-1), usable as ``prefix=``. Its log
    carries a one-token placeholder event that holds no rows (only ``log.input_ids[:h]`` and the
    positions are compared by :func:`eventkv.kv.prefill.prefill`)."""
    from transformers import DynamicCache

    from eventkv.kv.model import model_forward

    if not header_ids:
        raise EventKVError("the header tokenizes to nothing: give the model a chat template or an instruction.")
    dev = model_device(model)
    cache = DynamicCache()
    ids = torch.tensor([header_ids], device=dev)
    model_forward(model, ids, torch.arange(len(header_ids), device=dev).unsqueeze(0), cache, logits_to_keep=1)
    log = TokenizedLog.from_ids(header_ids, [("<none>", [0], None)])
    pos = torch.arange(len(header_ids), dtype=torch.long, device="cpu")  # an EventKV's positions live on the CPU
    return EventKV(log, *cache_kv(cache), pos, digest)


class Probe:
    """Base of every probe. Subclasses are ``@dataclass``es (fields = options) and set ``name``.

    Subclasses implement :meth:`items`, :meth:`arms`, :meth:`run_item` and :meth:`summarize`;
    :meth:`figure` is optional.
    """

    name: ClassVar[str] = ""
    #: bump when the record format changes (part of the run's identity)
    record_version: ClassVar[int] = 1
    #: options that make the probe fast enough for the registry's smoke test on a tiny model
    smoke_options: ClassVar[dict] = {}
    #: :meth:`run_batch` computes several items in one batch (``--batch-pairs``); False: one at a time
    batches_items: ClassVar[bool] = False

    def options(self) -> dict:
        """Every option as a JSON-able dict (tuples become lists)."""
        return json_ready(dataclasses.asdict(cast("DataclassInstance", self)))  # every subclass is a @dataclass

    @classmethod
    def for_records(cls, options: dict) -> Probe:
        """The probe of a run's recorded options (its manifest's), to summarize and draw its records
        (``eventkv report``); a probe whose inputs are files overrides it so that a copied run folder
        reports without them."""
        return cls(**options)

    def validate(self) -> None:
        """Raise EventKVError on an impossible option combination (names the option and the fix)."""

    def max_items(self) -> int | None:
        """How many items the probe can make (None: any number), e.g. the lines of a task file."""
        return None

    def check_model(self, rt: Runtime) -> None:
        """Raise EventKVError on an option the loaded model cannot run (e.g. a layer it does not have).
        The runner calls it after :meth:`validate` and before it creates or writes the run directory."""

    def use_run_directory(self, directory) -> None:
        """The run's directory (a :class:`pathlib.Path`), handed over by the runner once it exists
        and before the first item is computed. A probe that builds state worth keeping across a
        restart (e.g. prefilled memories) keeps it under this directory; the default ignores it."""

    def arms(self) -> list[Arm]:
        raise NotImplementedError

    def items(self, seed: int, indices: Sequence[int]) -> list[dict]:
        """The items with these indices; item ``i`` depends only on ``(seed, i)`` and the options."""
        raise NotImplementedError

    def run_item(self, rt: Runtime, item: dict) -> dict:
        """Run every arm on one item; return its JSON record (must include ``"index"``).
        Must be deterministic (no timings, no wall-clock values)."""
        raise NotImplementedError

    def run_batch(self, rt: Runtime, items: Sequence[dict]) -> list[dict]:
        """The records of several items, in order. This base runs :meth:`run_item` on each; a probe
        that can batch items overrides it (the pair probes: ``--batch-pairs``), with
        records equal to :meth:`run_item`'s up to float rounding."""
        return [self.run_item(rt, it) for it in items]

    def summarize(self, records: Sequence[dict]) -> Summary:
        raise NotImplementedError

    def figure(self, records: Sequence[dict], path) -> None:  # pragma: no cover - optional
        """Write a figure of the records to ``path`` (PNG)."""


#: the entry-point group through which packages (eventkv's own and third-party) declare probes:
#: ``name = "module:Class"`` under ``[project.entry-points."eventkv.probes"]`` in pyproject.toml
ENTRY_POINT_GROUP = "eventkv.probes"


def _check_probe(name: str, cls) -> None:
    """A probe entry point must name a :class:`Probe` whose ``name`` is the entry point's name."""
    if not (isinstance(cls, type) and issubclass(cls, Probe)) or cls.name != name:
        ep = PROBES._declared().get(name)
        value = ep.value if ep is not None else f"{getattr(cls, '__module__', '?')}:{getattr(cls, '__name__', cls)}"
        raise EventKVError(
            f"entry point {name!r} = {value!r} in group {ENTRY_POINT_GROUP!r} is not a Probe named "
            f"{name!r}: declare the probe class whose `name` is the entry point's name."
        )


PROBES: Registry[type[Probe]] = Registry(
    "probe",
    entry_points=ENTRY_POINT_GROUP,
    allowed=lambda names: one_of(tuple(sorted(names))),
    check=_check_probe,
)
"""Every probe, by name: those declared in the ``eventkv.probes`` entry-point group (imported on first
use) and those registered in-process with :func:`register`."""


def load_probes() -> Registry[type[Probe]]:
    """Import every probe declared in the ``eventkv.probes`` entry-point group and return
    :data:`PROBES` (plus any registered in-process with :func:`register`).

    Raises:
        EventKVError: an entry point that does not name a :class:`Probe` of the same name.
    """
    PROBES.load_all()
    return PROBES


def register(cls: type[Probe]) -> type[Probe]:
    """Class decorator: list a probe in :data:`PROBES` under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    return PROBES.put(cls.name, cls)


def get_probe(name: str) -> type[Probe]:
    """The registered probe class called ``name``.

    Raises:
        EventKVError: unknown probe (the message lists the registered ones).
    """
    return PROBES.get(name)


def json_ready(x):
    """Tuples to lists, recursively (so options compare equal after a JSON round trip)."""
    if isinstance(x, dict):
        return {k: json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_ready(v) for v in x]
    return x
