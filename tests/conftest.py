"""Fixtures shared by several test files."""

from __future__ import annotations

import json

import pytest


@pytest.fixture()
def jsonl(tmp_path):
    """An event log of three events ``a``, ``b``, ``c`` (texts ``event a`` ...)."""
    p = tmp_path / "events.jsonl"
    p.write_text("\n".join(json.dumps({"id": i, "text": f"event {i}"}) for i in ("a", "b", "c")) + "\n")
    return p
