"""Seams: wherever a scaffold part (chat head, instruction, chat tail) meets tokenized content, the
pieces tokenized on their own concatenate to the ids of the whole text.

Fast tests use the tiny byte-level ChatML tokenizer and tiny SentencePiece-style tokenizers (with and
without a prefix space, with and without a chat template); tests marked ``integration`` use the packaged
smollm2-135m (chat template) and gemma3-270m (plain-text scaffold).
"""

from __future__ import annotations

import logging

import pytest

from eventkv import models
from eventkv.kv.log import Event, EventLog, header_text, tokenize, tokenize_query
from eventkv.models import SEAM_CONTENTS, profile_for, scaffold_seams
from eventkv.models.encoding import encode
from eventkv.studies.splice.engine import SplicePrompt
from eventkv.studies.splice.probe import option_ids
from eventkv.studies.splice.tasks import TASKS, builtin_items
from eventkv.testing import CHATML, tiny_model, tiny_sentencepiece_tokenizer, tiny_tokenizer

QUESTION = "Where is the red key?"


def _plain_byte_level():
    tok = tiny_tokenizer()
    tok.chat_template = None
    return tok


TOKENIZERS = {
    "byte-level-chatml": tiny_tokenizer,
    "byte-level-plain": _plain_byte_level,
    "sentencepiece-plain": lambda: tiny_sentencepiece_tokenizer(prefix_space=False),
    "sentencepiece-prefix-space-plain": lambda: tiny_sentencepiece_tokenizer(prefix_space=True),
    "sentencepiece-prefix-space-chatml": lambda: tiny_sentencepiece_tokenizer(prefix_space=True, chat_template=CHATML),
}


def _splice_contents() -> list[str]:
    """The built-in splice tasks' prompts (two items each), the user content of the splice span."""
    return [item["prompt"] for task in sorted(TASKS) for item in builtin_items(task, 0, [0, 1])]


def assert_seams_hold(tok, profile) -> None:
    """Every seam check of this file for one tokenizer and profile: piecewise ids equal the whole text's,
    tokenized by `encode` and by the tokenizer itself (``add_special_tokens=False``; the prompt opens with
    BOS or a template's special token, so a prefix-space tokenizer adds no space there either)."""

    def whole(text: str) -> list[int]:
        ids = encode(tok, text)
        assert ids == tok(text, add_special_tokens=False)["input_ids"]
        return ids

    head, tail = profile.chat_head, profile.chat_tail
    assert not head.endswith((" ", "\t")), f"head {head!r} ends in a space that would be tokenized apart"
    assert scaffold_seams(tok, head, tail) == []
    for content in SEAM_CONTENTS:
        # the header + events + query path of the log
        log = EventLog(
            [Event("a", content), Event("b", "Dana moved the red key."), Event("c", "42 apples")],
            instruction="Answer in one word.",
        )
        tl = tokenize(log, tok, profile)
        text = header_text(profile, log.instruction) + "".join(ev.render() for ev in log.events) + QUESTION + tail
        assert tl.input_ids + tokenize_query(tok, profile, QUESTION) == whole(text), content
        # no instruction: the first event meets the chat head directly
        tl = tokenize(EventLog([Event("a", content)]), tok, profile)
        assert tl.input_ids == whole(head + content + "\n"), content
    for content in list(SEAM_CONTENTS) + _splice_contents():
        prompt = SplicePrompt.from_text(tok, profile, content)
        assert list(prompt.ids) == whole(head + content + tail), content
        assert list(prompt.span_ids) == encode(tok, content)
    for option in ("positive", "Paris", "42"):
        # the answer continues the tail: option tokens as the whole text has them
        prompt = SplicePrompt.from_text(tok, profile, "Is it good?")
        sep = "" if tail[-1:].isspace() else " "
        assert list(prompt.ids) + option_ids(tok, profile, option) == whole(head + "Is it good?" + tail + sep + option)


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_every_tiny_profile_tokenizes_piecewise_as_the_whole_text(name):
    tok = TOKENIZERS[name]()
    profile = profile_for(tiny_model("llama"), tok, f"tiny-{name}")
    assert profile.scaffold == ("chat_template" if "chatml" in name else "plain_text")
    assert_seams_hold(tok, profile)


def test_plain_text_head_ends_in_a_newline_and_the_old_space_head_had_the_seam():
    tok = tiny_sentencepiece_tokenizer(prefix_space=False)
    profile = profile_for(tiny_model("llama"), tok, "tiny-sp")
    assert (profile.chat_head, profile.chat_tail) == ("<s>User:\n", "\nAssistant:")
    ids = encode(tok, profile.chat_head) + encode(tok, "Dana")
    assert tok.convert_ids_to_tokens(ids) == ["<s>", "U", "s", "e", "r", ":", "\n", "D", "a", "n", "a"]
    # the former head "User: " left a lone space token: 'User', ':', '▁', 'D' instead of 'User', ':', '▁D'
    old = encode(tok, "<s>User: ") + encode(tok, "Dana")
    assert tok.convert_ids_to_tokens(old)[5:8] == [":", "▁", "D"]
    assert tok.convert_ids_to_tokens(encode(tok, "<s>User: Dana"))[5:7] == [":", "▁D"]
    assert scaffold_seams(tok, "<s>User: ", "\nAssistant:") == list(SEAM_CONTENTS)


def test_encode_drops_a_sentencepiece_prefix_space_and_leaves_other_tokenizers_alone():
    sp = tiny_sentencepiece_tokenizer(prefix_space=True)
    assert sp.convert_ids_to_tokens(sp("Dana", add_special_tokens=False)["input_ids"])[0] == "▁D"
    assert sp.convert_ids_to_tokens(encode(sp, "Dana")) == ["D", "a", "n", "a"]
    assert sp.convert_ids_to_tokens(encode(sp, " Dana")) == ["▁D", "a", "n", "a"]  # a real leading space stays
    assert encode(sp, "") == []
    for tok in (tiny_tokenizer(), tiny_sentencepiece_tokenizer(prefix_space=False)):
        for text in SEAM_CONTENTS + (" Dana", "\nDana", ""):
            assert encode(tok, text) == tok(text, add_special_tokens=False)["input_ids"]


def test_stated_difference_content_that_begins_with_whitespace_may_merge_with_the_head():
    """Stated and deliberate: a content piece is tokenized on its own, so a leading newline does not merge
    with the head's closing newline as it may in the whole text (tiny tokenizers have no such merge, so
    here the pieces still agree; gemma3-270m's ``'\\n\\n'`` token is checked in the integration test)."""
    tok = tiny_sentencepiece_tokenizer(prefix_space=False)
    assert scaffold_seams(tok, "<s>User:\n", "\nAssistant:", ("\nDana", " Dana")) == []


def test_a_chat_template_with_a_seam_is_reported(caplog):
    tok = tiny_sentencepiece_tokenizer(
        prefix_space=False, chat_template=("{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}")
    )
    with caplog.at_level(logging.WARNING, logger="eventkv.models"):
        profile = profile_for(tiny_model("llama"), tok, "tiny-inst")
    assert profile.chat_head == "<s>[INST] "
    assert scaffold_seams(tok, profile.chat_head, profile.chat_tail)[0] == SEAM_CONTENTS[0]
    assert "does not tokenize piece by piece" in caplog.text and "tiny-inst" in caplog.text


# --------------------------------------------------------------------------------------------
# Real packaged models


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("alias", sorted(models.ALIASES))
def test_every_packaged_profile_tokenizes_piecewise_as_the_whole_text(alias):
    """Every packaged alias's tokenizer (fetched once per machine); the chat head and tail come from the
    tokenizer alone, so a tiny model of the alias's family stands in for the weights."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models.pull(alias, progress=False))
    family = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}[models.ALIASES[alias].family]
    profile = profile_for(tiny_model(family), tok, alias)
    assert profile.scaffold == ("plain_text" if alias == "gemma3-270m" else "chat_template")
    assert_seams_hold(tok, profile)


@pytest.mark.slow
@pytest.mark.integration
def test_gemma3_plain_head_no_longer_leaves_a_lone_space_token():
    lm = models.load("gemma3-270m")
    tok, p = lm.tokenizer, lm.profile
    assert (p.scaffold, p.chat_head, p.chat_tail) == ("plain_text", "<bos>User:\n", "\nAssistant:")
    ids = encode(tok, p.chat_head) + encode(tok, "Dana moved the red key.")
    assert ids[:6] == [2, 2887, 236787, 107, 170185, 7808]  # '<bos>', 'User', ':', '\n', 'Dana', '▁moved'
    assert tok.convert_ids_to_tokens(ids[:6]) == ["<bos>", "User", ":", "\n", "Dana", "▁moved"]
    # the former head "<bos>User: " gave '<bos>', 'User', ':', '▁', 'Dana' against the whole text's '▁Dana'
    assert scaffold_seams(tok, "<bos>User: ", p.chat_tail, ("Dana moved the red key.",)) == ["Dana moved the red key."]
    # stated difference: a content that begins with a newline merges into '\n\n' in the whole text only
    assert scaffold_seams(tok, p.chat_head, p.chat_tail, ("\nDana",)) == ["\nDana"]
