"""KV-cache eviction policies as pure scoring rules over one layer's captured inputs, each written
from its paper and checked against NVIDIA kvpress 0.5.5's presses (``tests/test_kvpress_parity.py``).
A policy scores every (KV head, row) of a layer; the :func:`keep_mask` of a **compression ratio**
``r`` (the fraction of rows evicted) keeps, per KV head, the ``max(1, int(rows * (1 - r)))``
best-scored rows — kvpress's count, the same float expression.

Parameters are checked when a policy is made (``__post_init__``): a bad one raises
:class:`~eventkv.errors.OptionError` naming the field, in the library as on the command line.

Positions: every rule that depends on where a row sits reads ``LayerCapture.positions`` — the
rows' real RoPE position ids from the log (position budgets leave gaps) — never the row index.

Devices: a rule computes on the capture's device (every tensor it makes follows ``keys``); the
captures of :func:`eventkv.eviction.capture.capture_prefill` are on the CPU, in float32 and float64,
so a policy's scores do not depend on the device the model ran on beyond the captured inputs'
rounding. Random scores are drawn on the CPU from a seeded generator whatever the device.

Why not kvpress: kvpress 0.5.5 pins transformers < 5.3, its hooks fail on 5.24 (the attention
keyword is now ``cache``), and importing it patches every attention function process-wide; the
rules are short, so they are written here from the papers; ``benchmarks/kvpress_parity.py``, run
where kvpress is installed, writes the rows its presses keep on a tiny model (``tests/data/kvpress_parity/``)
and the parity test compares every policy with them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from eventkv.errors import OptionError
from eventkv.options import check_bool, check_int


@dataclass
class LayerCapture:
    """One layer's inputs to a scoring rule, captured during the global prefill.

    Attributes:
        layer: the layer index.
        keys, values: ``[kv_heads, rows, head_dim]`` as cached (keys after RoPE).
        positions: ``[rows]`` int64 RoPE position ids of the rows.
        queries: ``[q_heads, window, head_dim]`` the queries (after RoPE) of the last ``window``
            prefill tokens — the observation window of SnapKV / TOVA / expected attention.
        query_positions: ``[window]`` their position ids.
        scaling: the attention's score scale (``1/sqrt(head_dim)`` unless the model says otherwise).
        rope: ``(inv_freq [head_dim // 2], attention_scaling)`` of this layer's rotary embedding, or
            None (needed by :class:`ExpectedAttention` to rotate queries to future positions).
        event_of_row: ``[rows]`` int64 index of each row's event (-1 for the header), or None.
        n_layers: the model's layer count (what per-layer budgets such as PyramidKV's are spread over), or
            None when unknown.
        out_proj: ``[hidden, q_heads * head_dim]`` the layer's attention output projection (``o_proj``'s
            weight as the model holds it: its dtype and device, not a copy), or None: what rules that weigh a
            row by its value's effect on the layer's output read (CriticalKV).
        extra_keys: ``[kv_heads, extra, head_dim]`` keys past the rows that the captured queries also attend
            to, or None: the tokens of a reconstruction pass that follows the history (KVzip; the queries are
            then that pass's, :func:`eventkv.eviction.capture.capture_reconstruction`).
        extra_positions: ``[extra]`` their position ids.
    """

    layer: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    scaling: float | None = None
    rope: tuple[torch.Tensor, float] | None = None
    event_of_row: torch.Tensor | None = None
    n_layers: int | None = None
    out_proj: torch.Tensor | None = None
    extra_keys: torch.Tensor | None = None
    extra_positions: torch.Tensor | None = None

    @property
    def kv_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def rows(self) -> int:
        return self.keys.shape[1]

    def scale(self) -> float:
        return self.scaling if self.scaling is not None else 1.0 / math.sqrt(self.keys.shape[-1])

    def need_queries(self, who: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(queries, query_positions)``; raises OptionError naming policy ``who`` if they were not captured."""
        if self.queries is None or self.query_positions is None:
            raise OptionError("policy", who, "this policy reads the observation window's queries: capture them.")
        return self.queries, self.query_positions

    def need_events(self, who: str) -> torch.Tensor:
        """``event_of_row``; raises OptionError naming policy ``who`` if it was not captured."""
        if self.event_of_row is None:
            raise OptionError("policy", who, "event-level scoring needs each row's event: capture the log.")
        return self.event_of_row


class Policy:
    """A scoring rule and its budget. Three parts, each a method a policy may replace:

    * :meth:`scores`: ``[kv_heads, rows]`` float64, higher = keep;
    * :meth:`budget`: the rows each KV head keeps on a layer at a compression ratio, ``[kv_heads]`` int64 —
      by default :func:`kept_count` in every head; per-layer rules (PyramidKV, a ratio per layer) and per-head
      rules (AdaKV) give other counts (``eventkv.eviction.budgets``);
    * :meth:`mask`: the kept rows, ``[kv_heads, rows]`` bool — by default :meth:`keep` of the budget.

    :func:`keep_mask` calls :meth:`mask`; the audit reads nothing else."""

    name: ClassVar[str] = ""

    def members(self) -> tuple[Policy, ...]:
        """The policies inside this one — a wrapper's ``inner`` field, a composition's ``policies`` — whose
        needs the capture must meet too (here none; a subclass with such fields has them)."""
        inner = getattr(self, "inner", None)
        return ((inner,) if isinstance(inner, Policy) else ()) + tuple(getattr(self, "policies", ()))

    def ranks_rows(self) -> bool:
        """Whether :meth:`scores` ranks the rows, so that a wrapper keeping rows by them (``inner`` of AdaKV,
        ChunkKV, CriticalKV, a ratio per layer, event-level top-k) keeps something: False for a policy that keeps
        every row and scores them alike (ThinK prunes key channels), whose scores would leave such a wrapper
        keeping the latest rows by its tie rule."""
        return True

    def check_inner(self, field_name: str, value: object, example: str) -> None:
        """Raises OptionError unless ``value`` is a policy whose scores rank rows (:meth:`ranks_rows`), for a
        field ``field_name`` this policy keeps rows by; ``example`` names a policy to give."""
        if not isinstance(value, Policy):
            raise OptionError(field_name, value, f"give a policy, e.g. {example}.")
        if not value.ranks_rows():
            raise OptionError(
                field_name,
                value.name,
                f"{self.name} keeps rows by its {field_name}'s scores, and {value.name} ranks no rows (think keeps "
                f"every row and prunes key channels): give a row policy, e.g. {example}, or apply think after one: "
                "composed(policies=snapkv/think).",
            )

    def check_layers(self, n_layers: int) -> None:
        """Raises OptionError when a per-layer setting of this policy or of :meth:`members` does not give one
        entry per layer of a model of ``n_layers`` layers — checked before any model work (the audit does, once
        the model is loaded)."""
        for m in self.members():
            m.check_layers(n_layers)

    def ratio_use(self) -> str:
        """How this policy reads the compression ratio when not as the fraction of each KV head's rows evicted
        (a sentence for the audit's summary); empty when it does (here: what :meth:`members` say)."""
        return next((u for m in self.members() if (u := m.ratio_use())), "")

    @property
    def needs_all_queries(self) -> bool:
        """Whether :meth:`scores` reads every prefill query, not only the observation window's (a capture
        then needs ``window >= rows``): here, whether any of :meth:`members` does."""
        return any(m.needs_all_queries for m in self.members())

    @property
    def needs_reconstruction(self) -> bool:
        """Whether :meth:`scores` reads a reconstruction pass's queries and keys (``LayerCapture.extra_keys``:
        :func:`eventkv.eviction.capture.capture_reconstruction`) instead of the observation window's: here,
        whether any of :meth:`members` does."""
        return any(m.needs_reconstruction for m in self.members())

    @property
    def keeps_by_scores(self) -> bool:
        """Whether the kept rows are each KV head's best by :meth:`scores`, a count per head (:meth:`keep`), with no
        selection rule of its own — what a row-count budget can drive (compression during decoding,
        :mod:`eventkv.eviction.decoding`). Here: whether the class keeps this base's :meth:`budget` and :meth:`mask`."""
        return type(self).mask is Policy.mask and type(self).budget is Policy.budget

    def check_ratio(self, ratio: float) -> None:
        """Raises OptionError when this policy cannot apply ``ratio`` — checked before any model work (the audit
        does, for each of its ratios); here: whatever :meth:`members` refuse."""
        for m in self.members():
            m.check_ratio(ratio)

    def scores(self, c: LayerCapture) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def budget(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        """``[kv_heads]`` int64: the rows each KV head of layer ``c`` keeps at ``ratio`` (here
        :func:`kept_count` in every head). Raises: OptionError: ``ratio`` outside [0, 1)."""
        return torch.full((c.kv_heads,), kept_count(c.rows, ratio), dtype=torch.long, device=c.keys.device)

    def mask(self, c: LayerCapture, ratio: float) -> torch.Tensor:
        """``[kv_heads, rows]`` bool: the rows kept at ``ratio`` (:meth:`keep` of :meth:`budget`)."""
        return self.keep(c, self.budget(c, ratio))

    def key_channels(self, c: LayerCapture, ratio: float) -> torch.Tensor | None:
        """``[kv_heads, head_dim]`` bool: the key channels kept at ``ratio``, the others read as 0 in every row
        (ThinK prunes channels, not rows); None: every channel. Here: the channels every one of :meth:`members`
        keeps (a member that prunes none counts as keeping all), None when none prunes."""
        kept = [ch for m in self.members() if (ch := m.key_channels(c, ratio)) is not None]
        return None if not kept else torch.stack(kept).all(dim=0)

    def checked_scores(self, c: LayerCapture) -> torch.Tensor:
        """:meth:`scores`, checked. Raises: OptionError: scores of the wrong shape, or nan."""
        s = self.scores(c)
        if s.shape != (c.kv_heads, c.rows):
            raise OptionError("policy scores", tuple(s.shape), f"expected ({c.kv_heads}, {c.rows}).")
        if torch.isnan(s).any():
            raise OptionError("policy scores", "nan", f"{self.name} gave nan scores on layer {c.layer}.")
        return s

    def keep(self, c: LayerCapture, n_keep: int | torch.Tensor) -> torch.Tensor:
        """``[kv_heads, rows]`` bool: per KV head its ``n_keep`` highest scores (one count for every head, or
        ``[kv_heads]`` counts), ties to the later position (:func:`top_rows`).

        Raises:
            OptionError: scores of the wrong shape, or nan.
        """
        return top_rows(self.checked_scores(c), c.positions, n_keep)


def top_rows(s: torch.Tensor, positions: torch.Tensor, n_keep: int | torch.Tensor) -> torch.Tensor:
    """``[heads, rows]`` bool: in each head of ``s [heads, rows]`` the ``n_keep`` (an int, or ``[heads]``
    counts) highest scores, equal scores to the later of ``positions [rows]``."""
    heads, rows = s.shape
    counts = torch.as_tensor(n_keep, dtype=torch.long, device=s.device).expand(heads)
    # ties: the later position wins — sort by position descending, then stably by score descending
    by_pos = torch.argsort(positions.to(s.device), descending=True, stable=True)
    by_score = torch.argsort(s[:, by_pos], dim=1, descending=True, stable=True)
    rank = torch.empty_like(by_score)
    rank.scatter_(1, by_score, torch.arange(rows, device=s.device).expand(heads, rows).contiguous())
    mask = torch.zeros(heads, rows, dtype=torch.bool, device=s.device)
    mask[:, by_pos] = rank < counts[:, None]
    return mask


def last_queries(c: LayerCapture, window: int) -> LayerCapture:
    """``c`` with only its last ``window`` captured queries (the same object when it holds no more)."""
    if c.queries is None or c.query_positions is None or c.queries.shape[1] <= window:
        return c
    return dataclasses.replace(c, queries=c.queries[:, -window:], query_positions=c.query_positions[-window:])


def window_attention(c: LayerCapture, who: str, window: int | None = None) -> torch.Tensor:
    """Softmax attention of the last ``window`` captured queries (all when None) over every row,
    ``[q_heads, window, rows]`` float64, causal by position (a query sees rows at positions <= its own)."""
    q, qpos = c.need_queries(who)
    q = q.double()
    if window is not None:
        q, qpos = q[:, -window:], qpos[-window:]
    k = c.keys.double()
    group = q.shape[0] // c.kv_heads
    k = k.repeat_interleave(group, dim=0)  # [q_heads, rows, head_dim]
    logits = torch.einsum("hwd,hrd->hwr", q, k) * c.scale()
    visible = c.positions[None, :] <= qpos[:, None]  # [window, rows]
    logits = logits.masked_fill(~visible[None], float("-inf"))
    return torch.softmax(logits, dim=-1)


def observation_window(c: LayerCapture, who: str, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The observation window of SnapKV-style rules, checked: the last ``window`` captured queries' attention
    (:func:`window_attention`), their positions, and which rows the window itself holds.

    Returns:
        ``(att [q_heads, window, rows] float64, query positions [window], in_window [rows] bool)``.

    Raises:
        OptionError: a capture with fewer than ``window`` queries, or a layer of no more rows than ``window``
            (nothing before the window to score, as kvpress refuses).
    """
    queries, qpos = c.need_queries(who)
    if queries.shape[1] < window:
        raise OptionError(
            "window", window, f"the capture holds {queries.shape[1]} queries: capture at least the window."
        )
    if c.rows <= window:
        raise OptionError(
            "window",
            window,
            f"the layer has {c.rows} rows: the window must leave rows before it to score "
            f"(give a window below {c.rows}).",
        )
    qpos = qpos[-window:]
    return window_attention(c, who, window), qpos, c.positions >= qpos.min()


def per_kv_head(att: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[q_heads, rows]`` -> ``[kv_heads, rows]`` by averaging each GQA group's query heads."""
    return att.reshape(kv_heads, att.shape[0] // kv_heads, att.shape[-1]).mean(dim=1)


def _sink_rows(c: LayerCapture, sinks: int) -> torch.Tensor:
    """``[rows]`` bool: the rows at the first ``sinks`` positions (all rows when there are fewer)."""
    sink = torch.zeros(c.rows, dtype=torch.bool, device=c.positions.device)
    sink[torch.argsort(c.positions, stable=True)[:sinks]] = True
    return sink


@dataclass
class StreamingLLM(Policy):
    """Keep the first ``sinks`` positions (attention sinks) and the most recent rows (Xiao et al.,
    "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453, Section 3.2: 4
    initial tokens + a rolling window; kvpress's StreamingLLMPress). Score: sinks first, then by
    position, later = better. With more sinks than kept rows, the first kept-count positions stay.

    Raises:
        OptionError: ``sinks`` not a whole number >= 0.
    """

    name: ClassVar[str] = "streaming"
    sinks: int = 4

    def __post_init__(self) -> None:
        check_int("sinks", self.sinks, "keep 0 or more sink positions (a whole number; the paper keeps 4).", minimum=0)

    def scores(self, c: LayerCapture) -> torch.Tensor:
        pos = c.positions.double()
        sink = _sink_rows(c, self.sinks)
        s = torch.where(sink, pos.max() + 1.0 + (pos.max() - pos), pos)  # sinks above every other row, earliest first
        return s.expand(c.kv_heads, -1).clone()


@dataclass
class Knorm(Policy):
    """Keep the keys of the smallest L2 norm (Devoto et al., "A Simple and Effective L2 Norm-Based
    Strategy for KV Cache Compression", arXiv 2406.11430, Section 3: low key norm correlates with
    high attention; kvpress's KnormPress). Score: ``-||k||`` per head and row.

    Ties: RoPE is a rotation, so in layer 0 every row of one token id has the same key norm, and
    only the rotated keys' float32 rounding (~1e-7 relative) tells them apart; on real weights
    near-equal norms also occur in later layers and between different tokens. Norms within
    ``TIE_RTOL`` of their sorted neighbour are therefore one score — the chain's, which may span more
    than ``TIE_RTOL`` end to end — and :meth:`Policy.keep` keeps the later positions of a tie, on every
    CPU alike. kvpress leaves the order of such rows to its rounding and ``topk`` (docs/eviction.md,
    "Parity with kvpress")."""

    name: ClassVar[str] = "knorm"
    TIE_RTOL: ClassVar[float] = 8 * torch.finfo(torch.float32).eps  # 9.5e-7: 8 float32 ulps

    def scores(self, c: LayerCapture) -> torch.Tensor:
        return -_merge_near_ties(c.keys.double().norm(dim=-1), self.TIE_RTOL)


def _merge_near_ties(x: torch.Tensor, rtol: float) -> torch.Tensor:
    """``x [heads, rows]`` >= 0 with each run of values whose neighbours (sorted, per head) differ by at
    most ``rtol`` of the larger replaced by the run's smallest value: rounding noise becomes an exact tie."""
    v, order = torch.sort(x, dim=-1)
    close = (v[:, 1:] - v[:, :-1]) <= rtol * v[:, 1:]
    starts = torch.cat([torch.ones_like(close[:, :1]), ~close], dim=-1)  # True where a new run begins
    run = torch.cumsum(starts.long(), dim=-1) - 1  # [heads, rows] run index in sorted order
    first = torch.zeros_like(v).scatter_reduce_(-1, run, v, reduce="amin", include_self=False)
    out = torch.empty_like(x)
    out.scatter_(-1, order, first.gather(-1, run))
    return out


@dataclass
class SnapKV(Policy):
    """Observation-window attention (Li et al., "SnapKV: LLM Knows What You Are Looking for Before
    Generation", arXiv 2404.14469, Section 4.2; kvpress's SnapKVPress): the last ``window``
    queries' softmax attention to each earlier row is averaged over the window (the paper sums; the order is
    the same, and the mean is kvpress's scale, which CriticalKV's epsilon is added to), averaged over each
    GQA group's query heads, smoothed by 1D pooling (``kernel``, ``pooling`` max or avg, stride 1,
    same length; avg counts the zero padding, as SnapKV's code and kvpress do), and the window's
    own rows are always kept. Defaults: window 64, kernel 5, avg, those of SnapKV's own code
    (``SnapKVCluster`` in the authors' repository) and of kvpress's SnapKVPress; the paper's Section 5 runs
    ``SnapKV(window=32, kernel=7, pooling="max")``.

    Raises:
        OptionError: ``window`` or ``kernel`` not a whole number >= 1, ``pooling`` not max/avg (on
            construction); a capture with fewer than ``window`` queries, or not more rows than
            ``window`` (nothing before the window to score, as kvpress refuses), on scoring.
    """

    name: ClassVar[str] = "snapkv"
    window: int = 64
    kernel: int = 5
    pooling: str = "avg"

    def __post_init__(self) -> None:
        check_int("window", self.window, "observe at least 1 query (a whole number; SnapKV uses 64).")
        check_int("kernel", self.kernel, "pool over at least 1 row (a whole number; 1 = no pooling).")
        if self.pooling not in ("max", "avg"):
            raise OptionError("pooling", self.pooling, "use max or avg.")

    def scores(self, c: LayerCapture) -> torch.Tensor:
        att, _, in_window = observation_window(c, self.name, self.window)
        # the window's mean, as kvpress (the paper sums: the same order, but CriticalKV adds an epsilon to it)
        votes = att[:, :, ~in_window].mean(dim=1)  # [q_heads, prefix rows]
        votes = per_kv_head(votes, c.kv_heads)
        if self.kernel > 1 and votes.shape[-1] > 0:
            x = votes[:, None, :]
            pad = self.kernel // 2
            if self.pooling == "max":
                x = torch.nn.functional.max_pool1d(x, self.kernel, 1, pad)
            else:
                x = torch.nn.functional.avg_pool1d(x, self.kernel, 1, pad, count_include_pad=True)
            votes = x[:, 0, : votes.shape[-1]]
        s = torch.full((c.kv_heads, c.rows), float("inf"), dtype=torch.float64, device=votes.device)
        s[:, ~in_window] = votes
        return s


@dataclass
class Tova(Policy):
    """Token omission via attention (Oren et al., "Transformers are Multi-State RNNs", arXiv
    2401.06104, Section 4; kvpress's TOVAPress): keep the rows the last query attends to most, its
    attention averaged over all heads of the layer (one mask for every head). The last query's own
    row is always kept, as in kvpress (the paper lets it compete; its weight is usually high)."""

    name: ClassVar[str] = "tova"

    def scores(self, c: LayerCapture) -> torch.Tensor:
        att = window_attention(c, self.name, 1)[:, -1, :]  # the last query: [q_heads, rows]
        _, qpos = c.need_queries(self.name)
        s = att.mean(dim=0)
        s = torch.where(c.positions == qpos[-1], float("inf"), s)
        return s.expand(c.kv_heads, -1).clone()


@dataclass
class ExpectedAttention(Policy):
    """Expected attention of future queries (Devoto et al., "Expected Attention: KV Cache
    Compression by Estimating Attention from Future Queries Distribution", 2025; kvpress's
    ExpectedAttentionPress): queries are modelled as Gaussian, with the mean and covariance
    (divided by n, the maximum-likelihood estimate, as kvpress) of the captured queries before
    RoPE; both are rotated by the average RoPE rotation over the next ``horizon`` positions after
    the history; a row's score is the expected attention logit ``mu.k * s + s^2 k^T Sigma k / 2``
    (the log of E[exp(s q.k)] under the Gaussian), softmaxed over rows, averaged over each GQA
    group, and weighted by the value norm (``use_vnorm``: ``(att + epsilon) * ||v||``).

    Sinks: the rows at the first ``sinks`` positions (attention sinks, kvpress's ``n_sink``) are
    always kept and left out of the scores, the softmax and the query statistics (a query at a
    sink position is not counted).

    Raises:
        OptionError: ``horizon`` < 1, ``sinks`` < 0, ``epsilon`` negative or not finite, or a flag
            that is not a bool (on construction); a capture without queries, RoPE, rows after the
            sinks or a query after them (on scoring).
    """

    name: ClassVar[str] = "expected"
    horizon: int = 512
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    sinks: int = 4

    def __post_init__(self) -> None:
        check_int("horizon", self.horizon, "average RoPE over at least 1 future position (kvpress uses 512).")
        check_int("sinks", self.sinks, "keep 0 or more sink positions (a whole number; kvpress keeps 4).", minimum=0)
        check_bool("use_covariance", self.use_covariance, "give True or False.")
        check_bool("use_vnorm", self.use_vnorm, "give True or False.")
        if (
            isinstance(self.epsilon, bool)
            or not isinstance(self.epsilon, (int, float))
            or not math.isfinite(self.epsilon)
            or self.epsilon < 0
        ):
            raise OptionError("epsilon", self.epsilon, "give a finite number >= 0 added to the scores (default 0).")

    def scores(self, c: LayerCapture) -> torch.Tensor:
        q, all_qpos = c.need_queries(self.name)
        q = q.double()
        if c.rope is None:
            raise OptionError("policy", self.name, "expected attention rotates queries with RoPE: capture it.")
        sink = _sink_rows(c, self.sinks)
        if bool(sink.all()):
            raise OptionError(
                "sinks", self.sinks, f"the layer has {c.rows} rows, all sinks: give fewer sinks than rows."
            )
        first_free = c.positions[~sink].min()  # queries at sink positions are left out of the statistics
        counted = all_qpos >= first_free
        if not bool(counted.any()):
            raise OptionError(
                "sinks", self.sinks, "every captured query sits at a sink position: capture later queries."
            )
        q, qpos = q[:, counted], all_qpos[counted]
        inv_freq, att_scale = c.rope
        inv_freq = inv_freq.double()
        # back to pre-RoPE queries: each (i, i + d/2) pair rotated by -angle, scale removed
        ang = qpos.double()[:, None] * inv_freq[None, :]  # [window, d/2]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        pre = (q * cos - _rotate_half(q) * sin) / att_scale
        mu = pre.mean(dim=1)  # [q_heads, d]
        # average rotation over the next `horizon` positions after the history's last one
        dev = q.device
        future = c.positions.max().double() + 1 + torch.arange(self.horizon, dtype=torch.float64, device=dev)
        fang = future[:, None] * inv_freq[None, :]
        cbar = torch.cat([fang.cos().mean(0)] * 2) * att_scale
        sbar = torch.cat([fang.sin().mean(0)] * 2) * att_scale
        d = q.shape[-1]
        rot = torch.diag(cbar) + torch.diag(sbar) @ _rotate_half_matrix(d, dev)  # R-bar, [d, d]
        k = c.keys.double()[:, ~sink].repeat_interleave(q.shape[0] // c.kv_heads, dim=0)  # [q_heads, free rows, d]
        s = c.scale()
        logits = torch.einsum("hd,hrd->hr", mu @ rot.T, k) * s
        if self.use_covariance:
            centered = pre - mu[:, None, :]
            cov = torch.einsum("hwd,hwe->hde", centered, centered) / pre.shape[1]
            cov = rot @ cov @ rot.T
            logits = logits + 0.5 * s * s * torch.einsum("hrd,hde,hre->hr", k, cov, k)
        att = per_kv_head(torch.softmax(logits, dim=-1), c.kv_heads)
        if self.use_vnorm:
            att = (att + self.epsilon) * c.values.double()[:, ~sink].norm(dim=-1)
        out = torch.full((c.kv_heads, c.rows), float("inf"), dtype=torch.float64, device=att.device)
        out[:, ~sink] = att
        return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def _rotate_half_matrix(d: int, device: torch.device) -> torch.Tensor:
    """P with ``P @ x == rotate_half(x)`` (the RoPE convention of transformers' Llama family), ``[d, d]`` float64."""
    return _rotate_half(torch.eye(d, dtype=torch.float64, device=device)).T


@dataclass
class Random(Policy):
    """Uniform random scores (seeded): the control every policy should beat."""

    name: ClassVar[str] = "random"
    seed: int = 0

    def __post_init__(self) -> None:
        check_int("seed", self.seed, "give a whole number >= 0 as the seed.", minimum=0)

    def scores(self, c: LayerCapture) -> torch.Tensor:
        # drawn on the CPU: a CUDA generator gives other numbers for the same seed
        g = torch.Generator(device="cpu").manual_seed(self.seed * 100_003 + c.layer)
        return torch.rand(c.kv_heads, c.rows, generator=g, dtype=torch.float64, device="cpu").to(c.keys.device)


@dataclass
class EventTopK(Policy):
    """Whole events by a pooled score: an ``inner`` policy's scores averaged over each event's rows
    (and heads), so an event is kept or evicted entirely; the header is always kept. What an
    event-structured memory that drops whole events presents."""

    name: ClassVar[str] = "event-topk"
    inner: Policy = field(default_factory=Knorm)

    def __post_init__(self) -> None:
        self.check_inner("inner", self.inner, "knorm (its scores are pooled per event)")

    def scores(self, c: LayerCapture) -> torch.Tensor:
        ev = c.need_events(self.name)
        inner = self.inner.scores(c).mean(dim=0)
        s = torch.empty(c.rows, dtype=torch.float64, device=inner.device)
        for e in ev.unique().tolist():
            rows = ev == e
            s[rows] = float("inf") if e < 0 else inner[rows].mean()
        return s.expand(c.kv_heads, -1).clone()

    def keep(self, c: LayerCapture, n_keep: int | torch.Tensor) -> torch.Tensor:
        """The header, then whole events, best pooled score first, each kept only if all its rows
        still fit in ``n_keep`` (per-head counts: the smallest); the same mask for every head (so at most
        ``n_keep`` rows, fewer when the next event does not fit)."""
        n_keep = n_keep if isinstance(n_keep, int) else int(n_keep.min())
        s = self.scores(c)[0]
        ev = c.need_events(self.name)
        keep = ev < 0  # the header first
        events = sorted((e for e in ev.unique().tolist() if e >= 0), key=lambda e: (-s[ev == e][0].item(), -e))
        for e in events:
            rows = ev == e
            if int(keep.sum()) + int(rows.sum()) <= n_keep:
                keep = keep | rows
        return keep.expand(c.kv_heads, -1).clone()


@dataclass
class UserPolicy(Policy):
    """A user's rule: ``fn(capture) -> [kv_heads, rows]`` scores (higher = keep)."""

    name: ClassVar[str] = "callable"
    fn: Callable[[LayerCapture], torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise OptionError("fn", self.fn, "give UserPolicy(fn=...), a function of a LayerCapture.")

    def scores(self, c: LayerCapture) -> torch.Tensor:
        assert self.fn is not None  # __post_init__ refuses a missing fn
        s = torch.as_tensor(self.fn(c), dtype=torch.float64, device=c.keys.device)
        if s.shape != (c.kv_heads, c.rows):
            raise OptionError(
                "policy scores", tuple(s.shape), f"return one score per (KV head, row): shape ({c.kv_heads}, {c.rows})."
            )
        return s


def kept_count(rows: int, ratio: float) -> int:
    """Rows kept of ``rows`` at compression ratio ``ratio``: ``max(1, int(rows * (1 - ratio)))``,
    kvpress 0.5.5's count in the same float arithmetic (``rows * (1 - ratio)`` rounded down; at
    least one row). ``rows - floor(ratio * rows)`` would keep one row more whenever ``ratio * rows``
    is fractional.

    Raises:
        OptionError: ``ratio`` outside [0, 1) or not a number; ``rows`` not a whole number >= 1.
    """
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:  # nan fails too
        raise OptionError("ratio", ratio, "give a compression ratio in [0, 1): the fraction of rows evicted.")
    check_int("rows", rows, "give the layer's row count, a whole number >= 1.")
    return max(1, int(rows * (1 - ratio)))


def keep_mask(policy: Policy, c: LayerCapture, ratio: float) -> torch.Tensor:
    """The rows a policy keeps at compression ratio ``ratio`` (fraction evicted): :meth:`Policy.mask`, by
    default :func:`kept_count` rows per KV head; a policy with per-layer or per-head budgets
    (``eventkv.eviction.budgets``) keeps other counts per head, ``kept_count`` on average over the layer's
    heads (per-head budgets) or over the layers (per-layer budgets; SimLayerKV, whose lazy layers set the count,
    reads no ratio but 0).

    Returns:
        ``[kv_heads, rows]`` bool.

    Raises:
        OptionError: ``ratio`` outside [0, 1); scores of the wrong shape, or nan.
    """
    return policy.mask(c, ratio)
