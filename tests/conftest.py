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


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama and its tokenizer saved as a local model directory (the CLI's --model)."""
    from eventkv.testing import tiny_model, tiny_tokenizer

    d = tmp_path_factory.mktemp("tiny")
    tiny_model("llama").save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d
