"""The splice: replace a prompt span's K/V rows in chosen layers with those of a donor
(Study 2, "Controlled splice"), on the same data path as serving (config-less ``DynamicCache``,
explicit position ids, rows kept at their original positions).

Layout. A prompt is ``head + span + tail`` token ids, tokenized piece by piece (no BPE merge
crosses a boundary), at contiguous positions ``0 .. P-1``: the head is the chat template up to the
user content, the **span** is the user content (rows ``[h, h + n)``), the tail is the end of the
user turn plus the assistant opener. Every arm keeps the span's length, so every later position
is the same in all arms.

Arms (:data:`ARMS`), applied to the span rows of the selected layers (and KV heads):

* ``clean`` — no change (the reference).
* ``scaffold`` — the rows the same chat template produces with **neutral filler** as user content,
  computed at the same positions over the same head rows. The filler is length-matched in tokens:
  :data:`DEFAULT_FILLER` (a content-free sentence) repeated and its token ids truncated to the
  span's token count ``n`` (the filler is tokenized on its own, like the span). Any filler text
  can be given; the span's own text as filler reproduces ``clean``.
* ``zero-kv`` / ``zero-k`` / ``zero-v`` — keys and/or values set to 0. A zero key still takes
  attention weight ``exp(0)`` (its logit is 0, not -inf): zeroing is not removal.
* ``mask`` — the span removed from attention in the selected layers only (a scoped per-layer 4D
  mask installed by :func:`span_masked`; other layers see the span as usual). With per-head
  selection only the query heads that read the selected KV heads lose the span.
* ``mean`` — each selected layer's span keys and values replaced by their mean over the span rows
  (per KV head; keys are averaged after RoPE, as stored).

Which rows are computed under the splice (:func:`splice_sweep`; exposed as options):

* **decoding step** ``t`` — the forward that predicts generated token ``g_t``. Step 0 feeds the
  last prompt token, step ``s > 0`` feeds ``g_{s-1}``. A splice *from step t* means: ``g_0 ..
  g_{t-1}`` are the clean greedy tokens, predicted from the clean cache, and the rows of the
  tokens fed at steps ``< t`` are the clean ones; the steps ``>= t`` attend to the spliced span
  (and to the rows of the tokens fed since step ``t``, which are computed under the splice).
  ``t = 0`` splices before the first token is predicted. If the clean run stopped before step
  ``t`` the splice never takes effect and the answer is the clean one.
* **tail** — ``"clean"`` (default, a pure cache edit as in the study): the rows between the span
  and the token fed at step ``t`` (the prompt tail and, for ``t > 0``, the first generated tokens)
  keep their clean K/V, which were computed while the clean span was visible. ``"spliced"``:
  those rows are recomputed over the spliced cache, with the clean tokens forced (only the
  span's own rows come from the donor). With ``tail="spliced"``, ``mask`` on every layer equals
  a prefill of the prompt without the span at the same positions.

Layers are selected per splice (default in the sweep: every layer ``>= cutoff``; a cutoff equal
to the number of layers splices nothing and reproduces clean exactly). ``heads`` selects KV heads
(after grouped-query sharing); None = all.

Performance: :func:`clean_run` (one prefill + one clean greedy decode) and :func:`donor_rows`
(one short forward per scaffold filler) are computed once per prompt; :func:`splice_sweep` then
runs every (arm, layers, step) cell as a batch over the shared rows — a cutoff sweep costs
splices and decodes, not prefills. Every decode is the data path's decode loop
(:func:`eventkv.kv.readout.generate_from`), a finished splice leaving its batch.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
from transformers import DynamicCache

from eventkv.errors import EventKVError
from eventkv.kv.model import check_context, model_device, model_forward
from eventkv.kv.readout import generate_from, token_logprobs
from eventkv.kv.rows import cache_from_rows, cache_kv
from eventkv.kv.stacked import Batch
from eventkv.models.encoding import encode

ARMS = ("clean", "scaffold", "zero-kv", "zero-k", "zero-v", "mask", "mean")
TAILS = ("clean", "spliced")
#: The default scaffold filler: neutral, content-free; repeated and truncated to the span length.
DEFAULT_FILLER = "This is a neutral sentence with no particular content. "


# ------------------------------------------------------------------------------ prompt layout
@dataclass(frozen=True)
class SplicePrompt:
    """A chat prompt split into head, span and tail token ids (contiguous positions 0..P-1).

    Rows: head ``[0, h)``, span ``[h, h + n)``, tail ``[h + n, P)``.
    """

    head_ids: tuple[int, ...]
    span_ids: tuple[int, ...]
    tail_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.span_ids:
            raise EventKVError("the splice span is empty: give the prompt some user content.")
        if not self.tail_ids:
            raise EventKVError(
                "the prompt has no tail after the span (no chat template tail): splicing needs at "
                "least one token after the span; load the model with a chat template or plain-text scaffold."
            )

    @property
    def ids(self) -> list[int]:
        return [*self.head_ids, *self.span_ids, *self.tail_ids]

    @property
    def n_rows(self) -> int:
        return len(self.head_ids) + len(self.span_ids) + len(self.tail_ids)

    @property
    def span_rows(self) -> tuple[int, int]:
        """``(start, end)`` rows of the span (end exclusive); rows equal positions here."""
        return len(self.head_ids), len(self.head_ids) + len(self.span_ids)

    @classmethod
    def from_text(cls, tokenizer, profile, content: str) -> "SplicePrompt":
        """``profile.chat_head + content + profile.chat_tail``, each piece tokenized on its own
        (without special tokens, `eventkv.models.encoding.encode`); the span is ``content``. The pieces' ids equal
        the whole text's at both seams (`eventkv.models.scaffold_seams`; tested for every profile)."""
        return cls(
            tuple(encode(tokenizer, profile.chat_head)),
            tuple(encode(tokenizer, content)),
            tuple(encode(tokenizer, profile.chat_tail)),
        )


def filler_ids(tokenizer, n_tokens: int, filler: str = DEFAULT_FILLER) -> list[int]:
    """Token ids of ``filler`` repeated until it has at least ``n_tokens`` tokens, truncated to
    exactly ``n_tokens`` (tokenized on its own, without special tokens).

    Raises:
        EventKVError: a filler that tokenizes to nothing.
    """
    one = encode(tokenizer, filler)
    if not one:
        raise EventKVError(f"the scaffold filler {filler!r} tokenizes to nothing: give a non-empty filler text.")
    reps = -(-n_tokens // len(one)) + 1
    ids = encode(tokenizer, filler * reps)
    return ids[:n_tokens]


# ------------------------------------------------------------------------------ the splice itself
@dataclass(frozen=True)
class Splice:
    """One splice: an arm applied to the span rows of ``layers`` (and KV ``heads``; None = all),
    taking effect from decoding ``step``. ``donor`` names the donor rows (for ``scaffold``: the
    key of :func:`donor_rows`' result; default ``"scaffold"``)."""

    arm: str
    layers: tuple[int, ...] = ()
    heads: tuple[int, ...] | None = None
    step: int = 0
    donor: str = "scaffold"

    def __post_init__(self) -> None:
        if self.arm not in ARMS:
            raise EventKVError(f"unknown splice arm {self.arm!r}: use one of {', '.join(ARMS)}.")
        if self.step < 0:
            raise EventKVError(f"decoding step {self.step}: give a step >= 0 (0 = before the first generated token).")


def layers_from(cutoff: int, n_layers: int) -> tuple[int, ...]:
    """The layers a cutoff selects: every layer ``>= cutoff`` (empty when ``cutoff == n_layers``).

    Raises:
        EventKVError: a cutoff outside ``0 .. n_layers``.
    """
    if not 0 <= cutoff <= n_layers:
        raise EventKVError(
            f"layer cutoff {cutoff} is outside 0..{n_layers} for this {n_layers}-layer model: "
            f"give cutoffs between 0 and {n_layers} ({n_layers} = splice nothing)."
        )
    return tuple(range(cutoff, n_layers))


@dataclass
class CleanRun:
    """The clean prompt's rows and its greedy generation, computed once and shared by every splice.

    Attributes:
        prompt: the SplicePrompt.
        keys, values: per layer ``[1, kv_heads, rows, head_dim]``: the prompt's rows followed by the
            rows of the tokens fed during decoding (``rows = P - 1 + number of decode forwards``).
        tokens: the clean greedy tokens (stop token excluded); stopped: whether a stop token ended it.
        logits: per decoding step ``[vocab]`` (float32) when kept.
    """

    prompt: SplicePrompt
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    tokens: list[int]
    stopped: bool
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def n_layers(self) -> int:
        return len(self.keys)


@dataclass
class SpliceResult:
    """The greedy generation of one splice: ``tokens`` (the clean ``g_0..g_{t-1}`` then the spliced
    continuation; stop token excluded), ``stopped``, and per spliced step logits when kept."""

    splice: Splice
    tokens: list[int]
    stopped: bool
    logits: list[torch.Tensor] = field(default_factory=list)
    took_effect: bool = True


def _attention_modules(model) -> list[torch.nn.Module]:
    """The self-attention module of every decoder layer, indexed by layer."""
    mods = {}
    for name, m in model.named_modules():
        if name.endswith("self_attn") and hasattr(m, "layer_idx"):
            mods[int(m.layer_idx)] = m
    if not mods:
        raise EventKVError(
            f"{type(model).__name__} has no '*.self_attn' modules with a layer_idx: the mask arm "
            "supports Hugging Face decoder models (Llama, Qwen, Gemma, ...)."
        )
    return [mods[i] for i in sorted(mods)]


@contextmanager
def span_masked(
    model, span_rows: tuple[int, int], plan: dict[int, torch.Tensor], heads: dict[int, torch.Tensor] | None = None
) -> Iterator[None]:
    """Scoped per-layer removal of a span from attention.

    While installed, the attention of layer ``l`` in ``plan`` does not see key rows
    ``span_rows[0] .. span_rows[1] - 1`` for the batch elements where ``plan[l]`` (``[batch]`` bool)
    is True; other layers and elements are untouched. ``heads[l]`` (``[batch, n_query_heads]``
    bool), if given, limits the removal to those query heads. Both are made on the model's device
    (:func:`_spliced_rows` does), so a hook copies nothing per forward. Both dicts are read at each forward
    (so a caller may replace their tensors when it drops finished batch elements). The layer's own mask (causal,
    sliding window) is kept and combined; when the model passes none, a causal mask is built.
    Hooks are removed on exit, always.
    """
    attns = _attention_modules(model)
    handles = []
    lo, hi = span_rows

    def make_hook(layer: int):
        def hook(module, args, kwargs):
            sel = plan[layer]  # read at call time: the decoder may shrink the batch between forwards
            head_sel = None if heads is None else heads.get(layer)
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            b, q = hidden.shape[0], hidden.shape[1]
            past = 0
            if cache is not None and len(cache.layers) > layer and cache.layers[layer].keys is not None:
                past = int(cache.layers[layer].keys.shape[-2])
            kv = past + q
            dev = hidden.device
            base = kwargs.get("attention_mask")
            hide = torch.zeros(b, 1, 1, kv, dtype=torch.bool, device=dev)
            hide[:, :, :, lo:hi] = sel.view(b, 1, 1, 1)
            if head_sel is not None:
                hide = hide & head_sel.view(b, -1, 1, 1)
            if base is None:
                rows = torch.arange(kv, device=dev)
                qrows = torch.arange(past, kv, device=dev)
                base = (rows.view(1, -1) <= qrows.view(-1, 1)).view(1, 1, q, kv)
            if base.dtype == torch.bool:
                new = base & ~hide
            else:
                new = base.masked_fill(hide, torch.finfo(base.dtype).min)
            kwargs["attention_mask"] = new
            return args, kwargs

        return hook

    try:
        for layer in plan:
            handles.append(attns[layer].register_forward_pre_hook(make_hook(layer), with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


@torch.inference_mode()
def clean_run(
    model,
    prompt: SplicePrompt,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    max_context: int | None = None,
    keep_logits: bool = False,
    decided: Callable[[list[int]], bool] | None = None,
) -> CleanRun:
    """Prefill the prompt (all but its last token), then decode greedily from the last prompt
    token (decoding step 0) for up to ``max_new_tokens`` tokens, keeping every row.
    ``decided(tokens)``, if given, ends the generation once its outcome is known (a splice from a
    later step then cannot change it).

    Raises:
        EventKVError: prompt plus generation longer than the model's context.
    """
    check_context(prompt.n_rows + max_new_tokens, max_context, what="prompt plus generation")
    dev = model_device(model)
    ids = torch.tensor([prompt.ids], device=dev)
    cache = DynamicCache()
    p = prompt.n_rows  # >= 2: a SplicePrompt has a span and a tail
    model_forward(model, ids[:, : p - 1], torch.arange(p - 1, device=dev).unsqueeze(0), cache, logits_to_keep=1)
    batch = Batch.of_rows(*cache_kv(cache), p - 1)
    (gen,) = generate_from(
        model,
        batch,
        ids[:, p - 1 :],
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        keep_logits=keep_logits,
        decided=decided,
    )
    keys, values = cache_kv(batch.cache)
    return CleanRun(prompt, keys, values, gen.tokens, gen.stopped, gen.logits)


@torch.inference_mode()
def donor_rows(model, run: CleanRun, donor_ids: Sequence[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The span rows a donor prompt produces: ``donor_ids`` (the span's length) are run over the
    clean head rows at the span's positions. Returns per layer keys and values
    ``[1, kv_heads, n, head_dim]``.

    Raises:
        EventKVError: donor ids of another length than the span.
    """
    lo, hi = run.prompt.span_rows
    if len(donor_ids) != hi - lo:
        raise EventKVError(
            f"the donor has {len(donor_ids)} tokens but the span has {hi - lo}: length-match the filler "
            "to the span (see filler_ids)."
        )
    dev = model_device(model)
    cache = cache_from_rows([k[:, :, :lo] for k in run.keys], [v[:, :, :lo] for v in run.values])
    model_forward(
        model,
        torch.tensor([list(donor_ids)], device=dev),
        torch.arange(lo, hi, device=dev).unsqueeze(0),
        cache,
        logits_to_keep=1,
    )
    keys, values = cache_kv(cache)
    return [k[:, :, lo:hi] for k in keys], [v[:, :, lo:hi] for v in values]


def _replacement(arm: str, run: CleanRun, layer: int, donors: dict) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(new keys, new values) ``[1, kv_heads, n, head_dim]`` for the span at ``layer``; None = keep."""
    lo, hi = run.prompt.span_rows
    k, v = run.keys[layer][:, :, lo:hi], run.values[layer][:, :, lo:hi]
    if arm == "zero-kv":
        return torch.zeros_like(k), torch.zeros_like(v)
    if arm == "zero-k":
        return torch.zeros_like(k), None
    if arm == "zero-v":
        return None, torch.zeros_like(v)
    if arm == "mean":
        return k.mean(dim=2, keepdim=True).expand_as(k), v.mean(dim=2, keepdim=True).expand_as(v)
    return None, None


@torch.inference_mode()
def splice_sweep(
    model,
    run: CleanRun,
    splices: Sequence[Splice],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    donors: dict | None = None,
    tail: str = "clean",
    batch_size: int = 16,
    keep_logits: bool = False,
    decided: Callable[[list[int]], bool] | None = None,
) -> list[SpliceResult]:
    """Run many splices of one clean run, batched over the shared rows (see the module docstring
    for what a step and the tail option mean).

    Args:
        run: the clean run (its rows are never modified).
        splices: the cells; each gets its greedy generation (at most ``max_new_tokens`` tokens in
            all, the clean ``g_0..g_{t-1}`` included).
        donors: ``{name: (keys, values)}`` from :func:`donor_rows`, for ``scaffold`` splices.
        tail: ``"clean"`` | ``"spliced"``.
        batch_size: splices per batched decode.
        decided: ``decided(tokens) -> bool`` ends a generation early once its outcome is known
            (e.g. an exact-match answer that already diverged); finished splices leave the batch.

    Returns:
        one SpliceResult per splice, in order.

    Raises:
        EventKVError: unknown tail, a scaffold splice without its donor, a layer or head out of range.
    """
    donors = donors or {}
    _check_splices(run, splices, donors, tail, batch_size)
    stops = set(int(t) for t in stop_token_ids)
    results: list[SpliceResult | None] = [None] * len(splices)
    n_fed = len(run.tokens) + (1 if run.stopped else 0)  # decode forwards of the clean run
    by_step: dict[int, list[int]] = {}
    for i, s in enumerate(splices):
        if s.step >= n_fed or (not run.stopped and s.step >= max_new_tokens):
            # the clean run ended before this step: the splice never takes effect
            results[i] = SpliceResult(s, list(run.tokens[:max_new_tokens]), run.stopped, [], took_effect=False)
        else:
            by_step.setdefault(s.step, []).append(i)
    for step, idx in by_step.items():
        for a in range(0, len(idx), batch_size):
            chunk = idx[a : a + batch_size]
            for i, r in zip(
                chunk,
                _run_batch(
                    model,
                    run,
                    [splices[i] for i in chunk],
                    step,
                    donors,
                    tail,
                    max_new_tokens,
                    stops,
                    keep_logits,
                    decided,
                ),
            ):
                results[i] = r
    return results  # type: ignore[return-value]


def _start_row(run: CleanRun, step: int, tail: str) -> int:
    """The first row computed under the splice: the token fed at ``step`` (tail ``clean``) or the
    first tail row (tail ``spliced``)."""
    return run.prompt.n_rows - 1 + step if tail == "clean" else run.prompt.span_rows[1]


def _spliced_rows(model, run: CleanRun, splices: Sequence[Splice], r0: int, donors: dict):
    """The spliced rows ``[0, r0)`` of a batch of splices: per layer keys and values
    ``[B, kv_heads, r0, head_dim]`` (fresh tensors; the clean run's are never written), and the
    ``mask`` arm's per-layer plans for :func:`span_masked` (``{layer: [B] bool}``,
    ``{layer: [B, n_query_heads] bool}``), on the rows' device."""
    lo, hi = run.prompt.span_rows
    b = len(splices)
    dev = run.keys[0].device
    keys, values = [], []
    plan: dict[int, list[bool]] = {}
    head_plan: dict[int, list[list[bool]]] = {}
    n_q_heads = int(model.config.get_text_config().num_attention_heads)
    group = n_q_heads // run.keys[0].shape[1]
    for layer in range(run.n_layers):
        k = run.keys[layer][:, :, :r0].expand(b, -1, -1, -1).clone()
        v = run.values[layer][:, :, :r0].expand(b, -1, -1, -1).clone()
        for e, s in enumerate(splices):
            if layer not in s.layers:
                continue
            hs = slice(None) if s.heads is None else list(s.heads)
            if s.arm == "mask":
                plan.setdefault(layer, [False] * b)[e] = True
                if s.heads is not None:
                    hp = head_plan.setdefault(layer, [[True] * n_q_heads for _ in range(b)])
                    hp[e] = [h // group in s.heads for h in range(n_q_heads)]
                continue
            if s.arm == "scaffold":
                nk, nv = donors[s.donor][0][layer], donors[s.donor][1][layer]
            else:
                nk, nv = _replacement(s.arm, run, layer, donors)
            if nk is not None:
                k[e, hs, lo:hi] = nk[0, hs].to(k.dtype)
            if nv is not None:
                v[e, hs, lo:hi] = nv[0, hs].to(v.dtype)
        keys.append(k)
        values.append(v)
    plans = [
        {layer: torch.tensor(m, dtype=torch.bool, device=dev) for layer, m in p.items()} for p in (plan, head_plan)
    ]
    return keys, values, *plans


def _run_batch(
    model,
    run: CleanRun,
    splices: list[Splice],
    step: int,
    donors: dict,
    tail: str,
    max_new: int,
    stops: set[int],
    keep_logits: bool,
    decided: Callable | None = None,
) -> list[SpliceResult]:
    prompt = run.prompt
    p = prompt.n_rows
    lo, hi = prompt.span_rows
    all_ids = prompt.ids + run.tokens
    r0 = _start_row(run, step, tail)
    forced = torch.tensor([all_ids[r0 : p + step]], dtype=torch.long, device=model_device(model))
    b = len(splices)
    keys, values, plan, head_plan = _spliced_rows(model, run, splices, r0, donors)

    def narrow(idx: torch.Tensor) -> None:  # finished splices leave the batch: their mask plans too
        for m in (plan, head_plan):
            for layer in list(m):
                m[layer] = m[layer].index_select(0, idx)

    prefix = list(run.tokens[:step])
    dec = None if decided is None else (lambda new: decided(prefix + new))
    with span_masked(model, (lo, hi), plan, head_plan or None):
        gens = generate_from(
            model,
            Batch.of_rows(keys, values, r0),
            forced.expand(b, -1),
            max_new_tokens=max_new - step,
            stop_token_ids=stops,
            keep_logits=keep_logits,
            decided=dec,
            drop_finished=True,
            on_drop=narrow,
        )
    return [SpliceResult(s, prefix + g.tokens, g.stopped, g.logits) for s, g in zip(splices, gens)]


def _check_splices(run: CleanRun, splices: Sequence[Splice], donors: dict, tail: str, batch_size: int) -> None:
    if tail not in TAILS:
        raise EventKVError(f"unknown tail option {tail!r}: use one of {', '.join(TAILS)}.")
    if batch_size < 1:
        raise EventKVError(f"batch size {batch_size}: give at least 1.")
    n_layers = run.n_layers
    kv_heads = run.keys[0].shape[1]
    for s in splices:
        bad = [layer for layer in s.layers if not 0 <= layer < n_layers]
        if bad:
            raise EventKVError(
                f"layer {bad[0]} is out of range for this {n_layers}-layer model: give layers 0..{n_layers - 1}."
            )
        if s.heads is not None and any(not 0 <= h < kv_heads for h in s.heads):
            raise EventKVError(
                f"KV heads {list(s.heads)} out of range: this model has {kv_heads} KV heads per layer "
                f"(0..{kv_heads - 1})."
            )
        if s.arm == "scaffold" and s.donor not in donors:
            raise EventKVError(f"scaffold splice needs donor rows {s.donor!r}: compute them with donor_rows().")


@torch.inference_mode()
def splice_choice(
    model,
    run: CleanRun,
    splices: Sequence[Splice],
    options: Sequence[Sequence[int]],
    *,
    donors: dict | None = None,
    tail: str = "clean",
    batch_size: int = 16,
) -> list[list[float]]:
    """Forced-choice readout over the spliced cache: for each splice, the log-probability (nats,
    the sum over its tokens) of each option's full continuation right after the prompt, scored
    over the spliced rows — the candidate-logit readout of :func:`eventkv.kv.readout.candidate_logprobs`,
    on a splice instead of a served cache. A splice with no layers (cutoff = number of layers)
    gives the clean scores.

    The splice applies before the first answer token (decoding step 0; the option tokens are
    forced, so there is no clean greedy prefix to keep). The rows from :func:`_start_row` on (the
    last prompt token, or the whole tail with ``tail="spliced"``) and the option tokens are
    computed over the spliced cache; for each splice all options go in one batched forward of
    ``[n_options, forced + longest - 1]`` tokens (right-padded; padding is after every scored
    token, so causal attention keeps it out).

    Args:
        run: the clean run (only its prompt rows are read; ``clean_run(..., max_new_tokens=0)``
            suffices).
        options: token ids per option (each non-empty), e.g. an answer word as the assistant
            would write it right after the prompt.
        donors, tail, batch_size: as :func:`splice_sweep` (``batch_size`` counts splices).

    Returns:
        per splice, per option, the total log-probability (float, nats).

    Raises:
        EventKVError: no option or an empty option, a splice from a step other than 0, and the
            errors of :func:`splice_sweep`.
    """
    donors = donors or {}
    _check_splices(run, splices, donors, tail, batch_size)
    if not options or any(len(o) == 0 for o in options):
        raise EventKVError("forced choice needs at least one option and no empty option (check the item's options).")
    if any(s.step != 0 for s in splices):
        raise EventKVError(
            "the forced-choice readout splices before the first answer token: use decoding step 0 "
            "(--steps 0) with --readout choice."
        )
    prompt = run.prompt
    lo, hi = prompt.span_rows
    r0 = _start_row(run, 0, tail)
    forced = list(prompt.ids[r0:])
    n_opt, longest = len(options), max(len(o) for o in options)
    width = len(forced) + longest - 1
    dev = model_device(model)
    # per option: its input (forced + the option but its last token, right-padded with token 0), and
    # [n_opt, longest] the logits row before each option token, that token, and whether it is one
    # (the padding entries, at the last forced row with token 0, are computed but never summed)
    seqs = [forced + list(o[:-1]) for o in options]
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], dtype=torch.long, device=dev)
    pad = [longest - len(o) for o in options]
    at = torch.tensor(
        [[len(forced) - 1 + j for j in range(len(o))] + [len(forced) - 1] * k for o, k in zip(options, pad)],
        dtype=torch.long,
        device=dev,
    )
    targets = torch.tensor([list(o) + [0] * k for o, k in zip(options, pad)], dtype=torch.long, device=dev)
    real = torch.tensor([[True] * len(o) + [False] * k for o, k in zip(options, pad)], dtype=torch.bool, device=dev)
    option = torch.arange(n_opt, device=dev).unsqueeze(1)  # [n_opt, 1]
    out: list[list[float]] = []
    for a in range(0, len(splices), batch_size):
        chunk = list(splices[a : a + batch_size])
        b = len(chunk)
        keys, values, plan, head_plan = _spliced_rows(model, run, chunk, r0, donors)
        rep = lambda t: t.repeat_interleave(n_opt, dim=0)  # noqa: E731  [b, ...] -> [b * n_opt, ...]
        keys, values = [rep(k) for k in keys], [rep(v) for v in values]
        plan = {layer: rep(m) for layer, m in plan.items()}
        head_plan = {layer: rep(m) for layer, m in head_plan.items()}
        batch_ids = ids.repeat(b, 1)
        pos = torch.arange(r0, r0 + width, device=dev).unsqueeze(0).expand(b * n_opt, -1)
        with span_masked(model, (lo, hi), plan, head_plan or None):
            logits = model_forward(model, batch_ids, pos, cache_from_rows(keys, values))
        # per splice one gather of its option tokens [n_opt, longest] (float64 over one splice's vocab rows
        # at a time), summed on the device; the [b, n_opt] sums are copied back once
        per = logits.reshape(b, n_opt, width, -1)
        sums = [torch.where(real, token_logprobs(per[e][option, at], targets), 0.0).sum(dim=-1) for e in range(b)]
        out.extend(torch.stack(sums).tolist())
    return out


@torch.inference_mode()
def splice_generate(
    model,
    prompt: SplicePrompt,
    splice: Splice,
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    donor_ids: Sequence[int] | None = None,
    tail: str = "clean",
    max_context: int | None = None,
    keep_logits: bool = False,
) -> SpliceResult:
    """One splice from scratch: clean prefill and decode, the donor's prefill (``scaffold``:
    ``donor_ids``, the span's length), then the spliced decode. The naive path — a sweep should
    use :func:`clean_run` once and :func:`splice_sweep`.

    Raises:
        EventKVError: as :func:`splice_sweep`; a scaffold splice without ``donor_ids``.
    """
    run = clean_run(
        model, prompt, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, max_context=max_context
    )
    donors = {}
    if splice.arm == "scaffold":
        if donor_ids is None:
            raise EventKVError("a scaffold splice needs donor_ids (e.g. filler_ids(tokenizer, len(prompt.span_ids))).")
        donors[splice.donor] = donor_rows(model, run, donor_ids)
    return splice_sweep(
        model,
        run,
        [splice],
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        donors=donors,
        tail=tail,
        batch_size=1,
        keep_logits=keep_logits,
    )[0]
