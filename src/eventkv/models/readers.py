"""Reading a model and its tokenizer with transformers: from a Hugging Face directory or hub id, or
from a GGUF file (dequantized at load). Used by `eventkv.models.loading` and by the GGUF conversion
in `eventkv.models.fetch`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eventkv.errors import EventKVError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = ["gguf_model", "gguf_tokenizer", "load_gguf", "load_hf"]


def load_hf(ref: str, name: str, dtype: torch.dtype, attn: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model and tokenizer of a Hugging Face directory or hub id ``ref`` (``from_pretrained``).

    ``name`` is the name the user gave, for messages; ``attn`` the attention implementation.

    Raises:
        EventKVError: transformers raised ``OSError`` (not found, unreadable, no network).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def go():
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, attn_implementation=attn)
        return model, AutoTokenizer.from_pretrained(ref)

    return _wrap_os_error(name, go)


def load_gguf(path: Path, name: str, dtype: torch.dtype, attn: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Model (dequantized, see `gguf_model`) and tokenizer (`gguf_tokenizer`) of the GGUF file ``path``.

    Raises:
        EventKVError: the file cannot be read (``OSError``, message names ``name``); `accelerate`
            is missing.
    """
    model = _wrap_os_error(name, lambda: gguf_model(path, dtype, attn))
    tokenizer = _wrap_os_error(name, lambda: gguf_tokenizer(path))
    return model, tokenizer


def gguf_model(path: Path, dtype: torch.dtype, attn: str) -> PreTrainedModel:
    """A dense model from a GGUF file, dequantized at load (forced, so installing `kernels` changes nothing).

    Raises:
        EventKVError: the `accelerate` package, which transformers needs for GGUF, is missing.
    """
    from transformers import AutoModelForCausalLM, GgufConfig
    from transformers.utils import is_accelerate_available

    if not is_accelerate_available():
        raise EventKVError(
            f"loading GGUF weights ({path.name}) needs the `accelerate` package; install it with `pip "
            "install accelerate`"
        )
    return AutoModelForCausalLM.from_pretrained(
        str(path.parent),
        gguf_file=path.name,
        dtype=dtype,
        attn_implementation=attn,
        quantization_config=GgufConfig(dequantize=True),
    )


def gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a GGUF file, with the GGUF's ``tokenizer.chat_template`` set if transformers dropped it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if getattr(tokenizer, "chat_template", None) is None:
        template = _gguf_string_field(path, "tokenizer.chat_template")
        if template:
            tokenizer.chat_template = template
    return tokenizer


def _gguf_string_field(path: Path, key: str) -> str | None:
    """A string metadata field of a GGUF file (memory-mapped, no tensor data read), or None."""
    from gguf import GGUFReader

    f = GGUFReader(str(path)).fields.get(key)
    if f is None:
        return None
    value = f.contents()
    return value if isinstance(value, str) else None


def _wrap_os_error(name: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except OSError as e:
        raise EventKVError(
            f"could not load model {name!r}: {e}. Check the path or hub id (and network access for hub ids)."
        ) from e
