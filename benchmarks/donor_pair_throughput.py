"""Donor-pair throughput: pairs per hour of eventkv's donor-pair probe against the study's way, measured
in one run on the same model, dtype, threads and pairs.

    python benchmarks/donor_pair_throughput.py --model qwen2.5-coder-1.5b --dtype float32 --threads 2 --pairs 6

Three ways are timed on every pair, in a rotating order (so a slower or busier stretch of the
machine falls on each of them alike):

* ``study``: Study 1's own way (Part A of its causal probe): per variant the whole history is
  prefilled from scratch (header included), then greedy generation at batch 1 for {decoy, root}
  served compactly and for every event (:func:`study_pair`);
* ``eventkv all arms``: ``eventkv run donor-pair`` with kv, isolated, text-all, kv-all (both
  readouts: greedy generation and candidate log-probs);
* ``eventkv kv,isolated``: ``eventkv run donor-pair --arms kv,isolated`` — lazy prefill stops each
  variant after the root, both readouts.

With ``--batch-pairs N`` (N > 1) a fourth way runs the kv,isolated arms N pairs at a time
(``DonorPair.run_batch``: histories prefilled and read out in one batch).

With ``--study-repo DIR`` (a checkout of the study's repository, oklen/Compute-Globally-Materialize-Locally,
cloned by the user: nothing of it is part of eventkv) a way ``study's script`` times the study's own
Part A (``kvmemory.kv_causal``: both variants' histories encoded, the root and full arms asked with its
trace readout) on the same model directory, dtype, device and threads, in the same rotation; it is
then the baseline of the ratios. Its items are the script's own (seeded), as many as ``--pairs``;
Part B, which the script runs after Part A of each item, is not timed (:class:`StudyScript`).
Without it the baseline is ``study (re-implemented)``: the study's way re-done on eventkv's data
path, not the study's code. The script runs as its users run it: its model's linear layers on torch's
own kernel. ``--study-onednn`` adds a way ``study's script, oneDNN linears``: the same script with its
model's linears routed through oneDNN as eventkv routes its own (``eventkv.models.kernels``), to tell
the kernel's share of the ratio from the rest. ``--linear`` sets eventkv's kernel (default ``auto``:
oneDNN for float32 on a CPU).

Prints one line per pair and way, then per way: mean seconds per pair, pairs per hour, tokens per
pair through the model's decoder — decode steps (forwards of one token, or of a token and its
prompt-lookup draft, times the rows of the batch) and the tokens of the other multi-token forwards
(histories, questions, candidates: prefill) — and the ratio of its pairs per hour to the baseline's;
then per way where a pair's wall time goes: the seconds in the decoder's prefill forwards, in its
decode forwards, and the rest (LM head, serving, scoring, Python), so a
reader sees where a ratio comes from. Model load and one warm-up pair per way are excluded.
``--profile`` prints a cProfile of the eventkv ways.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch

from eventkv.errors import EventKVError
from eventkv.kv.decoding import DRAFT_TOKENS
from eventkv.models import load
from eventkv.options import check_batch_pairs
from eventkv.probes import Runtime
from eventkv.studies.materialization.donor_pair import DonorPair

ALL_ARMS = ("kv", "isolated", "text-all", "kv-all")
LAZY_ARMS = ("kv", "isolated")
#: the most tokens a decode forward feeds a sequence: its token and a prompt-lookup draft
DECODE_Q = 1 + DRAFT_TOKENS


def study_pair(rt: Runtime, probe: DonorPair, item: dict) -> float:
    """One donor pair the study's way, on eventkv's data path: per variant the header and every event
    prefilled from scratch, then greedy generation at batch 1 (up to ``probe.max_new_tokens`` tokens)
    for {decoy, root} served compactly and for every event. Returns wall seconds."""
    from eventkv.kv.log import TokenizedLog, tokenize_query
    from eventkv.kv.prefill import prefill
    from eventkv.kv.readout import generate
    from eventkv.kv.serve import serve

    t = time.perf_counter()
    ids = [probe.event_id(i) for i in range(probe.n_events)]
    header = rt.header_ids(probe.instruction)
    toks = [[rt.encode(e) for e in ev] for ev in item["events"]]
    m = item["source_slot"]
    budget = max(len(toks[0][m]), len(toks[1][m]))
    query = tokenize_query(rt.tokenizer, rt.profile, item["question"])
    for v in (0, 1):
        log = TokenizedLog(header, ids, toks[v], [budget if i == m else None for i in range(probe.n_events)])
        ekv = prefill(rt.model, log)
        for served in ([probe.event_id(probe.decoy_slot), probe.event_id(probe.root_slot)], "all"):
            generate(
                rt.model,
                serve(ekv, served, "compact"),
                query,
                max_new_tokens=probe.max_new_tokens,
                stop_token_ids=rt.stop_token_ids,
            )
    return time.perf_counter() - t


class ForwardCount:
    """Tokens through ``model``'s decoder while :attr:`active`: ``prefill``, the tokens of multi-token
    forwards (``[batch, q]`` with q > ``decode_q`` counts batch x q, padding included), and ``decoded``, the
    decode forwards (counting batch): one token, or for eventkv's readouts (``decode_q`` = :data:`DECODE_Q`)
    a token and its prompt-lookup draft; and the wall seconds of each kind, ``prefill_s`` and ``decode_s``
    (from the decoder's forward pre-hook to its forward hook, the device synchronized on CUDA). Hooks on the
    decoder (``model.model``), so the forwards that skip the LM head count too; the LM head's own time falls
    outside both (it is counted with the rest of a pair's time)."""

    def __init__(self, model, decode_q: int = 1) -> None:
        self.decode_q = decode_q
        self.prefill = self.decoded = 0
        self.prefill_s = self.decode_s = 0.0
        self.active = False
        self._started: tuple[float, bool] | None = None
        decoder = getattr(model, "model", model)
        decoder.register_forward_pre_hook(self._seen, with_kwargs=True)
        decoder.register_forward_hook(self._done)

    def _seen(self, module, args, kwargs) -> None:
        if not self.active:
            return
        x = kwargs.get("input_ids")
        if x is None:
            x = args[0] if args else kwargs["inputs_embeds"]
        batch, q = x.shape[0], x.shape[1]
        multi = q > self.decode_q
        if multi:
            self.prefill += batch * q
        else:
            self.decoded += batch
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        self._started = (time.perf_counter(), multi)

    def _done(self, module, args, output) -> None:
        if self._started is None:
            return
        t0, multi = self._started
        self._started = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        if multi:
            self.prefill_s += time.perf_counter() - t0
        else:
            self.decode_s += time.perf_counter() - t0

    @contextlib.contextmanager
    def on(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def take(self) -> tuple[int, int]:
        """``(decoded, prefill)`` since the last take (the seconds: :meth:`take_seconds`)."""
        got = (self.decoded, self.prefill)
        self.decoded = self.prefill = 0
        return got

    def take_seconds(self) -> tuple[float, float]:
        """``(prefill_s, decode_s)`` since the last call."""
        got = (self.prefill_s, self.decode_s)
        self.prefill_s = self.decode_s = 0.0
        return got


class StudyScript:
    """The study's own Part A from a checkout of its repository (``repo``), on ``model_dir`` in ``dtype``.

    Each pair is one call of the script's ``main`` with ``--items 1 --seed SEED+k`` (the script builds
    its own items), with three things changed at run time and nothing in its files: its ``HFBackend`` is
    built once here and handed to every call (no reload per pair; ``SPRAG_DEVICE_MAP=cpu`` on a CPU); on
    a machine without CUDA its unconditional ``torch.cuda.synchronize()`` / ``empty_cache()`` calls are
    no-ops; and the package ``kvmemory`` is entered without its ``__init__``, which imports a module the
    public repository does not ship. What is timed: the calls of Part A — the first two
    ``encode_variant`` (both variants' histories) and the first four ``ask`` (root and full of each) of
    an item, which is the order of the script's loop; Part B and the header's encoding are not.

    Raises:
        EventKVError: ``repo`` holds no ``kvmemory/kv_causal.py``.
    """

    @staticmethod
    def check(repo: Path) -> None:
        """Raises EventKVError unless ``repo`` is a directory holding ``kvmemory/kv_causal.py``."""
        if not repo.is_dir():
            raise EventKVError(
                f"--study-repo {str(repo)!r}: no such directory: give a checkout of "
                "oklen/Compute-Globally-Materialize-Locally."
            )
        if not (repo / "kvmemory" / "kv_causal.py").is_file():
            raise EventKVError(
                f"--study-repo {str(repo)!r}: no kvmemory/kv_causal.py there: give a checkout of "
                "oklen/Compute-Globally-Materialize-Locally."
            )

    def __init__(self, repo: Path, model_dir: Path, dtype: str, device: str, seed: int) -> None:
        self.check(repo)
        if "kvmemory" not in sys.modules:
            package = types.ModuleType("kvmemory")
            package.__path__ = [str(repo / "kvmemory")]
            sys.modules["kvmemory"] = package
        sys.path.insert(0, str(repo))
        if device == "cpu":
            os.environ.setdefault("SPRAG_DEVICE_MAP", "cpu")
        with self.cuda_calls():
            from kvmemory import kv_causal  # the user's checkout
            from kvmemory.llm_hf import HFBackend

            self.llm = HFBackend(str(model_dir), dtype=getattr(torch, dtype))
        self.script, self.seed = kv_causal, seed
        self.count = ForwardCount(self.llm.model)

    @contextlib.contextmanager
    def cuda_calls(self):
        """Without CUDA, the script's ``torch.cuda.synchronize`` and ``empty_cache`` do nothing."""
        if torch.cuda.is_available():
            yield
            return
        saved = torch.cuda.synchronize, torch.cuda.empty_cache
        torch.cuda.synchronize = torch.cuda.empty_cache = lambda *a, **k: None  # type: ignore[assignment]
        try:
            yield
        finally:
            torch.cuda.synchronize, torch.cuda.empty_cache = saved

    def pair(self, index: int, linear: str = "torch") -> float:
        """Part A of the script's item for seed ``seed + index``: its wall seconds (the tokens in
        :attr:`count`), its model's linears on ``linear`` (``"torch"``: as the script runs them;
        ``"onednn"``: as eventkv runs its own) for this call."""
        from eventkv.models.kernels import use_linear

        use_linear(self.llm.model, linear)
        k = self.script
        spent, calls = [0.0], {"encode_variant": 0, "ask": 0}
        originals = {"encode_variant": k.encode_variant, "ask": k.ask, "HFBackend": k.HFBackend}

        def timed(name: str, part_a: int):
            def call(*args, **kwargs):
                calls[name] += 1
                if calls[name] > part_a:  # Part B's
                    return originals[name](*args, **kwargs)
                t = time.perf_counter()
                with self.count.on():
                    got = originals[name](*args, **kwargs)
                spent[0] += time.perf_counter() - t
                return got

            return call

        argv = sys.argv
        k.encode_variant, k.ask = timed("encode_variant", 2), timed("ask", 4)
        k.HFBackend = lambda *a, **kw: self.llm
        sys.argv = ["kv_causal", "--items", "1", "--seed", str(self.seed + index), "--out", os.devnull]
        try:
            with self.cuda_calls(), contextlib.redirect_stdout(io.StringIO()):
                k.main()
        finally:
            sys.argv = argv
            for name, fn in originals.items():
                setattr(k, name, fn)
            use_linear(self.llm.model, "torch")
        return spent[0]


def main() -> None:
    ap = argparse.ArgumentParser(
        description="Donor pairs per hour of eventkv's donor-pair probe against the study's way (its own script "
        "with --study-repo, else a re-implementation), measured in one run.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--model", default="smollm2-135m", help="packaged alias or local model directory")
    ap.add_argument("--dtype", default="float32", help="float32, bfloat16 or auto")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument("--pairs", type=int, default=6, help="timed pairs per way (after one warm-up pair per way)")
    ap.add_argument("--seed", type=int, default=0, help="seed of eventkv's donor pairs")
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=64,
        help="greedy tokens at most per answer of eventkv's ways (the study's script keeps its own cap, 160)",
    )
    ap.add_argument(
        "--query-at",
        default="last-served",
        choices=("last-served", "history"),
        help="where eventkv's kv and isolated arms ask: right after the served events, where the study's script "
        "asks (the probe's default), or after the whole history",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch threads (None: torch's own count)")
    ap.add_argument("--batch-pairs", type=int, default=1, help="also time kv,isolated N pairs at a time (N > 1)")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the eventkv ways")
    ap.add_argument(
        "--study-repo",
        type=Path,
        default=None,
        help="a checkout of the study's repository: also time its own Part A, the baseline then "
        "(without it the baseline is a re-implementation)",
    )
    ap.add_argument("--study-seed", type=int, default=3900, help="the study's script's seed (its items are its own)")
    ap.add_argument(
        "--study-onednn",
        action="store_true",
        help="also time the study's script with its model's linears on oneDNN, as eventkv runs its own",
    )
    ap.add_argument(
        "--linear",
        default=None,
        help="eventkv's linear kernel: auto, onednn or torch (None: EVENTKV_LINEAR, else auto)",
    )
    args = ap.parse_args()
    check_batch_pairs(args.batch_pairs)
    if args.study_repo is not None:
        StudyScript.check(args.study_repo)  # before the model loads
    if args.threads:
        torch.set_num_threads(args.threads)

    t = time.perf_counter()
    lm = load(args.model, dtype=args.dtype, device=args.device, linear=args.linear)
    cpu = torch.cpu.get_capabilities().get("cpu_name") if hasattr(torch.cpu, "get_capabilities") else None
    print(
        f"model {args.model} ({lm.profile.dtype}, {args.device}) loaded in {time.perf_counter() - t:.1f} s; "
        f"torch threads {torch.get_num_threads()}; CPU {cpu or 'unknown'}, kernels "
        f"{torch.backends.cpu.get_cpu_capability()}; linears on {lm.profile.linear_kernel}"
    )
    rt = Runtime(lm.model, lm.tokenizer, lm.profile)
    probes = {
        "eventkv all arms": DonorPair(max_new_tokens=args.max_new_tokens, arm_names=ALL_ARMS, query_at=args.query_at),
        "eventkv kv,isolated": DonorPair(
            max_new_tokens=args.max_new_tokens, arm_names=LAZY_ARMS, query_at=args.query_at
        ),
    }
    study = DonorPair(max_new_tokens=args.max_new_tokens)
    items = study.items(args.seed, range(args.pairs + 1))
    warm, timed = items[0], items[1:]

    count = ForwardCount(rt.model, DECODE_Q)
    ways = {REIMPLEMENTED: lambda it: _counted(count, lambda: study_pair(rt, study, it))}
    for name, probe in probes.items():
        ways[name] = lambda it, p=probe: _counted(count, lambda: _timed(lambda: p.run_item(rt, it)))
    script = None
    if args.study_repo is not None:
        from eventkv.models.cache_dir import model_dir

        local = Path(args.model) if Path(args.model).is_dir() else model_dir(args.model)
        script = StudyScript(args.study_repo.resolve(), local, lm.profile.dtype, args.device, args.study_seed)
        ways = {SCRIPT: lambda it: (script.pair(it["index"]), *script.count.take()), **ways}
        if args.study_onednn:
            ways[SCRIPT_ONEDNN] = lambda it: (script.pair(it["index"], "onednn"), *script.count.take())
        print(f"study's script: {args.study_repo} (kvmemory.kv_causal, Part A), model directory {local}")
    else:
        print(
            f"baseline: {REIMPLEMENTED!r} is the study's way re-implemented on eventkv's data path, not the "
            "study's own code: give --study-repo DIR (a checkout of its repository) to time its own Part A"
        )
    for way in ways.values():  # warm-up: header prefill, allocator, kernels
        way(warm)

    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    secs: dict[str, list[float]] = {name: [] for name in ways}
    tokens: dict[str, list[tuple[int, int]]] = {name: [] for name in ways}
    split: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}  # (prefill s, decode s) a pair
    names = list(ways)
    for k, it in enumerate(timed):
        for j in range(len(names)):
            name = names[(k + j) % len(names)]
            if prof is not None and name.startswith("eventkv"):
                prof.enable()
            counter = script.count if script is not None and name in (SCRIPT, SCRIPT_ONEDNN) else count
            counter.take_seconds()
            s, decoded, prefilled = ways[name](it)
            if prof is not None:
                prof.disable()
            secs[name].append(s)
            tokens[name].append((decoded, prefilled))
            split[name].append(counter.take_seconds())
            print(f"pair {it['index']}: {name:<32} {s:7.2f} s, {decoded} decode steps, {prefilled} prefill tokens")

    if args.batch_pairs > 1:
        name = f"eventkv kv,isolated batch {args.batch_pairs}"
        p = probes["eventkv kv,isolated"]
        p.run_batch(rt, items[: min(args.batch_pairs, len(items))])  # warm-up at the batch shape
        per, toks = [], []
        for a in range(0, len(timed), args.batch_pairs):
            chunk = timed[a : a + args.batch_pairs]
            count.take_seconds()
            s, decoded, prefilled = _counted(count, lambda c=chunk: _timed(lambda: p.run_batch(rt, c)))
            pre_s, dec_s = count.take_seconds()
            split.setdefault(name, []).extend([(pre_s / len(chunk), dec_s / len(chunk))] * len(chunk))
            per.extend([s / len(chunk)] * len(chunk))
            toks.extend([(decoded // len(chunk), prefilled // len(chunk))] * len(chunk))
            print(f"pairs {chunk[0]['index']}-{chunk[-1]['index']}: {name} {s:7.2f} s")
        secs[name], tokens[name] = per, toks

    if prof is not None:
        import pstats

        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    baseline = SCRIPT if SCRIPT in secs else REIMPLEMENTED
    base = statistics.mean(secs[baseline])
    print(f"\nbaseline of the ratios: {baseline}")
    print(
        "decode steps: decode forwards (a token, or a token and its prompt-lookup draft) x their batch rows "
        "(padding rows too); prefill: the tokens of the other multi-token forwards"
    )
    print(f"{'way':<32} {'s/pair':>8} {'pairs/hour':>11} {'decode/pair':>13} {'prefill/pair':>13} {'vs baseline':>12}")
    for name, s in secs.items():
        mean = statistics.mean(s)
        decoded = statistics.mean(d for d, _ in tokens[name])
        prefilled = statistics.mean(p for _, p in tokens[name])
        print(f"{name:<32} {mean:8.2f} {3600 / mean:11.0f} {decoded:13.0f} {prefilled:13.0f} {base / mean:11.2f}x")
    print(
        "\nwhere a pair's wall time goes: the decoder's multi-token forwards (prefill), its decode forwards "
        "(decode), and the rest (LM head, serving, scoring, Python)"
    )
    print(f"{'way':<32} {'s/pair':>8} {'prefill s':>10} {'decode s':>10} {'rest s':>8} {'decode share':>13}")
    for name, s in secs.items():
        mean = statistics.mean(s)
        pre = statistics.mean(p for p, _ in split[name])
        dec = statistics.mean(d for _, d in split[name])
        print(f"{name:<32} {mean:8.3f} {pre:10.3f} {dec:10.3f} {mean - pre - dec:8.3f} {dec / mean:12.0%}")


SCRIPT = "study's script"
SCRIPT_ONEDNN = "study's script, oneDNN linears"
REIMPLEMENTED = "study (re-implemented)"


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _counted(count: ForwardCount, fn) -> tuple[float, int, int]:
    """``(fn()'s seconds, decoded, prefill tokens)`` with ``count`` on during ``fn``."""
    count.take()
    with count.on():
        seconds = fn()
    return (seconds, *count.take())


if __name__ == "__main__":
    try:
        main()
    except EventKVError as e:  # a bad option or an unusable device: one line, exit 2
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
