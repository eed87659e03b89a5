"""What eventkv knows about a model: `ModelProfile`, and `LoadedModel` (model + tokenizer + profile).

Plain data types with no model code: `eventkv.kv.log` and the probes import them for their
signatures without loading anything. The profile is read by `eventkv.models.introspect.profile_for`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["LAYER_TYPES", "LoadedModel", "ModelProfile"]

LAYER_TYPES = ("full_attention", "sliding_attention")
"""The attention layer kinds eventkv's KV data path supports."""


@dataclass(frozen=True)
class ModelProfile:
    """Model-specific facts the KV data path and the probes need, read from config and tokenizer.

    Fields:
        name: the alias, path or hub id as given to `load`.
        family: ``config.model_type`` (e.g. ``"llama"``, ``"qwen2"``, ``"gemma3_text"``).
        num_layers: decoder layers.
        num_kv_heads: key/value heads per layer (after grouped-query sharing).
        head_dim: size of one head's key/value vector.
        layer_types: per layer ``"full_attention"`` or ``"sliding_attention"``. Read from
            ``config.layer_types``; a config without it is all sliding when it sets a
            ``sliding_window`` (e.g. Mistral-7B-v0.1), else all full — the same rule
            ``DynamicCache(config=...)`` uses, so it matches the cache layers built at prefill.
        sliding_window: the sliding layers' window in tokens (``config.sliding_window``), or None
            when no layer slides.
        dtype: parameter dtype, e.g. ``"float32"``, ``"bfloat16"``.
        device: where the parameters are when the profile is read, e.g. ``"cpu"``, ``"cuda:0"``.
        chat_head: the prompt text up to where the user's content starts. It is exactly what the
            tokenizer's chat template renders for one user message (Qwen2.5's and SmolLM2's
            templates add a default system message: it is kept, as part of the head), preceded by
            the BOS token's text when the tokenizer adds BOS on encode and the template does not
            write it. Tokenize head and tail with ``add_special_tokens=False``.
        chat_tail: the text after the user's content, up to and including the generation prompt
            (the assistant turn opener).
        scaffold: ``"chat_template"`` when head/tail come from the template; ``"plain_text"`` when
            the tokenizer has no chat template (head = BOS text if needed + ``"User:\\n"``, tail =
            ``"\\nAssistant:"``); ``"none"`` when no tokenizer was given (head and tail empty).
        max_context: ``config.max_position_embeddings``, in tokens.
        stop_token_ids: EOS ids (generation config, config, tokenizer) then the ids of the
            end-of-turn tokens in `END_OF_TURN_TOKENS` that exist in the vocab; no duplicates.
        weights_digest: sha256 hex of the content the model was built from (see `load`: the GGUF,
            or a directory's config and weight files), ``"hub:<id>@<revision>"`` for a hub model
            whose snapshot is not in the Hugging Face cache, ``"unhashed"`` when not computed.
        dtype_reason: why ``dtype`` was chosen (``"requested"``, or what `resolve_dtype` detected
            for ``dtype="auto"``); empty for profiles not made by `load`.
        device_reason: why ``device`` was chosen (``"requested"``, ``"requested: CUDA device <name>"``,
            or what `resolve_device` found for ``device="auto"``); empty for profiles not made by `load`.
        linear_kernel: what the linear layers run on, ``"onednn"`` or ``"torch"`` (`eventkv.models.kernels`).
        linear_reason: why; empty for profiles not made by `load`.
        attention_kernel: what the attention runs on, ``"matmul"`` (short queries; SDPA above) or ``"sdpa"``
            (`eventkv.models.attention`), or the implementation the model was loaded with.
        attention_reason: why; empty for profiles not made by `load`.
    """

    name: str
    family: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    dtype: str
    device: str
    chat_head: str
    chat_tail: str
    scaffold: str
    max_context: int
    stop_token_ids: tuple[int, ...]
    weights_digest: str
    dtype_reason: str = ""
    device_reason: str = ""
    linear_kernel: str = "torch"
    linear_reason: str = ""
    attention_kernel: str = "sdpa"
    attention_reason: str = ""

    @property
    def kv_row_bytes(self) -> int:
        """Bytes of one KV row over every layer in the model's dtype: layers x 2 (K, V) x KV heads x head dim x
        the dtype's bytes (a cache slot as the model serves it)."""
        import torch

        size = torch.empty((), dtype=getattr(torch, self.dtype)).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * size

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable dict of all fields (tuples become lists)."""
        d = asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["stop_token_ids"] = list(self.stop_token_ids)
        return d


@dataclass
class LoadedModel:
    """A model in eval mode and the requested dtype, its tokenizer, and its `ModelProfile`."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    profile: ModelProfile
