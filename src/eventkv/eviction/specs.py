"""Policy specs: a registered policy's name with its settings in parentheses, as ``eventkv audit --policy`` takes
them (``snapkv(window=64,kernel=5,pooling=avg)``, ``adakv(inner=snapkv(window=8),alpha=0.2)``), read into the
policy the library would build with the same keywords (``docs/eviction.md``, "Settings")."""

from __future__ import annotations

import dataclasses
from typing import Any

from eventkv.errors import OptionError
from eventkv.eviction.policies import Policy
from eventkv.options import POLICIES


def make_policy(name: str, **options) -> Policy:
    """The registered policy ``name`` (:data:`POLICIES`) with ``options``.

    Raises:
        OptionError: an unknown name (the message lists the registered ones).
    """
    return POLICIES.get(name)(**options)


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``(name, settings)`` of a policy spec: a registered name (:data:`POLICIES`) alone, or with settings in
    parentheses, ``snapkv(window=64,kernel=5,pooling=avg)``. Each value is read as its field's type: whole
    numbers, numbers, ``true`` / ``false``, text, a policy as a spec of its own
    (``adakv(inner=snapkv(window=8,kernel=5),alpha=0.2)``, built here), or a list with ``/`` between its items
    (``per-layer-ratio(inner=knorm,ratios=0.25/0.75)``, ``per-layer(policies=knorm/snapkv(window=8))``; a ``/``
    inside an item's parentheses belongs to that item), and ``none`` for a setting that may be unset
    (``finch(chunk=none)``); :func:`policy_from_spec` then builds the policy, whose own checks apply. A list of
    lists (duo's ``pattern``) is given from Python.

    Raises:
        OptionError: an unknown name, a setting the policy does not have (the message lists those it has), a
            value not of its field's type, a setting given twice, or a spec not of this form.
    """
    if not isinstance(spec, str):
        raise OptionError("policy", spec, "give a policy name, e.g. snapkv or snapkv(window=64,kernel=5).")
    text = spec.strip()
    name, _, rest = text.partition("(")
    name = name.strip()
    cls = POLICIES.get(name)  # an unknown name: the registry's message lists the known ones
    settings: dict[str, Any] = {}
    if not rest:
        if "(" in text or ")" in text:
            raise OptionError("policy", spec, "close the settings' parenthesis: snapkv(window=64,kernel=5).")
        return name, settings
    if not rest.endswith(")") or not _balanced(rest[:-1]):
        raise OptionError("policy", spec, "write settings as name(key=value,...), e.g. snapkv(window=64,kernel=5).")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init} if dataclasses.is_dataclass(cls) else {}
    settable = {k: f for k, f in fields.items() if f.type in _SETTABLE}
    for item in split_policy_specs(rest[:-1]):
        key, eq, raw = (x.strip() for x in item.partition("="))
        if not eq or key not in settable:
            has = ", ".join(settable) or "none"
            raise OptionError("policy", spec, f"{name} has no setting {key!r}: its settings are {has}.")
        if key in settings:
            raise OptionError("policy", spec, f"{key} is given twice.")
        settings[key] = _setting(spec, key, raw, str(settable[key].type))
    return name, settings


#: the field types a spec can set, and how a value is written: a policy as a nested spec
#: (``adakv(inner=snapkv(window=8,kernel=5))``), a list of numbers with ``/`` between them (``ratios=0.25/0.75``)
_SETTABLE = (
    "int",
    "float",
    "bool",
    "str",
    "Policy",
    "tuple[float, ...]",
    "tuple[Policy, ...]",
    "float | None",
    "int | None",
)


def _split_outside_parentheses(text: str, sep: str) -> list[str]:
    """``text`` cut at each ``sep`` outside parentheses, so a list item may hold a spec with a list of its own
    (``composed(policies=per-layer-ratio(inner=knorm,ratios=0.25/0.75)/snapkv)``)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return parts + [text[start:]]


def _balanced(text: str) -> bool:
    """Whether every parenthesis of ``text`` closes, in order."""
    depth = 0
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def _setting(spec: str, key: str, raw: str, kind: str) -> Any:
    if kind.endswith(" | None") and raw.lower() == "none":  # a setting that may be left unset: none
        return None
    kind = kind.removesuffix(" | None")
    if kind in ("Policy", "tuple[Policy, ...]"):
        items = _split_outside_parentheses(raw, "/") if kind == "tuple[Policy, ...]" else [raw]
        try:
            built = tuple(policy_from_spec(x) for x in items)
        except OptionError as e:  # a policy inside this spec: name the whole spec too
            raise OptionError("policy", spec, f"its {key}: {e}") from None
        return built if kind == "tuple[Policy, ...]" else built[0]
    if kind == "tuple[float, ...]":
        return tuple(_setting(spec, key, x, "float") for x in raw.split("/"))
    try:
        if kind == "bool":
            if raw.lower() not in ("true", "false"):
                raise ValueError(raw)
            return raw.lower() == "true"
        return {"int": int, "float": float, "str": str}[kind](raw)
    except ValueError:
        want = {"int": "a whole number", "float": "a number", "bool": "true or false", "str": "text"}[kind]
        raise OptionError("policy", spec, f"{key} must be {want}, not {raw!r}.") from None


def policy_from_spec(spec: str, **defaults: Any) -> Policy:
    """The policy a spec names (:func:`parse_policy_spec`), its settings over ``defaults`` (settings a caller
    gives every policy of that name, e.g. the audit's ``--sinks`` for streaming).

    Raises:
        OptionError: as :func:`parse_policy_spec`, and the policy's own checks of its settings.
    """
    name, settings = parse_policy_spec(spec)
    return make_policy(name, **{**defaults, **settings})


def split_policy_specs(text: str) -> list[str]:
    """Comma-separated policy specs, the commas inside a spec's parentheses kept:
    ``"streaming,snapkv(window=64,kernel=5),knorm"`` -> ``["streaming", "snapkv(window=64,kernel=5)", "knorm"]``."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    out.append(cur.strip())
    return [x for x in out if x]
