"""Carriers for the memory: answer-free texts of the contract's kinds, and kind='auto' read from a
contract.json (Study 1, "Programmed carriers")."""

import json

import pytest

from eventkv.errors import EventKVError
from eventkv.memory.carriers import CARRIER_KINDS, carrier_text, choose_kind, read_contract


def _contract(d: dict, digest: str | None = "abc") -> dict:
    return {"model": "m", "provenance": {"weights_digest": digest}, "programming": {"readout": "logits", "d": d}}


def _d(median: float, p: float) -> dict:
    return {"n": 24, "median": median, "pos": 0, "neg": 0, "zero": 0, "sign_p": p, "wilcoxon_p": p}


@pytest.mark.parametrize("kind", CARRIER_KINDS)
def test_carrier_texts_name_the_subject_and_no_value(kind):
    text = carrier_text(kind, "the user's home city", ["e3", "e7"])
    assert "the user's home city" in text
    assert "Lisbon" not in text  # a carrier is built from the subject and ids only: it cannot hold a value
    if kind in ("binding", "compute"):
        assert "events e3, e7" in text
    assert carrier_text(kind, "x", ["e1"]) != carrier_text(kind, "y", ["e1"])


def test_carrier_text_refuses_bad_arguments():
    with pytest.raises(EventKVError, match="kind 'explicit': use one of passive"):
        carrier_text("explicit", "x", ["e1"])
    with pytest.raises(EventKVError, match="subject"):
        carrier_text("passive", "  ", ["e1"])
    with pytest.raises(EventKVError, match="sources"):
        carrier_text("binding", "x", [])


def test_auto_picks_the_largest_significant_positive_shift():
    d = {
        "row": _d(0.5, 1e-6),  # not a carrier kind
        "passive": _d(0.02, 0.01),
        "binding": _d(0.09, 0.2),  # largest but not significant
        "directive": _d(-0.3, 1e-5),  # significant but negative
        "compute": _d(0.05, 0.001),
        "compute+row": _d(0.9, 1e-9),  # beside the row: not the carrier alone
    }
    c = choose_kind(_contract(d), "abc")
    assert (c.kind, c.median_d, c.p_value) == ("compute", 0.05, 0.001)
    assert "compute" in c.reason and "+0.050" in c.reason


def test_auto_ties_go_to_the_first_kind_in_the_battery_order():
    c = choose_kind(_contract({"directive": _d(0.05, 0.01), "binding": _d(0.05, 0.01)}))
    assert c.kind == "binding"


def test_auto_falls_back_to_pinned_text():
    assert choose_kind(None).kind is None
    none = choose_kind(_contract({k: _d(0.01, 0.4) for k in CARRIER_KINDS}))
    assert none.kind is None and "pinned" in none.reason and "0.05" in none.reason
    assert choose_kind(_contract({})).kind is None  # no graded readout in the contract


def test_auto_refuses_a_contract_of_other_weights(tmp_path):
    with pytest.raises(EventKVError, match="measured on weights"):
        choose_kind(_contract({}, digest="other"), "abc")
    assert choose_kind(_contract({}, digest=None), "abc").kind is None  # an older contract without a digest


def test_read_contract_from_a_file(tmp_path):
    p = tmp_path / "contract.json"
    p.write_text(json.dumps(_contract({"passive": _d(0.1, 0.01)})))
    assert choose_kind(p, "abc").kind == "passive"
    with pytest.raises(EventKVError, match="does not exist"):
        read_contract(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(EventKVError, match="not readable JSON"):
        read_contract(tmp_path / "bad.json")
    with pytest.raises(EventKVError, match="no 'programming' section"):
        read_contract({"model": "m"})
