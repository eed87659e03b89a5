"""Option vocabularies shared by the library and every CLI command (no heavy imports here, so the
CLI's ``--help`` stays fast), and the checks of option values at the boundary: type and range, with a
message that names the option, the bad value and what is allowed (:class:`eventkv.errors.OptionError`).

The probes' option objects call the checks in ``validate()``, so library callers and the CLI get the
same error before a model loads; the CLI prints it under the flag's name (``--max-new-tokens 0: ...``).

    >>> check_int("max_new_tokens", 0, "generate at least 1 token.")
    Traceback (most recent call last):
    eventkv.errors.OptionError: max_new_tokens 0: generate at least 1 token.
"""

from __future__ import annotations

import math
import os
import re
from typing import Iterable, Sequence

from eventkv.errors import OptionError
from eventkv.registry import Registry

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
"""What ``--dtype`` / ``models.load(dtype=...)`` accept; ``"auto"`` is resolved by ``models.resolve_dtype``."""

DTYPE_HELP = (
    "auto (default): bfloat16 where the hardware computes it natively (CUDA on Ampere or later; a CPU "
    "with AVX512-BF16 or AMX), else float32 | float32 | bfloat16 | float16. The choice and the reason "
    "are recorded in the manifest"
)


DEVICE_CHOICES = ("auto", "cpu", "cuda")
"""What ``--device`` / ``models.load(device=...)`` accept, besides ``cuda:N`` (the N-th CUDA GPU); ``"auto"`` is
resolved by ``models.resolve_device`` (a CUDA GPU when torch sees one, else the CPU)."""

DEVICE_HELP = (
    "auto (default): the CUDA GPU when torch sees one, else the CPU | cpu | cuda | cuda:N. With --dtype auto a "
    "GPU with native bf16 runs bfloat16; use --dtype float32 for reference numbers. The device is recorded "
    "in the manifest"
)

_CUDA_INDEX = re.compile(r"cuda:(0|[1-9][0-9]*)")


def check_device(device) -> str:
    """``device`` if it is ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (syntax only: whether this machine has
    that GPU is :func:`eventkv.models.resolve_device`'s check, which needs torch).

    Raises:
        OptionError: any other value (names the ``device`` field, the value and what is allowed).
    """
    if not isinstance(device, str) or not (device in DEVICE_CHOICES or _CUDA_INDEX.fullmatch(device)):
        raise OptionError(
            "device",
            device,
            "use auto (the CUDA GPU when torch sees one, else the CPU), cpu, cuda or cuda:N (the N-th GPU).",
        )
    return device


def is_int(value) -> bool:
    """True for an int that is not a bool (``True`` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(field: str, value, allowed: str, *, minimum: int = 1, flag: str | None = None) -> int:
    """``value`` if it is an int ``>= minimum``; else OptionError(field, value, allowed)."""
    if not is_int(value) or value < minimum:
        raise OptionError(field, value, allowed, flag)
    return value


def check_bool(field: str, value, allowed: str, *, flag: str | None = None) -> bool:
    """``value`` if it is a bool (not 1 or 0); else OptionError(field, value, allowed)."""
    if not isinstance(value, bool):
        raise OptionError(field, value, allowed, flag)
    return value


def check_optional_int(field: str, value, allowed: str, *, minimum: int = 1, flag: str | None = None) -> int | None:
    """Like :func:`check_int`, but None (the option left out) passes."""
    return None if value is None else check_int(field, value, allowed, minimum=minimum, flag=flag)


def check_float(field: str, value, allowed: str, *, low: float, high: float, flag: str | None = None) -> float:
    """``value`` if it is a finite real number strictly between ``low`` and ``high``; else OptionError."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not low < value < high
    ):
        raise OptionError(field, value, allowed, flag)
    return float(value)


def check_ints(
    field: str, values: Sequence, allowed: str, *, minimum: int = 0, flag: str | None = None
) -> tuple[int, ...]:
    """A non-empty list of distinct ints ``>= minimum``; else OptionError naming the whole list."""
    values = tuple(values)
    if not values or not all(is_int(v) and v >= minimum for v in values) or len(set(values)) != len(values):
        raise OptionError(field, values, allowed, flag)
    return values


def check_choices(
    field: str,
    values: Sequence,
    known: Iterable[str],
    *,
    required: Sequence[str] = (),
    flag: str | None = None,
    what: str = "",
) -> tuple[str, ...]:
    """A non-empty list of distinct names from ``known`` that includes every name in ``required``;
    else OptionError whose message lists the known names."""
    known = tuple(known)
    values = tuple(values)
    ok = (
        values
        and all(isinstance(v, str) and v in known for v in values)
        and len(set(values)) == len(values)
        and all(r in values for r in required)
    )
    if not ok:
        need = f", including {' and '.join(required)}" if required else ""
        raise OptionError(
            field,
            values,
            f"give {what or 'a comma-separated list'} of {', '.join(known)}, each at most once{need}.",
            flag,
        )
    return values


# --------------------------------------------------------------- options every run command shares
# (checked together by eventkv.probes.run_options.RunOptions.validate)


def env_value(env: str) -> str:
    """Environment variable ``env``'s value without surrounding space; ``""`` when unset or blank."""
    return os.environ.get(env, "").strip()


def check_choice_or_env(field: str, choice: str | None, env: str, choices: Sequence[str]) -> str:
    """``choice``, or environment variable ``env``'s value when ``choice`` is None (``"auto"`` when that is
    unset too), checked against ``choices`` (a kernel switch of ``models.load``: ``linear``, ``attention``).

    Raises:
        OptionError: ``choice`` (named ``field``) or the environment value (named ``env``) not in ``choices``.
    """
    if choice is None:
        value = env_value(env)
        if value and value not in choices:
            raise OptionError(env, value, f"set it to one of {', '.join(choices)}, or unset it.", flag=env)
        choice = value or "auto"
    if choice not in choices:
        raise OptionError(field, choice, f"use one of {', '.join(choices)}.")
    return choice


def check_items(items) -> int:
    """``--items``: at least one item."""
    return check_int("items", items, "run at least one item.")


def check_batch_pairs(batch_pairs) -> int:
    """``--batch-pairs``: a whole number >= 1, the items a pair probe computes in one batch.

    Raises:
        OptionError: ``batch_pairs`` is not a whole number >= 1.
    """
    allowed = "give a whole number of items >= 1 (1: one item at a time; 8 or more pays off on a GPU)."
    check_optional_int("batch_pairs", batch_pairs, allowed)
    if batch_pairs is None or batch_pairs < 1:
        raise OptionError("batch_pairs", batch_pairs, allowed)
    return batch_pairs


def check_threads(threads) -> int | None:
    """``--threads``: None (torch decides) or 1 .. the machine's logical cores (more threads than cores
    only slow torch down, and a huge count fails to start threads).

    Raises:
        OptionError: ``threads`` is not a whole number in that range.
    """
    cores = os.cpu_count() or 1
    allowed = (
        f"give 1 to {cores} torch CPU threads (this machine has {cores} logical cores), "
        "or leave it out and torch decides."
    )
    check_optional_int("threads", threads, allowed)
    if threads is not None and threads > cores:
        raise OptionError("threads", threads, allowed)
    return threads


def check_out_dir(path, field: str = "out") -> None:
    """An output directory (``--out``, ``--store``) must be a directory or not exist yet.

    Raises:
        OptionError: ``path`` exists and is not a directory (e.g. a file), or lies under a file.
    """
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise OptionError(
            field,
            str(path),
            "that path is a file, not a directory: give a directory that is new or was made by eventkv.",
        )
    if path is not None:
        parent = os.path.dirname(os.path.abspath(path))
        while parent and not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if parent and not os.path.isdir(parent):
            raise OptionError(
                field, str(path), f"{parent!r} is a file, so no directory can be made under it: give another path."
            )


def check_max_new_tokens(max_new_tokens) -> int:
    """``--max-new-tokens``: the greedy generation budget, at least 1 token."""
    return check_int("max_new_tokens", max_new_tokens, "generate at least 1 token (the greedy budget, in tokens).")


def check_chunk_size(chunk_size) -> int | None:
    """``--chunk-size``: None (one forward) or a positive number of tokens per forward."""
    return check_optional_int(
        "chunk_size", chunk_size, "give a positive number of tokens per forward (or leave it out for one pass)."
    )


def check_slots(**slots) -> None:
    """Every slot option (``n_events``, ``decoy_slot``, ``root_slot`` ...) is an int (``n_events`` >= 1, slots
    >= 0); ``source_slots`` is a pair of ints. The layout's order is the probe's own check."""
    for field, value in slots.items():
        if field == "source_slots":
            if not (isinstance(value, tuple) and len(value) == 2 and all(is_int(v) and v >= 0 for v in value)):
                raise OptionError(field, value, "give a slot range like 8-11 (0-based slots, inclusive) or one slot.")
        elif field == "n_events":
            check_int(field, value, "give a whole number of events per history.")
        else:
            check_int(field, value, "give a 0-based slot (slot i is event i+1 of the history).", minimum=0)


# --------------------------------------------------------------- the product's extension points, by name
# (lazy "module:attr" specs: listing the names imports nothing, so the CLI's --help lists them from here)

POLICIES: Registry = Registry(
    "eviction policy",
    {
        "streaming": "eventkv.eviction.policies:StreamingLLM",
        "knorm": "eventkv.eviction.policies:Knorm",
        "snapkv": "eventkv.eviction.policies:SnapKV",
        "tova": "eventkv.eviction.policies:Tova",
        "expected": "eventkv.eviction.policies:ExpectedAttention",
        "random": "eventkv.eviction.policies:Random",
        "event-topk": "eventkv.eviction.policies:EventTopK",
        "observed": "eventkv.eviction.scorers:ObservedAttention",
        "keydiff": "eventkv.eviction.scorers:KeyDiff",
        "lagkv": "eventkv.eviction.scorers:LagKV",
        "simlayerkv": "eventkv.eviction.budgets:SimLayerKV",
        "qfilter": "eventkv.eviction.scorers:QFilter",
        "kvzip": "eventkv.eviction.scorers:KVzip",
        "think": "eventkv.eviction.scorers:ThinK",
        "finch": "eventkv.eviction.scorers:Finch",
        "adakv": "eventkv.eviction.budgets:AdaKV",
        "per-layer-ratio": "eventkv.eviction.budgets:PerLayerRatio",
        "per-layer": "eventkv.eviction.budgets:PerLayer",
        "pyramidkv": "eventkv.eviction.budgets:PyramidKV",
        "criticalkv": "eventkv.eviction.budgets:CriticalKV",
        "criticaladakv": "eventkv.eviction.budgets:CriticalAdaKV",
        "chunkkv": "eventkv.eviction.budgets:ChunkKV",
        "composed": "eventkv.eviction.budgets:Composed",
        "duo": "eventkv.eviction.budgets:DuoAttention",
    },
    field="policy",
    flag="--policy",
)
"""What ``--policy`` / :func:`eventkv.eviction.make_policy` accept: the policy classes, by name."""

BACKENDS: Registry = Registry(
    "sweep backend",
    {
        "serial": "eventkv.sweep.backends:SerialBackend",
        "process": "eventkv.sweep.backends:ProcessBackend",
        "ray": "eventkv.sweep.backends:RayBackend",
    },
    help={
        "serial": "one worker in this process",
        "process": "worker processes on this machine, the cores divided among them",
        "ray": "Ray actors on a cluster; pip install 'eventkv[ray]'",
    },
    field="backend",
)
"""What ``--backend`` of ``eventkv sweep`` accepts: the backend classes, by name."""

DIALOGUE_FORMATS: Registry = Registry(
    "dialogue format",
    {
        "locomo": "eventkv.studies.materialization.dialogue:load_locomo",
        "realtalk": "eventkv.studies.materialization.dialogue:load_realtalk",
    },
    field="data_format",
    flag="--format",
    allowed=lambda names: f"use {' or '.join(names)}.",
)
"""What ``--format`` accepts: the loaders of :mod:`eventkv.studies.materialization.dialogue`, by dataset (a path ->
list of conversations)."""

CARRIER_KINDS: Registry = Registry(
    "carrier kind",
    {
        "passive": "eventkv.memory.carriers:passive",
        "binding": "eventkv.memory.carriers:binding",
        "directive": "eventkv.memory.carriers:directive",
        "compute": "eventkv.memory.carriers:compute",
    },
    field="kind",
    allowed=lambda names: f"use one of {', '.join(names)} or auto.",
)
"""The answer-free carrier kinds (Study 1, "Programmed carriers"): the memory's carrier texts of
:mod:`eventkv.memory.carriers`, by kind (``(subject, refs) -> text``); the contract battery measures
them and ``explicit``."""

SELECTORS: Registry = Registry(
    "selector",
    {
        "bm25": "eventkv.memory.select:BM25Selector",
        "dense": "eventkv.memory.dense:DenseSelector",
        "attention": "eventkv.memory.attention:AttentionSelector",
        "hybrid": "eventkv.memory.hybrid:HybridSelector",
        "rerank": "eventkv.memory.rerank:RerankSelector",
    },
    field="selector",
    allowed=lambda names: f"give one of {', '.join(sorted(names))}, or a Selector.",
)
"""What ``selector=`` of :class:`eventkv.memory.EventMemory` accepts by name: the selector classes of
:mod:`eventkv.memory.select` (BM25) and :mod:`eventkv.memory.dense` (sentence embeddings), each
constructible with no arguments (each ranks a memory's events for a question)."""
