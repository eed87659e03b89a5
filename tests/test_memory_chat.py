"""Chat in the library: a conversation read after a memory's rows (:mod:`eventkv.memory.chat`) in the
model's chat template, the decoding options of the readout (:class:`eventkv.kv.decoding.Decoding`: seeded
sampling, stop strings, the per-step text that never splits a character), on the tiny Llama with its
byte-level ChatML tokenizer."""

from __future__ import annotations

import pytest

from eventkv.errors import OptionError
from eventkv.kv.decoding import Decoding, TextWatch
from eventkv.kv.log import tokenize_query
from eventkv.memory import EventMemory
from eventkv.memory.chat import chat_prompt_ids, chat_reply, chat_tail_ids, chat_tail_text, check_messages
from eventkv.testing import tiny_lm

QUESTION = "Where does Dana live?"


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


@pytest.fixture()
def mem(lm, tmp_path):
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as m:
        m.add(["Dana lives in Lisbon.", "Ravi drinks tea."])
        yield m


def test_one_user_message_reads_as_the_question(lm):
    messages = [{"role": "user", "content": QUESTION}]
    assert chat_tail_ids(lm, messages) == tokenize_query(lm.tokenizer, lm.profile, QUESTION)


def test_a_conversation_continues_the_headers_user_turn(lm):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": QUESTION},
    ]
    # ChatML (the tiny tokenizer's template) without its opening "<|im_start|>user\n": the memory's header
    assert chat_tail_text(lm, messages) == (
        "Be brief.\n\nHi.<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\n"
        + QUESTION
        + "<|im_end|>\n<|im_start|>assistant\n"
    )
    # the model alone: the template over the messages as given, system message included
    expected = lm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert chat_prompt_ids(lm, messages) == lm.tokenizer(expected, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize(
    "messages, field",
    [
        ([], "messages"),
        ("hi", "messages"),
        ([{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "x"}], "messages[-1].role"),
        ([{"role": "user", "content": "  "}], "messages[-1].content"),
        ([{"role": "tool", "content": "x"}], "messages[0]"),
        ([{"role": "user", "content": 3}], "messages[0]"),
    ],
)
def test_bad_conversations_name_the_field(messages, field):
    with pytest.raises(OptionError) as e:
        check_messages(messages)
    assert e.value.field == field


def test_a_memory_conversation_must_open_with_the_user(lm):
    with pytest.raises(OptionError) as e:
        chat_tail_text(lm, [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": QUESTION}])
    assert e.value.field == "messages[0].role"


def test_the_step_text_never_splits_a_character(lm):
    text = "é€ ok"
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode())  # byte-level: one token per byte
    watch = TextWatch(lm.tokenizer, ())
    pieces = [watch.step(ids[: n + 1]) for n in range(len(ids))]
    assert pieces == ["", "é", "", "", "€", " ", "o", "k"] and "".join(pieces) == text


def test_stop_strings_are_held_back_until_they_cannot_match(lm):
    text = "abcXYd"
    ids = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    watch = TextWatch(lm.tokenizer, ("XYZ", "cX"))
    pieces = [watch.step(ids[: n + 1]) for n in range(4)]
    assert pieces == ["a", "b", "", ""] and watch.stop == "cX" and watch.text == "ab"


def test_decoding_in_the_memory_query(mem):
    greedy = mem.query(QUESTION, select="view", max_new_tokens=10)
    pieces: list[str] = []
    watched = mem.query(QUESTION, select="view", max_new_tokens=10, decoding=Decoding(on_step=pieces.append))
    assert watched.generation.tokens == greedy.generation.tokens and "".join(pieces) == greedy.text
    assert len(pieces) == len(greedy.generation.tokens) + greedy.generation.stopped  # one call per step
    a, b = (
        mem.query(QUESTION, select="view", max_new_tokens=10, decoding=Decoding(temperature=1.0, seed=s))
        for s in (5, 5)
    )
    assert a.generation.tokens == b.generation.tokens
    with pytest.raises(OptionError):
        mem.query_batch(QUESTION, [("view", "compact"), ("view", "text")], decoding=Decoding(on_step=print))


@pytest.mark.parametrize(
    "bad, field",
    [
        (Decoding(temperature=-1), "temperature"),
        (Decoding(temperature=2.5), "temperature"),
        (Decoding(top_p=0), "top_p"),
        (Decoding(seed=1.5), "seed"),  # type: ignore[arg-type]
        (Decoding(stop=("",)), "stop"),
        (Decoding(stop="x"), "stop"),  # type: ignore[arg-type]
    ],
)
def test_bad_decodings_are_option_errors(bad, field):
    with pytest.raises(OptionError) as e:
        bad.check()
    assert e.value.field == field


def test_the_model_alone_answers_a_conversation(lm):
    messages = [{"role": "user", "content": QUESTION}]
    reply = chat_reply(lm, messages, max_new_tokens=6)
    assert reply.prompt_tokens == len(chat_prompt_ids(lm, messages)) and len(reply.generation.tokens) <= 6
    with pytest.raises(OptionError) as e:
        chat_reply(lm, messages, max_new_tokens=5000)
    assert e.value.field == "max_new_tokens"
