"""Served caches of a tiny model whose output layer is scaled by 30 (clear top-two margins, so greedy answers
compared across batch shapes and forwards of several tokens pick the same tokens): shared by the readout
tests that read several served caches at once."""

from __future__ import annotations

from typing import Sequence

import torch

from eventkv.kv.log import Event, EventLog, TokenizedLog, tokenize, tokenize_query
from eventkv.kv.prefill import prefill
from eventkv.kv.serve import ServedCache, serve
from eventkv.testing import tiny_lm

EVENTS = [Event("a", "register A set to ON"), Event("b", "register B mirrors A"), Event("c", "register C is OFF")]
QUESTION = "What is register A?"


def sharp_served(
    family: str, plans: Sequence[tuple[list[str] | str, str]]
) -> tuple[object, TokenizedLog, list[ServedCache], list[int]]:
    """A tiny ``family`` model with its output layer scaled by 30, :data:`EVENTS` prefilled, one served cache
    per ``(served, mode)`` plan and the question's token ids: ``(lm, log, caches, query)``."""
    lm = tiny_lm(family)
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(30.0)
    log = tokenize(EventLog(EVENTS), lm.tokenizer, lm.profile)
    ekv = prefill(lm.model, log)
    caches = [serve(ekv, served, mode) for served, mode in plans]
    return lm, log, caches, tokenize_query(lm.tokenizer, lm.profile, QUESTION)
