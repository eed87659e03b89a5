"""The model adapter of the data path: one forward over a Hugging Face causal LM with the data
path's masks, positions and cache (:func:`model_forward`), the attention masks a model takes
(:func:`attention_masks`), the cache keyword, the model's device, and the checks a forward needs
(rows that match the model, a context that holds the positions)."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from eventkv.errors import EventKVError

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def cache_kwarg(model: PreTrainedModel) -> str:
    """Name of the cache keyword of ``model.forward``: ``cache`` (transformers >= 5.2x) or
    ``past_key_values`` (older 5.x)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def model_device(model: PreTrainedModel) -> torch.device:
    """The device of ``model``'s parameters (``cpu``, ``cuda:0``): where every tensor fed to a forward — token
    ids, position ids, attention masks — is created (``device=`` at creation, never a copy per step)."""
    return next(model.parameters()).device


def layer_types(model: PreTrainedModel) -> tuple[list[str], int | None]:
    """Each decoder layer's attention type (``"full_attention"`` / ``"sliding_attention"``) and the
    sliding window in cache rows (None: no window), from the model's text config."""
    text = model.config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window is not None else "full_attention"] * int(text.num_hidden_layers)
    return [str(t) for t in types], window


def takes_4d_masks(model: PreTrainedModel) -> bool:
    """Whether the model's attention implementation takes a prepared 4D mask (``sdpa``, ``eager``,
    eventkv's matmul attention; flash attention takes none)."""
    from eventkv.models.attention import MATMUL_ATTENTION

    return model.config.get_text_config(decoder=True)._attn_implementation in ("sdpa", "eager", MATMUL_ATTENTION)


def attention_masks(
    model: PreTrainedModel, visible: torch.Tensor, distance: torch.Tensor
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4D additive attention mask(s) of a forward whose attention is not plain causal (keys out of
    position order, a tree of branches), as transformers 5 takes them prepared.

    Args:
        visible: ``[batch, q, kv]`` or ``[q, kv]`` bool: which keys (cache rows, then the new tokens) each
            new token may attend to.
        distance: ``[q, kv]`` or ``[batch, q, kv]`` int64, how many cache rows back each key lies from each new
            token as an unbatched forward would lay them out: a sliding-window layer hides keys ``window`` or
            more back.

    Returns:
        ``[batch or 1, 1, q, kv]`` float in the model's dtype (0 = attend, the dtype's minimum = masked);
        for a model with sliding-window layers, a dict by layer type (``"full_attention"``,
        ``"sliding_attention"``).

    Raises:
        EventKVError: an attention implementation that takes no 4D mask (flash attention).
    """
    if not takes_4d_masks(model):
        impl = model.config.get_text_config(decoder=True)._attn_implementation
        raise EventKVError(
            f"this forward needs a 4D attention mask, which attention implementation {impl!r} does not take: "
            "load the model with attn_implementation='sdpa' (or 'eager')."
        )
    types, window = layer_types(model)
    dtype = next(model.parameters()).dtype
    if visible.dim() == 2:
        visible = visible.unsqueeze(0)

    def additive(v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(v.shape, dtype=dtype, device=v.device)
        return out.masked_fill_(~v, torch.finfo(dtype).min).unsqueeze(1)

    full = additive(visible)
    if "sliding_attention" not in types or window is None:
        return full
    return {"full_attention": full, "sliding_attention": additive(visible & (distance < int(window)))}


class _StopForward(Exception):
    """Raised by :func:`forward_until`'s hook: the rest of the forward is not needed."""


@contextmanager
def forward_until(module: torch.nn.Module) -> Iterator[None]:
    """A scope in which a forward ends as soon as ``module`` has run (a forward hook raises an internal
    exception, caught here): what a caller needs from the early layers, without the later ones. The
    forward's logits and cache are then incomplete (the cache holds the layers up to ``module``'s).
    The hook is removed on exit, whatever happens."""

    def stop(*_):
        raise _StopForward

    handle = module.register_forward_hook(stop)
    try:
        yield
    except _StopForward:
        pass
    finally:
        handle.remove()


def model_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: DynamicCache,
    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
    logits_to_keep: int = 0,
) -> torch.Tensor:
    """One forward pass that appends rows to ``cache`` and returns logits.

    Args:
        input_ids: ``[batch, q]`` token ids.
        position_ids: ``[batch, q]`` RoPE position ids (always explicit: the model's default,
            ``arange(q) + rows``, is wrong once rows have been dropped).
        cache: a config-less ``DynamicCache`` (every layer keeps all its rows; sliding-window
            layers get their window from the attention mask, counted in cache rows).
        attention_mask: ``[batch, rows + q]`` bool, indexed by cache row, or None (all visible); or a
            prepared 4D mask ``[batch, 1, q, rows + q]`` (additive float), or a dict of them by layer type
            (``"full_attention"``, ``"sliding_attention"``), which transformers 5 uses as given
            (:func:`eventkv.kv.blend.causal_masks`).
        logits_to_keep: 0 = logits for every query token, k = the last k only.

    Returns:
        logits ``[batch, q or k, vocab]`` (float32).

    Raises:
        EventKVError: the cache's rows are of another dtype or device than the model's.
    """
    rows = check_rows_match(model, cache)
    if attention_mask is None:
        # Why an explicit all-visible mask: our position ids have gaps (position budgets, dropped
        # rows). transformers reads gaps in position ids as packed-sequence boundaries when it is
        # given no mask (5.24 does so only without a cache; other 5.x versions may not wait for
        # that), which would silently cut attention at every gap. With a mask it never guesses.
        b, q = input_ids.shape
        attention_mask = torch.ones(b, rows + q, dtype=torch.bool, device=input_ids.device)
    kwargs = {cache_kwarg(model): cache}
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        use_cache=True,
        logits_to_keep=logits_to_keep,
        **kwargs,
    )
    return out.logits.float()


def check_rows_match(model: PreTrainedModel, cache: DynamicCache) -> int:
    """The number of rows in ``cache``, after checking that they have the model's dtype and device.

    Why: torch promotes mixed dtypes silently in some attention kernels (bfloat16 rows under a
    float32 model shifted candidate log-probs by 0.06–0.08 nats on smollm2-135m) and fails with a
    bare error in others; stored rows must be cast on purpose (:meth:`EventKV.to`), never by accident.

    Raises:
        EventKVError: rows of another layout (layers, KV heads, head dim: rows made by another
            model) or of another dtype or device than the model's parameters.
    """
    layer = cache.layers[0] if cache.layers else None
    keys = getattr(layer, "keys", None) if getattr(layer, "is_initialized", False) else None
    if keys is None:
        return 0
    cfg = model.config.get_text_config()
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    want = (cfg.num_hidden_layers, kv_heads, head_dim)
    got = (len(cache.layers), int(keys.shape[1]), int(keys.shape[-1]))
    if got != want:
        raise EventKVError(
            f"the KV rows have {got[0]} layers x {got[1]} KV heads x head dim {got[2]} but the model has "
            f"{want[0]} x {want[1]} x {want[2]}: they were made by another model; prefill again with this one "
            f"(EventKV.load(dir, expect_digest=profile.weights_digest) catches this at load)."
        )
    p = next(model.parameters())
    if keys.dtype != p.dtype or keys.device != p.device:
        kd, pd = str(keys.dtype).removeprefix("torch."), str(p.dtype).removeprefix("torch.")
        raise EventKVError(
            f"the KV rows are {kd} on {keys.device} but the model runs in {pd} on {p.device}: load the model with "
            f"dtype={kd!r} (the rows' dtype), prefill again with this model, or cast the rows on purpose with "
            f"EventKV.to(dtype=torch.{pd}, device={str(p.device)!r})."
        )
    return int(keys.shape[-2])


def check_context(n_positions: int, max_context: int | None, what: str = "history") -> None:
    """Raise EventKVError when ``n_positions`` exceeds the model's context (tokens)."""
    if max_context is not None and n_positions > max_context:
        raise EventKVError(
            f"the {what} needs {n_positions} positions but the model's context is {max_context} tokens: "
            f"shorten the log (fewer or shorter events) or use a model with a longer context."
        )
