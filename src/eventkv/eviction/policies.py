"""KV-cache eviction policies as pure scoring rules over one layer's captured inputs (issue 13,
point 1), each written from its paper. A policy scores every (KV head, row) of a layer; the
:func:`keep_mask` of a **compression ratio** ``r`` (the fraction of rows evicted, kvpress's
convention) keeps, per KV head, the ``rows - floor(r * rows)`` best-scored rows.

Positions: every rule that depends on where a row sits reads ``LayerCapture.positions`` — the
rows' real RoPE position ids from the log (position budgets leave gaps) — never the row index.

Devices: a rule computes on the capture's device (every tensor it makes follows ``keys``); the
captures of :func:`eventkv.eviction.capture.capture_prefill` are on the CPU, in float32 and float64,
so a policy's scores do not depend on the device the model ran on beyond the captured inputs'
rounding. Random scores are drawn on the CPU from a seeded generator whatever the device.

Why not kvpress: kvpress 0.5.5 pins transformers < 5.3, its hooks fail on 5.24 (the attention
keyword is now ``cache``), and importing it patches every attention function process-wide; the
rules are short, so they are written here from the papers (a parity test runs where someone
installs kvpress by hand).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from eventkv.errors import OptionError


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

    @property
    def kv_heads(self) -> int:
        return self.keys.shape[0]

    @property
    def rows(self) -> int:
        return self.keys.shape[1]

    def scale(self) -> float:
        return self.scaling if self.scaling is not None else 1.0 / math.sqrt(self.keys.shape[-1])

    def need_queries(self, who: str) -> torch.Tensor:
        if self.queries is None or self.query_positions is None:
            raise OptionError("policy", who, "this policy reads the observation window's queries: capture them.")
        return self.queries


class Policy:
    """A scoring rule: :meth:`scores` gives ``[kv_heads, rows]`` float64, higher = keep;
    :meth:`keep` turns them into the kept rows (per head, the ``n_keep`` best)."""

    name: ClassVar[str] = ""

    def scores(self, c: LayerCapture) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def keep(self, c: LayerCapture, n_keep: int) -> torch.Tensor:
        """``[kv_heads, rows]`` bool: per KV head the ``n_keep`` highest scores, ties to the later position.

        Raises:
            OptionError: scores of the wrong shape, or nan.
        """
        s = self.scores(c)
        if s.shape != (c.kv_heads, c.rows):
            raise OptionError("policy scores", tuple(s.shape), f"expected ({c.kv_heads}, {c.rows}).")
        if torch.isnan(s).any():
            raise OptionError("policy scores", "nan", f"{self.name} gave nan scores on layer {c.layer}.")
        # ties: the later position wins — sort by position descending, then stably by score descending
        by_pos = torch.argsort(c.positions, descending=True, stable=True)
        by_score = torch.argsort(s[:, by_pos], dim=1, descending=True, stable=True)
        mask = torch.zeros(c.kv_heads, c.rows, dtype=torch.bool, device=s.device)
        mask.scatter_(1, by_pos[by_score[:, :n_keep]], True)
        return mask


def _window_attention(c: LayerCapture, who: str, window: int | None = None) -> torch.Tensor:
    """Softmax attention of the last ``window`` captured queries (all when None) over every row,
    ``[q_heads, window, rows]`` float64, causal by position (a query sees rows at positions <= its own)."""
    q = c.need_queries(who).double()
    qpos = c.query_positions
    if window is not None:
        q, qpos = q[:, -window:], qpos[-window:]
    k = c.keys.double()
    group = q.shape[0] // c.kv_heads
    k = k.repeat_interleave(group, dim=0)  # [q_heads, rows, head_dim]
    logits = torch.einsum("hwd,hrd->hwr", q, k) * c.scale()
    visible = c.positions[None, :] <= qpos[:, None]  # [window, rows]
    logits = logits.masked_fill(~visible[None], float("-inf"))
    return torch.softmax(logits, dim=-1)


def _per_kv_head(att: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """``[q_heads, rows]`` -> ``[kv_heads, rows]`` by averaging each GQA group's query heads."""
    return att.reshape(kv_heads, att.shape[0] // kv_heads, att.shape[-1]).mean(dim=1)


@dataclass
class StreamingLLM(Policy):
    """Keep the first ``sinks`` positions (attention sinks) and the most recent rows (Xiao et al.,
    "Efficient Streaming Language Models with Attention Sinks", arXiv 2309.17453, Section 3.2: 4
    initial tokens + a rolling window). Score: sinks first, then by position, later = better."""

    name: ClassVar[str] = "streaming"
    sinks: int = 4

    def scores(self, c: LayerCapture) -> torch.Tensor:
        pos = c.positions.double()
        order = torch.argsort(c.positions, stable=True)
        sink = torch.zeros(c.rows, dtype=torch.bool, device=c.positions.device)
        sink[order[: self.sinks]] = True  # the rows at the first `sinks` positions
        s = torch.where(sink, pos.max() + 1.0 + (self.sinks - pos), pos)
        return s.expand(c.kv_heads, -1).clone()


@dataclass
class Knorm(Policy):
    """Keep the keys of the smallest L2 norm (Devoto et al., "A Simple and Effective L2 Norm-Based
    Strategy for KV Cache Compression", arXiv 2406.11430, Section 3: low key norm correlates with
    high attention). Score: ``-||k||`` per head and row."""

    name: ClassVar[str] = "knorm"

    def scores(self, c: LayerCapture) -> torch.Tensor:
        return -c.keys.double().norm(dim=-1)


@dataclass
class SnapKV(Policy):
    """Observation-window attention (Li et al., "SnapKV: LLM Knows What You Are Looking for Before
    Generation", arXiv 2404.14469, Section 4.2): the last ``window`` queries' softmax attention to
    each earlier row is summed over the window, averaged over each GQA group's query heads,
    smoothed by 1D pooling (``kernel``, ``pooling`` max or avg, stride 1, same length), and the
    window's own rows are always kept."""

    name: ClassVar[str] = "snapkv"
    window: int = 32
    kernel: int = 7
    pooling: str = "max"

    def scores(self, c: LayerCapture) -> torch.Tensor:
        if c.queries is not None and c.queries.shape[1] < self.window:
            raise OptionError(
                "window", self.window, f"the capture holds {c.queries.shape[1]} queries: capture at least the window."
            )
        att = _window_attention(c, self.name, self.window)  # [q_heads, window, rows]
        in_window = c.positions >= c.query_positions[-self.window :].min()
        votes = att[:, :, ~in_window].sum(dim=1)  # [q_heads, prefix rows]
        votes = _per_kv_head(votes, c.kv_heads)
        if self.kernel > 1 and votes.shape[-1] > 0:
            x = votes[:, None, :]
            pad = self.kernel // 2
            if self.pooling == "max":
                x = torch.nn.functional.max_pool1d(x, self.kernel, 1, pad)
            else:
                x = torch.nn.functional.avg_pool1d(x, self.kernel, 1, pad, count_include_pad=False)
            votes = x[:, 0, : votes.shape[-1]]
        s = torch.full((c.kv_heads, c.rows), float("inf"), dtype=torch.float64, device=votes.device)
        s[:, ~in_window] = votes
        return s


@dataclass
class Tova(Policy):
    """Token omission via attention (Oren et al., "Transformers are Multi-State RNNs", arXiv
    2401.06104, Section 4): keep the rows the last query attends to most, its attention averaged
    over all heads of the layer (one mask for every head)."""

    name: ClassVar[str] = "tova"

    def scores(self, c: LayerCapture) -> torch.Tensor:
        att = _window_attention(c, self.name, 1)[:, -1, :]  # the last query: [q_heads, rows]
        return att.mean(dim=0).expand(c.kv_heads, -1).clone()


@dataclass
class ExpectedAttention(Policy):
    """Expected attention of future queries (Devoto et al., "Expected Attention: KV Cache
    Compression by Estimating Attention from Future Queries Distribution", 2025; kvpress's
    ExpectedAttentionPress): queries are modelled as Gaussian, with the mean and covariance of the
    window's queries before RoPE; both are rotated by the average RoPE rotation over the next
    ``horizon`` positions after the history; a row's score is the expected attention logit
    ``mu.k * s + s^2 k^T Sigma k / 2`` (the log of E[exp(s q.k)] under the Gaussian), softmaxed
    over rows, averaged over each GQA group, and weighted by the value norm (``use_vnorm``)."""

    name: ClassVar[str] = "expected"
    horizon: int = 512
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0

    def scores(self, c: LayerCapture) -> torch.Tensor:
        q = c.need_queries(self.name).double()
        if c.rope is None:
            raise OptionError("policy", self.name, "expected attention rotates queries with RoPE: capture it.")
        inv_freq, att_scale = c.rope
        inv_freq = inv_freq.double()
        # back to pre-RoPE queries: each (i, i + d/2) pair rotated by -angle, scale removed
        ang = c.query_positions.double()[:, None] * inv_freq[None, :]  # [window, d/2]
        cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
        pre = (q * cos - _rotate_half(q) * sin) / att_scale
        mu = pre.mean(dim=1)  # [q_heads, d]
        # average rotation over the next `horizon` positions after the last one
        dev = q.device
        future = c.query_positions.max().double() + 1 + torch.arange(self.horizon, dtype=torch.float64, device=dev)
        fang = future[:, None] * inv_freq[None, :]
        cbar = torch.cat([fang.cos().mean(0)] * 2) * att_scale
        sbar = torch.cat([fang.sin().mean(0)] * 2) * att_scale
        d = q.shape[-1]
        rot = torch.diag(cbar) + torch.diag(sbar) @ _rotate_half_matrix(d, dev)  # R-bar, [d, d]
        k = c.keys.double().repeat_interleave(q.shape[0] // c.kv_heads, dim=0)  # [q_heads, rows, d]
        s = c.scale()
        logits = torch.einsum("hd,hrd->hr", mu @ rot.T, k) * s
        if self.use_covariance and pre.shape[1] > 1:
            centered = pre - mu[:, None, :]
            cov = torch.einsum("hwd,hwe->hde", centered, centered) / (pre.shape[1] - 1)
            cov = rot @ cov @ rot.T
            logits = logits + 0.5 * s * s * torch.einsum("hrd,hde,hre->hr", k, cov, k)
        att = _per_kv_head(torch.softmax(logits, dim=-1), c.kv_heads)
        if self.use_vnorm:
            att = (att + self.epsilon) * c.values.double().norm(dim=-1)
        return att


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

    def scores(self, c: LayerCapture) -> torch.Tensor:
        if c.event_of_row is None:
            raise OptionError("policy", self.name, "event-level scoring needs each row's event: capture the log.")
        inner = self.inner.scores(c).mean(dim=0)
        ev = c.event_of_row
        s = torch.empty(c.rows, dtype=torch.float64, device=inner.device)
        for e in ev.unique().tolist():
            rows = ev == e
            s[rows] = float("inf") if e < 0 else inner[rows].mean()
        return s.expand(c.kv_heads, -1).clone()

    def keep(self, c: LayerCapture, n_keep: int) -> torch.Tensor:
        """The header, then whole events, best pooled score first, each kept only if all its rows
        still fit in ``n_keep``; the same mask for every head (so at most ``n_keep`` rows, fewer when
        the next event does not fit)."""
        s = self.scores(c)[0]
        ev = c.event_of_row
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

    def scores(self, c: LayerCapture) -> torch.Tensor:
        if self.fn is None:
            raise OptionError("policy", None, "give UserPolicy(fn=...), a function of a LayerCapture.")
        s = torch.as_tensor(self.fn(c), dtype=torch.float64, device=c.keys.device)
        if s.shape != (c.kv_heads, c.rows):
            raise OptionError(
                "policy scores", tuple(s.shape), f"return one score per (KV head, row): shape ({c.kv_heads}, {c.rows})."
            )
        return s


POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (StreamingLLM, Knorm, SnapKV, Tova, ExpectedAttention, Random, EventTopK)
}


def make_policy(name: str, **options) -> Policy:
    """The registered policy ``name`` with ``options``.

    Raises:
        OptionError: an unknown name (the message lists the registered ones).
    """
    if name not in POLICIES:
        raise OptionError("policy", name, f"use one of {', '.join(POLICIES)}.", flag="--policy")
    return POLICIES[name](**options)


def keep_mask(policy: Policy, c: LayerCapture, ratio: float) -> torch.Tensor:
    """The rows a policy keeps at compression ratio ``ratio`` (fraction evicted): at most
    ``rows - floor(ratio * rows)`` per KV head (:meth:`Policy.keep`).

    Returns:
        ``[kv_heads, rows]`` bool.

    Raises:
        OptionError: ``ratio`` outside [0, 1); scores of the wrong shape, or nan.
    """
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio < 1:
        raise OptionError("ratio", ratio, "give a compression ratio in [0, 1): the fraction of rows evicted.")
    return policy.keep(c, c.rows - math.floor(ratio * c.rows))
