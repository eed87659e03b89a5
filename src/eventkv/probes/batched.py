"""Batched readouts over several served caches at once (the probes' fast path).

On a CPU a decode step costs about the same for 1 or 8 sequences (reading the weights
dominates), so every arm of a donor pair is answered in one batch: the served caches are
left-padded with masked rows to a common row count, the query runs once for the whole batch,
candidate scoring branches off the query's cache in one forward, and greedy decoding runs the
generating arms together, dropping each sequence from the batch as it stops.

Results equal :func:`eventkv.readout.generate` and :func:`eventkv.readout.candidate_logprobs`
run one cache at a time up to float rounding (tested): pad rows are masked out of attention
(weight exactly 0), every sequence keeps its own position ids, and on sliding-window layers the
window still counts the sequence's own rows (padding sits before the header, outside any
window that reaches real rows before it would reach the pad).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from eventkv.errors import EventKVError
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from eventkv.prefill import check_context, model_forward
from eventkv.readout import CandidateScore, Generation
from eventkv.serve import ServedCache


class GrowingLayer(DynamicLayer):
    """A cache layer over a preallocated buffer ``[batch, kv_heads, capacity, head_dim]``: new rows
    are written in place (no ``torch.cat`` of the whole cache per decode step); ``keys`` and
    ``values`` are views of the filled rows. The buffer doubles when full."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        super().__init__()
        b, h, n, d = keys.shape
        cap = max(capacity, n)
        self._k = keys.new_empty(b, h, cap, d)
        self._v = values.new_empty(b, h, cap, values.shape[3])
        self._k[:, :, :n] = keys
        self._v[:, :, :n] = values
        self.n = n
        self.device = keys.device
        self.is_initialized = True
        self._views()

    def _views(self) -> None:
        self.keys = self._k[:, :, : self.n]
        self.values = self._v[:, :, : self.n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        q = key_states.shape[-2]
        if self.n + q > self._k.shape[2]:
            cap = 2 * (self.n + q)
            k, v = self._k.new_empty(*self._k.shape[:2], cap, self._k.shape[3]), self._v.new_empty(*self._v.shape[:2], cap, self._v.shape[3])
            k[:, :, : self.n], v[:, :, : self.n] = self.keys, self.values
            self._k, self._v = k, v
        self._k[:, :, self.n: self.n + q] = key_states
        self._v[:, :, self.n: self.n + q] = value_states
        self.n += q
        self._views()
        return self.keys, self.values


def growing_cache(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], capacity: int) -> DynamicCache:
    """A ``DynamicCache`` whose layers are :class:`GrowingLayer` s holding these rows (copied)."""
    cache = DynamicCache()
    cache.layers = [GrowingLayer(k, v, capacity) for k, v in zip(keys, values)]
    return cache


@dataclass
class Batch:
    """Several served caches stacked on the batch axis.

    cache: a DynamicCache of GrowingLayers, per layer ``[batch, kv_heads, rows, head_dim]``
    (left-padded with zero rows); mask: ``[batch, rows]`` bool, False on pad rows and on rows a
    native cache hides; next_position: ``[batch]`` int64, each sequence's first query position.
    """

    cache: DynamicCache
    mask: torch.Tensor
    next_position: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    def select(self, idx: Sequence[int], capacity: int) -> "Batch":
        """A copy of the sub-batch at ``idx`` (indices may repeat) with room for ``capacity`` rows."""
        i = torch.tensor(list(idx), dtype=torch.long, device=self.mask.device)
        layers = self.cache.layers
        cache = growing_cache([l.keys.index_select(0, i) for l in layers],
                              [l.values.index_select(0, i) for l in layers], capacity)
        return Batch(cache, self.mask.index_select(0, i), self.next_position.index_select(0, i.cpu()))

    def forward(self, model, ids: torch.Tensor, offset: int, logits_to_keep: int = 0) -> torch.Tensor:
        """Append ``ids [batch, q]`` (at positions ``next_position + offset + arange(q)``) to this
        batch's rows; returns logits ``[batch, q or logits_to_keep, vocab]``."""
        dev = self.mask.device
        b, q = ids.shape
        pos = self.next_position.to(dev).unsqueeze(1) + offset + torch.arange(q, device=dev).unsqueeze(0)
        self.mask = torch.cat([self.mask, torch.ones(b, q, dtype=torch.bool, device=dev)], dim=1)
        return model_forward(model, ids.to(dev), pos, self.cache, self.mask, logits_to_keep=logits_to_keep)


def stack(served: Sequence[ServedCache], extra: int = 0) -> Batch:
    """Left-pad the served caches to a common row count and stack them (``[batch, ...]``), with
    room for ``extra`` more rows."""
    if not served:
        raise EventKVError("nothing to read out: give at least one served cache.")
    n = max(s.n_rows for s in served)
    dev = served[0].keys[0].device
    layers = []
    for layer in range(len(served[0].keys)):
        k0, v0 = served[0].keys[layer], served[0].values[layer]
        k = k0.new_zeros(len(served), k0.shape[1], n + extra, k0.shape[3])
        v = v0.new_zeros(len(served), v0.shape[1], n + extra, v0.shape[3])
        for i, s in enumerate(served):
            r = s.n_rows
            k[i, :, n - r: n] = s.keys[layer][0]
            v[i, :, n - r: n] = s.values[layer][0]
        gl = GrowingLayer.__new__(GrowingLayer)
        DynamicLayer.__init__(gl)
        gl._k, gl._v, gl.n, gl.device, gl.is_initialized = k, v, n, dev, True
        gl._views()
        layers.append(gl)
    cache = DynamicCache()
    cache.layers = layers
    mask = torch.zeros(len(served), n, dtype=torch.bool, device=dev)
    for i, s in enumerate(served):
        vis = s.visible if s.visible is not None else torch.ones(s.n_rows, dtype=torch.bool)
        mask[i, n - s.n_rows:] = vis.to(dev)
    nxt = torch.tensor([s.next_position for s in served], dtype=torch.long)
    return Batch(cache, mask, nxt)


@dataclass
class Readout:
    """What one served cache answered: its greedy generation (or None) and its candidate scores
    (empty when not asked)."""

    generation: Generation | None
    candidates: list[CandidateScore]


@torch.inference_mode()
def read_out(model, served: Sequence[ServedCache], query_ids: Sequence[int], *, generate: Sequence[bool],
             score: Sequence[bool], candidates: Sequence[Sequence[int]] = (), candidate_texts: Sequence[str] = (),
             answer_prefix_ids: Sequence[int] = (), max_new_tokens: int = 64, stop_token_ids: Sequence[int] = (),
             tokenizer=None, max_context: int | None = None) -> list[Readout]:
    """Answer one query from several served caches in batched forwards.

    Args:
        served: the served caches (any modes, any row counts).
        query_ids: the query's token ids (question + chat tail), the same for every cache.
        generate: per cache, whether to decode greedily (up to ``max_new_tokens``, stopping on
            ``stop_token_ids``, which are not emitted).
        score: per cache, whether to score the candidates.
        candidates: token ids per candidate; each is scored as the continuation of
            ``query_ids + answer_prefix_ids`` (full continuation: sum of its tokens' log-probs, nats).
        answer_prefix_ids: forced answer opener placed before the candidates (e.g. ``"Answer:"``).

    Returns:
        one Readout per served cache, in order.

    Raises:
        EventKVError: empty query, empty candidate, or history + query beyond the model's context.
    """
    if not query_ids:
        raise EventKVError("the query is empty: give a question.")
    if any(score) and (not candidates or any(len(c) == 0 for c in candidates)):
        raise EventKVError("candidate scoring needs at least one candidate and no empty candidate.")
    longest = max([len(c) for c in candidates], default=0) + len(answer_prefix_ids)
    for s in served:
        check_context(s.next_position + len(query_ids) + max(max_new_tokens, longest), max_context,
                      what="history plus query")
    batch = stack(served, extra=q_len_extra(query_ids, max_new_tokens, longest))
    dev = batch.mask.device
    q = len(query_ids)
    first = batch.forward(model, torch.tensor([list(query_ids)] * batch.size, device=dev), 0, logits_to_keep=1)[:, -1]
    out = [Readout(None, []) for _ in served]

    scored = [i for i, f in enumerate(score) if f]
    if scored:
        _score(model, batch, first, scored, q, candidates, candidate_texts, list(answer_prefix_ids), out)
    gens = [i for i, f in enumerate(generate) if f]
    if gens:
        sub = batch if len(gens) == batch.size else batch.select(gens, batch.mask.shape[1] + max_new_tokens)
        _generate(model, sub, first[gens], gens, q, max_new_tokens,
                  set(int(t) for t in stop_token_ids), tokenizer, out)
    return out


def q_len_extra(query_ids: Sequence[int], max_new_tokens: int, longest: int) -> int:
    """Rows a batch must have room for beyond its served rows: the query plus the longer of the
    generation and the candidate continuation."""
    return len(query_ids) + max(max_new_tokens, longest)


def _score(model, batch: Batch, first: torch.Tensor, scored: list[int], q: int, candidates, texts,
           prefix: list[int], out: list[Readout]) -> None:
    n_c = len(candidates)
    seqs = [prefix + list(c) for c in candidates]
    width = max(len(s) for s in seqs) - 1
    first_lp = torch.log_softmax(first.double(), dim=-1)
    lp = None
    if width > 0:
        sub = batch.select([i for i in scored for _ in range(n_c)], batch.mask.shape[1] + width)
        ids = torch.zeros(sub.size, width, dtype=torch.long)
        for r in range(sub.size):
            s = seqs[r % n_c][:-1]
            ids[r, : len(s)] = torch.tensor(s)
        lp = torch.log_softmax(sub.forward(model, ids, q).double(), dim=-1)
    for a, i in enumerate(scored):
        per = []
        for c, s in enumerate(seqs):
            r = a * n_c + c
            tl = []
            for k in range(len(prefix), len(s)):
                tl.append(float(first_lp[i, s[0]]) if k == 0 else float(lp[r, k - 1, s[k]]))
            per.append(tl)
        totals = torch.tensor([sum(t) for t in per], dtype=torch.float64)
        probs = torch.softmax(totals, dim=0)
        out[i].candidates = [CandidateScore(texts[c] if texts else "", list(candidates[c]), float(totals[c]),
                                            per[c], float(probs[c])) for c in range(n_c)]


def _generate(model, batch: Batch, logits: torch.Tensor, owners: list[int], q: int, max_new: int,
              stops: set[int], tokenizer, out: list[Readout]) -> None:
    """Greedy decoding of the whole batch; a sequence that has stopped keeps being fed its last
    token (its rows are never read) so the batch never has to be copied."""
    gens = [Generation(tokens=[]) for _ in owners]
    done = [max_new <= 0] * len(owners)
    step = 0
    while not all(done):
        toks = torch.argmax(logits, dim=-1).tolist()
        feed = []
        for r, g in enumerate(gens):
            t = int(toks[r])
            if not done[r]:
                if t in stops:
                    g.stopped = True
                    done[r] = True
                else:
                    g.tokens.append(t)
                    done[r] = len(g.tokens) >= max_new
            feed.append(t)
        if all(done):
            break
        logits = batch.forward(model, torch.tensor(feed, dtype=torch.long).unsqueeze(1), q + step, logits_to_keep=1)[:, -1]
        step += 1
    for g, i in zip(gens, owners):
        if tokenizer is not None:
            g.text = tokenizer.decode(g.tokens, skip_special_tokens=True)
        out[i].generation = g
