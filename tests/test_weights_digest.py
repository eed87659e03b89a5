"""A model's weights digest is a digest of its content: a local directory whose layer-0 k/v weights were
rewritten in place (same shapes, same file size, same inode, mtime put back with ``os.utime``) gets
another digest, so a memory store, a run folder and a sweep made with the old weights are refused; the
full-file hashes are cached by each file's stat, so an unchanged file is read once."""

from __future__ import annotations

import os
import re
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
    """Scale layer 0's k_proj and v_proj weights inside ``model.safetensors`` in place (see `rewrite_tensors`)."""
    rewrite_tensors(
        directory / "model.safetensors",
        ("model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"),
        scale,
    )


def rewrite_tensors(path: Path, names: tuple[str, ...], scale: float) -> None:
    """Scale the tensors ``names`` inside the safetensors file ``path``, in place: same tensor names, shapes and
    dtypes (so the same file size), same inode, and the file's mtime put back as it was. Retried until the
    file's ctime moved (a rewrite within the same timestamp tick as the last one keeps it)."""
    before = os.stat(path)
    tensors = {k: v.clone() for k, v in load_file(path).items()}  # copies: the file is rewritten under them
    for name in names:
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
    assert sorted(hashed) == ["config.json", "generation_config.json", "model.safetensors"]
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


# --- every file the loader reads is covered: shards in subfolders, .bin checkpoints, adapters, remote code ---

SUB_SHARD = "sub/model-00002-of-00002.safetensors"
LAYOUTS = ["safetensors", "sharded", "sharded-subfolder", "bin", "sharded-bin-subfolder", "explicit-subfolder"]


def split_checkpoint(directory: Path, first: str, second: str, index: str) -> None:
    """Replace the directory's ``model.safetensors`` by two shards named in the index ``index`` (written here, as
    transformers writes one): the tensors sorted by name, the first half in ``first`` and the rest
    (``model.norm.weight`` among them) in ``second``; a ``.bin`` shard is written with ``torch.save``."""
    import json

    tensors = {k: v.clone() for k, v in load_file(directory / "model.safetensors").items()}
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for shard, part in ((first, names[:half]), (second, names[half:])):
        path = directory / shard
        path.parent.mkdir(parents=True, exist_ok=True)
        chunk = {n: tensors[n] for n in part}
        if shard.endswith(".bin"):
            torch.save(chunk, path)
        else:
            path.write_bytes(save(chunk, metadata={"format": "pt"}))
        weight_map.update(dict.fromkeys(part, shard))
    assert weight_map["model.norm.weight"] == second
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / index).write_text(json.dumps(index_json, indent=2))


def make_layout(directory: Path, layout: str) -> Path:
    """A tiny Llama saved as a model directory in one of `LAYOUTS` (no tokenizer)."""
    import json

    model = tiny_model("llama", vocab_size=VOCAB)
    if layout == "sharded":
        model.save_pretrained(directory, max_shard_size="1MB")
        assert len(list(directory.glob("model-*-of-*.safetensors"))) > 1
        return directory
    model.save_pretrained(directory)
    if layout == "sharded-subfolder":
        split_checkpoint(directory, "model-00001-of-00002.safetensors", SUB_SHARD, "model.safetensors.index.json")
    elif layout == "bin":
        torch.save(load_file(directory / "model.safetensors"), directory / "pytorch_model.bin")
        (directory / "model.safetensors").unlink()
    elif layout == "sharded-bin-subfolder":
        split_checkpoint(
            directory,
            "pytorch_model-00001-of-00002.bin",
            "sub/pytorch_model-00002-of-00002.bin",
            "pytorch_model.bin.index.json",
        )
    elif layout == "explicit-subfolder":  # config.json names its weights file (transformers_weights)
        (directory / "sub").mkdir()
        (directory / "model.safetensors").rename(directory / "sub" / "weights.safetensors")
        config = json.loads((directory / "config.json").read_text())
        config["transformers_weights"] = "sub/weights.safetensors"
        (directory / "config.json").write_text(json.dumps(config))
    else:
        assert layout == "safetensors"
    return directory


_RECORDING: list[set[Path]] = []


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _RECORDING and isinstance(args[0], str | bytes | os.PathLike):
        _RECORDING[-1].add(Path(os.fsdecode(args[0])))


@pytest.fixture()
def opened():
    """``record()``: a context manager giving the set of files opened inside it — Python's own opens (the "open"
    audit event) and the paths handed to safetensors' ``safe_open`` / ``load_file`` and ``torch.load``, wrapped
    wherever a loaded transformers, peft or safetensors module holds them (safetensors opens its files from
    Rust, which the audit hook does not see)."""
    import contextlib
    import sys

    import safetensors
    import safetensors.torch

    if not getattr(sys, "_eventkv_digest_audit", False):  # an audit hook cannot be removed: add it once
        sys.addaudithook(_audit)
        sys._eventkv_digest_audit = True  # type: ignore[attr-defined]

    def recording(real):
        def wrapper(filename, *args, **kwargs):
            if _RECORDING and isinstance(filename, str | os.PathLike):
                _RECORDING[-1].add(Path(filename))
            return real(filename, *args, **kwargs)

        return wrapper

    @contextlib.contextmanager
    def record():
        originals = [safetensors.safe_open, safetensors.torch.load_file, torch.load]
        seen: set[Path] = set()
        with pytest.MonkeyPatch.context() as patch:  # its own: undone on leaving, the test's patches kept
            for module in list(sys.modules.values()):
                name = getattr(module, "__name__", "")
                if not isinstance(name, str) or not name.startswith(("transformers", "peft", "safetensors", "torch")):
                    continue
                for attr, value in list(vars(module).items()):
                    if any(value is real for real in originals):
                        patch.setattr(module, attr, recording(value))
            _RECORDING.append(seen)
            try:
                yield seen
            finally:
                _RECORDING.pop()

    return record


def tokenizer_file_names(tmp_path: Path) -> set[str]:
    """The names of the files a tokenizer's ``save_pretrained`` writes (they have their own digest in a store)."""
    out = tmp_path / "tokenizer-files"
    tiny_tokenizer().save_pretrained(out)
    return {p.name for p in out.iterdir()}


def adapter_layout(models_dir: Path, embedded: bool) -> Path:
    """A LoRA adapter (peft) over a tiny Llama: in the base model's own directory (``embedded``), or alone in a
    directory whose ``adapter_config.json`` names the base directory."""
    import json

    peft = pytest.importorskip("peft")
    base = make_layout(models_dir / "base", "sharded-subfolder")
    model = tiny_model("llama", vocab_size=VOCAB)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    target = base if embedded else models_dir / "adapter"
    lora.save_pretrained(target)
    config = json.loads((target / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(base)
    (target / "adapter_config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("layout", [*LAYOUTS, "adapter", "embedded-adapter"])
def test_every_model_file_the_loader_opens_is_in_the_digest(tmp_path, opened, layout):
    """The files transformers opens while `load_hf` loads a model directory (the tokenizer's files aside) are all
    among `model_files`, whatever the layout."""
    from eventkv.models.readers import load_hf

    models_dir = tmp_path / "models"
    if layout in ("adapter", "embedded-adapter"):
        d = adapter_layout(models_dir, embedded=layout == "embedded-adapter")
    else:
        d = make_layout(models_dir / "m", layout)
    tiny_tokenizer().save_pretrained(d)
    with opened() as seen:
        model, _ = load_hf(str(d), "m", torch.float32, "sdpa")
    assert torch.equal(model.model.norm.weight, torch.ones(64))  # the loader found every shard
    tokenizer_files = tokenizer_file_names(tmp_path)
    read = {
        p.resolve()
        for p in seen
        if p.resolve().is_relative_to(models_dir.resolve()) and p.is_file() and p.name not in tokenizer_files
    }
    assert any(p.suffix in (".safetensors", ".bin") for p in read)  # the recording sees the weight files
    covered = {p.resolve() for p in digest.model_files(d)}
    assert read - covered == set()


def test_a_rewrite_of_a_shard_in_a_subfolder_changes_the_digest_and_the_store_is_refused(tmp_path, settled):
    """A sharded model whose index maps half the tensors to a shard in ``sub/``: scaling ``model.norm.weight``
    there by 1.5 changes the digest, and a memory store made with the old weights is refused."""
    from eventkv.memory import EventMemory

    d = make_layout(tmp_path / "models" / "m", "sharded-subfolder")
    tiny_tokenizer().save_pretrained(d)
    lm = models.load(str(d), dtype="float32")
    assert torch.equal(lm.model.model.norm.weight, torch.ones(64))  # loaded from the sub/ shard
    with EventMemory.create(tmp_path / "store", lm, namespace="t") as mem:
        mem.add(["Dana lives in Lisbon.", "Ravi drinks tea."], prefill=True)
    rewrite_tensors(d / SUB_SHARD, ("model.norm.weight",), 1.5)
    changed = models.load(str(d), dtype="float32")
    assert torch.equal(changed.model.model.norm.weight, torch.full((64,), 1.5))
    assert changed.profile.weights_digest != lm.profile.weights_digest
    with pytest.raises(EventKVError, match=r"was made with weights .* stored KV rows would be stale"):
        EventMemory.open(tmp_path / "store", changed)


def test_the_digest_of_an_unchanged_sharded_subfolder_model_is_stable_and_cached(tmp_path, settled, hashed):
    d = make_layout(tmp_path / "m", "sharded-subfolder")
    names = sorted(p.relative_to(d).as_posix() for p in digest.model_files(d))
    assert names == [
        "config.json",
        "generation_config.json",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        SUB_SHARD,
    ]
    first = digest.directory_digest(d)
    assert sorted(hashed) == sorted(Path(n).name for n in names)
    hashed.clear()
    assert digest.directory_digest(d) == first and hashed == []  # cached: nothing read


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        ("../outside.safetensors", r"points outside the model directory: \.\./outside\.safetensors"),
        ("/tmp/elsewhere.safetensors", r"points outside the model directory: /tmp/elsewhere\.safetensors"),
        ("sub/gone.safetensors", r"names the shard sub/gone\.safetensors, which does not exist"),
    ],
)
def test_an_index_naming_a_shard_outside_the_folder_or_a_missing_one_is_refused(tmp_path, shard, message):
    import json

    d = make_layout(tmp_path / "m" / "model", "sharded-subfolder")
    (tmp_path / "m" / "outside.safetensors").write_bytes((d / SUB_SHARD).read_bytes())
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: shard if v == SUB_SHARD else v for k, v in index["weight_map"].items()}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(EventKVError, match=message):
        digest.directory_digest(d)


@pytest.mark.parametrize(
    ("name", "message"),
    [("../w.safetensors", "points outside the model directory"), ("sub/gone.safetensors", "does not exist")],
)
def test_a_config_naming_a_weights_file_outside_the_folder_or_a_missing_one_is_refused(tmp_path, name, message):
    import json

    d = make_layout(tmp_path / "m" / "model", "explicit-subfolder")
    (d / "sub" / "weights.safetensors").rename(tmp_path / "m" / "w.safetensors")
    config = json.loads((d / "config.json").read_text())
    config["transformers_weights"] = name
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(EventKVError, match=rf"transformers_weights='{re.escape(name)}', which {message}"):
        digest.directory_digest(d)


def test_an_adapter_directory_covers_the_adapter_and_its_base_model(tmp_path, settled):
    """An adapter alone in its directory (``adapter_config.json`` naming the base directory, no ``config.json``):
    its digest covers the adapter's files and every file of the base model, so a rewritten base shard counts."""
    import json

    base = make_layout(tmp_path / "base", "sharded-subfolder")
    a = tmp_path / "adapter"
    a.mkdir()
    (a / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(base)}))
    (a / "adapter_model.safetensors").write_bytes(save({"w": torch.ones(2)}, metadata={"format": "pt"}))
    files = {p.resolve() for p in digest.model_files(a)}
    assert files == {a / "adapter_config.json", a / "adapter_model.safetensors"} | {
        p.resolve() for p in digest.model_files(base)
    }
    first = digest.directory_digest(a)
    rewrite_tensors(base / SUB_SHARD, ("model.norm.weight",), 1.5)
    assert digest.directory_digest(a) != first


def test_remote_code_named_in_auto_map_and_what_it_imports_are_covered(tmp_path, settled):
    import json

    d = make_layout(tmp_path / "m", "safetensors")
    config = json.loads((d / "config.json").read_text())
    config["auto_map"] = {
        "AutoConfig": "configuration_tiny.TinyConfig",
        "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM",
        "AutoTokenizer": ["other/repo--tokenization.Slow", None],  # another repository's code: not in the folder
    }
    (d / "config.json").write_text(json.dumps(config))
    (d / "configuration_tiny.py").write_text("from transformers import LlamaConfig as TinyConfig\n")
    (d / "modeling_tiny.py").write_text("from .layers.helpers import scale\nfrom .common import TinyForCausalLM\n")
    (d / "common.py").write_text("from transformers import LlamaForCausalLM as TinyForCausalLM\n")
    (d / "layers").mkdir()
    (d / "layers" / "helpers.py").write_text("scale = 1.0\n")
    (d / "unrelated.py").write_text("x = 1\n")
    names = {p.relative_to(d).as_posix() for p in digest.model_files(d)}
    assert {"configuration_tiny.py", "modeling_tiny.py", "common.py", "layers/helpers.py"} <= names
    assert "unrelated.py" not in names
    first = digest.directory_digest(d)
    (d / "layers" / "helpers.py").write_text("scale = 1.5\n")
    assert digest.directory_digest(d) != first
