"""Named members of an extension point: one :class:`Registry` per kind (probe, eviction policy, sweep
backend, dialogue format, carrier kind), each member listed once under its name.

A member is listed in one of three ways:

* a lazy ``"module:attr"`` spec (:meth:`Registry.add`, or the ``members`` mapping): :meth:`Registry.names`
  lists it without importing its module, so the CLI's ``--help`` stays free of torch; the module is
  imported on the first :meth:`Registry.get` of that name;
* an object registered in-process (:meth:`Registry.register`, a decorator, or :meth:`Registry.put`);
* an entry point of an ``importlib.metadata`` group (``entry_points=``), declared by eventkv's own
  ``pyproject.toml`` or by a third-party package: ``name = "module:attr"``.

An unknown name is a user error: :meth:`Registry.get` raises :class:`~eventkv.errors.OptionError` when
the registry stands for an option (``field=``; the CLI names its flag), else
:class:`~eventkv.errors.EventKVError`, and the message names the bad value and lists the known ones:

    >>> colours = Registry("colour", {"red": "builtins:str"}, field="colour")
    >>> colours.names()
    ('red',)
    >>> colours.get("blue")
    Traceback (most recent call last):
    eventkv.errors.OptionError: colour 'blue': use one of red.
"""

from __future__ import annotations

import importlib
from typing import Callable, Generic, Iterator, Mapping, TypeVar

from eventkv.errors import EventKVError, OptionError

T = TypeVar("T")


def one_of(names: tuple[str, ...]) -> str:
    """The default fix of an unknown name: ``use one of a, b, c.``"""
    return f"use one of {', '.join(names)}."


class Registry(Generic[T]):
    """The members of one extension point, by name, in the order they were listed (entry points last).

    Args:
        kind: what a member is, in messages (``"eviction policy"``).
        members: lazy members, ``{name: "module:attr"}``.
        help: one line per member name, for the CLI's lists of choices (:meth:`help`).
        field: the option an unknown name is a bad value of (:class:`OptionError` with this field);
            None: an unknown name raises :class:`EventKVError` ``unknown KIND 'NAME': ...``.
        flag: the CLI flag of ``field`` (default ``--`` + the field with dashes).
        allowed: the fix of an unknown name from the known names (default :func:`one_of`).
        entry_points: an ``importlib.metadata`` entry-point group whose entries are members too.
        check: called as ``check(name, obj)`` on every member when it is first resolved; raises
            EventKVError on an object that is no valid member.

    Raises:
        ValueError: (at listing time) a name listed twice with two different members — a programming
            error, not a user's.
    """

    def __init__(
        self,
        kind: str,
        members: Mapping[str, str] | None = None,
        *,
        help: Mapping[str, str] | None = None,
        field: str | None = None,
        flag: str | None = None,
        allowed: Callable[[tuple[str, ...]], str] = one_of,
        entry_points: str | None = None,
        check: Callable[[str, object], None] | None = None,
    ) -> None:
        self.kind, self.field, self.flag, self.allowed = kind, field, flag, allowed
        self.entry_points, self._check = entry_points, check
        self._specs: dict[str, str] = {}
        self._loaded: dict[str, T] = {}
        self._help: dict[str, str] = {}
        for name, spec in (members or {}).items():
            self.add(name, spec, (help or {}).get(name, ""))

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self.names())})"

    # ---------------------------------------------------------------- listing
    def add(self, name: str, spec: str, help: str = "") -> None:
        """List the member ``name`` as a lazy ``"module:attr"`` spec (imported on its first :meth:`get`)."""
        module, _, attr = spec.partition(":")
        if not module or not attr:
            raise ValueError(f"{self.kind} {name!r}: spec {spec!r} is not 'module:attr'")
        if self._specs.get(name, spec) != spec or name in self._loaded:
            raise ValueError(f"{self.kind} name {name!r} is already registered")
        self._specs[name] = spec
        if help:
            self._help[name] = help

    def put(self, name: str, obj: T) -> T:
        """List ``obj`` as the member ``name`` (again with the same object: nothing changes); returns it."""
        if not name:
            raise ValueError(f"{obj!r} has no {self.kind} name")
        if self._loaded.get(name, obj) is not obj or (name in self._specs and not self._is_spec_of(name, obj)):
            raise ValueError(f"{self.kind} name {name!r} is already registered")
        self._loaded[name] = obj
        return obj

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: list the decorated object as the member ``name``."""
        return lambda obj: self.put(name, obj)

    def _is_spec_of(self, name: str, obj) -> bool:
        module, _, attr = self._specs[name].partition(":")
        return getattr(obj, "__module__", None) == module and getattr(obj, "__qualname__", None) == attr

    def _declared(self) -> dict:
        """The entry points of the group, by name (none without a group)."""
        if self.entry_points is None:
            return {}
        from importlib.metadata import entry_points

        return {ep.name: ep for ep in entry_points(group=self.entry_points)}

    def names(self) -> tuple[str, ...]:
        """Every member's name, imported or not: listed and registered ones in order, then entry points."""
        out = dict.fromkeys([*self._specs, *self._loaded])
        out.update(dict.fromkeys(self._declared()))
        return tuple(out)

    def help(self, name: str) -> str:
        """The one line given for ``name`` (``""`` if none)."""
        return self._help.get(name, "")

    # ---------------------------------------------------------------- resolving
    def get(self, name: str) -> T:
        """The member called ``name``, importing it on first use.

        Raises:
            OptionError: an unknown name, when the registry stands for an option (``field``).
            EventKVError: an unknown name otherwise; a member that fails the registry's ``check``.
        """
        if isinstance(name, str) and name in self._loaded:
            return self._loaded[name]
        if isinstance(name, str) and name in self._specs:
            module, _, attr = self._specs[name].partition(":")
            obj = getattr(importlib.import_module(module), attr)
        else:
            declared = self._declared() if isinstance(name, str) else {}
            if name not in declared:
                raise self.unknown(name)
            obj = declared[name].load()
        if self._check is not None:
            self._check(name, obj)
        self._loaded[name] = obj
        return obj

    def unknown(self, name) -> EventKVError:
        """The error for a name that is no member (names the value and lists the known names)."""
        fix = self.allowed(self.names())
        if self.field is not None:
            return OptionError(self.field, name, fix, self.flag)
        return EventKVError(f"unknown {self.kind} {name!r}: {fix}")

    def load_all(self) -> dict[str, T]:
        """Every member, imported, by name."""
        return {name: self.get(name) for name in self.names()}

    # ---------------------------------------------------------------- a read-only mapping of names
    def __contains__(self, name) -> bool:
        return isinstance(name, str) and name in self.names()

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def __getitem__(self, name: str) -> T:
        return self.get(name)

    def keys(self) -> tuple[str, ...]:
        return self.names()

    def values(self) -> list[T]:
        return list(self.load_all().values())

    def items(self) -> list[tuple[str, T]]:
        return list(self.load_all().items())
