"""An EventMemory whose history grows past the model's context: positions keep growing, the events
past the prefill window are prefilled windowed (eventkv.kv.windowed; StreamingLLM, arXiv 2309.17453),
every stored key is rotated at its event's stored position.

Tiny random models with a 256-token context, float32; the hand check rebuilds every chunk's rows
from public pieces (the stored rows, eventkv.kv.rope.rerotate, one model forward) and compares within
1e-5. smollm2-135m on a 20,000-token history once (``-m integration``).
"""

from __future__ import annotations

import inspect
import json
import time
from pathlib import Path

import pytest
import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.log import TokenizedLog, tokenize
from eventkv.kv.model import model_forward
from eventkv.kv.prefill import prefill
from eventkv.kv.rope import rerotate
from eventkv.kv.rows import cache_from_rows, cache_kv
from eventkv.kv.windowed import PrefillWindow, fits, plan_chunks, windowed_prefill
from eventkv.memory import EventMemory
from eventkv.testing import tiny_lm

CONTEXT = 256
TOL = 1e-5
FAMILIES = ("llama", "gemma3")  # plain RoPE; sliding-window layers with their own local RoPE


def texts(n: int, start: int = 0) -> list[str]:
    return [f"note {i}: register r{i} holds {7 * i % 97}." for i in range(start, start + n)]


@pytest.fixture(scope="module", params=FAMILIES)
def lm(request):
    torch.set_num_threads(1)  # tiny forwards: two threads on two busy cores only wait on each other
    return tiny_lm(request.param, max_context=CONTEXT)


@pytest.fixture(scope="module")
def long_store(lm, tmp_path_factory):
    """A memory of ~3x the context, prefilled in one call; returns its directory and a copy of its rows."""
    d = tmp_path_factory.mktemp("long") / "mem"
    with EventMemory.create(d, lm, namespace="long") as mem:
        mem.add(texts(26))
        assert mem.stats().history_end > 3 * CONTEXT
        mem.prefill()
        ekv = mem._ekv
        return d, ekv


def expected_chunk(lm, ekv, chunk):
    """One chunk's rows as the windowed prefill defines them, from the stored rows: header rows, then
    the window's recent rows re-rotated to follow the header, one forward of the chunk's tokens at the
    positions that continue them, its keys re-rotated to their whole-history positions."""
    h = len(ekv.log.header_ids)
    a, b, c = chunk.row_start, chunk.row_end, chunk.context_row
    pos = ekv.positions
    recent = [k[:, :, c:a] for k in ekv.keys]
    moved = rerotate(lm.model, recent, pos[c:a], pos[c:a] - chunk.shift) if a > c else recent
    keys = [torch.cat([k[:, :, :h], m], dim=2) for k, m in zip(ekv.keys, moved)]
    values = [torch.cat([v[:, :, :h], v[:, :, c:a]], dim=2) for v in ekv.values]
    cache = cache_from_rows(keys, values)
    ids = torch.tensor([ekv.log.input_ids[a:b]])
    with torch.inference_mode():
        model_forward(lm.model, ids, (pos[a:b] - chunk.shift).unsqueeze(0), cache)
    new_k, new_v = cache_kv(cache)
    n = h + (a - c)
    back = rerotate(lm.model, [k[:, :, n:] for k in new_k], pos[a:b] - chunk.shift, pos[a:b])
    return back, [v[:, :, n:] for v in new_v]


def max_diff(xs, ys) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys))


def test_positions_keep_growing_past_the_context(lm, tmp_path):
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        h = len(mem.header_ids)
        added = mem.add(texts(26))
        ends = [a.position + a.width for a in added]
        assert [a.position for a in added] == [h] + ends[:-1]  # one after another, past the context
        assert ends[-1] == mem.stats().history_end > 3 * CONTEXT
        assert mem.get(added[-1].id).position == added[-1].position > CONTEXT


def test_every_chunk_is_the_windowed_computation(lm, long_store):
    """Hand check: the one-pass part equals a one-pass prefill exactly; every chunk past it equals its
    windowed forward rebuilt from the stored rows (<= 1e-5); every chunk's context fits the window and
    starts right after the header."""
    _, ekv = long_store
    window = PrefillWindow.for_context(CONTEXT)
    h = len(ekv.log.header_ids)
    chunks = plan_chunks(ekv.log, window)
    assert len(chunks) >= 8 and chunks[0].first == fits(ekv.log, window)
    n_fit = chunks[0].first
    head = TokenizedLog(ekv.log.header_ids, ekv.log.event_ids[:n_fit], ekv.log.event_tokens[:n_fit])
    one_pass = prefill(lm.model, head)
    r = one_pass.n_rows
    assert all(torch.equal(k[:, :, :r], o) for k, o in zip(ekv.keys, one_pass.keys))
    assert all(torch.equal(v[:, :, :r], o) for v, o in zip(ekv.values, one_pass.values))
    assert ekv.positions.tolist() == ekv.log.position_ids  # every row at its whole-history position
    worst = 0.0
    for chunk in chunks:
        pos = ekv.positions
        assert chunk.context_row > h and int(pos[chunk.context_row]) - chunk.shift == h  # follows the header
        assert int(pos[chunk.row_end - 1]) - chunk.shift < window.size  # the whole forward fits the window
        keys, values = expected_chunk(lm, ekv, chunk)
        a, b = chunk.row_start, chunk.row_end
        worst = max(worst, max_diff([k[:, :, a:b] for k in ekv.keys], keys))
        worst = max(worst, max_diff([v[:, :, a:b] for v in ekv.values], values))
    assert worst <= TOL, worst


def test_windowed_rows_are_not_a_longer_context_rows(lm, long_store):
    """What windowed rows lose: past the one-pass part they are not what one causal pass over the whole
    history computes (the same tiny model, whose RoPE computes any position, run past its context):
    equal up to the first chunk, apart after it (where a row's inputs reach past the window)."""
    _, ekv = long_store
    whole = prefill(lm.model, ekv.log)  # no max_context: one pass over all 3x
    r = plan_chunks(ekv.log, PrefillWindow.for_context(CONTEXT))[0].row_start
    assert (
        max_diff([k[:, :, :r] for k in whole.keys], [k[:, :, :r] for k in ekv.keys]) <= TOL
    )  # a longer pass rounds apart
    apart = max_diff([v[:, :, r:] for v in whole.values], [v[:, :, r:] for v in ekv.values])
    if lm.profile.family == "llama":
        assert apart > 1e-3, apart
    else:  # tiny Gemma 3: its one full-attention layer is the last, so every stored row is computed from the
        # sliding layers' 16-row window, which every prefill window holds: nothing is lost
        assert lm.profile.layer_types[-1] == "full_attention" and apart <= TOL, apart


def test_a_history_that_fits_prefills_as_one_pass(lm, tmp_path):
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add(texts(5))
        assert mem.stats().history_end <= CONTEXT
        mem.prefill()
        ekv = mem._ekv
        fresh = prefill(lm.model, tokenize(mem.event_log(), lm.tokenizer, lm.profile))
        assert fresh.log.input_ids == ekv.log.input_ids
        assert all(torch.equal(a, b) for a, b in zip(ekv.keys + ekv.values, fresh.keys + fresh.values))


def test_chunks_do_not_depend_on_when_prefill_runs(lm, long_store, tmp_path):
    """Events added and prefilled one at a time give the rows of one prefill call (float rounding)."""
    _, ekv = long_store
    with EventMemory.create(tmp_path / "m", lm, namespace="long") as mem:
        for text in texts(26):
            mem.add(text, prefill=True)
        assert mem.stats().segments == 26
        assert max_diff(mem._ekv.keys + mem._ekv.values, ekv.keys + ekv.values) <= TOL


def test_close_and_open_keep_the_rows_and_continue(lm, long_store, tmp_path):
    d, ekv = long_store
    with EventMemory.open(d, lm) as mem:
        back = mem._ekv
        assert back.positions.tolist() == ekv.positions.tolist()
        assert all(torch.equal(a, b) for a, b in zip(back.keys + back.values, ekv.keys + ekv.values))
    # continue a long history after open: the same rows as one memory that never closed
    with EventMemory.create(tmp_path / "a", lm, namespace="t") as a:
        a.add(texts(20), prefill=True)
    with EventMemory.open(tmp_path / "a", lm) as a:
        a.add(texts(6, start=20), prefill=True)
        reopened = a._ekv
    with EventMemory.create(tmp_path / "b", lm, namespace="t") as b:
        b.add(texts(20), prefill=True)
        b.add(texts(6, start=20), prefill=True)
        assert max_diff(reopened.keys + reopened.values, b._ekv.keys + b._ekv.values) == 0.0


def test_a_query_past_the_context_names_the_fix(lm, long_store):
    d, _ = long_store
    with EventMemory.open(d, lm) as mem:
        with pytest.raises(EventKVError, match='positions="contiguous"') as err:
            mem.query("What does r3 hold?", select=["e4"], positions="original", max_new_tokens=2)
        assert f"ends at position {mem.stats().history_end}" in str(err.value)
        # the text mode re-prefills the served events at contiguous positions: it answers
        ans = mem.query("What does r3 hold?", select=["e4"], mode="text", max_new_tokens=2)
        assert ans.served_ids == ["e4"] and len(ans.generation.tokens) <= 2
        # no positions given: the served rows are re-rotated after the header (the default), so they answer too
        rows = mem.query("What does r3 hold?", select=["e4"], max_new_tokens=2)
        assert rows.plan["positions"] == "contiguous" and rows.served_ids == ["e4"]


contiguous_serving = pytest.mark.skipif(
    "positions" not in inspect.signature(EventMemory.query).parameters,
    reason='query(positions="contiguous") comes with eventkv.kv.serve(positions=...)',
)


@contiguous_serving
def test_a_long_history_answers_contiguous(lm, long_store):
    """Served rows of a history past the context, re-rotated to follow the header, answer as the same rows
    served by eventkv.kv.serve(positions="contiguous") (the readout of the served cache, greedy)."""
    from eventkv.kv.readout import answer_served
    from eventkv.kv.serve import serve

    d, ekv = long_store
    with EventMemory.open(d, lm) as mem:
        ids = ["e4", "e25"]  # one from the one-pass part, one from the last chunk
        ans = mem.query("What does r3 hold?", select=ids, max_new_tokens=4, positions="contiguous", keep_logits=True)
        assert ans.served_ids == ids
        q = mem_question(mem, "What does r3 hold?")
        served = serve(ekv, ids, "compact", model=lm.model, positions="contiguous")
        assert served.next_position == len(mem.header_ids) + sum(mem.get(i).n_rows for i in ids) < CONTEXT
        ((gen, _),) = answer_served(
            lm.model,
            lm.tokenizer,
            [served],
            q,
            max_new_tokens=4,
            stop_token_ids=lm.profile.stop_token_ids,
            max_context=CONTEXT,
            keep_logits=True,
        )
        assert gen.tokens == ans.generation.tokens
        assert max_diff(gen.logits, ans.generation.logits) <= 1e-4


def mem_question(mem, question):
    from eventkv.kv.log import tokenize_query

    return tokenize_query(mem.lm.tokenizer, mem.lm.profile, question)


def test_an_event_wider_than_the_window_is_refused(lm, tmp_path):
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        with pytest.raises(EventKVError, match="prefill window .* holds at most"):
            mem.add("x" * (CONTEXT + 10))
        assert mem.stats().events == 0
        window = PrefillWindow.for_context(CONTEXT, size=128, chunk=32)
    with EventMemory.open(tmp_path / "m", lm, window=window) as mem:
        assert mem.window == window
        with pytest.raises(EventKVError, match="128 positions"):
            mem.add("x" * 130)


def test_window_options_are_checked():
    assert PrefillWindow.for_context(256) == PrefillWindow(256, 64)
    with pytest.raises(OptionError, match="window 300"):
        PrefillWindow.for_context(256, size=300)
    with pytest.raises(OptionError, match="window_chunk 128"):
        PrefillWindow.for_context(256, size=128, chunk=128)


def test_forget_on_a_long_history_recomputes_windowed(lm, tmp_path):
    """forget re-prefills the later events: the result equals a fresh windowed prefill of the rest."""
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:
        mem.add(texts(26), prefill=True)
        mem.forget("e3")
        ekv = mem._ekv
        fresh = windowed_prefill(
            lm.model, tokenize(mem.event_log(), lm.tokenizer, lm.profile), PrefillWindow.for_context(CONTEXT)
        )
        assert fresh.log.input_ids == ekv.log.input_ids
        assert max_diff(ekv.keys + ekv.values, fresh.keys + fresh.values) <= TOL


LOCOMO = Path("/work/shared/data/locomo/locomo10-dev.json")


@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_answers_from_a_20k_token_history(tmp_path):
    """smollm2-135m (8,192 positions) keeps a 20,000-token history of synthetic agent events, prefilled
    windowed; a question about an event past its first 8,192 positions is refused at the original
    positions and answered from the served rows (contiguous) or as text."""
    from eventkv.models import load

    lm = load("smollm2-135m")
    needle = "The vault code for project Heron is 4417."
    events = [
        f"step {i}: agent ran tool {['search', 'shell', 'read', 'write'][i % 4]} on file src/mod{i % 37}.py; "
        f"it returned {i * 13 % 101} lines and status ok."
        for i in range(670)
    ]
    events[650] = needle  # past the first 8,192 positions: its rows come from a windowed chunk
    with EventMemory.create(tmp_path / "mem", lm, namespace="agent") as mem:
        mem.add(events)
        end = mem.stats().history_end
        assert end > 20_000 > lm.profile.max_context
        t0 = time.perf_counter()
        rows = mem.prefill()
        seconds = time.perf_counter() - t0
        chunks = plan_chunks(mem._ekv.log, mem.window)
        print(json.dumps({"history_end": end, "rows": rows, "chunks": len(chunks), "prefill_s": round(seconds, 1)}))
        question = "What is the vault code for project Heron?"
        with pytest.raises(EventKVError, match='positions="contiguous"'):
            mem.query(question, select=["e651"], max_new_tokens=8, positions="original")
        t0 = time.perf_counter()
        ans = mem.query(question, select=["e651"], mode="text", max_new_tokens=16)
        text_s = time.perf_counter() - t0
        assert "4417" in ans.text, ans.text
        measured = {"text_answer": ans.text, "text_query_s": round(text_s, 1)}
        if "positions" in inspect.signature(EventMemory.query).parameters:
            t0 = time.perf_counter()
            rows = mem.query(question, select=["e651"], max_new_tokens=16, positions="contiguous")
            measured |= {"contiguous_answer": rows.text, "contiguous_query_s": round(time.perf_counter() - t0, 1)}
            assert "4417" in rows.text, rows.text
        print(json.dumps(measured))
