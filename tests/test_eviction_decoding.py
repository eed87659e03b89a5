"""Compression during decoding (eventkv.eviction.decoding, kvpress's DecodingPress) on tiny random models: no cut
is the plain decode, a cut keeps each KV head's best rows by the policy (by hand), the schedule's counts, and the
refusals."""

from __future__ import annotations

import pytest
import torch

from eventkv.errors import EventKVError, OptionError
from eventkv.eviction import ExpectedAttention, Knorm, SnapKV, StreamingLLM
from eventkv.eviction.budgets import AdaKV
from eventkv.eviction.decoding import DecodingCompression, decode_compressed
from eventkv.eviction.policies import top_rows
from eventkv.eviction.scorers import Finch, ObservedAttention
from eventkv.kv.model import model_forward
from eventkv.testing import tiny_model

PROMPT = [(7 * i + 3) % 90 + 5 for i in range(40)]
FORCED = [(11 * i + 2) % 90 + 5 for i in range(20)]


def _plain(model, prompt, forced):
    """The next-token logits before each forced token, one plain forward a step (no capture, no cut)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    n = len(prompt)
    out = model_forward(model, torch.tensor([prompt]), torch.arange(n)[None], cache, logits_to_keep=1)
    logits = []
    for i, t in enumerate(forced):
        logits.append(out[0, -1])
        out = model_forward(model, torch.tensor([[t]]), torch.tensor([[n + i]]), cache, logits_to_keep=1)
    return torch.stack(logits)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_without_a_cut_the_decode_is_the_plain_one(family):
    model = tiny_model(family)
    run = decode_compressed(model, PROMPT, DecodingCompression(Knorm(), interval=100, target_rows=8), forced=FORCED)
    assert run.cuts == 0 and run.tokens == FORCED
    torch.testing.assert_close(run.logits, _plain(model, PROMPT, FORCED), atol=1e-5, rtol=0)
    assert all(p.tolist() == [list(range(60))] * p.shape[0] for p in run.positions)
    greedy = decode_compressed(model, PROMPT, DecodingCompression(Knorm(), interval=100), max_new_tokens=5)
    assert greedy.tokens == greedy.logits.argmax(dim=-1).tolist() and len(greedy.tokens) == 5


def test_a_cut_keeps_each_heads_best_rows_by_the_policy():
    model = tiny_model("llama")
    # one cut, after the 8th forced token's forward: 48 rows (40 prompt + 8) cut to 24 per KV head by the key norm
    run = decode_compressed(model, PROMPT, DecodingCompression(Knorm(), interval=8, target_rows=24), forced=FORCED[:10])
    assert run.cuts == 1
    from transformers import DynamicCache

    from eventkv.eviction.policies import LayerCapture
    from eventkv.kv.rows import cache_kv

    cache = DynamicCache()
    ids = PROMPT + FORCED[:8]
    model_forward(model, torch.tensor([ids]), torch.arange(48)[None], cache, logits_to_keep=1)
    for layer, k in enumerate(cache_kv(cache)[0]):
        c = LayerCapture(layer, k[0], k[0], torch.arange(48))
        want = [torch.nonzero(m).flatten().tolist() + [48, 49] for m in top_rows(Knorm().scores(c), c.positions, 24)]
        assert run.positions[layer].tolist() == want, f"layer {layer}"  # then the 9th and 10th tokens' rows
    # the logits before the 10th token come from the cut cache (the 9th token's forward): not the plain decode's;
    # those before the 9th, from the last step before the cut, are
    plain = _plain(model, PROMPT, FORCED[:10])
    torch.testing.assert_close(run.logits[:9], plain[:9], atol=1e-5, rtol=0)
    assert not torch.allclose(run.logits[9], plain[9], atol=1e-3)


def test_the_schedule_cuts_every_interval_and_heads_keep_their_own_rows():
    model = tiny_model("qwen2")
    run = decode_compressed(model, PROMPT, DecodingCompression(Knorm(), interval=8, target_rows=30), forced=FORCED)
    # 48 rows -> 30 after step 8; 38 -> 30 after step 16; then 4 more steps: 34 rows per head
    assert run.cuts == 2 and all(p.shape[1] == 34 for p in run.positions)
    for p in run.positions:
        assert bool((p[:, 1:] > p[:, :-1]).all())  # ascending in every head
        assert p[:, -4:].tolist() == [[56, 57, 58, 59]] * p.shape[0]  # the steps after the last cut
    assert any(not torch.equal(p[0], p[1]) for p in run.positions)  # heads keep rows of their own
    # StreamingLLM: the sinks and the latest rows, in every head
    s = decode_compressed(model, PROMPT, DecodingCompression(StreamingLLM(sinks=4), 8, 30), forced=FORCED)
    assert all(p.tolist() == [[0, 1, 2, 3, *range(30, 60)]] * p.shape[0] for p in s.positions)
    # SnapKV scores from the buffered steps' queries: its window must fit the steps between cuts
    snap = decode_compressed(model, PROMPT, DecodingCompression(SnapKV(window=4), 8, 30), forced=FORCED)
    assert snap.cuts == 2 and all(p.shape[1] == 34 for p in snap.positions)
    with pytest.raises(OptionError, match=r"its window of 16 queries is longer than the 8 steps a cut sees"):
        DecodingCompression(SnapKV(window=16), 8, 30)
    with pytest.raises(OptionError, match=r"\(interval 32, buffer 4\): give interval and buffer of 8 or more"):
        DecodingCompression(SnapKV(window=8), 32, 30, buffer=4)
    # Finch without chunks is a scoring policy; the question's window is the buffered steps' queries
    fin = decode_compressed(model, PROMPT, DecodingCompression(Finch(window=4), 8, 30), forced=FORCED)
    assert fin.cuts == 2 and all(p.shape[1] == 34 for p in fin.positions)
    # expected attention rotates queries by RoPE frequencies a decode step does not capture: refused at the cut
    with pytest.raises(OptionError, match="cannot score from what a decode step captures"):
        decode_compressed(model, PROMPT, DecodingCompression(ExpectedAttention(), 8, 30), forced=FORCED)


def test_bad_input_is_named():
    with pytest.raises(OptionError, match="policy 'adakv': it chooses rows by a rule of its own"):
        DecodingCompression(AdaKV())
    with pytest.raises(OptionError, match="policy 'finch': it chooses rows by a rule of its own"):
        DecodingCompression(Finch(chunk=100))
    with pytest.raises(OptionError, match="policy 'observed': it reads every prefill query"):
        DecodingCompression(ObservedAttention())
    with pytest.raises(OptionError, match="policy 'knorm'"):
        DecodingCompression("knorm")  # type: ignore[arg-type]
    for field in ("interval", "target_rows", "buffer"):
        with pytest.raises(OptionError, match=f"{field} 0"):
            DecodingCompression(Knorm(), **{field: 0})
    with pytest.raises(EventKVError, match="empty prompt"):
        decode_compressed(tiny_model("llama"), [], DecodingCompression(Knorm()))
    with pytest.raises(EventKVError, match="sliding window"):
        decode_compressed(tiny_model("gemma3"), PROMPT, DecodingCompression(Knorm()))
    with pytest.raises(OptionError, match="max_new_tokens 0"):
        decode_compressed(tiny_model("llama"), PROMPT, DecodingCompression(Knorm()), max_new_tokens=0)
