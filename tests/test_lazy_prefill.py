"""Lazy prefill in the pair engine: a history is prefilled up to the last event a
subset-serving arm reads and continued only when an arm reads everything, so an arm's answers are
byte-identical whether or not another arm asked for the whole history (float32, tiny models), and
the subset-only run computes fewer prefill tokens."""

from __future__ import annotations

import pytest
from probe_fixtures import tiny_runtime
from tiers import slow_except

from eventkv.studies.materialization.donor_pair import DonorPair
from eventkv.studies.materialization.pairs import PairArm, events_read, tokenize_pair


def _count_tokens(model):
    seen = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            seen.append(int(ids.shape[-1]))

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


class WholeDonorPair(DonorPair):
    prefill_whole = True  # the same arms, every history prefilled to its end


@pytest.mark.parametrize("family", slow_except(["llama", "qwen2", "gemma3"], "gemma3"))
def test_lazy_records_equal_the_whole_prefill_for_the_same_arms(family):
    rt = tiny_runtime(family)
    opts = {"arm_names": ("kv", "isolated"), "readout": "both", "max_new_tokens": 3}
    lazy, whole = DonorPair(**opts), WholeDonorPair(**opts)
    for item in lazy.items(3, [0, 1, 2]):
        seen, h = _count_tokens(rt.model)
        try:
            a = lazy.run_item(rt, item)
            n_lazy = sum(seen)
            seen.clear()
            b = whole.run_item(rt, item)
            n_full = sum(seen)
        finally:
            h.remove()
        assert a == b  # the whole record, bit for bit
        assert n_lazy < n_full  # the lazy run stopped after the root (slot 13 of 24)


def test_events_read():
    rt = tiny_runtime("llama")
    probe = DonorPair()
    item = probe.items(0, [0])[0]
    logs = tokenize_pair(rt, "x", item["events"])
    pair = {"roles": {"main": {"decoy": 0, "root": 13}}}
    kv = PairArm("kv", "main", ("decoy", "root"), "compact")
    text = PairArm("text-all", "main", "all", "prefill")
    assert events_read([kv], pair, logs[0], "main") == (14, False)
    assert events_read([kv, text], pair, logs[0], "main") == (14, True)
    assert events_read([text], pair, logs[0], "main") == (None, True)
