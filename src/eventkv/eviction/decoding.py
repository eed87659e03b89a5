"""Compression during decoding (kvpress's DecodingPress): the prompt is prefilled whole, then every ``interval``
decoding steps each layer's cache is cut to ``target_rows`` rows per KV head by a policy's scores, the
observation window being the queries of the steps since the last cut (at most ``buffer`` of them).

What a long generation (a reasoning trace, an agent's long answer) does to its own KV cache: the rows grow with
every token, and a decoding-time press bounds them. Heads keep rows of their own once a cut has run (each head's
best ``target_rows``), so each head carries its own positions from then on; every policy scores one KV head at a
time, with the queries of that head's GQA group.

Why not kvpress itself: see :mod:`eventkv.eviction.policies`. Where eventkv differs from kvpress 0.5.5's
DecodingPress (``docs/eviction.md``): kvpress rebuilds the buffered queries from hidden states and rotates them all
by the current step's RoPE angle (the one position embedding a decoding forward carries); eventkv keeps each step's
query as the attention computed it, rotated at its own position, and lets it see only the rows before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.eviction.capture import capturing
from eventkv.eviction.policies import LayerCapture, Policy
from eventkv.kv.model import layer_types, model_device, model_forward
from eventkv.kv.rows import cache_from_rows, cache_kv
from eventkv.options import check_int

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["DecodedRun", "DecodingCompression", "decode_compressed"]


@dataclass(frozen=True)
class DecodingCompression:
    """How the cache is cut while decoding (kvpress's DecodingPress: ``compression_interval``, ``target_size``,
    ``hidden_states_buffer_size``).

    Attributes:
        policy: scores each KV head's rows (:meth:`Policy.scores`); each head keeps its ``target_rows`` best
            (:meth:`Policy.keep`). A policy that chooses rows by a rule of its own (per-layer or per-head budgets,
            chunks, compositions: :attr:`Policy.keeps_by_scores` False) is refused, as kvpress's DecodingPress takes
            scorer presses only: during decoding the budget is a row count, the same in every head; so is one that
            reads every prefill query (H2O) or a reconstruction pass (KVzip).
        interval: decoding steps between cuts (512, kvpress's default).
        target_rows: rows each KV head keeps at a cut (2048); a layer at or under it is left whole.
        buffer: the queries of at most this many latest steps form the observation window (256).

    Raises:
        OptionError: a non-policy, a policy with its own selection rule (:attr:`Policy.keeps_by_scores` False) or
            one that reads every prefill query or a reconstruction pass; ``interval``, ``target_rows`` or ``buffer``
            not a whole number >= 1; a policy ``window`` longer than ``interval`` or ``buffer``.
    """

    policy: Policy
    interval: int = 512
    target_rows: int = 2048
    buffer: int = 256

    def __post_init__(self) -> None:
        if not isinstance(self.policy, Policy):
            raise OptionError("policy", self.policy, "give an eviction policy (eventkv.eviction), e.g. Knorm().")
        if not self.policy.keeps_by_scores:
            raise OptionError(
                "policy",
                self.policy.name,
                "it chooses rows by a rule of its own (budgets per layer or head, chunks, a composition); decoding "
                "compression keeps each KV head's target_rows best rows by a policy's scores: give a scoring policy "
                "(knorm, snapkv, streaming, tova, keydiff, finch without chunks, ...).",
            )
        if self.policy.needs_all_queries or self.policy.needs_reconstruction:
            raise OptionError(
                "policy",
                self.policy.name,
                "it reads every prefill query or a reconstruction pass, which a decode step does not have: give a "
                "policy that scores from the latest queries or the keys (knorm, snapkv, streaming, ...).",
            )
        check_int("interval", self.interval, "cut the cache every N decoding steps (a whole number >= 1).")
        check_int("target_rows", self.target_rows, "keep at least 1 row per KV head (a whole number).")
        check_int("buffer", self.buffer, "keep the queries of at least 1 step as the window (a whole number).")
        window = getattr(self.policy, "window", None)
        if isinstance(window, int) and window > min(self.interval, self.buffer):
            raise OptionError(
                "policy",
                self.policy.name,
                f"its window of {window} queries is longer than the {min(self.interval, self.buffer)} steps a cut "
                f"sees (interval {self.interval}, buffer {self.buffer}): give interval and buffer of {window} or "
                "more, or a shorter window.",
            )


@dataclass
class DecodedRun:
    """One decode under :class:`DecodingCompression`.

    Attributes:
        tokens: the tokens fed after the prompt (generated, or the forced ones).
        logits: ``[len(tokens), vocab]`` float32: the next-token logits before each of ``tokens``.
        positions: per layer ``[kv_heads, rows]`` int64: the positions each KV head holds at the end, ascending.
        cuts: how many times the cache was cut (every layer at once).
    """

    tokens: list[int]
    logits: torch.Tensor
    positions: list[torch.Tensor]
    cuts: int


@torch.inference_mode()
def decode_compressed(
    model: PreTrainedModel,
    prompt_ids: Sequence[int],
    compression: DecodingCompression,
    *,
    max_new_tokens: int = 64,
    forced: Sequence[int] | None = None,
    stop_token_ids: Sequence[int] = (),
) -> DecodedRun:
    """Prefill ``prompt_ids`` (positions 0, 1, ...), then decode greedily — or feed ``forced`` — one token a step,
    cutting every layer's cache to ``compression.target_rows`` rows per KV head after every
    ``compression.interval`` steps (kvpress's DecodingPress; the prompt's prefill itself is not cut).

    Args:
        model: a Hugging Face causal LM (eval mode) with full-attention layers only.
        prompt_ids: the prompt's token ids.
        compression: the policy and its schedule.
        max_new_tokens: greedy steps at most (ignored with ``forced``).
        forced: tokens to feed instead of the greedy ones (teacher forcing: the same cache trajectory on two
            implementations), or None.
        stop_token_ids: greedy decoding stops after emitting one of these.

    Returns:
        a :class:`DecodedRun`.

    Raises:
        EventKVError: an empty prompt; a model with sliding-window layers (a cut changes the row distances its
            window is counted in).
        OptionError: ``max_new_tokens`` not a whole number >= 1; a policy that cannot score from what a decode
            step captures (expected attention's RoPE frequencies, event-level scoring's events), at the first cut.
    """
    if not prompt_ids:
        raise EventKVError("decode_compressed got an empty prompt: give at least one token id.")
    types, window = layer_types(model)
    if "sliding_attention" in types and window is not None:
        raise EventKVError(
            "decoding compression needs full-attention layers: a cut changes the row distances a sliding window "
            "is counted in. Use a model without sliding-window layers."
        )
    check_int("max_new_tokens", max_new_tokens, "generate at least 1 token.")
    device = model_device(model)
    n = len(prompt_ids)
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([list(prompt_ids)], device=device)
    logits = model_forward(model, ids, torch.arange(n, device=device)[None], cache, logits_to_keep=1)
    keys, values = cache_kv(cache)
    # each head's positions live on the CPU, where the policies score
    positions = [torch.arange(n, dtype=torch.long, device="cpu").expand(k.shape[1], -1).clone() for k in keys]
    steps = len(forced) if forced is not None else max_new_tokens
    out_tokens: list[int] = []
    out_logits: list[torch.Tensor] = []
    stops = set(stop_token_ids)
    cuts, since = 0, 0
    buffered: list[int] = []  # the positions of the buffered steps' queries
    scaling = None
    with capturing(model, compression.buffer) as seen:
        for step in range(steps):
            last = logits[0, -1].float().cpu()
            token = int(forced[step]) if forced is not None else int(last.argmax())
            out_logits.append(last)
            out_tokens.append(token)
            if forced is None and token in stops:
                break
            pos = n + step
            logits = model_forward(
                model,
                torch.tensor([[token]], device=device),
                torch.tensor([[pos]], device=device),
                cache,
                logits_to_keep=1,
            )
            grown = torch.full((positions[0].shape[0], 1), pos, dtype=torch.long, device="cpu")
            positions = [torch.cat([p, grown], dim=1) for p in positions]
            buffered = (buffered + [pos])[-compression.buffer :]
            since += 1
            if since < compression.interval:
                continue
            keys, values = cache_kv(cache)
            new_k, new_v = [], []
            for layer, (k, v) in enumerate(zip(keys, values)):
                slot = seen.get(layer, {})
                scaling = slot.get("scaling", scaling)
                k, v, positions[layer] = _cut(
                    compression, layer, len(keys), k, v, positions[layer], slot.get("q"), buffered, scaling
                )
                new_k.append(k)
                new_v.append(v)
                slot.pop("q", None)  # the window restarts after a cut, as kvpress's buffer does
            cache = cache_from_rows(new_k, new_v)
            buffered, since, cuts = [], 0, cuts + 1
    return DecodedRun(out_tokens, torch.stack(out_logits), positions, cuts)


def _cut(
    compression: DecodingCompression,
    layer: int,
    n_layers: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    queries: torch.Tensor | None,
    query_positions: list[int],
    scaling: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's cut: each KV head's ``target_rows`` best rows by the policy, in position order.

    Args:
        keys, values: ``[1, kv_heads, rows, head_dim]`` the layer's cache; positions ``[kv_heads, rows]``.
        queries: ``[q_heads, buffered, head_dim]`` the buffered steps' queries (after RoPE), or None.

    Returns:
        ``(keys, values, positions)`` of ``target_rows`` rows per head (the inputs when the layer has no more).
    """
    kv_heads, rows = positions.shape
    if rows <= compression.target_rows:
        return keys, values, positions
    qpos = torch.tensor(query_positions, dtype=torch.long, device="cpu")
    group = 0 if queries is None else queries.shape[0] // kv_heads
    kept = []
    for h in range(kv_heads):
        c = LayerCapture(
            layer=layer,
            keys=keys[0, h : h + 1].float().cpu(),
            values=values[0, h : h + 1].float().cpu(),
            positions=positions[h],
            queries=None if queries is None else queries[h * group : (h + 1) * group],
            query_positions=None if queries is None else qpos[-queries.shape[1] :],
            scaling=scaling,
            n_layers=n_layers,
        )
        try:
            mask = compression.policy.keep(c, compression.target_rows)[0]
        except OptionError as e:
            raise OptionError(
                "policy",
                compression.policy.name,
                f"it cannot score from what a decode step captures (each step's queries and the rows' keys, values "
                f"and positions; no RoPE frequencies, no events): {e}",
            ) from None
        kept.append(torch.nonzero(mask).flatten())  # ascending row index: ascending position within the head
    idx = torch.stack(kept).to(keys.device)  # [kv_heads, target_rows]
    gather = idx[None, :, :, None].expand(1, -1, -1, keys.shape[-1])
    return (
        keys.gather(2, gather),
        values.gather(2, gather),
        torch.stack([positions[h][kept[h]] for h in range(kv_heads)]),
    )
