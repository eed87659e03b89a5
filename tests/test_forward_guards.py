"""Guards every model forward of the data path takes: stored rows must
have the model's dtype and device (or be cast on purpose), and an explicit attention mask is
always passed, because position ids with gaps must never be read as packed sequences."""

from __future__ import annotations

import pytest
import torch

from eventkv.errors import EventKVError
from eventkv.kv.log import Event, EventLog, tokenize, tokenize_query
from eventkv.kv.prefill import prefill
from eventkv.kv.readout import candidate_logprobs, generate, read_out
from eventkv.kv.rows import EventKV
from eventkv.kv.serve import serve
from eventkv.testing import tiny_lm

EVENTS = [
    Event("a", "Dana lives in Lyon.", budget=24),
    Event("b", "The table is at 19:30.", budget=30),
    Event("c", "Dana moved to Nantes."),
]


def _setup(family="llama"):
    lm = tiny_lm(family)
    tlog = tokenize(EventLog(EVENTS), lm.tokenizer, lm.profile)
    assert tlog.n_rows < tlog.history_end  # the budgets leave gaps in the position ids
    q = tokenize_query(lm.tokenizer, lm.profile, "Where does Dana live?")
    return lm, tlog, q


@pytest.mark.parametrize("rows_dtype, model_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)])
def test_rows_of_another_dtype_are_refused_on_every_path(rows_dtype, model_dtype):
    lm, tlog, q = _setup()
    ekv = prefill(lm.model, tlog).to(dtype=rows_dtype)
    lm.model.to(model_dtype)
    served = serve(ekv, ["a", "c"], mode="compact")
    rd, md = str(rows_dtype).removeprefix("torch."), str(model_dtype).removeprefix("torch.")
    msg = rf"^the KV rows are {rd} on cpu but the model runs in {md} on cpu: load the model with dtype='{rd}'"
    with pytest.raises(EventKVError, match=msg):
        generate(lm.model, served, q, max_new_tokens=2)
    with pytest.raises(EventKVError, match=msg):
        candidate_logprobs(lm.model, served, q, [[5, 6], [7]])
    with pytest.raises(EventKVError, match=msg):
        read_out(lm.model, [served], q, generate=[True], score=[False], max_new_tokens=2)
    longer = tokenize(EventLog([*EVENTS, Event("d", "More.")]), lm.tokenizer, lm.profile)
    with pytest.raises(EventKVError, match=msg):
        prefill(lm.model, longer, prefix=ekv)


def test_a_stored_bf16_eventkv_under_a_float32_model_is_refused_until_cast(tmp_path):
    lm, tlog, q = _setup()
    # stored bf16 rows, cast from a float32 prefill (no bf16 forward: torch's bf16 CPU attention refuses to
    # run on an AMX CPU held to AVX2 kernels, see eventkv.models.dtypes.native_bf16)
    prefill(lm.model, tlog, weights_digest="same-weights").to(dtype=torch.bfloat16).save(tmp_path / "kv")
    ekv = EventKV.load(tmp_path / "kv", expect_digest="same-weights")  # same weights, other dtype
    assert ekv.dtype == "bfloat16"
    with pytest.raises(EventKVError, match="the KV rows are bfloat16 on cpu but the model runs in float32"):
        candidate_logprobs(lm.model, serve(ekv, ["a"]), q, [[5], [7]])
    cast = ekv.to(dtype=torch.float32)  # the explicit cast works
    assert cast.dtype == "float32" and ekv.dtype == "bfloat16"
    assert torch.equal(cast.keys[0], ekv.keys[0].float())
    scores = candidate_logprobs(lm.model, serve(cast, ["a"]), q, [[5], [7]])
    assert all(torch.isfinite(torch.tensor(s.logprob)) for s in scores)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_every_forward_passes_an_explicit_mask(family):
    lm, tlog, q = _setup(family)
    seen = []

    def hook(_module, args, kwargs):
        seen.append(kwargs.get("attention_mask"))

    handle = lm.model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        ekv = prefill(lm.model, tlog, chunk_size=7)
        for mode in ("compact", "native", "isolated", "text"):
            served = (
                serve(ekv, ["a", "c"], mode=mode, model=lm.model)
                if mode in ("isolated", "text")
                else serve(ekv, ["a", "c"], mode=mode)
            )
            generate(lm.model, served, q, max_new_tokens=3)
            candidate_logprobs(lm.model, served, q, [[5, 6, 7], [8]])
            read_out(
                lm.model,
                [served, served],
                q,
                generate=[True, False],
                score=[False, True],
                candidates=[[5, 6], [8]],
                max_new_tokens=3,
            )
    finally:
        handle.remove()
    assert len(seen) > 20
    assert all(m is not None for m in seen), f"{sum(m is None for m in seen)} of {len(seen)} forwards had no mask"


def test_without_a_mask_transformers_reads_position_gaps_as_packed_sequences():
    """Why the mask matters: with no cache and no mask, transformers 5.x treats a jump in the position
    ids as the start of a new packed sequence, so tokens after a budget gap stop seeing the tokens
    before it. If eventkv ever forwarded gapped positions without a mask, its rows would change."""
    lm, tlog, _ = _setup()
    ids = torch.tensor([tlog.input_ids])
    pos = torch.tensor([tlog.position_ids])
    with torch.inference_mode():
        packed = lm.model(input_ids=ids, position_ids=pos, use_cache=False).logits
        masked = lm.model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids, dtype=torch.bool)).logits
        ours = lm.model(
            input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids, dtype=torch.bool), use_cache=False
        ).logits
    first_gap = tlog.spans[2].row_start  # first row after event a's budget gap
    assert torch.equal(masked, ours)
    assert torch.allclose(packed[0, :first_gap], masked[0, :first_gap], atol=1e-5)
    assert (packed[0, first_gap:] - masked[0, first_gap:]).abs().max() > 1e-3
