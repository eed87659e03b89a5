"""Tiny random models built from configs, for tests and benchmarks (no weights downloaded).

Each covers one attention variant: Llama (GQA), Qwen2 (QKV bias), Qwen3 (q/k norm), and
Gemma 3 text (sliding-window layers mixed with full layers, window smaller than test histories).
"""

from __future__ import annotations

import torch

TINY_FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")


def tiny_config(family: str, vocab_size: int = 320, sliding_window: int = 16):
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


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer():
    """A byte-level tokenizer (ids 0..255 are the 256 byte symbols; 256 ``<|endoftext|>``, 257 ``<|im_start|>``,
    258 ``<|im_end|>``) with a ChatML chat template. Fits the tiny models' 320-token vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.chat_template = CHATML
    return fast


def tiny_sentencepiece_tokenizer(prefix_space: bool = False, chat_template: str | None = None):
    """A character-level SentencePiece-style tokenizer: a space becomes ``▁`` and merges with the next
    character (``' D'`` is one token ``▁D``), as in Gemma's and Llama 2's vocabularies; BOS ``<s>`` is
    prepended on encode. With ``prefix_space`` every text it encodes also gets a leading ``▁`` (Llama 2 /
    Mistral: ``'Dana'`` → ``'▁D', 'a', 'n', 'a'``), without it none (Gemma 3). No chat template unless
    given. Ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>``, then under 320 symbols (fits the tiny models)."""
    import string

    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if not c.isspace()] + ["\n", "Ü", "é"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3}
    for c in chars + ["▁" + c for c in chars if c != "\n"]:
        vocab.setdefault(c, len(vocab))
    merges = [("▁", c) for c in chars if c != "\n"]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    if prefix_space:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.decoder = decoders.Replace("▁", " ")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    if chat_template is not None:
        fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
        fast.chat_template = chat_template
    return fast


def tiny_lm(family: str = "llama", seed: int = 0):
    """A ``LoadedModel`` of a tiny random ``family`` model with :func:`tiny_tokenizer` (for tests)."""
    from eventkv.models import LoadedModel, profile_for

    model, tok = tiny_model(family, seed=seed), tiny_tokenizer()
    return LoadedModel(model, tok, profile_for(model, tok, f"tiny-{family}", weights_digest=f"tiny-{family}-{seed}"))
