"""Chat messages as token ids: the conversation that follows a memory's served rows, or a whole
prompt for the model alone, both in the model's own chat template.

A memory's rows sit inside one user turn: its header is the template's head up to the user's content
(:attr:`eventkv.models.ModelProfile.chat_head`, plus the memory's instruction), its events follow as
that content, and a question closes the turn (``question + chat_tail``: :func:`eventkv.kv.log.tokenize_query`).
A conversation read after the rows (:func:`chat_tail_ids`) continues the same turn: the template renders
the conversation, the head it opens with is dropped (the memory's header stands in its place), so the
first user message follows the rows as a question does, and a conversation of one user message gives
exactly the ids :func:`~eventkv.kv.log.tokenize_query` gives for its text. The contents are placed into the
rendered template as given (the template renders placeholders, as :func:`eventkv.models.profile_for`
does to find the head and tail), so a template's own processing of a content (a trim) applies to
neither path. System messages cannot go where the template puts them (the header is the memory's,
prefilled once), so under a memory each system message's text opens the next user message's content.

The model alone (:func:`chat_prompt_ids`, :func:`chat_reply`): the template over the messages as given.

A content is text, never markup: a special token's string typed in it (ChatML's ``<|im_end|>``, a
``</s>``) is tokenized as its characters (the tokenizer's ``split_special_tokens``), so the control
tokens of a prompt are the template's alone and a message cannot close its turn or forge another.
A conversation whose contents hold no such string is tokenized as one text, exactly as before.

Messages are mappings with ``role`` (``system`` | ``user`` | ``assistant``) and ``content`` (a string),
the last one from the user (the reply is the assistant's next turn).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence, cast

import torch
from transformers import DynamicCache

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.decoding import Decoding
from eventkv.kv.model import check_context, model_device, model_forward
from eventkv.kv.readout import Generation, answer_served
from eventkv.kv.rows import cache_kv
from eventkv.kv.serve import ServedCache
from eventkv.models.encoding import encode
from eventkv.models.introspect import PLAIN_TEXT_HEAD, PLAIN_TEXT_TAIL
from eventkv.options import check_max_new_tokens

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.models.profile import LoadedModel

ROLES = ("system", "user", "assistant")
#: what stands for the i-th content while the template renders (replaced by the content after)
_PLACEHOLDER = "EVENTKV_CHAT_CONTENT_{}_5b1e"
_PLACEHOLDERS = re.compile(r"EVENTKV_CHAT_CONTENT_(\d+)_5b1e")

#: a rendered conversation: its pieces in order, each ``(text, is_content)`` (a message's content, or
#: the template's text around the contents)
Parts = list[tuple[str, bool]]


@dataclass(frozen=True)
class ChatReply:
    """What the model alone answered to a conversation (:func:`chat_reply`).

    Attributes:
        text: the reply (stop token excluded; cut at a stop string).
        generation: the :class:`eventkv.kv.readout.Generation` (tokens, finish reason).
        prompt_tokens: tokens of the rendered conversation the reply was read after.
        timings_ms: wall time in milliseconds of ``prefill`` (the prompt) and ``decode``.
    """

    text: str
    generation: Generation
    prompt_tokens: int
    timings_ms: dict[str, float]


def check_messages(messages) -> list[dict[str, str]]:
    """The conversation, checked: a list of ``{"role", "content"}`` dicts (copies).

    Raises:
        OptionError: no messages; a message that is not a mapping with a role among :data:`ROLES`
            and a string content; a last message not from the user, or a blank one.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise OptionError("messages", messages, "give a non-empty list of {'role', 'content'} messages.")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
            raise OptionError(
                f"messages[{i}]", m, f"give a mapping with a role among {', '.join(ROLES)} and a string content."
            )
        out.append({"role": str(m["role"]), "content": str(m["content"])})
    if out[-1]["role"] != "user":
        raise OptionError(
            "messages[-1].role",
            out[-1]["role"],
            "end the conversation with a user message: the reply is the assistant's next turn.",
        )
    if not out[-1]["content"].strip():
        raise OptionError("messages[-1].content", out[-1]["content"], "give the last user message some text.")
    return out


def last_user_text(messages) -> str:
    """The content of the conversation's last message (a user's: :func:`check_messages`), what a
    memory selects its served events from.

    Raises:
        OptionError: as :func:`check_messages`.
    """
    return check_messages(messages)[-1]["content"]


def _render(lm: LoadedModel, messages: list[dict[str, str]]) -> Parts:
    """The model's chat template over ``messages`` with the generation prompt, the contents placed
    as given, as :data:`Parts`; a tokenizer without a template gets the plain-text scaffold
    (``User:`` / ``Assistant:``).

    Raises:
        EventKVError: no tokenizer, or the template renders a placeholder other than once.
        OptionError: the template refuses the conversation (e.g. roles that do not alternate).
    """
    tok = lm.tokenizer
    if lm.profile.scaffold == "none" or tok is None:
        raise EventKVError("a chat needs the model's tokenizer: load the model with its tokenizer.")
    if not getattr(tok, "chat_template", None):
        parts: Parts = []
        for m in messages:  # the scaffold eventkv gives a model without a template, turn after turn
            if m["role"] == "user":
                parts += [(PLAIN_TEXT_HEAD, False), (m["content"], True), (PLAIN_TEXT_TAIL, False)]
            elif m["role"] == "assistant":
                parts += [(" ", False), (m["content"], True), ("\n", False)]
            else:
                parts += [(m["content"], True), ("\n", False)]
        return parts
    held = [{"role": m["role"], "content": _PLACEHOLDER.format(i)} for i, m in enumerate(messages)]
    try:
        rendered = cast(str, tok.apply_chat_template(held, tokenize=False, add_generation_prompt=True))
    except Exception as exc:  # jinja2's TemplateError, or the template's own raise_exception
        raise OptionError(
            "messages", f"{len(messages)} messages", f"the model's chat template refuses this conversation ({exc})."
        ) from None
    for i in range(len(messages)):
        mark = _PLACEHOLDER.format(i)
        if rendered.count(mark) != 1:
            raise EventKVError(
                f"the chat template of {lm.profile.name!r} renders message {i} {rendered.count(mark)} times, "
                "expected once: give the tokenizer a standard chat template."
            )
    parts, at = [], 0
    for found in _PLACEHOLDERS.finditer(rendered):
        parts += [(rendered[at : found.start()], False), (messages[int(found.group(1))]["content"], True)]
        at = found.end()
    return [*parts, (rendered[at:], False)]


def _text(parts: Parts) -> str:
    return "".join(text for text, _ in parts)


def _special_strings(tok) -> list[str]:
    """The strings of the tokenizer's special tokens (those a text tokenizes to their control ids), longest first."""
    found = {t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if getattr(t, "special", False)}
    return sorted((t for t in found | set(getattr(tok, "all_special_tokens", ())) if t), key=len, reverse=True)


class _PlainText:
    """The tokenizer, reading the strings of special tokens as plain text (transformers'
    ``split_special_tokens``): what :func:`eventkv.models.encoding.encode` calls for a run of text holding a content."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, text: str, **kw):
        return self.tokenizer(text, split_special_tokens=True, **kw)


def _encode(lm: LoadedModel, parts: Parts) -> list[int]:
    """Token ids of the rendered conversation ``parts``, a special token's string in a content read as
    plain text (module docstring). Without such a string: :func:`eventkv.models.encoding.encode` of the whole text.
    With one: the template's special tokens are found in the template's pieces alone and give their
    ids; each run of text between two of them (template text and contents together) is encoded with
    ``split_special_tokens``, as the tokenizer encodes the runs between special tokens of one text."""
    tok = lm.tokenizer
    specials = _special_strings(tok)
    if not any(mark in text for text, content in parts if content for mark in specials):
        return encode(tok, _text(parts))
    split = re.compile("|".join(map(re.escape, specials)))
    runs: list[str | int] = []  # runs of text, and the template's special tokens' ids
    run = ""
    for text, content in parts:
        if content:
            run += text
            continue
        at = 0
        for found in split.finditer(text):
            run += text[at : found.start()]
            runs += [run] if run else []
            runs.append(cast(int, tok.convert_tokens_to_ids(found.group())))
            run, at = "", found.end()
        run += text[at:]
    runs += [run] if run else []
    plain = _PlainText(tok)
    return [i for r in runs for i in ([r] if isinstance(r, int) else encode(plain, r))]


def _bos_text(lm: LoadedModel) -> str:
    """The BOS token's text when the profile's head starts with it (the tokenizer adds BOS, the
    template does not write it: :attr:`~eventkv.models.ModelProfile.chat_head`), else ``""``."""
    bos = getattr(lm.tokenizer, "bos_token", None)
    return bos if bos and lm.profile.chat_head.startswith(bos) else ""


def fold_system(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation under a memory: each system message's text opens the next user message's
    content (followed by a blank line); the other messages as they are."""
    out, pending = [], []
    for m in messages:
        if m["role"] == "system":
            pending.append(m["content"])
        elif m["role"] == "user" and pending:
            out.append({"role": "user", "content": "\n\n".join([*pending, m["content"]])})
            pending = []
        else:
            out.append(m)
    return out


def chat_tail_text(lm: LoadedModel, messages) -> str:
    """The text of a conversation read after a memory's served rows (see the module docstring):
    the template's rendering of the conversation (system messages folded: :func:`fold_system`)
    without the head it opens with. One user message ``q``: ``q + chat_tail``.

    Raises:
        OptionError: as :func:`check_messages`; the template refuses the conversation.
        EventKVError: the template renders a conversation that does not open with the head of one
            user turn (the memory's header could not stand in its place).
    """
    return _text(_tail(lm, messages))


def _tail(lm: LoadedModel, messages) -> Parts:
    """:func:`chat_tail_text` as :data:`Parts`. Raises as :func:`chat_tail_text`."""
    turns = fold_system(check_messages(messages))
    if turns[0]["role"] != "user":
        raise OptionError(
            "messages[0].role",
            turns[0]["role"],
            "open the conversation with a user message (after any system messages): under a memory the "
            "memory's events open the first user turn.",
        )
    parts = _render(lm, turns)
    head = lm.profile.chat_head
    for opening in (head, head[len(_bos_text(lm)) :]):
        if opening and parts[0][0].startswith(opening):
            return [(parts[0][0][len(opening) :], False), *parts[1:]]
    raise EventKVError(
        f"the chat template of {lm.profile.name!r} renders this conversation without the head of one user turn "
        f"({head[:60]!r}): a memory's rows cannot be read before it. Ask without a memory."
    )


def chat_tail_ids(lm: LoadedModel, messages) -> list[int]:
    """Token ids of :func:`chat_tail_text` (one text, encoded as :func:`eventkv.kv.log.tokenize_query`
    encodes a question with its tail; a special token's string in a content as plain text: module
    docstring). Raises as :func:`chat_tail_text`."""
    return _encode(lm, _tail(lm, messages))


def chat_prompt_ids(lm: LoadedModel, messages) -> list[int]:
    """Token ids of the whole conversation for the model alone: its chat template over the messages
    as given (system messages where the template puts them), with the generation prompt, and the
    BOS token first when the tokenizer adds one the template does not write; a special token's string
    in a content is plain text (module docstring).

    Raises:
        OptionError: as :func:`check_messages`; the template refuses the conversation.
        EventKVError: no tokenizer.
    """
    parts = _render(lm, check_messages(messages))
    bos = _bos_text(lm)
    if bos and not _text(parts).startswith(bos):
        parts = [(bos, False), *parts]
    return _encode(lm, parts)


@torch.inference_mode()
def chat_reply(lm: LoadedModel, messages, *, max_new_tokens: int = 256, decoding: Decoding | None = None) -> ChatReply:
    """The model's reply to a conversation, without a memory: the prompt (:func:`chat_prompt_ids`)
    is prefilled but for its last token, and the reply is read out after that token
    (:func:`eventkv.kv.readout.answer_served`: the same decoding, sampling, stop strings and step
    callback as a memory's query).

    Raises:
        OptionError: as :func:`chat_prompt_ids`; ``max_new_tokens`` < 1 or past the context; a bad
            ``decoding``.
        EventKVError: the prompt past the model's context.
    """
    check_max_new_tokens(max_new_tokens)
    ids = chat_prompt_ids(lm, messages)
    ctx = lm.profile.max_context
    check_context(len(ids), ctx, what="conversation")
    if ctx is not None and len(ids) + max_new_tokens > ctx:
        raise OptionError(
            "max_new_tokens",
            max_new_tokens,
            f"the conversation takes {len(ids)} of the model's {ctx} positions: give at most "
            f"{ctx - len(ids)} new tokens.",
        )
    if len(ids) < 2:
        raise EventKVError("the rendered conversation has fewer than 2 tokens: give the messages some text.")
    t0 = time.perf_counter()
    device = model_device(lm.model)
    cache = DynamicCache()
    n = len(ids) - 1
    pos = torch.arange(n, device=device).unsqueeze(0)
    model_forward(lm.model, torch.tensor([ids[:n]], device=device), pos, cache, logits_to_keep=1)
    keys, values = cache_kv(cache)
    served = ServedCache(
        keys=keys,
        values=values,
        positions=torch.arange(n, device="cpu"),
        visible=None,
        next_position=n,
        mode="text",
        served=(),
    )
    t1 = time.perf_counter()
    ((gen, _),) = answer_served(
        lm.model,
        lm.tokenizer,
        [served],
        ids[n:],
        max_new_tokens=max_new_tokens,
        stop_token_ids=lm.profile.stop_token_ids,
        max_context=ctx,
        decoding=decoding,
    )
    t2 = time.perf_counter()
    return ChatReply(gen.text, gen, len(ids), {"prefill": 1e3 * (t1 - t0), "decode": 1e3 * (t2 - t1)})
