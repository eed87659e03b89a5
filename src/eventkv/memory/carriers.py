"""Programmed carriers for the memory (Study 1, "Programmed carriers" and "The memory contract").

A **carrier** is an answer-free event written on purpose after its source events, so that its
rows, computed by the global prefill with the sources in view, can carry their state after the
sources are no longer served. The memory writes the same four answer-free kinds the contract
battery measures (:mod:`eventkv.studies.materialization.carriers`), phrased about a *subject* and the *source
events* instead of a register and a step:

* ``passive`` — ``note: {subject} was recorded earlier in this log``;
* ``binding`` — ``{subject} keeps what was written about it in event(s) {ids}``;
* ``directive`` — ``[remember] {subject}``;
* ``compute`` — ``note: to answer about {subject} later, look back at event(s) {ids} and take what
  is written there``.

None of them states a value: a carrier may be served alone without leaking an answer, and
whether it carries anything is an empirical property of the checkpoint. That is what the
contract measures, so ``kind="auto"`` reads the model's ``contract.json``
(:func:`choose_kind`): the answer-free kind whose graded donor shift ``d`` (carrier served alone
beside the decoy, candidate log-odds, nats) is largest among those significantly above 0; where
none is — or where no contract was measured for this checkpoint — no carrier is written and the
memory pins the sources' text instead (the study's fallback: explicit text always works).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from eventkv.errors import EventKVError, OptionError
from eventkv.options import CARRIER_KINDS

#: significance level of the one-sided reading of the contract's tests (Wilcoxon p on d, median > 0)
ALPHA = 0.05


def carrier_text(kind: str, subject: str, source_ids: Sequence[str]) -> str:
    """The text of an answer-free carrier of ``kind`` about ``subject``, referring to its source
    events by id.

    Raises:
        OptionError: an unknown kind, an empty subject or no source ids.
    """
    write = CARRIER_KINDS.get(kind)  # the answer-free kinds, listed in eventkv.options
    if not isinstance(subject, str) or not subject.strip():
        raise OptionError("subject", subject, "name what the carrier is about (e.g. 'the user's home city').")
    ids = [str(i) for i in source_ids]
    if not ids:
        raise OptionError("sources", list(source_ids), "give the ids of the events the carrier is about.")
    refs = ("event " if len(ids) == 1 else "events ") + ", ".join(ids)
    return write(subject.strip(), refs)


def passive(subject: str, refs: str) -> str:
    """A passive note: ``note: {subject} was recorded earlier in this log`` (``refs`` unused)."""
    return f"note: {subject} was recorded earlier in this log"


def binding(subject: str, refs: str) -> str:
    """A binding sentence: ``{subject} keeps what was written about it in {refs}``."""
    return f"{subject} keeps what was written about it in {refs}"


def directive(subject: str, refs: str) -> str:
    """A directive tag: ``[remember] {subject}`` (``refs`` unused)."""
    return f"[remember] {subject}"


def compute(subject: str, refs: str) -> str:
    """A compute note: ``note: to answer about {subject} later, look back at {refs} and take what is
    written there``."""
    return f"note: to answer about {subject} later, look back at {refs} and take what is written there"


@dataclass(frozen=True)
class KindChoice:
    """What ``kind="auto"`` decided and why.

    Attributes:
        kind: the carrier kind to write, or None (write none: pin the sources' text instead).
        reason: one sentence naming the contract's figures behind the choice.
        median_d: the chosen kind's median donor shift (nats), or None.
        p_value: its Wilcoxon p on d, or None.
    """

    kind: str | None
    reason: str
    median_d: float | None = None
    p_value: float | None = None


def read_contract(contract: str | Path | dict) -> dict:
    """A ``contract.json`` (path or already-parsed dict) as a dict.

    Raises:
        EventKVError: a missing or unreadable file, or JSON that is not a contract (no
            ``programming`` section).
    """
    if isinstance(contract, dict):
        data = contract
    else:
        path = Path(contract)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise EventKVError(
                f"contract {str(path)!r} does not exist: give the contract.json written by 'eventkv contract'."
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise EventKVError(
                f"contract {str(path)!r} is not readable JSON ({exc}): run 'eventkv contract' again."
            ) from None
    if not isinstance(data, dict) or "programming" not in data:
        raise EventKVError(
            "the contract has no 'programming' section: give the contract.json of a full 'eventkv contract' run "
            "(its carriers probe measures the carrier kinds)."
        )
    return data


def check_contract(contract: str | Path | dict, weights_digest: str | None, model: str | None = None) -> dict:
    """The contract as a dict, after checking it was measured on this checkpoint: its
    ``provenance.weights_digest`` equals ``weights_digest``; a contract without a digest (written
    before eventkv recorded one) must name the same model (``model``, the name given to ``load``).

    Raises:
        EventKVError: unreadable, not a contract, or measured on another checkpoint.
    """
    data = read_contract(contract)
    measured = (data.get("provenance") or {}).get("weights_digest")
    if measured is not None and weights_digest is not None and measured != weights_digest:
        raise EventKVError(
            f"the contract was measured on weights {measured[:12]} but this memory's model is {weights_digest[:12]}: "
            "run 'eventkv contract' on this model and give its contract.json."
        )
    if measured is None and model is not None and data.get("model") != model:
        raise EventKVError(
            f"the contract was measured on {data.get('model')!r} (it records no weights digest) but this memory's "
            f"model is {model!r}: run 'eventkv contract --model {model}' and give its contract.json."
        )
    return data


def choose_kind(
    contract: str | Path | dict | None, weights_digest: str | None = None, model: str | None = None
) -> KindChoice:
    """The carrier kind ``kind="auto"`` writes on this checkpoint (Study 1, "Programmed carriers").

    Reads ``programming.d`` of ``contract.json``: for each answer-free kind, the donor shift ``d``
    with the carrier served alone (``d/<kind>``: median in nats, Wilcoxon p). A kind qualifies when
    its median is > 0 and its Wilcoxon p < :data:`ALPHA`; the qualifying kind with the largest
    median is chosen. No contract, a contract without the graded readout, or no qualifying kind:
    ``kind=None`` (the caller pins the sources' text instead).

    Args:
        contract: a contract.json path or dict, or None.
        weights_digest: the memory's model digest; when the contract records another one (its
            ``provenance.weights_digest``), the contract is refused — it was measured on another
            checkpoint.
        model: the memory's model name; checked instead when the contract records no digest.

    Raises:
        EventKVError: an unreadable contract, or one measured on other weights.
    """
    if contract is None:
        return KindChoice(None, "no contract.json was given: the sources' text is pinned instead (the fallback).")
    data = check_contract(contract, weights_digest, model)
    d = (data["programming"] or {}).get("d") or {}
    candidates = []
    for kind in CARRIER_KINDS:
        stats = d.get(kind)
        if not stats or stats.get("median") is None or stats.get("wilcoxon_p") is None:
            continue
        if stats["median"] > 0 and stats["wilcoxon_p"] < ALPHA:
            candidates.append((stats["median"], kind, stats["wilcoxon_p"]))
    model = data.get("model", "this model")
    if not d:
        return KindChoice(
            None, f"the contract of {model} has no graded readout (d): the sources' text is pinned instead."
        )
    if not candidates:
        return KindChoice(
            None,
            f"no answer-free carrier kind has a donor shift d significantly above 0 in the contract of {model} "
            f"(Wilcoxon p < {ALPHA}, median > 0): the sources' text is pinned instead (the study's fallback).",
        )
    median, kind, p = max(candidates, key=lambda c: (c[0], -CARRIER_KINDS.names().index(c[1])))
    return KindChoice(
        kind,
        f"{kind}: the largest significant donor shift in the contract of {model} "
        f"(median d = {median:+.3f} nats, Wilcoxon p = {p:.2g}).",
        float(median),
        float(p),
    )


@dataclass(frozen=True)
class CarrierPlan:
    """What :meth:`eventkv.memory.EventMemory.carrier` writes: ``kind`` (None: no carrier, the sources
    are pinned instead), ``text`` (the carrier's text; None with no kind) and ``reason`` (why)."""

    kind: str | None
    text: str | None
    reason: str


def plan_carrier(
    kind: str,
    subject: str,
    source_ids: Sequence[str],
    contract: str | Path | dict | None,
    weights_digest: str,
    model: str,
) -> CarrierPlan:
    """The carrier for ``subject`` about ``source_ids``: ``kind="auto"`` takes the kind the contract
    qualifies (:func:`choose_kind`; none: the sources are pinned, the study's fallback), any other
    kind is the caller's.

    Raises:
        OptionError: an unknown kind, an empty subject, no sources (checked for a pin too).
        EventKVError: a contract that cannot be read or was measured on other weights.
    """
    if kind == "auto":
        choice = choose_kind(contract, weights_digest, model)
        chosen, reason = choice.kind, choice.reason
    else:
        chosen, reason = kind, f"{kind}: chosen by the caller."
    if chosen is None:
        carrier_text("passive", subject, source_ids)  # the same argument checks as a written carrier
        return CarrierPlan(None, None, reason)
    return CarrierPlan(chosen, carrier_text(chosen, subject, source_ids), reason)
