"""The faithfulness gates on a CUDA GPU. Marked ``cuda``; skipped where torch sees
no GPU. ``pytest -m cuda`` runs only these.

Run on one NVIDIA H200 (torch 2.11.0+cu130): all pass; the measured maxima are in ``docs/devices.md``
(float32 GPU vs CPU at most 1.1e-5, bfloat16 at most 1.3% of the largest logit).
``EVENTKV_CUDA_REPORT=cuda-measured.json pytest -m cuda`` writes every measured maximum;
``EVENTKV_CUDA_TEST_DEVICE=cpu`` runs the file's logic with the "GPU" side on the CPU (a check of the
tests themselves, not of CUDA).

What is checked, on tiny random models (the four attention variants of ``tests/test_gates.py``) and a
tiny model directory for the CLI:

* the data path's gates with the model on the GPU in float32 — serving all events equals a fresh
  prefill (greedy, 8 steps), a subset compact equals native, native equals a masked fresh forward,
  isolated first event equals compact, text-all equals kv-all, candidate scores equal token-by-token
  log-softmax, chunked and prefix prefills equal one pass, a stored EventKV reads back to the GPU
  bitwise — each within ``TOL_F32``, as on the CPU;
* the GPU against the CPU: float32 on the GPU within ``TOL_F32`` of float32 on the CPU on every serving
  mode's logits and candidate scores; bfloat16 on the GPU within ``TOL_BF16_REL`` (relative to the
  largest logit) of float32 on the CPU;
* the subsystems on the GPU against the CPU in float32: the splice engine (generation and forced
  choice, every arm including the per-head mask), EventMemory (its gate, and a store made on the CPU
  opened on the GPU), eviction's per-head masked serving, and the CLI (``query`` reusing its store,
  ``run donor-pair`` records and the device in the manifest);
* ``load`` and ``--device auto`` pick the GPU, and bfloat16 where the GPU has it natively.

Tolerances (absolute, in logits or nats, unless relative):

* ``TOL_F32 = 1e-4`` — the CPU gates' tolerance (measured there: ~3e-7; on the H200 at most 1.1e-5).
  float32 on CUDA here means IEEE float32 matmuls (torch's default ``float32_matmul_precision ==
  "highest"``, asserted below): TF32 would move logits by ~1e-3 and fail these.
* ``TOL_BF16_REL = 0.03`` — bfloat16 vs float32: max |Δlogit| <= 3% of the largest |logit| (on the
  H200 at most 1.26%). Reference point: bfloat16 on this CPU vs float32 gave 0.6%–1.2% on these
  fixtures (2.7e-3 to 5.3e-3 on logits up to 0.65). No greedy token comparison in bfloat16 (the
  fixtures' top-two margins are not bf16-safe).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_gates import make_log  # the gates' log: 10 random events, every third with a position budget

from eventkv.kv.log import Event, EventLog, TokenizedLog, tokenize, tokenize_query
from eventkv.kv.prefill import prefill
from eventkv.kv.readout import candidate_logprobs, generate, query_logits
from eventkv.kv.rows import EventKV
from eventkv.kv.serve import SERVE_MODES, serve
from eventkv.testing import TINY_FAMILIES, assert_same_greedy, tiny_lm, tiny_model

DEVICE = os.environ.get("EVENTKV_CUDA_TEST_DEVICE", "cuda")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        DEVICE.startswith("cuda") and not torch.cuda.is_available(),
        reason="no CUDA GPU (torch.cuda.is_available() is False)",
    ),
]

TOL_F32 = 1e-4
TOL_BF16_REL = 0.03
QUERY = [5, 6, 7, 8]
SUBSET = ["e1", "e4", "e8"]
SIDES = (("ref", "cpu"), ("dev", DEVICE))
"""The two sides of a GPU-against-CPU comparison: the CPU reference and the device under test."""
MEASURED: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report():
    """IEEE float32 on the GPU (else the float32 tolerance means nothing); at the end, the measured
    maxima, printed and written to ``$EVENTKV_CUDA_REPORT`` when set."""
    assert torch.get_float32_matmul_precision() == "highest", "TF32 is on: float32 results move by ~1e-3"
    yield
    name = torch.cuda.get_device_name() if DEVICE.startswith("cuda") else f"{DEVICE} (dry run)"
    report = {"device": name, "torch": torch.__version__, "measured": dict(sorted(MEASURED.items()))}
    print("\ncuda measured:", json.dumps(report, indent=1))
    if os.environ.get("EVENTKV_CUDA_REPORT"):
        with open(os.environ["EVENTKV_CUDA_REPORT"], "w") as f:
            json.dump(report, f, indent=1)


def measure(tag: str, value: float) -> float:
    MEASURED[tag] = max(MEASURED.get(tag, 0.0), value)
    return value


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over two tensors on any devices (compared on the CPU in float64)."""
    return float((a.detach().double().cpu() - b.detach().double().cpu()).abs().max())


def cpu(tensors):
    return [t.detach().float().cpu() for t in tensors]


_MODELS: dict = {}


def model(family: str, where: str, dtype: torch.dtype = torch.float32, **kw):
    """The tiny random ``family`` model (the same weights everywhere) on ``where`` in ``dtype``."""
    key = (family, where, dtype, tuple(sorted(kw.items())))
    if key not in _MODELS:
        _MODELS[key] = tiny_model(family, dtype=dtype, **kw).to(where)
    return _MODELS[key]


def fresh_logits(m, ids, positions, attention_mask=None) -> torch.Tensor:
    """One uncached forward on the model's device: logits ``[len, vocab]`` (float32)."""
    dev = next(m.parameters()).device
    with torch.no_grad():
        out = m(
            input_ids=torch.tensor([ids], device=dev),
            position_ids=torch.tensor([positions], device=dev),
            attention_mask=attention_mask,
        )
    return out.logits[0].float()


# ====================================================================== the data path's gates on the GPU


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("mode", ["compact", "native"])
def test_cuda_gate_all_events_equals_fresh_prefill(family, mode):
    m = model(family, DEVICE)
    log = make_log()
    ekv = prefill(m, log)
    assert ekv.keys[0].device.type == torch.device(DEVICE).type and ekv.positions.device.type == "cpu"
    gen = generate(m, serve(ekv, "all", mode), QUERY, max_new_tokens=8, keep_logits=True)
    ids = log.input_ids + QUERY + gen.tokens
    pos = log.position_ids + list(range(log.history_end, log.history_end + len(QUERY) + 8))
    ref = fresh_logits(m, ids, pos)[log.n_rows + len(QUERY) - 1 :][:8].cpu()
    measure("f32 gpu: all served vs fresh", max(diff(a, b) for a, b in zip(gen.logits, ref)))
    assert_same_greedy(gen.tokens, cpu(gen.logits), [int(r.argmax()) for r in ref], list(ref), TOL_F32)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_cuda_gate_serving_paths_agree(family, tmp_path):
    m = model(family, DEVICE)
    log = make_log()
    ekv = prefill(m, log, weights_digest="w")
    # chunked and prefix prefills equal one pass
    head = TokenizedLog.from_ids(log.header_ids, [(log.event_ids[0], log.event_tokens[0], log.budgets[0])])
    for other in (prefill(m, log, chunk_size=7), prefill(m, log, prefix=prefill(m, head))):
        d = max(diff(a, b) for a, b in zip(ekv.keys + ekv.values, other.keys + other.values))
        assert measure("f32 gpu: chunked/prefix prefill vs one pass", d) <= 1e-5
    # isolated first event == compact; text-all == kv-all without budgets
    a = query_logits(m, serve(ekv, ["e0"], "compact"), QUERY)
    b = query_logits(m, serve(ekv, ["e0"], "isolated", model=m), QUERY)
    assert measure("f32 gpu: isolated e0 vs compact", diff(a, b)) <= TOL_F32
    plain = prefill(m, make_log(budgets=False))
    a = query_logits(m, serve(plain, "all", "compact"), QUERY)
    b = query_logits(m, serve(plain, "all", "text", model=m), QUERY)
    assert measure("f32 gpu: text-all vs kv-all", diff(a, b)) <= TOL_F32
    # a subset: compact == native (full attention; Gemma 3 with a window over the whole history)
    mw = model("gemma3", DEVICE, sliding_window=128) if family == "gemma3" else m
    ew = prefill(mw, log)
    gc = generate(mw, serve(ew, SUBSET, "compact"), QUERY, max_new_tokens=8, keep_logits=True)
    gn = generate(mw, serve(ew, SUBSET, "native"), QUERY, max_new_tokens=8, keep_logits=True)
    measure("f32 gpu: subset compact vs native", max(diff(x, y) for x, y in zip(gc.logits, gn.logits)))
    assert_same_greedy(gc.tokens, cpu(gc.logits), gn.tokens, cpu(gn.logits), TOL_F32)
    # candidate scores == token-by-token log-softmax of the query's logits
    cands = [[10], [11, 12, 13], [14, 15]]
    for mode in ("compact", "native"):
        scores = candidate_logprobs(m, serve(ekv, SUBSET, mode), QUERY, cands)
        for cand, score in zip(cands, scores):
            served = serve(ekv, SUBSET, mode)
            total = sum(
                float(torch.log_softmax(query_logits(m, served, QUERY + cand[:j]).double(), -1)[cand[j]])
                for j in range(len(cand))
            )
            assert measure("f32 gpu: candidate score vs token by token", abs(score.logprob - total)) <= TOL_F32
    # a stored EventKV reads back to the GPU bitwise
    ekv.save(tmp_path / "kv")
    back = EventKV.load(tmp_path / "kv", expect_digest="w", device=DEVICE)
    assert all(torch.equal(x, y) for x, y in zip(ekv.keys + ekv.values, back.keys + back.values))
    d = diff(query_logits(m, serve(ekv, SUBSET), QUERY), query_logits(m, serve(back, SUBSET), QUERY))
    assert measure("f32 gpu: stored and read back vs in memory", d) <= TOL_F32


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_cuda_gate_native_equals_a_masked_fresh_forward(family):
    m = model(family, DEVICE)
    log = make_log()
    ekv = prefill(m, log)
    got = query_logits(m, serve(ekv, SUBSET, "native"), QUERY)
    keep = torch.zeros(log.n_rows, dtype=torch.bool, device=DEVICE)
    keep[ekv.rows_of(SUBSET).to(DEVICE)] = True
    n = log.n_rows + len(QUERY)
    window = getattr(m.config, "sliding_window", None)
    masks = {}
    for kind in ("full_attention", "sliding_attention"):
        allowed = torch.ones(n, n, dtype=torch.bool, device=DEVICE).tril()
        if kind == "sliding_attention" and window:
            allowed &= ~torch.ones(n, n, dtype=torch.bool, device=DEVICE).tril(-window)
        allowed[log.n_rows :, : log.n_rows] &= keep
        masks[kind] = allowed[None, None]
    pos = log.position_ids + list(range(log.history_end, log.history_end + len(QUERY)))
    mask = masks if family == "gemma3" else masks["full_attention"]
    ref = fresh_logits(m, log.input_ids + QUERY, pos, attention_mask=mask)[-1]
    assert measure("f32 gpu: native vs masked fresh forward", diff(got, ref)) <= TOL_F32


# ====================================================================== the GPU against the CPU


def _readouts(m, log, subset=SUBSET):
    """Per serving mode, the query's logits and three candidates' scores: ``{mode: (logits, scores)}``."""
    ekv = prefill(m, log)
    out = {}
    for mode in SERVE_MODES:
        served = serve(ekv, subset, mode, model=m)
        scores = candidate_logprobs(m, served, QUERY, [[10], [11, 12, 13], [14, 15]])
        out[mode] = (query_logits(m, served, QUERY).cpu(), [s.logprob for s in scores])
    return out


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_cuda_float32_matches_the_cpu(family):
    log = make_log()
    ref = _readouts(model(family, "cpu"), log)
    got = _readouts(model(family, DEVICE), log)
    for mode in SERVE_MODES:
        assert measure(f"f32 gpu vs cpu: logits ({mode})", diff(got[mode][0], ref[mode][0])) <= TOL_F32, mode
        d = max(abs(x - y) for x, y in zip(got[mode][1], ref[mode][1]))
        assert measure("f32 gpu vs cpu: candidate scores", d) <= TOL_F32, mode


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_cuda_bfloat16_matches_the_cpu_float32(family):
    log = make_log()
    ref = _readouts(model(family, "cpu"), log)
    m = model(family, DEVICE, torch.bfloat16)
    got = _readouts(m, log)
    for mode in SERVE_MODES:
        scale = float(ref[mode][0].abs().max())
        rel = diff(got[mode][0], ref[mode][0]) / scale
        assert measure(f"bf16 gpu vs f32 cpu: logits, relative ({mode})", rel) <= TOL_BF16_REL, mode
    # one bf16 path against another on the GPU: all events served vs a fresh bf16 forward
    ekv = prefill(m, log)
    pos = log.position_ids + list(range(log.history_end, log.history_end + len(QUERY)))
    fresh = fresh_logits(m, log.input_ids + QUERY, pos)[-1]
    for mode in ("compact", "native"):
        rel = diff(query_logits(m, serve(ekv, "all", mode), QUERY), fresh) / float(fresh.abs().max())
        assert measure("bf16 gpu: all served vs fresh, relative", rel) <= TOL_BF16_REL, mode


def test_cuda_load_picks_the_gpu_and_native_bf16(tiny_dir):
    from eventkv.models import load, native_bf16

    if not DEVICE.startswith("cuda"):
        pytest.skip("dry run: device auto is the CPU")
    lm = load(str(tiny_dir))  # dtype and device auto
    assert lm.profile.device.startswith("cuda") and lm.profile.device_reason.startswith("auto: CUDA device ")
    assert lm.profile.dtype == ("bfloat16" if native_bf16("cuda")[0] else "float32"), lm.profile.dtype_reason
    lm = load(str(tiny_dir), dtype="float32", device=DEVICE)
    assert str(lm.model.device).startswith("cuda") and lm.model.dtype == torch.float32


# ====================================================================== the subsystems on the GPU


def _sharp(lm):
    """Output layer x 30: logits spread like a trained model's, so greedy steps have clear margins."""
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(30.0)
    return lm


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_cuda_splice_engine_matches_the_cpu(family):
    from eventkv.studies.splice.engine import (
        Splice,
        SplicePrompt,
        clean_run,
        donor_rows,
        filler_ids,
        splice_choice,
        splice_sweep,
    )

    class Profile:
        chat_head = "<|im_start|>user\n"
        chat_tail = "<|im_end|>\n<|im_start|>assistant\n"

    results = {}
    for side, where in SIDES:
        lm = _sharp(tiny_lm(family))
        lm.model.to(where)
        prompt = SplicePrompt.from_text(lm.tokenizer, Profile, "Table: a=3, b=7, c=1. What is b?")
        run = clean_run(lm.model, prompt, max_new_tokens=6, keep_logits=True)
        donors = {"scaffold": donor_rows(lm.model, run, filler_ids(lm.tokenizer, len(prompt.span_ids)))}
        n = lm.model.config.num_hidden_layers
        cells = [
            Splice("scaffold", tuple(range(1, n))),
            Splice("zero-kv", tuple(range(n))),
            Splice("mask", tuple(range(n)), heads=(0,)),
            Splice("mask", tuple(range(1, n)), step=1),
            Splice("mean", (n - 1,)),
        ]
        swept = splice_sweep(lm.model, run, cells, max_new_tokens=6, donors=donors, keep_logits=True)
        choice = splice_choice(
            lm.model, run, [c for c in cells if c.step == 0], [[40, 41], [42], [43, 44, 45]], donors=donors
        )
        results[side] = (run, swept, choice)
    (run_c, swept_c, choice_c), (run_g, swept_g, choice_g) = results["ref"], results["dev"]
    measure("f32 gpu vs cpu: splice clean run", max(diff(a, b) for a, b in zip(run_g.logits, run_c.logits)))
    assert_same_greedy(run_g.tokens, cpu(run_g.logits), run_c.tokens, cpu(run_c.logits), TOL_F32)
    for g, c in zip(swept_g, swept_c):
        if g.logits:
            measure("f32 gpu vs cpu: splice sweep", max(diff(a, b) for a, b in zip(g.logits, c.logits)))
        assert_same_greedy(g.tokens, cpu(g.logits), c.tokens, cpu(c.logits), TOL_F32)
    d = max(abs(x - y) for gr, cr in zip(choice_g, choice_c) for x, y in zip(gr, cr))
    assert measure("f32 gpu vs cpu: splice choice", d) <= TOL_F32


def test_cuda_memory_gate_and_a_store_made_on_the_cpu(tmp_path):
    from eventkv.memory import EventMemory

    events = ["Dana lives in Lisbon.", {"text": "Ravi drinks green tea.", "id": "ravi", "budget": 40}, "Mei: Friday."]
    question = "What does Ravi drink?"
    answers = {}
    for side, where in SIDES:
        lm = _sharp(tiny_lm("qwen2"))
        lm.model.to(where)
        with EventMemory.create(tmp_path / side, lm, namespace="n") as mem:
            mem.add(events)
            mem.update("ravi", "Ravi switched to coffee.", prefill=True)
            ans = mem.query(question, select="all", max_new_tokens=6, keep_logits=True)
            # the gate: a fresh prefill of the same header + events, all served
            tlog = tokenize(mem.event_log("all"), lm.tokenizer, lm.profile)
            q = tokenize_query(lm.tokenizer, lm.profile, question)
            ref = generate(lm.model, serve(prefill(lm.model, tlog), "all"), q, max_new_tokens=6, keep_logits=True)
            g = ans.generation
            assert_same_greedy(g.tokens, cpu(g.logits), ref.tokens, cpu(ref.logits), TOL_F32)
            measure("f32 gpu: memory query vs fresh prefill", max(diff(a, b) for a, b in zip(g.logits, ref.logits)))
            answers[side] = g
        if side == "dev":  # the CPU's store opened on the GPU: the device is not part of a store's identity
            with EventMemory.open(tmp_path / "ref", lm) as mem:
                assert mem._ekv.keys[0].device.type == torch.device(where).type
                again = mem.query(question, select="all", max_new_tokens=6, keep_logits=True).generation
                d = max(diff(a, b) for a, b in zip(again.logits, answers["ref"].logits))
                assert measure("f32 gpu vs cpu: memory store made on the cpu", d) <= TOL_F32
    g, c = answers["dev"], answers["ref"]
    measure("f32 gpu vs cpu: memory query", max(diff(a, b) for a, b in zip(g.logits, c.logits)))
    assert_same_greedy(g.tokens, cpu(g.logits), c.tokens, cpu(c.logits), TOL_F32)


def test_cuda_eviction_masked_serving_matches_the_cpu():
    from eventkv.eviction import keep_mask, make_policy
    from eventkv.eviction.capture import capture_prefill
    from eventkv.eviction.masked import read_out_masked

    events = [Event("a", "register A set to ON", budget=40), Event("b", "B mirrors A"), Event("c", "C is 7")]
    scores, masks = {}, None
    for side, where in SIDES:
        lm = _sharp(tiny_lm("llama"))
        lm.model.to(where)
        log = tokenize(EventLog(events), lm.tokenizer, lm.profile)
        ekv, caps = capture_prefill(lm.model, log, window=8)
        assert {c.keys.device.type for c in caps} == {"cpu"}  # the rules compute on the CPU
        if masks is None:  # the CPU's masks on both devices: the same rows kept
            masks = [keep_mask(make_policy("snapkv", window=8), c, 0.5) for c in caps]
        q = tokenize_query(lm.tokenizer, lm.profile, "What is A?")
        opts = {"candidates": [[40], [41, 42]], "max_context": None}
        full = read_out_masked(lm.model, ekv, [torch.ones_like(m) for m in masks], q, **opts)
        plain = candidate_logprobs(lm.model, serve(ekv, "all", "native"), q, [[40], [41, 42]])
        d = max(abs(a.logprob - b.logprob) for a, b in zip(full.candidates, plain))
        assert measure("f32 gpu: keep-all mask vs native serving", d) <= TOL_F32
        kept = read_out_masked(lm.model, ekv, masks, q, **opts)
        iso = read_out_masked(lm.model, serve(ekv, "all", "isolated", model=lm.model), masks, q, **opts)
        scores[side] = [c.logprob for r in (kept, iso) for c in r.candidates]
    d = max(abs(a - b) for a, b in zip(scores["dev"], scores["ref"]))
    assert measure("f32 gpu vs cpu: per-head masked serving", d) <= TOL_F32


# ====================================================================== the CLI on the GPU


def _numbers(x, path=""):
    """Every number in a JSON record, by path (strings and bools left out: they follow from the numbers)."""
    if isinstance(x, dict):
        return {k: v for key in sorted(x) for k, v in _numbers(x[key], f"{path}/{key}").items()}
    if isinstance(x, list):
        return {k: v for i, e in enumerate(x) for k, v in _numbers(e, f"{path}[{i}]").items()}
    return {path: float(x)} if isinstance(x, (int, float)) and not isinstance(x, bool) else {}


def test_cuda_cli_runs_and_records_the_device(tiny_dir, tmp_path, monkeypatch, capsys):
    from typer.testing import CliRunner

    from eventkv.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EVENTKV_CACHE", str(tmp_path / "cache"))
    runner = CliRunner()
    log = tmp_path / "events.jsonl"
    log.write_text('{"id": "a", "text": "Dana lives in Lyon."}\n{"id": "b", "text": "Ravi drinks tea."}\n')
    query = ["query", "-m", str(tiny_dir), "--log", str(log), "--serve", "a", "-q", "Who?", "--max-new-tokens", "3"]
    query += ["--dtype", "float32", "--device", DEVICE, "--candidates", "Dana,Ravi"]
    first, again = runner.invoke(app, query), runner.invoke(app, query)  # the second reuses the stored rows
    assert first.exit_code == 0 and again.exit_code == 0, first.output + again.output
    assert "prefilled" in first.output and "reused" in again.output and f"on {DEVICE}" in " ".join(again.output.split())
    records = {}
    for side, where in SIDES:
        run = ["run", "donor-pair", "--model", str(tiny_dir), "--items", "2", "--readout", "logits", "--no-progress"]
        run += ["--n-events", "16", "--root-slot", "13", "--dtype", "float32", "--device", where, "--out", side]
        res = runner.invoke(app, run)
        assert res.exit_code == 0, res.output
        manifest = json.loads((tmp_path / side / "manifest.json").read_text())
        assert manifest["invocations"][-1]["device"].startswith(where) and manifest["profile"]["device"].startswith(
            where
        )
        records[side] = [json.loads(line) for line in (tmp_path / side / "records.jsonl").read_text().splitlines()]
    for got, ref in zip(records["dev"], records["ref"]):
        g, r = _numbers(got), _numbers(ref)
        assert g.keys() == r.keys()
        d = max(abs(g[k] - r[k]) for k in g)
        assert measure("f32 gpu vs cpu: donor-pair records (rounded to 1e-6)", d) <= TOL_F32 + 1e-6


def test_cuda_ekv_to_and_back_is_exact():
    m = model("llama", DEVICE)
    ekv = prefill(m, make_log())
    there = ekv.to(device="cpu").to(device=DEVICE)
    assert all(torch.equal(a, b) for a, b in zip(ekv.keys + ekv.values, there.keys + there.values))
    assert there.positions.device.type == "cpu"
