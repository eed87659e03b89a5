"""More scoring rules in the :class:`eventkv.eviction.policies.Policy` contract, each written from its paper and
compared with the NVIDIA kvpress 0.5.5 press of the same name (``tests/test_kvpress_parity.py``):

* :class:`ObservedAttention` — H2O's heavy hitters: the attention every prefill query paid a row, averaged;
* :class:`KeyDiff` — keys least like the head's average key;
* :class:`QFilter` — keys projected on the direction a head's queries share;
* :class:`KVzip` — the attention a row draws while the model repeats its context;
* :class:`ThinK` — key channels pruned by their share of the window's query-key products (rows kept);
* :class:`Finch` — the rows the question attends to, the attention normalized by each query's row count.

Why not kvpress itself: see :mod:`eventkv.eviction.policies` (it pins transformers < 5.3 and patches every
attention function process-wide).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from eventkv.errors import OptionError
from eventkv.eviction.policies import (
    LayerCapture,
    Policy,
    kept_count,
    observation_window,
    per_kv_head,
    top_rows,
    window_attention,
)
from eventkv.options import check_bool, check_int, check_optional_int


@dataclass
class ObservedAttention(Policy):
    """Heavy hitters (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large
    Language Models", arXiv 2306.14048, Section 3: the accumulated attention a token receives marks the few
    tokens that matter; kvpress's ObservedAttentionPress applies it once, after the prefill). A row's score is
    the softmax attention every prefill query at or after its position paid it, summed over those queries and
    divided by their number (a row near the end is seen by few queries: the average keeps it from losing for
    that alone), averaged over each GQA group's query heads.

    Needs every prefill query in the capture (``capture_prefill(window=rows)``; the audit captures them when
    this policy is audited).

    Raises:
        OptionError: a capture that holds fewer queries than rows, on scoring.
    """

    name: ClassVar[str] = "observed"

    @property
    def needs_all_queries(self) -> bool:
        return True

    def scores(self, c: LayerCapture) -> torch.Tensor:
        queries, _ = c.need_queries(self.name)
        if queries.shape[1] < c.rows:
            raise OptionError(
                "policy",
                self.name,
                f"it averages the attention of every prefill query: the capture holds {queries.shape[1]} of "
                f"{c.rows}; capture them all (window >= rows).",
            )
        att = window_attention(c, self.name)[:, -c.rows :]  # [q_heads, rows (queries), rows (keys)]
        _, qpos = c.need_queries(self.name)
        seen_by = (c.positions[None, :] <= qpos[-c.rows :, None]).sum(dim=0).clamp(min=1)  # queries seeing a row
        return per_kv_head(att.sum(dim=1) / seen_by.double(), c.kv_heads)


@dataclass
class KeyDiff(Policy):
    """Key diversity (Park et al., "KeyDiff: Key Similarity-Based KV Cache Eviction for Long-Context LLM
    Inference in Resource-Constrained Environments", arXiv 2504.15364, Section 3: keys that differ most from
    the others draw attention from more varied queries; no query is read). A row's score is minus the cosine
    similarity of its key to the head's anchor, the mean of the head's unit-length keys: the most dissimilar
    keys are kept."""

    name: ClassVar[str] = "keydiff"

    def scores(self, c: LayerCapture) -> torch.Tensor:
        k = c.keys.double()
        unit = torch.nn.functional.normalize(k, dim=-1)
        anchor = unit.mean(dim=1, keepdim=True)  # [kv_heads, 1, head_dim]
        return -torch.nn.functional.cosine_similarity(k, anchor, dim=-1)


@dataclass
class LagKV(Policy):
    """Lag-relative statistics (Liang et al., "LagKV: Lag-Relative Information of the KV Cache Tells Which
    Tokens Are Important", arXiv 2504.04704, Section 3; kvpress's LagKVPress): no query is read. After the
    first ``sinks`` rows the rows are cut into partitions of ``lag`` rows; each partition's keys and values are
    min-max normalized per channel by the *next* partition's minimum and maximum (its lag reference), and a
    row's score in each of K and V is the softmax, over its partition, of the standard deviation of its
    normalized channels (Bessel-corrected); the row's score is the mean of the two. The sinks, the last whole
    partition and the rows after it (it has no reference) score above every other row, so they are kept first
    (where the budget holds fewer rows than they are, the latest of them, as every tie here). With
    ``cross_scoring`` False (the paper's and kvpress's default) a row scores its rank within its partition over
    ``lag``, so every partition keeps the same count and equal ranks of different partitions tie (the later row
    kept, as every tie here); True compares the softmax scores across partitions. A layer of fewer than
    ``sinks + 2 * lag`` rows is not partitioned: the sinks and then the latest rows are kept. A channel whose
    reference minimum equals its maximum normalizes to 0 (kvpress divides by zero there and scores NaN).

    Raises:
        OptionError: ``sinks`` not a whole number >= 0, ``lag`` not one >= 1, ``cross_scoring`` not a bool
            (on construction).
    """

    name: ClassVar[str] = "lagkv"
    sinks: int = 4
    lag: int = 128
    cross_scoring: bool = False

    def __post_init__(self) -> None:
        check_int("sinks", self.sinks, "keep at least 0 sink rows (a whole number; LagKV uses 4).", minimum=0)
        check_int("lag", self.lag, "give a partition of at least 1 row (a whole number; LagKV uses 128).")
        check_bool("cross_scoring", self.cross_scoring, "give true or false.")

    def scores(self, c: LayerCapture) -> torch.Tensor:
        """``[kv_heads, rows]`` float64: 1 for the sinks and the tail, the rank over ``lag`` (or with
        ``cross_scoring`` the softmax score) for the partitioned rows; the short-layer ramp below ``sinks + 2 lag``."""
        n, sinks, lag = c.rows, self.sinks, self.lag
        out = torch.ones(c.kv_heads, n, dtype=torch.float64, device=c.keys.device)
        if n < sinks + 2 * lag:  # too short to partition: the sinks, then the latest rows
            if n > sinks:
                out[:, sinks:] = torch.arange(n - sinks, dtype=torch.float64, device=out.device) / (n - sinks)
            return out
        parts = (n - sinks) // lag  # whole partitions; the last of them, and the rows after it, are the kept tail
        end = sinks + (parts - 1) * lag
        score = (self._partition_scores(c.keys, parts) + self._partition_scores(c.values, parts)) / 2
        if not self.cross_scoring:  # rank within the partition: 0 for the lowest, (lag - 1) / lag for the highest
            score = score.argsort(dim=-1).argsort(dim=-1).double() / lag
        out[:, sinks:end] = score.reshape(c.kv_heads, -1)
        return out

    def _partition_scores(self, states: torch.Tensor, parts: int) -> torch.Tensor:
        """``[kv_heads, parts - 1, lag]`` float64: each scored row's softmax (over its partition) of the standard
        deviation of its channels, min-max normalized by the next partition's."""
        kv_heads, _, dim = states.shape
        x = states[:, self.sinks : self.sinks + parts * self.lag].double().reshape(kv_heads, parts, self.lag, dim)
        ref = x[:, 1:]
        low, high = ref.amin(dim=2, keepdim=True), ref.amax(dim=2, keepdim=True)
        span = high - low
        normed = torch.where(span > 0, (x[:, :-1] - low) / torch.where(span > 0, span, 1.0), 0.0)
        return normed.std(dim=-1).softmax(dim=-1)


@dataclass
class QFilter(Policy):
    """Q-Filters (Godey et al., "Q-Filters: Leveraging Query-Key Geometry for Efficient Key-Value Cache
    Compression", arXiv 2503.02812, Sections 3-4): the queries of a head lie mostly along one direction, and a
    key's attention logit is then close to proportional to its projection on that direction, so the projection
    scores the key without any query-key product at eviction time. The paper computes the direction (the
    filter) once per head, offline, as the first right singular vector of many queries, signed so that the
    queries project positively on it; kvpress's QFilterPress downloads such filters for a few models.
    Here the filter is calibrated on the capture's own queries (the observation window's, every query of the
    KV head's GQA group together), the stated calibration where no published filter exists for the model; a
    row's score is its key's projection on the filter.

    Raises:
        OptionError: a capture without queries (on scoring).
    """

    name: ClassVar[str] = "qfilter"

    def filters(self, c: LayerCapture) -> torch.Tensor:
        """``[kv_heads, head_dim]`` float64: each KV head's unit filter (first right singular vector of its
        group's captured queries, signed so that their mean projects on it positively)."""
        q, _ = c.need_queries(self.name)
        q = q.double().reshape(c.kv_heads, -1, q.shape[-1])  # [kv_heads, group * window, head_dim]
        _, _, vh = torch.linalg.svd(q, full_matrices=False)
        u = vh[:, 0, :]
        sign = torch.sign((q.mean(dim=1) * u).sum(dim=-1))
        return u * torch.where(sign == 0, 1.0, sign)[:, None]

    def scores(self, c: LayerCapture) -> torch.Tensor:
        return torch.einsum("hrd,hd->hr", c.keys.double(), self.filters(c))


@dataclass
class KVzip(Policy):
    """Context reconstruction (Kim et al., "KVzip: Query-Agnostic KV Cache Compression with Context
    Reconstruction", arXiv 2505.23416, Section 3: a row the model needs to repeat its context is a row any later
    question may need). After the history the model is asked to repeat it and reads the history's tokens again
    (:func:`eventkv.eviction.capture.capture_reconstruction`); a row's score is the largest softmax attention any
    of those reconstruction queries pays it, over the keys of the history and of the reconstruction before the
    query, maximised over each GQA group's query heads. Query-agnostic: no question is read. The paper shares
    the budget across heads (``AdaKV(inner=KVzip())`` does so per layer); alone it keeps ``kept_count`` rows per head.

    Raises:
        OptionError: a capture without a reconstruction pass (on scoring).
    """

    name: ClassVar[str] = "kvzip"

    @property
    def needs_reconstruction(self) -> bool:
        return True

    def scores(self, c: LayerCapture) -> torch.Tensor:
        if c.extra_keys is None or c.extra_positions is None or c.queries is None or c.query_positions is None:
            raise OptionError(
                "policy", self.name, "it reads a reconstruction pass: capture one (capture_reconstruction)."
            )
        q = c.queries.double()
        keys = torch.cat([c.keys.double(), c.extra_keys.double().to(c.keys.device)], dim=1)
        pos = torch.cat([c.positions, c.extra_positions.to(c.positions.device)])
        group = q.shape[0] // c.kv_heads
        logits = torch.einsum("hwd,hrd->hwr", q, keys.repeat_interleave(group, dim=0)) * c.scale()
        visible = pos[None, :] <= c.query_positions[:, None]
        att = torch.softmax(logits.masked_fill(~visible[None], float("-inf")), dim=-1)
        best = att[:, :, : c.rows].amax(dim=1)  # [q_heads, rows]
        return best.reshape(c.kv_heads, group, c.rows).amax(dim=1)


@dataclass
class ThinK(Policy):
    """Key channels pruned, not rows (Xu et al., "ThinK: Thinner Key Cache by Query-Driven Pruning", arXiv
    2407.21018, Section 3: a key channel matters by how much it adds to the observation window's query-key
    products; kvpress's ThinKPress). Per KV head, channel ``d`` scores the mean of its squared window queries
    (after RoPE, averaged over the GQA group) times the mean of its squared keys over every row; at ratio ``r``
    the ``int(head_dim * r)`` lowest-scored channels are pruned — they read as 0 in every key
    (:meth:`key_channels`; the audit's masked readout serves them so). Every row is kept (:meth:`mask`); compose
    with a row policy (``Composed(policies=(SnapKV(), ThinK()))``) to evict rows too. ``r`` is the fraction of
    key channels pruned: of the keys and values together, half that.

    Raises:
        OptionError: ``window`` not a whole number >= 1 (on construction); a capture with fewer queries (on
            scoring).
    """

    name: ClassVar[str] = "think"
    window: int = 32

    def __post_init__(self) -> None:
        check_int("window", self.window, "observe at least 1 query (a whole number; ThinK uses 32).")

    def scores(self, c: LayerCapture) -> torch.Tensor:
        """``[kv_heads, rows]`` zeros: every row alike (:meth:`ranks_rows` is False, so no wrapper keeps rows by
        them)."""
        return torch.zeros(c.kv_heads, c.rows, dtype=torch.float64, device=c.keys.device)

    def ranks_rows(self) -> bool:
        return False

    def ratio_use(self) -> str:
        return "the fraction of key channels pruned; every row is kept"

    def mask(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        kept_count(c.rows, ratio)  # checks the ratio
        return torch.ones(c.kv_heads, c.rows, dtype=torch.bool, device=c.keys.device)

    def channel_scores(self, c: LayerCapture) -> torch.Tensor:
        """``[kv_heads, head_dim]`` float64: each key channel's score."""
        q, _ = c.need_queries(self.name)
        if q.shape[1] < self.window:
            raise OptionError(
                "window", self.window, f"the capture holds {q.shape[1]} queries: capture at least the window."
            )
        q = q[:, -self.window :].double()
        group = q.shape[0] // c.kv_heads
        qn = q.pow(2).mean(dim=1).reshape(c.kv_heads, group, -1).mean(dim=1)
        return qn.to(c.keys.device) * c.keys.double().pow(2).mean(dim=1)

    def key_channels(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        kept_count(c.rows, ratio)
        s = self.channel_scores(c)
        dim = s.shape[-1]
        # the lowest int(dim * ratio) pruned: keep the best dim - that, ties to the later channel
        return top_rows(s, torch.arange(dim, device=s.device), dim - int(dim * ratio))


@dataclass
class Finch(Policy):
    """Prompt-guided window attention (Corallo and Papotti, "FINCH: Prompt-guided Key-Value Cache Compression for
    Large Language Models", TACL 12, 2024, Section 3; kvpress's FinchPress): the rows the question attends to. The
    observation window is the last ``window`` captured queries — the question, where the capture ends with it
    (a prompt of context then question, prefilled together, as Finch's is); in the audit the memory has not seen
    the question, so the window is the history's end. Each window query's softmax attention to the rows before the
    window is multiplied by the number of rows before that query (Finch's normalization: a later query spreads
    its attention over more rows; kvpress's count, the query's own row excluded), averaged over the window and
    over each GQA group's query heads, with no pooling; the window's rows are always kept. With ``chunk`` the
    rows in position order are cut into chunks of ``chunk`` (Finch's chunked prefill), and each chunk keeps
    ``kept_count(its rows, ratio)`` of its own by these scores. Row selection only: kvpress's ``rerotate_keys``
    moves the kept keys to contiguous positions, which eventkv's serving does when asked
    (``positions="contiguous"``).

    Raises:
        OptionError: ``window`` not a whole number >= 1, ``chunk`` not None or one >= 1 (on construction); a
            capture with fewer than ``window`` queries or not more rows than ``window`` (on scoring); a ``chunk``
            of at most ``window / (1 - ratio)`` rows, where a chunk's budget could not hold the window (kvpress
            refuses it too), on masking.
    """

    name: ClassVar[str] = "finch"
    window: int = 64
    chunk: int | None = None

    def __post_init__(self) -> None:
        check_int("window", self.window, "observe at least 1 query (a whole number: the question's tokens).")
        check_optional_int(
            "chunk", self.chunk, "give the chunk length in rows (a whole number >= 1), or none for no chunks."
        )

    def scores(self, c: LayerCapture) -> torch.Tensor:
        att, qpos, in_window = observation_window(c, self.name, self.window)  # att: [q_heads, window, rows]
        before = (c.positions[None, :] < qpos[:, None]).sum(dim=1).double()  # [window]: rows before each query
        votes = (att[:, :, ~in_window] * before[None, :, None]).mean(dim=1)  # [q_heads, prefix rows]
        s = torch.full((c.kv_heads, c.rows), float("inf"), dtype=torch.float64, device=votes.device)
        s[:, ~in_window] = per_kv_head(votes, c.kv_heads)
        return s

    @property
    def keeps_by_scores(self) -> bool:
        return self.chunk is None  # in chunks, each chunk keeps a count of its own

    def check_ratio(self, ratio: float) -> None:
        if self.chunk is not None and self.chunk <= self.window / (1 - ratio):
            raise OptionError(
                "chunk",
                self.chunk,
                f"a chunk must hold more than window / (1 - ratio) = {self.window / (1 - ratio):g} rows at ratio "
                f"{ratio:g}, so its budget can keep the window: give a longer chunk or a shorter window.",
            )

    def mask(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        if self.chunk is None:
            return super().mask(c, ratio)
        kept_count(c.rows, ratio)  # checks the ratio
        self.check_ratio(ratio)
        s = self.checked_scores(c)
        order = torch.argsort(c.positions, stable=True)  # rows by position
        keep = torch.zeros(c.kv_heads, c.rows, dtype=torch.bool, device=s.device)
        for i in range(0, c.rows, self.chunk):
            rows = order[i : i + self.chunk]
            keep[:, rows] = top_rows(s[:, rows], c.positions[rows], kept_count(len(rows), ratio))
        return keep

    def budget(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        if self.chunk is None:
            return super().budget(c, ratio)
        return self.mask(c, ratio).sum(dim=1)
