"""Bad input raises EventKVError with a clear message; the CLI exits 2 without a traceback."""

import json

import pytest
from cli_fixtures import run_cli

import eventkv.models
from eventkv.errors import EventKVError
from eventkv.kv.log import Event, EventLog, TokenizedLog, tokenize
from eventkv.kv.prefill import prefill
from eventkv.kv.query import answer
from eventkv.kv.rows import EventKV
from eventkv.kv.serve import serve
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
    code, out, err = run_cli(
        monkeypatch, capsys, "query", "-m", "no-such-model", "--log", str(jsonl), "--serve", "a", "-q", "x"
    )
    assert code == 2 and "no-such-model" in err and "Traceback" not in err


def test_cli_query_prints_answer(monkeypatch, capsys, tmp_path, jsonl, fake_load):
    monkeypatch.setenv("EVENTKV_CACHE", str(tmp_path / "cache"))
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "query",
        "--log",
        str(jsonl),
        "--serve",
        "a,c",
        "-q",
        "which?",
        "--candidates",
        "a,c",
        "--max-new-tokens",
        "3",
    )
    assert code in (0, None)
    assert "answer:" in out and "log-prob" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["query", "--mode", "bogus", "--serve", "a", "-q", "x"], "--mode 'bogus'"),
        (["query", "--serve", ",", "-q", "x"], "served set is empty"),
        (["run", "donor-pair", "--items", "0"], "--items 0"),
        (["contract", "--items", "1"], "--items 1"),
        (["splice", "--cutoffs", "5-2"], "runs backwards"),
        (["run", "patch", "--lengths", "2"], "--lengths 2:"),
    ],
)
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


# ------------------------------------------------------- every numeric or list option, checked at the boundary

_BAD_OPTIONS = [
    # query
    (["query", "--chunk-size", "-1"], "--chunk-size -1: give a positive number of tokens per forward"),
    (["query", "--chunk-size", "0"], "--chunk-size 0: give a positive number"),
    (["query", "--chunk-size", "1.5"], "--chunk-size '1.5': input should be a valid integer"),
    (["query", "--max-new-tokens", "0"], "--max-new-tokens 0: generate at least 1 token"),
    (["query", "--max-new-tokens", "-3"], "--max-new-tokens -3:"),
    (["query", "--serve", "a,zzz"], "unknown event id 'zzz'"),
    (["query", "-q", " "], "--question ' ': give a non-empty question"),
    (["query", "--candidates", "x,x"], "--candidates x,x: give distinct, non-empty candidate answers"),
    # run donor-pair
    (["run", "donor-pair", "--items", "-3"], "--items -3: run at least one item"),
    (["run", "donor-pair", "--items", "abc"], "--items 'abc': input should be a valid integer"),
    (["run", "donor-pair", "--threads", "0"], "--threads 0: give 1 to"),
    (["run", "donor-pair", "--threads", "-1"], "--threads -1:"),
    (["run", "donor-pair", "--max-new-tokens", "0"], "--max-new-tokens 0: generate at least 1 token"),
    (["run", "donor-pair", "--n-events", "2"], "--n-events 2: a donor pair needs at least 3 events"),
    (["run", "donor-pair", "--decoy-slot", "-1"], "--decoy-slot -1: give a 0-based slot"),
    (["run", "donor-pair", "--decoy-slot", "30"], "--decoy-slot 30: outside the history's slots 0..23"),
    (["run", "donor-pair", "--root-slot", "5"], "--root-slot 5: the root must come after every source slot"),
    (["run", "donor-pair", "--source-slots", "11-8"], "--source-slots 11,8: the first slot must not exceed the last"),
    (["run", "donor-pair", "--source-slots", "x"], "--source-slots 'x': give a slot range"),
    (["run", "donor-pair", "--decoy", "bogus"], "--decoy 'bogus': use one of"),
    (["run", "donor-pair", "--states", "ONLINE"], "--states ONLINE: give at least two distinct state words"),
    (["run", "donor-pair", "--states", "ONLINE,online"], "--states ONLINE,online:"),
    (["run", "donor-pair", "--states", ","], "--states ',': give a comma-separated list"),
    (["run", "donor-pair", "--arms", "isolated"], "--arms isolated: give arms of kv,"),
    (["run", "donor-pair", "--arms", "kv,kv"], "--arms kv,kv: give arms of"),
    (["run", "donor-pair", "--arms", "kv,bogus"], "--arms kv,bogus:"),
    (["run", "donor-pair", "--arms", "kv,kv-all"], "--arms kv,kv-all: kv-all is checked against text-all"),
    (["run", "donor-pair", "--readout", "bogus"], "--readout 'bogus': use generate, logits or both"),
    (["run", "donor-pair", "--batch-pairs", "0"], "--batch-pairs 0: give a whole number of items >= 1"),
    (["run", "landing", "--batch-pairs", "-2"], "--batch-pairs -2:"),
    (["contract", "--batch-pairs", "0"], "--batch-pairs 0:"),
    # run trigger-bank / landing / access / carriers / patch
    (["run", "trigger-bank", "--arms", "text"], "--arms text: give arms of kv, text, isolated"),
    (["run", "trigger-bank", "--max-new-tokens", "0"], "--max-new-tokens 0:"),
    (["run", "trigger-bank", "--items", "0"], "--items 0:"),
    (["run", "landing", "--tost-margin", "0"], "--tost-margin 0.0: give a margin strictly between 0 and 1"),
    (["run", "landing", "--tost-margin", "1"], "--tost-margin 1.0:"),
    (["run", "landing", "--tost-margin", "nan"], "--tost-margin nan:"),
    (["run", "landing", "--tost-margin", "inf"], "--tost-margin inf:"),
    (["run", "landing", "--tost-margin", "abc"], "--tost-margin 'abc': input should be a valid number"),
    (["run", "landing", "--max-new-tokens", "-1"], "--max-new-tokens -1:"),
    (["run", "landing", "--threads", "0"], "--threads 0:"),
    (["run", "access", "--cardinalities", "binary,hex"], "--cardinalities binary,hex: give payload cardinalities"),
    (["run", "access", "--cardinalities", "binary,binary"], "--cardinalities binary,binary:"),
    (["run", "access", "--cardinalities", ","], "--cardinalities ',': give a comma-separated list"),
    (["run", "carriers", "--kinds", "passive,bogus"], "--kinds passive,bogus: give carrier kinds"),
    (["run", "carriers", "--kinds", "passive,passive"], "--kinds passive,passive:"),
    (["run", "patch", "--lengths", "2"], "--lengths 2: give distinct history lengths of at least 4 events"),
    (["run", "patch", "--lengths", "24,24"], "--lengths 24,24:"),
    (["run", "patch", "--lengths", "24,x"], "--lengths '24,x': give comma-separated integers"),
    (["run", "patch", "--timing-repeats", "0"], "--timing-repeats 0: time each update at least once"),
    (["run", "patch", "--max-new-tokens", "0"], "--max-new-tokens 0:"),
    # contract
    (["contract", "--items", "1"], "--items 1: the contract needs at least 2 items per probe"),
    (["contract", "--items", "-5"], "--items -5:"),
    (["contract", "--threads", "0"], "--threads 0:"),
    # splice
    (["splice", "--cutoffs", "5-2"], "runs backwards"),
    (["splice", "--cutoffs", "x"], "--cutoffs 'x': give 'all' or comma-separated layer numbers"),
    (["splice", "--steps", "-1"], "--steps -1: give distinct decoding steps >= 0"),
    (["splice", "--steps", "0,0"], "--steps 0,0:"),
    (["splice", "--steps", "16"], "--steps 16 is not below --max-new-tokens 16"),
    (["splice", "--heads", "-1"], "--heads -1: give distinct KV head indices >= 0"),
    (["splice", "--heads", "0,0"], "--heads 0,0:"),
    (["splice", "--arms", "clean"], "--arms '': give splice arms"),
    (["splice", "--arms", "mask,mask"], "--arms mask,mask:"),
    (["splice", "--arms", "mask,bogus"], "--arms mask,bogus:"),
    (["splice", "--batch-size", "0"], "--batch-size 0: decode at least 1 splice per batch"),
    (["splice", "--max-new-tokens", "0"], "--max-new-tokens 0:"),
    (["splice", "--items", "0"], "--items 0:"),
    (["splice", "--threads", "0"], "--threads 0:"),
    (["splice", "--filler", ""], "--filler '': give a non-empty scaffold filler text"),
    (["splice", "--layer-set", "below"], "--layer-set 'below'"),
    (["splice", "--tail", "x"], "--tail 'x'"),
    (["splice", "--match", "fuzzy"], "--match 'fuzzy'"),
    (["splice", "--readout", "vote"], "--readout 'vote'"),
]


def _cli_args(args, jsonl, out_dir):
    if args[0] == "query":
        given = set(args)
        base = (
            ["query", "--log", str(jsonl)]
            + ([] if "--serve" in given else ["--serve", "a"])
            + ([] if "-q" in given else ["-q", "which?"])
        )
        return base + args[1:]
    return [*args, "--out", str(out_dir), "--no-progress"]


def _assert_one_line_exit_2(code, out, err, message, out_dir):
    assert code == 2, (out, err)
    assert message in err, err
    assert "Traceback" not in err + out
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
    assert not out_dir.exists()


@pytest.mark.parametrize("args, message", _BAD_OPTIONS, ids=[" ".join(a) for a, _ in _BAD_OPTIONS])
def test_every_bad_option_is_one_line_before_the_model_loads(monkeypatch, capsys, tmp_path, jsonl, args, message):
    def no_load(*a, **k):
        raise AssertionError("the model must not load for a bad option")

    monkeypatch.setattr(eventkv.models, "load", no_load)
    monkeypatch.setenv("EVENTKV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLUMNS", "400")  # one line, however long the message
    out_dir = tmp_path / "out"
    code, out, err = run_cli(monkeypatch, capsys, *_cli_args(args, jsonl, out_dir))
    _assert_one_line_exit_2(code, out, err, message, out_dir)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["splice", "--heads", "5"], "--heads 5: this model has 2 KV heads per layer: give heads 0..1."),
        (["splice", "--cutoffs", "99"], "cutoff 99 is outside 0..2 for this 2-layer model"),
    ],
)
def test_options_the_model_decides_leave_no_run_directory(monkeypatch, capsys, tmp_path, fake_load, args, message):
    monkeypatch.setenv("COLUMNS", "400")
    out_dir = tmp_path / "out"
    code, out, err = run_cli(monkeypatch, capsys, *args, "--out", str(out_dir), "--no-progress")
    _assert_one_line_exit_2(code, out, err, message, out_dir)


def test_splice_items_beyond_the_task_file(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(eventkv.models, "load", lambda *a, **k: (_ for _ in ()).throw(AssertionError("no load")))
    monkeypatch.setenv("COLUMNS", "400")
    task = tmp_path / "items.jsonl"
    task.write_text("\n".join(json.dumps({"prompt": f"say {w}", "answer": w}) for w in ("yes", "no")) + "\n")
    out_dir = tmp_path / "out"
    code, out, err = run_cli(monkeypatch, capsys, "splice", "--task", str(task), "--items", "5", "--out", str(out_dir))
    _assert_one_line_exit_2(code, out, err, "--items 5: the task file holds 2 items: use --items 2 or fewer.", out_dir)


def test_library_option_errors_name_the_field():
    from eventkv.errors import OptionError
    from eventkv.studies.materialization.donor_pair import DonorPair
    from eventkv.studies.materialization.landing import Landing
    from eventkv.studies.materialization.patch import Patch
    from eventkv.studies.splice.probe import SpliceProbe

    for make, field in (
        (lambda: DonorPair(max_new_tokens=0), "max_new_tokens 0:"),
        (lambda: DonorPair(n_events=24.0), "n_events 24.0:"),
        (lambda: DonorPair(arm_names=("kv", "kv")), "arm_names kv,kv:"),
        (lambda: Landing(tost_margin=float("nan")), "tost_margin nan:"),
        (lambda: Landing(tost_margin=True), "tost_margin True:"),
        (lambda: Patch(lengths=(24.5, 48)), "lengths 24.5,48:"),
        (lambda: SpliceProbe(steps=(0, "1")).validate(), "steps 0,1:"),
        (lambda: SpliceProbe(batch_size=0).validate(), "batch_size 0:"),
    ):
        with pytest.raises(OptionError) as exc:
            make()
        assert str(exc.value).startswith(field), str(exc.value)
    with pytest.raises(OptionError, match=r"^chunk_size -1: give a positive number"):
        answer(None, EventLog([Event("a", "x")]), "a", "q?", chunk_size=-1)


def test_cli_help_and_good_values_still_exit_0(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "run", "donor-pair", "--help")
    assert code == 0 and "--max-new-tokens" in out
