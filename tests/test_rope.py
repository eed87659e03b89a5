"""eventkv.rope: stored keys re-rotated to other positions equal the keys the same pre-RoPE projections give
there (RoPE, arXiv 2104.09864: a rotation whose angle is linear in the position), on every tiny architecture and
under rope scaling."""

import sys

import pytest
import torch

from eventkv.errors import EventKVError
from eventkv.prefill import cache_kv, model_forward
from eventkv.rope import rerotate, rotary_embedding
from eventkv.testing import TINY_FAMILIES, tiny_model

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


def _keys_with_pre_rope(model, ids, positions):
    """The cache keys of one forward at ``positions`` and each layer's pre-RoPE keys ``[1, kv_heads, q, head_dim]``
    (the layer input through k_proj, and k_norm where the architecture has one)."""
    pre: dict[int, torch.Tensor] = {}

    def hook(layer_idx):
        def capture(module, args, kwargs):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            k = module.k_proj(h).view(*h.shape[:-1], -1, module.head_dim)
            if hasattr(module, "k_norm"):
                k = module.k_norm(k)
            pre[layer_idx] = k.transpose(1, 2)

        return capture

    layers = model.model.layers
    handles = [layer.self_attn.register_forward_pre_hook(hook(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        from transformers import DynamicCache

        cache = DynamicCache()
        model_forward(model, ids, positions.unsqueeze(0), cache)
    finally:
        for h in handles:
            h.remove()
    return cache_kv(cache)[0], [pre[i] for i in range(len(layers))]


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


def test_bad_shapes_are_refused():
    model = tiny_model("llama")
    keys = [torch.randn(1, 2, 3, 16) for _ in range(2)]
    with pytest.raises(EventKVError, match="layers"):
        rerotate(model, keys[:1], torch.arange(3), torch.arange(3) + 1)
    with pytest.raises(EventKVError, match=r"\[rows\]"):
        rerotate(model, keys, torch.arange(4), torch.arange(4) + 1)
