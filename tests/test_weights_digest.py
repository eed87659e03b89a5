"""A model's weights digest is a digest of its content: a local directory whose layer-0 k/v weights were
rewritten in place (same shapes, same file size, same inode, mtime put back with ``os.utime``) gets
another digest, so a memory store, a run folder and a sweep made with the old weights are refused; the
full-file hashes are cached by each file's stat, so an unchanged file is read once."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

import eventkv.models.digest as digest
from eventkv import models
from eventkv.errors import EventKVError
from eventkv.testing import tiny_model, tiny_tokenizer

LATER_NS = 60 * 10**9
VOCAB = 4096  # embeddings of 1 MiB and more: layer 0's k/v weights lie past the file's first MiB


@pytest.fixture(autouse=True)
def cache_root(tmp_path, monkeypatch):
    """Each test has its own digest cache (``EVENTKV_CACHE``)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("EVENTKV_CACHE", str(root))
    return root


@pytest.fixture()
def settled(monkeypatch):
    """Hashes happen a minute after the files were written (fresh files are not cached: see RACY_NS)."""
    import time

    monkeypatch.setattr(digest, "_now_ns", lambda: time.time_ns() + LATER_NS)


@pytest.fixture()
def hashed(monkeypatch):
    """The files the digest code reads in full, in order."""
    seen: list[str] = []
    real = digest.sha256_file

    def counting(path):
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(digest, "sha256_file", counting)
    return seen


def save_model(directory: Path, family: str = "llama") -> Path:
    tiny_model(family, vocab_size=VOCAB).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return directory


def rewrite_layer0_kv(directory: Path, scale: float = 1.5) -> None:
    """Scale layer 0's k_proj and v_proj weights inside ``model.safetensors``, in place: same tensor names,
    shapes and dtypes (so the same file size), same inode, and the file's mtime put back as it was. Retried
    until the file's ctime moved (a rewrite within the same timestamp tick as the last one keeps it)."""
    path = directory / "model.safetensors"
    before = os.stat(path)
    tensors = {k: v.clone() for k, v in load_file(path).items()}  # copies: the file is rewritten under them
    for name in ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"):
        tensors[name] = tensors[name] * scale
    data = save(tensors, metadata={"format": "pt"})
    while True:
        with open(path, "r+b") as f:  # the existing file, rewritten: the same inode
            f.write(data)
            f.truncate()
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        after = os.stat(path)
        if after.st_ctime_ns != before.st_ctime_ns:
            break
    assert (after.st_size, after.st_ino, after.st_mtime_ns) == (before.st_size, before.st_ino, before.st_mtime_ns)


def test_a_same_size_same_mtime_rewrite_of_layer0_kv_changes_the_digest(tmp_path, settled, hashed):
    d = save_model(tmp_path / "m")
    first = digest.directory_digest(d)
    assert sorted(hashed) == ["config.json", "model.safetensors"]
    hashed.clear()
    assert digest.directory_digest(d) == first and hashed == []  # cached: nothing read
    rewrite_layer0_kv(d)
    second = digest.directory_digest(d)
    assert second != first
    assert hashed == ["model.safetensors"]  # the stale entry was not used; config.json still cached
    hashed.clear()
    assert digest.directory_digest(d) == second and hashed == []


def test_load_of_a_local_directory_reports_the_content_digest(tmp_path, settled):
    d = save_model(tmp_path / "m")
    lm = models.load(str(d), dtype="float32")
    assert lm.profile.weights_digest == digest.directory_digest(d)
    rewrite_layer0_kv(d)
    assert models.load(str(d), dtype="float32").profile.weights_digest != lm.profile.weights_digest


def test_a_config_change_changes_the_digest(tmp_path, settled):
    """The rows depend on the config too (RoPE's base here), not only on the weight files."""
    import json

    d = save_model(tmp_path / "m")
    first = models.load(str(d), dtype="float32").profile.weights_digest
    config = json.loads((d / "config.json").read_text())
    config["rope_parameters"]["rope_theta"] *= 2
    (d / "config.json").write_text(json.dumps(config))
    assert models.load(str(d), dtype="float32").profile.weights_digest != first


def test_memory_open_refuses_a_store_made_with_the_old_weights(tmp_path, settled):
    from eventkv.memory import EventMemory

    d = save_model(tmp_path / "m")
    lm = models.load(str(d), dtype="float32")
    with EventMemory.create(tmp_path / "store", lm, namespace="t") as mem:
        mem.add(["Dana lives in Lisbon.", "Ravi drinks tea."], prefill=True)
    EventMemory.open(tmp_path / "store", lm).close()  # the same weights: accepted
    rewrite_layer0_kv(d)
    changed = models.load(str(d), dtype="float32")
    with pytest.raises(EventKVError, match=r"was made with weights .* stored KV rows would be stale"):
        EventMemory.open(tmp_path / "store", changed)


def test_a_run_folder_and_a_sweep_refuse_to_resume_with_changed_weights(tmp_path, settled):
    from probe_fixtures import tiny_tokenizer as word_tokenizer

    from eventkv.probes import get_probe
    from eventkv.probes.base import Runtime
    from eventkv.probes.runner import RECORDS, run_probe
    from eventkv.sweep import SweepOptions, parse_plan, run_sweep

    d = tmp_path / "tinyqwen"
    tiny_model("qwen2", seed=1, vocab_size=VOCAB).save_pretrained(d)
    word_tokenizer().save_pretrained(d)
    access = {"max_new_tokens": 2, "n_events": 8, "source_slots": [2, 3], "root_slot": 5}
    plan = parse_plan(
        {
            "out": f"{tmp_path}/sweep/{{label}}",
            "models": [str(d)],
            "seeds": [0],
            "items": 1,
            "dtype": "float32",
            "threads": 1,
            "probes": [{"probe": "access", "options": access}],
        }
    )

    def run_folder():
        lm = models.load(str(d), dtype="float32")
        probe = get_probe("access")(**access)
        rt = Runtime(lm.model, lm.tokenizer, lm.profile)
        run_probe(probe, rt, model=str(d), items=1, seed=0, out=tmp_path / "run", progress=False, figure=False)

    saved = torch.get_num_threads()
    try:
        run_folder()
        run_sweep(plan, SweepOptions(), figure=False)
        before = (tmp_path / "run" / RECORDS).read_bytes()
        rewrite_layer0_kv(d)
        with pytest.raises(EventKVError, match=r"different settings \(weights_digest: "):
            run_folder()
        with pytest.raises(EventKVError, match=r"1 of 1 run folders refused, nothing computed:.*weights_digest"):
            run_sweep(plan, SweepOptions(), figure=False)
    finally:
        torch.set_num_threads(saved)
    assert (tmp_path / "run" / RECORDS).read_bytes() == before


def test_a_gguf_file_digest_is_cached_and_follows_its_content(tmp_path, settled, hashed):
    f = tmp_path / "w.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 4096)
    first = digest.file_digest(f)
    import hashlib

    assert first == hashlib.sha256(f.read_bytes()).hexdigest()
    assert digest.file_digest(f) == first and hashed == ["w.gguf"]
    mtime = f.stat().st_mtime_ns
    f.write_bytes(b"GGUF" + b"\1" * 4096)  # same size
    os.utime(f, ns=(mtime, mtime))
    assert digest.file_digest(f) == hashlib.sha256(f.read_bytes()).hexdigest() != first


def test_a_replaced_file_is_hashed_again(tmp_path, settled, hashed):
    """A new file renamed over the old one (a new inode) with the old size and mtime."""
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 100)
    first = digest.file_digest(f)
    st = f.stat()
    new = tmp_path / "new.bin"
    new.write_bytes(b"b" * 100)
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, f)
    assert digest.file_digest(f) != first and hashed == ["w.bin", "w.bin"]


def test_fresh_files_are_hashed_every_time(tmp_path, hashed):
    """A file written within RACY_NS of its hash is not cached: a second write in the same timestamp tick
    would leave its stat as it was."""
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 100)
    digest.file_digest(f)
    digest.file_digest(f)
    assert hashed == ["w.bin", "w.bin"]


@pytest.mark.parametrize("damage", [b"", b"{not json", b'{"format": 1, "files": []}', b'{"format": 99}', b"\xff\xfe"])
def test_a_damaged_cache_file_is_ignored_and_rebuilt(tmp_path, cache_root, settled, hashed, damage):
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 100)
    cache_root.mkdir()
    (cache_root / digest.DIGEST_CACHE).write_bytes(damage)
    first = digest.file_digest(f)
    assert hashed == ["w.bin"]
    assert digest.file_digest(f) == first and hashed == ["w.bin"]  # the rebuilt cache serves it


def test_a_read_only_cache_still_gives_the_digest(tmp_path, monkeypatch, settled, hashed):
    monkeypatch.setenv("EVENTKV_CACHE", "/proc/eventkv-not-writable")
    f = tmp_path / "w.bin"
    f.write_bytes(b"a" * 100)
    assert digest.file_digest(f) == digest.file_digest(f) and hashed == ["w.bin", "w.bin"]


def test_a_hub_id_gets_the_digest_of_its_cached_snapshot(tmp_path, monkeypatch, settled):
    """A hub model's digest is its snapshot's content digest (the same as loading that folder directly), so a
    changed snapshot or another revision under the same id is told apart."""
    import huggingface_hub.constants

    import eventkv.models.loading as loading

    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--owner--tiny"
    snapshot = save_model(repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    real = loading.load_hf

    def from_cache(ref, name, dtype, attn):  # what from_pretrained does offline: read the cached snapshot
        model, tok = real(str(snapshot), name, dtype, attn)
        model.config._commit_hash = commit
        return model, tok

    monkeypatch.setattr(loading, "load_hf", from_cache)
    hub = models.load("owner/tiny", dtype="float32").profile.weights_digest
    assert hub == digest.directory_digest(snapshot) != "unhashed"
    rewrite_layer0_kv(snapshot)
    assert models.load("owner/tiny", dtype="float32").profile.weights_digest != hub
