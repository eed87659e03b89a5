"""Bad input raises EventKVError with a clear message; the CLI exits 2 without a traceback."""

import json
import sys

import pytest

import eventkv.models
from eventkv.cli import main
from eventkv.errors import EventKVError
from eventkv.log import Event, EventLog, TokenizedLog, tokenize
from eventkv.prefill import EventKV, prefill
from eventkv.query import answer
from eventkv.serve import serve
from eventkv.testing import tiny_lm


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


@pytest.fixture()
def log():
    return EventLog([Event("a", "alpha is 1"), Event("b", "beta is 2"), Event("c", "gamma is 3")])


def test_empty_log():
    with pytest.raises(EventKVError, match="empty"):
        EventLog([])


def test_duplicate_ids():
    with pytest.raises(EventKVError, match="duplicate event id 'a'"):
        EventLog([Event("a", "x"), Event("a", "y")])


def test_budget_too_small():
    with pytest.raises(EventKVError, match="raise its budget to at least 3"):
        TokenizedLog.from_ids([1], [("a", [5, 6, 7], 2)])


def test_unknown_event_id(lm, log):
    ekv = prefill(lm.model, tokenize(log, lm.tokenizer, lm.profile))
    with pytest.raises(EventKVError, match="unknown event id 'zzz'.*a, b, c"):
        serve(ekv, ["a", "zzz"])


def test_empty_served_set(lm, log):
    ekv = prefill(lm.model, tokenize(log, lm.tokenizer, lm.profile))
    for empty in ([], "", " , "):
        with pytest.raises(EventKVError, match="served set is empty"):
            serve(ekv, empty)


def test_unknown_mode(lm, log):
    ekv = prefill(lm.model, tokenize(log, lm.tokenizer, lm.profile))
    with pytest.raises(EventKVError, match="unknown serving mode 'sparse'"):
        serve(ekv, ["a"], "sparse")


def test_history_longer_than_context(lm):
    long = EventLog([Event(f"e{i}", "x" * 200) for i in range(30)])  # > 6000 byte tokens
    assert lm.profile.max_context == 4096
    with pytest.raises(EventKVError, match="context is 4096 tokens"):
        prefill(lm.model, tokenize(long, lm.tokenizer, lm.profile), max_context=lm.profile.max_context)


def test_corrupted_eventkv_detected(tmp_path, lm, log):
    ekv = prefill(lm.model, tokenize(log, lm.tokenizer, lm.profile))
    d = ekv.save(tmp_path / "kv")
    raw = bytearray((d / "kv.safetensors").read_bytes())
    raw[-10] ^= 0xFF
    (d / "kv.safetensors").write_bytes(bytes(raw))
    with pytest.raises(EventKVError, match="corrupted"):
        EventKV.load(d)


def test_partial_eventkv_detected(tmp_path, lm, log):
    ekv = prefill(lm.model, tokenize(log, lm.tokenizer, lm.profile))
    d = ekv.save(tmp_path / "kv")
    (d / "eventkv.json").unlink()
    with pytest.raises(EventKVError, match="no complete EventKV"):
        EventKV.load(d)


def test_answer_reuses_store(tmp_path, lm, log):
    first = answer(lm, log, ["a", "c"], "what is gamma?", candidates=["1", "3"], max_new_tokens=4, store=tmp_path / "s")
    again = answer(lm, log, ["a", "c"], "what is gamma?", candidates=["1", "3"], max_new_tokens=4, store=tmp_path / "s")
    assert not first.reused and again.reused
    assert first.generation.tokens == again.generation.tokens
    assert [c.logprob for c in first.candidates] == [c.logprob for c in again.candidates]
    assert first.n_rows_served < first.n_rows_total


# ------------------------------------------------------------------------------------- CLI

def run_cli(monkeypatch, capsys, *args):
    monkeypatch.setattr(sys, "argv", ["eventkv", *args])
    with pytest.raises(SystemExit) as exc:
        main()
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


@pytest.fixture()
def jsonl(tmp_path):
    p = tmp_path / "events.jsonl"
    p.write_text("\n".join(json.dumps({"id": i, "text": f"event {i}"}) for i in ("a", "b", "c")) + "\n")
    return p


@pytest.fixture()
def fake_load(monkeypatch, lm):
    monkeypatch.setattr(eventkv.models, "load", lambda name, dtype="float32", **kw: lm)


@pytest.mark.parametrize("serve_arg, message", [("a,zzz", "unknown event id 'zzz'"), (",", "served set is empty")])
def test_cli_bad_served_set_exits_2(monkeypatch, capsys, tmp_path, jsonl, fake_load, serve_arg, message):
    monkeypatch.setenv("EVENTKV_CACHE", str(tmp_path / "cache"))
    code, out, err = run_cli(monkeypatch, capsys, "query", "--log", str(jsonl), "--serve", serve_arg, "-q", "which?")
    assert code == 2 and message in err and "Traceback" not in err + out


def test_cli_empty_log_exits_2(monkeypatch, capsys, tmp_path, fake_load):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    code, out, err = run_cli(monkeypatch, capsys, "query", "--log", str(empty), "--serve", "a", "-q", "x")
    assert code == 2 and "no events" in err


def test_cli_unknown_alias_exits_2(monkeypatch, capsys, jsonl):
    code, out, err = run_cli(monkeypatch, capsys, "query", "-m", "no-such-model", "--log", str(jsonl), "--serve", "a", "-q", "x")
    assert code == 2 and "no-such-model" in err and "Traceback" not in err


def test_cli_query_prints_answer(monkeypatch, capsys, tmp_path, jsonl, fake_load):
    monkeypatch.setenv("EVENTKV_CACHE", str(tmp_path / "cache"))
    code, out, err = run_cli(monkeypatch, capsys, "query", "--log", str(jsonl), "--serve", "a,c", "-q", "which?",
                             "--candidates", "a,c", "--max-new-tokens", "3")
    assert code in (0, None)
    assert "answer:" in out and "log-prob" in out


@pytest.mark.parametrize("args, message", [
    (["query", "--mode", "bogus", "--serve", "a", "-q", "x"], "--mode 'bogus'"),
    (["query", "--serve", ",", "-q", "x"], "served set is empty"),
    (["run", "donor-pair", "--items", "0"], "--items 0"),
    (["contract", "--items", "1"], "--items 1"),
    (["splice", "--cutoffs", "5-2"], "runs backwards"),
    (["run", "patch", "--lengths", "2"], "--lengths 2:"),
])
def test_cli_bad_options_fail_before_the_model_loads(monkeypatch, capsys, tmp_path, jsonl, args, message):
    def no_load(*a, **k):
        raise AssertionError("the model must not load for a bad option")

    monkeypatch.setattr(eventkv.models, "load", no_load)
    out_dir = tmp_path / "out"
    extra = ["--log", str(jsonl)] if args[0] == "query" else ["--out", str(out_dir)]
    code, out, err = run_cli(monkeypatch, capsys, *args, *extra)
    assert code == 2 and message in err and "Traceback" not in err + out
    assert not out_dir.exists()


def test_log_path_is_a_directory(tmp_path):
    with pytest.raises(EventKVError, match="is a directory"):
        EventLog.from_jsonl(tmp_path)
