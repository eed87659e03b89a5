"""Faithfulness gates of the splice (Study 2, "Controlled splice") on tiny random Llama, Qwen2 and
Gemma 3 (sliding window 16) models; ``pytest -k splice``. Seconds each on a CPU."""

import pytest
import torch
from transformers import DynamicCache

from eventkv.errors import EventKVError
from eventkv.kv.model import model_forward
from eventkv.studies.splice.engine import (
    ARMS,
    Splice,
    SplicePrompt,
    _attention_modules,
    clean_run,
    donor_rows,
    filler_ids,
    layers_from,
    span_masked,
    splice_choice,
    splice_generate,
    splice_sweep,
)
from eventkv.testing import assert_same_greedy, tiny_model, tiny_tokenizer

FAMILIES = ["llama", "qwen2", "gemma3"]
CONTENT = "Table: a=3, b=7, c=1. What is b?"
MAX_NEW = 6


class Profile:
    chat_head = "<|im_start|>user\n"
    chat_tail = "<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def setup(family, tok, **kw):
    model = tiny_model(family, **kw)
    prompt = SplicePrompt.from_text(tok, Profile, CONTENT)
    return model, prompt


def n_layers(model):
    return model.config.num_hidden_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_splice_cutoff_beyond_last_layer_equals_clean_exactly(family, tok):
    model, prompt = setup(family, tok)
    run = clean_run(model, prompt, max_new_tokens=MAX_NEW, keep_logits=True)
    donors = {"scaffold": donor_rows(model, run, filler_ids(tok, len(prompt.span_ids)))}
    none = layers_from(n_layers(model), n_layers(model))
    assert none == ()
    cells = [Splice(a, none, step=t) for a in ARMS for t in (0, 2)]
    for tail, batch in (("clean", 1), ("spliced", len(cells))):
        for r in splice_sweep(
            model, run, cells, max_new_tokens=MAX_NEW, donors=donors, tail=tail, batch_size=batch, keep_logits=True
        ):
            # the logits from the splice step on equal the clean run's at those steps
            if tail == "clean":  # the same forwards on the same rows: bit-equal
                assert r.tokens == run.tokens
                assert all(torch.equal(got, ref) for got, ref in zip(r.logits, run.logits[r.splice.step :]))
            else:  # the tail recomputed in a batch: equal within float32 rounding
                assert_same_greedy(r.tokens, r.logits, run.tokens, run.logits[r.splice.step :], 1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_splice_scaffold_with_the_span_own_text_equals_clean(family, tok):
    model, prompt = setup(family, tok)
    run = clean_run(model, prompt, max_new_tokens=MAX_NEW, keep_logits=True)
    own = filler_ids(tok, len(prompt.span_ids), filler=CONTENT)
    assert own == list(prompt.span_ids)
    donors = {"scaffold": donor_rows(model, run, own)}
    cells = [Splice("scaffold", layers_from(c, n_layers(model)), step=0) for c in range(n_layers(model))]
    for r in splice_sweep(model, run, cells, max_new_tokens=MAX_NEW, donors=donors, batch_size=4, keep_logits=True):
        assert_same_greedy(r.tokens, r.logits, run.tokens, run.logits, 1e-5)


def _prefill_without_span(model, prompt, max_new):
    """Reference: head + tail (no span) at their original positions, then greedy decoding."""
    lo, hi = prompt.span_rows
    ids = list(prompt.head_ids) + list(prompt.tail_ids)
    pos = list(range(lo)) + list(range(hi, prompt.n_rows))
    cache = DynamicCache()
    logits = model_forward(model, torch.tensor([ids]), torch.tensor([pos]), cache, logits_to_keep=1)[0, -1]
    out, toks, nxt = [], [], prompt.n_rows
    for _ in range(max_new):
        out.append(logits)
        t = int(torch.argmax(logits))
        toks.append(t)
        if len(toks) == max_new:
            break
        logits = model_forward(model, torch.tensor([[t]]), torch.tensor([[nxt]]), cache, logits_to_keep=1)[0, -1]
        nxt += 1
    return toks, out


@pytest.mark.parametrize("family", FAMILIES)
def test_splice_mask_on_every_layer_equals_a_prefill_without_the_span(family, tok):
    # Meaningful where the sliding window covers the whole prompt: a masked row still counts
    # toward a sliding layer's window (counted in rows), a removed one does not.
    kw = {"sliding_window": 128} if family == "gemma3" else {}
    model, prompt = setup(family, tok, **kw)
    ref_toks, ref_logits = _prefill_without_span(model, prompt, MAX_NEW)
    r = splice_generate(
        model,
        prompt,
        Splice("mask", layers_from(0, n_layers(model))),
        max_new_tokens=MAX_NEW,
        tail="spliced",
        keep_logits=True,
    )
    assert_same_greedy(r.tokens, r.logits, ref_toks, ref_logits, 1e-4)
    # zeroing is not removal: zero-kv on every layer gives other logits than the mask
    z = splice_generate(
        model,
        prompt,
        Splice("zero-kv", layers_from(0, n_layers(model))),
        max_new_tokens=MAX_NEW,
        tail="spliced",
        keep_logits=True,
    )
    assert (z.logits[0] - ref_logits[0]).abs().max() > 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_splice_sweep_equals_the_naive_one_splice_path(family, tok):
    model, prompt = setup(family, tok)
    fill = filler_ids(tok, len(prompt.span_ids))
    run = clean_run(model, prompt, max_new_tokens=4)
    donors = {"scaffold": donor_rows(model, run, fill)}
    cells = [
        Splice("scaffold", layers_from(1, n_layers(model)), step=0),
        Splice("zero-kv", (0,), step=1),
        Splice("mean", layers_from(1, n_layers(model)), step=0),
        Splice("zero-k", (1,), step=2),
        Splice("mask", (0,), heads=(1,), step=0),
        Splice("scaffold", (1,), heads=(0,), step=1),
    ]
    fast = splice_sweep(model, run, cells, max_new_tokens=4, donors=donors, batch_size=4, keep_logits=True)
    for cell, f in zip(cells, fast):
        slow = splice_generate(model, prompt, cell, max_new_tokens=4, donor_ids=fill, keep_logits=True)
        assert_same_greedy(f.tokens, f.logits, slow.tokens, slow.logits, 1e-4)
        assert f.tokens[: cell.step] == run.tokens[: cell.step]  # the first t tokens are clean


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_splice_arms_change_the_logits_and_heads_select(family, tok):
    model, prompt = setup(family, tok)
    run = clean_run(model, prompt, max_new_tokens=2, keep_logits=True)
    donors = {"scaffold": donor_rows(model, run, filler_ids(tok, len(prompt.span_ids)))}
    every = layers_from(0, n_layers(model))
    kvh = run.keys[0].shape[1]
    cells = [Splice(a, every) for a in ARMS[1:]] + [Splice(a, every, heads=tuple(range(kvh))) for a in ARMS[1:]]
    res = splice_sweep(model, run, cells, max_new_tokens=2, donors=donors, keep_logits=True)
    n = len(ARMS) - 1
    for i in range(n):
        assert (res[i].logits[0] - run.logits[0]).abs().max() > 1e-4, cells[i].arm
        assert torch.allclose(res[i].logits[0], res[n + i].logits[0], atol=1e-5, rtol=0)  # all heads == None


def test_splice_mask_hooks_are_removed_even_on_error(tok):
    model, prompt = setup("llama", tok)
    attn = _attention_modules(model)
    with pytest.raises(RuntimeError):
        with span_masked(model, (2, 4), {0: torch.tensor([True]), 1: torch.tensor([True])}):
            assert all(len(a._forward_pre_hooks) == 1 for a in attn)
            raise RuntimeError("boom")
    assert all(len(a._forward_pre_hooks) == 0 for a in attn)


def test_splice_user_errors(tok):
    model, prompt = setup("llama", tok)
    with pytest.raises(EventKVError, match="zero"):
        Splice("zero")
    with pytest.raises(EventKVError, match="cutoff 9"):
        layers_from(9, 2)
    run = clean_run(model, prompt, max_new_tokens=2)
    with pytest.raises(EventKVError, match="donor"):
        splice_sweep(model, run, [Splice("scaffold", (0,))], max_new_tokens=2)
    with pytest.raises(EventKVError, match="tail"):
        splice_sweep(model, run, [Splice("mask", (0,))], max_new_tokens=2, tail="x")
    with pytest.raises(EventKVError, match="3 tokens but the span"):
        donor_rows(model, run, [1, 2, 3])
    with pytest.raises(EventKVError, match="tail"):
        SplicePrompt((1,), (2,), ())


def test_splice_filler_is_length_matched(tok):
    for n in (1, 5, 57, 200):
        ids = filler_ids(tok, n)
        assert len(ids) == n
        assert tok.decode(ids).startswith("This is a neutral sentence"[:n])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_splice_early_exit_drops_finished_splices_without_changing_the_others(family, tok):
    model, prompt = setup(family, tok)
    run = clean_run(model, prompt, max_new_tokens=MAX_NEW)
    cells = [Splice(a, layers_from(c, n_layers(model))) for a in ("mask", "zero-kv", "mean") for c in (0, 1)]
    full = splice_sweep(model, run, cells, max_new_tokens=MAX_NEW, batch_size=len(cells), keep_logits=True)

    def decided(toks):  # ends different splices at different steps
        return toks[-1] % 3 == 0

    early = splice_sweep(
        model, run, cells, max_new_tokens=MAX_NEW, batch_size=len(cells), decided=decided, keep_logits=True
    )
    for f, e in zip(full, early):  # the batch shrinks as splices finish: equal within float32 rounding
        n = len(e.tokens)
        assert_same_greedy(e.tokens, e.logits, f.tokens[:n], f.logits[: len(e.logits)], 1e-5)
        assert len(e.tokens) == len(f.tokens) or decided(e.tokens)


# ------------------------------------------------------------------ forced-choice readout over the splice
def _options(tok):
    """Options of 1, 2 and 3 tokens (exercises the right padding)."""
    return [
        tok("b", add_special_tokens=False)["input_ids"],
        tok("7.", add_special_tokens=False)["input_ids"],
        tok(" c=1", add_special_tokens=False)["input_ids"][:3],
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_splice_choice_cutoff_beyond_last_layer_equals_clean_exactly(family, tok):
    model, prompt = setup(family, tok)
    run = clean_run(model, prompt, max_new_tokens=0)
    opts = _options(tok)
    assert sorted(len(o) for o in opts) == [1, 2, 3]
    donors = {"scaffold": donor_rows(model, run, filler_ids(tok, len(prompt.span_ids)))}
    none = layers_from(n_layers(model), n_layers(model))
    for tail in ("clean", "spliced"):
        clean = splice_choice(model, run, [Splice("clean")], opts, tail=tail, batch_size=1)[0]
        got = splice_choice(model, run, [Splice(a, none) for a in ARMS], opts, donors=donors, tail=tail, batch_size=1)
        for row in got:
            assert row == clean  # the same floats: nothing spliced is clean, exactly
        batched = splice_choice(
            model, run, [Splice(a, none) for a in ARMS], opts, donors=donors, tail=tail, batch_size=len(ARMS)
        )
        for row in batched:
            assert row == pytest.approx(clean, abs=1e-5)
    # and the splice arms do move the scores when they splice every layer
    every = layers_from(0, n_layers(model))
    moved = splice_choice(model, run, [Splice(a, every) for a in ARMS[1:]], opts, donors=donors)
    for arm, row in zip(ARMS[1:], moved):
        assert max(abs(x - y) for x, y in zip(row, clean)) > 1e-4, arm


@pytest.mark.parametrize("family", FAMILIES)
def test_splice_choice_clean_equals_candidate_logprobs_on_a_served_cache(family, tok):
    from eventkv.kv.readout import candidate_logprobs
    from eventkv.kv.serve import ServedCache

    model, prompt = setup(family, tok)
    run = clean_run(model, prompt, max_new_tokens=0)
    p = prompt.n_rows
    served = ServedCache(
        [k[:, :, : p - 1] for k in run.keys],
        [v[:, :, : p - 1] for v in run.values],
        torch.arange(p - 1),
        None,
        p - 1,
        "compact",
        (),
    )
    opts = _options(tok)
    ref = [c.logprob for c in candidate_logprobs(model, served, [prompt.ids[-1]], opts)]
    got = splice_choice(model, run, [Splice("clean")], opts)[0]
    assert got == pytest.approx(ref, abs=1e-4)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_splice_choice_matches_the_generation_path(family, tok):
    """The first option token's log-prob under a splice equals the log-softmax of the spliced
    generation's first-step logits (same splice, step 0), for every arm."""
    model, prompt = setup(family, tok)
    run = clean_run(model, prompt, max_new_tokens=2)
    donors = {"scaffold": donor_rows(model, run, filler_ids(tok, len(prompt.span_ids)))}
    one = [[5], [9], [17]]
    cells = [Splice(a, layers_from(1, n_layers(model))) for a in ARMS] + [Splice("mask", (0,), heads=(1,))]
    gen = splice_sweep(model, run, cells, max_new_tokens=2, donors=donors, keep_logits=True)
    ch = splice_choice(model, run, cells, one, donors=donors, batch_size=3)
    for g, row in zip(gen, ch):
        lp = torch.log_softmax(g.logits[0], dim=-1)
        assert row == pytest.approx([float(lp[o[0]]) for o in one], abs=1e-4), g.splice


def test_splice_choice_user_errors(tok):
    model, prompt = setup("llama", tok)
    run = clean_run(model, prompt, max_new_tokens=0)
    with pytest.raises(EventKVError, match="step 0"):
        splice_choice(model, run, [Splice("zero-kv", (0,), step=1)], [[3]])
    with pytest.raises(EventKVError, match="empty option"):
        splice_choice(model, run, [Splice("zero-kv", (0,))], [[3], []])
    with pytest.raises(EventKVError, match="donor"):
        splice_choice(model, run, [Splice("scaffold", (0,))], [[3]])
