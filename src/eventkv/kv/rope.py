"""Re-rotation of stored keys to other RoPE positions (a data-path helper of serving).

Rotary position embedding (RoPE; Su et al. 2021, "RoFormer: Enhanced Transformer with Rotary
Position Embedding", arXiv 2104.09864, section 3.4) multiplies each pair of a key's channels by a
rotation whose angle is ``position * inv_freq``: linear in the position. So a key rotated at
position ``p`` becomes the key the same projection gives at position ``q`` by one more rotation, by
the angle of the offset ``q - p`` (``R(q) = R(q - p) R(p)``), and no forward is needed. This holds
for every RoPE whose frequencies are fixed: the default one and the rope scalings ``linear``,
``llama3`` and ``yarn`` (which only change ``inv_freq``, and for yarn multiply cos and sin by a
constant attention factor). It does not hold for ``dynamic`` NTK scaling or ``longrope``: their
frequencies depend on the length of the sequence the keys were computed in.

Every angle, cos and sin comes from the model's own rotary embedding module (transformers'
``<Family>RotaryEmbedding``, one per model, called with the layer's type where the model has one
RoPE per layer type, as Gemma 3's local-base sliding layers), and the rotation is the modeling
module's own ``apply_rotary_pos_emb``; nothing here recomputes frequencies.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from eventkv.errors import EventKVError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["REROTATABLE_ROPE_TYPES", "rerotatable", "rerotate", "rotary_embedding"]

REROTATABLE_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""transformers rope types whose frequencies do not depend on the sequence length (re-rotation is exact)."""

_LENGTH_DEPENDENT = ("dynamic", "longrope")


def rotary_embedding(model: PreTrainedModel) -> torch.nn.Module:
    """The rotary embedding module of ``model``'s decoder (``model.model.rotary_emb`` for the causal LMs of
    transformers 5.x: Llama, Qwen2, Qwen3, Gemma 3).

    Raises:
        EventKVError: the decoder has no ``rotary_emb`` module (a model without RoPE, or one that keeps a
            rotary module per attention layer).
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    for holder in (decoder, getattr(decoder, "model", None), getattr(model, "model", None)):
        rotary = getattr(holder, "rotary_emb", None)
        if isinstance(rotary, torch.nn.Module):
            return rotary
    raise EventKVError(
        f"{type(model).__name__} has no decoder-level rotary_emb module: eventkv re-rotates keys only for RoPE "
        "models whose decoder holds one rotary embedding (Llama, Qwen2, Qwen3, Gemma 3); serve with "
        "positions='original'."
    )


def _rope_type(rotary: torch.nn.Module, layer_type: str | None) -> str:
    kinds = getattr(rotary, "rope_type", "default")
    kind = kinds.get(layer_type, "default") if isinstance(kinds, dict) else kinds
    return str(kind)


def _check_rope_type(kind: str, layer_type: str | None) -> None:
    where = f" on {layer_type} layers" if layer_type else ""
    if any(k in kind for k in _LENGTH_DEPENDENT):
        raise EventKVError(
            f"rope type {kind!r}{where} rescales its frequencies with the sequence length, so keys computed in one "
            "sequence cannot be re-rotated exactly to the positions of another: serve with positions='original', "
            f"or use a model whose rope type is one of {', '.join(REROTATABLE_ROPE_TYPES)}."
        )
    if kind not in REROTATABLE_ROPE_TYPES:
        raise EventKVError(
            f"rope type {kind!r}{where} is not known to be a fixed rotation; eventkv re-rotates only "
            f"{', '.join(REROTATABLE_ROPE_TYPES)}: serve with positions='original'."
        )


def _apply_rotary(rotary: torch.nn.Module) -> Callable[..., Any]:
    """The ``apply_rotary_pos_emb`` of the modeling module that defines ``rotary``'s class."""
    apply = getattr(sys.modules[type(rotary).__module__], "apply_rotary_pos_emb", None)
    if apply is None:
        raise EventKVError(
            f"the modeling module of {type(rotary).__name__} has no apply_rotary_pos_emb: eventkv cannot re-rotate "
            "this model's keys; serve with positions='original'."
        )
    return apply


def _offset_rotation(
    rotary: torch.nn.Module, layer_type: str | None, offsets: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[1, rows, head_dim]`` float32 of the rotation by ``offsets`` ``[rows]`` positions, with the
    module's attention factor (yarn) divided out: the stored keys carry it already, from their first rotation."""
    _check_rope_type(_rope_type(rotary, layer_type), layer_type)
    buffer = next(iter(rotary.buffers()), None)
    device = buffer.device if buffer is not None else offsets.device
    x = torch.empty(0, dtype=torch.float32, device=device)  # the module reads only x's dtype and device
    kwargs = {"layer_type": layer_type} if "layer_type" in inspect.signature(rotary.forward).parameters else {}
    position_ids = torch.cat([offsets.to(device), torch.zeros(1, dtype=torch.long, device=device)]).unsqueeze(0)
    cos, sin = rotary(x, position_ids, **kwargs)
    if cos.shape[-1] != head_dim:
        raise EventKVError(
            f"the rotary embedding rotates {cos.shape[-1]} of the {head_dim} channels of a key head (partial "
            "rotary): eventkv re-rotates only full-head RoPE; serve with positions='original'."
        )
    factor = cos[:, -1:]  # cos(0) = 1 times the attention factor (1 except for yarn)
    return cos[:, :-1] / factor, sin[:, :-1] / factor


@torch.inference_mode()
def rerotate(
    model: PreTrainedModel,
    keys: Sequence[torch.Tensor],
    from_positions: torch.Tensor,
    to_positions: torch.Tensor,
) -> list[torch.Tensor]:
    """Stored keys re-rotated from the positions they were computed at to other positions (RoPE, arXiv
    2104.09864: the rotation angle is linear in the position, so ``R(to) = R(to - from) R(from)``).

    Each layer uses its own RoPE: the model's rotary embedding called with the layer's type where the model has
    one per type (Gemma 3's sliding layers: the local base), rope scaling included (``linear``, ``llama3``,
    ``yarn``; yarn's attention factor, which the stored keys carry once from their first rotation, is not
    applied a second time). The rotation runs in float32 and the result is cast back to the keys' dtype.

    Args:
        model: the model that computed the keys.
        keys: per layer ``[batch, kv_heads, rows, head_dim]`` keys, rotated at ``from_positions``
            (e.g. an EventKV's or ServedCache's keys); any device per layer. Not modified.
        from_positions, to_positions: ``[rows]`` int64 position ids (any device), the ones each row was rotated
            at and the ones it should be at.

    Returns:
        per layer ``[batch, kv_heads, rows, head_dim]`` keys rotated at ``to_positions``, dtype and device of the
        input; the input tensors themselves where every offset is 0. Against the same pre-RoPE keys rotated
        directly at ``to_positions``: equal up to float32 rounding of the angles (measured: within 6.5e-6 on
        the tiny test models at positions below 200, keys of magnitude up to ~5; the rounding grows with the
        position, as the model's own does).

    Raises:
        EventKVError: a number of layers other than the model's, positions of another length than the rows,
            a rope type that cannot be re-rotated exactly (``dynamic`` NTK scaling, ``longrope``, or one not in
            :data:`REROTATABLE_ROPE_TYPES`), partial rotary, or a model without a decoder-level rotary module.
    """
    text = model.config.get_text_config(decoder=True)
    n_layers = int(text.num_hidden_layers)
    if len(keys) != n_layers:
        raise EventKVError(f"got keys for {len(keys)} layers but the model has {n_layers}: pass one tensor per layer.")
    rows = int(keys[0].shape[-2]) if keys else 0
    if from_positions.shape != (rows,) or to_positions.shape != (rows,):
        raise EventKVError(
            f"from_positions {tuple(from_positions.shape)} and to_positions {tuple(to_positions.shape)} must both "
            f"be [rows] = ({rows},), one position id per key row."
        )
    offsets = to_positions.to(torch.long).cpu() - from_positions.to(torch.long).cpu()
    if not bool(offsets.any()):
        return list(keys)
    rotary = rotary_embedding(model)
    apply = _apply_rotary(rotary)
    layer_types: list[str | None] = list(getattr(text, "layer_types", None) or [None] * n_layers)
    if not isinstance(getattr(rotary, "rope_type", None), dict):
        layer_types = [None] * n_layers  # one RoPE for every layer
    rotations: dict[str | None, tuple[torch.Tensor, torch.Tensor]] = {}
    out: list[torch.Tensor] = []
    for k, layer_type in zip(keys, layer_types):
        if layer_type not in rotations:
            rotations[layer_type] = _offset_rotation(rotary, layer_type, offsets, int(k.shape[-1]))
        cos, sin = (t.to(k.device) for t in rotations[layer_type])
        k32 = k.float()
        _, rotated = apply(k32, k32, cos, sin)
        out.append(rotated.to(k.dtype))
    return out


_REROTATABLE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def rerotatable(model: PreTrainedModel) -> bool:
    """Whether :func:`rerotate` moves this model's keys exactly: a decoder-level rotary module of a rope type in
    :data:`REROTATABLE_ROPE_TYPES` on every layer, rotating full key heads. Answered by re-rotating one zero key
    per layer by one position (the same checks a real re-rotation runs), once per model object.

    Returns:
        True when ``positions="contiguous"`` can serve this model; False where :func:`rerotate` raises.
    """
    known = _REROTATABLE.get(model)
    if known is not None:
        return known
    text = model.config.get_text_config(decoder=True)
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    # a probe key per layer on the CPU: rerotate moves its rotation to each key's device
    keys = [torch.zeros(1, kv_heads, 1, head_dim, device="cpu") for _ in range(int(text.num_hidden_layers))]
    one = torch.ones(1, dtype=torch.long, device="cpu")
    try:
        rerotate(model, keys, one - 1, one)
        ok = True
    except EventKVError:
        ok = False
    _REROTATABLE[model] = ok
    return ok
