"""The pair probes' shared base: the layout options every donor-pair history shares
(:class:`PairLayout`) and the probe base :class:`PairProbe`, whose items run in two phases — each
item's :class:`~eventkv.studies.materialization.pairs.engine.PairRequest` (what the pair engine
must answer), one engine call over every request of a batch, then each item's record from its
:class:`~eventkv.studies.materialization.pairs.engine.PairRun` (Study 1, "Donor pair")."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Sequence, cast

from eventkv.errors import OptionError
from eventkv.options import check_max_new_tokens, check_slots
from eventkv.probes.base import Probe, Readout, Runtime
from eventkv.studies.materialization.pairs.arms import PairArm
from eventkv.studies.materialization.pairs.engine import PairRequest, PairRun, run_pairs


@dataclass
class PairLayout:
    """The layout options every donor-pair history shares (Study 1, "Donor pair"): ``n_events``
    events per history, the served decoy at ``decoy_slot``, the unserved source in a seeded slot
    of ``source_slots`` (inclusive, 0-based; slot ``i`` is event ``i+1``). The field names are the
    options dictionary's keys that a run folder stores in its manifest and compares on resume:
    never rename them.

    A mixin for ``@dataclass`` probes: list it before :class:`PairProbe`. Its fields come first,
    in this order, followed by the probe's own (a probe's later slots, e.g. ``root_slot``, are its
    own fields). The probe's ``validate()`` (called by :meth:`PairProbe.__post_init__`) calls
    :meth:`check_layout` with the probe's later slots.

    Adopting it in a probe that declares these fields itself is a small change::

        @dataclass
        class Landing(PairLayout, PairProbe):
            # n_events, decoy_slot and source_slots inherited
            root_slot: int = 13
            ...

            def validate(self) -> None:
                self.check_layout(("root", self.root_slot), ("edge", self.edge_slot), ...)

    A probe whose layout needs more than the order of its slots (e.g. a source block two slots
    wide before the carrier) adds that check after :meth:`check_layout`.
    """

    n_events: int = 24
    decoy_slot: int = 0
    source_slots: tuple[int, int] = (8, 11)

    def validate(self) -> None:
        """Raises OptionError on an impossible layout (see :meth:`check_layout`)."""
        self.check_layout()

    def check_layout(self, *later: tuple[str, int], decoy_first: bool = True) -> None:
        """Check the layout: decoy, source slots ``lo..hi``, then each of ``later`` (``(role, slot)``
        pairs, e.g. ``("root", 13)``) in order after the source slots, all below ``n_events``.

        Args:
            later: the probe's later roles and slots, in the order they must come.
            decoy_first: the decoy must come before the source slots; when False it may sit
                anywhere that collides with no other role (the donor-pair probe's rule).

        Raises:
            OptionError: naming the field (``n_events``, ``decoy_slot``, ``source_slots`` or
                ``<role>_slot``) and the fix: not an int, outside ``0..n_events-1``, too few events
                for the roles, ``lo > hi``, a later slot not after the one before, or the decoy
                out of place.
        """
        check_slots(
            n_events=self.n_events,
            decoy_slot=self.decoy_slot,
            source_slots=self.source_slots,
            **{f"{role}_slot": slot for role, slot in later},
        )
        n, (lo, hi) = self.n_events, self.source_slots
        roles = ["decoy", "source", *(role for role, _ in later)]
        if n < len(roles):
            raise OptionError("n_events", n, f"a donor pair needs at least {len(roles)} events ({', '.join(roles)}).")
        slots = [("decoy_slot", self.decoy_slot), *((f"{role}_slot", slot) for role, slot in later)]
        for field, value in [*slots, ("source_slots", self.source_slots)]:
            if not all(0 <= v < n for v in (value if isinstance(value, tuple) else (value,))):
                raise OptionError(
                    field, value, f"outside the history's slots 0..{n - 1}: choose slots below n_events={n}."
                )
        if lo > hi:
            raise OptionError("source_slots", self.source_slots, "the first slot must not exceed the last (e.g. 8-11).")
        before = None
        for role, slot in later:
            if before is None and not hi < slot:
                raise OptionError(
                    f"{role}_slot", slot, f"the {role} must come after every source slot (last {hi}): move it later."
                )
            if before is not None and not before[1] < slot:
                raise OptionError(
                    f"{role}_slot",
                    slot,
                    f"the {role} must come after the {before[0]} (slot {before[1]}): move it later.",
                )
            before = (role, slot)
        if decoy_first and not self.decoy_slot < lo:
            raise OptionError(
                "decoy_slot",
                self.decoy_slot,
                f"the decoy must come before the source slots {lo}-{hi}: move it earlier.",
            )
        if lo <= self.decoy_slot <= hi or any(self.decoy_slot == slot for _, slot in later):
            others = " or ".join(f"the {role} {slot}" for role, slot in later)
            raise OptionError(
                "decoy_slot",
                self.decoy_slot,
                f"collides with the source slots {lo}-{hi}{' or ' + others if others else ''}: move it.",
            )


READOUT_OPTIONS = ("generate", "logits", "both")


def pair_record(
    item: dict, run: PairRun, events: dict, after_index: Sequence[str] = (), after_values: Sequence[str] = (), **extra
) -> dict:
    """A pair probe's record of ``item`` (see :meth:`PairProbe.finish`), keys in this order: the
    item's ``index``, its ``after_index`` keys, ``names``, ``source_slot``, ``values``, its
    ``after_values`` keys, ``decoy_value``, ``candidates`` and ``questions``; then ``extra``,
    ``events`` and :meth:`PairRun.record` (arms, outcomes, d, ...).

    Raises:
        KeyError: ``item`` lacks one of the keys named.
    """
    keep = ("index", *after_index, "names", "source_slot", "values", *after_values)
    return {
        **{k: item[k] for k in (*keep, "decoy_value", "candidates", "questions")},
        **extra,
        "events": events,
        **run.record(),
    }


def variant_events(history: Sequence[list[str]]) -> dict:
    """``{"A": events_A, "B": events_B}`` for one history's ``[events_A, events_B]``."""
    return {"A": history[0], "B": history[1]}


class PairProbe(Probe):
    """Members shared by the donor-pair probes (donor pair, trigger bank, landing, access,
    carriers, patch): the ``readout`` option, arms derived from :meth:`pair_arms`, items built
    one by one from ``(seed, index)`` by ``_item``, and the two phases every item runs in:

    1. :meth:`request` — what the pair engine must answer for the item (a :class:`PairRequest`:
       the donor pair, its histories and questions, and the answer parser); computes nothing;
    2. :meth:`finish` — the item's record, from the item and the :class:`PairRun` the engine
       handed back for its request.

    Between the two, :meth:`answer` gives every request of a batch to the pair engine
    :func:`run_pairs` in one call; :meth:`run_item` is a batch of one and :meth:`run_batch` a batch
    of several (``--batch-pairs``).

    Subclasses are ``@dataclass``es with the fields ``readout``, ``max_new_tokens``,
    ``instruction`` and ``answer_prefix``; the ClassVars below choose the engine's options.
    """

    #: 2: lazy prefill splits each history's forward at the last event a subset arm reads,
    #: which moves the rows of text arms by float rounding against version-1 records; 3: a pair's two
    #: variants are prefilled in one batched forward where they continue the same rows, and isolated
    #: events are encoded together, which moves rows by float rounding against version 2; 4: isolated events
    #: ride in the first prefill round's forward under a 4D mask (a history's first event is its prefill's
    #: own rows), which moves the rows of that round and of the isolated arm by float rounding
    record_version: ClassVar[int] = 4
    #: prefill the variants' common leading events once, as their own prefix (see :func:`run_pairs`)
    shared_prefix: ClassVar[bool] = False
    #: record whether each generation ended on a stop token (``stopped``)
    record_stopped: ClassVar[bool] = False
    #: prefill every history to its end even when no arm needs it (see :func:`run_pairs`'s ``whole``)
    prefill_whole: ClassVar[bool] = False
    #: greedy answers draft from the text their arm serves (see :func:`run_pairs`'s ``prompt_lookup``)
    prompt_lookup: ClassVar[bool] = False
    batches_items: ClassVar[bool] = True

    if TYPE_CHECKING:  # declared by every subclass (a ``@dataclass``), read by the members below
        __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]
        readout: str
        max_new_tokens: int
        instruction: str
        answer_prefix: str

        def _item(self, seed: int, index: int) -> dict: ...

    def __post_init__(self) -> None:
        """Every field whose default is a tuple becomes a tuple (options arrive as JSON lists from a
        manifest or as lists from the CLI), then :meth:`validate` runs."""
        for f in dataclasses.fields(self):
            if isinstance(f.default, tuple):
                setattr(self, f.name, tuple(getattr(self, f.name)))
        self.validate()

    def check_readout(self) -> None:
        """Raises OptionError when ``self.readout`` is not generate, logits or both, or ``self.max_new_tokens``
        is below 1."""
        if self.readout not in READOUT_OPTIONS:
            raise OptionError("readout", self.readout, "use generate, logits or both.")
        check_max_new_tokens(self.max_new_tokens)

    @property
    def readouts(self) -> tuple[Readout, ...]:
        # check_readout (every subclass's validate) admits only generate, logits or both
        return ("generate", "logits") if self.readout == "both" else (cast(Readout, self.readout),)

    def pair_arms(self) -> list[PairArm]:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def arms(self):
        return [a.arm(self.readouts) for a in self.pair_arms()]

    def items(self, seed: int, indices: Sequence[int]) -> list[dict]:
        return [self._item(seed, i) for i in indices]

    def request(self, item: dict) -> PairRequest:  # pragma: no cover - every subclass defines it
        """Phase 1: what the pair engine must answer for ``item`` (the donor pair and the answer
        parser). Deterministic in the item and the options; runs nothing on the model."""
        raise NotImplementedError

    def finish(self, rt: Runtime, item: dict, run: PairRun) -> dict:  # pragma: no cover - every subclass defines it
        """Phase 2: the JSON record of ``item`` (with ``"index"``) from ``run``, the engine's answer
        to :meth:`request`'s request."""
        raise NotImplementedError

    def answer(self, rt: Runtime, requests: Sequence[PairRequest]) -> list[PairRun]:
        """:func:`run_pairs` over ``requests`` with this probe's arms and options (instruction,
        readouts, max new tokens, answer prefix, ``shared_prefix``, ``record_stopped``,
        ``prefill_whole``, ``prompt_lookup``): one :class:`PairRun` per request, in order."""
        return run_pairs(
            rt,
            [r.pair for r in requests],
            self.pair_arms(),
            instruction=self.instruction,
            readouts=self.readouts,
            parses=[r.parse for r in requests],
            max_new_tokens=self.max_new_tokens,
            answer_prefix=self.answer_prefix,
            shared_prefix=self.shared_prefix,
            record_stopped=self.record_stopped,
            whole=self.prefill_whole,
            prompt_lookup=self.prompt_lookup,
        )

    def run_item(self, rt: Runtime, item: dict) -> dict:
        """The record of one item: :meth:`run_batch` on it alone."""
        return self.run_batch(rt, [item])[0]

    def run_batch(self, rt: Runtime, items: Sequence[dict]) -> list[dict]:
        """The records of several items with their pairs batched (``--batch-pairs``): every item's
        :meth:`request`, one :meth:`answer` over all of them, then every item's :meth:`finish`.
        Records equal :meth:`run_item`'s up to float rounding (the engine's matmuls run at other
        shapes; tested on tiny models); a batch of one is :meth:`run_item` bit for bit."""
        requests = [self.request(it) for it in items]
        runs = self.answer(rt, requests) if requests else []
        return [self.finish(rt, it, run) for it, run in zip(items, runs)]
