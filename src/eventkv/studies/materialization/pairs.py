"""The donor-pair engine: donor pairs with one or several histories and many arms.

The donor-pair probe (:mod:`eventkv.studies.materialization.donor_pair`, Study 1, "Donor pair") answers one
history layout with fixed arms. The contract probes (Study 1, "The memory contract", "Programmed
carriers", "Updates") need the same unit of evidence — two variants identical except for what an
unserved event wrote — over *several* histories per item (e.g. with and without a carrier), with arms that serve any
roles, mix rows of the two variants (the landing factorial), or answer with the query at a fixed
absolute position. This module is the one donor-pair engine under all of them, the donor-pair
probe included: :func:`run_pair` runs an item on the data path (tokenize with position budgets,
prefill sharing the common prefix, serve, one batched readout) and scores every arm as a donor
pair (:func:`outcome`, :func:`donor_d`); :class:`PairLayout` holds the layout options the pair
probes share.

An item (a JSON-able dict built by the probe, deterministic in ``(seed, index)``) holds:

* ``values``: ``[a, b]`` — what variant A's and variant B's donor wrote (the gold answers);
* ``histories``: ``{name: [events_A, events_B]}`` — event texts per variant;
* ``roles``: ``{name: {role: slot}}`` — which slot plays which role in that history;
* ``pad``: optional ``{name: {slot: [texts]}}`` — alternative texts whose longest tokenization
  sets that slot's position budget (so positions do not depend on which alternative was used);
* ``questions``: ``{name: text}``;
* ``candidates``: candidate answer texts for the logit readout, and ``gold_candidates``: the
  candidates that stand for ``a`` and ``b`` (usually the values themselves).

Positions. Within a history, every slot whose tokens differ between the variants gets a position
budget equal to the longer tokenization, so every later event — and the query — sits at the same
positions in both variants. An arm with ``fixed_position`` asks its question at position ``P`` =
the largest ``history_end`` over the item's histories, the same for every such arm of the item
(the position control of Study 1: the query's absolute position does not vary across arms).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.log import HEADER_ID, TokenizedLog, tokenize_query
from eventkv.options import check_max_new_tokens, check_slots
from eventkv.prefill import EventKV
from eventkv.probes.base import Arm, Probe, Runtime
from eventkv.readout import read_out
from eventkv.serve import ServedCache, serve

VARIANTS = ("A", "B")
#: pair outcomes (Study 1, "Donor pair"), in table order
OUTCOMES = ("follow", "anti", "constant", "other")
#: the leading columns of every outcome table: the arm, the readout, the number of pairs, each outcome's count
OUTCOME_COLUMNS = ("arm", "readout", "pairs", *OUTCOMES)


# ---------------------------------------------------------------- scoring one pair (Study 1, "Donor pair")
def outcome(answer_a: str | None, answer_b: str | None, a: str, b: str) -> str:
    """Pair outcome from the two variants' answers (variant A's source wrote ``a``, B's ``b``):
    ``follow`` (each answers its own source's value), ``anti`` (each answers the other's),
    ``constant`` (both give the same answer), ``other`` (anything else, e.g. no answer)."""
    if answer_a == a and answer_b == b:
        return "follow"
    if answer_a == b and answer_b == a:
        return "anti"
    if answer_a is not None and answer_a == answer_b:
        return "constant"
    return "other"


def log_odds(logprobs: dict[str, float], state: str) -> float:
    """log-odds of ``state`` among the candidates: ``lp(state) - logsumexp(lp(others))`` (nats)."""
    others = [v for k, v in logprobs.items() if k != state]
    m = max(others)
    return logprobs[state] - (m + math.log(sum(math.exp(v - m) for v in others)))


def donor_d(lp_a: dict[str, float], lp_b: dict[str, float], a: str, b: str) -> float:
    """The continuous donor statistic of one pair (Study 1, "Donor pair"), in nats:
    ``d = ½([lo(a|A) - lo(a|B)] + [lo(b|B) - lo(b|A)])`` where ``lo(v|X)`` is the log-odds of ``v``
    among the candidates in variant X (:func:`log_odds`); d > 0 leans toward each variant's own
    unserved value. ``lp_a``/``lp_b``: candidate log-probabilities per variant."""
    return 0.5 * ((log_odds(lp_a, a) - log_odds(lp_b, a)) + (log_odds(lp_b, b) - log_odds(lp_a, b)))


# ---------------------------------------------------------------- the pair probes' shared options
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
        class Landing(PairLayout, PairProbe):  # was: Landing(PairProbe)
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


class PairProbe(Probe):
    """Members shared by the donor-pair probes (donor pair, trigger bank, landing, access,
    carriers, patch): the ``readout`` option, arms derived from :meth:`pair_arms`, items built
    one by one from ``(seed, index)`` by ``_item``, and :meth:`answer`, which runs an item's arms
    on the pair engine :func:`run_pair`.

    Subclasses are ``@dataclass``es with the fields ``readout``, ``max_new_tokens``,
    ``instruction`` and ``answer_prefix``; the two ClassVars below choose the engine's options.
    """

    #: 2: lazy prefill splits each history's forward at the last event a subset arm reads,
    #: which moves the rows of text arms by float rounding against version-1 records; 3: a pair's two
    #: variants are prefilled in one batched forward where they continue the same rows, and isolated
    #: events are encoded together, which moves rows by float rounding against version 2
    record_version: ClassVar[int] = 3
    #: prefill the variants' common leading events once, as their own prefix (see :func:`run_pair`)
    shared_prefix: ClassVar[bool] = False
    #: record whether each generation ended on a stop token (``stopped``)
    record_stopped: ClassVar[bool] = False
    #: prefill every history to its end even when no arm needs it (see :func:`run_pair`'s ``whole``)
    prefill_whole: ClassVar[bool] = False
    batches_items: ClassVar[bool] = True

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
    def readouts(self) -> tuple[str, ...]:
        return ("generate", "logits") if self.readout == "both" else (self.readout,)

    def pair_arms(self) -> list["PairArm"]:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def arms(self):
        return [a.arm(self.readouts) for a in self.pair_arms()]

    def items(self, seed: int, indices: Sequence[int]) -> list[dict]:
        return [self._item(seed, i) for i in indices]

    def answer(self, rt: Runtime, item: dict, parse: Callable[[str], str | None]) -> "PairRun":
        """:func:`run_pair` on ``item`` with this probe's arms and options (instruction, readouts,
        max new tokens, answer prefix, ``shared_prefix``, ``record_stopped``); ``parse`` reads the
        answer out of a generation. Inside :meth:`run_batch` the engine's runs are batched: the
        first pass collects each item's engine input, the second hands back its run."""
        batch = getattr(self, "_batch", None)
        if batch is not None:
            mode, store = batch
            if mode == "collect":
                store.append((item, parse))
                raise _Deferred
            if store and store[0][0] == item:
                return store.pop(0)[1]
        return self.answer_many(rt, [item], [parse])[0]

    def answer_many(self, rt: Runtime, items: Sequence[dict], parses: Sequence[Callable]) -> list["PairRun"]:
        """:func:`run_pairs` on several engine inputs with this probe's arms and options."""
        return run_pairs(
            rt,
            items,
            self.pair_arms(),
            instruction=self.instruction,
            readouts=self.readouts,
            parses=parses,
            max_new_tokens=self.max_new_tokens,
            answer_prefix=self.answer_prefix,
            shared_prefix=self.shared_prefix,
            record_stopped=self.record_stopped,
            whole=self.prefill_whole,
        )

    def run_batch(self, rt: Runtime, items: Sequence[dict]) -> list[dict]:
        """The records of several items with their pairs batched (``--batch-pairs``):
        each item's :meth:`run_item` runs twice — first to collect the engine input it passes to
        :meth:`answer`, then, after one :func:`run_pairs` over all of them, to write its record from
        its run. One item is :meth:`run_item` itself. Records equal :meth:`run_item`'s up to float
        rounding (tested on tiny models)."""
        if len(items) <= 1:
            return [self.run_item(rt, it) for it in items]
        calls: list[tuple[dict, Callable]] = []
        object.__setattr__(self, "_batch", ("collect", calls))
        try:
            for it in items:
                try:
                    self.run_item(rt, it)
                except _Deferred:
                    continue
                raise EventKVError(f"probe {self.name!r}: run_item did not ask the pair engine; it cannot be batched.")
            runs = self.answer_many(rt, [c[0] for c in calls], [c[1] for c in calls])
            object.__setattr__(self, "_batch", ("replay", [(c[0], r) for c, r in zip(calls, runs)]))
            return [self.run_item(rt, it) for it in items]
        finally:
            object.__setattr__(self, "_batch", None)

    def run_arms(self, rt: Runtime, item: dict, parse: Callable[[str], str | None]) -> dict:
        """The engine's part of a contract probe's record: :meth:`answer` then :meth:`PairRun.record`."""
        return self.answer(rt, item, parse).record()


class _Deferred(Exception):
    """Raised by :meth:`PairProbe.answer` while :meth:`PairProbe.run_batch` collects engine inputs."""


@dataclass(frozen=True)
class PairArm:
    """One arm of a multi-history donor pair.

    Attributes:
        name: the arm's name in records and tables.
        history: which of the item's histories it is answered from.
        served: roles of that history to serve, or ``"all"``.
        encoding: ``compact`` (rows of the global prefill), ``isolated`` (each served event
            encoded alone) or ``prefill`` (the global prefill continued by the query: text).
        question: which of the item's questions it asks.
        swap: roles whose rows come from the *other* variant's prefill (compact only): the
            landing factorial serves the root of one variant beside the mention of the other.
        fixed_position: ask at the item's common query position (see the module docstring).
        description: one line for tables and docs.
    """

    name: str
    history: str
    served: tuple[str, ...] | str
    encoding: str = "compact"
    question: str = "main"
    swap: tuple[str, ...] = ()
    fixed_position: bool = False
    description: str = ""

    def arm(self, readouts: Sequence[str]) -> Arm:
        return Arm(
            self.name,
            self.served,
            self.encoding if self.encoding != "prefill" else "prefill",
            tuple(readouts),
            self.description,
        )


def event_id(slot: int) -> str:
    return f"e{slot:02d}"


def serve_mixed(own: EventKV, other: EventKV, served: Sequence[str], swap: Sequence[str]) -> ServedCache:
    """Compact serving of ``served`` where the events in ``swap`` take their rows from ``other``
    (a prefill of the other variant, with the same positions for those events).

    Returns:
        ServedCache of header + served rows in log order (keys/values ``[1, kv_heads, rows, head_dim]``).

    Raises:
        EventKVError: a swapped event whose positions differ between the two prefills.
    """
    order = [HEADER_ID] + [e for e in own.log.event_ids if e in set(served)]
    ks, vs, ps = [[] for _ in own.keys], [[] for _ in own.keys], []
    for e in order:
        src = other if e in swap else own
        s = src.log.span(e)
        if e in swap and (s.pos_start, s.n_tokens) != (own.log.span(e).pos_start, own.log.span(e).n_tokens):
            raise EventKVError(f"event {e!r} sits at different positions in the two variants: it cannot be swapped.")
        for layer in range(len(ks)):  # a span's rows are contiguous: a slice, on whatever device they live
            ks[layer].append(src.keys[layer][:, :, s.row_start : s.row_end])
            vs[layer].append(src.values[layer][:, :, s.row_start : s.row_end])
        ps.append(src.positions[s.row_start : s.row_end])
    return ServedCache(
        [torch.cat(k, dim=2) for k in ks],
        [torch.cat(v, dim=2) for v in vs],
        torch.cat(ps),
        None,
        own.log.history_end,
        "compact",
        tuple(order[1:]),
    )


def tokenize_pair(
    rt: Runtime, instruction: str, texts: Sequence[Sequence[str]], pad: dict | None = None
) -> list[TokenizedLog]:
    """The two variants of one history as TokenizedLogs with shared positions: a slot whose tokens
    differ gets the longer length as its budget; a slot in ``pad`` gets the longest tokenization
    of its alternatives (and of its own texts)."""
    n = len(texts[0])
    if len(texts[1]) != n:
        raise EventKVError("the two variants of a history must have the same number of events.")
    header = rt.header_ids(instruction)
    toks = [[rt.encode(t) for t in ev] for ev in texts]
    pad = {int(k): v for k, v in (pad or {}).items()}
    budgets: list[int | None] = []
    for i in range(n):
        width = None
        if toks[0][i] != toks[1][i]:
            width = max(len(toks[0][i]), len(toks[1][i]))
        if i in pad:
            width = max([len(toks[0][i]), len(toks[1][i])] + [len(rt.encode(t)) for t in pad[i]])
        budgets.append(width)
    ids = [event_id(i) for i in range(n)]
    return [TokenizedLog(header, ids, toks[v], budgets) for v in (0, 1)]


class PrefillCache:
    """Prefills of one item, sharing work: the header rows come from the runtime (once per run);
    each variant's prefill continues the longest already-computed prefix with the same tokens
    and positions (so the events before the first difference are computed once per item)."""

    def __init__(self, rt: Runtime, instruction: str) -> None:
        self.rt, self.instruction = rt, instruction
        self._done: list[EventKV] = []

    def prefill(self, log: TokenizedLog) -> EventKV:
        """The EventKV of ``log`` (keys/values ``[1, kv_heads, rows, head_dim]`` per layer),
        continuing the longest computed prefix or returning an identical earlier prefill."""
        done, prefix = self.plan(log)
        if done is not None:
            return done
        return self.add(self.rt.prefill(log, prefix=prefix))

    def plan(self, log: TokenizedLog) -> tuple[EventKV | None, EventKV]:
        """``(done, prefix)`` for ``log``: an identical earlier prefill (``done``, nothing to compute),
        else None and the longest computed prefix to continue (the header's rows at least)."""
        ids, pos = log.input_ids, log.position_ids
        best, best_n = self.rt.header_kv(self.instruction), None
        for ekv in self._done:
            n = _common_events(ekv.log, log)
            if n and (best_n is None or n > best_n):
                best, best_n = ekv, n
        if best_n is not None:
            if best_n == len(log.event_ids) and best.log.input_ids == ids and best.log.position_ids == pos:
                return best, best
            if best_n < len(best.log.event_ids):
                best = _truncate(best, best_n)
        return None, best

    def add(self, ekv: EventKV) -> EventKV:
        """Keep ``ekv`` (a prefill of this item) for later prefills to continue; returns it."""
        self._done.append(ekv)
        return ekv

    def prefill_shared(self, pair: Sequence[TokenizedLog]) -> None:
        """Prefill the events both variants begin with (same tokens and positions) as a prefix of
        its own, which both variants' prefills then continue: the donor-pair probe's order of
        forwards (header, shared events, each variant's remainder). Nothing when the variants
        differ in their first event or not at all."""
        shared = shared_log(pair)
        if shared is not None:
            self.prefill(shared)


def shared_log(pair: Sequence[TokenizedLog]) -> TokenizedLog | None:
    """The header and the events both variants begin with (same tokens and positions), or None when
    they differ in their first event or not at all (see :meth:`PrefillCache.prefill_shared`)."""
    n = _common_events(pair[0], pair[1])
    return _leading(pair[0], n) if 0 < n < len(pair[0].event_ids) else None


def events_read(arms: Sequence["PairArm"], item: dict, log: TokenizedLog, history: str) -> tuple[int | None, bool]:
    """``(n, everything)`` for one history: ``n`` leading events hold every event its subset-serving
    arms read (served or swapped, by history order; None when that is the whole history or there is
    no such arm), and ``everything`` says whether an arm reads every event (``prefill`` encoding or
    ``served="all"``). The lead is always prefilled first and the rest continues it."""
    mine = [a for a in arms if a.history == history]
    everything = any(a.encoding == "prefill" or a.served == "all" for a in mine)
    roles = item["roles"][history]
    idx = [
        log.event_ids.index(event_id(roles[r]))
        for a in mine
        if not (a.encoding == "prefill" or a.served == "all")
        for r in (*a.served, *a.swap)
        if r in roles and event_id(roles[r]) in log.event_ids
    ]
    n = max(idx) + 1 if idx else None
    return (None if n == len(log.event_ids) else n), everything


def _common_events(a: TokenizedLog, b: TokenizedLog) -> int:
    """Number of leading events with the same tokens and positions in both logs (0 if the headers differ)."""
    if a.header_ids != b.header_ids:
        return 0
    n = 0
    for i in range(min(len(a.event_ids), len(b.event_ids))):
        sa, sb = a.spans[i + 1], b.spans[i + 1]
        if a.event_tokens[i] != b.event_tokens[i] or sa.pos_start != sb.pos_start or a.event_ids[i] != b.event_ids[i]:
            break
        n += 1
    return n


def _leading(log: TokenizedLog, n_events: int) -> TokenizedLog:
    """The header and the first ``n_events`` events of ``log`` (same tokens, budgets, positions)."""
    return TokenizedLog(log.header_ids, log.event_ids[:n_events], log.event_tokens[:n_events], log.budgets[:n_events])


def _truncate(ekv: EventKV, n_events: int) -> EventKV:
    """The EventKV of the header and the first ``n_events`` events of ``ekv`` (rows shared)."""
    sub = _leading(ekv.log, n_events)
    r = sub.n_rows
    return EventKV(
        sub, [k[:, :, :r] for k in ekv.keys], [v[:, :, :r] for v in ekv.values], ekv.positions[:r], ekv.weights_digest
    )


@dataclass
class PairRun:
    """One item answered on every arm by :func:`run_pair`: what a probe writes its record from.

    Attributes:
        logs: per history, the two variants' TokenizedLogs ``[A, B]`` (shared positions).
        prefills: per history, the two variants' EventKVs ``[A, B]``: rows of the global prefill, up to
            the last event an arm reads (lazy prefill; every event when an arm reads all).
        answers: per arm, ``[out_A, out_B]``: ``text``, ``n_tokens`` (``stopped``), ``answer``
            (generate) and ``logprobs`` (nats), ``choice`` (logits).
        outcomes: per arm and readout, the pair's outcome (:func:`outcome`).
        d: per arm with the logits readout, the donor statistic (:func:`donor_d`, nats).
        query_position: per arm, the position of the query's first token.
        served: per arm, ``events`` (event ids, or ``"all"``), ``swap`` (event ids whose rows
            come from the other variant) and ``rows`` (header + served rows, per variant).
    """

    logs: dict[str, list[TokenizedLog]]
    prefills: dict[str, list[EventKV]]
    answers: dict[str, list[dict]]
    outcomes: dict[str, dict[str, str]]
    d: dict[str, float]
    query_position: dict[str, int]
    served: dict[str, dict]

    @property
    def history_end(self) -> dict[str, int]:
        """Per history, the first position after it (where a query starts; the same in both variants)."""
        return {h: pair[0].history_end for h, pair in self.logs.items()}

    def record(self) -> dict:
        """The engine's part of a contract probe's record: ``{"arms": {arm: {"A": out, "B": out}},
        "outcomes", "d", "query_position", "history_end", "served"}``."""
        return {
            "arms": {n: {"A": x[0], "B": x[1]} for n, x in self.answers.items()},
            "outcomes": self.outcomes,
            "d": self.d,
            "query_position": self.query_position,
            "history_end": self.history_end,
            "served": self.served,
        }


def run_pair(
    rt: Runtime,
    item: dict,
    arms: Sequence[PairArm],
    *,
    instruction: str,
    readouts: Sequence[str],
    parse: Callable[[str], str | None],
    max_new_tokens: int,
    answer_prefix: str,
    cache: PrefillCache | None = None,
    shared_prefix: bool = False,
    record_stopped: bool = False,
    whole: bool = False,
) -> PairRun:
    """Run every arm on both variants of one item and score each arm as a donor pair (Study 1,
    "Donor pair"): the one donor-pair engine of the pair probes. One batched readout answers all
    arms of a question. **Lazy prefill**: each history is prefilled up to the last event
    a subset-serving arm reads, and continued to its end only when an arm reads every event (text,
    or ``served="all"``); rows are causal and the query's position comes from the log, so an arm's
    rows and answers are byte-identical whether or not another arm asked for the whole history.

    Args:
        item: the item (see the module docstring).
        arms: the arms to answer; an isolated arm whose served tokens are the same in both
            variants is encoded once and answers both.
        readouts: ``generate`` and/or ``logits``.
        parse: reads the answer out of a generated text (None: no answer).
        max_new_tokens: the greedy generation budget (tokens).
        answer_prefix: text forced before the scored candidates (e.g. ``"Answer:"``).
        cache: prefills to continue (default: a new :class:`PrefillCache`).
        shared_prefix: prefill each history's common leading events once as their own prefix
            before the variants (:meth:`PrefillCache.prefill_shared`) instead of continuing
            variant A's rows; the donor-pair probe's order of forwards, kept so its records stay
            bitwise the same.
        record_stopped: record ``stopped`` (the generation ended on a stop token) per answer.
        whole: prefill every history to its end even when no arm reads past the lead (the lead is
            still computed first, so the answers are byte-identical to the lazy run's).

    Returns:
        a :class:`PairRun` (its :meth:`PairRun.record` is the contract probes' record part).

    Raises:
        EventKVError: an arm naming an unknown history, role or question; a history or query
            beyond the model's context.
    """
    return run_pairs(
        rt,
        [item],
        arms,
        instruction=instruction,
        readouts=readouts,
        parses=[parse],
        max_new_tokens=max_new_tokens,
        answer_prefix=answer_prefix,
        caches=None if cache is None else [cache],
        shared_prefix=shared_prefix,
        record_stopped=record_stopped,
        whole=whole,
    )[0]


def run_pairs(
    rt: Runtime,
    items: Sequence[dict],
    arms: Sequence[PairArm],
    *,
    instruction: str,
    readouts: Sequence[str],
    parses: Sequence[Callable[[str], str | None]],
    max_new_tokens: int,
    answer_prefix: str,
    caches: Sequence[PrefillCache] | None = None,
    shared_prefix: bool = False,
    record_stopped: bool = False,
    whole: bool = False,
) -> list[PairRun]:
    """:func:`run_pair` on several items at once: the
    items' prefills run in rounds, each round of every item in one :func:`eventkv.batched.prefill_batch`
    forward (the shared events; both variants' leads, which continue them — with ``shared_prefix``,
    else variant A's lead and then B's, which continues A's rows; then the rest of each history when
    an arm reads everything); every event an isolated arm serves is encoded alone in one
    :func:`eventkv.batched.encode_alone` forward; and the served caches of every item are read out
    together, one :func:`read_out` per question and query length (caches are left-padded, each with
    its own positions; no padding goes between a cache's rows and its query). :func:`run_pair` is
    this function on one item; with more, the records equal one item's at a time up to float
    rounding (the matmuls run at other shapes; tested on tiny models).

    Args:
        items: the items (see the module docstring).
        parses: one answer parser per item.
        caches: one :class:`PrefillCache` per item (default: new ones).
        arms, instruction, readouts, max_new_tokens, answer_prefix, shared_prefix, record_stopped,
            whole: as for :func:`run_pair`, the same for every item.

    Returns:
        one :class:`PairRun` per item, in order.

    Raises:
        EventKVError: as :func:`run_pair`; ``parses`` or ``caches`` not one per item.
    """
    from eventkv.batched import prefill_batch

    if len(parses) != len(items) or (caches is not None and len(caches) != len(items)):
        raise EventKVError(
            f"run_pairs got {len(items)} items but {len(parses)} parsers"
            + ("" if caches is None else f" and {len(caches)} prefill caches")
            + ": give one per item."
        )
    caches = list(caches) if caches is not None else [PrefillCache(rt, instruction) for _ in items]
    used = sorted({a.history for a in arms})
    logs: list[dict[str, list[TokenizedLog]]] = []
    # per item, its prefills in rounds: the prefills of one round do not continue each other
    jobs: list[list[list[tuple[str, TokenizedLog]]]] = []
    for item in items:
        logs.append({})
        jobs.append([])
        for h in used:
            if h not in item["histories"]:
                raise EventKVError(f"arm history {h!r} is not in the item (has {', '.join(item['histories'])}).")
            logs[-1][h] = pair = tokenize_pair(rt, instruction, item["histories"][h], item.get("pad", {}).get(h))
            n, everything = events_read(arms, item, pair[0], h)
            everything = everything or whole
            lead = pair if n is None else [_leading(log, n) for log in pair]
            shared = shared_log(lead) if shared_prefix else None
            variants = [[(f"{h}/0", lead[0])], [(f"{h}/1", lead[1])]]
            if shared is not None:  # both variants continue the shared events: one round
                jobs[-1] += [[("shared", shared)], variants[0] + variants[1]]
            else:  # variant B continues variant A's rows up to their first difference
                jobs[-1] += variants
            if everything and n is not None:  # the rest continues the lead: the lead's rows are the same either way
                jobs[-1].append([(f"{h}/0", pair[0]), (f"{h}/1", pair[1])])

    ekvs: list[dict[str, list[EventKV | None]]] = [{h: [None, None] for h in used} for _ in items]
    for r in range(max(len(j) for j in jobs)):
        todo: list[tuple[int, str, TokenizedLog, EventKV]] = []
        done: list[tuple[int, str, EventKV]] = []
        for i, item_jobs in enumerate(jobs):
            for what, log in item_jobs[r] if r < len(item_jobs) else ():
                have, prefix = caches[i].plan(log)
                if have is not None:
                    done.append((i, what, have))
                else:
                    todo.append((i, what, log, prefix))
        if todo:
            made = prefill_batch(
                rt.model,
                [(log, prefix) for _, _, log, prefix in todo],
                max_context=rt.max_context,
                weights_digest=rt.weights_digest,
            )
            done += [(i, what, caches[i].add(ekv)) for (i, what, _, _), ekv in zip(todo, made)]
        for i, what, ekv in done:
            if what != "shared":
                h, v = what.split("/")
                ekvs[i][h][int(v)] = ekv

    memo = _encode_isolated(rt, instruction, items, arms, logs)
    entries: list[tuple[int, str, tuple[int, ...], ServedCache]] = []  # (item, arm, variants, cache)
    served_rec: list[dict] = [{} for _ in items]
    qpos: list[dict] = [{} for _ in items]
    for i, item in enumerate(items):
        common = max(logs[i][h][0].history_end for h in used)
        for arm in arms:
            caches, qpos[i][arm.name], served_rec[i][arm.name] = _serve_arm(
                rt, item, arm, logs[i][arm.history], ekvs[i][arm.history], common, memo
            )
            entries += [(i, arm.name, vs, sc) for vs, sc in caches]

    cand_texts = [list(item["candidates"]) for item in items]
    cands = [[rt.encode(" " + c) for c in texts] for texts in cand_texts]
    groups: dict[tuple, list[int]] = {}
    queries: dict[tuple[int, str], list[int]] = {}
    for k, (i, name, _, _) in enumerate(entries):
        q = next(a for a in arms if a.name == name).question
        if q not in items[i]["questions"]:
            raise EventKVError(f"question {q!r} is not in the item (has {', '.join(items[i]['questions'])}).")
        if (i, q) not in queries:
            queries[i, q] = tokenize_query(rt.tokenizer, rt.profile, items[i]["questions"][q])
        key = (q, len(queries[i, q]), tuple(cand_texts[i]), tuple(map(tuple, cands[i])))
        groups.setdefault(key, []).append(k)
    results: list = [None] * len(entries)
    for (q, _, texts, cand_ids), ks in groups.items():
        res = read_out(
            rt.model,
            [entries[k][3] for k in ks],
            [queries[entries[k][0], q] for k in ks],
            generate=["generate" in readouts] * len(ks),
            score=["logits" in readouts] * len(ks),
            candidates=[list(c) for c in cand_ids],
            candidate_texts=list(texts),
            answer_prefix_ids=rt.encode(answer_prefix),
            max_new_tokens=max_new_tokens,
            stop_token_ids=rt.stop_token_ids,
            tokenizer=rt.tokenizer,
            max_context=rt.max_context,
        )
        for k, x in zip(ks, res):
            results[k] = x

    answers: list[dict[str, list[dict | None]]] = [{a.name: [None, None] for a in arms} for _ in items]
    for (i, name, vs, _), res in zip(entries, results):
        out: dict = {}
        if res.generation is not None:
            g = res.generation
            out.update(text=g.text, n_tokens=len(g.tokens))
            if record_stopped:
                out.update(stopped=g.stopped)
            out.update(answer=parses[i](g.text))
        if res.candidates:
            lps: dict[str, float] = {}
            for c in res.candidates:  # candidates that tokenize alike keep the first score
                lps.setdefault(c.text, c.logprob)
            out.update(logprobs=lps, choice=max(lps, key=lps.get))
        for v in vs:
            answers[i][name][v] = out

    runs = []
    for i, item in enumerate(items):
        a, b = item["values"]
        ca, cb = item.get("gold_candidates", item["values"])
        outcomes, d = {}, {}
        for arm in arms:
            A, B = answers[i][arm.name]
            outcomes[arm.name] = {}
            if "generate" in readouts:
                outcomes[arm.name]["generate"] = outcome(A["answer"], B["answer"], a, b)
            if "logits" in readouts:
                outcomes[arm.name]["logits"] = outcome(A["choice"], B["choice"], ca, cb)
                d[arm.name] = (
                    donor_d(A["logprobs"], B["logprobs"], ca, cb) if ca != cb and len(A["logprobs"]) > 1 else 0.0
                )
        runs.append(PairRun(logs[i], ekvs[i], answers[i], outcomes, d, qpos[i], served_rec[i]))
    return runs


def _encode_isolated(
    rt: Runtime, instruction: str, items: Sequence[dict], arms: Sequence[PairArm], logs: list[dict]
) -> dict[tuple, tuple]:
    """Every event an isolated arm serves, over all items and variants, encoded alone after the
    header in one forward (:func:`eventkv.batched.encode_alone`), as an ``isolated_memo`` for
    :func:`eventkv.serve.serve` (keyed by event id, first position and token ids)."""
    from eventkv.batched import encode_alone

    wanted: dict[tuple, tuple[list[int], int]] = {}
    for i, item in enumerate(items):
        for arm in arms:
            if arm.encoding != "isolated":
                continue
            for log in logs[i][arm.history]:
                for e in _served_ids(item, arm, logs[i][arm.history][0]):
                    tokens = log.event_tokens[log.event_ids.index(e)]
                    wanted.setdefault((e, log.span(e).pos_start, tuple(tokens)), (list(tokens), log.span(e).pos_start))
    if not wanted:
        return {}
    return dict(zip(wanted, encode_alone(rt.model, rt.header_kv(instruction), list(wanted.values()))))


def _served_ids(item: dict, arm: PairArm, log: TokenizedLog) -> list[str]:
    """The event ids ``arm`` serves from ``log`` (its history's variant A; the ids are the same in B).

    Raises:
        EventKVError: a role the arm serves that its history does not have.
    """
    if arm.served == "all":
        return list(log.event_ids)
    roles = item["roles"][arm.history]
    missing = [r for r in arm.served if r not in roles]
    if missing:
        raise EventKVError(f"arm {arm.name!r} serves role(s) {missing} missing from history {arm.history!r}.")
    return [event_id(roles[r]) for r in arm.served]


def _serve_arm(
    rt: Runtime,
    item: dict,
    arm: PairArm,
    logs: list[TokenizedLog],
    pair: list[EventKV],
    common: int,
    memo: dict | None = None,
) -> tuple[list[tuple[tuple[int, ...], ServedCache]], int, dict]:
    """One arm of one item: ``([(variants answered, served cache)], query position, served
    record)`` — one cache per variant, or one for both (an isolated arm whose served tokens are the
    same in both variants)."""
    log0 = logs[0]
    ids = _served_ids(item, arm, log0)
    swap = [event_id(item["roles"][arm.history][r]) for r in arm.swap]
    if arm.encoding == "prefill":
        caches = [
            (
                (v,),
                ServedCache(e.keys, e.values, e.positions, None, e.log.history_end, "prefill", tuple(e.log.event_ids)),
            )
            for v, e in enumerate(pair)
        ]
    elif arm.encoding == "isolated":
        idx = [log0.event_ids.index(e) for e in ids]
        if all(logs[0].event_tokens[j] == logs[1].event_tokens[j] for j in idx):
            # identical served tokens at identical positions: one encoding answers both variants
            caches = [((0, 1), serve(pair[0], ids, "isolated", model=rt.model, isolated_memo=memo))]
        else:
            caches = [((v,), serve(pair[v], ids, "isolated", model=rt.model, isolated_memo=memo)) for v in (0, 1)]
    elif swap:
        caches = [((v,), serve_mixed(pair[v], pair[1 - v], ids, swap)) for v in (0, 1)]
    else:
        caches = [((v,), serve(pair[v], ids, "compact")) for v in (0, 1)]
    p = common if arm.fixed_position else log0.history_end
    rec = {
        "events": ids if arm.served != "all" else "all",
        "swap": swap,
        "rows": [len(log.header_ids) + sum(log.span(e).n_tokens for e in ids) for log in logs],
    }
    return [(vs, dataclasses.replace(sc, next_position=p)) for vs, sc in caches], p, rec


def correct(record: dict, arm: str, readout: str, value_key: str = "values") -> list[bool]:
    """Per variant (A, B): did ``arm`` answer that variant's own value under ``readout``?"""
    key = "answer" if readout == "generate" else "choice"
    gold = record[value_key] if readout == "generate" else record.get("gold_candidates", record[value_key])
    return [record["arms"][arm][v].get(key) == g for v, g in zip(VARIANTS, gold)]


def pair_stats(records: Sequence[dict], arm: str, readout: str) -> dict:
    """Donor-pair statistics of one arm and readout over records (Study 1, "Donor pair"):
    outcome counts, the follow rate (pairs where both variants answered their own donor's value)
    with its Wilson 95% interval, prevalence (follow + anti), and the exact sign test follow vs anti."""
    from eventkv.stats import sign_test, wilson

    rs = [r for r in records if arm in r["outcomes"] and readout in r["outcomes"][arm]]
    c = {o: sum(1 for r in rs if r["outcomes"][arm][readout] == o) for o in OUTCOMES}
    n = len(rs)
    st = sign_test(c["follow"], c["anti"], ("follow", "anti"), name=f"{arm}/{readout}: exact sign test, follow vs anti")
    return {"n": n, **c, "rate": wilson(c["follow"], n), "prevalence": wilson(c["follow"] + c["anti"], n), "sign": st}


def primary_readout(readouts: Sequence[str]) -> str:
    """The readout contract figures are quoted on: candidate logits when run (Study 1: on older
    checkpoints free generation under-reports what the candidate probe finds), else generation."""
    return "logits" if "logits" in readouts else "generate"


def arm_table(
    records: Sequence[dict], arms: Sequence[PairArm], readouts: Sequence[str], caption: str, data: dict | None = None
):
    """One row per arm and readout: pairs, follow, anti, constant, other, the follow rate and the
    prevalence (follow + anti) with Wilson 95% intervals, and the exact sign test follow vs anti.
    Fills ``data[f"{arm}/{readout}"]`` when given."""
    from eventkv.probes.base import Table
    from eventkv.stats import format_p

    rows = []
    for a in arms:
        for ro in readouts:
            s = pair_stats(records, a.name, ro)
            if data is not None:
                data[f"{a.name}/{ro}"] = {
                    "n": s["n"],
                    "follow": s["follow"],
                    "anti": s["anti"],
                    "constant": s["constant"],
                    "other": s["other"],
                    "rate": s["rate"].__dict__,
                    "prevalence": s["prevalence"].__dict__,
                    "p": s["sign"].p_value,
                }
            rows.append(
                [
                    a.name,
                    ro,
                    str(s["n"]),
                    str(s["follow"]),
                    str(s["anti"]),
                    str(s["constant"]),
                    str(s["other"]),
                    s["rate"].describe(2),
                    s["prevalence"].describe(2),
                    format_p(s["sign"].p_value),
                ]
            )
    return Table(
        caption,
        [*OUTCOME_COLUMNS, "follow rate [Wilson 95%]", "sensitive [Wilson 95%]", "p (follow vs anti)"],
        rows,
    )


def d_stats(records: Sequence[dict], arm: str) -> dict | None:
    """Graded donor sensitivity of one arm (candidate readout): the donor statistic ``d`` of every
    pair (:func:`donor_d`, nats; d > 0 leans toward each variant's own
    unserved value), its median, the exact sign test d > 0 vs d < 0 (zeros dropped) and the
    two-sided Wilcoxon signed-rank test (``scipy.stats.wilcoxon``). ``None`` when no record has a
    ``d`` for ``arm`` (generation-only runs)."""
    from eventkv.stats import median, require_finite, sign_test_d, wilcoxon_d

    with_d = [(r.get("index", i), r["d"][arm]) for i, r in enumerate(records) if arm in r.get("d", {})]
    ds = require_finite(
        [x for _, x in with_d], f"donor statistic d of arm {arm!r}", labels=[f"item {i}" for i, _ in with_d]
    )
    if not ds:
        return None
    s, w = sign_test_d(ds), wilcoxon_d(ds)
    return {
        "n": len(ds),
        "median": median(ds),
        "pos": s.counts["d>0"],
        "neg": s.counts["d<0"],
        "zero": s.counts["d=0 dropped"],
        "sign_p": s.p_value,
        "wilcoxon_p": w.p_value,
    }


def describe_d(s: dict) -> str:
    """``d>0:d<0 = 27:5, median +0.125 nats`` for a :func:`d_stats` dict."""
    return f"d>0:d<0 = {s['pos']}:{s['neg']}, median {round(s['median'], 3) + 0.0:+.3f} nats"


def d_table(records: Sequence[dict], arms: Sequence[PairArm], caption: str, data: dict | None = None):
    """One row per arm with a candidate readout: pairs, median d, d>0, d<0, d=0, sign-test and
    Wilcoxon p (see :func:`d_stats`); fills ``data[f"d/{arm}"]``. ``None`` when no arm has d."""
    from eventkv.probes.base import Table
    from eventkv.stats import format_p

    rows = []
    for a in arms:
        s = d_stats(records, a.name)
        if s is None:
            continue
        if data is not None:
            data[f"d/{a.name}"] = s
        rows.append(
            [
                a.name,
                str(s["n"]),
                f"{round(s['median'], 3) + 0.0:+.3f}",
                str(s["pos"]),
                str(s["neg"]),
                str(s["zero"]),
                format_p(s["sign_p"]),
                format_p(s["wilcoxon_p"]),
            ]
        )
    if not rows:
        return None
    return Table(caption, ["arm", "pairs", "median d (nats)", "d>0", "d<0", "d=0", "p sign", "p Wilcoxon"], rows)


D_CAPTION = (
    "Graded donor shift d (candidate log-odds of each variant's own value, own minus other variant, nats; "
    "d > 0 leans toward the unserved source)"
)


def candidate_share(out: dict, candidate: str) -> float:
    """Probability share of ``candidate`` among the scored candidates (softmax of their log-probs)."""
    import math

    lps = out["logprobs"]
    m = max(lps.values())
    return math.exp(lps[candidate] - m) / sum(math.exp(v - m) for v in lps.values())
