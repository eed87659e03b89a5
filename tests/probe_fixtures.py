"""A tiny offline tokenizer and model profile for probe tests.

The tokenizer is word-level: every printable ASCII character is a token, and so is every
alphabetic word of the probes' own texts (instruction, question, event templates, register
names, state words); digits are characters and other words map to ``<unk>``. Whitespace is its
own token, so candidates like " ONLINE" are two tokens (multi-token scoring is exercised). Plus
two chat special tokens; under 256 ids, the tiny models' vocabulary. Built in memory: nothing is downloaded.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, field

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from eventkv.testing import tiny_model

SPECIAL = ["<unk>", "<|im_start|>", "<|im_end|>"]


def _probe_words() -> list[str]:
    from eventkv.probes.donor_pair import INSTRUCTION, NAMES, QUESTION, DonorPair

    probe = DonorPair(states=("ONLINE", "OFFLINE", "STANDBY"))
    text = " ".join(
        [INSTRUCTION, QUESTION, " ".join(NAMES + probe.states), "Answer completed a routine self-test"]
        + probe.items(0, [0])[0]["events"][0]
    )
    return sorted(set(re.findall(r"[A-Za-z_]+", text)))


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {t: i for i, t in enumerate(SPECIAL)}
    for ch in string.printable:
        vocab.setdefault(ch, len(vocab))
    for w in _probe_words():
        vocab.setdefault(w, len(vocab))
    assert len(vocab) <= 256, len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[A-Za-z_]+|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", additional_special_tokens=SPECIAL[1:])
    return fast


@dataclass
class TinyProfile:
    """The fields of eventkv.models.ModelProfile a probe reads."""

    chat_head: str = "<|im_start|>user\n"
    chat_tail: str = "<|im_end|>\n<|im_start|>assistant\n"
    stop_token_ids: list = field(default_factory=list)
    max_context: int = 4096
    weights_digest: str = "tiny-random"
    dtype: str = "float32"
    name: str = "tiny"

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def tiny_runtime(family: str = "llama", seed: int = 0):
    from eventkv.probes.base import Runtime

    tok = tiny_tokenizer()
    prof = TinyProfile(stop_token_ids=[tok.convert_tokens_to_ids("<|im_end|>")], name=f"tiny-{family}")
    return Runtime(tiny_model(family, seed=seed), tok, prof)
