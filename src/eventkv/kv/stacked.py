"""Served caches stacked on the batch axis for one batched readout: :func:`stack` left-pads them to a
common row count (pad rows masked out of attention, each sequence at its own positions),
:func:`merge` regroups sequences of several stacks, and :meth:`Batch.forward_tree` scores every
candidate continuation as one prefix tree (:class:`CandidateTree`) in a single forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence, cast

import torch
from transformers import DynamicCache

from eventkv.errors import EventKVError
from eventkv.kv.model import attention_masks, model_forward
from eventkv.kv.rows import GrowingLayer, LayerRows, cache_from_rows, cache_kv, growing_cache
from eventkv.kv.serve import ServedCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class Batch:
    """Several served caches stacked on the batch axis.

    cache: a DynamicCache, per layer ``[batch, kv_heads, rows, head_dim]``: GrowingLayers left-padded
    with zero rows (:func:`stack`, :func:`merge`), or the layers of :func:`eventkv.kv.rows.cache_from_rows`
    (:meth:`of_rows`); mask: ``[batch, rows]`` bool, False on pad rows and on rows a native cache
    hides; next_position: ``[batch]`` int64, each sequence's first query position. All three live on
    the rows' device (the model's), so a decode step copies nothing to or from it.
    """

    cache: DynamicCache
    mask: torch.Tensor
    next_position: torch.Tensor

    @classmethod
    def of_rows(cls, keys: Sequence[LayerRows], values: Sequence[LayerRows], next_position: int) -> "Batch":
        """A batch over rows that every sequence sees whole, with no padding: per layer ``keys`` / ``values``
        ``[batch, kv_heads, rows, head_dim]`` (shared, never written in place: new rows are concatenated,
        :func:`eventkv.kv.rows.cache_from_rows`), every sequence's next token at position ``next_position``
        (e.g. a prompt's rows at positions ``0 .. rows - 1`` and ``next_position = rows``)."""
        b, rows, dev = int(keys[0].shape[0]), int(keys[0].shape[2]), keys[0].device
        mask = torch.ones(b, rows, dtype=torch.bool, device=dev)
        return cls(cache_from_rows(keys, values), mask, torch.full((b,), next_position, dtype=torch.long, device=dev))

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    def keep(self, idx: torch.Tensor) -> None:
        """Keep only the sequences ``idx`` (``[kept]`` int64 on the batch's device, in the order given), in
        place: the rows of every layer, the mask and the next positions (the rows are copied)."""
        self.cache.batch_select_indices(idx)
        self.mask = self.mask.index_select(0, idx)
        self.next_position = self.next_position.index_select(0, idx)

    def select(self, idx: Sequence[int], capacity: int) -> "Batch":
        """A copy of the sub-batch at ``idx`` (indices may repeat) with room for ``capacity`` rows."""
        i = torch.tensor(list(idx), dtype=torch.long, device=self.mask.device)
        keys, values = cache_kv(self.cache)
        cache = growing_cache([k.index_select(0, i) for k in keys], [v.index_select(0, i) for v in values], capacity)
        return Batch(cache, self.mask.index_select(0, i), self.next_position.index_select(0, i))

    def forward(self, model: PreTrainedModel, ids: torch.Tensor, offset: int, logits_to_keep: int = 0) -> torch.Tensor:
        """Append ``ids [batch, q]`` (at positions ``next_position + offset + arange(q)``) to this
        batch's rows; returns logits ``[batch, q or logits_to_keep, vocab]``."""
        dev = self.mask.device
        b, q = ids.shape
        pos = self.next_position.unsqueeze(1) + offset + torch.arange(q, device=dev).unsqueeze(0)
        self.mask = torch.cat([self.mask, torch.ones(b, q, dtype=torch.bool, device=dev)], dim=1)
        return model_forward(model, ids, pos, self.cache, self.mask, logits_to_keep=logits_to_keep)

    def forward_tree(self, model: PreTrainedModel, ids: torch.Tensor, tree: "CandidateTree") -> torch.Tensor:
        """Append the query ``ids [batch, q]`` (at ``next_position + arange(q)``) to this batch's rows and,
        in the same forward, the candidate branches of ``tree`` after it (node ``j`` at ``next_position +
        q + depth[j]``, seeing the rows, the whole query and its own branch up to itself). The branch rows
        are dropped again afterwards: the batch then holds its rows and the query, as :meth:`forward`
        leaves it. A sliding-window layer counts each branch token's distance as the separate branch
        forward would (query rows, then its branch).

        Returns:
            logits ``[batch, 1 + n_nodes, vocab]``: the query's last token's, then each node's.
        """
        dev = self.mask.device
        b, q = ids.shape
        rows, n = int(self.mask.shape[1]), len(tree.tokens)
        depth = torch.tensor(tree.depths, dtype=torch.long, device=dev)
        nodes = torch.tensor(tree.tokens, dtype=torch.long, device=dev).expand(b, n)
        pos = self.next_position.unsqueeze(1) + torch.cat([torch.arange(q, device=dev), q + depth]).unsqueeze(0)
        new = torch.zeros(q + n, q + n, dtype=torch.bool, device=dev)
        new[:q, :q] = torch.ones(q, q, dtype=torch.bool, device=dev).tril()
        new[q:, :q] = True
        new[q:, q:] = torch.tensor(tree.ancestors, dtype=torch.bool, device=dev)
        visible = torch.cat([self.mask.unsqueeze(1).expand(b, q + n, rows), new.expand(b, -1, -1)], dim=2)
        rank = torch.cat([torch.arange(rows + q, device=dev), rows + q + depth])  # rows as unbatched
        masks = attention_masks(model, visible, rank[rows:].unsqueeze(1) - rank.unsqueeze(0))
        logits = model_forward(model, torch.cat([ids, nodes], dim=1), pos, self.cache, masks, logits_to_keep=n + 1)
        for layer in self.cache.layers:  # drop the branch rows: generation continues after the query
            cast(GrowingLayer, layer).drop(n)
        self.mask = torch.cat([self.mask, torch.ones(b, q, dtype=torch.bool, device=dev)], dim=1)
        return logits


@dataclass(frozen=True)
class CandidateTree:
    """The candidates' continuations as a prefix tree of input tokens (what :meth:`Batch.forward_tree`
    feeds after the query): every distinct prefix ``seq[:j + 1]`` (``j < len(seq) - 1``) of the
    sequences ``answer prefix + candidate`` is one node, so candidates sharing an answer prefix (or
    leading tokens) share its rows.

    Attributes:
        tokens: each node's token id.
        depths: each node's offset after the query (0 = right after it).
        ancestors: ``[n][n]`` bools, True where node ``j`` is node ``i`` or on its branch.
        node_of: the node of each prefix (a tuple of token ids).
    """

    tokens: list[int]
    depths: list[int]
    ancestors: list[list[bool]]
    node_of: dict[tuple[int, ...], int]

    @classmethod
    def of(cls, seqs: Sequence[Sequence[int]]) -> "CandidateTree":
        tokens: list[int] = []
        depths: list[int] = []
        branch: list[set[int]] = []
        node_of: dict[tuple[int, ...], int] = {}
        for s in seqs:
            for j in range(len(s) - 1):
                key = tuple(s[: j + 1])
                if key in node_of:
                    continue
                node_of[key] = len(tokens)
                up = branch[node_of[key[:-1]]] if j else set()
                branch.append(up | {len(tokens)})
                tokens.append(int(s[j]))
                depths.append(j)
        ancestors = [[j in branch[i] for j in range(len(tokens))] for i in range(len(tokens))]
        return cls(tokens, depths, ancestors, node_of)


def stack(served: Sequence[ServedCache], extra: int = 0) -> Batch:
    """Left-pad the served caches to a common row count and stack them (``[batch, ...]``), with
    room for ``extra`` more rows."""
    if not served:
        raise EventKVError("nothing to read out: give at least one served cache.")
    n = max(s.n_rows for s in served)
    dev = served[0].keys[0].device
    layers = []
    for layer in range(len(served[0].keys)):
        k0, v0 = served[0].keys[layer], served[0].values[layer]
        k = k0.new_zeros(len(served), k0.shape[1], n + extra, k0.shape[3])
        v = v0.new_zeros(len(served), v0.shape[1], n + extra, v0.shape[3])
        for i, s in enumerate(served):
            r = s.n_rows
            k[i, :, n - r : n] = s.keys[layer][0]
            v[i, :, n - r : n] = s.values[layer][0]
        layers.append(GrowingLayer.over(k, v, n))
    cache = DynamicCache()
    cache.layers.extend(layers)  # config-less: no layers until given
    mask = torch.zeros(len(served), n, dtype=torch.bool, device=dev)
    for i, s in enumerate(served):
        mask[i, n - s.n_rows :] = True if s.visible is None else s.visible.to(dev)
    nxt = torch.tensor([s.next_position for s in served], dtype=torch.long, device=dev)
    return Batch(cache, mask, nxt)


def merge(parts: Sequence[tuple[Batch, int, int]], extra: int) -> Batch:
    """Sequences of several batches (of any row counts) as one batch: ``parts`` are ``(batch, index
    in it, shift)``; each sequence's rows are left-padded with masked zero rows to the longest one's
    count (so its own rows stay contiguous at the end, as :func:`stack` leaves them) and its next
    position moves by ``shift`` (the query rows it was given since). Room for ``extra`` more rows;
    indices may repeat. The rows are copied: the batches are left as they were."""
    n = max(int(b.mask.shape[1]) for b, _, _ in parts)
    dev = parts[0][0].mask.device
    rows = {id(b): cache_kv(b.cache) for b, _, _ in parts}  # per batch: per layer keys, values
    layers = []
    for layer in range(len(parts[0][0].cache.layers)):
        k0, v0 = rows[id(parts[0][0])][0][layer], rows[id(parts[0][0])][1][layer]
        k = k0.new_zeros(len(parts), k0.shape[1], n + extra, k0.shape[3])
        v = v0.new_zeros(len(parts), v0.shape[1], n + extra, v0.shape[3])
        for r, (b, i, _) in enumerate(parts):
            kb, vb = rows[id(b)][0][layer], rows[id(b)][1][layer]
            m = kb.shape[2]
            k[r, :, n - m : n] = kb[i]
            v[r, :, n - m : n] = vb[i]
        layers.append(GrowingLayer.over(k, v, n))
    cache = DynamicCache()  # config-less: no layers until given
    cache.layers.extend(layers)
    mask = torch.zeros(len(parts), n, dtype=torch.bool, device=dev)
    for r, (b, i, _) in enumerate(parts):
        mask[r, n - b.mask.shape[1] :] = b.mask[i]
    nxt = torch.stack([b.next_position[i] + shift for b, i, shift in parts])
    return Batch(cache, mask, nxt)
