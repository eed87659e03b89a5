"""Names that become paths: memory ids and namespaces. One rule for both, checked
before any path is built, so no request can name a file outside its namespace directory."""

from __future__ import annotations

import re

from eventkv.errors import OptionError

#: a name: 1-64 characters, ASCII letters, digits, ``_`` and ``-``, starting with a letter or digit
#: (no ``.``, ``/``, ``\\``, NUL or spaces: nothing a path could be traversed with)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}")
NAME_PATTERN = "^" + NAME.pattern + "$"
MAX_NAME = 64


def check_name(value: object, what: str = "memory id") -> str:
    """``value`` if it is a valid name (:data:`NAME`), else an error naming it and the rule.

    Raises:
        OptionError: not a string, empty, longer than 64 characters, or a character outside
            ``[A-Za-z0-9_-]`` (or a leading ``_`` / ``-``).
    """
    if not isinstance(value, str) or NAME.fullmatch(value) is None:
        shown = value[:80] if isinstance(value, str) else value
        raise OptionError(
            what,
            shown,
            f"use 1-{MAX_NAME} characters from A-Z, a-z, 0-9, '_' and '-', starting with a letter or digit.",
        )
    return value
