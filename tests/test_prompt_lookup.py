"""Prompt-lookup decoding (:class:`eventkv.kv.decoding.PromptLookup`, ``lookup=`` of the readouts): a
greedy answer that drafts from a source is the answer decoded one token per forward — the same tokens,
every step's logits within 1e-4 (float32) — in fewer forwards where the drafts are right, one sequence
or several in a batch with drafts of different lengths and fates; models with sliding-window layers
decode without drafts. Tiny random models, their output layer sharpened (clear top-two margins)."""

from __future__ import annotations

import pytest
import torch
from served_fixtures import sharp_served

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.decoding import DRAFT_TOKENS, PromptLookup
from eventkv.kv.readout import generate_from, read_out
from eventkv.kv.rows import cache_kv
from eventkv.kv.stacked import Batch
from eventkv.testing import assert_same_greedy, tiny_model

TOL = 1e-4
BUDGET = 24


def sharp(family: str):
    model = tiny_model(family)
    with torch.no_grad():
        model.lm_head.weight.mul_(30.0)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def model(request):
    return sharp(request.param)


def prompts(model, n: int = 2, length: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(5, model.config.vocab_size, (n, length), generator=g)


def decode(model, prompt: torch.Tensor, lookup=None, budget=BUDGET, **kw):
    """Greedy continuations of ``prompt`` ``[batch, t]`` (rows of all but its last token, then
    :func:`generate_from`), and the number of model forwards they took."""
    with torch.no_grad():
        out = model(input_ids=prompt[:, :-1], use_cache=True)
    keys, values = cache_kv(out.past_key_values)
    batch = Batch.of_rows(keys, values, prompt.shape[1] - 1)
    calls = [0]
    hook = model.model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    try:
        gens = generate_from(model, batch, prompt[:, -1:], max_new_tokens=budget, keep_logits=True, lookup=lookup, **kw)
    finally:
        hook.remove()
    return gens, calls[0]


def test_right_drafts_give_the_greedy_answer_in_fewer_forwards(model):
    prompt = prompts(model)
    plain, n_plain = decode(model, prompt)
    assert n_plain == BUDGET  # the prompt's last token, then one forward per token but the last
    # a source holding each answer: every draft is the answer's continuation
    oracle = [prompt[r].tolist() + plain[r].tokens for r in range(2)]
    drafted, n_drafted = decode(model, prompt, lookup=oracle)
    for got, ref in zip(drafted, plain):
        assert_same_greedy(got.tokens, got.logits, ref.tokens, ref.logits, TOL)
    # each forward after the first verifies DRAFT_TOKENS drafts: about BUDGET / (DRAFT_TOKENS + 1) forwards
    assert n_drafted <= BUDGET // (DRAFT_TOKENS + 1) + 2, n_drafted


def test_wrong_drafts_change_nothing_but_the_forwards(model):
    prompt = prompts(model)
    plain, _ = decode(model, prompt)
    # drafts from another prompt's answer: mostly rejected
    other = prompts(model, length=41)[:, 1:]
    other_answers, _ = decode(model, other)
    wrong = [other[r].tolist() + other_answers[r].tokens for r in range(2)]
    drafted, _ = decode(model, prompt, lookup=wrong)
    for got, ref in zip(drafted, plain):
        assert_same_greedy(got.tokens, got.logits, ref.tokens, ref.logits, TOL)


def test_a_batch_mixes_drafting_and_plain_sequences(model):
    prompt = prompts(model, n=3)
    plain, _ = decode(model, prompt)
    lookup = [prompt[0].tolist() + plain[0].tokens, None, prompt[2].tolist()]
    drafted, _ = decode(model, prompt, lookup=lookup, budget=[BUDGET, 9, 17])
    for got, ref, n in zip(drafted, plain, [BUDGET, 9, 17]):
        assert len(got.tokens) == n  # the budget holds: a draft never runs past it
        assert_same_greedy(got.tokens, got.logits, ref.tokens[:n], ref.logits[:n], TOL)


def test_drafts_end_at_a_stop_token_and_at_decided(model):
    prompt = prompts(model, n=1)
    plain, _ = decode(model, prompt)
    stop = plain[0].tokens[10]
    oracle = [prompt[0].tolist() + plain[0].tokens]
    got, _ = decode(model, prompt, lookup=oracle, stop_token_ids=[stop])
    first = plain[0].tokens.index(stop)
    assert got[0].tokens == plain[0].tokens[:first] and got[0].stopped
    decided, _ = decode(model, prompt, lookup=oracle, decided=lambda toks: len(toks) >= 7)
    assert decided[0].tokens == plain[0].tokens[:7]


def test_read_out_drafts_from_served_caches():
    lm, log, caches, query = sharp_served("qwen2", [("all", "compact"), (["b", "c"], "native"), (["a"], "compact")])
    opts = dict(generate=[True] * 3, score=[False] * 3, max_new_tokens=12, keep_logits=True)
    plain = read_out(lm.model, caches, query, **opts)
    # the first answer drafts from itself, the second from the events' text, the third not at all
    text = [t for tokens in log.event_tokens for t in tokens]
    sources = [query + plain[0].generation.tokens, text + query, None]
    drafted = read_out(lm.model, caches, query, lookup=sources, **opts)
    for got, ref in zip(drafted, plain):
        g, r = got.generation, ref.generation
        assert_same_greedy(g.tokens, g.logits, r.tokens, r.logits, TOL)
    with pytest.raises(EventKVError, match="lookup sources"):
        read_out(lm.model, caches, query, lookup=sources[:2], **opts)


def test_a_sliding_window_model_decodes_without_drafts():
    model = sharp("gemma3")
    prompt = prompts(model)
    plain, n_plain = decode(model, prompt)
    drafted, n_drafted = decode(model, prompt, lookup=[prompt[r].tolist() + plain[r].tokens for r in range(2)])
    assert n_drafted == n_plain
    assert [g.tokens for g in drafted] == [g.tokens for g in plain]


def test_prompt_lookup_drafts():
    lookup = PromptLookup([5, 6, 7, 8, 9, 1, 6, 7, 3], stops={9}, tokens=4)
    assert lookup.draft([6, 7], room=10) == [8]  # the first match of (6, 7); cut before the stop token 9
    assert lookup.draft([4, 5], room=10) == [6, 7, 8]  # (4, 5) occurs nowhere earlier; 5 does
    assert lookup.draft([5], room=2) == [6, 7]  # the budget caps a draft
    assert lookup.draft([42], room=5) == []
    assert lookup.draft([5], room=0) == []
    for bad in (0, -1, 2.5, True):
        with pytest.raises(OptionError, match="tokens"):
            PromptLookup([1, 2], stops=set(), tokens=bad)


def test_donor_pairs_answer_the_same_with_and_without_drafts():
    """The donor-pair probe drafts from each history's text: the same records as a run that decodes one
    token per forward, but for float rounding (greedy texts, answers, outcomes; d within 1e-4)."""
    from probe_fixtures import tiny_runtime

    from eventkv.studies.materialization.donor_pair import ARM_NAMES, DonorPair

    class NoDrafts(DonorPair):
        prompt_lookup = False

    rt = tiny_runtime("llama")
    drafting, plain = (
        DonorPair(arm_names=ARM_NAMES, max_new_tokens=12),
        NoDrafts(arm_names=ARM_NAMES, max_new_tokens=12),
    )
    assert DonorPair.prompt_lookup
    for item in drafting.items(3, range(3)):
        a, b = drafting.run_item(rt, item), plain.run_item(rt, item)
        assert a["arms"].keys() == b["arms"].keys() and a["outcomes"] == b["outcomes"]
        for arm in a["arms"]:
            for v in "AB":
                assert a["arms"][arm][v]["text"] == b["arms"][arm][v]["text"], (arm, v)
        assert all(abs(a["d"][k] - b["d"][k]) <= TOL for k in a["d"])


def test_generate_from_refuses_a_wrong_count_of_sources_before_any_forward(model):
    prompt = prompts(model)
    with torch.no_grad():
        out = model(input_ids=prompt[:, :-1], use_cache=True)
    keys, values = cache_kv(out.past_key_values)
    batch = Batch.of_rows(keys, values, prompt.shape[1] - 1)
    rows = batch.mask.shape[1]
    with pytest.raises(EventKVError, match="2 sequences but 1 lookup sources"):
        generate_from(model, batch, prompt[:, -1:], max_new_tokens=4, lookup=[[1, 2]])
    assert batch.mask.shape[1] == rows  # nothing was fed


def test_a_control_drafts_the_same_tokens_in_both_variants():
    """The kv and isolated arms serve the same events in both variants: their drafts come from those
    events' text, not from the history that holds the variant's own source."""
    from probe_fixtures import tiny_runtime

    from eventkv.kv import readout
    from eventkv.studies.materialization.donor_pair import ARM_NAMES, DonorPair

    rt = tiny_runtime("llama")
    probe = DonorPair(arm_names=ARM_NAMES, max_new_tokens=6)
    seen = []
    original = readout.read_out

    def spy(*args, **kw):
        seen.append(kw.get("lookup"))
        return original(*args, **kw)

    item = probe.items(3, [0])[0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("eventkv.studies.materialization.pairs.engine.read_out", spy)
        probe.run_item(rt, item)
    sources = [s for call in seen for s in call]
    assert len(sources) == 5  # kv's two variants, isolated's one cache for both, text-all's two
    text_all = sorted(sources, key=len)[-2:]
    assert text_all[0] != text_all[1]  # the whole histories differ by the source event
    # the token ids the rows hold: each event tokenized on its own, as its prefill was
    held = [[t for e in events for t in rt.encode(e)] for events in item["events"]]
    assert sorted(v for s in text_all for v in (0, 1) if s[: len(held[v])] == held[v]) == [0, 1]
    served = sorted(sources, key=len)[:-2]
    assert all(len(s) < len(text_all[0]) for s in served)
    assert len({tuple(s) for s in served}) <= 2  # kv's and isolated's served text: the same in both variants
