"""Selection by the model's own attention: :class:`AttentionSelector` (``"attention"``).

An event is scored by the attention the question's queries pay to the event's **stored** keys (the
rows the memory prefilled), so retrieval uses the serving model itself, no second model: MemArt
(ICLR 2026 submission: a KV-cache-centric memory that retrieves turns by attention over their
stored keys), Quest (Tang et al. 2024, arXiv 2406.10774, §3: a page is scored by the largest
attention logit its keys can reach), InfLLM (Xiao et al. 2024, arXiv 2402.04617, §2.2: blocks of
context looked up by the current tokens' attention to their representative keys).

What is computed, per question:

1. **Query states.** One forward of the question's tokens only, tokenized as a query is
   (:func:`eventkv.kv.log.tokenize_query`: the question, then the chat template's tail), at the
   positions the query gets when it is answered from the stored rows (``positions="original"``):
   ``context.history_end`` onward. :func:`capture_queries` (a scoped hook on the chosen layers'
   attention modules) reads each chosen layer's query states as the model computes them: the
   layer's ``q_proj``, its ``q_norm`` where it has one (Qwen3, Gemma 3), then RoPE by the
   modeling module's own ``apply_rotary_pos_emb`` with the cos/sin the model's rotary embedding
   gave that layer (Gemma 3's sliding layers get their local RoPE). With ``attend="question"``
   (the default) the question is forwarded alone, with no cache, so its hidden states see only
   the question; with ``attend="history"`` it is forwarded over every stored row (the hidden states
   the full-history query has; costlier: every layer attends to the whole history). The forward
   stops after the deepest chosen layer. The history is never prefilled again.
2. **Logits.** Per chosen layer ``l``, head ``h`` and question token ``t``:
   ``z[r] = scaling * q[h, t] . k[g(h), r]`` over the stored rows ``r`` of the candidate events
   (GQA: query head ``h`` reads KV head ``g(h) = h // (heads / kv_heads)``), ``scaling`` the
   attention module's own (``head_dim ** -0.5`` for Llama and Qwen; Gemma 3's
   ``query_pre_attn_scalar ** -0.5``), then a softmax over those rows. The header's rows (chat
   head and instruction; the BOS token, an attention sink in most heads) are left out of the
   softmax with ``header=False`` (the default), so every (layer, head, token) spreads a unit of
   attention over the events; with ``header=True`` they take part in the softmax but score no event.
   Rows of events that are not candidates (deleted, superseded by a patch) are left out.
   Sliding-window layers score every row, not only the rows within their window.
3. **Pooling** to one score per event, then the mean over heads, question tokens and chosen
   layers: ``"mass"`` (the sum of the softmax over the event's rows: the attention the event
   receives), ``"max"`` (the largest softmax entry among its rows, as Quest bounds a page by its
   most attended key), ``"mean"`` (the mean over its rows: mass per row, favouring short events).

Cost: one forward of the question (``q`` tokens) plus a ``q x rows`` product per chosen layer and
head over the stored rows. Memory: one layer at a time, ``[heads, q, rows]`` float32 at most.

The default layers and pooling are measured (``benchmarks/attention_layers.py``): see
:data:`DEFAULT_LAYERS`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Literal, get_args

import numpy as np
import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.log import HEADER_ID, tokenize_query
from eventkv.kv.model import forward_until, model_device, model_forward
from eventkv.kv.rows import cache_from_rows
from eventkv.memory.select import ScoringSelector, SelectionContext

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedModel

    from eventkv.kv.rows import EventKV
    from eventkv.memory.records import MemoryRecord
    from eventkv.models.profile import LoadedModel

Pooling = Literal["mass", "max", "mean"]
"""How an event's rows pool to its score (module docstring, step 3)."""
POOLINGS: tuple[Pooling, ...] = get_args(Pooling)
Attend = Literal["question", "history"]
"""What the question's forward sees: itself only, or every stored row (module docstring, step 1)."""
ATTENDS: tuple[Attend, ...] = get_args(Attend)

#: The default chosen layers, as fractions of depth (``round(f * (layers - 1))``): layer 18 of smollm2-135m's
#: 30, where evidence-turn recall@5 peaked (0.62 with max pooling, 0.51 with mass; most layers 0.00-0.29;
#: BM25 0.60) on 18 LoCoMo dev questions (3 conversations cut to 2,000 tokens of turns; float32, AMD EPYC
#: 2 cores AVX2; ``benchmarks/attention_layers.py``). Few questions, picked on them: a starting point.
DEFAULT_LAYERS: tuple[float, ...] = (0.62,)
#: The default pooling (max beat mass at the default layer, above).
DEFAULT_POOLING: Pooling = "max"


def attention_modules(model: PreTrainedModel) -> list[Any]:
    """The attention module (``self_attn``) of each decoder layer of a Hugging Face causal LM, in layer order.

    Raises:
        EventKVError: a model whose decoder has no ``layers`` list of modules with ``self_attn``.
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if layers is None or not all(hasattr(layer, "self_attn") for layer in layers):
        raise EventKVError(
            f"{type(model).__name__} has no decoder layers with self_attn: the attention selector needs a "
            "Llama-style decoder (Llama, Qwen2, Qwen3, Gemma 3)."
        )
    return [layer.self_attn for layer in layers]


def _query_states(attn: Any, hidden: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]):
    """``[batch, heads, q, head_dim]`` query states of one attention module, as its forward makes them."""
    shape = (*hidden.shape[:-1], -1, attn.head_dim)
    q = attn.q_proj(hidden).view(shape)
    norm = getattr(attn, "q_norm", None)
    if norm is not None:
        q = norm(q)  # over head_dim: the same before or after the head transpose (Qwen3 / Gemma 3)
    q = q.transpose(1, 2)
    cos, sin = cos_sin
    apply_rope = sys.modules[type(attn).__module__].apply_rotary_pos_emb  # the model's own RoPE
    q, _ = apply_rope(q, q, cos, sin)
    return q


@contextmanager
def capture_queries(model: PreTrainedModel, layers: Sequence[int]) -> Iterator[dict[int, torch.Tensor]]:
    """A scoped hook that records the query states of ``layers`` during the forwards run inside it.

    Yields a dict filled by each forward: ``{layer: [batch, heads, q, head_dim]}`` (after ``q_proj``,
    ``q_norm`` where the layer has one, and RoPE at the forward's positions; the model's dtype).
    The forward ends (an internal exception, caught by the context) after the deepest layer in
    ``layers``; its logits and cache are then incomplete. The hooks are removed on exit, whatever
    happens.
    """
    captured: dict[int, torch.Tensor] = {}
    modules = attention_modules(model)
    last = max(layers)
    handles = []

    def hook_for(index: int):
        def hook(module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            captured[index] = _query_states(module, hidden, kwargs["position_embeddings"])

        return hook

    try:
        for i in sorted(set(layers)):
            handles.append(modules[i].register_forward_pre_hook(hook_for(i), with_kwargs=True))
        with forward_until(modules[last]):  # the layers after the deepest chosen one are not needed
            yield captured
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def question_queries(
    lm: LoadedModel, question: str, start: int, layers: Sequence[int], rows: EventKV | None = None
) -> dict[int, torch.Tensor]:
    """The question's query states at ``layers``: ``{layer: [1, heads, q, head_dim]}``, ``q`` the tokens
    of :func:`eventkv.kv.log.tokenize_query`, at positions ``start .. start + q - 1``. With ``rows`` the
    question is forwarded over those stored rows (a fresh cache over them; the rows are not changed),
    else alone."""
    ids = tokenize_query(lm.tokenizer, lm.profile, question)
    device = model_device(lm.model)
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    positions = torch.arange(start, start + len(ids), dtype=torch.long, device=device)[None]
    cache = cache_from_rows(rows.keys, rows.values) if rows is not None else cache_from_rows([], [])
    with capture_queries(lm.model, layers) as captured:
        model_forward(lm.model, input_ids, positions, cache, logits_to_keep=1)
    return captured


def event_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    owner: torch.Tensor,
    n_events: int,
    *,
    scaling: float,
    pooling: Pooling = DEFAULT_POOLING,
    softcap: float | None = None,
) -> torch.Tensor:
    """One layer's event scores from its query states and stored keys (module docstring, steps 2-3).

    Args:
        queries: ``[1, heads, q, head_dim]`` the question's query states at this layer.
        keys: ``[1, kv_heads, rows, head_dim]`` the stored keys of the rows in the softmax.
        owner: ``[rows]`` int64, the index of the event each row belongs to, ``-1`` for a row that takes
            part in the softmax but scores no event (the header with ``header=True``).
        n_events: the number of events.
        scaling: the factor on ``q . k`` (the attention module's ``scaling``).
        pooling: ``"mass"`` | ``"max"`` | ``"mean"``.
        softcap: the layer's logit soft-capping (``cap * tanh(z / cap)``), None for none.

    Returns:
        ``[n_events]`` float32: the pooled score averaged over heads and question tokens (an event
        with no row scores 0).
    """
    heads, kv_heads = queries.shape[1], keys.shape[1]
    q = queries[0].float().reshape(kv_heads, heads // kv_heads, queries.shape[2], -1)  # [kv, group, q, d]
    z = torch.einsum("kgtd,krd->kgtr", q, keys[0].float()) * scaling
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    p = torch.softmax(z, dim=-1).reshape(-1, z.shape[-1])  # [heads * q, rows]
    kept = owner >= 0
    p, idx = p[:, kept], owner[kept].to(p.device)
    out = torch.zeros(p.shape[0], n_events, dtype=p.dtype, device=p.device)
    index = idx.expand(p.shape[0], -1)
    if pooling == "max":
        out = out.scatter_reduce(1, index, p, reduce="amax", include_self=True)  # p >= 0: the zeros are neutral
    else:
        out = out.scatter_add(1, index, p)
        if pooling == "mean":
            counts = torch.bincount(idx, minlength=n_events).clamp(min=1).to(p.dtype)
            out = out / counts
    return out.mean(dim=0)


def resolve_layers(layers: Sequence[int | float], n_layers: int) -> list[int]:
    """Layer indices from ``layers``: an int is an index (``0 .. n_layers - 1``; negative counts from the
    end), a float in ``[0, 1]`` a fraction of depth (``round(f * (n_layers - 1))``); sorted, unique.

    Raises:
        OptionError: an empty list, a value that is neither, an index out of range.
    """
    fix = f"give layer indices in 0..{n_layers - 1} (or negative from the end) or fractions of depth in [0, 1]."
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers:
        raise OptionError("layers", layers, fix)
    out = set()
    for v in layers:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise OptionError("layers", layers, fix)
        if isinstance(v, float):
            if not 0.0 <= v <= 1.0:
                raise OptionError("layers", layers, fix)
            out.add(round(v * (n_layers - 1)))
        elif -n_layers <= v < n_layers:
            out.add(v % n_layers)
        else:
            raise OptionError("layers", layers, fix)
    return sorted(out)


class AttentionSelector(ScoringSelector):
    """Ranks events by the attention the question's queries pay to their stored keys (the module
    docstring says what is computed; sources MemArt, Quest arXiv 2406.10774, InfLLM arXiv 2402.04617).

    Args:
        layers: the layers scored (indices, or fractions of depth; see :func:`resolve_layers`); default
            :data:`DEFAULT_LAYERS`, measured with ``benchmarks/attention_layers.py`` on the LoCoMo
            development split (see ``docs/memory.md``, "Selectors").
        pooling: ``"max"`` (default, :data:`DEFAULT_POOLING`) | ``"mass"`` | ``"mean"``.
        header: whether the header's rows take part in the softmax (they never score).
        attend: ``"question"`` (default: the question forwarded alone) | ``"history"`` (over every
            stored row).

    Raises:
        OptionError: a bad ``layers``, ``pooling`` or ``attend`` (``layers`` is checked against the
            model's depth at :meth:`rank`).
    """

    name = "attention"

    def __init__(
        self,
        layers: Sequence[int | float] = DEFAULT_LAYERS,
        pooling: Pooling = DEFAULT_POOLING,
        *,
        header: bool = False,
        attend: Attend = "question",
    ) -> None:
        if pooling not in POOLINGS:
            raise OptionError("pooling", pooling, f"give one of {', '.join(POOLINGS)}.")
        if attend not in ATTENDS:
            raise OptionError("attend", attend, f"give one of {', '.join(ATTENDS)}.")
        resolve_layers(layers, 1 << 30)  # the types and signs now; the range against the model at rank
        self.layers, self.pooling, self.header, self.attend = tuple(layers), pooling, bool(header), attend

    def scores(
        self, question: str, events: Sequence[MemoryRecord], context: SelectionContext | None = None
    ) -> np.ndarray:
        """``[len(events)]`` float32 attention scores of the events, in the given order.

        Raises:
            OptionError: a context without the model or the stored rows; ``layers`` out of the model's range.
            EventKVError: no events, a blank question, an event whose rows are not stored.
        """
        if context is None or context.lm is None or context.rows is None:
            raise OptionError(
                "context",
                context,
                "the attention selector reads the model and the stored rows: give a SelectionContext with lm "
                "and rows (EventMemory.select builds one).",
            )
        events = list(events)
        if not events:
            raise EventKVError("attention selection got no events to rank: give at least one event.")
        if not isinstance(question, str) or not question.strip():
            raise EventKVError(f"attention selection got the question {question!r}: give a non-empty question.")
        lm, ekv = context.lm, context.rows()
        layers = resolve_layers(self.layers, ekv.n_layers)
        spans = [ekv.log.span(e.id) for e in events]
        owner = [i for i, s in enumerate(spans) for _ in range(s.row_start, s.row_end)]
        rows = [r for s in spans for r in range(s.row_start, s.row_end)]
        if self.header:
            head = ekv.log.span(HEADER_ID)
            rows, owner = [*range(head.row_start, head.row_end), *rows], [-1] * head.n_tokens + owner
        device = ekv.keys[0].device
        index = torch.tensor(rows, dtype=torch.long, device=device)
        owners = torch.tensor(owner, dtype=torch.long, device=device)
        queries = question_queries(
            lm, question, context.history_end, layers, rows=ekv if self.attend == "history" else None
        )
        modules = attention_modules(lm.model)
        total = torch.zeros(len(events), dtype=torch.float32, device=device)
        with torch.inference_mode():
            for layer in layers:
                attn = modules[layer]
                total += event_scores(
                    queries.pop(layer),
                    ekv.keys[layer].index_select(2, index),
                    owners,
                    len(events),
                    scaling=float(attn.scaling),
                    pooling=self.pooling,
                    softcap=getattr(attn, "attn_logit_softcapping", None),
                )
        return (total / len(layers)).cpu().numpy()
