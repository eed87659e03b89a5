"""Write the kvpress parity fixtures: the rows NVIDIA kvpress's presses keep on a tiny model.

Run in an environment where kvpress is installed (it pins its own transformers, so not eventkv's
environment), from the repository root::

    python3 -m venv /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install torch==2.13.0 kvpress==0.5.5
    /tmp/kvpress-venv/bin/python benchmarks/kvpress_parity.py

It needs nothing of eventkv. It builds two tiny random models from the config below — a Llama
and a Qwen2 (whose q/k/v projections have biases, drawn too) — with weights drawn from NumPy's
PCG64 with a fixed seed (the same on every CPU), a fixed prompt of token ids, and writes to
``tests/data/kvpress_parity/``:

* ``config.json``: the config keyword arguments (both families);
* ``<family>.safetensors``: the weights (float32), so eventkv's test loads exactly these;
* ``kept_rows.json``: the token ids, the versions, and per family, press and compression ratio
  the rows kvpress kept, per layer and KV head (sorted row indices) — every press of ``PRESSES`` at
  every ratio of ``RATIOS``, and the ``EDGE`` cells at their own ratios (SnapKV keeping fewer rows
  than its window, StreamingLLM with more sinks than kept rows and with sinks near the row count) — and
  the ``DECODING`` cells: DecodingPress over Knorm, StreamingLLM and SnapKV, 20 forced tokens fed after the
  prompt, the positions each layer and KV head holds at the end (each layer's rows are followed through
  every cut by a hook that runs before the press's own and sees the rows it cuts).

How the kept rows are read: the prompt runs once without a press (the full cache) and once inside
each press's context manager (kvpress compresses every layer's cache after its prefill forward).
kvpress's presses are of two kinds, and the kept rows of each kind are read so:

* Presses that shrink the cache (every ``ScorerPress`` — StreamingLLM, Knorm, SnapKV, TOVA,
  ExpectedAttention, ObservedAttention, KeyDiff, LagKV, PyramidKV, CriticalKV — and the wrappers
  ChunkKV, PerLayerCompression and Composed, and Finch with ``rerotate_keys=False``): each row left in
  the compressed cache is found in the full cache by its exact key and value vectors. Finch reads its
  window (the question) from a delimiter token before it, which its embedding hook removes: its cells run
  on a copy of the model with one more embedding row, the delimiter's (``finch_kept``).
* Presses that mask rather than shrink (AdaKV, CriticalAdaKV: head-wise budgets, which a
  rectangular cache cannot hold): the cache keeps all rows, and the press records the evicted
  ones on each attention module as ``module.masked_key_indices`` = (batch, KV head, row) index
  tensors, which kvpress's attention patch (``kvpress/attention_patch.py``) later overwrites
  with a fake key whose attention weight underflows to zero at decoding. The kept rows of a
  layer and KV head are then the rows the cache holds (found as above: all of them) less the
  rows ``masked_key_indices`` names for that head. The script sets ``masked_key_indices`` to
  None on every attention module before each run and reads it after the run, for every press
  (None, as for the shrinking presses, masks nothing).

ObservedAttention (H2O) scores from the attention weights, which only the eager attention
returns, so its runs use an eager copy of the model (the same weights); its full cache is that
eager model's own no-press prefill (layer 0's rows are the same as sdpa's; later layers' can
differ in the last bits), and its cells say ``"attn_implementation": "eager"``. Every other
press runs on the sdpa model (AdaKV and CriticalAdaKV refuse eager).

Wrapper presses: a PRESSES option that is a ``{"press": name, "options": {...}}`` dict (or a
list of them) is built as a nested press. The ratio goes to the outermost press whose
constructor takes ``compression_ratio``; a wrapper without one (AdaKV, CriticalAdaKV,
CriticalKV, ChunkKV, Composed) passes it to each nested press, so a Composed cell at ratio r
applies each of its presses at r in turn (kvpress's Composed ratio is then 1 - (1 - r)^2).
PerLayerCompression takes its per-layer ratios from its options; its cell's ratio is kvpress's
``PerLayerCompressionPress.compression_ratio`` (their mean). Only kvpress's public API is used
(the press objects as context managers, and the attribute its masking presses record).
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import numpy as np
import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "kvpress_parity"

CONFIG = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
SEED = 20
WEIGHT_STD = 0.3  # larger than a trained model's init: peaked attention, scores far apart
N_TOKENS = 61  # 0.3 * 61 is fractional: kvpress keeps int(61 * 0.7) = 42 rows, not 61 - floor(18.3) = 43
RATIOS = (0.3, 0.75)

# a nested press (see the docstring): the SnapKV of the "snapkv" cells, wrapped by AdaKV, ChunkKV, ...
SNAPKV = {"press": "SnapKVPress", "options": {"window_size": 8, "kernel_size": 5}}

# (fixture name, kvpress class, its options); eventkv's policy of the same settings is named in the test
PRESSES = (
    ("streaming", "StreamingLLMPress", {"n_sink": 4}),
    ("knorm", "KnormPress", {}),
    ("snapkv", "SnapKVPress", {"window_size": 8, "kernel_size": 5}),
    ("tova", "TOVAPress", {}),
    ("expected", "ExpectedAttentionPress", {"n_future_positions": 512, "n_sink": 4}),
    # presses that wrap others, vary budgets per layer or head, or read every query (see the docstring)
    ("observed", "ObservedAttentionPress", {}),  # H2O; eager attention (see the docstring)
    ("keydiff", "KeyDiffPress", {}),
    ("lagkv", "LagKVPress", {"n_sink": 4, "lag_size": 8}),  # 61 rows: 6 scored partitions of 8, a tail of 9
    # lazy layers by the last query's attention (0.3: three of the four layers lazy, shares 0.19-0.41); no ratio is
    # read, so its two cells are the same press
    ("simlayerkv", "SimLayerKVPress", {"lazy_threshold": 0.3, "n_recent": 16, "n_initial": 4, "n_last": 1}),
    ("adakv_snapkv", "AdaKVPress", {"press": SNAPKV, "alpha_safeguard": 0.2}),  # masks (docstring)
    ("criticalkv_snapkv", "CriticalKVPress", {"press": SNAPKV, "epsilon": 1e-4, "first_stage_ratio": 0.5}),
    (
        "criticaladakv_snapkv",
        "CriticalAdaKVPress",
        {"press": SNAPKV, "alpha_safeguard": 0.2, "epsilon": 1e-4, "first_stage_ratio": 0.5},
    ),  # masks (docstring)
    ("pyramidkv", "PyramidKVPress", {"window_size": 8, "kernel_size": 5, "beta": 20}),
    ("chunkkv_snapkv", "ChunkKVPress", {"press": SNAPKV, "chunk_length": 4}),  # 61 = 15 chunks of 4 + 1
    ("composed_snapkv_knorm", "ComposedPress", {"presses": [SNAPKV, {"press": "KnormPress", "options": {}}]}),
    # per-layer ratios from the options: one cell, at their mean (the RATIOS loop does not apply)
    ("perlayer_snapkv", "PerLayerCompressionPress", {"press": SNAPKV, "compression_ratios": [0.25, 0.75]}),
    # prunes key channels, not rows: the ratio is the fraction of channels; its cells hold the pruned channels
    ("think", "ThinKPress", {"window_size": 8}),
    # the question's window: the last FINCH_WINDOW ids, after a delimiter (see finch_kept); kept rows, not re-rotated
    ("finch", "FinchPress", {"rerotate_keys": False}),
    ("finch_chunked", "FinchPress", {"rerotate_keys": False, "chunk_length": 40}),  # chunks of 40 and 21 rows
    # Not covered, though kvpress 0.5.5 has them: AdaKV/ChunkKV over ObservedAttention (AdaKV refuses
    # eager attention, ChunkKV refuses attention weights); QFilterPress and FastKVzipPress (their
    # filters / gates are downloaded from the Hugging Face hub per named model); DuoAttentionPress
    # (its head patterns are downloaded from the hub, or estimated on the kmfoda/booksum data set
    # with the model's tokenizer); KVzipPress (it loads the model's tokenizer and chat template by
    # name, which these random models lack, to rerun the model on reconstruction prompts); the
    # other presses (ThinK's key-channel pruning, decoding-time presses, ...) are out of this scope.
)
# FinchPress's window: the ids after its delimiter token, which its embedding hook finds and removes
FINCH_WINDOW = 8
# the presses that need attention weights, and so the eager attention
EAGER = {"ObservedAttentionPress"}
# edge cells, each at one ratio of its own: where kvpress's kept rows come out of an exact tie of its own making
EDGE = (
    # 6 of 61 rows kept, fewer than the window's 8: every window row has the same padded score
    ("snapkv_below_window", "SnapKVPress", {"window_size": 8, "kernel_size": 5}, 0.9),
    # 6 rows kept, fewer than the 10 sinks: the zeroed slice n_sink:6 is empty, every row scores 1
    ("streaming_sinks_over_kept", "StreamingLLMPress", {"n_sink": 10}, 0.9),
    # 60 sinks of 61 rows, 30 kept: the same empty slice
    ("streaming_sinks_near_rows", "StreamingLLMPress", {"n_sink": 60}, 0.5),
)


FAMILIES = ("llama", "qwen2")


def build_model(family: str, attn: str = "sdpa"):
    """The tiny ``family`` model: every matrix and bias N(0, WEIGHT_STD) from PCG64(SEED), in name order."""
    import transformers

    cls = {"llama": "Llama", "qwen2": "Qwen2"}[family]
    cfg = getattr(transformers, cls + "Config")(**CONFIG)
    cfg._attn_implementation = attn
    if getattr(cfg, "head_dim", None) is None:
        # Qwen2Config has no head_dim, which CriticalKV reads (module.config.head_dim); Qwen2's
        # attention derives it as hidden_size // heads, so this value changes nothing else
        cfg.head_dim = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    model = getattr(transformers, cls + "ForCausalLM")(cfg).eval()
    rng = np.random.default_rng(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if p.dim() >= 2 or name.endswith(".bias"):
                p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * WEIGHT_STD))
    return model


def prompt_ids() -> list[int]:
    rng = np.random.default_rng(SEED + 1)
    return rng.integers(0, CONFIG["vocab_size"], N_TOKENS).tolist()


def cache_rows(model, ids: list[int], press=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer the cache's (keys, values) ``[kv_heads, rows, head_dim]`` after a prefill of ``ids``."""
    from contextlib import nullcontext

    from transformers import DynamicCache

    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None  # set by masking presses (see the docstring)
    cache = DynamicCache()
    with torch.no_grad(), press(model) if press is not None else nullcontext():
        model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return [(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers]


def kept_indices(full, compressed) -> list[list[list[int]]]:
    """Per layer and KV head, the sorted full-cache rows whose key and value the compressed cache holds."""
    out = []
    for (fk, fv), (ck, cv) in zip(full, compressed):
        heads = []
        for h in range(fk.shape[0]):
            f = torch.cat([fk[h], fv[h]], dim=-1)  # [rows, 2 * head_dim]
            c = torch.cat([ck[h], cv[h]], dim=-1)
            same = (c[:, None, :] == f[None, :, :]).all(-1)  # [kept, rows]
            if not bool((same.sum(1) == 1).all()):
                raise SystemExit(f"a kept row matches {same.sum(1).tolist()} full rows: the rows are not distinct")
            heads.append(sorted(same.float().argmax(1).tolist()))
        out.append(heads)
    return out


def masked_by_head(masked, kv_heads: int) -> list[set[int]]:
    """Per KV head the rows a masking press's ``masked_key_indices`` (``(batch, head, row)`` index tensors, or
    None) names; also read by ``kvpress_parity_real.py``."""
    heads: list[set[int]] = [set() for _ in range(kv_heads)]
    if masked is not None:
        batch, head, row = masked
        if bool((batch != 0).any()):
            raise SystemExit("a masked row of a batch other than the one prompt")
        for h, r in zip(head.tolist(), row.tolist()):
            heads[h].add(r)
    return heads


def masked_rows(model) -> list[list[set[int]]]:
    """Per layer and KV head, the rows the last run's masking press masked (``masked_key_indices``)."""
    return [
        masked_by_head(getattr(layer.self_attn, "masked_key_indices", None), CONFIG["num_key_value_heads"])
        for layer in model.model.layers
    ]


def press_kept(model, ids: list[int], full, press) -> list[list[list[int]]]:
    """Per layer and KV head, the sorted full-cache rows ``press`` keeps: in its compressed cache, not masked."""
    compressed = cache_rows(model, ids, press)
    kept = kept_indices(full, compressed)
    masked = masked_rows(model)
    return [[[r for r in rows if r not in m] for rows, m in zip(layer, ml)] for layer, ml in zip(kept, masked)]


#: presses that prune key channels (zeroed in every row) instead of rows, their ratio given to this argument
CHANNEL_PRESSES = {"ThinKPress": "key_channel_compression_ratio"}


def pruned_channels(full, compressed) -> list[list[list[int]]]:
    """Per layer and KV head, the key channels a channel press zeroed in every row (the values unchanged)."""
    out = []
    for (fk, fv), (ck, cv) in zip(full, compressed):
        if not torch.equal(fv, cv) or fk.shape != ck.shape:
            raise SystemExit("a channel press changed the values or the rows")
        zero = (ck == 0).all(dim=1) & ~(fk == 0).all(dim=1)  # [kv_heads, head_dim]
        if not torch.equal(ck[~zero[:, None, :].expand_as(ck)], fk[~zero[:, None, :].expand_as(fk)]):
            raise SystemExit("a channel press changed a channel it kept")
        out.append([sorted(torch.nonzero(z).flatten().tolist()) for z in zero])
    return out


def finch_kept(family: str, ids: list[int], full, press) -> list[list[list[int]]]:
    """The rows a FinchPress keeps of ``ids`` whose last FINCH_WINDOW ids are the question: a copy of the model with
    one more embedding row, the delimiter, put before the question; the press's hook reads the window from it and
    removes it, so the model prefills exactly ``ids`` (its cache is ``full``'s)."""
    model = build_model(family)
    delimiter = CONFIG["vocab_size"]
    model.resize_token_embeddings(delimiter + 1)
    press.delimiter_token_id = delimiter
    cut = len(ids) - FINCH_WINDOW
    return press_kept(model, ids[:cut] + [delimiter] + ids[cut:], full, press)


# compression during decoding (DecodingPress): the prompt, then DECODE_STEPS forced tokens one at a time, the cache
# cut every DECODE_INTERVAL steps to DECODE_TARGET rows per KV head, the window the last DECODE_BUFFER steps
DECODE_STEPS, DECODE_INTERVAL, DECODE_TARGET, DECODE_BUFFER = 20, 8, 30, 8
DECODING = (
    ("decoding_knorm", "KnormPress", {}),
    ("decoding_streaming", "StreamingLLMPress", {"n_sink": 4}),
    ("decoding_snapkv", "SnapKVPress", {"window_size": 4, "kernel_size": 5}),
)


def forced_ids() -> list[int]:
    """The tokens fed after the prompt in the decoding cells (PCG64(SEED + 2))."""
    rng = np.random.default_rng(SEED + 2)
    return rng.integers(0, CONFIG["vocab_size"], DECODE_STEPS).tolist()


def decoding_positions(model, ids: list[int], forced: list[int], press) -> list[list[list[int]]]:
    """Per layer and KV head, the positions a DecodingPress's cache holds after ``forced`` is fed one token a step
    after the prompt (explicit position ids: the true positions). Each layer's rows are followed through every cut:
    a hook registered before the press's own runs first and sees the layer's rows before the press cuts them; the
    rows left are found among those by their exact key and value."""
    from transformers import DynamicCache

    kv_heads = CONFIG["num_key_value_heads"]
    before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def snapshot(module, args, kwargs, output):
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        before[module.layer_idx] = (layer.keys[0].clone(), layer.values[0].clone())
        return output

    hooks = [m.self_attn.register_forward_hook(snapshot, with_kwargs=True) for m in model.model.layers]
    n = len(ids)
    positions = [[list(range(n)) for _ in range(kv_heads)] for _ in model.model.layers]
    cache = DynamicCache()
    try:
        with torch.no_grad(), press(model):
            model(torch.tensor([ids]), past_key_values=cache, use_cache=True)
            for step, token in enumerate(forced):
                pos = n + step
                model(
                    torch.tensor([[token]]), position_ids=torch.tensor([[pos]]), past_key_values=cache, use_cache=True
                )
                for i, layer in enumerate(cache.layers):
                    bk, bv = before[i]
                    for h in range(kv_heads):
                        grown = positions[i][h] + [pos]
                        if layer.keys.shape[2] == bk.shape[1]:  # not cut this step
                            positions[i][h] = grown
                            continue
                        full = torch.cat([bk[h], bv[h]], dim=-1)
                        left = torch.cat([layer.keys[0, h], layer.values[0, h]], dim=-1)
                        same = (left[:, None, :] == full[None, :, :]).all(-1)  # [left, before]
                        if not bool((same.sum(1) == 1).all()):
                            raise SystemExit("a row left after a cut matches no single row before it")
                        positions[i][h] = [grown[j] for j in same.float().argmax(1).tolist()]
    finally:
        for hook in hooks:
            hook.remove()
    return positions


def make_press(kvpress, cls: str, options: dict, ratio: float | None):
    """The kvpress press ``cls(**options)``, its nested presses built, ``ratio`` given as the docstring says."""

    def build(value):
        if isinstance(value, dict) and "press" in value:
            return make_press(kvpress, value["press"], value.get("options", {}), ratio)
        if isinstance(value, list):
            return [build(v) for v in value]
        return value

    kwargs = {k: build(v) for k, v in options.items()}
    press_cls = getattr(kvpress, cls)
    if cls in CHANNEL_PRESSES:
        return press_cls(**{CHANNEL_PRESSES[cls]: ratio, **kwargs})
    if ratio is not None and "compression_ratio" in inspect.signature(press_cls).parameters:
        kwargs = {"compression_ratio": ratio, **kwargs}
    return press_cls(**kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    from importlib.metadata import version

    import kvpress
    import transformers
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    ids = prompt_ids()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "config.json").write_text(json.dumps(CONFIG, indent=1) + "\n")
    models = {}
    for family in FAMILIES:
        model = build_model(family)
        full = cache_rows(model, ids)
        eager = build_model(family, "eager")
        eager_full = cache_rows(eager, ids)
        cells = {}
        runs = [(n, c, o, r) for n, c, o in PRESSES for r in (RATIOS if "compression_ratios" not in o else (None,))]
        for name, cls, options, ratio in runs + list(EDGE):
            press = make_press(kvpress, cls, options, ratio)
            cell = {"press": cls, "options": options, "ratio": press.compression_ratio if ratio is None else ratio}
            if cls in CHANNEL_PRESSES:
                cell["ratio"] = ratio  # the fraction of key channels
                cell["pruned_channels"] = pruned_channels(full, cache_rows(model, ids, press))
                cell["kept"] = [[list(range(len(ids)))] * CONFIG["num_key_value_heads"]] * len(full)
            elif cls == "FinchPress":
                cell["kept"] = finch_kept(family, ids, full, press)
            elif cls in EAGER:
                cell["attn_implementation"] = "eager"
                cell["kept"] = press_kept(eager, ids, eager_full, press)
            else:
                cell["kept"] = press_kept(model, ids, full, press)
            cells[f"{name}@{cell['ratio']:g}"] = cell
        for name, cls, options in DECODING:
            base = make_press(kvpress, cls, options, None)
            press = kvpress.DecodingPress(
                base_press=base,
                compression_interval=DECODE_INTERVAL,
                target_size=DECODE_TARGET,
                hidden_states_buffer_size=DECODE_BUFFER,
            )
            cells[name] = {
                "press": "DecodingPress",
                "options": {
                    "base_press": {"press": cls, "options": options},
                    "compression_interval": DECODE_INTERVAL,
                    "target_size": DECODE_TARGET,
                    "hidden_states_buffer_size": DECODE_BUFFER,
                },
                "forced_ids": forced_ids(),
                "positions": decoding_positions(model, ids, forced_ids(), press),
            }
        models[family] = cells
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
        save_file(state, str(args.out / f"{family}.safetensors"))
        for key, cell in cells.items():
            print(family, key, [len(h) for layer in cell.get("kept", cell.get("positions")) for h in layer])
    fixture = {
        "made_by": "benchmarks/kvpress_parity.py",
        "versions": {
            "kvpress": version("kvpress"),
            "transformers": transformers.__version__,
            "torch": torch.__version__,
        },
        "seed": SEED,
        "weight_std": WEIGHT_STD,
        "input_ids": ids,
        "models": models,
    }
    (args.out / "kept_rows.json").write_text(json.dumps(fixture, indent=None, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
