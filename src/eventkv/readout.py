"""Readouts: answer a query from a served cache (Study 1, "Donor pair", readouts).

* :func:`generate` — our own greedy decode loop (max new tokens, stops on EOS/end-of-turn).
* :func:`candidate_logprobs` — forced choice: every candidate's full continuation is scored
  (sum of its tokens' log-probabilities), all candidates in one batched forward.

Both take the query's token ids (question + chat tail) and place them at positions starting
at ``served.next_position`` (right after the full history). Neither modifies the served cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from eventkv.errors import EventKVError
from eventkv.prefill import check_context, model_forward
from eventkv.serve import ServedCache


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


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _start(model, served: ServedCache, query_ids: Sequence[int], max_context: int | None, extra: int = 0):
    if not query_ids:
        raise EventKVError("the query is empty: give a question.")
    check_context(served.next_position + len(query_ids) + extra, max_context, what="history plus query")
    dev = _device(model)
    cache = served.to_cache()
    ids = torch.tensor([list(query_ids)], device=dev)
    pos = torch.arange(served.next_position, served.next_position + len(query_ids), device=dev).unsqueeze(0)
    mask = served.attention_mask(len(query_ids))
    logits = model_forward(model, ids, pos, cache, mask, logits_to_keep=1)[0, -1]
    return cache, logits


@torch.inference_mode()
def query_logits(model, served: ServedCache, query_ids: Sequence[int], max_context: int | None = None) -> torch.Tensor:
    """Next-token logits ``[vocab]`` (float32) after the query."""
    return _start(model, served, query_ids, max_context)[1]


@torch.inference_mode()
def generate(model, served: ServedCache, query_ids: Sequence[int], *, max_new_tokens: int = 64,
             stop_token_ids: Sequence[int] = (), tokenizer=None, max_context: int | None = None,
             keep_logits: bool = False) -> Generation:
    """Greedy decoding from a served cache.

    Args:
        query_ids: the query's token ids (placed at ``served.next_position`` onwards).
        max_new_tokens: upper bound on generated tokens.
        stop_token_ids: generation stops (without emitting it) on any of these.
        tokenizer: if given, ``text`` is the decoded continuation.
        keep_logits: keep each step's logits ``[vocab]`` (for faithfulness tests).

    Raises:
        EventKVError: empty query, or history + query + new tokens beyond the model's context.
    """
    cache, logits = _start(model, served, query_ids, max_context, extra=max_new_tokens)
    dev = _device(model)
    stops = set(int(t) for t in stop_token_ids)
    out = Generation(tokens=[])
    pos = served.next_position + len(query_ids)
    n_rows_new = len(query_ids)
    for _ in range(max_new_tokens):
        if keep_logits:
            out.logits.append(logits)
        tok = int(torch.argmax(logits))
        if tok in stops:
            out.stopped = True
            break
        out.tokens.append(tok)
        if len(out.tokens) == max_new_tokens:
            break
        n_rows_new += 1
        mask = served.attention_mask(n_rows_new)
        logits = model_forward(model, torch.tensor([[tok]], device=dev), torch.tensor([[pos]], device=dev),
                               cache, mask, logits_to_keep=1)[0, -1]
        pos += 1
    if tokenizer is not None:
        out.text = tokenizer.decode(out.tokens, skip_special_tokens=True)
    return out


@torch.inference_mode()
def candidate_logprobs(model, served: ServedCache, query_ids: Sequence[int], candidates: Sequence[Sequence[int]],
                       texts: Sequence[str] | None = None, max_context: int | None = None) -> list[CandidateScore]:
    """Score each candidate continuation of the query (forced choice).

    Args:
        candidates: token ids per candidate (non-empty each); scored in one batched forward of
            ``[n_candidates, longest - 1]`` tokens over the shared query cache.
        texts: optional display text per candidate.

    Returns:
        one CandidateScore per candidate, in input order; ``logprob`` in nats.

    Raises:
        EventKVError: no candidates or an empty candidate.
    """
    if not candidates or any(len(c) == 0 for c in candidates):
        raise EventKVError("candidate scoring needs at least one candidate and no empty candidate.")
    longest = max(len(c) for c in candidates)
    cache, logits = _start(model, served, query_ids, max_context, extra=longest)
    first = torch.log_softmax(logits, dim=-1)
    per_token = [[float(first[c[0]])] for c in candidates]
    if longest > 1:
        dev = _device(model)
        b, n = len(candidates), longest - 1
        ids = torch.zeros(b, n, dtype=torch.long, device=dev)
        for i, c in enumerate(candidates):
            ids[i, : len(c) - 1] = torch.tensor(list(c[:-1]))
        start = served.next_position + len(query_ids)
        pos = torch.arange(start, start + n, device=dev).unsqueeze(0).expand(b, -1)
        for layer in cache.layers:
            layer.keys = layer.keys.expand(b, -1, -1, -1)
            layer.values = layer.values.expand(b, -1, -1, -1)
        base = served.attention_mask(len(query_ids) + n, batch=b)
        lp = torch.log_softmax(model_forward(model, ids, pos, cache, base), dim=-1)
        for i, c in enumerate(candidates):
            for j in range(1, len(c)):
                per_token[i].append(float(lp[i, j - 1, c[j]]))
    totals = torch.tensor([sum(t) for t in per_token], dtype=torch.float64)
    probs = torch.softmax(totals, dim=0)
    return [CandidateScore(texts[i] if texts else "", list(c), float(totals[i]), per_token[i], float(probs[i]))
            for i, c in enumerate(candidates)]
