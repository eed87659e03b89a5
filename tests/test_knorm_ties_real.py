"""Knorm's tie rule on real weights (smollm2-135m, float32): key norms within 8 float32 ulps of a neighbour
occur in every layer, not only in layer 0, and between rows of different token ids; the rule makes each
chain one score and keeps its later positions, wherever the kept count cuts a chain."""

from __future__ import annotations

import pytest
import torch

from eventkv.eviction import Knorm, keep_mask
from eventkv.eviction.capture import capture_prefill
from eventkv.kv.log import Event, EventLog, tokenize

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SENTENCES = (
    "The lighthouse keeper logged the tide at dawn.",
    "A gull landed on the rail and watched the boats.",
    "Fog rolled in from the north before noon.",
    "The keeper wound the clock and trimmed the wick.",
)


@pytest.fixture(scope="module")
def captured():
    from eventkv.models import load

    lm = load("smollm2-135m", dtype="float32")
    events = [Event(f"e{i}", f"{SENTENCES[i % 4]} Entry {i}.") for i in range(24)]
    log = tokenize(EventLog(events, instruction="Logbook of the north light."), lm.tokenizer, lm.profile)
    _, caps = capture_prefill(lm.model, log, window=8)
    return torch.tensor(list(log.input_ids)), caps


def chains(norms: torch.Tensor):
    """Per head, the runs of sorted norms whose neighbours are within Knorm's tolerance: (head, rows) pairs."""
    v, order = torch.sort(norms, dim=-1)
    close = (v[:, 1:] - v[:, :-1]) <= Knorm.TIE_RTOL * v[:, 1:]
    for h in range(norms.shape[0]):
        run = [0]
        for j in range(1, norms.shape[1]):
            if close[h, j - 1]:
                run.append(j)
                continue
            if len(run) > 1:
                yield h, order[h, run]
            run = [j]
        if len(run) > 1:
            yield h, order[h, run]


def test_ties_occur_above_layer_0_and_across_token_ids(captured):
    ids, caps = captured
    groups = [(c.layer, rows) for c in caps for _, rows in chains(c.keys.double().norm(dim=-1))]
    assert len(groups) > 50
    assert any(layer > 0 for layer, _ in groups)
    assert any(len(set(ids[rows].tolist())) > 1 for _, rows in groups)


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.9])
def test_a_cut_chain_keeps_its_later_positions(captured, ratio):
    _, caps = captured
    cut = 0
    for c in caps:
        mask = keep_mask(Knorm(), c, ratio)
        for h, rows in chains(c.keys.double().norm(dim=-1)):
            kept = mask[h, rows]
            if kept.any() and not kept.all():
                cut += 1
                pos = c.positions[rows]
                assert pos[kept].min() > pos[~kept].max(), (c.layer, h, pos.tolist(), kept.tolist())
    assert cut > 0  # the rule is exercised: some chain straddles the kept count
