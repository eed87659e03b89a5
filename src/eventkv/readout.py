"""Readouts: answer a query from served caches (Study 1, "Donor pair", readouts).

One implementation, batched: :func:`read_out` answers one query from several served caches at
once, and the single-cache functions are that same path with a batch of one.

* :func:`generate` — greedy decoding (max new tokens, stops on EOS/end-of-turn); a
  :class:`Decoding` per sequence asks for seeded sampling instead (temperature, top-p), stop
  strings, and a per-step callback with the text each step adds (streaming).
* :func:`candidate_logprobs` — forced choice: every candidate's full continuation is scored
  (sum of its tokens' log-probabilities), all candidates in one batched forward.
* :func:`token_logprobs` — the one place a log-probability is computed: a float64 log-softmax
  of the float32 logits, so sums over many tokens and a large vocabulary match a float64
  reference within 1e-5 nats (a float32 log-softmax over a 49k vocabulary drifted by up to
  2.4e-4 nats on 12-token candidates).

Queries are placed at positions starting at ``served.next_position`` (right after the full
history). Nothing here modifies a served cache.

Several queries (one per cache, of any lengths) read out together: the caches whose queries have
one length take their query forward as one batch, and the generating sequences of every length
then decode as one batch, each left-padded again so that its own rows and its query's rows stay
contiguous (no padding between a cache's rows and its query): what answers several clients'
queries on several memories in one batched readout (:func:`eventkv.memory.answer.answer_prepared`).

Why batching is the default: on a CPU a decode step costs about the same for 1 or 8 sequences
(reading the weights dominates), so every arm of a donor pair is answered in one batch: the
served caches are left-padded with masked rows to a common row count, the query runs once for
the whole batch, candidate scoring branches off the query's cache in one forward, and greedy
decoding runs the generating arms together. Pad rows are masked out of attention (weight
exactly 0), every sequence keeps its own position ids, and on sliding-window layers the window
still counts the sequence's own rows (padding sits before the header, outside any window that
reaches real rows before it would reach the pad).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence, cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from eventkv.errors import EventKVError, OptionError
from eventkv.log import encode
from eventkv.models.kernels import linear_kernel_of
from eventkv.prefill import attention_masks, cache_kv, check_context, model_forward, takes_4d_masks
from eventkv.serve import ServedCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Generation:
    """A continuation (greedy unless its :class:`Decoding` samples). ``tokens`` excludes the stop
    token; ``stopped`` says whether a stop token ended it; ``stop_string`` is the stop string that
    ended it (``text`` is then cut where that string begins; ``tokens`` keeps every generated token);
    neither: max_new_tokens did. ``logits`` holds each step's logits ``[vocab]`` when requested."""

    tokens: list[int]
    text: str = ""
    stopped: bool = False
    logits: list[torch.Tensor] = field(default_factory=list)
    stop_string: str | None = None

    @property
    def finish_reason(self) -> Literal["stop", "length"]:
        """``"stop"`` when a stop token or a stop string ended it, ``"length"`` when max_new_tokens did."""
        return "stop" if self.stopped or self.stop_string is not None else "length"


#: the smallest temperature that samples: below it decoding is greedy. softmax(logits / T) tends to the
#: argmax as T -> 0, and at T = 1e-5 a logit gap of 1e-3 already weighs the runner-up exp(-100) ~ 4e-44
#: times the top token, so the threshold changes an answer only where the top logits tie. The value is
#: vLLM's convention (vllm/sampling_params.py, ``_SAMPLING_EPS = 1e-5``: a temperature under it is greedy).
MIN_SAMPLING_TEMPERATURE = 1e-5
#: the largest temperature a :class:`Decoding` accepts (OpenAI's range, [0, 2])
MAX_TEMPERATURE = 2.0
#: the seeds a :class:`Decoding` accepts, ``[SEED_MIN, SEED_END)``: every signed and every unsigned 64-bit
#: integer, what ``torch.Generator.manual_seed`` takes (a negative seed ``s`` seeds ``s + 2**64``)
SEED_MIN, SEED_END = -(2**63), 2**64


@dataclass(frozen=True)
class Decoding:
    """How one sequence is decoded, when not greedily or not silently.

    Attributes:
        temperature: a number in [0, 2]. Below :data:`MIN_SAMPLING_TEMPERATURE` (1e-5; 0, the default,
            included): greedy, the argmax, the limit of ``softmax(logits / temperature)`` as the
            temperature goes to 0 (the same tokens as 0, whatever the seed). From 1e-5: each token is
            drawn from ``softmax(logits / temperature)``, restricted to the top-p nucleus
            (:func:`sampling_probs`: float64 on the CPU, finite at every temperature).
        top_p: the nucleus (Holtzman et al. 2020, arXiv 1904.09751, Sec. 3.1): the smallest set of
            most probable tokens whose probabilities sum to at least ``top_p``, a number in (0, 1].
            1 (the default): every token; the nucleus always holds the most probable token, so as
            ``top_p`` goes to 0 it holds that token alone (the draw is the argmax, up to ties).
            Only with sampling.
        seed: seeds the sequence's own ``torch.Generator`` (CPU), so a sampled answer is reproducible
            whatever else shares its batch: a whole number in [-2**63, 2**64) (:data:`SEED_MIN`,
            :data:`SEED_END`: a signed or unsigned 64-bit integer; ``s`` and ``s + 2**64`` are the
            same seed); None: a fresh random seed.
        stop: stop strings: decoding ends once the decoded text contains one; the text is cut where
            the earliest one begins (``Generation.stop_string`` says which).
        on_step: called (on the decoding thread) once per decode step with the text that step adds:
            the decoded text grows by whole characters only (a token ending inside a multi-byte
            character adds nothing until the character is complete), and text that could begin a
            stop string is held back until it cannot; the empty string when a step adds nothing. The
            pieces concatenate to ``Generation.text``. The first call comes at the first step, right
            after the query's forward. An exception it raises ends the readout (the caller's way to
            abandon a generation nobody reads).

    Raises (:meth:`check`):
        OptionError: a temperature that is not a number in [0, 2] (NaN and infinities included), a
            top_p that is not a number in (0, 1], a seed that is not an int (a bool is not one) or lies
            outside [-2**63, 2**64), an empty stop string.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    on_step: Callable[[str], None] | None = None

    def check(self) -> "Decoding":
        """This decoding, checked (see the class docstring); returns itself."""
        t = self.temperature
        if not _number(t) or not 0 <= t <= MAX_TEMPERATURE:
            raise OptionError("temperature", t, "give a number in [0, 2] (0, or anything below 1e-5: greedy decoding).")
        p = self.top_p
        if not _number(p) or not 0 < p <= 1:
            raise OptionError("top_p", p, "give a number in (0, 1] (1: sample from every token).")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not SEED_MIN <= s < SEED_END):
            raise OptionError(
                "seed", s, "give a whole number in [-2**63, 2**64) (a 64-bit seed), or None for a random seed."
            )
        if isinstance(self.stop, str) or any(not isinstance(x, str) or not x for x in self.stop):
            raise OptionError("stop", self.stop, "give a tuple of non-empty stop strings.")
        return self

    @property
    def samples(self) -> bool:
        """Whether tokens are drawn (temperature >= :data:`MIN_SAMPLING_TEMPERATURE`) rather than taken
        greedily."""
        return self.temperature >= MIN_SAMPLING_TEMPERATURE

    @property
    def watches_text(self) -> bool:
        """Whether decoding reads the text at every step (stop strings or a step callback)."""
        return bool(self.stop) or self.on_step is not None


#: how a sequence is decoded when no :class:`Decoding` is given: greedily, silently
GREEDY = Decoding()


def _number(x: object) -> bool:
    """Whether ``x`` is an int or a finite float (a bool is not a number here; an int of any size is,
    where ``math.isfinite`` would raise OverflowError)."""
    if isinstance(x, bool):
        return False
    return isinstance(x, int) or (isinstance(x, float) and math.isfinite(x))


def sampling_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``softmax(logits / temperature)`` ``[vocab]``, float64 on the CPU: the distribution a sampled
    decode step draws from before the top-p nucleus (:class:`Decoding`), for ``logits`` ``[vocab]`` of
    any device and float dtype and any ``temperature`` >= :data:`MIN_SAMPLING_TEMPERATURE`.

    The logits are shifted by their maximum before the division: every exponent is then <= 0 and the
    largest exactly 0, so no temperature overflows (``logits / T`` alone does: float32 logits of
    magnitude 10 over a subnormal temperature are infinite, and their softmax is NaN); every
    probability is finite and >= 0, they sum to 1 (within float64 rounding), and the most probable
    token's is at least ``1 / vocab``. A NaN logit counts as ``-inf``; a ``+inf`` logit is the maximum
    (the tokens at ``+inf`` then share all the probability).

    Raises:
        OptionError: a temperature below :data:`MIN_SAMPLING_TEMPERATURE` (greedy: nothing is drawn)
            or not a finite number.
    """
    if not _number(temperature) or not temperature >= MIN_SAMPLING_TEMPERATURE:
        raise OptionError("temperature", temperature, "give a finite number >= 1e-5 to sample (below it: greedy).")
    x = logits.detach().to("cpu", torch.float64)
    x = torch.where(torch.isnan(x), -math.inf, x)
    top = x.max()
    # the top tokens' exponent is set to 0, not computed: inf - inf would be NaN when the top is +-inf
    z = torch.where(x == top, 0.0, (x - top) / temperature)
    return torch.softmax(z, dim=-1)


class _Sampler:
    """One sequence's draws: a CPU ``torch.Generator`` seeded once (:attr:`Decoding.seed`)."""

    def __init__(self, decoding: Decoding) -> None:
        self.decoding = decoding
        self.generator = torch.Generator(device="cpu")
        if decoding.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(decoding.seed % 2**64)  # [-2**63, 2**64) (checked): a negative seed wraps

    def draw(self, logits: torch.Tensor) -> int:
        """A token id drawn from ``logits`` ``[vocab]`` (any device, any float dtype) under the
        temperature (:func:`sampling_probs`) and the top-p nucleus; computed in float64 on the CPU (the
        same draw whatever device computed the logits, up to the logits' own rounding)."""
        d = self.decoding
        probs = sampling_probs(logits, d.temperature)
        if d.top_p < 1:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, dim=0) - sorted_p < d.top_p  # the first token is always kept
            sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
            return int(order[torch.multinomial(sorted_p, 1, generator=self.generator)])
        return int(torch.multinomial(probs, 1, generator=self.generator))


class TextWatch:
    """The decoded text of one growing generation, for stop strings and streaming
    (:attr:`Decoding.stop`, :attr:`Decoding.on_step`).

    Each :meth:`step` decodes every token so far (``tokenizer.decode(..., skip_special_tokens=True)``:
    the text :func:`read_out` answers with) and finds the earliest stop string in it. What it hands
    out (:meth:`step`, :meth:`rest`) is the text without a trailing replacement character U+FFFD (a
    token that ends inside a multi-byte UTF-8 character decodes to one until the character is
    complete) and without a tail that could still become a stop string; what was handed out is
    never taken back, so the pieces concatenate to the final text.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, stop: Sequence[str]) -> None:
        if tokenizer is None:
            raise EventKVError("stop strings and step callbacks need the tokenizer: pass tokenizer=... to read_out.")
        self.tokenizer, self.stops = tokenizer, tuple(stop)
        self.text, self.sent = "", 0
        self.stop: str | None = None

    def step(self, tokens: Sequence[int]) -> str:
        """The text the latest token adds (possibly empty), after decoding ``tokens``; sets
        :attr:`stop` (and cuts :attr:`text`) when a stop string appears."""
        self.text = cast(str, self.tokenizer.decode(list(tokens), skip_special_tokens=True))
        found = [(i, s) for s in self.stops if (i := self.text.find(s)) >= 0]
        if found:
            at, self.stop = min(found)
            self.text = self.text[:at]
            return self.rest()
        safe = self.text.rstrip("\ufffd")
        held = max((n for s in self.stops for n in range(1, len(s)) if safe.endswith(s[:n])), default=0)
        return self._hand_out(len(safe) - held)

    def rest(self) -> str:
        """What is left to hand out of the final text (at the end of the generation)."""
        return self._hand_out(len(self.text))

    def _hand_out(self, end: int) -> str:
        piece = self.text[self.sent : end] if end > self.sent else ""
        self.sent += len(piece)
        return piece


@dataclass
class CandidateScore:
    """Score of one candidate continuation: ``logprob`` is the sum over its tokens (nats);
    ``token_logprobs`` per token; ``prob`` its share among the candidates (softmax of logprob)."""

    text: str
    tokens: list[int]
    logprob: float
    token_logprobs: list[float]
    prob: float = 0.0


@dataclass
class Readout:
    """What one served cache answered: its greedy generation (or None) and its candidate scores
    (empty when not asked)."""

    generation: Generation | None
    candidates: list[CandidateScore]


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities (nats, float64) of ``token_ids`` under ``logits``.

    Args:
        logits: ``[..., vocab]`` (any float dtype; promoted to float64 before the log-softmax).
        token_ids: ``[...]`` int64, the same leading shape.

    Returns:
        ``[...]`` float64.
    """
    lp = torch.log_softmax(logits.double(), dim=-1)
    return lp.gather(-1, token_ids.to(lp.device).unsqueeze(-1)).squeeze(-1)


class GrowingLayer(DynamicLayer):
    """A cache layer over a preallocated buffer ``[batch, kv_heads, capacity, head_dim]``: new rows
    are written in place (no ``torch.cat`` of the whole cache per decode step); ``keys`` and
    ``values`` are views of the filled rows. The buffer doubles when full."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        super().__init__()
        b, h, n, d = keys.shape
        cap = max(capacity, n)
        self._k = keys.new_empty(b, h, cap, d)
        self._v = values.new_empty(b, h, cap, values.shape[3])
        self._k[:, :, :n] = keys
        self._v[:, :, :n] = values
        self.n = n
        self.device = keys.device
        self.is_initialized = True
        self._views()

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, n: int) -> "GrowingLayer":
        """A layer over the preallocated buffers ``keys`` / ``values`` ``[batch, kv_heads, capacity,
        head_dim]`` (not copied) whose first ``n`` rows are filled."""
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        layer._k, layer._v, layer.n, layer.device, layer.is_initialized = keys, values, n, keys.device, True
        layer._views()
        return layer

    def _views(self) -> None:
        self.keys = self._k[:, :, : self.n]
        self.values = self._v[:, :, : self.n]

    def drop(self, n: int) -> None:
        """Forget the last ``n`` rows (their buffer slots are written again by the next update)."""
        self.n -= n
        self._views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        q = key_states.shape[-2]
        if self.n + q > self._k.shape[2]:
            cap = 2 * (self.n + q)
            k, v = (
                self._k.new_empty(*self._k.shape[:2], cap, self._k.shape[3]),
                self._v.new_empty(*self._v.shape[:2], cap, self._v.shape[3]),
            )
            k[:, :, : self.n], v[:, :, : self.n] = self._k[:, :, : self.n], self._v[:, :, : self.n]
            self._k, self._v = k, v
        self._k[:, :, self.n : self.n + q] = key_states
        self._v[:, :, self.n : self.n + q] = value_states
        self.n += q
        self._views()
        return self.keys, self.values


def growing_cache(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], capacity: int) -> DynamicCache:
    """A ``DynamicCache`` whose layers are :class:`GrowingLayer` s holding these rows (copied)."""
    cache = DynamicCache()  # config-less: no layers until given
    cache.layers.extend(GrowingLayer(k, v, capacity) for k, v in zip(keys, values))
    return cache


@dataclass
class Batch:
    """Several served caches stacked on the batch axis.

    cache: a DynamicCache of GrowingLayers, per layer ``[batch, kv_heads, rows, head_dim]``
    (left-padded with zero rows); mask: ``[batch, rows]`` bool, False on pad rows and on rows a
    native cache hides; next_position: ``[batch]`` int64, each sequence's first query position.
    All three live on the rows' device (the model's), so a decode step copies nothing to or from it.
    """

    cache: DynamicCache
    mask: torch.Tensor
    next_position: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

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


@torch.inference_mode()
def read_out(
    model: PreTrainedModel,
    served: Sequence[ServedCache],
    query_ids: Sequence[int] | Sequence[Sequence[int]],
    *,
    generate: Sequence[bool],
    score: Sequence[bool],
    candidates: Sequence[Sequence[int]] = (),
    candidate_texts: Sequence[str] = (),
    answer_prefix_ids: Sequence[int] = (),
    max_new_tokens: int | Sequence[int] = 64,
    stop_token_ids: Sequence[int] = (),
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_context: int | None = None,
    keep_logits: bool = False,
    decoding: Decoding | Sequence[Decoding | None] | None = None,
) -> list[Readout]:
    """Answer one query, or one query per cache, from several served caches in batched forwards.

    Args:
        served: the served caches (any modes, any row counts).
        query_ids: the query's token ids (question + chat tail), the same for every cache; or one
            query per cache, of any lengths (several items' or clients' questions read out in one
            batch). The caches whose queries have one length run their query forward together; the
            generating sequences then decode together. No padding goes between a cache's rows and
            its query, so sliding-window layers see the rows they would see alone.
        generate: per cache, whether to decode greedily (up to ``max_new_tokens``, stopping on
            ``stop_token_ids``, which are not emitted).
        score: per cache, whether to score the candidates.
        candidates: token ids per candidate; each is scored as the continuation of
            ``query_ids + answer_prefix_ids`` (full continuation: sum of its tokens' log-probs, nats).
        answer_prefix_ids: forced answer opener placed before the candidates (e.g. ``"Answer:"``).
        max_new_tokens: the greedy decoding budget (tokens), for every cache or one per cache.
        keep_logits: keep each generated step's logits ``[vocab]`` in ``Generation.logits``.
        decoding: how each generating cache decodes (:class:`Decoding`: sampling, stop strings, a
            step callback): one for every cache, or one per cache (None: greedy); default greedy.
            Each sequence samples from its own generator, so its answer does not depend on the batch.

    Returns:
        one Readout per served cache, in order.

    Raises:
        EventKVError: ``generate`` or ``score`` not one flag per served cache, empty query, per-cache
            queries or budgets not one per cache, empty candidate, or history + query beyond the
            model's context; stop strings or a step callback without a tokenizer.
        OptionError: a bad :class:`Decoding` (:meth:`Decoding.check`), or not one per served cache.
    """
    n = len(served)
    if len(generate) != n or len(score) != n:
        raise EventKVError(
            f"read_out got {n} served caches but {len(generate)} generate and {len(score)} "
            f"score flags: give one generate flag and one score flag per served cache."
        )
    decodings = _decodings(decoding, n)
    queries = _queries(query_ids, n)
    budgets = _budgets(max_new_tokens, n)
    if any(score) and (not candidates or any(len(c) == 0 for c in candidates)):
        raise EventKVError("candidate scoring needs at least one candidate and no empty candidate.")
    longest = max([len(c) for c in candidates], default=0) + len(answer_prefix_ids)
    for s, query, budget in zip(served, queries, budgets):
        check_context(s.next_position + len(query) + max(budget, longest), max_context, what="history plus query")
    out = [Readout(None, []) for _ in served]
    groups: dict[int, list[int]] = {}  # query length -> the caches with a query of that length
    for i, query in enumerate(queries):
        groups.setdefault(len(query), []).append(i)
    where: dict[int, tuple[Batch, int, int]] = {}  # cache -> (its group's batch, index there, query length)
    firsts: dict[int, torch.Tensor] = {}  # cache -> the query's last logits [vocab]
    seqs = [list(answer_prefix_ids) + list(c) for c in candidates]
    tree = CandidateTree.of(seqs) if any(score) and takes_4d_masks(model) else None
    branch = len(tree.tokens) if tree is not None else 0  # rows the candidates' branches take
    for q, idx in groups.items():
        room = max([budgets[i] for i in idx if generate[i]], default=0)
        scored = [j for j, i in enumerate(idx) if score[i]]
        batch = stack([served[i] for i in idx], extra=q_len_extra(queries[idx[0]], room, max(longest, branch)))
        ids = torch.tensor([queries[i] for i in idx], device=batch.mask.device)
        local = [out[i] for i in idx]  # the same Readout objects: scoring fills them in place
        if tree is not None and branch and scored:  # candidates scored in the query's forward
            logits = batch.forward_tree(model, ids, tree)
            first = logits[:, 0]
            _score_tree(logits, tree, scored, seqs, len(answer_prefix_ids), candidates, candidate_texts, local)
        else:
            first = batch.forward(model, ids, 0, 1)[:, -1]
            if scored:
                _score(model, batch, first, scored, q, candidates, candidate_texts, list(answer_prefix_ids), local)
        for j, i in enumerate(idx):
            where[i], firsts[i] = (batch, j, q), first[j]
    gens = [i for i, f in enumerate(generate) if f]
    if gens:
        dev = where[gens[0]][0].mask.device
        rows = gens + [gens[0]] * decode_padding(len(gens), dev, linear_kernel_of(model))
        room = max(budgets[i] for i in gens)
        batch, _, q = where[gens[0]]
        if len(groups) == 1 and rows == list(range(batch.size)):
            sub, offset = batch, q  # every cache decodes, in order: the query's batch goes on as it is
        else:
            sub, offset = merge([where[i] for i in rows], room), 0  # next positions shifted by each query
        _generate(
            model,
            sub,
            torch.stack([firsts[i] for i in rows]),
            gens + [None] * (len(rows) - len(gens)),
            offset,
            [budgets[i] for i in rows],
            set(int(t) for t in stop_token_ids),
            tokenizer,
            out,
            keep_logits,
            [decodings[i] for i in gens] + [GREEDY] * (len(rows) - len(gens)),
        )
    return out


def _decodings(decoding: Decoding | Sequence[Decoding | None] | None, n: int) -> list[Decoding]:
    """One checked :class:`Decoding` per served cache (None: greedy)."""
    if decoding is None or isinstance(decoding, Decoding):
        return [(decoding or GREEDY).check()] * n
    given = list(decoding)
    if len(given) != n:
        raise OptionError("decoding", f"{len(given)} decodings", f"give one decoding, or one per served cache ({n}).")
    return [(d or GREEDY).check() for d in given]


def _queries(query_ids: Sequence[int] | Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """One query per served cache: ``query_ids`` repeated ``n`` times, or the per-cache queries
    checked (one per cache, none empty)."""
    if not query_ids:
        raise EventKVError("the query is empty: give a question.")
    if isinstance(query_ids[0], int):  # one query of token ids (the first id tells the two forms apart)
        return [list(cast("Sequence[int]", query_ids))] * n
    queries = [list(cast("Sequence[int]", q)) for q in query_ids]
    if len(queries) != n:
        raise EventKVError(
            f"read_out got {n} served caches but {len(queries)} queries: give one query or one per cache."
        )
    if not all(queries):
        raise EventKVError("a query is empty: give a question for every served cache.")
    return queries


def _budgets(max_new_tokens: int | Sequence[int], n: int) -> list[int]:
    """One decoding budget per served cache: ``max_new_tokens`` repeated, or the per-cache budgets checked."""
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * n
    budgets = [int(b) for b in max_new_tokens]
    if len(budgets) != n:
        raise EventKVError(
            f"read_out got {n} served caches but {len(budgets)} max_new_tokens: give one budget or one per cache."
        )
    return budgets


def q_len_extra(query_ids: Sequence[int], max_new_tokens: int, longest: int) -> int:
    """Rows a batch must have room for beyond its served rows: the query plus the longer of the
    generation and the candidate continuation."""
    return len(query_ids) + max(max_new_tokens, longest)


def _score(
    model: PreTrainedModel,
    batch: Batch,
    first: torch.Tensor,
    scored: list[int],
    q: int,
    candidates,
    texts,
    prefix: list[int],
    out: list[Readout],
) -> None:
    n_c = len(candidates)
    seqs = [prefix + list(c) for c in candidates]
    width = max(len(s) for s in seqs) - 1
    dev = first.device
    # the first token of every sequence is scored from the query's logits, token k > 0 from the
    # branch forward's output k - 1; inputs and targets are right-padded with token 0 (those entries are
    # unread). Every tensor is made on the model's device; the scores come back in one copy each.
    first_lp = token_logprobs(
        first[scored].unsqueeze(1).expand(-1, n_c, -1),
        torch.tensor([[s[0] for s in seqs]] * len(scored), dtype=torch.long, device=dev),
    ).tolist()  # [scored][n_c]
    lp: list[list[float]] = []  # read only for tokens k > 0, which exist only when width > 0
    if width > 0:
        sub = batch.select([i for i in scored for _ in range(n_c)], batch.mask.shape[1] + width)
        padded = [seqs[r % n_c] + [0] * (width + 1 - len(seqs[r % n_c])) for r in range(sub.size)]
        ids = torch.tensor([s[:-1] for s in padded], dtype=torch.long, device=dev)
        targets = torch.tensor([s[1:] for s in padded], dtype=torch.long, device=dev)
        lp = token_logprobs(sub.forward(model, ids, q), targets).tolist()  # [scored * n_c][width]
    for a, i in enumerate(scored):
        per = []
        for c, s in enumerate(seqs):
            r = a * n_c + c
            per.append([first_lp[a][c] if k == 0 else lp[r][k - 1] for k in range(len(prefix), len(s))])
        _fill_candidates(out[i], per, candidates, texts)


def _score_tree(
    logits: torch.Tensor,
    tree: CandidateTree,
    scored: list[int],
    seqs: list[list[int]],
    n_prefix: int,
    candidates,
    texts,
    out: list[Readout],
) -> None:
    """Candidate scores from :meth:`Batch.forward_tree`'s logits ``[batch, 1 + n_nodes, vocab]``: token
    ``k`` of a sequence is scored from the query's logits (k = 0) or from node ``seq[:k]``'s."""
    at = [[0 if k == 0 else 1 + tree.node_of[tuple(s[:k])] for k in range(n_prefix, len(s))] for s in seqs]
    flat_at = [x for row in at for x in row]
    targets = [s[k] for s in seqs for k in range(n_prefix, len(s))]
    dev = logits.device
    sel = logits[scored][:, torch.tensor(flat_at, dtype=torch.long, device=dev)]  # [scored, tokens, vocab]
    tgt = torch.tensor(targets, dtype=torch.long, device=dev).expand(len(scored), -1)
    lp = token_logprobs(sel, tgt).tolist()  # [scored][tokens], one copy
    for a, i in enumerate(scored):
        per, k = [], 0
        for row in at:
            per.append(lp[a][k : k + len(row)])
            k += len(row)
        _fill_candidates(out[i], per, candidates, texts)


def _fill_candidates(out: Readout, per: list[list[float]], candidates, texts) -> None:
    """``out.candidates`` from each candidate's per-token log-probs (nats): sums and their softmax shares."""
    totals = torch.tensor([sum(t) for t in per], dtype=torch.float64, device="cpu")  # python floats: CPU
    probs = torch.softmax(totals, dim=0)
    out.candidates = [
        CandidateScore(texts[c] if texts else "", list(candidates[c]), float(totals[c]), per[c], float(probs[c]))
        for c in range(len(candidates))
    ]


#: On a CPU whose linears run on torch's own kernel (MKL sgemm), a greedy decode step of 2 or 3 sequences is
#: fed as 4 (copies of the first; their tokens are never read). Why: MKL runs a product with 2 or 3 rows as
#: that many matrix-vector products, reading the weights once per row, while 4 rows take one pass of the
#: weights. Measured on an AMD EPYC (2 threads, float32), one decode step of qwen2.5-coder-1.5b: 302 / 651 /
#: 921 / 581 ms for 1 / 2 / 3 / 4 sequences. oneDNN's linears (`eventkv.models.kernels`, what a float32
#: model gets on a CPU) have no such step: 385 / 586 / 706 / 950 ms on the same CPU, so they are not padded.
#: Each sequence keeps its own rows, positions and mask, so the padding changes its tokens only by float
#: rounding. A GPU batches any size well: no padding there.
CPU_DECODE_MIN_BATCH = 4


def decode_padding(n: int, device: torch.device, linear_kernel: str = "torch") -> int:
    """How many padding sequences a greedy decode of ``n`` sequences on ``device`` gets
    (:data:`CPU_DECODE_MIN_BATCH`): ``4 - n`` for 2 or 3 sequences on a CPU whose linears run on torch's
    own kernel, else 0."""
    if torch.device(device).type != "cpu" or linear_kernel != "torch":
        return 0
    return CPU_DECODE_MIN_BATCH - n if 1 < n < CPU_DECODE_MIN_BATCH else 0


def _generate(
    model: PreTrainedModel,
    batch: Batch,
    logits: torch.Tensor,
    owners: list[int | None],
    q: int,
    max_new: Sequence[int],
    stops: set[int],
    tokenizer: PreTrainedTokenizerBase | None,
    out: list[Readout],
    keep_logits: bool = False,
    decodings: Sequence[Decoding] | None = None,
) -> None:
    """Decoding of the whole batch (greedy, or each sequence as its :class:`Decoding` says), sequence
    ``r`` up to ``max_new[r]`` tokens, the first step fed at ``next_position + q``; a sequence that has
    stopped keeps being fed its last token (its rows are never read) so the batch never has to be
    copied. An owner of None is a padding sequence (:func:`decode_padding`): fed, never waited for,
    never read."""
    decodings = list(decodings or [GREEDY] * len(owners))
    gens = [Generation(tokens=[]) for _ in owners]
    done = [m <= 0 or i is None for m, i in zip(max_new, owners)]
    samplers = [_Sampler(d) if d.samples and i is not None else None for d, i in zip(decodings, owners)]
    watches = [
        TextWatch(tokenizer, d.stop) if d.watches_text and i is not None else None for d, i in zip(decodings, owners)
    ]
    step = 0
    while not all(done):
        toks = torch.argmax(logits, dim=-1).tolist()
        feed = []
        for r, g in enumerate(gens):
            t = int(toks[r])
            if not done[r]:
                sampler, watch = samplers[r], watches[r]
                if sampler is not None:
                    t = sampler.draw(logits[r])
                if keep_logits:
                    g.logits.append(logits[r])
                piece = ""
                if t in stops:
                    g.stopped = True
                    done[r] = True
                else:
                    g.tokens.append(t)
                    done[r] = len(g.tokens) >= max_new[r]
                    if watch is not None:
                        piece = watch.step(g.tokens)
                        if watch.stop is not None:
                            g.stop_string, done[r] = watch.stop, True
                if watch is not None:
                    if done[r]:
                        piece += watch.rest()
                    on_step = decodings[r].on_step
                    if on_step is not None:
                        on_step(piece)
            feed.append(t)
        if all(done):
            break
        ids = torch.tensor(feed, dtype=torch.long, device=logits.device).unsqueeze(1)
        logits = batch.forward(model, ids, q + step, logits_to_keep=1)[:, -1]
        step += 1
    for g, i, watch in zip(gens, owners, watches):
        if i is None:
            continue
        if watch is not None:
            g.text = watch.text  # cut at its stop string
        elif tokenizer is not None:
            g.text = cast(str, tokenizer.decode(g.tokens, skip_special_tokens=True))  # one sequence: one text
        out[i].generation = g


# ------------------------------------------------------------------ one served cache: a batch of one


@torch.inference_mode()
def query_logits(
    model: PreTrainedModel, served: ServedCache, query_ids: Sequence[int], max_context: int | None = None
) -> torch.Tensor:
    """Next-token logits ``[vocab]`` (float32) after the query.

    Raises:
        EventKVError: empty query, or history + query beyond the model's context.
    """
    if not query_ids:
        raise EventKVError("the query is empty: give a question.")
    check_context(served.next_position + len(query_ids), max_context, what="history plus query")
    batch = stack([served], extra=len(query_ids))
    ids = torch.tensor([list(query_ids)], device=batch.mask.device)
    return batch.forward(model, ids, 0, logits_to_keep=1)[0, -1]


def generate(
    model: PreTrainedModel,
    served: ServedCache,
    query_ids: Sequence[int],
    *,
    max_new_tokens: int = 64,
    stop_token_ids: Sequence[int] = (),
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_context: int | None = None,
    keep_logits: bool = False,
) -> Generation:
    """Greedy decoding from a served cache (:func:`read_out` with one cache).

    Args:
        query_ids: the query's token ids (placed at ``served.next_position`` onwards).
        max_new_tokens: upper bound on generated tokens.
        stop_token_ids: generation stops (without emitting it) on any of these.
        tokenizer: if given, ``text`` is the decoded continuation.
        keep_logits: keep each step's logits ``[vocab]`` (for faithfulness tests).

    Raises:
        EventKVError: empty query, or history + query + new tokens beyond the model's context.
    """
    return _generation(
        _read_out_one(
            model,
            served,
            query_ids,
            generate=True,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            tokenizer=tokenizer,
            max_context=max_context,
            keep_logits=keep_logits,
        )
    )


def candidate_logprobs(
    model: PreTrainedModel,
    served: ServedCache,
    query_ids: Sequence[int],
    candidates: Sequence[Sequence[int]],
    texts: Sequence[str] | None = None,
    max_context: int | None = None,
) -> list[CandidateScore]:
    """Score each candidate continuation of the query (forced choice; :func:`read_out` with one cache).

    Args:
        candidates: token ids per candidate (non-empty each); scored in one batched forward of
            ``[n_candidates, longest - 1]`` tokens over the shared query cache.
        texts: optional display text per candidate.

    Returns:
        one CandidateScore per candidate, in input order; ``logprob`` in nats (float64 sums).

    Raises:
        EventKVError: no candidates or an empty candidate; history + query beyond the context.
    """
    if not candidates or any(len(c) == 0 for c in candidates):
        raise EventKVError("candidate scoring needs at least one candidate and no empty candidate.")
    return _read_out_one(
        model,
        served,
        query_ids,
        generate=False,
        candidates=candidates,
        candidate_texts=texts or (),
        max_new_tokens=0,
        max_context=max_context,
    ).candidates


def answer_served(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    served: Sequence[ServedCache],
    query_ids: Sequence[int],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int],
    max_context: int | None,
    candidates: Sequence[str] = (),
    keep_logits: bool = False,
    decoding: Decoding | Sequence[Decoding | None] | None = None,
) -> list[tuple[Generation, list[CandidateScore]]]:
    """A question answered from one or more served caches, as ``eventkv query`` and the memory do:
    per cache the greedy answer (or as ``decoding`` says: :func:`read_out`) and, when ``candidates``
    are given, each candidate's log-probability (nats; candidates tokenized alone with
    :func:`eventkv.log.encode`) — all caches in one batched :func:`read_out` (left-padded, each row
    at its own positions; a batch of one is :func:`generate` plus :func:`candidate_logprobs`).

    Returns:
        one ``(generation, candidate scores)`` per served cache, in order.

    Raises:
        EventKVError: no served cache; as :func:`read_out`.
    """
    if not served:
        raise EventKVError("answer_served got no served cache: give at least one.")
    ids = [encode(tokenizer, c) for c in candidates]
    outs = read_out(
        model,
        list(served),
        query_ids,
        generate=[True] * len(served),
        score=[bool(ids)] * len(served),
        candidates=ids,
        candidate_texts=list(candidates),
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        tokenizer=tokenizer,
        max_context=max_context,
        keep_logits=keep_logits,
        decoding=decoding,
    )
    return [(_generation(o), o.candidates) for o in outs]


def _read_out_one(
    model: PreTrainedModel, served: ServedCache, query_ids: Sequence[int], *, generate: bool, **options: Any
) -> Readout:
    """:func:`read_out` from the one cache ``served``: the greedy answer (``generate``) or else the candidate
    scores; ``options`` are :func:`read_out`'s."""
    return read_out(model, [served], query_ids, generate=[generate], score=[not generate], **options)[0]


def _generation(out: Readout) -> Generation:
    """The generation of a readout asked to generate (``generate=True``)."""
    assert out.generation is not None  # read_out generates for every cache with generate=True
    return out.generation
