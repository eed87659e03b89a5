"""The linear layers' kernel (`eventkv.models.kernels`): oneDNN for float32 models on a CPU, the same
logits as torch's own within float32 rounding, and torch's own wherever oneDNN cannot serve."""

from __future__ import annotations

import copy

import pytest
import torch

from eventkv.errors import OptionError
from eventkv.models.kernels import LINEAR_ENV, linear_kernel, resolve_linear, use_linear
from eventkv.testing import TINY_FAMILIES, tiny_model

TOL = 1e-5  # measured: at most 2e-6 on these tiny models (AVX2 and AVX-512 kernels)


def _logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


def _linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_onednn_linears_give_torchs_logits(family):
    model = tiny_model(family)
    ids = torch.randint(0, 300, (3, 17), generator=torch.Generator().manual_seed(1))
    want = _logits(model, ids)
    kernel, reason = use_linear(model, "auto")
    assert kernel == "onednn", reason  # every CPU torch wheel has oneDNN
    assert all("forward" in m.__dict__ for m in _linears(model))
    got = _logits(model, ids)
    assert (got - want).abs().max().item() < TOL
    assert use_linear(model, "torch") == ("torch", "requested")
    assert not any("forward" in m.__dict__ for m in _linears(model))
    assert torch.equal(_logits(model, ids), want)  # torch's own again, bit for bit


def test_other_dtypes_keep_torchs_kernels():
    model = tiny_model("llama", dtype=torch.bfloat16)
    kernel, reason = linear_kernel(model, "onednn")
    assert kernel == "torch" and "bfloat16" in reason


def test_a_copy_in_float64_and_a_call_with_gradients_use_f_linear():
    model = tiny_model("qwen2")
    use_linear(model, "auto")
    ids = torch.tensor([[5, 6, 7, 8]])
    m64 = copy.deepcopy(model).double()  # the copied forward is bound to the copy, which falls back
    ref = _logits(m64, ids)
    assert (ref.float() - _logits(model, ids)).abs().max().item() < 1e-4
    out = model(input_ids=ids, use_cache=False).logits.sum()  # gradients on: F.linear, which has a backward
    out.backward()
    assert model.lm_head.weight.grad is not None


def test_hooks_on_a_linear_still_run():
    model = tiny_model("llama")
    use_linear(model, "auto")
    seen = []
    model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, a, o: seen.append(tuple(o.shape)))
    _logits(model, torch.tensor([[1, 2, 3]]))
    assert seen == [(1, 3, 64)]


def test_a_bad_choice_is_named(monkeypatch):
    with pytest.raises(OptionError, match="linear 'mkl': use one of auto, onednn, torch"):
        resolve_linear("mkl")
    monkeypatch.setenv(LINEAR_ENV, "fast")
    with pytest.raises(OptionError, match="EVENTKV_LINEAR 'fast'") as e:
        resolve_linear(None)
    assert e.value.for_cli().startswith("EVENTKV_LINEAR 'fast'")
    monkeypatch.setenv(LINEAR_ENV, "torch")
    assert resolve_linear(None) == "torch"
    monkeypatch.delenv(LINEAR_ENV)
    assert resolve_linear(None) == "auto"


def test_the_reason_says_where_the_choice_came_from(monkeypatch):
    monkeypatch.setenv(LINEAR_ENV, "torch")
    assert use_linear(tiny_model("llama")) == ("torch", "requested (EVENTKV_LINEAR)")
    bf16 = tiny_model("llama", dtype=torch.bfloat16)
    assert (
        linear_kernel(bf16, "onednn")[1]
        == "bfloat16 on cpu: torch's own kernels (oneDNN linears are for float32 on a CPU)"
    )


def test_load_names_the_environment_when_it_chose(tiny_dir, monkeypatch):
    from eventkv.models import load

    monkeypatch.setenv(LINEAR_ENV, "torch")
    profile = load(str(tiny_dir), dtype="float32", device="cpu").profile
    assert (profile.linear_kernel, profile.linear_reason) == ("torch", "requested (EVENTKV_LINEAR)")
    monkeypatch.delenv(LINEAR_ENV)
    profile = load(str(tiny_dir), dtype="float32", device="cpu", linear="torch").profile
    assert (profile.linear_kernel, profile.linear_reason) == ("torch", "requested")
