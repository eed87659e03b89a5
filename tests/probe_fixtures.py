"""A tiny offline tokenizer and model profile for probe tests.

The tokenizer is `eventkv.testing.tiny_tokenizer`'s word-level form over the probes' own words
(instruction, question, event templates, register names, state words): a printable ASCII character
is a token and so is each such word; digits are characters and other words map to ``<unk>``.
Whitespace is its own token, so candidates like " ONLINE" are two tokens (multi-token scoring is
exercised). Built in memory: nothing is downloaded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerFast

from eventkv.testing import tiny_model
from eventkv.testing import tiny_tokenizer as testing_tokenizer


def _probe_words() -> list[str]:
    from eventkv.studies.materialization.donor_pair import INSTRUCTION, NAMES, QUESTION, DonorPair

    probe = DonorPair(states=("ONLINE", "OFFLINE", "STANDBY"))
    text = " ".join(
        [INSTRUCTION, QUESTION, " ".join(NAMES + probe.states), "Answer completed a routine self-test"]
        + probe.items(0, [0])[0]["events"][0]
    )
    return sorted(set(re.findall(r"[A-Za-z_]+", text)))


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The probe tests' tokenizer: word-level over the probes' words (see the module docstring)."""
    return testing_tokenizer(words=_probe_words())


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
