"""EventMemory.carrier: kind='auto' from the model's contract.json writes the
kind the contract measured as carrying state on this checkpoint, or pins the sources' text."""

import json

import pytest

from eventkv.errors import EventKVError, OptionError
from eventkv.memory import EventMemory
from eventkv.testing import tiny_lm


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


def _contract(tmp_path, lm, d: dict, digest: str | None = None):
    p = tmp_path / "contract.json"
    prov = {"weights_digest": digest or lm.profile.weights_digest}
    p.write_text(json.dumps({"model": "tiny", "provenance": prov, "programming": {"readout": "logits", "d": d}}))
    return p


def _d(median, p):
    return {"n": 24, "median": median, "pos": 0, "neg": 0, "zero": 0, "sign_p": p, "wilcoxon_p": p}


def _memory(tmp_path, lm, contract=None):
    mem = EventMemory.create(tmp_path / "mem", lm, namespace="t", contract=contract)
    mem.add([{"text": "Dana moved to Porto in May.", "id": "move"}, {"text": "Ravi likes tea.", "id": "tea"}])
    return mem


def test_auto_writes_the_contracts_kind_after_the_sources(lm, tmp_path):
    c = _contract(tmp_path, lm, {"compute": _d(0.04, 0.001), "passive": _d(0.01, 0.02)})
    with _memory(tmp_path, lm, c) as mem:
        r = mem.carrier(["move"], "where Dana lives", prefill=True)
        assert r.kind == "compute" and r.pinned == () and "compute" in r.reason
        rec = mem.get(r.added.id)
        assert rec.kind == "carrier" and "move" in rec.text and "Porto" not in rec.text
        assert rec.position > mem.get("move").position and rec.n_rows > 0
        assert not mem.get("move").pinned


def test_auto_without_a_qualifying_kind_pins_the_sources(lm, tmp_path):
    c = _contract(tmp_path, lm, {k: _d(0.02, 0.3) for k in ("passive", "binding", "directive", "compute")})
    with _memory(tmp_path, lm, c) as mem:
        n = len(mem.list())
        r = mem.carrier(["move", "tea"], "Dana's city")
        assert (r.kind, r.added, r.pinned) == (None, None, ("move", "tea"))
        assert "pinned" in r.reason and len(mem.list()) == n
        assert mem.get("move").pinned and mem.get("tea").pinned
        assert {"move", "tea"} <= set(mem.select("unrelated words", k=1))  # pinned: in every served set


def test_no_contract_pins_and_an_explicit_kind_is_written(lm, tmp_path):
    with _memory(tmp_path, lm) as mem:
        assert mem.carrier(["move"], "Dana's city").kind is None and mem.get("move").pinned
        r = mem.carrier(["tea"], "Ravi's drink", kind="directive")
        assert r.kind == "directive" and mem.get(r.added.id).text == "[remember] Ravi's drink"


def test_carrier_errors(lm, tmp_path):
    c = _contract(tmp_path, lm, {}, digest="another-model")
    with pytest.raises(EventKVError, match="measured on weights"):  # refused when the memory is created
        _memory(tmp_path, lm, c)
    with _memory(tmp_path, lm) as mem:
        with pytest.raises(OptionError, match="kind 'explicit'"):
            mem.carrier(["move"], "x", kind="explicit")
        with pytest.raises(EventKVError, match="unknown event id|nope"):
            mem.carrier(["nope"], "x", kind="passive")
        mem.delete("tea")
        with pytest.raises(EventKVError, match="'tea' is deleted"):
            mem.carrier(["tea"], "x", kind="passive")
        with pytest.raises(OptionError, match="sources"):
            mem.carrier([], "x", kind="passive")
