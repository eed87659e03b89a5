"""Names that become paths: memory ids and namespaces. One rule for both, checked
before any path is built, so no request can name a file outside its namespace directory. The rule
is part of the wire (the client and the MCP server check it too): :mod:`eventkv.wire`."""

from __future__ import annotations

from eventkv.wire import MAX_NAME, NAME, NAME_PATTERN, check_name

__all__ = ["MAX_NAME", "NAME", "NAME_PATTERN", "check_name"]
