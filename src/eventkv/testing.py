"""Tiny random models built from configs, for tests and benchmarks (no weights downloaded).

Each covers one attention variant: Llama (GQA), Qwen2 (QKV bias), Qwen3 (q/k norm), and
Gemma 3 text (sliding-window layers mixed with full layers, window smaller than test histories).
"""

from __future__ import annotations

import string
from collections.abc import Iterable
from typing import Any

import torch

TINY_FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
TINY_VOCAB = 320
"""The tiny models' vocabulary size (ids); every tiny tokenizer here fits it."""


def tiny_config(
    family: str,
    vocab_size: int = TINY_VOCAB,
    sliding_window: int = 16,
    rope_parameters: dict | None = None,
    max_context: int = 4096,
    num_hidden_layers: int | None = None,
):
    """A 2-to-6-layer config of ``family`` with hidden size 64 (float32, sdpa attention) and a context of
    ``max_context`` tokens (``max_position_embeddings``: the profile's ``max_context``; the default RoPE
    itself computes any position).

    ``num_hidden_layers``: another depth (None: 2 layers, Gemma 3 3); Gemma 3's layers repeat its pattern of two
    sliding-window layers and one full-attention layer.

    ``rope_parameters``: transformers' RoPE parameters (``{"rope_type": "yarn", "factor": 4.0, ...}``) for the
    Llama, Qwen2 and Qwen3 configs; None keeps the family's default RoPE.
    """
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_context,
        tie_word_embeddings=False,
    )
    if rope_parameters is not None:
        if family == "gemma3":
            raise ValueError("rope_parameters is for llama, qwen2 and qwen3 (Gemma 3 has one RoPE per layer type)")
        common["rope_parameters"] = rope_parameters
    layers = num_hidden_layers or (3 if family == "gemma3" else 2)
    if family == "llama":
        return LlamaConfig(num_hidden_layers=layers, **common)
    if family == "qwen2":
        return Qwen2Config(num_hidden_layers=layers, **common)
    if family == "qwen3":
        return Qwen3Config(num_hidden_layers=layers, head_dim=16, **common)
    if family == "gemma3":
        return Gemma3TextConfig(
            num_hidden_layers=layers,
            head_dim=16,
            sliding_window=sliding_window,
            layer_types=["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(layers)],
            **common,
        )
    raise ValueError(f"unknown tiny family {family!r}; use one of {TINY_FAMILIES}")


def tiny_model(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **kw):
    """A randomly initialised causal LM of ``family`` in eval mode, the same on every CPU.

    Every matrix is drawn N(0, ``initializer_range``) from NumPy's PCG64 generator seeded with
    ``seed``; vectors (norm weights, biases) keep the library's constant init. Why not torch's own
    init: ``torch.nn.init.normal_`` on the CPU takes a vectorised path on x86 with AVX2 and a scalar
    one elsewhere (ARM, ``ATEN_CPU_CAPABILITY=default``) that give different weights for one seed,
    so a test's random model would depend on the CPU.
    """
    import numpy as np
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, **kw)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    rng = np.random.default_rng(seed)
    std = float(cfg.initializer_range)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() >= 2:
                p.copy_(torch.from_numpy(rng.standard_normal(tuple(p.shape)) * std))
    return model.eval()


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(words: Iterable[str] | None = None):
    """A tokenizer for the tiny models, built in memory (under 320 ids: fits their vocabulary).

    Default: byte-level (ids 0..255 are the 256 byte symbols; 256 ``<|endoftext|>``, 257 ``<|im_start|>``,
    258 ``<|im_end|>``) with a ChatML chat template; ``<|endoftext|>`` is EOS.

    With ``words``: word-level, so that the probes' texts stay short and a candidate like ``" ONLINE"`` is
    two tokens. Ids 0..2 are ``<unk>``, ``<|im_start|>``, ``<|im_end|>``, then every printable ASCII
    character, then each of ``words`` in the given order (repeats skipped). A text splits into alphabetic
    words (``[A-Za-z_]+``) and single characters; a word not in ``words`` becomes ``<unk>``, digits and
    whitespace are characters. No chat template, no EOS.

    Raises:
        ValueError: ``words`` make the vocabulary larger than 320 ids.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if words is not None:
        vocab = {t: i for i, t in enumerate(["<unk>", "<|im_start|>", "<|im_end|>"])}
        for token in [*string.printable, *words]:
            vocab.setdefault(token, len(vocab))
        if len(vocab) > TINY_VOCAB:
            raise ValueError(f"{len(vocab)} tokens do not fit the tiny models' {TINY_VOCAB}-id vocabulary")
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[A-Za-z_]+|[\s\S]"), behavior="isolated")
        tok.decoder = decoders.Fuse()
        return PreTrainedTokenizerFast(
            tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=["<|im_start|>", "<|im_end|>"]
        )
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
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
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


def tiny_sentence_model(directory, seed: int = 0, dim: int = 32):
    """Save a tiny random sentence-transformers model in ``directory`` and return its path (for tests of
    the dense selector): a 1-layer BERT (``dim`` hidden units, random weights from ``seed``) over the
    byte-level :func:`tiny_tokenizer`, mean pooling, L2 normalization (the layout of all-MiniLM-L6-v2's
    modules). Its vectors are ``[dim]``; their similarities mean nothing."""
    from pathlib import Path

    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import BertConfig, BertModel

    from eventkv.models.progress import quiet_transformers

    out = Path(directory)
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=dim,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=2 * dim,
        max_position_embeddings=256,
    )
    with quiet_transformers():
        BertModel(config).save_pretrained(out / "bert")
        tok = tiny_tokenizer()
        tok.pad_token = tok.eos_token
        tok.save_pretrained(out / "bert")
        modules = [Transformer(str(out / "bert")), Pooling(dim, "mean"), Normalize()]
        SentenceTransformer(modules=modules, device="cpu").save(str(out / "model"))
    return out / "model"


def tiny_lm(family: str = "llama", seed: int = 0, max_context: int = 4096):
    """A ``LoadedModel`` of a tiny random ``family`` model with :func:`tiny_tokenizer` (for tests), whose
    context is ``max_context`` tokens."""
    from eventkv.models import LoadedModel, profile_for

    model, tok = tiny_model(family, seed=seed, max_context=max_context), tiny_tokenizer()
    return LoadedModel(model, tok, profile_for(model, tok, f"tiny-{family}", weights_digest=f"tiny-{family}-{seed}"))


def save_sharp_model(directory) -> Any:
    """The tiny random Llama of :func:`tiny_lm` with its output layer scaled by 30 (logits spread like a
    trained model's, so greedy steps have clear top-two margins), saved with its tokenizer as a local
    model directory ``directory`` (returned), for servers and benchmarks that load a model by path."""
    lm = tiny_lm("llama")
    with torch.no_grad():
        lm.model.lm_head.weight.mul_(30.0)
    lm.model.save_pretrained(directory)
    lm.tokenizer.save_pretrained(directory)
    return directory


def lookup_model(family: str, table, *, fallback: int, vocab_size: int = 320):
    """A tiny causal LM (``llama`` or ``qwen2``) whose greedy next token is fixed **by construction**
    (weights set by hand, no training), so a test that needs right answers does not depend on one
    CPU's floating-point path.

    ``table[trigger][current] = next`` (token ids): at any position whose context (every row its
    layer-0 attention sees) contains the token ``trigger`` and whose own token is ``current``, the
    model predicts ``next``. ``table[None][current] = next`` applies where no trigger is in sight
    (e.g. the span holding the trigger was zeroed, masked or replaced by a splice). Everywhere else
    it predicts ``fallback``. A context should hold one trigger (several different ones: undefined).

    The circuit, in a residual stream of ``hidden_size`` one-hot directions (1 bias direction,
    one per trigger, one per trigger read, one per ``current`` token, one per ``next`` token):

    * layer 0 attention, query head 0: a constant query against a key that is non-zero only on
      trigger tokens (in RoPE's slowest-rotating pair, so the score barely depends on the distance:
      under 1e-3 of it over 1,000 positions); a trigger scores ~32 against 0 for any other row, and
      its value writes the trigger's read direction (about 1) into the residual. No trigger in
      sight: the attention averages zero values.
    * last layer's MLP: one SwiGLU unit per table entry, an AND of "own token is ``current``" and
      "trigger read" (or "no trigger read" for ``table[None]``); it writes ``next``'s direction.
    * lm_head: reads the ``next`` directions (logit ~40) and, for ``fallback``, the bias direction
      (~17-24 when no unit fires, under 1 when one does). Every other logit is ~0, so each
      prediction wins by a margin of >= 13 nats (measured 13.9-39.6). Every other weight is 0.

    Raises:
        ValueError: another family, a trigger that is also a ``current``/``next`` token, or a table
            too large for the hidden size / MLP width.
    """
    family_ok = ("llama", "qwen2")
    if family not in family_ok:
        raise ValueError(f"lookup_model builds {family_ok} (plain q/k/v); got {family!r}")
    triggers = [t for t in table if t is not None]
    entries = [(trig, cur, nxt) for trig, rows in table.items() for cur, nxt in rows.items()]
    currents = sorted({c for _, c, _ in entries})
    nexts = sorted({n for _, _, n in entries})
    if set(triggers) & (set(currents) | set(nexts)):
        raise ValueError(f"triggers {sorted(set(triggers) & (set(currents) | set(nexts)))} are also table tokens")
    model = tiny_model(family, vocab_size=vocab_size)
    cfg = model.config
    d, n_units = cfg.hidden_size, cfg.intermediate_size
    head_dim = d // cfg.num_attention_heads
    # residual directions
    BIAS = 0
    trig_dir = {t: 1 + i for i, t in enumerate(triggers)}
    read_dir = {t: 1 + len(triggers) + i for i, t in enumerate(triggers)}
    cur_dir = {c: 1 + 2 * len(triggers) + i for i, c in enumerate(currents)}
    next_dir = {n: 1 + 2 * len(triggers) + len(currents) + i for i, n in enumerate(nexts)}
    if 1 + 2 * len(triggers) + len(currents) + len(nexts) > d or len(entries) > n_units or len(triggers) > head_dim:
        raise ValueError(f"table too large for hidden size {d} / {n_units} MLP units / head_dim {head_dim}")
    layers = model.model.layers
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.fill_(1.0)
        emb = model.model.embed_tokens.weight  # [vocab, d]
        emb[:, BIAS] = 1.0
        for t, j in trig_dir.items():
            emb[t, j] = 1.0
        for c, j in cur_dir.items():
            emb[c, j] = 1.0
        # layer 0, query head 0 (reads KV head 0): trigger lookup in RoPE's slowest pair
        inv_freq = model.model.rotary_emb.inv_freq
        slow = int(torch.argmin(inv_freq))  # rotates dims (slow, slow + head_dim / 2)
        attn = layers[0].self_attn
        attn.q_proj.weight[slow, BIAS] = 2.0
        for i, t in enumerate(triggers):
            attn.k_proj.weight[slow, trig_dir[t]] = 2.0
            attn.v_proj.weight[i, trig_dir[t]] = 1.0
            # a trigger row's normalised entry is sqrt(d / 2) (bias + trigger): read = 1
            attn.o_proj.weight[read_dir[t], i] = (2.0 / d) ** 0.5
        # last layer's MLP: one AND unit per table entry
        mlp = layers[-1].mlp
        for u, (trig, cur, nxt) in enumerate(entries):
            mlp.gate_proj.weight[u, cur_dir[cur]] = 4.0
            if trig is None:  # own token AND no trigger read
                mlp.gate_proj.weight[u, BIAS] = -2.0
                for r in read_dir.values():
                    mlp.gate_proj.weight[u, r] = -4.0
            else:  # own token AND this trigger read
                mlp.gate_proj.weight[u, read_dir[trig]] = 4.0
                mlp.gate_proj.weight[u, BIAS] = -6.0
            mlp.up_proj.weight[u, BIAS] = 1.0
            mlp.down_proj.weight[next_dir[nxt], u] = 1.0
        for n, j in next_dir.items():
            model.lm_head.weight[n, j] = 5.0
        model.lm_head.weight[fallback, BIAS] = 3.0
    return model.eval()


def assert_same_greedy(tokens, logits, ref_tokens, ref_logits, tol: float) -> None:
    """Assert that two greedy decodes of one model by two code paths agree: per step logits
    (``[vocab]`` each) within ``tol`` of the reference's, and the same tokens.

    Two paths (batched vs single, cached vs fresh) reduce in different orders, so their logits
    differ by up to ``tol``; the same argmax then follows only where the reference's top two logits
    are more than ``2 * tol`` apart. That margin is asserted at every step, so a near-tie in the
    fixture fails here, by name, on every CPU, instead of flipping a token on some CPUs only.
    """
    assert len(logits) == len(ref_logits), (len(logits), len(ref_logits))
    for step, (got, ref) in enumerate(zip(logits, ref_logits)):
        got, ref = got.detach().float(), ref.detach().float()
        diff = float((got - ref).abs().max())
        assert diff <= tol, f"step {step}: max |logit difference| {diff:.3g} > {tol:g}"
        top = torch.topk(ref, 2).values
        margin = float(top[0] - top[1])
        assert margin > 2 * tol, (
            f"step {step}: the reference's top two logits are {margin:.3g} apart (<= 2 x {tol:g}): "
            "a near-tie, whose argmax depends on the CPU; change the fixture"
        )
        assert int(got.argmax()) == int(ref.argmax()), step
    assert list(tokens) == list(ref_tokens)
