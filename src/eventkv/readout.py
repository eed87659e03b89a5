"""Readouts: answer a query from served caches (Study 1, "Donor pair", readouts).

One implementation, batched: :func:`read_out` answers one query from several served caches at
once, and the single-cache functions are that same path with a batch of one.

* :func:`generate` — greedy decoding (max new tokens, stops on EOS/end-of-turn).
* :func:`candidate_logprobs` — forced choice: every candidate's full continuation is scored
  (sum of its tokens' log-probabilities), all candidates in one batched forward.
* :func:`token_logprobs` — the one place a log-probability is computed: a float64 log-softmax
  of the float32 logits, so sums over many tokens and a large vocabulary match a float64
  reference within 1e-5 nats (a float32 log-softmax over a 49k vocabulary drifted by up to
  2.4e-4 nats on 12-token candidates).

Queries are placed at positions starting at ``served.next_position`` (right after the full
history). Nothing here modifies a served cache.

Several queries (one per cache, of any lengths) read out together: the caches whose queries have
one length take their query forward as one batch, and the generating sequences of every length
then decode as one batch, each left-padded again so that its own rows and its query's rows stay
contiguous (no padding between a cache's rows and its query): what answers several clients'
queries on several memories in one batched readout (:func:`eventkv.memory.answer.answer_prepared`).

Why batching is the default: on a CPU a decode step costs about the same for 1 or 8 sequences
(reading the weights dominates), so every arm of a donor pair is answered in one batch: the
served caches are left-padded with masked rows to a common row count, the query runs once for
the whole batch, candidate scoring branches off the query's cache in one forward, and greedy
decoding runs the generating arms together. Pad rows are masked out of attention (weight
exactly 0), every sequence keeps its own position ids, and on sliding-window layers the window
still counts the sequence's own rows (padding sits before the header, outside any window that
reaches real rows before it would reach the pad).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from eventkv.errors import EventKVError
from eventkv.log import encode
from eventkv.prefill import cache_kv, check_context, model_forward
from eventkv.serve import ServedCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Generation:
    """A greedy continuation. ``tokens`` excludes the stop token; ``stopped`` says whether a stop
    token ended it (else max_new_tokens did); ``logits`` holds each step's logits ``[vocab]``
    when requested."""

    tokens: list[int]
    text: str = ""
    stopped: bool = False
    logits: list[torch.Tensor] = field(default_factory=list)


@dataclass
class CandidateScore:
    """Score of one candidate continuation: ``logprob`` is the sum over its tokens (nats);
    ``token_logprobs`` per token; ``prob`` its share among the candidates (softmax of logprob)."""

    text: str
    tokens: list[int]
    logprob: float
    token_logprobs: list[float]
    prob: float = 0.0


@dataclass
class Readout:
    """What one served cache answered: its greedy generation (or None) and its candidate scores
    (empty when not asked)."""

    generation: Generation | None
    candidates: list[CandidateScore]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities (nats, float64) of ``token_ids`` under ``logits``.

    Args:
        logits: ``[..., vocab]`` (any float dtype; promoted to float64 before the log-softmax).
        token_ids: ``[...]`` int64, the same leading shape.

    Returns:
        ``[...]`` float64.
    """
    lp = torch.log_softmax(logits.double(), dim=-1)
    return lp.gather(-1, token_ids.to(lp.device).unsqueeze(-1)).squeeze(-1)


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

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, n: int) -> "GrowingLayer":
        """A layer over the preallocated buffers ``keys`` / ``values`` ``[batch, kv_heads, capacity,
        head_dim]`` (not copied) whose first ``n`` rows are filled."""
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        layer._k, layer._v, layer.n, layer.device, layer.is_initialized = keys, values, n, keys.device, True
        layer._views()
        return layer

    def _views(self) -> None:
        self.keys = self._k[:, :, : self.n]
        self.values = self._v[:, :, : self.n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        q = key_states.shape[-2]
        if self.n + q > self._k.shape[2]:
            cap = 2 * (self.n + q)
            k, v = (
                self._k.new_empty(*self._k.shape[:2], cap, self._k.shape[3]),
                self._v.new_empty(*self._v.shape[:2], cap, self._v.shape[3]),
            )
            k[:, :, : self.n], v[:, :, : self.n] = self._k[:, :, : self.n], self._v[:, :, : self.n]
            self._k, self._v = k, v
        self._k[:, :, self.n : self.n + q] = key_states
        self._v[:, :, self.n : self.n + q] = value_states
        self.n += q
        self._views()
        return self.keys, self.values


def growing_cache(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], capacity: int) -> DynamicCache:
    """A ``DynamicCache`` whose layers are :class:`GrowingLayer` s holding these rows (copied)."""
    cache = DynamicCache()  # config-less: no layers until given
    cache.layers.extend(GrowingLayer(k, v, capacity) for k, v in zip(keys, values))
    return cache


@dataclass
class Batch:
    """Several served caches stacked on the batch axis.

    cache: a DynamicCache of GrowingLayers, per layer ``[batch, kv_heads, rows, head_dim]``
    (left-padded with zero rows); mask: ``[batch, rows]`` bool, False on pad rows and on rows a
    native cache hides; next_position: ``[batch]`` int64, each sequence's first query position.
    All three live on the rows' device (the model's), so a decode step copies nothing to or from it.
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
        keys, values = cache_kv(self.cache)
        cache = growing_cache([k.index_select(0, i) for k in keys], [v.index_select(0, i) for v in values], capacity)
        return Batch(cache, self.mask.index_select(0, i), self.next_position.index_select(0, i))

    def forward(self, model: PreTrainedModel, ids: torch.Tensor, offset: int, logits_to_keep: int = 0) -> torch.Tensor:
        """Append ``ids [batch, q]`` (at positions ``next_position + offset + arange(q)``) to this
        batch's rows; returns logits ``[batch, q or logits_to_keep, vocab]``."""
        dev = self.mask.device
        b, q = ids.shape
        pos = self.next_position.unsqueeze(1) + offset + torch.arange(q, device=dev).unsqueeze(0)
        self.mask = torch.cat([self.mask, torch.ones(b, q, dtype=torch.bool, device=dev)], dim=1)
        return model_forward(model, ids, pos, self.cache, self.mask, logits_to_keep=logits_to_keep)


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
            k[i, :, n - r : n] = s.keys[layer][0]
            v[i, :, n - r : n] = s.values[layer][0]
        layers.append(GrowingLayer.over(k, v, n))
    cache = DynamicCache()
    cache.layers.extend(layers)  # config-less: no layers until given
    mask = torch.zeros(len(served), n, dtype=torch.bool, device=dev)
    for i, s in enumerate(served):
        mask[i, n - s.n_rows :] = True if s.visible is None else s.visible.to(dev)
    nxt = torch.tensor([s.next_position for s in served], dtype=torch.long, device=dev)
    return Batch(cache, mask, nxt)


def merge(parts: Sequence[tuple[Batch, int, int]], extra: int) -> Batch:
    """Sequences of several batches (of any row counts) as one batch: ``parts`` are ``(batch, index
    in it, shift)``; each sequence's rows are left-padded with masked zero rows to the longest one's
    count (so its own rows stay contiguous at the end, as :func:`stack` leaves them) and its next
    position moves by ``shift`` (the query rows it was given since). Room for ``extra`` more rows;
    indices may repeat. The rows are copied: the batches are left as they were."""
    n = max(int(b.mask.shape[1]) for b, _, _ in parts)
    dev = parts[0][0].mask.device
    rows = {id(b): cache_kv(b.cache) for b, _, _ in parts}  # per batch: per layer keys, values
    layers = []
    for layer in range(len(parts[0][0].cache.layers)):
        k0, v0 = rows[id(parts[0][0])][0][layer], rows[id(parts[0][0])][1][layer]
        k = k0.new_zeros(len(parts), k0.shape[1], n + extra, k0.shape[3])
        v = v0.new_zeros(len(parts), v0.shape[1], n + extra, v0.shape[3])
        for r, (b, i, _) in enumerate(parts):
            kb, vb = rows[id(b)][0][layer], rows[id(b)][1][layer]
            m = kb.shape[2]
            k[r, :, n - m : n] = kb[i]
            v[r, :, n - m : n] = vb[i]
        layers.append(GrowingLayer.over(k, v, n))
    cache = DynamicCache()  # config-less: no layers until given
    cache.layers.extend(layers)
    mask = torch.zeros(len(parts), n, dtype=torch.bool, device=dev)
    for r, (b, i, _) in enumerate(parts):
        mask[r, n - b.mask.shape[1] :] = b.mask[i]
    nxt = torch.stack([b.next_position[i] + shift for b, i, shift in parts])
    return Batch(cache, mask, nxt)


@torch.inference_mode()
def read_out(
    model: PreTrainedModel,
    served: Sequence[ServedCache],
    query_ids: Sequence[int] | Sequence[Sequence[int]],
    *,
    generate: Sequence[bool],
    score: Sequence[bool],
    candidates: Sequence[Sequence[int]] = (),
    candidate_texts: Sequence[str] = (),
    answer_prefix_ids: Sequence[int] = (),
    max_new_tokens: int | Sequence[int] = 64,
    stop_token_ids: Sequence[int] = (),
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_context: int | None = None,
    keep_logits: bool = False,
) -> list[Readout]:
    """Answer one query, or one query per cache, from several served caches in batched forwards.

    Args:
        served: the served caches (any modes, any row counts).
        query_ids: the query's token ids (question + chat tail), the same for every cache; or one
            query per cache, of any lengths (several items' or clients' questions read out in one
            batch). The caches whose queries have one length run their query forward together; the
            generating sequences then decode together. No padding goes between a cache's rows and
            its query, so sliding-window layers see the rows they would see alone.
        generate: per cache, whether to decode greedily (up to ``max_new_tokens``, stopping on
            ``stop_token_ids``, which are not emitted).
        score: per cache, whether to score the candidates.
        candidates: token ids per candidate; each is scored as the continuation of
            ``query_ids + answer_prefix_ids`` (full continuation: sum of its tokens' log-probs, nats).
        answer_prefix_ids: forced answer opener placed before the candidates (e.g. ``"Answer:"``).
        max_new_tokens: the greedy decoding budget (tokens), for every cache or one per cache.
        keep_logits: keep each generated step's logits ``[vocab]`` in ``Generation.logits``.

    Returns:
        one Readout per served cache, in order.

    Raises:
        EventKVError: ``generate`` or ``score`` not one flag per served cache, empty query, per-cache
            queries or budgets not one per cache, empty candidate, or history + query beyond the
            model's context.
    """
    n = len(served)
    if len(generate) != n or len(score) != n:
        raise EventKVError(
            f"read_out got {n} served caches but {len(generate)} generate and {len(score)} "
            f"score flags: give one generate flag and one score flag per served cache."
        )
    queries = _queries(query_ids, n)
    budgets = _budgets(max_new_tokens, n)
    if any(score) and (not candidates or any(len(c) == 0 for c in candidates)):
        raise EventKVError("candidate scoring needs at least one candidate and no empty candidate.")
    longest = max([len(c) for c in candidates], default=0) + len(answer_prefix_ids)
    for s, query, budget in zip(served, queries, budgets):
        check_context(s.next_position + len(query) + max(budget, longest), max_context, what="history plus query")
    out = [Readout(None, []) for _ in served]
    groups: dict[int, list[int]] = {}  # query length -> the caches with a query of that length
    for i, query in enumerate(queries):
        groups.setdefault(len(query), []).append(i)
    where: dict[int, tuple[Batch, int, int]] = {}  # cache -> (its group's batch, index there, query length)
    firsts: dict[int, torch.Tensor] = {}  # cache -> the query's last logits [vocab]
    for q, idx in groups.items():
        room = max([budgets[i] for i in idx if generate[i]], default=0)
        batch = stack([served[i] for i in idx], extra=q_len_extra(queries[idx[0]], room, longest))
        first = batch.forward(model, torch.tensor([queries[i] for i in idx], device=batch.mask.device), 0, 1)[:, -1]
        scored = [j for j, i in enumerate(idx) if score[i]]
        if scored:
            local = [out[i] for i in idx]  # the same Readout objects: _score fills them in place
            _score(model, batch, first, scored, q, candidates, candidate_texts, list(answer_prefix_ids), local)
        for j, i in enumerate(idx):
            where[i], firsts[i] = (batch, j, q), first[j]
    gens = [i for i, f in enumerate(generate) if f]
    if gens:
        dev = where[gens[0]][0].mask.device
        rows = gens + [gens[0]] * decode_padding(len(gens), dev)
        room = max(budgets[i] for i in gens)
        batch, _, q = where[gens[0]]
        if len(groups) == 1 and rows == list(range(batch.size)):
            sub, offset = batch, q  # every cache decodes, in order: the query's batch goes on as it is
        else:
            sub, offset = merge([where[i] for i in rows], room), 0  # next positions shifted by each query
        _generate(
            model,
            sub,
            torch.stack([firsts[i] for i in rows]),
            gens + [None] * (len(rows) - len(gens)),
            offset,
            [budgets[i] for i in rows],
            set(int(t) for t in stop_token_ids),
            tokenizer,
            out,
            keep_logits,
        )
    return out


def _queries(query_ids: Sequence[int] | Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """One query per served cache: ``query_ids`` repeated ``n`` times, or the per-cache queries
    checked (one per cache, none empty)."""
    if not query_ids:
        raise EventKVError("the query is empty: give a question.")
    if isinstance(query_ids[0], int):  # one query of token ids (the first id tells the two forms apart)
        return [list(cast("Sequence[int]", query_ids))] * n
    queries = [list(cast("Sequence[int]", q)) for q in query_ids]
    if len(queries) != n:
        raise EventKVError(
            f"read_out got {n} served caches but {len(queries)} queries: give one query or one per cache."
        )
    if not all(queries):
        raise EventKVError("a query is empty: give a question for every served cache.")
    return queries


def _budgets(max_new_tokens: int | Sequence[int], n: int) -> list[int]:
    """One decoding budget per served cache: ``max_new_tokens`` repeated, or the per-cache budgets checked."""
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * n
    budgets = [int(b) for b in max_new_tokens]
    if len(budgets) != n:
        raise EventKVError(
            f"read_out got {n} served caches but {len(budgets)} max_new_tokens: give one budget or one per cache."
        )
    return budgets


def q_len_extra(query_ids: Sequence[int], max_new_tokens: int, longest: int) -> int:
    """Rows a batch must have room for beyond its served rows: the query plus the longer of the
    generation and the candidate continuation."""
    return len(query_ids) + max(max_new_tokens, longest)


def _score(
    model: PreTrainedModel,
    batch: Batch,
    first: torch.Tensor,
    scored: list[int],
    q: int,
    candidates,
    texts,
    prefix: list[int],
    out: list[Readout],
) -> None:
    n_c = len(candidates)
    seqs = [prefix + list(c) for c in candidates]
    width = max(len(s) for s in seqs) - 1
    dev = first.device
    # the first token of every sequence is scored from the query's logits, token k > 0 from the
    # branch forward's output k - 1; inputs and targets are right-padded with token 0 (those entries are
    # unread). Every tensor is made on the model's device; the scores come back in one copy each.
    first_lp = token_logprobs(
        first[scored].unsqueeze(1).expand(-1, n_c, -1),
        torch.tensor([[s[0] for s in seqs]] * len(scored), dtype=torch.long, device=dev),
    ).tolist()  # [scored][n_c]
    lp: list[list[float]] = []  # read only for tokens k > 0, which exist only when width > 0
    if width > 0:
        sub = batch.select([i for i in scored for _ in range(n_c)], batch.mask.shape[1] + width)
        padded = [seqs[r % n_c] + [0] * (width + 1 - len(seqs[r % n_c])) for r in range(sub.size)]
        ids = torch.tensor([s[:-1] for s in padded], dtype=torch.long, device=dev)
        targets = torch.tensor([s[1:] for s in padded], dtype=torch.long, device=dev)
        lp = token_logprobs(sub.forward(model, ids, q), targets).tolist()  # [scored * n_c][width]
    for a, i in enumerate(scored):
        per = []
        for c, s in enumerate(seqs):
            r = a * n_c + c
            per.append([first_lp[a][c] if k == 0 else lp[r][k - 1] for k in range(len(prefix), len(s))])
        totals = torch.tensor([sum(t) for t in per], dtype=torch.float64, device="cpu")  # python floats: CPU
        probs = torch.softmax(totals, dim=0)
        out[i].candidates = [
            CandidateScore(texts[c] if texts else "", list(candidates[c]), float(totals[c]), per[c], float(probs[c]))
            for c in range(n_c)
        ]


#: On a CPU a greedy decode step of 2 or 3 sequences is fed as 4 (copies of the first; their tokens are
#: never read). Why: torch's CPU matmuls (MKL sgemm) run a product with 2 or 3 rows as that many
#: matrix-vector products, reading the weights once per row, while 4 rows take one pass of the
#: weights. Measured on an AMD EPYC (2 threads, float32), one decode step of qwen2.5-coder-1.5b:
#: 302 / 651 / 921 / 581 ms for 1 / 2 / 3 / 4 sequences; a 1536 x 8960 linear layer 2.5 / 5.0 / 7.8 /
#: 4.4 ms. Each sequence keeps its own rows, positions and mask, so the padding changes its tokens only
#: by float rounding. A GPU batches any size well: no padding there.
CPU_DECODE_MIN_BATCH = 4


def decode_padding(n: int, device: torch.device) -> int:
    """How many padding sequences a greedy decode of ``n`` sequences on ``device`` gets
    (:data:`CPU_DECODE_MIN_BATCH`): ``4 - n`` for 2 or 3 sequences on a CPU, else 0."""
    return CPU_DECODE_MIN_BATCH - n if torch.device(device).type == "cpu" and 1 < n < CPU_DECODE_MIN_BATCH else 0


def _generate(
    model: PreTrainedModel,
    batch: Batch,
    logits: torch.Tensor,
    owners: list[int | None],
    q: int,
    max_new: Sequence[int],
    stops: set[int],
    tokenizer: PreTrainedTokenizerBase | None,
    out: list[Readout],
    keep_logits: bool = False,
) -> None:
    """Greedy decoding of the whole batch, sequence ``r`` up to ``max_new[r]`` tokens, the first step
    fed at ``next_position + q``; a sequence that has stopped keeps being fed its last token (its rows
    are never read) so the batch never has to be copied. An owner of None is a padding sequence
    (:func:`decode_padding`): fed, never waited for, never read."""
    gens = [Generation(tokens=[]) for _ in owners]
    done = [m <= 0 or i is None for m, i in zip(max_new, owners)]
    step = 0
    while not all(done):
        toks = torch.argmax(logits, dim=-1).tolist()
        feed = []
        for r, g in enumerate(gens):
            t = int(toks[r])
            if not done[r]:
                if keep_logits:
                    g.logits.append(logits[r])
                if t in stops:
                    g.stopped = True
                    done[r] = True
                else:
                    g.tokens.append(t)
                    done[r] = len(g.tokens) >= max_new[r]
            feed.append(t)
        if all(done):
            break
        ids = torch.tensor(feed, dtype=torch.long, device=logits.device).unsqueeze(1)
        logits = batch.forward(model, ids, q + step, logits_to_keep=1)[:, -1]
        step += 1
    for g, i in zip(gens, owners):
        if i is None:
            continue
        if tokenizer is not None:
            g.text = cast(str, tokenizer.decode(g.tokens, skip_special_tokens=True))  # one sequence: one text
        out[i].generation = g


# ------------------------------------------------------------------ one served cache: a batch of one


@torch.inference_mode()
def query_logits(
    model: PreTrainedModel, served: ServedCache, query_ids: Sequence[int], max_context: int | None = None
) -> torch.Tensor:
    """Next-token logits ``[vocab]`` (float32) after the query.

    Raises:
        EventKVError: empty query, or history + query beyond the model's context.
    """
    if not query_ids:
        raise EventKVError("the query is empty: give a question.")
    check_context(served.next_position + len(query_ids), max_context, what="history plus query")
    batch = stack([served], extra=len(query_ids))
    ids = torch.tensor([list(query_ids)], device=batch.mask.device)
    return batch.forward(model, ids, 0, logits_to_keep=1)[0, -1]


def generate(
    model: PreTrainedModel,
    served: ServedCache,
    query_ids: Sequence[int],
    *,
    max_new_tokens: int = 64,
    stop_token_ids: Sequence[int] = (),
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_context: int | None = None,
    keep_logits: bool = False,
) -> Generation:
    """Greedy decoding from a served cache (:func:`read_out` with one cache).

    Args:
        query_ids: the query's token ids (placed at ``served.next_position`` onwards).
        max_new_tokens: upper bound on generated tokens.
        stop_token_ids: generation stops (without emitting it) on any of these.
        tokenizer: if given, ``text`` is the decoded continuation.
        keep_logits: keep each step's logits ``[vocab]`` (for faithfulness tests).

    Raises:
        EventKVError: empty query, or history + query + new tokens beyond the model's context.
    """
    return _generation(
        _read_out_one(
            model,
            served,
            query_ids,
            generate=True,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            tokenizer=tokenizer,
            max_context=max_context,
            keep_logits=keep_logits,
        )
    )


def candidate_logprobs(
    model: PreTrainedModel,
    served: ServedCache,
    query_ids: Sequence[int],
    candidates: Sequence[Sequence[int]],
    texts: Sequence[str] | None = None,
    max_context: int | None = None,
) -> list[CandidateScore]:
    """Score each candidate continuation of the query (forced choice; :func:`read_out` with one cache).

    Args:
        candidates: token ids per candidate (non-empty each); scored in one batched forward of
            ``[n_candidates, longest - 1]`` tokens over the shared query cache.
        texts: optional display text per candidate.

    Returns:
        one CandidateScore per candidate, in input order; ``logprob`` in nats (float64 sums).

    Raises:
        EventKVError: no candidates or an empty candidate; history + query beyond the context.
    """
    if not candidates or any(len(c) == 0 for c in candidates):
        raise EventKVError("candidate scoring needs at least one candidate and no empty candidate.")
    return _read_out_one(
        model,
        served,
        query_ids,
        generate=False,
        candidates=candidates,
        candidate_texts=texts or (),
        max_new_tokens=0,
        max_context=max_context,
    ).candidates


def answer_served(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    served: Sequence[ServedCache],
    query_ids: Sequence[int],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    max_context: int | None,
    candidates: Sequence[str] = (),
    keep_logits: bool = False,
) -> list[tuple[Generation, list[CandidateScore]]]:
    """A question answered from one or more served caches, as ``eventkv query`` and the memory do:
    per cache the greedy answer and, when ``candidates`` are given, each candidate's log-probability
    (nats; candidates tokenized alone with :func:`eventkv.log.encode`) — all caches in one batched
    :func:`read_out` (left-padded, each row at its own positions; a batch of one is :func:`generate`
    plus :func:`candidate_logprobs`).

    Returns:
        one ``(generation, candidate scores)`` per served cache, in order.

    Raises:
        EventKVError: no served cache; as :func:`read_out`.
    """
    if not served:
        raise EventKVError("answer_served got no served cache: give at least one.")
    ids = [encode(tokenizer, c) for c in candidates]
    outs = read_out(
        model,
        list(served),
        query_ids,
        generate=[True] * len(served),
        score=[bool(ids)] * len(served),
        candidates=ids,
        candidate_texts=list(candidates),
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        tokenizer=tokenizer,
        max_context=max_context,
        keep_logits=keep_logits,
    )
    return [(_generation(o), o.candidates) for o in outs]


def _read_out_one(
    model: PreTrainedModel, served: ServedCache, query_ids: Sequence[int], *, generate: bool, **options: Any
) -> Readout:
    """:func:`read_out` from the one cache ``served``: the greedy answer (``generate``) or else the candidate
    scores; ``options`` are :func:`read_out`'s."""
    return read_out(model, [served], query_ids, generate=[generate], score=[not generate], **options)[0]


def _generation(out: Readout) -> Generation:
    """The generation of a readout asked to generate (``generate=True``)."""
    assert out.generation is not None  # read_out generates for every cache with generate=True
    return out.generation
