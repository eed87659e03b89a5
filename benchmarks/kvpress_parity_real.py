"""kvpress parity on real weights: the rows NVIDIA kvpress 0.5.5's presses keep vs eventkv's policies.

``benchmarks/kvpress_parity.py`` checks parity on two tiny random models; this script does the same on
real checkpoints (smollm2-135m, a Llama; qwen2.5-coder-0.5b, a Qwen2 with q/k/v biases), three prompts
(61, 307 and 853 token ids: the model's own tokenization of the fixed English text below, cut to length)
and compression ratios 0.25, 0.5 and 0.9, in two runs, one per environment::

    # 1. kvpress's side (its environment; imports nothing of eventkv): the kept rows, written to --data
    nice -n 10 /tmp/kvpress-venv/bin/python benchmarks/kvpress_parity_real.py --side kvpress
    # 2. eventkv's side: the same ids and weights, eventkv's masks, compared cell by cell
    nice -n 10 .venv/bin/python benchmarks/kvpress_parity_real.py --side eventkv

Both sides run the models in float32, sdpa attention (eager only for ObservedAttention, which reads the
attention weights). A cell is one (model, prompt, press, ratio, layer, KV head): its kept rows.

The presses and settings are those of ``benchmarks/kvpress_parity.py`` (SnapKV window 8, kernel 5, ...),
except ChunkKV's ``chunk_length`` (16 here, 4 there: 4 is too short a phrase for real prompts),
PerLayerCompression's ratios (one per layer here: 0.25 on even layers, 0.75 on odd ones, mean 0.5) and chunked
Finch's ``chunk_length`` (96 here, 40 there: FinchPress asserts ``chunk_length > window / (1 - ratio)``, 80 at
0.9). Finch's window (the question: the last 8 ids) is set on the press directly, with no delimiter token.

kvpress's side, how the kept rows are read: one no-press prefill per (model, prompt), with a forward hook
on every attention module that, at that layer, runs each press's own ``forward_hook`` (the code kvpress's
context manager registers) on the hook's arguments, once per press and ratio, each time on a fresh copy of
the layer's full cache, and reads the rows the press left (found in the full cache by their exact key and
value) less the rows it masked (``masked_key_indices``, AdaKV and CriticalAdaKV). A press compresses a
layer's cache after the layer's prefill attention, and nothing downstream reads that cache during the
prefill, so this is what a prefill inside each press's context manager leaves, press by press, at one
forward per prompt instead of one per press and ratio; ``--verify-upto N`` (default 61) reruns every
press the ordinary way (the context manager, one prefill each, as ``kvpress_parity.py``) on the prompts of
at most N tokens and checks that both ways keep the same rows. ObservedAttention runs in a second, eager
prefill of the same model. The hook also records kvpress's own scores (``press.score``) of the scoring
presses (float32), which eventkv's side uses to tell ties from real differences.

eventkv's side: the same weights (transformers, float32, sdpa), the stored ids as a header of 4 and three
events (contiguous positions), ``capture_prefill(model, log, window=len(ids))`` (every query), and
``keep_mask(policy, capture, ratio)`` of the policy with the press's settings (the same mapping as
``tests/test_kvpress_parity.py``). A differing cell is classified: (a) a tie or near-tie at the
kept/evicted boundary — the rows only one side keeps have equal scores on one side (an exact tie), or
scores within ``NEAR_REL`` of each other (eventkv's float64 scores of its float32 capture; the gap is
reported relative to the score and in float32 ulps of it), (b) anything else, reported row by row.
It writes ``docs/results/kvpress-parity-real/summary.md`` and ``summary.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
DATA = Path("/tmp/i42r/kvpress_kept.json")  # kvpress's kept rows (not in the repository: ~MBs)
RESULTS = ROOT / "docs" / "results" / "kvpress-parity-real"
MODELS = {
    "smollm2-135m": "/root/.cache/eventkv/models/smollm2-135m",
    "qwen2.5-coder-0.5b": "/root/.cache/eventkv/models/qwen2.5-coder-0.5b",
}
sys.path.insert(0, str(Path(__file__).resolve().parent))
import kvpress_parity as _tiny  # noqa: E402  (the tiny-model script beside this one)

LENGTHS = (61, 307, 853)
RATIOS = (0.25, 0.5, 0.9)
HEADER = 4  # eventkv's side: ids[:4] the header, the rest three events
CHUNK = 16
FINCH_CHUNK = 96
NEAR_REL = 2.0**-13  # 1.2e-4 of the score (1024 float32 ulps): a near-tie (see the docstring)

# (cell name, kvpress class, options): kvpress_parity.py's presses (a script beside this one, importing nothing
# of eventkv either), with ChunkKV's chunk 16 and per-layer ratios for each model's depth; ThinK, which prunes key
# channels rather than rows, is compared there only
_REAL_OPTIONS = {
    "chunkkv_snapkv": {"chunk_length": CHUNK},
    "perlayer_snapkv": {"compression_ratios": "alternating"},
    # FinchPress asserts chunk_length > window / (1 - ratio): 80 at 0.9 with its window of 8
    "finch_chunked": {"chunk_length": FINCH_CHUNK},
}
PRESSES = tuple(
    (name, cls, {**options, **_REAL_OPTIONS.get(name, {})})
    for name, cls, options in _tiny.PRESSES
    if cls not in _tiny.CHANNEL_PRESSES
)
EAGER = {"ObservedAttentionPress"}
#: the scoring presses whose identical cells' boundary margins are reported
MARGIN_PRESSES = ("knorm", "snapkv", "tova", "expected", "observed", "keydiff", "finch")


def perlayer_ratios(n_layers: int) -> list[float]:
    """0.25 on even layers, 0.75 on odd ones (kvpress_parity.py's [0.25, 0.75], repeated)."""
    return [0.25 if layer % 2 == 0 else 0.75 for layer in range(n_layers)]


# A fixed English text written for this benchmark (no special tokens are added when it is tokenized).
TEXT = """\
The harbour town of Carrow sits at the mouth of a narrow river, where the water turns from brown to green \
as it meets the sea. For most of the year the town is quiet. Fishing boats leave before dawn and come back \
in the early afternoon, and the market on the quay sells what they bring: mackerel in summer, cod and \
whiting in winter, crabs and lobsters whenever the pots are full. The lighthouse on the northern headland \
was automated in 1987, and the keeper's cottage beside it is now a small museum that opens on weekends.

Martha Ellison has run the museum for eleven years. She was born in the cottage, the youngest daughter of \
the last keeper, and she remembers the smell of paraffin and brass polish, the sound of the clockwork that \
turned the lens, and the long winter nights when her father climbed the spiral stairs every four hours to \
check the flame. "People think it was romantic," she says, "and some of it was. But mostly it was work, \
the same work every night, and if you got it wrong a ship could end up on the rocks."

The museum holds the logbooks her father kept from 1961 to 1987. Each page records the date, the weather, \
the visibility, the state of the sea, and any ships that passed close to the point. Most entries are short: \
"Wind south-west, force five. Rain. Visibility two miles. Nothing sighted." A few are longer. On the night \
of the fourteenth of January 1974, a cargo ship called the Helen Marsh lost power in a gale and drifted \
towards the headland. The entry for that night runs to three pages, written in a hand that grows steadily \
less tidy as the hours pass. The lifeboat from the next harbour reached the ship at a quarter past three in \
the morning, and all nineteen crew were taken off before she struck the reef.

Visitors to the museum can read a copy of that entry, and they can climb the tower when the weather allows. \
There are one hundred and twelve steps to the lamp room. From the gallery at the top you can see the whole \
coast from the river mouth to the cliffs at Penhallow, and on a clear day the outline of the islands thirty \
miles to the west. Martha recommends going up in the late afternoon, when the light is low and the water \
below the headland shows every shade between silver and dark blue.

The town itself has changed more slowly than many places along this coast. There are no large hotels, and \
the council refused permission for a marina in 2009 after a long argument that divided families and \
neighbours. Those who supported the marina said it would bring money and jobs; those who opposed it said it \
would bring traffic, noise and second homes, and that the fishing fleet would be pushed out of the inner \
harbour. In the end the vote was close, seven to six, and the plans were withdrawn. Fifteen years later the \
argument still comes up in the pub on a Friday night.

The fleet is smaller than it was. In 1970 there were forty boats working out of Carrow; today there are \
eleven, and only four of them fish full time. The younger skippers have learned to sell directly to \
restaurants in the city, sending photographs of the catch from the boat and taking orders before they reach \
the quay. Tom Pascoe, who is thirty-four and has fished since he left school, says the phone has changed \
the business more than any engine or net. "My grandfather sold to whoever was standing on the quay. I know \
by nine in the morning where every box is going, and what I will get for it."

Not everything is about money. Every August the town holds a regatta, with rowing races in the harbour, a \
swimming race across the river mouth, and a competition for the best decorated boat. The prizes are small, \
a cup and a bottle of something, but the regatta draws people back who left years ago, and for one weekend \
the quay is as crowded as it was when the pilchard boats landed their catch by the thousand. In the evening \
there is music on the green, and the lifeboat crew sells raffle tickets to pay for new equipment.

The lifeboat station is the other institution in Carrow that everyone agrees on. It is run by volunteers, \
like almost every station on this coast, and the crew includes a plumber, two teachers, a nurse, a retired \
engineer and three of the fishermen. When the pagers go off they have eight minutes to get to the station \
and launch. Last year they were called out twenty-six times: to yachts with engine failure, to swimmers \
caught by the tide, to a kayaker who had lost his paddle, and once to a dog that had followed a ball over \
the edge of the cliff and was stranded on a ledge above the water. The dog was unhurt. The owner, according \
to the station's report, was "very apologetic and made a generous donation."

If you ask people in Carrow what makes the place special, most of them will talk about the light. Painters \
have come here since the eighteen-nineties, drawn by the way the sun moves across the water and the white \
walls of the houses that climb the hill above the harbour. There is a small gallery on Fore Street that \
shows their work, old and new, and a studio above the bakery where a group of local artists meet every \
Tuesday to paint together. Some of them are very good. Most of them, they admit, are mainly there for the \
company and the cake.

Martha closes the museum at five. Before she locks the door she walks once around the lamp room, checks the \
windows, and looks out along the coast, the way her father did. The lens no longer needs a keeper, and the \
ships carry satellite receivers that tell them exactly where they are. But she still likes to see the first \
flash at dusk, and to count the seconds until the next one, as she did when she was a child: one, two, three, \
four, five, and then the beam sweeps over the water again, steady as it has been for more than a century.
"""


# ----------------------------------------------------------------------------------------------------------------
# bit masks (the data file holds each cell's kept rows as a little-endian bit mask, in hex)


def pack(rows: list[int], n: int) -> str:
    bits = np.zeros(n, dtype=bool)
    bits[list(rows)] = True
    return np.packbits(bits, bitorder="little").tobytes().hex()


def unpack(h: str, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(bytes.fromhex(h), dtype=np.uint8), bitorder="little")[:n].astype(bool)


# ----------------------------------------------------------------------------------------------------------------
# kvpress's side (imports nothing of eventkv)


def make_press(kvpress, cls: str, options: dict, ratio: float | None, n_layers: int):
    """The kvpress press ``cls(**options)``, nested presses built, the ratio given as kvpress_parity.py."""
    import inspect

    def build(value):
        if isinstance(value, dict) and "press" in value:
            return make_press(kvpress, value["press"], value.get("options", {}), ratio, n_layers)
        if isinstance(value, list):
            return [build(v) for v in value]
        if value == "alternating":
            return perlayer_ratios(n_layers)
        return value

    kwargs = {k: build(v) for k, v in options.items()}
    press_cls = getattr(kvpress, cls)
    if ratio is not None and "compression_ratio" in inspect.signature(press_cls).parameters:
        kwargs = {"compression_ratio": ratio, **kwargs}
    press = press_cls(**kwargs)
    if cls == "FinchPress":
        # its window, the question's last FINCH_WINDOW ids, set directly: the delimiter hook would only set it
        # (and drop the delimiter); with an id no prompt holds the hook never fires, in either way of running
        press.window_size, press.delimiter_token_id = _tiny.FINCH_WINDOW, -1
    return press


def _row_lookup(keys: torch.Tensor, values: torch.Tensor) -> list[dict[bytes, int]]:
    """Per KV head, the full cache's rows ``{key+value bytes: row}`` (``keys``/``values`` ``[heads, rows, d]``)."""
    kv = torch.cat([keys, values], dim=-1).contiguous().numpy()
    out = []
    for h in range(kv.shape[0]):
        lut = {kv[h, r].tobytes(): r for r in range(kv.shape[1])}
        if len(lut) != kv.shape[1]:
            raise SystemExit("two rows of the full cache have the same key and value: rows cannot be told apart")
        out.append(lut)
    return out


def _kept_rows(lut, keys: torch.Tensor, values: torch.Tensor, masked) -> list[list[int]]:
    """Per KV head the sorted full-cache rows of the compressed ``keys``/``values`` (``[heads, kept, d]``),
    less the rows ``masked`` (``masked_key_indices`` or None) names for the head."""
    kv = torch.cat([keys, values], dim=-1).contiguous().numpy()
    gone = _tiny.masked_by_head(masked, kv.shape[0])
    out = []
    for h in range(kv.shape[0]):
        rows = [lut[h][kv[h, i].tobytes()] for i in range(kv.shape[1])]  # KeyError: a row not in the full cache
        if len(set(rows)) != len(rows):
            raise SystemExit("a row kept twice")
        out.append(sorted(r for r in rows if r not in gone[h]))
    return out


def one_pass(model, ids: list[int], jobs: dict, scorers: dict) -> tuple[dict, dict]:
    """One prefill of ``ids``; at every layer each job's press (``{key: press}``) runs its own forward hook on a
    fresh copy of the layer's full cache (see the docstring) and each scorer (``{name: press}``) scores it.

    Returns ``({key: [layer][head] sorted kept rows]}, {name: [layers, heads, rows] float32})``."""
    from transformers import DynamicCache

    n_layers = model.config.num_hidden_layers
    kept = {k: [None] * n_layers for k in jobs}
    scores = {k: [None] * n_layers for k in scorers}

    def hook(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        k0, v0 = layer.keys, layer.values
        lut = _row_lookup(k0[0], v0[0])
        for key, press in jobs.items():
            layer.keys, layer.values = k0.clone(), v0.clone()
            module.masked_key_indices = None
            press.forward_hook(module, args, kwargs, output)
            kept[key][module.layer_idx] = _kept_rows(
                lut, layer.keys[0], layer.values[0], getattr(module, "masked_key_indices", None)
            )
        for name, press in scorers.items():
            s = press.score(module, kwargs["hidden_states"], k0.clone(), v0.clone(), output[1], kwargs)
            s = s[0].float()
            scores[name][module.layer_idx] = s.expand(k0.shape[1], -1).numpy().copy()
        layer.keys, layer.values = k0, v0
        module.masked_key_indices = None
        return output

    hooks = []
    for press in list(jobs.values()) + list(scorers.values()):
        press.post_init_from_model(model)
    for layer in model.model.layers:
        layer.self_attn.rotary_emb = model.model.rotary_emb  # what a press's context manager sets
        hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]), past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return kept, {k: np.stack(v) for k, v in scores.items()}


def ordinary_kept(model, ids: list[int], press) -> list[list[list[int]]]:
    """The kept rows of a prefill inside ``press``'s context manager (kvpress_parity.py's way)."""
    from contextlib import nullcontext

    from transformers import DynamicCache

    def run(p):
        for layer in model.model.layers:
            layer.self_attn.masked_key_indices = None
        cache = DynamicCache()
        with torch.no_grad(), p(model) if p is not None else nullcontext():
            model(torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
        return [(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers]

    full = run(None)
    comp = run(press)
    return [
        _kept_rows(_row_lookup(fk, fv), ck, cv, getattr(model.model.layers[i].self_attn, "masked_key_indices", None))
        for i, ((fk, fv), (ck, cv)) in enumerate(zip(full, comp))
    ]


def kvpress_side(args) -> None:
    from importlib.metadata import version

    import kvpress
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    t_all = time.time()
    out = {
        "made_by": "benchmarks/kvpress_parity_real.py --side kvpress",
        "versions": {
            "kvpress": version("kvpress"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "lengths": list(args.lengths),
        "ratios": list(args.ratios),
        "chunk_length": CHUNK,
        "models": {},
    }
    scores_out = {}
    for mname in args.models:
        t_model = time.time()
        mdir = MODELS[mname]
        tok = AutoTokenizer.from_pretrained(mdir)
        all_ids = tok(TEXT, add_special_tokens=False)["input_ids"]
        if len(all_ids) < max(args.lengths):
            raise SystemExit(f"{mname}: the text is {len(all_ids)} tokens, fewer than {max(args.lengths)}")
        model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32, attn_implementation="sdpa").eval()
        cfg = model.config
        if getattr(cfg, "head_dim", None) is None:
            cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads  # CriticalKV reads config.head_dim (Qwen2)
        n_layers = cfg.num_hidden_layers
        grid = []  # (cell key, class, options, press)
        for name, cls, options in PRESSES:
            per_layer = "compression_ratios" in options
            for ratio in (None,) if per_layer else args.ratios:
                press = make_press(kvpress, cls, options, ratio, n_layers)
                grid.append((f"{name}@{press.compression_ratio if ratio is None else ratio:g}", cls, options, press))
        snap = {"window_size": 8, "kernel_size": 5}
        scorers_sdpa = {
            "knorm": kvpress.KnormPress(),
            "snapkv": kvpress.SnapKVPress(**snap),
            "tova": kvpress.TOVAPress(),
            "expected": kvpress.ExpectedAttentionPress(n_future_positions=512, n_sink=4),
            "keydiff": kvpress.KeyDiffPress(),
            "lagkv": kvpress.LagKVPress(n_sink=4, lag_size=8),
            **{
                f"criticalkv@{r:g}": kvpress.CriticalKVPress(
                    kvpress.SnapKVPress(compression_ratio=r, **snap), epsilon=1e-4, first_stage_ratio=0.5
                )
                for r in args.ratios
            },
            **{f"streaming@{r:g}": kvpress.StreamingLLMPress(compression_ratio=r, n_sink=4) for r in args.ratios},
            "finch": make_press(kvpress, "FinchPress", {"rerotate_keys": False}, 0.5, n_layers),  # scores: no ratio
        }
        m_out = {"dir": mdir, "n_layers": n_layers, "kv_heads": cfg.num_key_value_heads, "prompts": {}}
        for n in args.lengths:
            ids = all_ids[:n]
            t0 = time.time()
            sdpa_jobs = {k: p for k, cls, _, p in grid if cls not in EAGER}
            kept, sc = one_pass(model, ids, sdpa_jobs, scorers_sdpa)
            t_sdpa = time.time() - t0
            model.set_attn_implementation("eager")
            eager_jobs = {k: p for k, cls, _, p in grid if cls in EAGER}
            kept_e, sc_e = one_pass(model, ids, eager_jobs, {"observed": kvpress.ObservedAttentionPress()})
            model.set_attn_implementation("sdpa")
            kept.update(kept_e)
            sc.update(sc_e)
            t_pass = time.time() - t0
            verified = None
            if n <= args.verify_upto:
                verified = {}
                for k, cls, _, press in grid:
                    if cls in EAGER:
                        model.set_attn_implementation("eager")
                    verified[k] = ordinary_kept(model, ids, press) == kept[k]
                    model.set_attn_implementation("sdpa")
                    if not verified[k]:
                        print(f"  VERIFY FAILED {mname} {n} {k}")
            cells = {}
            for k, cls, _options, press in grid:
                cells[k] = {
                    "press": cls,
                    "ratio": press.compression_ratio,
                    "attn": "eager" if cls in EAGER else "sdpa",
                    "kept": [[pack(rows, n) for rows in layer] for layer in kept[k]],
                }
            for sname, arr in sc.items():
                scores_out[f"{mname}|{n}|{sname}"] = arr
            m_out["prompts"][str(n)] = {
                "input_ids": ids,
                "seconds": {"sdpa_pass": round(t_sdpa, 1), "both_passes": round(t_pass, 1)},
                "verified_by_context_manager": verified,
                "cells": cells,
            }
            ok = "" if verified is None else f", context-manager check {sum(verified.values())}/{len(verified)} same"
            print(f"{mname} {n} tokens: {len(cells)} press-ratio cells, {t_pass:.1f} s{ok}", flush=True)
        out["models"][mname] = m_out
        m_out["seconds"] = round(time.time() - t_model, 1)
        del model
        import gc

        gc.collect()
    out["seconds"] = round(time.time() - t_all, 1)
    args.data.parent.mkdir(parents=True, exist_ok=True)
    args.data.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    np.savez_compressed(args.data.with_suffix(".scores.npz"), **scores_out)
    print(f"wrote {args.data} and its scores ({out['seconds']} s)")


# ----------------------------------------------------------------------------------------------------------------
# eventkv's side


def eventkv_policies(n_layers: int) -> dict:
    from eventkv.eviction import ExpectedAttention, Knorm, SnapKV, StreamingLLM, Tova
    from eventkv.eviction.budgets import (
        AdaKV,
        ChunkKV,
        Composed,
        CriticalAdaKV,
        CriticalKV,
        PerLayerRatio,
        PyramidKV,
        SimLayerKV,
    )
    from eventkv.eviction.scorers import Finch, KeyDiff, LagKV, ObservedAttention

    snap = SnapKV(window=8, kernel=5, pooling="avg")
    return {
        "streaming": StreamingLLM(sinks=4),
        "knorm": Knorm(),
        "snapkv": snap,
        "tova": Tova(),
        "expected": ExpectedAttention(horizon=512, sinks=4),
        "observed": ObservedAttention(),
        "keydiff": KeyDiff(),
        "lagkv": LagKV(sinks=4, lag=8),
        "simlayerkv": SimLayerKV(threshold=0.3, recent=16),
        "adakv_snapkv": AdaKV(inner=snap, alpha=0.2),
        "criticalkv_snapkv": CriticalKV(inner=snap, epsilon=1e-4, first_stage=0.5),
        "criticaladakv_snapkv": CriticalAdaKV(inner=snap, alpha=0.2, epsilon=1e-4, first_stage=0.5),
        "pyramidkv": PyramidKV(window=8, kernel=5, pooling="avg", beta=20),
        "chunkkv_snapkv": ChunkKV(inner=snap, chunk=CHUNK),
        "composed_snapkv_knorm": Composed(policies=(snap, Knorm())),
        "perlayer_snapkv": PerLayerRatio(inner=snap, ratios=tuple(perlayer_ratios(n_layers))),
        "finch": Finch(window=8),
        "finch_chunked": Finch(window=8, chunk=FINCH_CHUNK),
    }


def ulp32(x: float) -> float:
    """The float32 ulp at magnitude ``x`` (> 0)."""
    return 2.0 ** (math.floor(math.log2(x)) - 23) if x > 0 and math.isfinite(x) else float("nan")


def gap_of(s_ev: np.ndarray, s_kv: np.ndarray | None, ev_only: list[int], kv_only: list[int]) -> dict:
    """How far apart the swapped entries are: on eventkv's scores ``max(ev_only) - min(kv_only)`` (eventkv
    keeps ev_only, so >= its boundary, and evicts kv_only), on kvpress's own ``max(kv_only) - min(ev_only)``;
    each relative to the larger magnitude and in float32 ulps of it. inf scores (always-kept rows) count as
    equal to each other."""
    out = {}
    for side, s, hi, lo in (("ev", s_ev, ev_only, kv_only), ("kv", s_kv, kv_only, ev_only)):
        if s is None:
            continue
        a, b = s[hi], s[lo]
        top, bot = float(np.max(a)), float(np.min(b))
        if math.isinf(top) and math.isinf(bot) and top == bot:
            gap, mag = 0.0, float("inf")
        else:
            gap = top - bot
            mag = float(np.max(np.abs(np.concatenate([a, b]))))
        fin = math.isfinite(mag) and mag > 0
        out[side] = {
            "gap": gap,
            "rel": gap / mag if fin else (0.0 if gap == 0 else float("inf")),
            "ulps": gap / ulp32(mag) if fin else (0.0 if gap == 0 else float("inf")),
        }
    return out


def classify(g: dict) -> str:
    """'a:tie' (equal on a side), 'a:near' (eventkv's gap within NEAR_REL), else 'b'."""
    ev, kv = g.get("ev"), g.get("kv")
    if (ev and ev["gap"] == 0) or (kv and kv["gap"] == 0):
        return "a:tie"
    if ev and abs(ev["rel"]) <= NEAR_REL:
        return "a:near"
    return "b"


def eventkv_side(args) -> None:
    import dataclasses

    import transformers
    from transformers import AutoModelForCausalLM

    from eventkv.eviction import Knorm, keep_mask
    from eventkv.eviction.budgets import _one_head, safeguard, top_cells
    from eventkv.eviction.capture import capture_prefill
    from eventkv.eviction.policies import kept_count, top_rows, window_attention
    from eventkv.kv.log import TokenizedLog

    transformers.utils.logging.disable_progress_bar()
    if args.threads:
        torch.set_num_threads(args.threads)
    t_all = time.time()
    data = json.loads(args.data.read_text())
    kvs = np.load(args.data.with_suffix(".scores.npz"))
    import transformers

    report = {
        "made_by": "benchmarks/kvpress_parity_real.py --side eventkv",
        "kvpress_side": {"versions": data["versions"], "seconds": data["seconds"]},
        "eventkv_side": {"transformers": transformers.__version__, "torch": torch.__version__},
        "near_rel": NEAR_REL,
        "chunk_length": data["chunk_length"],
        "counts": {},  # model -> press -> ratio -> prompt -> [identical, total, a_tie, a_near, b]
        "b_details": [],
        "margins": {},  # press -> the smallest relative boundary margin among identical cells (eventkv's scores)
        "a_tie_kv": {},  # press -> for a-tie findings: kvpress's own gap (equal / max ulps / inf / not recorded)
        "a_max": {},  # press -> largest eventkv relative gap among class (a) near-ties
        "score_noise": {},  # model -> scorer -> max / median relative |eventkv - kvpress| over finite rows
        "verified_by_context_manager": {},
    }
    for mname, m in data["models"].items():
        if args.models and mname not in args.models:
            continue
        t_model = time.time()
        model = AutoModelForCausalLM.from_pretrained(m["dir"], dtype=torch.float32, attn_implementation="sdpa").eval()
        n_layers = model.config.num_hidden_layers
        policies = eventkv_policies(n_layers)
        counts = report["counts"].setdefault(mname, {})
        noise = report["score_noise"].setdefault(mname, {})
        for n_str, p in m["prompts"].items():
            n = int(n_str)
            ids = p["input_ids"]
            if p["verified_by_context_manager"] is not None:
                v = p["verified_by_context_manager"]
                report["verified_by_context_manager"][f"{mname}|{n}"] = [sum(v.values()), len(v)]
            rest = ids[HEADER:]
            a, b = len(rest) // 3, 2 * len(rest) // 3
            log = TokenizedLog(ids[:HEADER], ["e0", "e1", "e2"], [rest[:a], rest[a:b], rest[b:]])
            t0 = time.time()
            _, caps = capture_prefill(model, log, window=len(ids))
            t_cap = time.time() - t0

            def kvs_of(name, mname=mname, n=n):
                return kvs[f"{mname}|{n}|{name}"].astype(np.float64)  # [layers, heads, rows]

            ev_scores = {}  # (scorer, layer) -> eventkv scores [heads, rows] (numpy float64)

            def ev_of(name, c, ev_scores=ev_scores, policies=policies):
                if (name, c.layer) not in ev_scores:
                    ev_scores[(name, c.layer)] = policies[name].scores(c).numpy()
                return ev_scores[(name, c.layer)]

            # the score noise between the two sides (finite entries)
            for name in ("knorm", "snapkv", "tova", "expected", "observed", "keydiff", "finch"):
                rel = []
                kv = kvs_of(name)
                for c in caps:
                    e = ev_of(name, c)
                    fin = np.isfinite(e)
                    k = kv[c.layer]
                    if name in ("snapkv", "finch"):
                        fin &= np.arange(c.rows)[None, :] < c.rows - 8
                    if name == "expected":
                        fin &= np.arange(c.rows)[None, :] >= 4
                    if name == "tova":
                        fin &= np.arange(c.rows)[None, :] < c.rows - 1
                    if name == "knorm":  # eventkv merges near ties: compare the raw norms
                        e = -c.keys.double().norm(dim=-1).numpy()
                    d = np.abs(e[fin] - k[fin]) / np.maximum(np.abs(e[fin]), 1e-300)
                    rel.append(d)
                d = np.concatenate(rel)
                cur = noise.setdefault(name, {"max_rel": 0.0, "median_rel": []})
                cur["max_rel"] = max(cur["max_rel"], float(d.max()))
                cur["median_rel"].append(float(np.median(d)))

            for key, cell in p["cells"].items():
                name = key.split("@")[0]
                rkey = key.split("@")[1]
                ratio = float(rkey)  # the ratio each stage gets (cell["ratio"] is Composed's compound one)
                policy = policies[name]
                row = counts.setdefault(name, {}).setdefault(rkey, {}).setdefault(n_str, [0, 0, 0, 0, 0])
                for c in caps:
                    mask = keep_mask(policy, c, ratio).numpy()
                    theirs = np.stack([unpack(h, n) for h in cell["kept"][c.layer]])
                    same_heads = [bool((mask[h] == theirs[h]).all()) for h in range(c.kv_heads)]
                    row[0] += sum(same_heads)
                    row[1] += c.kv_heads
                    if name in MARGIN_PRESSES:  # how close identical cells came to a swap
                        sm = ev_of(name, c) if name != "knorm" else -c.keys.double().norm(dim=-1).numpy()
                        for h in range(c.kv_heads):
                            if not same_heads[h]:
                                continue
                            kept_s, gone_s = sm[h][mask[h]], sm[h][~mask[h]]
                            kept_s, gone_s = kept_s[np.isfinite(kept_s)], gone_s[np.isfinite(gone_s)]
                            if not len(kept_s) or not len(gone_s):
                                continue
                            lo, hi = float(kept_s.min()), float(gone_s.max())
                            rel = (lo - hi) / max(abs(lo), abs(hi))
                            cur = report["margins"].get(name)
                            if cur is None or rel < cur["rel"]:
                                report["margins"][name] = {
                                    "rel": rel,
                                    "where": f"{mname} {n} tokens r={ratio:g} layer {c.layer} head {h}",
                                }
                    if all(same_heads):
                        continue
                    # classify the differing heads (or the layer, for cross-head budgets)
                    findings = _explain(
                        name,
                        c,
                        ratio,
                        mask,
                        theirs,
                        same_heads,
                        policy,
                        ev_of,
                        kvs_of,
                        p["cells"],
                        n,
                        dict(
                            Knorm=Knorm,
                            keep_mask=keep_mask,
                            _one_head=_one_head,
                            safeguard=safeguard,
                            top_cells=top_cells,
                            kept_count=kept_count,
                            top_rows=top_rows,
                            window_attention=window_attention,
                            dataclasses=dataclasses,
                        ),
                    )
                    for f in findings:
                        cls = f["class"]
                        row[{"a:tie": 2, "a:near": 3, "b": 4}[cls]] += f["heads"]
                        f.update(model=mname, prompt=n, press=name, ratio=ratio, layer=c.layer)
                        if cls == "a:near":
                            prev = report["a_max"].get(name)
                            if prev is None or f["gap"]["ev"]["rel"] > prev["rel"]:
                                report["a_max"][name] = {
                                    "rel": f["gap"]["ev"]["rel"],
                                    "ulps": f["gap"]["ev"]["ulps"],
                                    "where": f"{mname} {n} tokens r={ratio:g} layer {c.layer}",
                                }
                        report.setdefault("all_findings", []).append(f)
                        if cls == "a:tie":  # how far apart kvpress's own scores of the swapped rows are
                            kvg = f["gap"].get("kv")
                            t = report["a_tie_kv"].setdefault(
                                name, {"kv_equal": 0, "kv_apart": 0, "kv_ulps_max": 0.0, "kv_inf": 0, "no_kv_scores": 0}
                            )
                            if kvg is None:
                                t["no_kv_scores"] += f["heads"]
                            elif kvg["gap"] == 0:
                                t["kv_equal"] += f["heads"]
                            elif math.isinf(kvg["ulps"]):
                                t["kv_inf"] += f["heads"]
                            else:
                                t["kv_apart"] += f["heads"]
                                t["kv_ulps_max"] = max(t["kv_ulps_max"], kvg["ulps"])
                        report.setdefault("a_examples", {}).setdefault(f"{name}|{cls}", [])
                        ex = report["a_examples"][f"{name}|{cls}"]
                        if cls != "b" and len(ex) < 3:
                            ex.append({k: f[k] for k in ("model", "prompt", "ratio", "layer", "what", "gap")})
                        if cls == "b":
                            report["b_details"].append(f)
            print(f"{mname} {n} tokens: capture {t_cap:.1f} s, compared in {time.time() - t0:.1f} s", flush=True)
        for v in noise.values():
            if isinstance(v["median_rel"], list):
                v["median_rel"] = float(np.median(v["median_rel"]))
        report["eventkv_side"][f"seconds_{mname}"] = round(time.time() - t_model, 1)
        del model
        import gc

        gc.collect()
    report["eventkv_side"]["seconds"] = round(time.time() - t_all, 1)
    write_report(report, args.out)


def _explain(name, c, ratio, mask, theirs, same_heads, policy, ev_of, kvs_of, cells, n, h_):
    """The findings of one differing (layer) cell: a list of {class, heads, what, gap, ...}."""
    top_rows, kept_count = h_["top_rows"], h_["kept_count"]
    rows = c.rows
    diff_heads = [h for h in range(c.kv_heads) if not same_heads[h]]
    out = []

    def head_finding(h, s_ev, s_kv, note=""):
        e = np.nonzero(mask[h] & ~theirs[h])[0].tolist()
        k = np.nonzero(theirs[h] & ~mask[h])[0].tolist()
        if len(e) != len(k):
            return {
                "class": "b",
                "heads": 1,
                "what": f"head {h}: kept counts differ, eventkv {int(mask[h].sum())} vs kvpress {int(theirs[h].sum())}"
                + note,
                "eventkv_only": e,
                "kvpress_only": k,
                "gap": {},
            }
        g = gap_of(s_ev, s_kv, e, k)
        f = {
            "class": classify(g),
            "heads": 1,
            "what": f"head {h}: eventkv only {e}, kvpress only {k}" + note,
            "eventkv_only": e,
            "kvpress_only": k,
            "gap": g,
            "eventkv_scores": {"ev_only": [float(x) for x in s_ev[e]], "kv_only": [float(x) for x in s_ev[k]]},
        }
        if s_kv is not None:
            f["kvpress_scores"] = {"ev_only": [float(x) for x in s_kv[e]], "kv_only": [float(x) for x in s_kv[k]]}
        return f

    def window_note(e_rows, k_rows, window=8):
        if all(r >= rows - window for r in e_rows + k_rows):
            return " (all in the window: kept count below the window, kvpress's window rows tie)"
        return ""

    if name in ("streaming", "knorm", "snapkv", "tova", "expected", "observed", "keydiff", "lagkv", "finch"):
        kv = kvs_of(name if name != "streaming" else f"streaming@{ratio:g}")[c.layer]
        ev = ev_of(name, c)
        for h in diff_heads:
            f = head_finding(h, ev[h], kv[h])
            if name in ("snapkv", "finch"):
                f["what"] += window_note(f["eventkv_only"], f["kvpress_only"])
            out.append(f)
    elif name == "finch_chunked":  # per-chunk budgets over Finch's scores
        kv, ev = kvs_of("finch")[c.layer], ev_of("finch", c)
        for h in diff_heads:
            f = head_finding(h, ev[h], kv[h])
            f["what"] += window_note(f["eventkv_only"], f["kvpress_only"])
            out.append(f)
    elif name in ("pyramidkv", "perlayer_snapkv"):
        kv, ev = kvs_of("snapkv")[c.layer], ev_of("snapkv", c)
        for h in diff_heads:
            f = head_finding(h, ev[h], kv[h])
            f["what"] += window_note(f["eventkv_only"], f["kvpress_only"])
            out.append(f)
    elif name == "criticalkv_snapkv":
        kv = kvs_of(f"criticalkv@{ratio:g}")[c.layer].copy()
        kv[kv >= np.finfo(np.float32).max] = np.inf  # kvpress marks stage-1 rows with finfo.max
        inner = ev_of("snapkv", c)
        outright = top_rows(torch.from_numpy(inner), c.positions, policy.first(c, ratio))
        ev = torch.where(outright, float("inf"), policy.scores(c)).numpy()
        for h in diff_heads:
            f = head_finding(h, ev[h], kv[h])
            f["what"] += window_note(f["eventkv_only"], f["kvpress_only"])
            out.append(f)
    elif name in ("adakv_snapkv", "criticaladakv_snapkv"):
        # cross-head budgets: the layer is one decision; report per layer (heads = the differing heads)
        inner = ev_of("snapkv", c)
        kv_inner = kvs_of("snapkv")[c.layer]
        n_keep = kept_count(rows, ratio)
        safe_n = h_["safeguard"](n_keep, 0.2)
        safe = top_rows(torch.from_numpy(inner), c.positions, safe_n).numpy()
        ev = np.where(safe, np.inf, inner)
        kvb = kv_inner.copy()
        for h in range(c.kv_heads):  # kvpress's safeguard: its own top n_safe per head
            kvb[h, np.argsort(-kvb[h], kind="stable")[:safe_n]] = np.inf
        ev_counts, kv_counts = mask.sum(1).tolist(), theirs.sum(1).tolist()
        if name == "adakv_snapkv" or ev_counts != kv_counts:
            # the budget stage (AdaKV's mask itself, or CriticalAdaKV's per-head counts): cells across heads
            if name == "adakv_snapkv":
                em, km = mask, theirs
            else:
                em = h_["top_cells"](torch.from_numpy(ev), c.positions, c.kv_heads * n_keep).numpy()
                km = None  # kvpress's budget cells are not recorded: compare the boundary on eventkv's side
            if km is not None:
                e = np.nonzero((em & ~km).ravel())[0].tolist()
                k = np.nonzero((km & ~em).ravel())[0].tolist()
                g = gap_of(ev.ravel(), kvb.ravel(), e, k)
                what = (
                    f"cells (head, row) eventkv only {[divmod(i, rows) for i in e]}, "
                    f"kvpress only {[divmod(i, rows) for i in k]}"
                )
            else:
                kept_s = ev[em]
                gone_s = ev[~em]
                lo, hi = float(kept_s.min()), float(gone_s.max())
                e, k = [], []
                if lo == hi:  # an exact tie at the boundary (inf: always-kept window / safeguard cells)
                    g = {"ev": {"gap": 0.0, "rel": 0.0, "ulps": 0.0}}
                else:
                    mag = max(abs(lo), abs(hi))
                    g = {"ev": {"gap": lo - hi, "rel": (lo - hi) / mag, "ulps": (lo - hi) / ulp32(mag)}}
                what = (
                    f"per-head budgets differ: eventkv {ev_counts}, kvpress {kv_counts}; eventkv's budget boundary "
                    f"(last kept vs first evicted cell, SnapKV scores) {lo:.9g} vs {hi:.9g}"
                )
            f = {"class": classify(g), "heads": len(diff_heads), "what": what, "gap": g}
            f["what"] += window_note([i % rows for i in e], [i % rows for i in k]) if e else ""
            out.append(f)
        else:
            # same per-head budgets: the CriticalKV stage within each head
            budgets = torch.tensor(ev_counts)
            first = torch.maximum(torch.tensor(safe_n), (budgets.double() * 0.5).long())
            outright = top_rows(torch.from_numpy(inner), c.positions, first)
            ev2 = torch.where(outright, float("inf"), policy.scores(c)).numpy()
            for h in diff_heads:
                f = head_finding(h, ev2[h], None, " (CriticalKV stage, same per-head budgets)")
                f["what"] += window_note(f["eventkv_only"], f["kvpress_only"])
                out.append(f)
    elif name == "chunkkv_snapkv":
        chunk = CHUNK
        ev = ev_of("snapkv", c).sum(0)
        kv = kvs_of("snapkv")[c.layer].sum(0)
        starts = list(range(0, rows, chunk))
        ev_c = np.array([ev[i : i + chunk].mean() for i in starts])
        kv_c = np.array([kv[i : i + chunk].mean() for i in starts])
        e_ch = sorted({r // chunk for r in np.nonzero(mask[0] & ~theirs[0])[0].tolist()})
        k_ch = sorted({r // chunk for r in np.nonzero(theirs[0] & ~mask[0])[0].tolist()})
        g = gap_of(ev_c, kv_c, e_ch, k_ch) if e_ch and k_ch else {}
        f = {
            "class": classify(g) if g else "b",
            "heads": len(diff_heads),
            "what": f"chunks eventkv only {e_ch}, kvpress only {k_ch} (chunk scores ev {ev_c[e_ch].tolist()} / "
            f"{ev_c[k_ch].tolist()}, kv {kv_c[e_ch].tolist()} / {kv_c[k_ch].tolist()})",
            "gap": g,
        }
        out.append(f)
    elif name == "composed_snapkv_knorm":
        first = h_["keep_mask"](policy.policies[0], c, ratio).numpy()
        kv_first = np.stack([unpack(x, n) for x in cells[f"snapkv@{ratio:g}"]["kept"][c.layer]])
        kn = kvs_of("knorm")[c.layer]
        for h in diff_heads:
            if not (first[h] == kv_first[h]).all():
                # the difference comes from stage 1 (the snapkv cell at this ratio): classify that
                e = np.nonzero(first[h] & ~kv_first[h])[0].tolist()
                k = np.nonzero(kv_first[h] & ~first[h])[0].tolist()
                g = gap_of(ev_of("snapkv", c)[h], kvs_of("snapkv")[c.layer][h], e, k)
                f = {
                    "class": classify(g),
                    "heads": 1,
                    "what": f"head {h}: stage 1 (SnapKV) differs: eventkv only {e}, kvpress only {k}"
                    + window_note(e, k),
                    "gap": g,
                }
                out.append(f)
                continue
            kept1 = torch.from_numpy(np.nonzero(first[h])[0])
            sub = h_["_one_head"](c, h, kept1)
            s_ev = np.full(rows, np.nan)
            s_ev[kept1.numpy()] = h_["Knorm"]().scores(sub)[0].numpy()
            f = head_finding(h, s_ev, kn[h], " (stage 2, Knorm on the same SnapKV rows)")
            out.append(f)
    elif name == "simlayerkv":  # one decision per layer: lazy on one side only
        att = h_["window_attention"](c, name, policy.last)[:, :, : rows - policy.last].mean(dim=(0, 1))
        share = float(att[: policy.initial].sum() + att[-policy.recent :].sum())
        margin = share - policy.threshold
        out.append(
            {
                "class": "a:near" if abs(margin) <= NEAR_REL * policy.threshold else "b",
                "heads": len(diff_heads),
                "what": f"layer lazy on {'eventkv' if policy.lazy(c) else 'kvpress'}'s side only: eventkv's share "
                f"{share:.7f} against the threshold {policy.threshold}",
                "gap": {"ev": {"gap": margin, "rel": abs(margin) / policy.threshold}},
            }
        )
    else:
        raise SystemExit(f"no explanation rule for {name}")
    return out


def write_report(report: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    counts = report["counts"]
    models = list(counts)
    presses = list(next(iter(counts.values())))
    prompts_all = sorted({p for m in counts.values() for r in m[presses[0]].values() for p in r}, key=int)
    lines = [
        "# kvpress 0.5.5 parity on real weights",
        "",
        "Written by `benchmarks/kvpress_parity_real.py --side eventkv` from the kept rows of "
        "`--side kvpress` (see the script's docstring). A cell is one (model, prompt, press, ratio, layer, KV "
        f"head); prompts of {', '.join(prompts_all)} "
        "token ids of a fixed English text, ratios "
        + ", ".join(sorted({r for m in counts.values() for r in m["knorm"]}))
        + f" (PerLayerCompression: 0.25 / 0.75 by layer parity, one cell at 0.5), ChunkKV chunk_length "
        f"{report['chunk_length']}, float32, sdpa (eager for ObservedAttention).",
        "",
        f"kvpress side: kvpress {report['kvpress_side']['versions']['kvpress']}, transformers "
        f"{report['kvpress_side']['versions']['transformers']}, torch {report['kvpress_side']['versions']['torch']}, "
        f"{report['kvpress_side']['seconds']} s. eventkv side: transformers {report['eventkv_side']['transformers']}, "
        f"torch {report['eventkv_side']['torch']}, {report['eventkv_side']['seconds']} s.",
        "",
        "Classes of a differing cell: **a-tie** the rows (or cells, chunks) only one side keeps have equal scores on "
        "one side (kvpress's float32 or eventkv's float64); **a-near** eventkv's scores of those rows lie within "
        f"{report['near_rel']:.3g} of each other (relative; {report['near_rel'] / 2**-23:.0f} float32 ulps); "
        "**b** anything else.",
        "",
        "| press | " + " | ".join(f"{m} identical / total" for m in models) + " | a-tie | a-near | b |",
        "|---|" + "---|" * (len(models) + 3),
    ]
    grand = [0, 0, 0, 0, 0]
    for p in presses:
        cols, tot = [], [0, 0, 0, 0, 0]
        for m in models:
            s = [0, 0, 0, 0, 0]
            for r in counts[m][p].values():
                for v in r.values():
                    s = [a + b for a, b in zip(s, v)]
            cols.append(f"{s[0]} / {s[1]}")
            tot = [a + b for a, b in zip(tot, s)]
        grand = [a + b for a, b in zip(grand, tot)]
        lines.append(f"| {p} | " + " | ".join(cols) + f" | {tot[2]} | {tot[3]} | {tot[4]} |")
    lines.append(f"| **all** | {grand[0]} / {grand[1]} identical | | {grand[2]} | {grand[3]} | {grand[4]} |")
    lines += ["", "## Per ratio and prompt (identical / total)", ""]
    for m in models:
        lines.append(f"**{m}**")
        lines.append("")
        ratios = sorted({r for p in presses for r in counts[m][p]}, key=float)
        prompts = sorted({pr for p in presses for r in counts[m][p].values() for pr in r}, key=int)
        hdr = [f"r={r} n={pr}" for r in ratios for pr in prompts]
        lines.append("| press | " + " | ".join(hdr) + " |")
        lines.append("|---|" + "---|" * len(hdr))
        for p in presses:
            cells = []
            for r in ratios:
                for pr in prompts:
                    v = counts[m][p].get(r, {}).get(pr)
                    cells.append("" if v is None else (f"{v[0]}/{v[1]}" if v[0] == v[1] else f"**{v[0]}/{v[1]}**"))
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## Score noise between the two sides",
        "",
        "Relative |eventkv - kvpress| of the scores over every finite row (Knorm: the raw norms).",
        "",
        "| model | " + " | ".join(next(iter(report["score_noise"].values()))) + " |",
        "|---|" + "---|" * len(next(iter(report["score_noise"].values()))),
    ]
    for m, d in report["score_noise"].items():
        lines.append(
            f"| {m} | " + " | ".join(f"max {v['max_rel']:.2g}, median {v['median_rel']:.2g}" for v in d.values()) + " |"
        )
    lines += [
        "",
        "## Identical cells: the closest call per press",
        "",
        "The smallest relative margin between the last kept and the first evicted row (eventkv's scores; Knorm: the "
        "raw float64 norms, before its near-tie merge: a negative margin is a merged tie that both sides happened to "
        "cut alike) among the identical cells, to set against the noise above.",
        "",
    ]
    for p, v in report["margins"].items():
        lines.append(f"- {p}: {v['rel']:.3g} ({v['where']})")
    lines += ["", "## Class a-near: the largest near-tie gap per press", ""]
    for p, v in sorted(report["a_max"].items()):
        lines.append(f"- {p}: {v['rel']:.3g} relative ({v['ulps']:.0f} float32 ulps), {v['where']}")
    if not report["a_max"]:
        lines.append("None: every differing cell is an exact tie on one side (class a-tie).")
    lines += ["", "## Where the differing cells are", ""]
    where: dict = {}
    for f in report.get("all_findings", []):
        k = (f["press"], f["class"])
        where.setdefault(k, {}).setdefault(f"{f['model']} n={f['prompt']} r={f['ratio']:g}", 0)
        where[k][f"{f['model']} n={f['prompt']} r={f['ratio']:g}"] += f["heads"]
    for (p, cls), d in where.items():
        lines.append(f"- {p} ({cls}): " + "; ".join(f"{k}: {v} heads" for k, v in d.items()))
    lines += [
        "",
        "## Class a-tie: kvpress's own scores of the swapped rows",
        "",
        "Per press, the differing heads of class a-tie by what kvpress's float32 scores (recorded on its side) say "
        "of the rows only one side keeps (counts of differing heads): equal (kvpress's choice among them is "
        "`topk`'s order; eventkv keeps the later positions of a tie), a few ulps apart (eventkv's scores are equal: "
        "Knorm's merged near-ties, `Knorm.TIE_RTOL`), or apart by an always-kept mark (inf: kvpress marked some of "
        "the tied rows with `finfo.max` first — AdaKV's safeguard or CriticalKV's stage 1, itself chosen by `topk` "
        "among the tied window rows — and CriticalKV then ranks the other window rows by (max + 1 + epsilon) x the "
        "value term, where eventkv keeps the window's latest rows).",
        "",
        "| press | kvpress equal | kvpress a few ulps apart (max ulps) | kvpress apart by an always-kept mark (inf) "
        "| kvpress scores not recorded |",
        "|---|---|---|---|---|",
    ]
    for p, t in sorted(report["a_tie_kv"].items()):
        lines.append(
            f"| {p} | {t['kv_equal']} | {t['kv_apart']} ({t['kv_ulps_max']:.0f}) | {t['kv_inf']} "
            f"| {t['no_kv_scores']} |"
        )
    lines += ["", f"## Class b: every real difference ({len(report['b_details'])})", ""]
    for f in report["b_details"]:
        g = f.get("gap", {})
        gs = ", ".join(f"{k}: gap {v['gap']:.4g} ({v['rel']:.3g} rel, {v['ulps']:.3g} ulps)" for k, v in g.items())
        lines.append(
            f"- {f['model']} {f['prompt']} tokens {f['press']} r={f['ratio']:g} layer {f['layer']}: {f['what']}; {gs}"
        )
        if "eventkv_scores" in f:
            lines.append(f"  eventkv scores {f['eventkv_scores']}; kvpress scores {f.get('kvpress_scores')}")
    if report["verified_by_context_manager"]:
        lines += ["", "## One-pass vs context-manager runs (kvpress side)", ""]
        for k, (ok, tot) in report["verified_by_context_manager"].items():
            lines.append(f"- {k} tokens: {ok} / {tot} press-ratio cells keep the same rows both ways")
    md = "\n".join(lines) + "\n"
    (out_dir / "summary.md").write_text(md)
    compact = {
        k: report[k]
        for k in (
            "made_by",
            "kvpress_side",
            "eventkv_side",
            "near_rel",
            "chunk_length",
            "counts",
            "margins",
            "a_max",
            "a_tie_kv",
            "score_noise",
            "verified_by_context_manager",
        )
    }
    compact["count_fields"] = ["identical", "total", "a_tie", "a_near", "b"]
    compact["b"] = [
        {k: f[k] for k in ("model", "prompt", "press", "ratio", "layer", "heads", "what", "gap") if k in f}
        for f in report["b_details"][:200]
    ]
    compact["b_total"] = len(report["b_details"])
    (out_dir / "summary.json").write_text(json.dumps(compact, separators=(",", ":"), default=str) + "\n")
    Path("/tmp/i42r/report_full.json").write_text(json.dumps(report, indent=1, default=str))
    print(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--side", choices=("kvpress", "eventkv"), required=True)
    ap.add_argument("--data", type=Path, default=DATA, help="kvpress's kept rows (written / read)")
    ap.add_argument("--out", type=Path, default=RESULTS, help="eventkv side: the results folder")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--lengths", type=int, nargs="*", default=list(LENGTHS))
    ap.add_argument("--ratios", type=float, nargs="*", default=list(RATIOS))
    ap.add_argument("--verify-upto", type=int, default=61, help="kvpress side: also run the context manager way")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: fastest on a shared 2-core machine)")
    args = ap.parse_args()
    (kvpress_side if args.side == "kvpress" else eventkv_side)(args)


if __name__ == "__main__":
    main()
