"""Budgets that vary per layer and per head, as policies in the :class:`eventkv.eviction.policies.Policy`
contract (its :meth:`~eventkv.eviction.policies.Policy.budget` and :meth:`~eventkv.eviction.policies.Policy.mask`),
each wrapping or extending a scoring rule, and the compositions kvpress offers:

* :class:`AdaKV` — one budget per layer shared out among its heads by their scores (per-head budgets);
* :class:`PerLayerRatio` — a compression ratio per layer (kvpress's PerLayerCompressionPress);
* :class:`PerLayer` — a policy per layer.

A per-head rule keeps ``heads * kept_count(rows, ratio)`` rows on a layer, spread unevenly over its heads; a
per-layer rule changes the count per layer. The masks :func:`eventkv.eviction.keep_mask` returns hold each
head's own kept rows either way, which is what the audit's masked readout serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from eventkv.errors import OptionError
from eventkv.eviction.policies import LayerCapture, Policy, SnapKV, kept_count, top_rows


def _check_policy(name: str, value) -> None:
    if not isinstance(value, Policy):
        raise OptionError(name, value, "give a policy, e.g. SnapKV(window=8, kernel=5).")


def _layer_of(c: LayerCapture, n: int, what: str) -> int:
    """``c.layer``, checked against the ``n`` per-layer entries given. Raises: OptionError: too few."""
    if c.layer >= n:
        raise OptionError(what, n, f"give one per layer: layer {c.layer} has none (give at least {c.layer + 1}).")
    return c.layer


@dataclass
class AdaKV(Policy):
    """Adaptive per-head budgets (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
    Allocation for Efficient LLM Inference", arXiv 2407.11550, Section 4: a layer's budget goes to the rows
    with the highest scores across all its heads, so a head whose attention is concentrated keeps few rows and a
    dispersed one many; kvpress's AdaKVPress). The layer keeps ``heads * kept_count(rows, ratio)`` rows: first,
    each head's best ``int(alpha * kept_count)`` rows (the safeguard, so that no head is emptied), then the
    best-scored of the remaining (head, row) cells across the heads. ``inner`` scores; its own budget is not used.

    Ties between cells of equal score go to the later position, then to the lower head.

    Raises:
        OptionError: ``inner`` not a policy, ``alpha`` not in [0, 1] (on construction); as ``inner`` on scoring.
    """

    name: ClassVar[str] = "adakv"
    inner: Policy = field(default_factory=SnapKV)
    alpha: float = 0.2

    def __post_init__(self) -> None:
        _check_policy("inner", self.inner)
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 <= a <= 1:
            raise OptionError("alpha", a, "give the safeguard fraction in [0, 1] (Ada-KV uses 0.2).")

    @property
    def needs_all_queries(self) -> bool:
        return self.inner.needs_all_queries

    def scores(self, c: LayerCapture) -> torch.Tensor:
        return self.inner.checked_scores(c)

    def mask(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        n = kept_count(c.rows, ratio)
        s = self.checked_scores(c)
        safe = top_rows(s, c.positions, int(n * self.alpha))
        # the safeguard's cells first, then every other cell by score; ties: later position, then lower head
        order = torch.argsort(c.positions, descending=True, stable=True)
        heads, rows = s.shape
        flat_s = torch.where(safe, float("inf"), s)[:, order].T.reshape(-1)  # row-major over (position, head)
        best = torch.argsort(flat_s, descending=True, stable=True)[: heads * n]
        mask = torch.zeros(rows * heads, dtype=torch.bool, device=s.device)
        mask[best] = True
        out = torch.zeros(heads, rows, dtype=torch.bool, device=s.device)
        out[:, order] = mask.reshape(rows, heads).T
        return out

    def budget(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        """``[kv_heads]``: the rows each head keeps under :meth:`mask` (they sum to ``heads * kept_count``)."""
        return self.mask(c, ratio).sum(dim=1)


@dataclass
class PerLayerRatio(Policy):
    """A compression ratio per layer (kvpress's PerLayerCompressionPress): layer ``l`` keeps
    ``kept_count(rows, ratios[l])`` rows per head, scored by ``inner``; the ratio the audit gives is not used
    (empty ``ratios``: the audit's ratio in every layer, ``inner`` as it is).

    Raises:
        OptionError: ``inner`` not a policy, a ratio outside [0, 1) (on construction); a layer past the list
            (on scoring).
    """

    name: ClassVar[str] = "per-layer-ratio"
    inner: Policy = field(default_factory=SnapKV)
    ratios: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        _check_policy("inner", self.inner)
        self.ratios = tuple(self.ratios)
        for r in self.ratios:
            kept_count(1, r)  # raises OptionError naming the bad ratio

    def scores(self, c: LayerCapture) -> torch.Tensor:
        return self.inner.checked_scores(c)

    @property
    def needs_all_queries(self) -> bool:
        return self.inner.needs_all_queries

    def budget(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        if self.ratios:
            ratio = self.ratios[_layer_of(c, len(self.ratios), "ratios")]
        return torch.full((c.kv_heads,), kept_count(c.rows, ratio), dtype=torch.long)

    def mask(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        return self.inner.keep(c, self.budget(c, ratio))


@dataclass
class PerLayer(Policy):
    """A policy per layer (kvpress composes presses per layer the same way): layer ``l`` is scored, budgeted
    and masked by ``policies[l]`` at the audit's ratio.

    Raises:
        OptionError: ``policies`` empty or holding a non-policy (on construction); a layer past the list.
    """

    name: ClassVar[str] = "per-layer"
    policies: tuple[Policy, ...] = ()

    def __post_init__(self) -> None:
        self.policies = tuple(self.policies)
        if not self.policies:
            raise OptionError("policies", self.policies, "give one policy per layer.")
        for p in self.policies:
            _check_policy("policies", p)

    @property
    def needs_all_queries(self) -> bool:
        return any(p.needs_all_queries for p in self.policies)

    def _at(self, c: LayerCapture) -> Policy:
        return self.policies[_layer_of(c, len(self.policies), "policies")]

    def scores(self, c: LayerCapture) -> torch.Tensor:
        return self._at(c).checked_scores(c)

    def budget(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        return self._at(c).budget(c, ratio)

    def mask(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        return self._at(c).mask(c, ratio)
