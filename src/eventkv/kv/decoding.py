"""How a readout decodes: :class:`Decoding` (greedy, or seeded sampling with temperature and
top-p; stop strings; a per-step text callback), the sampling distribution (:func:`sampling_probs`),
the per-sequence :class:`Sampler`, the stop-string watch (:class:`TextWatch`) and the drafts of
prompt-lookup decoding (:class:`PromptLookup`). The decode loop that uses them is
:mod:`eventkv.kv.readout`."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence, cast

import torch

from eventkv.errors import EventKVError, OptionError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


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
#: the tokens a prompt-lookup draft proposes at most (:class:`PromptLookup`). transformers' example value of
#: ``prompt_lookup_num_tokens`` is 10, for GPUs, where verifying 10 tokens costs about what one does; on a
#: 2-core CPU a donor pair's sentence answers (qwen2.5-coder-1.5b, see the README's main-job speed) decoded
#: fastest with 2 in float32 (2: 18.4-18.9 s, 3: 18.9-20.3 s, 4: 19.3-19.4 s, none: 20.8-21.1 s a pair) and
#: with 2-3 in bfloat16 (none 10.3 s, 1: 9.1 s, 2: 7.8 s, 3: 7.4 s) on an Intel Xeon with AMX; on an AMD EPYC
#: with avx512_bf16 and no AMX, 3 in bfloat16 took the same decode forwards as 2 on the benchmark's two sentence
#: answers and more time (benchmarks/donor_pair_throughput.py, all arms: decode 1.28 s a pair against 1.17 s).
#: Those bfloat16 figures were made with the attention on SDPA, slow for 2-128 query tokens on a CPU; with the
#: matmul attention (eventkv.models.attention) a one-sequence forward of 3, 4 and 5 tokens over 700 rows took
#: 1.05x, 1.03x and 1.08x one of 1 token on that EPYC, so the best draft length there may be longer than 2
DRAFT_TOKENS = 2
#: the longest n-gram a prompt-lookup draft matches (transformers' ``max_matching_ngram_size`` default)
DRAFT_NGRAM = 2


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
        if not number(t) or not 0 <= t <= MAX_TEMPERATURE:
            raise OptionError("temperature", t, "give a number in [0, 2] (0, or anything below 1e-5: greedy decoding).")
        p = self.top_p
        if not number(p) or not 0 < p <= 1:
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


def number(x: object) -> bool:
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
    if not number(temperature) or not temperature >= MIN_SAMPLING_TEMPERATURE:
        raise OptionError("temperature", temperature, "give a finite number >= 1e-5 to sample (below it: greedy).")
    x = logits.detach().to("cpu", torch.float64)
    x = torch.where(torch.isnan(x), -math.inf, x)
    top = x.max()
    # the top tokens' exponent is set to 0, not computed: inf - inf would be NaN when the top is +-inf
    z = torch.where(x == top, 0.0, (x - top) / temperature)
    return torch.softmax(z, dim=-1)


class Sampler:
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


class PromptLookup:
    """Draft tokens for one greedy sequence by prompt lookup (Saxena 2023, "Prompt Lookup Decoding";
    transformers' ``PromptLookupCandidateGenerator`` does the search): the sequence's last n-gram
    (n = ``ngram`` down to 1) is looked up first in what it has generated, then in its source tokens
    followed by what it has generated, and the tokens that followed the first occurrence found are
    proposed, cut before any stop token. An answer repeats its own phrasing more often than its source's
    ("register X is ONLINE. The mirror statement for register X is ..."), which the source's first
    occurrence of "register X" does not continue: on the donor pair's sentence answers (qwen2.5-coder-1.5b,
    four answers of 24-39 tokens, replayed against their greedy tokens) the answer-first search took 80
    forwards where the source-first one took 89. The decode
    loop (:func:`eventkv.kv.readout.read_out`) feeds them after the sequence's token in one forward and
    keeps the ones the model's own argmax agrees with: the answer is the greedy answer, up to the
    float rounding of a forward of several tokens against one of one.

    Args:
        source: the token ids drafts are copied from (the served text and the query: what an answer
            quotes).
        stops: token ids a draft never proposes (the readout's stop tokens).
        tokens: the most tokens a draft proposes (>= 1).
        ngram: the longest n-gram matched (>= 1).

    Raises:
        OptionError: ``tokens`` or ``ngram`` not a whole number >= 1.
    """

    def __init__(
        self, source: Sequence[int], stops: set[int], tokens: int = DRAFT_TOKENS, ngram: int = DRAFT_NGRAM
    ) -> None:
        from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

        for name, v, what in (("tokens", tokens, "draft tokens"), ("ngram", ngram, "an n-gram length")):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise OptionError(name, v, f"give a whole number >= 1 ({what} of prompt lookup).")
        self.source, self.stops = [int(t) for t in source], set(stops)
        # max_length only caps the candidates' end; the readout caps a draft by the sequence's budget
        self._search = PromptLookupCandidateGenerator(
            num_output_tokens=tokens, max_matching_ngram_size=ngram, max_length=sys.maxsize
        )

    def draft(self, generated: Sequence[int], room: int) -> list[int]:
        """At most ``room`` tokens to follow ``generated`` (the sequence's tokens so far, its last fed
        token included); ``[]`` when its last n-gram occurs nowhere earlier or ``room`` <= 0."""
        if room <= 0 or not generated:
            return []
        answer = [int(t) for t in generated]
        out = self._continue(answer) if len(answer) > 1 else []
        if not out:
            out = self._continue(self.source + answer)
        out = out[:room]
        cut = next((i for i, t in enumerate(out) if t in self.stops), len(out))
        return out[:cut]

    def _continue(self, tokens: list[int]) -> list[int]:
        """The search's proposal after ``tokens`` (its last n-gram's first earlier occurrence in them)."""
        ids = torch.tensor([tokens], dtype=torch.long)
        found, _ = self._search.get_candidates(cast(torch.LongTensor, ids))
        return [int(t) for t in found[0, ids.shape[1] :].tolist()]
