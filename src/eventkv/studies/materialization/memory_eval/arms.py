"""The arm grid of ``eventkv memory eval`` (:mod:`eventkv.studies.materialization.memory_eval`): the arm
kinds and their serving, the budgets (parsed as the CLI takes them and labelled as arm names write them),
arm names to and from :class:`ArmSpec`, how one arm of a question is served (:class:`ArmPlan`), and the
readout batches by length (:func:`length_groups`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from eventkv.errors import OptionError

#: the recompute schedule (``blend_schedule``) of each blend kind; None: the serve mode's default
BLEND_SCHEDULE = {"blend": None, "blend-layerwise": "layerwise", "blend-epic": "epic", "blend-suffix": "suffix"}
#: the kinds of arm; ``arm_names`` picks among them (``rows`` required)
ARM_KINDS = ("rows", "text", "isolated", *BLEND_SCHEDULE, "full", "gold")
DEFAULT_KINDS = ("rows", "text", "isolated", "full", "gold")
#: kinds served from the control selectors' sets besides their rows
CONTROL_KINDS = ("text", "isolated", *BLEND_SCHEDULE)
#: kinds whose served cache depends on the positions mode
POSITIONED = ("rows", "isolated", *BLEND_SCHEDULE)
#: the serve mode of each kind
SERVE_MODE = {
    "rows": "compact",
    "text": "text",
    "isolated": "isolated",
    **dict.fromkeys(BLEND_SCHEDULE, "blend"),
    "full": "compact",
    "gold": "text",
}
#: the order selectors are listed in (others follow, by name); the fused one is the default control
SELECTOR_ORDER = ("bm25", "dense", "attention", "hybrid", "rerank")
FUSED = "hybrid"
DEFAULT_BUDGETS = (0.025, 0.05, 0.1, 0.2)
POSITIONS = ("original", "contiguous", "both")


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
    """The :class:`ArmSpec` named ``kind[:selector@budget][/contiguous]`` (see the package docstring)."""
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
