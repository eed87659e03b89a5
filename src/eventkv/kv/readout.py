"""Readouts: answer a query from served caches (Study 1, "Donor pair", readouts).

One implementation, batched: :func:`read_out` answers one query from several served caches at
once, and the single-cache functions are that same path with a batch of one. Every generated token
of the package comes from one decode loop here (:func:`read_out` and :func:`generate_from` run it).

* :func:`generate` — greedy decoding (max new tokens, stops on EOS/end-of-turn); a
  :class:`Decoding` per sequence asks for seeded sampling instead (temperature, top-p), stop
  strings, and a per-step callback with the text each step adds (streaming).
* :func:`candidate_logprobs` — forced choice: every candidate's full continuation is scored
  (sum of its tokens' log-probabilities), all candidates in one batched forward.
* :func:`generate_from` — the same decode loop started from rows already in a batch (a prompt
  prefilled but for its last token, rows a study edited), with an early end per sequence
  (``decided``) and finished sequences dropped from the batch: what the splice study decodes with.
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
from typing import TYPE_CHECKING, Any, Callable, Iterable, Literal, Sequence, cast

import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.model import check_context, layer_types, takes_4d_masks
from eventkv.kv.serve import ServedCache
from eventkv.models.encoding import encode
from eventkv.models.kernels import linear_kernel_of

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase
from eventkv.kv.decoding import GREEDY, Decoding, PromptLookup, Sampler, TextWatch
from eventkv.kv.stacked import Batch, CandidateTree, merge, stack


@dataclass
class Generation:
    """A continuation (greedy unless its :class:`Decoding` samples). ``tokens`` excludes the stop
    token; ``stopped`` says whether a stop token ended it; ``stop_string`` is the stop string that
    ended it (``text`` is then cut where that string begins; ``tokens`` keeps every generated token);
    neither: max_new_tokens did. ``logits`` holds each step's logits ``[vocab]`` when requested."""

    tokens: list[int]
    text: str = ""
    stopped: bool = False
    logits: list[torch.Tensor] = field(default_factory=list)
    stop_string: str | None = None

    @property
    def finish_reason(self) -> Literal["stop", "length"]:
        """``"stop"`` when a stop token or a stop string ended it, ``"length"`` when max_new_tokens did."""
        return "stop" if self.stopped or self.stop_string is not None else "length"


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
    decoding: Decoding | Sequence[Decoding | None] | None = None,
    lookup: Sequence[Sequence[int] | None] | None = None,
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
        decoding: how each generating cache decodes (:class:`Decoding`: sampling, stop strings, a
            step callback): one for every cache, or one per cache (None: greedy); default greedy.
            Each sequence samples from its own generator, so its answer does not depend on the batch.
        lookup: per served cache, the token ids its greedy answer may copy from (e.g. the served
            text and the query), or None: prompt-lookup decoding (:class:`~eventkv.kv.decoding.PromptLookup`),
            several tokens verified per forward where the answer quotes them. The answer is the greedy
            one up to the rounding of a forward of several tokens (models with sliding-window layers or
            without a 4D mask decode one token per forward). None (default): no drafts.

    Returns:
        one Readout per served cache, in order.

    Raises:
        EventKVError: ``generate`` or ``score`` not one flag per served cache, empty query, per-cache
            queries, budgets or lookup sources not one per cache, empty candidate, or history + query
            beyond the model's context; stop strings or a step callback without a tokenizer.
        OptionError: a bad :class:`Decoding` (:meth:`Decoding.check`), or not one per served cache.
    """
    n = len(served)
    if len(generate) != n or len(score) != n:
        raise EventKVError(
            f"read_out got {n} served caches but {len(generate)} generate and {len(score)} "
            f"score flags: give one generate flag and one score flag per served cache."
        )
    decodings = _decodings(decoding, n)
    queries = _queries(query_ids, n)
    budgets = _budgets(max_new_tokens, n)
    _check_lookup(lookup, n, f"read_out got {n} served caches")
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
    seqs = [list(answer_prefix_ids) + list(c) for c in candidates]
    tree = CandidateTree.of(seqs) if any(score) and takes_4d_masks(model) else None
    branch = len(tree.tokens) if tree is not None else 0  # rows the candidates' branches take
    for q, idx in groups.items():
        room = max([budgets[i] for i in idx if generate[i]], default=0)
        scored = [j for j, i in enumerate(idx) if score[i]]
        batch = stack([served[i] for i in idx], extra=q_len_extra(queries[idx[0]], room, max(longest, branch)))
        ids = torch.tensor([queries[i] for i in idx], device=batch.mask.device)
        local = [out[i] for i in idx]  # the same Readout objects: scoring fills them in place
        if tree is not None and branch and scored:  # candidates scored in the query's forward
            logits = batch.forward_tree(model, ids, tree)
            first = logits[:, 0]
            _score_tree(logits, tree, scored, seqs, len(answer_prefix_ids), candidates, candidate_texts, local)
        else:
            first = batch.forward(model, ids, 0, 1)[:, -1]
            if scored:
                _score(model, batch, first, scored, q, candidates, candidate_texts, list(answer_prefix_ids), local)
        for j, i in enumerate(idx):
            where[i], firsts[i] = (batch, j, q), first[j]
    gens = [i for i, f in enumerate(generate) if f]
    if gens:
        dev = where[gens[0]][0].mask.device
        dtype = next(model.parameters()).dtype
        kernel = linear_kernel_of(model)
        rows = gens + [gens[0]] * decode_padding(len(gens), dev, kernel, dtype)
        # finished sequences leave the batch (a long answer then decodes alone, not with the rows of every
        # short one), except on a kernel that decodes 2-3 sequences slower than 4 (decode_padding's case)
        drop = decode_padding(2, dev, kernel, dtype) == 0
        room = max(budgets[i] for i in gens)
        batch, _, q = where[gens[0]]
        if len(groups) == 1 and rows == list(range(batch.size)):
            sub, offset = batch, q  # every cache decodes, in order: the query's batch goes on as it is
        else:
            sub, offset = merge([where[i] for i in rows], room), 0  # next positions shifted by each query
        pad = len(rows) - len(gens)  # padding sequences: no budget, never read
        done = _generate(
            model,
            sub,
            torch.stack([firsts[i] for i in rows]),
            offset,
            [budgets[i] for i in gens] + [0] * pad,
            set(int(t) for t in stop_token_ids),
            tokenizer,
            keep_logits,
            [decodings[i] for i in gens] + [GREEDY] * pad,
            drop_finished=drop,
            lookup=None if lookup is None else [lookup[i] for i in gens] + [None] * pad,
        )
        for i, g in zip(gens, done):
            out[i].generation = g
    return out


def _decodings(decoding: Decoding | Sequence[Decoding | None] | None, n: int) -> list[Decoding]:
    """One checked :class:`Decoding` per served cache (None: greedy)."""
    if decoding is None or isinstance(decoding, Decoding):
        return [(decoding or GREEDY).check()] * n
    given = list(decoding)
    if len(given) != n:
        raise OptionError("decoding", f"{len(given)} decodings", f"give one decoding, or one per served cache ({n}).")
    return [(d or GREEDY).check() for d in given]


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


def _check_lookup(lookup: Sequence[Sequence[int] | None] | None, n: int, what: str) -> None:
    """Raises EventKVError unless ``lookup`` is None or holds one source per sequence (``what`` names the
    caller's unit, e.g. ``"read_out got 2 served caches"``)."""
    if lookup is not None and len(lookup) != n:
        raise EventKVError(f"{what} but {len(lookup)} lookup sources: give one per sequence (None: no drafts).")


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
        _fill_candidates(out[i], per, candidates, texts)


def _score_tree(
    logits: torch.Tensor,
    tree: CandidateTree,
    scored: list[int],
    seqs: list[list[int]],
    n_prefix: int,
    candidates,
    texts,
    out: list[Readout],
) -> None:
    """Candidate scores from :meth:`Batch.forward_tree`'s logits ``[batch, 1 + n_nodes, vocab]``: token
    ``k`` of a sequence is scored from the query's logits (k = 0) or from node ``seq[:k]``'s."""
    at = [[0 if k == 0 else 1 + tree.node_of[tuple(s[:k])] for k in range(n_prefix, len(s))] for s in seqs]
    flat_at = [x for row in at for x in row]
    targets = [s[k] for s in seqs for k in range(n_prefix, len(s))]
    dev = logits.device
    sel = logits[scored][:, torch.tensor(flat_at, dtype=torch.long, device=dev)]  # [scored, tokens, vocab]
    tgt = torch.tensor(targets, dtype=torch.long, device=dev).expand(len(scored), -1)
    lp = token_logprobs(sel, tgt).tolist()  # [scored][tokens], one copy
    for a, i in enumerate(scored):
        per, k = [], 0
        for row in at:
            per.append(lp[a][k : k + len(row)])
            k += len(row)
        _fill_candidates(out[i], per, candidates, texts)


def _fill_candidates(out: Readout, per: list[list[float]], candidates, texts) -> None:
    """``out.candidates`` from each candidate's per-token log-probs (nats): sums and their softmax shares."""
    totals = torch.tensor([sum(t) for t in per], dtype=torch.float64, device="cpu")  # python floats: CPU
    probs = torch.softmax(totals, dim=0)
    out.candidates = [
        CandidateScore(texts[c] if texts else "", list(candidates[c]), float(totals[c]), per[c], float(probs[c]))
        for c in range(len(candidates))
    ]


#: On a CPU whose linears run on torch's own kernel (MKL sgemm), a greedy decode step of 2 or 3 sequences is
#: fed as 4 (copies of the first; their tokens are never read). Why: MKL runs a product with 2 or 3 rows as
#: that many matrix-vector products, reading the weights once per row, while 4 rows take one pass of the
#: weights. Measured on an AMD EPYC (2 threads, float32), one decode step of qwen2.5-coder-1.5b: 302 / 651 /
#: 921 / 581 ms for 1 / 2 / 3 / 4 sequences. oneDNN's linears (`eventkv.models.kernels`, what a float32
#: model gets on a CPU) have no such step: 385 / 586 / 706 / 950 ms on the same CPU, so they are not padded.
#: A bfloat16 model's CPU linears run on oneDNN inside torch (with AMX tiles where the CPU has them) and have no
#: such step either: 188 / 188 / 190 / 190 ms for 1-4 sequences on an Intel Xeon with AMX, 208 / 208 / 226 / 243
#: ms with oneDNN held to AVX512-BF16 (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16``; qwen2.5-coder-1.5b, 2 threads,
#: ``benchmarks/cpu_linear.py --dtype bfloat16``), so padding would only cost there: bfloat16 is not padded.
#: Each sequence keeps its own rows, positions and mask, so the padding changes its tokens only by float
#: rounding. A GPU batches any size well: no padding there.
CPU_DECODE_MIN_BATCH = 4


def decode_padding(
    n: int, device: torch.device, linear_kernel: str = "torch", dtype: torch.dtype = torch.float32
) -> int:
    """How many padding sequences a greedy decode of ``n`` sequences on ``device`` gets
    (:data:`CPU_DECODE_MIN_BATCH`): ``4 - n`` for 2 or 3 sequences of a float32 model on a CPU whose linears
    run on torch's own kernel (MKL sgemm), else 0 (oneDNN, bfloat16, a GPU)."""
    if torch.device(device).type != "cpu" or linear_kernel != "torch" or dtype != torch.float32:
        return 0
    return CPU_DECODE_MIN_BATCH - n if 1 < n < CPU_DECODE_MIN_BATCH else 0


def _generate(
    model: PreTrainedModel,
    batch: Batch,
    logits: torch.Tensor,
    offset: int,
    max_new: Sequence[int],
    stops: set[int],
    tokenizer: PreTrainedTokenizerBase | None,
    keep_logits: bool = False,
    decodings: Sequence[Decoding] | None = None,
    decided: Callable[[list[int]], bool] | None = None,
    drop_finished: bool = False,
    on_drop: Callable[[torch.Tensor], None] | None = None,
    lookup: Sequence[Sequence[int] | None] | None = None,
) -> list[Generation]:
    """The decode loop, the one place tokens are generated step by step: sequence ``r`` of ``batch``
    decodes from ``logits[r]`` (``[batch, vocab]``, its last fed token's) up to ``max_new[r]`` tokens
    (greedy, or as ``decodings[r]`` says), the first step fed at ``next_position + offset``. ``decided``
    ends a sequence once it returns True for the tokens so far (checked after each token within the
    budget). A sequence that has stopped keeps being fed the argmax of its logits (its rows are never
    read) so the batch never has to be copied; with ``drop_finished`` it leaves the batch instead
    (:meth:`Batch.keep`, then ``on_drop(idx)`` with the batch rows ``[kept]`` that stay, for state the
    caller holds per batch row). A sequence with a budget of 0 and greedy decoding is a padding
    sequence (:func:`decode_padding`): fed, never waited for.

    ``lookup[r]``, where given, are the token ids sequence ``r`` drafts from (:class:`PromptLookup`,
    greedy sequences only, on a model without sliding-window layers that takes a 4D mask): a step
    then feeds each sequence's token and its draft in one forward, keeps the draft's tokens up to the
    first one its own argmax disagrees with, and masks the rows of the rest out of every later step
    (the sequence's next positions follow its kept tokens). Returns one Generation per sequence."""
    decodings = list(decodings or [GREEDY] * len(max_new))
    gens = [Generation(tokens=[]) for _ in max_new]
    done = [m <= 0 for m in max_new]
    samplers = [Sampler(d) if d.samples else None for d in decodings]
    watches = [TextWatch(tokenizer, d.stop) if d.watches_text else None for d in decodings]
    drafters = _drafters(model, lookup, samplers, stops)

    def emit(r: int, t: int, row: torch.Tensor) -> int:
        """Sequence ``r`` takes token ``t`` (its sampler's draw instead, when it samples) from the
        logits ``row`` ``[vocab]``; returns the token it is fed."""
        g = gens[r]
        if done[r]:
            return t
        sampler, watch = samplers[r], watches[r]
        if sampler is not None:
            t = sampler.draw(row)
        if keep_logits:
            g.logits.append(row)
        piece = ""
        if t in stops:
            g.stopped = True
            done[r] = True
        else:
            g.tokens.append(t)
            done[r] = len(g.tokens) >= max_new[r] or (decided is not None and decided(g.tokens))
            if watch is not None:
                piece = watch.step(g.tokens)
                if watch.stop is not None:
                    g.stop_string, done[r] = watch.stop, True
        if watch is not None:
            if done[r]:
                piece += watch.rest()
            on_step = decodings[r].on_step
            if on_step is not None:
                on_step(piece)
        return t

    seqs = list(range(len(gens)))  # the sequence in each batch row
    step = 0
    while not all(done):
        toks = torch.argmax(logits, dim=-1).tolist()
        feed = [emit(r, int(toks[j]), logits[j]) for j, r in enumerate(seqs)]
        if all(done):
            break
        if drop_finished and any(done[r] for r in seqs):
            kept = [j for j, r in enumerate(seqs) if not done[r]]
            idx = torch.tensor(kept, dtype=torch.long, device=logits.device)
            batch.keep(idx)
            if on_drop is not None:
                on_drop(idx)
            seqs, feed = [seqs[j] for j in kept], [feed[j] for j in kept]
        drafts = [
            dr.draft(gens[r].tokens, max_new[r] - len(gens[r].tokens)) if (dr := drafters[r]) and not done[r] else []
            for r in seqs
        ]
        q = 1 + max(len(d) for d in drafts)
        ids = torch.tensor([[t] + d + [t] * (q - 1 - len(d)) for t, d in zip(feed, drafts)], device=logits.device)
        out = batch.forward(model, ids, offset + step, logits_to_keep=q)
        step += q
        if q == 1:
            logits = out[:, -1]
            continue
        nexts = []
        for j, (r, d) in enumerate(zip(seqs, drafts)):
            kept_n = 0
            while kept_n < len(d) and not done[r] and int(torch.argmax(out[j, kept_n])) == d[kept_n]:
                emit(r, d[kept_n], out[j, kept_n])
                kept_n += 1
            nexts.append(out[j, kept_n])
            dropped = q - 1 - kept_n  # the rows of the draft's rejected tokens and of its padding
            if dropped:
                batch.mask[j, batch.mask.shape[1] - dropped :] = False
                batch.next_position[j] -= dropped
        logits = torch.stack(nexts)
    for g, watch in zip(gens, watches):
        if watch is not None:
            g.text = watch.text  # cut at its stop string
        elif tokenizer is not None:
            g.text = cast(str, tokenizer.decode(g.tokens, skip_special_tokens=True))  # one sequence: one text
    return gens


def _drafters(
    model: PreTrainedModel,
    lookup: Sequence[Sequence[int] | None] | None,
    samplers: Sequence[Sampler | None],
    stops: set[int],
) -> list[PromptLookup | None]:
    """One :class:`PromptLookup` per sequence that drafts: given a source, greedy, on a model whose
    attention takes the masked-out rows of a rejected draft exactly (a 4D mask, no sliding window: a
    window counts rows, and masked rows would shorten it). ``lookup`` holds one source per sequence
    (:func:`read_out` and :func:`generate_from` check it before any forward)."""
    if lookup is None:
        return [None] * len(samplers)
    types, window = layer_types(model)
    if not takes_4d_masks(model) or (window is not None and "sliding_attention" in types):
        return [None] * len(samplers)
    return [
        PromptLookup(src, stops) if src is not None and len(src) > 0 and sampler is None else None
        for src, sampler in zip(lookup, samplers)
    ]


@torch.inference_mode()
def generate_from(
    model: PreTrainedModel,
    batch: Batch,
    ids: torch.Tensor,
    *,
    max_new_tokens: int | Sequence[int],
    stop_token_ids: Iterable[int] = (),
    tokenizer: PreTrainedTokenizerBase | None = None,
    keep_logits: bool = False,
    decoding: Decoding | Sequence[Decoding | None] | None = None,
    decided: Callable[[list[int]], bool] | None = None,
    drop_finished: bool = False,
    on_drop: Callable[[torch.Tensor], None] | None = None,
    lookup: Sequence[Sequence[int] | None] | None = None,
) -> list[Generation]:
    """Decoding from rows already in a batch (a prompt prefilled but for its last token, rows edited
    by a study): ``ids`` ``[batch, q]`` are fed after each sequence's rows (at ``next_position +
    arange(q)``), then every sequence decodes from its last fed token's logits, in the decode loop
    :func:`read_out` decodes in. ``batch`` grows by the fed rows (read them back with
    :func:`eventkv.kv.rows.cache_kv` when every sequence ran to its end).

    Args:
        batch: the rows (:meth:`Batch.of_rows`, :func:`eventkv.kv.stacked.stack`), written in place.
        ids: ``[batch, q]`` token ids on the batch's device, ``q >= 1``.
        max_new_tokens: the budget (tokens), for every sequence or one per sequence; 0: the ids are
            fed and nothing is generated.
        stop_token_ids: a sequence stops (without emitting it) on any of these.
        tokenizer: if given, each Generation's ``text`` is its decoded continuation.
        keep_logits: keep each step's logits ``[vocab]`` in ``Generation.logits`` (float32).
        decoding: as :func:`read_out` (default greedy).
        decided: ``decided(tokens) -> bool`` ends a sequence once its outcome is known (e.g. an answer
            already scored), checked after each generated token.
        drop_finished: finished sequences leave the batch (the rows are copied, the forwards shrink)
            instead of being fed on; ``on_drop(idx)`` is then called with the batch rows that stay
            (``[kept]`` int64, indices into the batch before the drop).
        lookup: per sequence, token ids its greedy continuation may copy from, or None: prompt-lookup
            drafts, as :func:`read_out` takes them (the rows of rejected drafts stay in ``batch``, masked).

    Returns:
        one Generation per sequence, in batch order.

    Raises:
        EventKVError: budgets or lookup sources not one per sequence (checked before any forward); stop
            strings or a step callback without a tokenizer.
        OptionError: a bad :class:`Decoding`, or not one per sequence.
    """
    n = batch.size
    if not isinstance(max_new_tokens, int) and len(max_new_tokens) != n:
        raise EventKVError(
            f"generate_from got a batch of {n} sequences but {len(max_new_tokens)} max_new_tokens: give one budget "
            "or one per sequence."
        )
    budgets = _budgets(max_new_tokens, n)
    _check_lookup(lookup, n, f"generate_from got a batch of {n} sequences")
    logits = batch.forward(model, ids, 0, logits_to_keep=1)[:, -1]
    stops = set(int(t) for t in stop_token_ids)
    return _generate(
        model,
        batch,
        logits,
        int(ids.shape[1]),
        budgets,
        stops,
        tokenizer,
        keep_logits,
        _decodings(decoding, n),
        decided,
        drop_finished,
        on_drop,
        lookup,
    )


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
    decoding: Decoding | Sequence[Decoding | None] | None = None,
) -> list[tuple[Generation, list[CandidateScore]]]:
    """A question answered from one or more served caches, as ``eventkv query`` and the memory do:
    per cache the greedy answer (or as ``decoding`` says: :func:`read_out`) and, when ``candidates``
    are given, each candidate's log-probability (nats; candidates tokenized alone with
    :func:`eventkv.models.encoding.encode`) — all caches in one batched :func:`read_out` (left-padded, each row
    at its own positions; a batch of one is :func:`generate` plus :func:`candidate_logprobs`).

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
        decoding=decoding,
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
