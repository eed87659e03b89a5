"""What a memory's stored rows depend on, and the refusal of a model they were not made by: the weights
digest, the tokenizer's and chat template's sha256, and the dtype (:func:`model_identity`, kept in the
store's manifest; :func:`check_identity` on open). Stale KV is refused, never used."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from eventkv.errors import EventKVError

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.models.profile import LoadedModel


def tokenizer_digest(tokenizer) -> str:
    """sha256 (hex) of a tokenizer's serialized form: the fast tokenizer's JSON
    (``backend_tokenizer.to_str()``), else the files ``save_pretrained`` writes (sorted by name)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return hashlib.sha256(backend.to_str().encode()).hexdigest()
    h = hashlib.sha256()
    with tempfile.TemporaryDirectory() as d:
        tokenizer.save_pretrained(d)
        for f in sorted(Path(d).iterdir()):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def chat_template_digest(tokenizer) -> str:
    """sha256 (hex) of the tokenizer's chat template, or ``"none"`` when it has none."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return "none"
    if not isinstance(template, str):  # a dict of named templates
        template = json.dumps(template, sort_keys=True)
    return hashlib.sha256(template.encode()).hexdigest()


def model_identity(lm: LoadedModel) -> dict[str, str]:
    """What a store's rows depend on: weights, tokenizer, chat template, dtype (manifest fields)."""
    return {
        "weights_digest": lm.profile.weights_digest,
        "tokenizer_digest": tokenizer_digest(lm.tokenizer),
        "chat_template_digest": chat_template_digest(lm.tokenizer),
        "dtype": lm.profile.dtype,
    }


IDENTITY_NAMES = {
    "weights_digest": "weights",
    "tokenizer_digest": "tokenizer",
    "chat_template_digest": "chat template",
    "dtype": "dtype",
}


def check_identity(directory: Path, manifest: dict, lm: LoadedModel) -> None:
    """Refuse a store whose rows were made by other weights, tokenizer, chat template or dtype.

    Raises:
        EventKVError: naming the field, the stored and the given value, and the fix.
    """
    given = model_identity(lm)
    for key, what in IDENTITY_NAMES.items():
        stored = manifest.get(key)
        if stored != given[key]:
            raise EventKVError(
                f"the memory in {str(directory)!r} was made with {what} {str(stored)[:16]!r} (model "
                f"{manifest.get('model')!r}, {manifest.get('dtype')}) but the model given has {what} "
                f"{str(given[key])[:16]!r} ({lm.profile.name!r}, {lm.profile.dtype}): its stored KV rows would be "
                f"stale. Open it with the model it was made with, or create a new memory for this model and add "
                f"the events again."
            )
