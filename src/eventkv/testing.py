"""Tiny random models built from configs, for tests and benchmarks (no weights downloaded).

Each covers one attention variant: Llama (GQA), Qwen2 (QKV bias), Qwen3 (q/k norm), and
Gemma 3 text (sliding-window layers mixed with full layers, window smaller than test histories).
"""

from __future__ import annotations

import torch

TINY_FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")


def tiny_config(family: str, vocab_size: int = 256, sliding_window: int = 16):
    """A 2-to-6-layer config of ``family`` with hidden size 64 (float32, sdpa attention)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False)
    if family == "llama":
        return LlamaConfig(num_hidden_layers=2, **common)
    if family == "qwen2":
        return Qwen2Config(num_hidden_layers=2, **common)
    if family == "qwen3":
        return Qwen3Config(num_hidden_layers=2, head_dim=16, **common)
    if family == "gemma3":
        return Gemma3TextConfig(num_hidden_layers=3, head_dim=16, sliding_window=sliding_window,
                                layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                **common)
    raise ValueError(f"unknown tiny family {family!r}; use one of {TINY_FAMILIES}")


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **kw):
    """A randomly initialised causal LM of ``family`` in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, **kw)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()
