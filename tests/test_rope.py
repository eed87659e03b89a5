"""eventkv.kv.rope: stored keys re-rotated to other positions equal the keys the same pre-RoPE projections give
there (RoPE, arXiv 2104.09864: a rotation whose angle is linear in the position), on every tiny architecture and
under rope scaling."""

import sys
from contextlib import contextmanager

import pytest
import torch
from transformers import DynamicCache

from eventkv.errors import EventKVError, OptionError
from eventkv.kv.log import HEADER_ID, Event, EventLog, tokenize
from eventkv.kv.model import model_forward
from eventkv.kv.prefill import prefill
from eventkv.kv.readout import query_logits
from eventkv.kv.rope import rerotatable, rerotate, rotary_embedding
from eventkv.kv.rows import cache_kv
from eventkv.kv.serve import ServedCache, serve
from eventkv.testing import TINY_FAMILIES, tiny_lm, tiny_model

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024}
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # small, so the tiny positions reach every band of llama3's blend
}
TOL = 1e-5
"""float32 tolerance: the two paths round the angles differently (offset, then position, vs position)."""


@contextmanager
def _pre_rope_keys(model):
    """Capture each layer's pre-RoPE keys ``[1, kv_heads, q, head_dim]`` (the layer input through k_proj, and
    k_norm where the architecture has one) of every forward run inside, concatenated along the tokens."""
    pre: dict[int, list[torch.Tensor]] = {}

    def hook(layer_idx):
        def capture(module, args, kwargs):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            k = module.k_proj(h).view(*h.shape[:-1], -1, module.head_dim)
            if hasattr(module, "k_norm"):
                k = module.k_norm(k)
            pre.setdefault(layer_idx, []).append(k.transpose(1, 2))

        return capture

    layers = model.model.layers
    handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    out: list[torch.Tensor] = []
    try:
        yield out
    finally:
        for h in handles:
            h.remove()
    out.extend(torch.cat(pre[i], dim=2) for i in range(len(layers)))


def _keys_with_pre_rope(model, ids, positions):
    """The cache keys of one forward at ``positions`` and each layer's pre-RoPE keys."""
    cache = DynamicCache()
    with _pre_rope_keys(model) as pre:
        model_forward(model, ids, positions.unsqueeze(0), cache)
    return cache_kv(cache)[0], pre


def _rotated_at(model, pre_keys, positions):
    """Pre-RoPE keys rotated at ``positions`` with transformers' own pieces (the layer's rotary, apply_rotary)."""
    rotary = rotary_embedding(model)
    apply = sys.modules[type(rotary).__module__].apply_rotary_pos_emb
    types = getattr(model.config, "layer_types", None) or [None] * len(pre_keys)
    out = []
    for k, layer_type in zip(pre_keys, types):
        kwargs = {"layer_type": layer_type} if isinstance(rotary.rope_type, dict) else {}
        cos, sin = rotary(k, positions.unsqueeze(0), **kwargs)
        out.append(apply(k, k, cos, sin)[1])
    return out


CASES = [(f, None) for f in TINY_FAMILIES] + [("llama", LLAMA3), ("llama", YARN)]


@pytest.mark.parametrize(("family", "rope"), CASES, ids=[f"{f}-{r['rope_type'] if r else 'default'}" for f, r in CASES])
def test_rerotated_keys_equal_keys_rotated_at_the_new_positions(family, rope):
    model = tiny_model(family, **({"rope_parameters": rope} if rope else {}))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (1, 40), generator=gen)
    old = torch.arange(40) * 3 + 7  # gapped, as an EventKV's served rows are
    new = torch.cat([torch.arange(10), torch.arange(30) + 150])  # down and up: negative and positive offsets
    stored, pre = _keys_with_pre_rope(model, ids, old)
    assert all(torch.equal(s, r) for s, r in zip(stored, _rotated_at(model, pre, old)))  # the capture is right
    want = _rotated_at(model, pre, new)
    got = rerotate(model, stored, old, new)
    assert len(got) == len(stored)
    for layer, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == torch.float32
        assert (g - w).abs().max().item() <= TOL, (family, layer)
    if family == "gemma3":  # the sliding layers use the local base: the global one would give other keys
        assert (
            model.config.rope_parameters["sliding_attention"]["rope_theta"]
            != (model.config.rope_parameters["full_attention"]["rope_theta"])
        )


def test_yarn_attention_factor_is_applied_once():
    model = tiny_model("llama", rope_parameters=YARN)
    assert rotary_embedding(model).attention_scaling > 1.1  # 0.1 ln(4) + 1 = 1.139: a second one would show
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    stored, _ = _keys_with_pre_rope(model, ids, torch.arange(12))
    back = rerotate(
        model, rerotate(model, stored, torch.arange(12), torch.arange(12) + 50), torch.arange(12) + 50, torch.arange(12)
    )
    for s, b in zip(stored, back):
        assert torch.linalg.vector_norm(b) == pytest.approx(torch.linalg.vector_norm(s).item(), rel=1e-5)
        assert (s - b).abs().max().item() <= TOL


def test_zero_offsets_return_the_keys_themselves():
    model = tiny_model("llama")
    keys = [torch.randn(1, 2, 5, 16) for _ in range(2)]
    out = rerotate(model, keys, torch.arange(5), torch.arange(5))
    assert all(o is k for o, k in zip(out, keys))


def test_bfloat16_keys_come_back_bfloat16():
    model = tiny_model("qwen2")
    keys = [torch.randn(1, 2, 6, 16, dtype=torch.bfloat16) for _ in range(2)]
    out = rerotate(model, keys, torch.arange(6), torch.arange(6) + 3)
    assert all(o.dtype == torch.bfloat16 and o.shape == k.shape for o, k in zip(out, keys))


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_length_dependent_rope_is_refused_by_name(kind):
    rope = {"rope_type": kind, "rope_theta": 10000.0, "factor": 2.0}
    if kind == "longrope":
        rope |= {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}
    model = tiny_model("llama", rope_parameters=rope)
    keys = [torch.randn(1, 2, 3, 16) for _ in range(2)]
    with pytest.raises(EventKVError, match=kind):
        rerotate(model, keys, torch.arange(3), torch.arange(3) + 1)


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_the_default_positions_fall_back_to_original_where_rope_cannot_be_re_rotated(kind, tmp_path):
    from eventkv.kv.serve import default_positions
    from eventkv.memory import EventMemory
    from eventkv.models import LoadedModel

    rope = {"rope_type": kind, "rope_theta": 10000.0, "factor": 2.0}
    if kind == "longrope":
        rope |= {"short_factor": [1.0] * 8, "long_factor": [2.0] * 8, "original_max_position_embeddings": 64}
    refused = tiny_model("llama", rope_parameters=rope)
    assert not rerotatable(refused) and default_positions(refused, ["compact"]) == "original"
    plain = tiny_model("llama")
    assert rerotatable(plain) and default_positions(plain, ["compact", "text"]) == "contiguous"
    assert default_positions(plain, ["compact", "native"]) == "original"  # native keeps every row in place
    base = tiny_lm("llama")
    lm = LoadedModel(refused, base.tokenizer, base.profile)
    with EventMemory.create(tmp_path / "m", lm, namespace="t") as mem:  # the default never refuses the query
        mem.add(["register A set to ON", "register B mirrors A"])
        ans = mem.query("What is A?", select="view", max_new_tokens=1)
    assert ans.plan["positions"] == "original"


def test_bad_shapes_are_refused():
    model = tiny_model("llama")
    keys = [torch.randn(1, 2, 3, 16) for _ in range(2)]
    with pytest.raises(EventKVError, match="layers"):
        rerotate(model, keys[:1], torch.arange(3), torch.arange(3) + 1)
    with pytest.raises(EventKVError, match=r"\[rows\]"):
        rerotate(model, keys, torch.arange(4), torch.arange(4) + 1)


# serving at contiguous positions (eventkv.kv.serve, positions="contiguous")

EVENTS = [
    Event("a", "register A set to ON"),
    Event("b", "the pump in hall two failed", budget=40),  # a position budget: a gap after b's tokens
    Event("c", "register B mirrors A"),
    Event("d", "Dana moved the red key to the shelf"),
]
QUERY = list(b"What is B?")


def _ekv(lm, events=EVENTS):
    return prefill(lm.model, tokenize(EventLog(events), lm.tokenizer, lm.profile))


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("mode", ["compact", "isolated", "text"])
def test_contiguous_changes_nothing_when_no_row_moves(family, mode):
    lm = tiny_lm(family)
    ekv = _ekv(lm, [e for e in EVENTS if e.budget is None])  # no gap: every row is where contiguous puts it
    original = serve(ekv, "all", mode, lm.model)
    moved = serve(ekv, "all", mode, lm.model, positions="contiguous")
    assert moved.position_mode == "contiguous" and torch.equal(moved.positions, original.positions)
    assert moved.next_position == original.next_position == ekv.n_rows
    assert torch.equal(query_logits(lm.model, moved, QUERY), query_logits(lm.model, original, QUERY))


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_contiguous_subset_equals_keys_computed_at_the_served_positions(family):
    """The served rows re-rotated read out as rows whose keys the prefill had computed at those positions
    (pre-RoPE keys captured in the prefill, rotated there with transformers' pieces) with the same values.
    On Gemma 3 the served rows (70) pass the window (16): the sliding layers see the last 15 of them.
    Measured: keys within 4.4e-6, logits within 1.6e-7 (float32); the original positions differ from these by
    1.7e-3 to 7.4e-2 in the logits (the rows did move)."""
    lm = tiny_lm(family)
    with _pre_rope_keys(lm.model) as pre:
        ekv = _ekv(lm)
    served = ["b", "d"]
    moved = serve(ekv, served, "compact", lm.model, positions="contiguous")
    h, rows = ekv.log.span(HEADER_ID).n_tokens, ekv.rows_of(served)
    n = int(rows.shape[0])
    assert moved.positions.tolist() == list(range(n)) and moved.next_position == n
    assert n < ekv.log.history_end - 40  # b's budget gap and the rows of a and c closed up
    assert ekv.positions[rows][h:].tolist() != list(range(h, n))  # the rows did move
    at_served = [k.index_select(2, rows) for k in pre]
    want_keys = _rotated_at(lm.model, at_served, torch.arange(n))
    for got, want in zip(moved.keys, want_keys):
        assert (got - want).abs().max().item() <= TOL
    want = ServedCache(want_keys, moved.values, torch.arange(n), None, n, "compact", tuple(served), "contiguous")
    a, b = query_logits(lm.model, moved, QUERY), query_logits(lm.model, want, QUERY)
    assert torch.isfinite(a).all() and (a - b).abs().max().item() <= 1e-6


def test_isolated_contiguous_rerotates_the_isolated_encoding():
    lm = tiny_lm("gemma3")
    ekv, memo = _ekv(lm), {}
    original = serve(ekv, ["c", "d"], "isolated", lm.model)
    moved = serve(ekv, ["c", "d"], "isolated", lm.model, isolated_memo=memo, positions="contiguous")
    again = serve(ekv, ["c", "d"], "isolated", lm.model, isolated_memo=memo, positions="contiguous")  # memo hits
    assert len(memo) == 2 and moved.positions.tolist() == list(range(original.n_rows))
    assert all(torch.equal(v, w) for v, w in zip(moved.values, original.values))
    want = rerotate(lm.model, original.keys, original.positions, moved.positions)
    assert all(torch.equal(k, w) for k, w in zip(moved.keys, want))
    assert all(torch.equal(k, w) for k, w in zip(again.keys, moved.keys))


def test_contiguous_is_refused_where_it_cannot_apply():
    lm = tiny_lm("llama")
    ekv = _ekv(lm)
    with pytest.raises(OptionError, match="native"):
        serve(ekv, ["a"], "native", lm.model, positions="contiguous")
    with pytest.raises(OptionError, match="positions 'packed'"):
        serve(ekv, ["a"], "compact", lm.model, positions="packed")  # type: ignore[arg-type]
    with pytest.raises(EventKVError, match="model="):
        serve(ekv, ["a"], "compact", positions="contiguous")
