"""How eventkv tokenizes a piece of text: :func:`encode`, a text's token ids as it tokenizes where it
continues a longer text, so that pieces (header, events, question) concatenate to the whole text's ids.
It belongs to the model layer because it depends only on the tokenizer (its prefix-space rule), and the
data path (:mod:`eventkv.kv.log`) and the model checks (:mod:`eventkv.models.introspect`) both use it."""

from __future__ import annotations


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` alone, without special tokens, as the text tokenizes where it continues a
    longer text (so pieces concatenate to the whole text's ids; see `eventkv.models.scaffold_seams`).

    A SentencePiece tokenizer that prepends a space to every text it encodes (Llama 2, Mistral) would
    start each piece with a space the whole text does not have; for such a tokenizer the text is
    encoded after a newline and the newline's ids are dropped (unless the text merges into it).
    """

    def ids(t: str) -> list[int]:
        return list(tokenizer(t, add_special_tokens=False)["input_ids"])

    own, nl = ids(text), ids("\n")
    if ids("\na")[len(nl) :] == ids("a"):
        return own  # no prefix space (byte-level BPE, Gemma): the text's own ids
    after = ids("\n" + text)
    return after[len(nl) :] if after[: len(nl)] == nl else own
