"""The donor-pair probe once on a real packaged model (smollm2-135m, float32): two pairs end to
end. Asserts the probe's invariants, not the model's behaviour (a 135M model may be at chance)."""

import json

import pytest

from eventkv.probes import Runtime
from eventkv.probes.runner import load_records, run_probe
from eventkv.studies.materialization.donor_pair import DonorPair

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_donor_pair_on_smollm2(tmp_path):
    from eventkv.models import load

    lm = load("smollm2-135m", dtype="float32")
    rt = Runtime(lm.model, lm.tokenizer, lm.profile)
    s = run_probe(DonorPair(max_new_tokens=16), rt, model="smollm2-135m", items=2, seed=0, out=tmp_path, progress=False)
    recs = load_records(tmp_path)
    assert [r["index"] for r in recs] == [0, 1]
    for r in recs:
        assert r["served_identical"] and r["d"]["isolated"] == 0.0
        assert r["kv_all_vs_text_all"] == {"rows_and_positions_equal": True}
        assert r["arms"]["isolated"]["A"] == r["arms"]["isolated"]["B"]
        for arm in ("kv", "isolated", "text-all"):
            for v in "AB":
                lp = r["arms"][arm][v]["logprobs"]
                assert set(lp) == {"ONLINE", "OFFLINE"} and all(x < 0 for x in lp.values())
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m["identity"]["weights_digest"] == lm.profile.weights_digest
    assert m["profile"]["name"] == "smollm2-135m"
    assert s.data["pairs"] == 2
