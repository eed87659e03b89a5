"""The fast tier (``pytest -m "not slow"``, README "Set up and run the tests") keeps one case of a
parametrization whose cases differ by model family; the full suite runs all of them."""

from __future__ import annotations

from collections.abc import Sequence

import pytest


def slow_except(values: Sequence, fast) -> list:
    """``values`` for ``pytest.mark.parametrize`` (or a fixture's ``params``) with every value but ``fast``
    marked ``slow``, ids unchanged: e.g. ``slow_except(TINY_FAMILIES, "gemma3")`` keeps the Gemma 3 case
    (its sliding-window layers) in the fast tier, and the full suite runs every family.
    The faithfulness gates (tests/test_gates.py) run every family in both tiers."""
    assert fast in values, (fast, values)
    return [v if v == fast else pytest.param(v, marks=pytest.mark.slow) for v in values]
