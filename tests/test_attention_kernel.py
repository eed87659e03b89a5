"""The attention kernel (`eventkv.models.attention`): float32 matmul attention for short half-precision
queries on a CPU, as close to a float64 reference as torch's SDPA, SDPA for every other call, and the
choice recorded and checked like the linear kernel's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from eventkv.errors import OptionError
from eventkv.kv.model import takes_4d_masks
from eventkv.models.attention import (
    ATTENTION_ENV,
    MATMUL_ATTENTION,
    MATMUL_QUERY,
    attention_kernel,
    matmul_attention,
    resolve_attention,
    use_attention,
)
from eventkv.testing import TINY_FAMILIES, tiny_model

HALF_ULP = 2.0**-8  # bfloat16 keeps 8 significant bits: one rounding moves a value by at most half of 2^-7


class _Layer(torch.nn.Module):
    """What the attention functions read off an attention layer."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups, self.is_causal = groups, True


def _qkv(b: int, q: int, kv: int, heads: int = 6, kv_heads: int = 2, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = lambda h, n: (b, h, n, 16)  # noqa: E731
    return tuple(
        (torch.randn(*shape(h, n), generator=g) * 2).to(dtype) for h, n in ((heads, q), (kv_heads, kv), (kv_heads, kv))
    )


def _reference(query, key, value, mask):
    """float64 SDPA on repeated KV heads: ``[b, q, heads, d]``."""
    group = query.shape[1] // key.shape[1]
    k, v = (t.double().repeat_interleave(group, dim=1) for t in (key, value))
    return F.scaled_dot_product_attention(query.double(), k, v, attn_mask=mask).transpose(1, 2)


def _causal(q: int, kv: int) -> torch.Tensor:
    return torch.ones(q, kv, dtype=torch.bool).tril(kv - q)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "b, q, kv", [(1, 1, 37), (3, 1, 50), (3, 3, 50), (2, 5, 40), (2, 24, 24), (1, MATMUL_QUERY, 130)]
)
def test_matmul_attention_is_as_close_to_float64_as_one_rounding(dtype, b, q, kv):
    query, key, value = _qkv(b, q, kv, dtype=dtype)
    mask = _causal(q, kv)[None, None].expand(b, 1, q, kv)
    layer = _Layer(3)
    got, weights = matmul_attention(layer, query, key, value, mask, scaling=0.25)
    assert weights is None and got.dtype == dtype and got.shape == (b, q, 6, 16) and got.is_contiguous()
    # the reference's scale is SDPA's default, 1/sqrt(16) = 0.25: the one given here
    want = _reference(query, key, value, mask)
    # rounded once to the dtype: at most half a unit of the last place, plus float32 noise
    assert ((got.double() - want).abs() <= want.abs() * HALF_ULP + 1e-5).all()
    sdpa, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.25)
    assert (got.double() - sdpa.double()).abs().max() <= 2 * HALF_ULP * want.abs().max()


def test_an_additive_mask_a_missing_mask_and_a_padding_row():
    layer = _Layer(3)
    query, key, value = _qkv(2, 6, 6)
    causal = _causal(6, 6)[None, None].expand(2, 1, 6, 6)
    additive = torch.zeros(2, 1, 6, 6, dtype=torch.bfloat16).masked_fill(~causal, torch.finfo(torch.bfloat16).min)
    by_bool = matmul_attention(layer, query, key, value, causal, scaling=0.25)[0]
    assert torch.equal(matmul_attention(layer, query, key, value, additive, scaling=0.25)[0], by_bool)
    assert torch.equal(matmul_attention(layer, query, key, value, None, scaling=0.25)[0], by_bool)  # q == kv: causal
    step = query[
        :, :, -1:
    ]  # a one-token step without a mask (transformers' call for unpadded sequences) sees every row
    assert torch.equal(matmul_attention(layer, step, key, value, None, scaling=0.25)[0], by_bool[:, -1:])
    layer.is_causal = False
    full = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    assert torch.equal(
        matmul_attention(layer, query, key, value, None, scaling=0.25)[0],
        matmul_attention(layer, query, key, value, full, scaling=0.25)[0],
    )
    padded = causal.clone()
    padded[1, :, 0] = False  # a left-padding token that sees no key
    out = matmul_attention(_Layer(3), query, key, value, padded, scaling=0.25)[0]
    assert torch.isfinite(out.float()).all()  # an average over the keys, not NaN
    assert torch.equal(out[1, 1:], by_bool[1, 1:]) and torch.equal(out[0], by_bool[0])


@pytest.mark.parametrize(
    "case",
    ["float32", "long query", "gradients", "cached causal without a mask", "soft-cap"],
)
def test_every_other_call_goes_to_sdpa_unchanged(case):
    layer = _Layer(3)
    q = MATMUL_QUERY + 1 if case == "long query" else 4
    kv = q + 3 if case == "cached causal without a mask" else q
    query, key, value = _qkv(1, q, kv, dtype=torch.float32 if case == "float32" else torch.bfloat16)
    mask = None if case == "cached causal without a mask" else _causal(q, kv)[None, None]
    extra = {"softcap": 30.0} if case == "soft-cap" else {}
    if case == "gradients":
        query.requires_grad_(True)
    if case == "soft-cap":  # SDPA refuses it, and so the matmul path hands it on
        with pytest.raises(ValueError, match="softcap"):
            matmul_attention(layer, query, key, value, mask, scaling=0.25, **extra)
        return
    got = matmul_attention(layer, query, key, value, mask, scaling=0.25)[0]
    want = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.25)[0]
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_a_bf16_model_gives_sdpas_logits_prefill_and_decode(family):
    model = tiny_model(family, dtype=torch.bfloat16)
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(3))  # past Gemma 3's window of 16

    def run():
        with torch.inference_mode():
            out = model(input_ids=ids[:, :30], use_cache=True)
            step = model(input_ids=ids[:, 30:33], past_key_values=out.past_key_values, use_cache=True)
            one = model(input_ids=ids[:, 33:34], past_key_values=step.past_key_values, use_cache=True)
        return torch.cat([out.logits, step.logits, one.logits], dim=1).float()

    want = run()
    assert use_attention(model, "auto")[0] == "matmul"
    assert model.config._attn_implementation == MATMUL_ATTENTION and takes_4d_masks(model)
    got = run()
    # bfloat16 end to end: the two kernels' outputs differ by a rounding per layer (measured: at most
    # 1.4% of the largest logit on these models, Gemma 3; 0.6% on the others)
    assert (got - want).abs().max() <= 0.03 * want.abs().max()
    assert use_attention(model, "sdpa") == ("sdpa", "requested")
    assert torch.equal(run(), want)  # SDPA again, bit for bit


def test_the_choice_follows_dtype_device_and_implementation(monkeypatch):
    f32 = tiny_model("llama")
    assert attention_kernel(f32, "auto") == ("sdpa", "float32 on cpu: torch's SDPA")
    assert attention_kernel(f32, "matmul")[1].endswith("(the matmul path is for bfloat16 and float16 on a CPU)")
    bf16 = tiny_model("qwen2", dtype=torch.bfloat16)
    kernel, reason = attention_kernel(bf16, "auto")
    assert kernel == "matmul" and reason.startswith("auto: bfloat16 on a CPU") and str(MATMUL_QUERY) in reason
    bf16.set_attn_implementation("eager")
    assert attention_kernel(bf16, "matmul") == ("eager", "eager as loaded (the matmul path replaces SDPA only)")
    monkeypatch.setenv(ATTENTION_ENV, "sdpa")
    assert use_attention(tiny_model("qwen2", dtype=torch.bfloat16)) == ("sdpa", "requested (EVENTKV_ATTENTION)")


def test_a_bad_choice_is_named(monkeypatch):
    with pytest.raises(OptionError, match="attention 'flash': use one of auto, matmul, sdpa"):
        resolve_attention("flash")
    monkeypatch.setenv(ATTENTION_ENV, "fast")
    with pytest.raises(OptionError, match="EVENTKV_ATTENTION 'fast'") as e:
        resolve_attention(None)
    assert e.value.for_cli().startswith("EVENTKV_ATTENTION 'fast'")
    monkeypatch.delenv(ATTENTION_ENV)
    assert resolve_attention(None) == "auto"
