"""One readout implementation, accumulated in float64."""

from __future__ import annotations

import copy

import pytest
import torch

from eventkv.errors import EventKVError
from eventkv.kv.log import TokenizedLog
from eventkv.kv.prefill import prefill
from eventkv.kv.readout import candidate_logprobs, generate, read_out, token_logprobs
from eventkv.kv.rows import cache_from_rows
from eventkv.kv.serve import serve
from eventkv.testing import tiny_model

VOCAB = 49152  # SmolLM2's vocabulary size: where a float32 log-softmax drifted by 2.4e-4 nats
LOGIT_SCALE = 20.0  # logits scaled toward a real model's range; here a float32 log-softmax is off by 2e-5-5e-5 nats


def _setup():
    model = tiny_model("llama", vocab_size=VOCAB)
    with torch.no_grad():
        model.lm_head.weight.mul_(LOGIT_SCALE)
    g = torch.Generator().manual_seed(3)
    ids = lambda n: torch.randint(0, VOCAB, (n,), generator=g).tolist()  # noqa: E731
    tlog = TokenizedLog.from_ids(ids(6), [(f"e{i}", ids(9), None) for i in range(5)])
    query = ids(5)
    cands = [ids(12), ids(12), ids(7)]
    return model, tlog, query, cands


def _float64_reference(model, tlog, served_ids, query, cand) -> float:
    """The whole computation in float64: prefill, serve, forward and log-softmax."""
    m64 = copy.deepcopy(model).double()
    s64 = serve(prefill(m64, tlog), served_ids, mode="compact")
    seq = list(query) + list(cand[:-1])
    pos = torch.arange(s64.next_position, s64.next_position + len(seq)).unsqueeze(0)
    with torch.inference_mode():
        out = m64(
            input_ids=torch.tensor([seq]),
            position_ids=pos,
            use_cache=True,
            attention_mask=torch.ones(1, s64.n_rows + len(seq), dtype=torch.bool),
            cache=cache_from_rows(s64.keys, s64.values),
        ).logits[0]
    lp = torch.log_softmax(out, dim=-1)
    at = torch.arange(len(query) - 1, len(seq))
    return float(lp[at, torch.tensor(cand)].sum())


def test_candidate_logprobs_and_read_out_match_a_float64_reference_within_1e5():
    model, tlog, query, cands = _setup()
    ekv = prefill(model, tlog)
    a, b = serve(ekv, ["e1", "e3"], "compact"), serve(ekv, ["e0", "e2", "e4"], "native")
    ref_a = [_float64_reference(model, tlog, ["e1", "e3"], query, c) for c in cands]
    single = [s.logprob for s in candidate_logprobs(model, a, query, cands)]
    batched = read_out(model, [b, a], query, generate=[False, False], score=[True, True], candidates=cands)
    assert max(abs(x - y) for x, y in zip(single, ref_a)) < 1e-5
    assert max(abs(c.logprob - y) for c, y in zip(batched[1].candidates, ref_a)) < 1e-5
    assert [c.logprob for c in batched[1].candidates] == pytest.approx(single, abs=1e-5)
    # the scores are large, so the tolerance is a real constraint (each is a sum over up to 12 tokens)
    assert min(abs(x) for x in ref_a) > 50  # measured: ours within 2.4e-6 (AVX-512 and AVX2 kernels)


def test_token_logprobs_is_float64_of_the_given_logits():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)) * 10
    tok = torch.tensor([1, 2, VOCAB - 1])
    got = token_logprobs(logits, tok)
    assert got.dtype == torch.float64
    want = torch.log_softmax(logits.double(), -1)[torch.arange(3), tok]
    assert torch.equal(got, want)


def test_generate_is_read_out_with_one_cache():
    model, tlog, query, _ = _setup()
    s = serve(prefill(model, tlog), ["e1", "e3"], "compact")
    g = generate(model, s, query, max_new_tokens=6, keep_logits=True)
    r = read_out(model, [s], query, generate=[True], score=[False], max_new_tokens=6, keep_logits=True)[0]
    assert g.tokens == r.generation.tokens and len(g.tokens) == 6 and len(g.logits) == 6
    assert all(torch.equal(x, y) for x, y in zip(g.logits, r.generation.logits))
    assert [int(torch.argmax(x)) for x in g.logits] == g.tokens


@pytest.mark.parametrize(
    "gen, score", [([True], [False, False]), ([True, True], [True]), ([], []), ([True, False, True], [False, False])]
)
def test_read_out_refuses_flags_that_are_not_one_per_served_cache(gen, score):
    model, tlog, query, cands = _setup()
    ekv = prefill(model, tlog)
    served = [serve(ekv, ["e1"]), serve(ekv, ["e2"])]
    with pytest.raises(
        EventKVError,
        match=rf"^read_out got 2 served caches but {len(gen)} generate and "
        rf"{len(score)} score flags: give one generate flag",
    ):
        read_out(model, served, query, generate=gen, score=score, candidates=cands)
