"""Inputs a new user gives on a fresh clone, and others of the same kinds:
each gives one line and exit 2 with nothing written, or the right value."""

from __future__ import annotations

import os

import pytest
import torch
from cli_fixtures import run_cli

import eventkv.models
from eventkv.errors import EventKVError
from eventkv.kv.log import Event, EventLog, tokenize, tokenize_query
from eventkv.kv.prefill import prefill
from eventkv.kv.readout import generate
from eventkv.kv.serve import serve
from eventkv.testing import tiny_lm


@pytest.fixture()
def no_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model must not load for a bad option")

    monkeypatch.setattr(eventkv.models, "load", refuse)


def _one_line_exit_2(code, out, err, message):
    assert code == 2, (code, out, err)
    assert "Traceback" not in out + err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert message in err, err


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["run", "donor-pair", "--threads", "100000"],
            f"--threads 100000: give 1 to {os.cpu_count()} torch CPU threads",
        ),
        (["run", "donor-pair", "--dtype", "fp8"], "--dtype 'fp8': not supported; use one of auto, float32, bfloat16"),
        (["splice", "--dtype", "bf32"], "--dtype 'bf32': not supported"),
        (["contract", "--threads", "100000"], "--threads 100000: give 1 to"),
        (["contract", "--dtype", "fp8"], "--dtype 'fp8': not supported"),
        (["run", "landing", "--dtype", "fp8"], "--dtype 'fp8': not supported"),
        (["run", "patch", "--items", "0", "--threads", "0", "--dtype", "fp8"], "--items 0: run at least one item"),
        (["splice", "--threads", "0", "--dtype", "fp8"], "--threads 0: give 1 to"),
    ],
)
def test_more_bad_run_options(monkeypatch, capsys, tmp_path, no_load, args, message):
    out_dir = tmp_path / "out"
    _one_line_exit_2(*run_cli(monkeypatch, capsys, *args, "--out", str(out_dir)), message)
    assert not out_dir.exists()


@pytest.mark.parametrize("command", [["run", "donor-pair"], ["run", "landing"], ["splice"], ["contract"]])
def test_out_that_is_a_file_fails_before_the_model_loads(monkeypatch, capsys, tmp_path, no_load, command):
    f = tmp_path / "README.md"
    f.write_text("not a directory\n")
    _one_line_exit_2(
        *run_cli(monkeypatch, capsys, *command, "--out", str(f)), f"--out '{f}': that path is a file, not a directory"
    )
    assert f.read_text() == "not a directory\n"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--serve", "a,,c"], "--serve 'a,,c': an entry is empty"),
        (["--serve", "a,"], "--serve 'a,': an entry is empty"),
        (["--serve", "a", "--candidates", "x,,y"], "--candidates x,,y: give distinct, non-empty candidate answers"),
        (["--serve", "a", "--store", "FILE"], "that path is a file, not a directory"),
        (["--serve", "a", "--positions", "packed"], "--positions 'packed': use one of original, contiguous."),
        (["--serve", "a", "--mode", "native", "--positions", "contiguous"], "serving mode 'native' keeps every row"),
    ],
)
def test_more_bad_query_options(monkeypatch, capsys, tmp_path, jsonl, no_load, extra, message):
    f = tmp_path / "FILE"
    f.write_text("x")
    extra = [str(f) if e == "FILE" else e for e in extra]
    _one_line_exit_2(*run_cli(monkeypatch, capsys, "query", "--log", str(jsonl), "-q", "which?", *extra), message)


def test_max_new_tokens_past_the_context_is_named_before_anything_is_written(monkeypatch, capsys, tmp_path, jsonl):
    lm = tiny_lm("llama")  # max_position_embeddings 4096
    monkeypatch.setattr(eventkv.models, "load", lambda *a, **k: lm)
    store = tmp_path / "store"
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "query",
        "--log",
        str(jsonl),
        "--serve",
        "a",
        "-q",
        "which?",
        "--max-new-tokens",
        "100000",
        "--store",
        str(store),
    )
    tlog = tokenize(EventLog.from_jsonl(jsonl), lm.tokenizer, lm.profile)
    q = len(tokenize_query(lm.tokenizer, lm.profile, "which?"))
    used = tlog.span("<header>").n_tokens + tlog.span("a").n_tokens + q  # the default: contiguous positions
    _one_line_exit_2(
        code,
        out,
        err,
        f"--max-new-tokens 100000: the header, the served events and the query take {used} of the "
        f"model's 4096 positions (contiguous positions): give at most {4096 - used} new tokens.",
    )
    assert not store.exists()
    # at the original positions the whole history counts
    code, out, err = run_cli(
        monkeypatch, capsys, "query", "--log", str(jsonl), "--serve", "a", "-q", "which?", "--max-new-tokens",
        "100000", "--store", str(store), "--positions", "original",
    )  # fmt: skip
    used = tlog.history_end + q
    _one_line_exit_2(
        code,
        out,
        err,
        f"--max-new-tokens 100000: the history and the query take {used} of the "
        f"model's 4096 positions: give at most {4096 - used} new tokens.",
    )
    assert not store.exists()


def test_query_positions_contiguous_answers_as_serve_does(monkeypatch, capsys, tmp_path, jsonl):
    lm = tiny_lm("llama")
    monkeypatch.setattr(eventkv.models, "load", lambda *a, **k: lm)
    args = ["query", "--log", str(jsonl), "--serve", "c", "-q", "which?", "--max-new-tokens", "3"]
    code, out, err = run_cli(monkeypatch, capsys, *args, "--positions", "contiguous", "--store", str(tmp_path / "s"))
    assert code in (None, 0), err
    assert "(compact, contiguous positions)" in out
    ekv = prefill(lm.model, tokenize(EventLog.from_jsonl(jsonl), lm.tokenizer, lm.profile))
    sc = serve(ekv, ["c"], "compact", lm.model, positions="contiguous")
    q = tokenize_query(lm.tokenizer, lm.profile, "which?")
    text = generate(
        lm.model, sc, q, max_new_tokens=3, stop_token_ids=lm.profile.stop_token_ids, tokenizer=lm.tokenizer
    ).text
    assert f"answer: {text.strip()}" in " ".join(out.split())


def test_a_given_store_holding_another_eventkv_is_refused_not_overwritten(monkeypatch, capsys, tmp_path, jsonl):
    lm = tiny_lm("llama")
    monkeypatch.setattr(eventkv.models, "load", lambda *a, **k: lm)
    store = tmp_path / "store"
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "query",
        "--log",
        str(jsonl),
        "--serve",
        "a",
        "-q",
        "which?",
        "--max-new-tokens",
        "2",
        "--store",
        str(store),
    )
    assert code is None or code == 0, err
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    other = tmp_path / "other.jsonl"
    other.write_text('{"id": "a", "text": "another history"}\n')
    code, out, err = run_cli(
        monkeypatch,
        capsys,
        "query",
        "--log",
        str(other),
        "--serve",
        "a",
        "-q",
        "which?",
        "--max-new-tokens",
        "2",
        "--store",
        str(store),
    )
    _one_line_exit_2(code, out, err, f"--store '{store}' already holds a different EventKV (another log)")
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before


def test_event_log_lines_name_repeats_and_accept_a_bom(tmp_path):
    p = tmp_path / "e.jsonl"
    p.write_bytes(b'\xef\xbb\xbf{"id": "e0", "text": "hi"}\n\n{"id": "e0", "text": "again"}\n')
    with pytest.raises(EventKVError, match=rf"^{p}:3 repeats event id 'e0' \(first on line 1\)"):
        EventLog.from_jsonl(p)
    p.write_bytes(b'{"id": "e0", "text": "hi", "text": "ho"}\n')
    with pytest.raises(EventKVError, match=rf"^{p}:1 gives the key 'text' twice"):
        EventLog.from_jsonl(p)
    p.write_bytes(b'\xef\xbb\xbf{"id": "e0", "text": "hi"}\n')  # a Windows editor's byte-order mark
    assert EventLog.from_jsonl(p).events == [Event("e0", "hi")]


def test_rows_of_another_model_are_refused_with_their_layout():
    a, b = tiny_lm("llama"), tiny_lm("gemma3")  # 2 vs 3 layers
    tlog = tokenize(EventLog([Event("a", "hello there")]), a.tokenizer, a.profile)
    ekv = prefill(a.model, tlog)
    with pytest.raises(
        EventKVError,
        match=r"^the KV rows have 2 layers x 2 KV heads x head dim 16 but the model has "
        r"3 x 2 x 16: they were made by another model",
    ):
        generate(b.model, serve(ekv, "all"), tokenize_query(a.tokenizer, a.profile, "hi"), max_new_tokens=2)


def test_eventkv_to_takes_dtype_names_and_refuses_non_float_dtypes():
    lm = tiny_lm("llama")
    ekv = prefill(lm.model, tokenize(EventLog([Event("a", "hello")]), lm.tokenizer, lm.profile))
    assert ekv.to("bfloat16").dtype == "bfloat16" and ekv.to(torch.float16).dtype == "float16"
    for bad in (torch.int8, "int8", "fp8"):
        with pytest.raises(EventKVError, match=r"give a floating-point dtype"):
            ekv.to(bad)
    with pytest.raises(EventKVError, match=r"^EventKV.to\(device='nope'\): not a torch device"):
        ekv.to(device="nope")
