"""Running the ``eventkv`` command line inside a test (shared by the CLI error tests)."""

from __future__ import annotations

import sys

import pytest

from eventkv.cli import main


def run_cli(monkeypatch, capsys, *args: str) -> tuple[int | None, str, str]:
    """Run ``eventkv ARGS`` through its real entry point (so EventKVError becomes exit 2) and return
    ``(exit code, stdout, stderr)``."""
    monkeypatch.setattr(sys, "argv", ["eventkv", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err
