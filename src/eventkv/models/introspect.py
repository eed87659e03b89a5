"""Reading a `ModelProfile` from a model's own config and tokenizer: layer types, the chat scaffold
(and whether it tokenizes piecewise as the whole text does), stop tokens.

This is the one place model-specific facts are read; nothing elsewhere hard-codes them per model.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, cast

from eventkv.errors import EventKVError
from eventkv.models.encoding import encode
from eventkv.models.profile import LAYER_TYPES, ModelProfile

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = ["END_OF_TURN_TOKENS", "PLAIN_TEXT_HEAD", "PLAIN_TEXT_TAIL", "SEAM_CONTENTS", "profile_for", "scaffold_seams"]

END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")
"""Token texts that end a turn in the common chat formats; each one present in a vocab is a stop token."""

PLAIN_TEXT_HEAD = "User:\n"
"""The plain-text scaffold's head. It ends in a newline, not a space: a trailing space would be
tokenized on its own (Gemma 3: ``'User', ':', '▁', 'Dana'``) where the whole text has ``'▁Dana'``."""
PLAIN_TEXT_TAIL = "\nAssistant:"

SEAM_CONTENTS = (
    "Dana moved the key.",
    "hello world",
    "The red key",
    "42 apples",
    "3.5 kg",
    "7",
    "(see above)",
    '"Quoted" text',
    "- a list item",
    "? what",
    "Über café",
    "x",
)
"""User contents whose piecewise ids must equal the whole text's at every scaffold seam (see `scaffold_seams`):
several first words, digits, punctuation, a non-ASCII letter, one character."""

_SENTINEL = "EVENTKV_USER_CONTENT_7f3a9c"


def profile_for(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    name: str,
    weights_digest: str = "unhashed",
) -> ModelProfile:
    """Read a `ModelProfile` from a model's config and its tokenizer (see the field docs there).

    Works on any causal LM, including tiny random models built from a config. With
    ``tokenizer=None`` the chat head and tail are empty and ``scaffold`` is ``"none"``, and only
    the config's EOS ids are stop tokens.

    Raises:
        EventKVError: a layer type other than full or sliding attention (e.g. chunked or linear
            attention), which the KV data path does not support; a chat template that does not
            render the user's content exactly once.
    """
    config = model.config
    text = config.get_text_config(decoder=True)
    num_layers = int(text.num_hidden_layers)
    num_heads = int(text.num_attention_heads)
    num_kv_heads = int(getattr(text, "num_key_value_heads", None) or num_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // num_heads)
    window = getattr(text, "sliding_window", None)
    raw_types = getattr(text, "layer_types", None)
    if raw_types is None:
        raw_types = ["sliding_attention" if window is not None else "full_attention"] * num_layers
    layer_types = tuple(str(t) for t in raw_types)
    if len(layer_types) != num_layers:
        raise EventKVError(
            f"model {name!r} lists {len(layer_types)} layer_types for {num_layers} layers; fix its config.json"
        )
    unsupported = sorted(set(layer_types) - set(LAYER_TYPES))
    if unsupported:
        raise EventKVError(
            f"model {name!r} has attention layer types {unsupported}; eventkv supports only {list(LAYER_TYPES)}. "
            "Use a model with full or sliding-window attention."
        )
    sliding = "sliding_attention" in layer_types
    if sliding and window is None:
        raise EventKVError(
            f"model {name!r} has sliding_attention layers but no sliding_window in its config; fix its config.json"
        )
    head, tail, scaffold = _chat_scaffold(tokenizer, name)
    return ModelProfile(
        name=name,
        family=str(config.model_type),
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        layer_types=layer_types,
        sliding_window=int(window) if sliding and window is not None else None,  # None: refused above
        dtype=str(model.dtype).removeprefix("torch."),
        device=str(model.device),
        chat_head=head,
        chat_tail=tail,
        scaffold=scaffold,
        max_context=int(text.max_position_embeddings),
        stop_token_ids=_stop_token_ids(model, tokenizer),
        weights_digest=weights_digest,
    )


def scaffold_seams(
    tokenizer: PreTrainedTokenizerBase, head: str, tail: str, contents: tuple[str, ...] = SEAM_CONTENTS
) -> list[str]:
    """The contents whose piecewise ids ``encode(head) + encode(content) + encode(tail)`` differ from
    the ids of the whole text ``encode(head + content + tail)`` (`eventkv.models.encoding.encode`); empty when every
    seam where the scaffold meets content tokenizes as the whole text does.

    The packaged profiles and the tiny test tokenizer return ``[]`` for `SEAM_CONTENTS`. Stated
    difference: content that itself begins or ends in whitespace (a newline, a space) may merge with the
    head's closing newline or the tail's opening one in the whole text (``'\\n\\n'`` is one token in most
    vocabularies); piecewise it stays apart, as the log's design keeps every event's tokens its own.
    """
    pieces = encode(tokenizer, head), encode(tokenizer, tail)
    return [c for c in contents if pieces[0] + encode(tokenizer, c) + pieces[1] != encode(tokenizer, head + c + tail)]


def _chat_scaffold(tokenizer: PreTrainedTokenizerBase | None, name: str) -> tuple[str, str, str]:
    """(chat_head, chat_tail, scaffold) for one user turn; see `ModelProfile`."""
    if tokenizer is None:
        return "", "", "none"
    bos_text = tokenizer.bos_token if _adds_bos(tokenizer) else ""
    if not getattr(tokenizer, "chat_template", None):
        return bos_text + PLAIN_TEXT_HEAD, PLAIN_TEXT_TAIL, "plain_text"
    rendered = cast(  # tokenize=False: the rendered text (the stub's return type covers every mode)
        str,
        tokenizer.apply_chat_template(
            [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
        ),
    )
    if rendered.count(_SENTINEL) != 1:
        raise EventKVError(
            f"the chat template of {name!r} renders the user's content {rendered.count(_SENTINEL)} times, "
            "expected once; "
            "give the tokenizer a standard chat template"
        )
    head, tail = rendered.split(_SENTINEL)
    if bos_text and not head.startswith(bos_text):
        head = bos_text + head
    bad = scaffold_seams(tokenizer, head, tail)
    if bad:
        # A template whose head ends where the tokenizer merges across (e.g. a trailing space before the
        # content) cannot be tokenized piece by piece as a whole; say so rather than change its text.
        logger.warning(
            "the chat template of %r does not tokenize piece by piece as the whole prompt does at the "
            "head/content/tail seams (e.g. content %r); prompts keep the template's pieces",
            name,
            bad[0],
        )
    return head, tail, "chat_template"


def _adds_bos(tokenizer: PreTrainedTokenizerBase) -> bool:
    """True when encoding with special tokens prepends the BOS token."""
    bos_id = tokenizer.bos_token_id
    if bos_id is None or tokenizer.bos_token is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > len(without) and with_special[0] == bos_id


def _stop_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None) -> tuple[int, ...]:
    ids: list[int] = []

    def add(value: Any) -> None:
        if value is None:
            return
        for v in value if isinstance(value, (list, tuple)) else [value]:
            if v is not None and int(v) not in ids:
                ids.append(int(v))

    generation_config = getattr(model, "generation_config", None)
    add(getattr(generation_config, "eos_token_id", None))
    add(getattr(model.config.get_text_config(decoder=True), "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
        vocab = tokenizer.get_vocab()
        for token in END_OF_TURN_TOKENS:
            add(vocab.get(token))
    return tuple(ids)
