"""Budgets that vary per layer and per head, as policies in the :class:`eventkv.eviction.policies.Policy`
contract (its :meth:`~eventkv.eviction.policies.Policy.budget` and :meth:`~eventkv.eviction.policies.Policy.mask`),
each wrapping or extending a scoring rule, and the compositions kvpress offers:

* :class:`AdaKV` — one budget per layer shared out among its heads by their scores (per-head budgets);
* :class:`PerLayerRatio` — a compression ratio per layer (kvpress's PerLayerCompressionPress);
* :class:`PerLayer` — a policy per layer;
* :class:`PyramidKV` — SnapKV's scores with budgets that shrink from the bottom layer to the top;
* :class:`CriticalKV`, :class:`CriticalAdaKV` — a row weighed by what its value moves in the layer's output;
* :class:`ChunkKV` — whole chunks of consecutive rows;
* :class:`Composed` — policies one after the other;
* :class:`DuoAttention` — retrieval heads keep every row, streaming heads their sinks and recent rows.

A per-head rule keeps ``heads * kept_count(rows, ratio)`` rows on a layer, spread unevenly over its heads; a
per-layer rule changes the count per layer. The masks :func:`eventkv.eviction.keep_mask` returns hold each
head's own kept rows either way, which is what the audit's masked readout serves.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from eventkv.errors import OptionError
from eventkv.eviction.policies import (
    LayerCapture,
    Policy,
    SnapKV,
    kept_count,
    per_kv_head,
    top_rows,
    window_attention,
)
from eventkv.options import check_int

#: what the compression ratio is for most policies (:meth:`Policy.ratio_use` returns "" for it)
ROWS_EVICTED = "the fraction of each KV head's rows evicted"


def _reading(policy: Policy) -> str:
    """``name: how it reads the ratio``, for a member named in its wrapper's :meth:`Policy.ratio_use`."""
    return f"{policy.name}: {policy.ratio_use() or ROWS_EVICTED}"


#: how a policy with Ada-KV's per-head budgets reads the compression ratio (:meth:`Policy.ratio_use`)
_SHARED_BY_HEADS = "the fraction of each layer's rows evicted, shared out unevenly among its KV heads"


def _check_policy(name: str, value) -> None:
    if not isinstance(value, Policy):
        raise OptionError(name, value, "give a policy, e.g. SnapKV(window=8, kernel=5).")


def _check_per_layer(what: str, given: int, n_layers: int, policy: Policy) -> None:
    """Raises OptionError unless ``given`` entries of ``what`` match a model of ``n_layers`` layers."""
    if given != n_layers:
        raise OptionError(
            what,
            given,
            f"{policy.name} takes one entry per layer and the model has {n_layers} layers: give {n_layers}.",
        )


def _check_policies(value, what: str) -> tuple[Policy, ...]:
    """``value`` as a tuple of policies. Raises: OptionError: an empty one (``what`` says what to give) or a
    non-policy in it."""
    policies = tuple(value)
    if not policies:
        raise OptionError("policies", policies, what)
    for p in policies:
        _check_policy("policies", p)
    return policies


def _layer_of(c: LayerCapture, n: int, what: str) -> int:
    """``c.layer``, checked against the ``n`` per-layer entries given. Raises: OptionError: too few."""
    if c.layer >= n:
        fix = f"give {c.n_layers}, one per layer of the model" if c.n_layers else f"give at least {c.layer + 1}"
        raise OptionError(what, n, f"give one entry per layer: layer {c.layer} has none ({fix}).")
    return c.layer


def safeguard(n_keep: int, alpha: float) -> int:
    """The rows every head keeps first under a shared layer budget: ``int(n_keep * alpha)``, at least 1 when
    ``alpha`` > 0 and ``n_keep`` > 0 (kvpress's AdaKVPress rounds the same way)."""
    n = int(n_keep * alpha)
    return max(n, 1) if alpha > 0 and n_keep > 0 else n


def top_cells(s: torch.Tensor, positions: torch.Tensor, total: int) -> torch.Tensor:
    """``[heads, rows]`` bool: the ``total`` highest of all (head, row) cells of ``s [heads, rows]`` together;
    equal scores to the later position, then to the lower head."""
    heads, rows = s.shape
    order = torch.argsort(positions.to(s.device), descending=True, stable=True)
    flat = s[:, order].T.reshape(-1)  # position-major: (latest position, head 0), (latest, head 1), ...
    best = torch.argsort(flat, descending=True, stable=True)[:total]
    keep = torch.zeros(rows * heads, dtype=torch.bool, device=s.device)
    keep[best] = True
    out = torch.zeros(heads, rows, dtype=torch.bool, device=s.device)
    out[:, order] = keep.reshape(rows, heads).T
    return out


@dataclass
class AdaKV(Policy):
    """Adaptive per-head budgets (Feng et al., "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget
    Allocation for Efficient LLM Inference", arXiv 2407.11550, Section 4: a layer's budget goes to the rows
    with the highest scores across all its heads, so a head whose attention is concentrated keeps few rows and a
    dispersed one many; kvpress's AdaKVPress). The layer keeps ``heads * kept_count(rows, ratio)`` rows: first,
    each head's best :func:`safeguard` rows (``int(alpha * kept_count)``, at least 1 when ``alpha`` > 0, so that
    no head is emptied), then the best-scored of the remaining (head, row) cells across the heads. ``inner``
    scores; its own budget is not used.

    Ties between cells of equal score go to the later position, then to the lower head.

    Raises:
        OptionError: ``inner`` not a policy, ``alpha`` not in [0, 1] (on construction); as ``inner`` on scoring.
    """

    name: ClassVar[str] = "adakv"
    inner: Policy = field(default_factory=SnapKV)
    alpha: float = 0.2

    def __post_init__(self) -> None:
        self.check_inner("inner", self.inner, "snapkv")
        _check_fraction("alpha", self.alpha, "the safeguard fraction (Ada-KV uses 0.2)")

    def scores(self, c: LayerCapture) -> torch.Tensor:
        return self.inner.checked_scores(c)

    def mask(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        n = kept_count(c.rows, ratio)
        s = self.checked_scores(c)
        safe = top_rows(s, c.positions, safeguard(n, self.alpha))
        return top_cells(torch.where(safe, float("inf"), s), c.positions, c.kv_heads * n)

    def budget(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        """``[kv_heads]``: the rows each head keeps under :meth:`mask` (they sum to ``heads * kept_count``)."""
        return self.mask(c, ratio).sum(dim=1)

    def ratio_use(self) -> str:
        return _SHARED_BY_HEADS


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
        self.check_inner("inner", self.inner, "snapkv")
        self.ratios = tuple(self.ratios)
        for r in self.ratios:
            kept_count(1, r)  # raises OptionError naming the bad ratio

    def scores(self, c: LayerCapture) -> torch.Tensor:
        return self.inner.checked_scores(c)

    def _ratio(self, c: LayerCapture, ratio: float) -> float:
        """Layer ``c``'s own ratio from the list, or ``ratio`` (the audit's) when the list is empty."""
        return self.ratios[_layer_of(c, len(self.ratios), "ratios")] if self.ratios else ratio

    def budget(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        n = kept_count(c.rows, self._ratio(c, ratio))
        return torch.full((c.kv_heads,), n, dtype=torch.long, device=c.keys.device)

    def mask(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        return self.inner.keep(c, self.budget(c, ratio))

    def key_channels(self, c: LayerCapture, ratio: float) -> torch.Tensor | None:
        return self.inner.key_channels(c, self._ratio(c, ratio))

    def check_layers(self, n_layers: int) -> None:
        if self.ratios:
            _check_per_layer("ratios", len(self.ratios), n_layers, self)
        super().check_layers(n_layers)

    def ratio_use(self) -> str:
        return "not read: each layer evicts its own ratio of the list" if self.ratios else self.inner.ratio_use()


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
        self.policies = _check_policies(self.policies, "give one policy per layer.")

    def _at(self, c: LayerCapture) -> Policy:
        return self.policies[_layer_of(c, len(self.policies), "policies")]

    def scores(self, c: LayerCapture) -> torch.Tensor:
        return self._at(c).checked_scores(c)

    def budget(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        return self._at(c).budget(c, ratio)

    def mask(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        return self._at(c).mask(c, ratio)

    def key_channels(self, c: LayerCapture, ratio: float) -> torch.Tensor | None:
        return self._at(c).key_channels(c, ratio)

    def ranks_rows(self) -> bool:
        return all(p.ranks_rows() for p in self.policies)

    def check_layers(self, n_layers: int) -> None:
        _check_per_layer("policies", len(self.policies), n_layers, self)
        super().check_layers(n_layers)

    def ratio_use(self) -> str:
        if not any(p.ratio_use() for p in self.policies):
            return ""
        uses = dict.fromkeys(_reading(p) for p in self.policies)
        return f"as each layer's policy reads it ({'; '.join(uses)})"


def _value_effect(c: LayerCapture, who: str) -> torch.Tensor:
    """``[kv_heads, rows]`` float64: how much each row's value moves the layer's output — per query head the
    L1 norm of the value row projected through that head's slice of the output projection, averaged over each
    GQA group (CriticalKV's output-perturbation term)."""
    if c.out_proj is None:
        raise OptionError("policy", who, "it weighs rows by the output projection: capture it (capture_prefill does).")
    w = c.out_proj.detach().double().cpu()  # [hidden, q_heads * head_dim]
    d = c.values.shape[-1]
    q_heads = w.shape[1] // d
    w = w.reshape(w.shape[0], q_heads, d)  # [hidden, q_heads, head_dim]
    v = c.values.double().cpu().repeat_interleave(q_heads // c.kv_heads, dim=0)  # [q_heads, rows, head_dim]
    effect = torch.einsum("hrd,xhd->hrx", v, w).abs().sum(dim=-1)  # [q_heads, rows]
    return per_kv_head(effect, c.kv_heads).to(c.keys.device)


@dataclass
class CriticalKV(Policy):
    """Critical rows by output perturbation (Feng et al., "Identify Critical KV Cache in LLM Inference from an
    Output Perturbation Perspective", arXiv 2502.03805, Sections 3-4: a row matters by its attention weight times
    how far its value, through the output projection, moves the layer's output; kvpress's CriticalKVPress).
    Two stages per head: the best ``int((1 - ratio) * rows * first_stage)`` rows by ``inner``'s scores
    (at least 1) are kept outright; the rest of the :func:`~eventkv.eviction.policies.kept_count` budget goes to
    the best by ``(score + epsilon) * N``, N the value rows' L1 norm through each query head's slice of the
    output projection, averaged over the GQA group.

    Raises:
        OptionError: ``inner`` not a policy, ``epsilon`` not a finite number >= 0, ``first_stage`` not in [0, 1]
            (on construction); a capture without the output projection (on scoring).
    """

    name: ClassVar[str] = "criticalkv"
    inner: Policy = field(default_factory=SnapKV)
    epsilon: float = 1e-4
    first_stage: float = 0.5

    def __post_init__(self) -> None:
        self.check_inner("inner", self.inner, "snapkv")
        _check_fraction("first_stage", self.first_stage, "the share of the budget kept by the inner scores alone")
        e = self.epsilon
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 <= e < float("inf"):
            raise OptionError("epsilon", e, "give a finite number >= 0 (CriticalKV uses 1e-4).")

    def scores(self, c: LayerCapture) -> torch.Tensor:
        s = self.inner.checked_scores(c)
        return (s + self.epsilon) * _value_effect(c, self.name)

    def first(self, c: LayerCapture, ratio: float) -> int:
        """The rows each head keeps by ``inner``'s scores alone at ``ratio``."""
        n = int((1 - ratio) * c.rows * self.first_stage)
        return max(n, 1) if self.first_stage > 0 else n

    def mask(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        n = kept_count(c.rows, ratio)
        s = self.inner.checked_scores(c)
        outright = top_rows(s, c.positions, self.first(c, ratio))
        return top_rows(torch.where(outright, float("inf"), self.scores(c)), c.positions, n)


@dataclass
class CriticalAdaKV(CriticalKV):
    """CriticalKV with Ada-KV's per-head budgets (arXiv 2502.03805, Section 4; kvpress's CriticalAdaKVPress):
    each head's budget is the count :class:`AdaKV` gives it (safeguard ``alpha``, then the layer's best cells
    across heads); within it, the best ``max(safeguard, int(budget * first_stage))`` rows by ``inner``'s scores
    are kept outright and the rest go by ``(score + epsilon) * N``.

    Raises:
        OptionError: as :class:`CriticalKV`, and ``alpha`` not in [0, 1].
    """

    name: ClassVar[str] = "criticaladakv"
    alpha: float = 0.2

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_fraction("alpha", self.alpha, "the safeguard fraction (Ada-KV uses 0.2)")

    def mask(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        n = kept_count(c.rows, ratio)
        s = self.inner.checked_scores(c)
        safe = safeguard(n, self.alpha)
        budgets = top_cells(torch.where(top_rows(s, c.positions, safe), float("inf"), s), c.positions, c.kv_heads * n)
        budgets = budgets.sum(dim=1)
        first = (budgets.double() * self.first_stage).long().clamp(min=safe)
        outright = top_rows(s, c.positions, first)
        return top_rows(torch.where(outright, float("inf"), self.scores(c)), c.positions, budgets)

    def ratio_use(self) -> str:
        return _SHARED_BY_HEADS


def _check_fraction(name: str, value, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise OptionError(name, value, f"give {what} in [0, 1].")


@dataclass
class PyramidKV(SnapKV):
    """Pyramidal per-layer budgets over SnapKV's scores (Cai et al., "PyramidKV: Dynamic KV Cache Compression
    based on Pyramidal Information Funneling", arXiv 2406.02069, Section 3.3: lower layers attend broadly and
    keep more rows, higher layers fewer; kvpress's PyramidKVPress, which follows the authors' KVCache-Factory).
    With ``C = window + rows * (1 - ratio)``, the top layer keeps ``(C - window) / beta`` and the bottom
    ``2 (C - window)`` less that, the bottom clipped to ``rows - window`` (the top raised to keep the sum); layer
    ``l`` of ``L`` keeps ``round(bottom - l (bottom - top) / (L - 1))`` rows per head, the window's among them.
    Where that schedule does not fit (``rows >= bottom >= top >= window`` fails) every layer keeps
    ``max(1, round(rows * (1 - ratio)))``. Python's round (half to even), as kvpress.

    Raises:
        OptionError: as :class:`~eventkv.eviction.policies.SnapKV`, and ``beta`` not a number >= 1; a capture
            that does not say the model's layer count (on scoring).
    """

    name: ClassVar[str] = "pyramidkv"
    beta: float = 20.0

    def __post_init__(self) -> None:
        super().__post_init__()
        b = self.beta
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 1 <= b < float("inf"):
            raise OptionError("beta", b, "give a number >= 1: the bottom-to-top budget ratio's scale (PyramidKV: 20).")

    def budget(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        kept_count(c.rows, ratio)  # checks the ratio
        if c.n_layers is None:
            raise OptionError("policy", self.name, "its budgets vary by layer: capture the model's layer count.")
        n, w, layers = c.rows, self.window, c.n_layers
        capacity = w + n * (1 - ratio)
        top = (capacity - w) / self.beta
        bottom = (capacity - w) * 2 - top
        if bottom >= n - w:
            bottom = n - w
            top = (capacity - w) * 2 - bottom
        if not n >= bottom >= top >= w:
            keep = max(1, round(n * (1 - ratio)))
        else:
            step = (bottom - top) / (layers - 1) if layers > 1 else 0.0
            keep = round(bottom - c.layer * step)
        return torch.full((c.kv_heads,), keep, dtype=torch.long, device=c.keys.device)

    def ratio_use(self) -> str:
        return "the fraction of rows evicted over all layers together: lower layers keep more, higher fewer"


@dataclass
class ChunkKV(Policy):
    """Whole chunks of consecutive rows (Liu et al., "ChunkKV: Semantic-Preserving KV Cache Compression for
    Efficient Long-Context LLM Inference", arXiv 2502.00299, Section 3: a chunk of neighbouring tokens carries a
    phrase's meaning together, so it is kept or evicted together; kvpress's ChunkKVPress). The rows in position
    order are cut into chunks of ``chunk`` (the last one shorter when ``chunk`` does not divide them); a chunk's
    score is the mean over its rows of ``inner``'s scores summed over the KV heads; the best
    ``max(1, int(chunks * (1 - ratio)))`` chunks are kept, the same rows in every head (so the kept count is a
    multiple of ``chunk``, plus the short chunk's when it is kept). Fewer rows than one chunk: ``inner`` alone.

    Raises:
        OptionError: ``inner`` not a policy, ``chunk`` not a whole number >= 1 (on construction).
    """

    name: ClassVar[str] = "chunkkv"
    inner: Policy = field(default_factory=SnapKV)
    chunk: int = 20

    def __post_init__(self) -> None:
        self.check_inner("inner", self.inner, "snapkv")
        check_int("chunk", self.chunk, "give the chunk length in rows, a whole number >= 1 (ChunkKV: 10-20).")

    def scores(self, c: LayerCapture) -> torch.Tensor:
        return self.inner.checked_scores(c)

    def mask(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        if c.rows < self.chunk:
            return self.inner.mask(c, ratio)
        kept_count(c.rows, ratio)  # checks the ratio
        order = torch.argsort(c.positions, stable=True)  # rows by position
        summed = self.checked_scores(c).sum(dim=0)[order]
        starts = list(range(0, c.rows, self.chunk))
        chunk_scores = torch.stack([summed[i : i + self.chunk].mean() for i in starts])
        n = max(1, int(len(starts) * (1 - ratio)))
        # the best chunks; equal scores to the later chunk
        best = torch.argsort(chunk_scores.flip(0), descending=True, stable=True)[:n]
        keep = torch.zeros(c.rows, dtype=torch.bool, device=c.keys.device)
        for i in (len(starts) - 1 - best).tolist():
            keep[order[starts[i] : starts[i] + self.chunk]] = True
        return keep.expand(c.kv_heads, -1).clone()

    def budget(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        return self.mask(c, ratio).sum(dim=1)


@dataclass
class Composed(Policy):
    """Policies applied one after the other (kvpress's ComposedPress): each head keeps what the first policy
    keeps of it at the ratio, then what the next keeps of those rows at the same ratio, and so on (so the
    compression compounds: ``1 - (1 - ratio)^k`` of the rows go). A later policy scores only the rows left,
    with the observation window's queries of the head's GQA group.

    Raises:
        OptionError: ``policies`` empty or holding a non-policy (on construction).
    """

    name: ClassVar[str] = "composed"
    policies: tuple[Policy, ...] = ()

    def __post_init__(self) -> None:
        self.policies = _check_policies(self.policies, "give the policies to apply, first to last.")

    def scores(self, c: LayerCapture) -> torch.Tensor:
        return self.policies[0].checked_scores(c)

    def mask(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        keep = self.policies[0].mask(c, ratio)
        for p in self.policies[1:]:
            nxt = torch.zeros_like(keep)
            for h in range(c.kv_heads):
                rows = torch.nonzero(keep[h]).flatten()
                nxt[h, rows] = p.mask(_one_head(c, h, rows), ratio)[0]
            keep = nxt
        return keep

    def budget(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        return self.mask(c, ratio).sum(dim=1)

    def ranks_rows(self) -> bool:
        return self.policies[0].ranks_rows()

    def ratio_use(self) -> str:
        uses = "; ".join(_reading(p) for p in self.policies)
        compound = ", so the row evictions compound" if sum(p.ranks_rows() for p in self.policies) > 1 else ""
        return f"applied by each of its policies in turn ({uses}){compound}"


def _one_head(c: LayerCapture, head: int, rows: torch.Tensor) -> LayerCapture:
    """KV head ``head`` of ``c`` with only ``rows``: its keys, values, positions, events, and the queries of its
    GQA group."""
    queries = c.queries
    if queries is not None:
        group = queries.shape[0] // c.kv_heads
        queries = queries[head * group : (head + 1) * group]
    return dataclasses.replace(
        c,
        keys=c.keys[head : head + 1, rows],
        values=c.values[head : head + 1, rows],
        positions=c.positions[rows],
        queries=queries,
        event_of_row=None if c.event_of_row is None else c.event_of_row[rows],
        out_proj=None,
    )


@dataclass
class DuoAttention(Policy):
    """Retrieval heads and streaming heads (Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with
    Retrieval and Streaming Heads", arXiv 2410.10819, Section 3: only some heads retrieve from the whole
    context; the others attend to the first tokens and the recent ones, so they keep only those rows). A
    retrieval head keeps every row; a streaming head keeps the ``sinks`` first positions and the most recent
    rows, ``sinks + recent`` in all (fewer when the ratio asks for fewer, below).

    Which heads stream: the paper learns a gate per head on synthetic retrieval data and publishes the
    patterns for a few models; kvpress's DuoAttentionPress downloads them or estimates them on a dataset. Give
    ``pattern`` (per layer, one retrieval score per KV head, higher = retrieval), or, without it, the heads are
    calibrated on the capture: a head's retrieval score is the share of its observation window's attention
    (averaged over the GQA group) that falls outside its sinks and its recent rows — the attention a streaming
    head would lose. On each layer the lowest-scored heads stream: as many as ``streaming`` (a fraction of the
    KV heads, rounded down) when given, else the fewest whose streaming keeps at most ``heads *
    kept_count(rows, ratio)`` rows in the layer; when even all of them keep more, every head streams with
    ``kept_count`` rows (its sinks and the most recent).

    Raises:
        OptionError: ``sinks`` or ``recent`` not whole numbers >= 0, ``streaming`` not in [0, 1] (on
            construction); neither ``pattern`` nor the window's queries, or a pattern without this layer or
            with another head count (on scoring).
    """

    name: ClassVar[str] = "duo"
    sinks: int = 4
    recent: int = 64
    streaming: float | None = None
    pattern: tuple[tuple[float, ...], ...] | None = None

    def __post_init__(self) -> None:
        check_int("sinks", self.sinks, "keep 0 or more sink positions per streaming head.", minimum=0)
        check_int("recent", self.recent, "keep 0 or more recent rows per streaming head.", minimum=0)
        if self.streaming is not None:
            _check_fraction("streaming", self.streaming, "the fraction of KV heads that stream")
        if self.pattern is not None:
            self.pattern = tuple(tuple(float(x) for x in layer) for layer in self.pattern)

    def _local(self, c: LayerCapture, keep: int) -> torch.Tensor:
        """``[rows]`` bool: the first ``sinks`` positions and the latest rows, ``keep`` in all."""
        order = torch.argsort(c.positions, stable=True)
        local = torch.zeros(c.rows, dtype=torch.bool, device=c.keys.device)
        sinks = min(self.sinks, keep)
        local[order[:sinks]] = True
        if keep > sinks:
            local[order[-(keep - sinks) :]] = True
        return local

    def scores(self, c: LayerCapture) -> torch.Tensor:
        """``[kv_heads, rows]``: each head's retrieval score on every row (the rows are not ranked within a
        head; :meth:`mask` keeps a head's rows whole or its sinks and recent rows)."""
        if self.pattern is not None:
            layer = self.pattern[_layer_of(c, len(self.pattern), "pattern")]
            if len(layer) != c.kv_heads:
                raise OptionError("pattern", layer, f"give one score per KV head ({c.kv_heads}) on every layer.")
            head = torch.tensor(layer, dtype=torch.float64, device=c.keys.device)
        else:
            att = per_kv_head(window_attention(c, self.name).mean(dim=1), c.kv_heads)  # [kv_heads, rows]
            local = self._local(c, min(c.rows, self.sinks + self.recent))
            head = att[:, ~local].sum(dim=1)
        return head.to(c.keys.device)[:, None].expand(-1, c.rows).clone()

    def mask(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        n = kept_count(c.rows, ratio)
        head = self.checked_scores(c)[:, 0]
        width = min(c.rows, self.sinks + self.recent)
        by_score = torch.argsort(head, stable=True)  # the lowest retrieval scores stream first
        if self.streaming is not None:
            count = int(self.streaming * c.kv_heads)
        else:
            total = c.kv_heads * n
            count = next((s for s in range(c.kv_heads + 1) if (c.kv_heads - s) * c.rows + s * width <= total), -1)
            if count < 0:  # even every head streaming keeps too much: every head keeps kept_count rows
                count, width = c.kv_heads, n
        out = torch.ones(c.kv_heads, c.rows, dtype=torch.bool, device=c.keys.device)
        local = self._local(c, width)
        for h in by_score[:count].tolist():
            out[h] = local
        return out

    def budget(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        return self.mask(c, ratio).sum(dim=1)

    def check_layers(self, n_layers: int) -> None:
        if self.pattern is not None:
            _check_per_layer("pattern", len(self.pattern), n_layers, self)

    def ratio_use(self) -> str:
        if self.streaming is not None:
            return "not read: a fixed fraction of the KV heads streams (streaming=)"
        return "the least fraction of each layer's rows evicted: the fewest whole heads reaching it stream (often more)"


@dataclass
class SimLayerKV(Policy):
    """Lazy layers keep only their first and latest rows (Zhang et al., "SimLayerKV: A Simple Framework for
    Layer-Level KV Cache Reduction", arXiv 2410.13846, Section 3; kvpress's SimLayerKVPress): a layer is lazy
    when the last ``last`` prefill queries put more than ``threshold`` of their softmax attention — averaged
    over every query head and those queries, over the rows before them — on the first ``initial`` and the
    latest ``recent`` of those rows. A lazy layer keeps its first ``initial`` rows and its latest
    ``recent - last`` rows (kvpress's count), every KV head alike; any other layer keeps every row. The decision
    is per layer, so the compression ratio is not read, except that a ratio of 0 keeps every row (as with every
    policy); a layer of at most ``initial + recent + last`` rows is never compressed. The threshold is per model
    family in the paper and kvpress (Llama 3 0.9, Llama 2 0.65, Mistral 0.8, Qwen 0.85); the default here is
    0.9, and ``threshold=1`` turns the policy off, as in kvpress.

    Raises:
        OptionError: ``threshold`` not a number in [0, 1], ``initial``, ``recent`` or ``last`` not whole numbers
            (``initial`` >= 0, the others >= 1), ``recent`` not above ``last`` (on construction); a capture without
            the last ``last`` queries (on scoring).
    """

    name: ClassVar[str] = "simlayerkv"
    threshold: float = 0.9
    initial: int = 4
    recent: int = 1024
    last: int = 1

    def __post_init__(self) -> None:
        _check_fraction("threshold", self.threshold, "the attention share that makes a layer lazy")
        check_int("initial", self.initial, "keep at least 0 initial rows (SimLayerKV uses 4).", minimum=0)
        check_int("recent", self.recent, "keep at least 1 recent row (SimLayerKV uses 1024).")
        check_int("last", self.last, "read at least 1 last query (SimLayerKV uses 1).")
        if self.recent <= self.last:
            raise OptionError(
                "recent",
                self.recent,
                f"keep more recent rows than last queries ({self.last}): a lazy layer keeps recent - last.",
            )

    def lazy(self, c: LayerCapture) -> bool:
        """Whether layer ``c`` is lazy: the share of the last queries' attention on the first and latest rows
        before them, above ``threshold``; False for a layer too short to compress or with ``threshold`` 1."""
        if self.threshold >= 1 or c.rows <= self.initial + self.recent + self.last:
            return False
        q, _ = c.need_queries(self.name)
        if q.shape[1] < self.last:
            raise OptionError("last", self.last, f"the capture holds {q.shape[1]} queries: capture at least last.")
        att = window_attention(c, self.name, self.last)[:, :, : c.rows - self.last].mean(dim=(0, 1))
        share = att[: self.initial].sum() + att[-self.recent :].sum()
        return bool(share > self.threshold)

    def scores(self, c: LayerCapture) -> torch.Tensor:
        """``[kv_heads, rows]`` float64: 1 for the first ``initial`` and the latest ``recent - last`` rows (row
        order), 0 for the others."""
        s = torch.zeros(c.kv_heads, c.rows, dtype=torch.float64, device=c.keys.device)
        s[:, : self.initial] = 1
        s[:, c.rows - (self.recent - self.last) :] = 1  # recent > last: checked on construction
        return s

    def budget(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        """``[kv_heads]`` int64: ``initial + recent - last`` in every head of a lazy layer, else every row (and
        every row at ``ratio`` 0); not ``kept_count``: the ratio is not read.

        Raises:
            OptionError: ``ratio`` outside [0, 1).
        """
        kept_count(c.rows, ratio)  # checks the ratio
        n = c.rows if ratio == 0 or not self.lazy(c) else self.initial + self.recent - self.last
        return torch.full((c.kv_heads,), n, dtype=torch.long, device=c.keys.device)

    def ratio_use(self) -> str:
        return "not read (but 0 keeps every row): a lazy layer keeps its first and latest rows, another every row"
