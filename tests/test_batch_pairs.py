"""Pairs batched across items: :func:`eventkv.kv.batched.prefill_batch` equals the
one-at-a-time prefill, :func:`eventkv.kv.readout.read_out` takes one query per cache, and a pair probe's
``run_batch`` (``--batch-pairs N``) writes the records of ``run_item`` up to float rounding — the
same greedy texts, answers and outcomes, candidate log-probs and d within TOL — on tiny Llama, Qwen2
and Gemma 3 (sliding window of 16 rows, shorter than a history, so padding that moved a window
would show) in float32."""

from __future__ import annotations

import pytest
import torch
from probe_fixtures import tiny_runtime
from tiers import slow_except

from eventkv.errors import EventKVError
from eventkv.kv.batched import prefill_batch
from eventkv.kv.log import tokenize_query
from eventkv.kv.readout import read_out
from eventkv.kv.serve import serve
from eventkv.studies.materialization.donor_pair import DonorPair
from eventkv.studies.materialization.pairs import PrefillCache, leading_log, tokenize_pair

FAMILIES = ["llama", "qwen2", "gemma3"]
#: float32 on CPU: batched matmuls at other shapes round differently; measured differences here are ~1e-6
TOL = 1e-4
ROW_TOL = 1e-5


def _close(a, b, path="record"):
    """Records equal except floats, which agree within TOL."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), path
        assert abs(a - b) <= TOL, f"{path}: {a} vs {b}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            _close(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} vs {b!r}"


@pytest.mark.parametrize("family", slow_except(FAMILIES, "llama"))
def test_prefill_batch_equals_one_at_a_time(family):
    rt = tiny_runtime(family)
    probe = DonorPair()
    jobs, want = [], []
    for item in probe.items(5, [0, 1, 2]):
        logs = tokenize_pair(rt, probe.instruction, item["events"])
        header = rt.header_kv(probe.instruction)
        for log in logs:  # logs of different lengths, from the header's rows
            jobs.append((log, header))
            want.append(rt.prefill(log, prefix=header))
    # and one log from scratch (no prefix) beside them
    jobs.append((jobs[0][0], None))
    want.append(rt.prefill(jobs[0][0]))
    got = prefill_batch(rt.model, jobs, max_context=rt.max_context, weights_digest=rt.weights_digest)
    for g, w in zip(got, want):
        assert g.log is w.log and torch.equal(g.positions, w.positions)
        for layer in range(w.n_layers):
            assert g.keys[layer].shape == w.keys[layer].shape
            torch.testing.assert_close(g.keys[layer], w.keys[layer], atol=ROW_TOL, rtol=0)
            torch.testing.assert_close(g.values[layer], w.values[layer], atol=ROW_TOL, rtol=0)


def test_prefill_batch_refuses_bad_jobs():
    rt = tiny_runtime("llama")
    probe = DonorPair()
    a, b = tokenize_pair(rt, probe.instruction, probe.items(0, [0])[0]["events"])
    with pytest.raises(EventKVError, match="no logs"):
        prefill_batch(rt.model, [])
    ekv_a = rt.prefill(a)
    with pytest.raises(EventKVError, match="log 1: the prefix"):
        prefill_batch(rt.model, [(a, None), (b, ekv_a)])  # A's rows are no prefix of B's log
    # a prefix that already holds every row computes nothing: the prefix's rows, as prefill() gives them
    got = prefill_batch(rt.model, [(b, None), (a, ekv_a)])
    assert got[1].n_rows == ekv_a.n_rows and all(torch.equal(x, y) for x, y in zip(got[1].keys, ekv_a.keys))
    assert prefill_batch(rt.model, [(a, ekv_a), (a, ekv_a)])[0].n_rows == a.n_rows


@pytest.mark.parametrize("family", slow_except(FAMILIES, "llama"))
def test_read_out_with_one_query_per_cache(family):
    rt = tiny_runtime(family)
    probe = DonorPair()
    items = probe.items(1, range(6))
    served, queries = [], []
    for item in items:
        log = tokenize_pair(rt, probe.instruction, item["events"])[0]
        ekv = PrefillCache(rt, probe.instruction).prefill(log)
        served.append(serve(ekv, ["e00", "e13"], "compact"))
        queries.append(tokenize_query(rt.tokenizer, rt.profile, item["question"]))
    n = len(queries[0])
    same = [k for k, q in enumerate(queries) if len(q) == n]
    assert len(same) >= 2 and len({tuple(queries[k]) for k in same}) >= 2  # different questions, one length
    cands = [rt.encode(" " + s) for s in probe.states]
    kw = dict(
        candidates=cands,
        candidate_texts=list(probe.states),
        answer_prefix_ids=rt.encode("Answer:"),
        max_new_tokens=4,
        tokenizer=rt.tokenizer,
    )

    def flags(n):
        return {"generate": [True] * n, "score": [True] * n}

    together = read_out(rt.model, [served[k] for k in same], [queries[k] for k in same], **flags(len(same)), **kw)
    for k, r in zip(same, together):
        one = read_out(rt.model, [served[k]], queries[k], **flags(1), **kw)[0]
        assert r.generation.tokens == one.generation.tokens
        for c, d in zip(r.candidates, one.candidates):
            assert abs(c.logprob - d.logprob) <= TOL
    other = next((k for k, q in enumerate(queries) if len(q) != n), None)
    if other is not None:
        with pytest.raises(EventKVError, match="lengths"):
            read_out(rt.model, [served[0], served[other]], [queries[0], queries[other]], **flags(2), **kw)
    with pytest.raises(EventKVError, match="2 served caches but 1 queries"):
        read_out(rt.model, served[:2], [queries[0]], **flags(2), **kw)


@pytest.mark.parametrize("family", slow_except(FAMILIES, "llama"))
@pytest.mark.parametrize(
    "arms", [("kv", "isolated"), pytest.param(("kv", "isolated", "text-all", "kv-all"), marks=pytest.mark.slow)]
)
def test_donor_pair_batch_n_equals_batch_1(family, arms):
    rt = tiny_runtime(family)
    probe = DonorPair(arm_names=arms, readout="both", max_new_tokens=3)
    items = probe.items(2, range(5))
    one = [probe.run_item(rt, it) for it in items]
    many = probe.run_batch(rt, items)
    assert [r["index"] for r in many] == [it["index"] for it in items]
    for a, b in zip(one, many):
        _close(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["trigger-bank", "landing", "access", "carriers", "patch"])
def test_every_contract_probe_batches_too(name):
    """The contract probes: several histories per item, swapped rows, fixed query positions, patches
    (whose histories continue each other's rows), timing left out of the records."""
    from eventkv.probes.base import get_probe

    cls = get_probe(name)
    assert cls.batches_items
    rt = tiny_runtime("qwen2")
    probe = cls(**cls.smoke_options)
    items = probe.items(0, range(3))
    one = [probe.run_item(rt, it) for it in items]
    _close(_untimed(one), _untimed(probe.run_batch(rt, items)))


def _untimed(records):
    """Records without wall-clock fields (the patch probe times its updates)."""
    if isinstance(records, list):
        return [_untimed(r) for r in records]
    if isinstance(records, dict):
        return {k: _untimed(v) for k, v in records.items() if "seconds" not in k and "timing" not in k}
    return records


def test_batch_of_one_is_run_item_bit_for_bit():
    rt = tiny_runtime("gemma3")
    probe = DonorPair(arm_names=("kv", "isolated"), max_new_tokens=3)
    item = probe.items(4, [0])[0]
    assert probe.run_batch(rt, [item]) == [probe.run_item(rt, item)]


@pytest.mark.slow
def test_runner_batches_and_records_it(tmp_path):
    """``run_probe(batch=3)`` writes the records of batch 1 (within TOL), in index order, resumes a
    cut run, and records ``batch_pairs`` with the invocation."""
    from eventkv.probes.runner import RUN_MANIFEST, load_records, run_probe

    rt = tiny_runtime("llama")
    probe = DonorPair(arm_names=("kv", "isolated"), readout="both", max_new_tokens=3)

    def run(out, items, batch):
        return run_probe(
            probe, rt, model="tiny", items=items, seed=7, out=out, progress=False, figure=False, batch=batch
        )

    run(tmp_path / "one", 5, 1)
    run(tmp_path / "many", 2, 3)  # a first invocation stops after 2 items
    run(tmp_path / "many", 5, 3)  # resumed: items 2..4 in one batch
    one, many = load_records(tmp_path / "one"), load_records(tmp_path / "many")
    assert [r["index"] for r in many] == [0, 1, 2, 3, 4]
    _close(one, many)
    import json

    invocations = json.loads((tmp_path / "many" / RUN_MANIFEST).read_text())["invocations"]
    assert [(x["items_computed"], x["batch_pairs"]) for x in invocations] == [(2, 3), (3, 3)]
    assert all("device" in x and "device_reason" in x for x in invocations)


def test_batch_pairs_is_refused_for_a_probe_that_does_not_batch():
    from eventkv.errors import OptionError
    from eventkv.probes.base import get_probe
    from eventkv.probes.run_options import RunOptions

    splice = get_probe("splice")()
    assert not splice.batches_items and DonorPair.batches_items
    with pytest.raises(OptionError, match="batch_pairs 2: probe 'splice' computes its items one at a time"):
        RunOptions("m", 2, batch_pairs=2, device="cpu").validate(splice)
    RunOptions("m", 2, batch_pairs=2, device="cpu").validate(DonorPair())


@pytest.mark.parametrize("family", FAMILIES)
def test_encode_alone_equals_serving_each_event_alone(family):
    from eventkv.kv.batched import encode_alone

    rt = tiny_runtime(family)
    probe = DonorPair()
    log = tokenize_pair(rt, probe.instruction, probe.items(0, [0])[0]["events"])[0]
    ekv = PrefillCache(rt, probe.instruction).prefill(log)
    ids = ["e00", "e05", "e13"]
    want = serve(ekv, ids, "isolated", model=rt.model)
    events = [(log.event_tokens[log.event_ids.index(e)], log.span(e).pos_start) for e in ids]
    rows = encode_alone(rt.model, rt.header_kv(probe.instruction), events)
    memo = {(e, p, tuple(t)): r for e, (t, p), r in zip(ids, events, rows)}
    got = serve(ekv, ids, "isolated", model=rt.model, isolated_memo=memo)
    assert torch.equal(got.positions, want.positions)
    for a, b in zip(got.keys + got.values, want.keys + want.values):
        torch.testing.assert_close(a, b, atol=ROW_TOL, rtol=0)
    with pytest.raises(EventKVError, match="at least one event"):
        encode_alone(rt.model, rt.header_kv(probe.instruction), [])


def test_decode_padding_only_where_mkl_sgemm_has_its_step():
    from eventkv.kv.readout import decode_padding

    cpu = torch.device("cpu")
    # float32 on torch's kernel: 2 and 3 sequences decode as 4, others as they are
    assert [decode_padding(n, cpu) for n in (1, 2, 3, 4, 8)] == [0, 2, 1, 0, 0]
    assert [decode_padding(n, cpu, "onednn") for n in (2, 3)] == [0, 0]  # oneDNN has no such step
    assert [decode_padding(n, cpu, "torch", torch.bfloat16) for n in (2, 3)] == [0, 0]  # bf16 runs on oneDNN
    assert decode_padding(2, torch.device("meta")) == 0  # not a CPU: never padded


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_packed_equals_prefill_batch_and_encode_alone(family):
    """Events packed into a prefill's rows under a 4D mask: the jobs' rows are prefill_batch's and each
    event's rows encode_alone's, within ROW_TOL; on Gemma 3 the histories pass its 16-row window, so a
    packed event's window counted in the batch's rows rather than its own encoding's would show."""
    from eventkv.kv.batched import encode_alone, prefill_packed

    rt = tiny_runtime(family)
    probe = DonorPair()
    header = rt.header_kv(probe.instruction)
    a, b = tokenize_pair(rt, probe.instruction, probe.items(3, [0])[0]["events"])
    short = PrefillCache(rt, probe.instruction).prefill(leading_log(a, 4))
    jobs = [(a, header), (leading_log(b, 9), short), (leading_log(a, 4), short)]  # the last computes nothing
    events = [(a.event_tokens[i], a.span(a.event_ids[i]).pos_start) for i in (13, 0, 20, 5)]
    alone = [(0, events[0][0], events[0][1]), (1, events[1][0], events[1][1]), (1, *events[2]), (2, *events[3])]
    got, isolated = prefill_packed(rt.model, jobs, alone, max_context=rt.max_context)
    want = prefill_batch(rt.model, jobs[:2], max_context=rt.max_context) + [short]
    for g, w in zip(got, want):
        assert g.n_rows == w.n_rows and torch.equal(g.positions, w.positions)
        for x, y in zip(g.keys + g.values, w.keys + w.values):
            torch.testing.assert_close(x, y, atol=ROW_TOL, rtol=0)
    for (gk, gv, gp), (wk, wv, wp) in zip(isolated, encode_alone(rt.model, header, events)):
        assert torch.equal(gp, wp)
        for x, y in zip(gk + gv, wk + wv):
            torch.testing.assert_close(x, y, atol=ROW_TOL, rtol=0)
    assert prefill_packed(rt.model, jobs[:1], [])[1] == []
    with pytest.raises(EventKVError, match="event 0 to encode alone names job 3 of 3"):
        prefill_packed(rt.model, jobs, [(3, events[0][0], 5)])


def test_isolated_events_without_a_4d_mask_take_a_forward_of_their_own(monkeypatch):
    """For a model that takes no 4D mask the engine encodes the isolated events in a forward of their own
    (encode_isolated), not packed into a prefill round: the records are the packed run's up to float rounding."""
    import eventkv.studies.materialization.pairs.engine as engine

    rt = tiny_runtime("llama")
    probe = DonorPair(max_new_tokens=4)
    items = probe.items(0, [0, 1])
    packed = probe.run_batch(rt, items)
    monkeypatch.setattr(engine, "takes_4d_masks", lambda model: False)
    calls = []
    own = engine.encode_isolated
    monkeypatch.setattr(engine, "encode_isolated", lambda *a: calls.append(len(a[2])) or own(*a))
    _close(probe.run_batch(rt, items), packed)
    assert calls == [2]  # each item's root (its decoy comes first in its history: the prefill's own rows)
