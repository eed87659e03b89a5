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
  the rows kvpress kept, per layer and KV head (sorted row indices).

How the kept rows are read: the prompt runs once without a press (the full cache) and once inside
each press's context manager (kvpress compresses every layer's cache after its prefill forward);
each row left in the compressed cache is found in the full cache by its exact key and value
vectors. Only kvpress's public API is used (the press objects as context managers).
"""

from __future__ import annotations

import argparse
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

# (fixture name, kvpress class, its options); eventkv's policy of the same settings is named in the test
PRESSES = (
    ("streaming", "StreamingLLMPress", {"n_sink": 4}),
    ("knorm", "KnormPress", {}),
    ("snapkv", "SnapKVPress", {"window_size": 8, "kernel_size": 5}),
    ("tova", "TOVAPress", {}),
    ("expected", "ExpectedAttentionPress", {"n_future_positions": 512, "n_sink": 4}),
)


FAMILIES = ("llama", "qwen2")


def build_model(family: str):
    """The tiny ``family`` model: every matrix and bias N(0, WEIGHT_STD) from PCG64(SEED), in name order."""
    import transformers

    cls = {"llama": "Llama", "qwen2": "Qwen2"}[family]
    cfg = getattr(transformers, cls + "Config")(**CONFIG)
    cfg._attn_implementation = "sdpa"
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
        cells = {}
        for name, cls, options in PRESSES:
            for ratio in RATIOS:
                press = getattr(kvpress, cls)(compression_ratio=ratio, **options)
                cells[f"{name}@{ratio:g}"] = {
                    "press": cls,
                    "options": options,
                    "ratio": ratio,
                    "kept": kept_indices(full, cache_rows(model, ids, press)),
                }
        models[family] = cells
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
        save_file(state, str(args.out / f"{family}.safetensors"))
        for key, cell in cells.items():
            print(family, key, [len(h) for layer in cell["kept"] for h in layer])
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
