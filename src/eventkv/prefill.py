"""Global prefill and the EventKV store: the second arrow of the data path.

Global prefill runs the header and all events through the model once, causally, with the
log's position ids (Study 1, "Setting"). Every layer's K/V rows are kept — sliding-window
layers included, so that any event can later be served — together with their position ids
and the event span index. An EventKV saves to disk (safetensors + a JSON manifest) so one
prefill can answer many later queries.
"""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin

from eventkv.errors import EventKVError
from eventkv.files import fsync_path, sha256_file
from eventkv.log import HEADER_ID, TokenizedLog
from eventkv.options import check_chunk_size

if TYPE_CHECKING:
    from transformers import PreTrainedModel

LayerRows = torch.Tensor
"""One layer's keys or values: ``[batch, kv_heads, rows, head_dim]`` (batch 1 in an EventKV)."""

EVENTKV_MANIFEST = "eventkv.json"
"""File name of a saved EventKV's JSON manifest (log, spans, weights digest, checksum)."""
EVENTKV_TENSORS = "kv.safetensors"
"""File name of a saved EventKV's rows and positions (safetensors)."""
FORMAT_VERSION = 1


def cache_kwarg(model: PreTrainedModel) -> str:
    """Name of the cache keyword of ``model.forward``: ``cache`` (transformers >= 5.2x) or
    ``past_key_values`` (older 5.x)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def model_device(model: PreTrainedModel) -> torch.device:
    """The device of ``model``'s parameters (``cpu``, ``cuda:0``): where every tensor fed to a forward — token
    ids, position ids, attention masks — is created (``device=`` at creation, never a copy per step)."""
    return next(model.parameters()).device


def layer_types(model: PreTrainedModel) -> tuple[list[str], int | None]:
    """Each decoder layer's attention type (``"full_attention"`` / ``"sliding_attention"``) and the
    sliding window in cache rows (None: no window), from the model's text config."""
    text = model.config.get_text_config(decoder=True)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window is not None else "full_attention"] * int(text.num_hidden_layers)
    return [str(t) for t in types], window


def takes_4d_masks(model: PreTrainedModel) -> bool:
    """Whether the model's attention implementation takes a prepared 4D mask (``sdpa``, ``eager``;
    flash attention takes none)."""
    return model.config.get_text_config(decoder=True)._attn_implementation in ("sdpa", "eager")


def attention_masks(
    model: PreTrainedModel, visible: torch.Tensor, distance: torch.Tensor
) -> torch.Tensor | dict[str, torch.Tensor]:
    """The 4D additive attention mask(s) of a forward whose attention is not plain causal (keys out of
    position order, a tree of branches), as transformers 5 takes them prepared.

    Args:
        visible: ``[batch, q, kv]`` or ``[q, kv]`` bool: which keys (cache rows, then the new tokens) each
            new token may attend to.
        distance: ``[q, kv]`` int64, how many cache rows back each key lies from each new token as an
            unbatched forward would lay them out: a sliding-window layer hides keys ``window`` or more back.

    Returns:
        ``[batch or 1, 1, q, kv]`` float in the model's dtype (0 = attend, the dtype's minimum = masked);
        for a model with sliding-window layers, a dict by layer type (``"full_attention"``,
        ``"sliding_attention"``).

    Raises:
        EventKVError: an attention implementation that takes no 4D mask (flash attention).
    """
    if not takes_4d_masks(model):
        impl = model.config.get_text_config(decoder=True)._attn_implementation
        raise EventKVError(
            f"this forward needs a 4D attention mask, which attention implementation {impl!r} does not take: "
            "load the model with attn_implementation='sdpa' (or 'eager')."
        )
    types, window = layer_types(model)
    dtype = next(model.parameters()).dtype
    if visible.dim() == 2:
        visible = visible.unsqueeze(0)

    def additive(v: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(v.shape, dtype=dtype, device=v.device)
        return out.masked_fill_(~v, torch.finfo(dtype).min).unsqueeze(1)

    full = additive(visible)
    if "sliding_attention" not in types or window is None:
        return full
    return {"full_attention": full, "sliding_attention": additive(visible & (distance < int(window)))}


class _StopForward(Exception):
    """Raised by :func:`forward_until`'s hook: the rest of the forward is not needed."""


@contextmanager
def forward_until(module: torch.nn.Module) -> Iterator[None]:
    """A scope in which a forward ends as soon as ``module`` has run (a forward hook raises an internal
    exception, caught here): what a caller needs from the early layers, without the later ones. The
    forward's logits and cache are then incomplete (the cache holds the layers up to ``module``'s).
    The hook is removed on exit, whatever happens."""

    def stop(*_):
        raise _StopForward

    handle = module.register_forward_hook(stop)
    try:
        yield
    except _StopForward:
        pass
    finally:
        handle.remove()


def model_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: DynamicCache,
    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
    logits_to_keep: int = 0,
) -> torch.Tensor:
    """One forward pass that appends rows to ``cache`` and returns logits.

    Args:
        input_ids: ``[batch, q]`` token ids.
        position_ids: ``[batch, q]`` RoPE position ids (always explicit: the model's default,
            ``arange(q) + rows``, is wrong once rows have been dropped).
        cache: a config-less ``DynamicCache`` (every layer keeps all its rows; sliding-window
            layers get their window from the attention mask, counted in cache rows).
        attention_mask: ``[batch, rows + q]`` bool, indexed by cache row, or None (all visible); or a
            prepared 4D mask ``[batch, 1, q, rows + q]`` (additive float), or a dict of them by layer type
            (``"full_attention"``, ``"sliding_attention"``), which transformers 5 uses as given
            (:func:`eventkv.blend.causal_masks`).
        logits_to_keep: 0 = logits for every query token, k = the last k only.

    Returns:
        logits ``[batch, q or k, vocab]`` (float32).

    Raises:
        EventKVError: the cache's rows are of another dtype or device than the model's.
    """
    rows = check_rows_match(model, cache)
    if attention_mask is None:
        # Why an explicit all-visible mask: our position ids have gaps (position budgets, dropped
        # rows). transformers reads gaps in position ids as packed-sequence boundaries when it is
        # given no mask (5.24 does so only without a cache; other 5.x versions may not wait for
        # that), which would silently cut attention at every gap. With a mask it never guesses.
        b, q = input_ids.shape
        attention_mask = torch.ones(b, rows + q, dtype=torch.bool, device=input_ids.device)
    kwargs = {cache_kwarg(model): cache}
    out = model(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        use_cache=True,
        logits_to_keep=logits_to_keep,
        **kwargs,
    )
    return out.logits.float()


def check_rows_match(model: PreTrainedModel, cache: DynamicCache) -> int:
    """The number of rows in ``cache``, after checking that they have the model's dtype and device.

    Why: torch promotes mixed dtypes silently in some attention kernels (bfloat16 rows under a
    float32 model shifted candidate log-probs by 0.06–0.08 nats on smollm2-135m) and fails with a
    bare error in others; stored rows must be cast on purpose (:meth:`EventKV.to`), never by accident.

    Raises:
        EventKVError: rows of another layout (layers, KV heads, head dim: rows made by another
            model) or of another dtype or device than the model's parameters.
    """
    layer = cache.layers[0] if cache.layers else None
    keys = getattr(layer, "keys", None) if getattr(layer, "is_initialized", False) else None
    if keys is None:
        return 0
    cfg = model.config.get_text_config()
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    want = (cfg.num_hidden_layers, kv_heads, head_dim)
    got = (len(cache.layers), int(keys.shape[1]), int(keys.shape[-1]))
    if got != want:
        raise EventKVError(
            f"the KV rows have {got[0]} layers x {got[1]} KV heads x head dim {got[2]} but the model has "
            f"{want[0]} x {want[1]} x {want[2]}: they were made by another model; prefill again with this one "
            f"(EventKV.load(dir, expect_digest=profile.weights_digest) catches this at load)."
        )
    p = next(model.parameters())
    if keys.dtype != p.dtype or keys.device != p.device:
        kd, pd = str(keys.dtype).removeprefix("torch."), str(p.dtype).removeprefix("torch.")
        raise EventKVError(
            f"the KV rows are {kd} on {keys.device} but the model runs in {pd} on {p.device}: load the model with "
            f"dtype={kd!r} (the rows' dtype), prefill again with this model, or cast the rows on purpose with "
            f"EventKV.to(dtype=torch.{pd}, device={str(p.device)!r})."
        )
    return int(keys.shape[-2])


def cache_kv(cache: Cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's keys and values ``[batch, kv_heads, rows, head_dim]`` in ``cache`` after a forward.

    Raises:
        EventKVError: a layer that holds no keys or values (not a full or sliding-window attention layer, which
            :func:`eventkv.models.introspect.profile_for` refuses before any forward).
    """
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    for layer in cache.layers:
        k, v = (layer.keys, layer.values) if isinstance(layer, CacheLayerMixin) else (None, None)
        if k is None or v is None:
            raise EventKVError(
                f"cache layer {len(keys)} ({type(layer).__name__}) holds no keys and values; eventkv supports only "
                "full and sliding-window attention layers."
            )
        keys.append(k)
        values.append(v)
    return keys, values


def cache_from_rows(keys: Sequence[LayerRows], values: Sequence[LayerRows]) -> DynamicCache:
    """A fresh config-less ``DynamicCache`` holding the given per-layer rows
    (``[batch, kv_heads, rows, head_dim]`` each). Tensors are shared, never written in place."""
    return DynamicCache(ddp_cache_data=list(zip(keys, values)))


def _unshared(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` made contiguous, with every tensor whose memory overlaps an earlier one cloned.

    Why: safetensors' ``save_file`` refuses non-contiguous tensors and tensors whose memory
    overlaps ("Some tensors share memory"); its ``save_model`` would instead drop the duplicate
    names, and those layers would not load back under their own names. Layers sharing one
    tensor (``keys[0] is keys[1]``) are legitimate, so each is written as its own copy; disjoint
    views of one storage are kept as they are (safetensors accepts them). Empty tensors are
    cloned too: safetensors counts an empty view inside another tensor's memory as shared.
    """
    out: dict[str, torch.Tensor] = {}
    taken: list[tuple[torch.device, int, int]] = []
    for name, t in tensors.items():
        t = t.detach().contiguous()
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        if t.numel() == 0 or any(dev == t.device and s < end and start < e for dev, s, e in taken):
            t = t.clone()
            start = t.data_ptr()
            end = start + t.numel() * t.element_size()
        taken.append((t.device, start, end))
        out[name] = t
    return out


def _temp_path(directory: Path, prefix: str, temps: list[Path]) -> Path:
    """A new empty file ``directory/<prefix>XXXX.tmp``, appended to ``temps`` (for clean-up)."""
    fd, name = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=".tmp")
    os.close(fd)
    temps.append(Path(name))
    return temps[-1]


@dataclass
class EventKV:
    """The K/V rows of a globally prefilled event log.

    Attributes:
        log: the TokenizedLog that was prefilled (spans, token ids, position ids).
        keys, values: one tensor per layer, ``[1, kv_heads, rows, head_dim]``, on the device of the
            model that computed them; rows follow the log's row order (header, then events).
        positions: ``[rows]`` int64 on the CPU, the RoPE position id each row was computed at
            (bookkeeping: compared with the log's lists and saved; never fed to a forward).
        weights_digest: digest of the model weights that produced the rows.
        dtype: dtype name of the stored rows.
    """

    log: TokenizedLog
    keys: list[LayerRows]
    values: list[LayerRows]
    positions: torch.Tensor
    weights_digest: str = "unhashed"
    meta: dict = field(default_factory=dict)

    @property
    def n_rows(self) -> int:
        return int(self.positions.shape[0])

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def dtype(self) -> str:
        return str(self.keys[0].dtype).removeprefix("torch.")

    def rows_of(self, event_ids: Sequence[str], include_header: bool = True) -> torch.Tensor:
        """Row indices ``[n]`` (int64 on the CPU, ascending = log order) of the header and the given events;
        move them once to the rows' device to select keys or values.

        Raises:
            EventKVError: an unknown event id.
        """
        spans = [self.log.span(e) for e in event_ids]
        if include_header:
            spans.append(self.log.span(HEADER_ID))
        spans.sort(key=lambda s: s.row_start)
        idx = [r for s in spans for r in range(s.row_start, s.row_end)]
        return torch.tensor(sorted(set(idx)), dtype=torch.long, device="cpu")

    def to(self, dtype: torch.dtype | str | None = None, device: str | torch.device | None = None) -> "EventKV":
        """A copy of this EventKV with its rows cast to ``dtype`` (a floating torch dtype or its name,
        e.g. ``"float32"``) and/or moved to ``device`` — the explicit cast a model of another dtype
        needs. Rows cast from bfloat16 to float32 are *not* what a float32 prefill computes.

        Raises:
            EventKVError: a dtype that is not a floating-point type, or a device torch does not know.
        """
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype, None) if dtype in ("float32", "bfloat16", "float16", "float64") else dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise EventKVError(
                f"EventKV.to(dtype={dtype!r}): give a floating-point dtype, e.g. torch.float32 or 'bfloat16'."
            )
        try:
            device = torch.device(device) if device is not None else None
        except (RuntimeError, TypeError) as exc:
            raise EventKVError(
                f"EventKV.to(device={device!r}): not a torch device ({exc}); use e.g. 'cpu' or 'cuda:0'."
            ) from None
        keys = [k.to(dtype=dtype, device=device) for k in self.keys]
        values = [v.to(dtype=dtype, device=device) for v in self.values]
        return EventKV(self.log, keys, values, self.positions, self.weights_digest, dict(self.meta))

    def nbytes(self) -> int:
        """Bytes held by the K/V tensors (keys + values, all layers)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    # ---------------------------------------------------------------- persistence
    def save(self, directory: str | Path) -> Path:
        """Write ``kv.safetensors`` and the ``eventkv.json`` manifest (model digest, token ids,
        spans, dtype, sha256 of the tensor file) into ``directory``.

        Layers may share storage (``keys[0] is keys[1]``, keys and values as views of one tensor)
        or be non-contiguous views; each is written as its own tensor and loads back bit-exact.
        Both files are written to temporary names in ``directory``, flushed to disk (fsync) and
        moved into place, manifest last, and the directory entry is synced, so a save that
        returned survives a crash and a killed save never leaves a directory that loads as
        something else. A save that raises (a full disk, an interrupt) removes its temporary
        files and leaves an EventKV already in ``directory`` as it was (if only the final directory
        sync fails, the new EventKV is in place and the error is raised). A save killed outright
        may leave ``.kv-*.tmp`` / ``.manifest-*.tmp`` files, which :meth:`load` ignores.

        Returns:
            ``directory`` as a Path.
        """
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tensors = {"positions": self.positions}
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            tensors[f"keys.{i}"], tensors[f"values.{i}"] = k[0], v[0]
        tensors = _unshared(tensors)
        temps: list[Path] = []
        backup: Path | None = None
        replaced = False
        try:
            kv_tmp = _temp_path(d, ".kv-", temps)
            save_file(tensors, kv_tmp)
            fsync_path(kv_tmp)
            manifest = {
                "format": FORMAT_VERSION,
                "weights_digest": self.weights_digest,
                "dtype": self.dtype,
                "n_layers": self.n_layers,
                "n_rows": self.n_rows,
                "history_end": self.log.history_end,
                "tensors_sha256": sha256_file(kv_tmp),
                "log": self.log.to_dict(),
                "spans": [s.__dict__ for s in self.log.spans],
                "meta": self.meta,
            }
            man_tmp = _temp_path(d, ".manifest-", temps)
            with open(man_tmp, "w") as f:
                json.dump(manifest, f)
                f.flush()
                os.fsync(f.fileno())
            if (d / EVENTKV_TENSORS).is_file():
                # A hard link to the old tensor file, so that a failure between the two renames below
                # can put it back next to the old manifest (the old EventKV stays loadable).
                # Without hard links (some network file systems) there is no backup, and such a failure
                # removes the new tensor file instead: the directory then loads as nothing, not as a mix.
                backup = _temp_path(d, ".kv-old-", temps)
                backup.unlink()
                try:
                    os.link(d / EVENTKV_TENSORS, backup)
                except OSError:
                    backup = None
            os.replace(kv_tmp, d / EVENTKV_TENSORS)
            replaced = True
            os.replace(man_tmp, d / EVENTKV_MANIFEST)
            replaced = False
            fsync_path(d)
        except BaseException:
            if replaced and backup is not None:
                os.replace(backup, d / EVENTKV_TENSORS)
            elif replaced:
                (d / EVENTKV_TENSORS).unlink(missing_ok=True)
            for p in temps:
                p.unlink(missing_ok=True)
            raise
        if backup is not None:
            backup.unlink(missing_ok=True)
        return d

    @classmethod
    def load(
        cls,
        directory: str | Path,
        expect_digest: str | None = None,
        verify: bool = True,
        device: str | torch.device = "cpu",
    ) -> "EventKV":
        """Read an EventKV written by :meth:`save`.

        Args:
            expect_digest: if given, the stored weights digest must equal it.
            verify: check the tensor file's sha256 against the manifest.
            device: where the keys and values are read to (the model's device, e.g. from
                :func:`model_device`); the positions always stay on the CPU. Files written on one
                device load on any other.

        Raises:
            EventKVError: missing/partial directory, checksum mismatch, or a different model.
        """
        d = Path(directory)
        if not (d / EVENTKV_MANIFEST).is_file() or not (d / EVENTKV_TENSORS).is_file():
            raise EventKVError(
                f"{str(d)!r} holds no complete EventKV (missing {EVENTKV_MANIFEST} or {EVENTKV_TENSORS}): "
                "prefill again."
            )
        manifest = json.loads((d / EVENTKV_MANIFEST).read_text())
        if verify and sha256_file(d / EVENTKV_TENSORS) != manifest["tensors_sha256"]:
            raise EventKVError(
                f"{str(d / EVENTKV_TENSORS)!r} does not match its manifest checksum (corrupted): delete it and "
                "prefill again."
            )
        if expect_digest is not None and manifest["weights_digest"] != expect_digest:
            raise EventKVError(
                f"the EventKV in {str(d)!r} was made by weights {manifest['weights_digest'][:16]}, not by the model "
                f"given ({expect_digest[:16]}): prefill again with this model."
            )
        n = manifest["n_layers"]
        dev = torch.device(device)
        # the rows are read straight to a CUDA GPU (safetensors reads to the CPU or CUDA; any other device
        # is reached through the CPU); the positions stay on the CPU
        with safe_open(d / EVENTKV_TENSORS, framework="pt", device=str(dev) if dev.type == "cuda" else "cpu") as f:
            keys = [f.get_tensor(f"keys.{i}").unsqueeze(0).to(dev) for i in range(n)]
            values = [f.get_tensor(f"values.{i}").unsqueeze(0).to(dev) for i in range(n)]
        with safe_open(d / EVENTKV_TENSORS, framework="pt", device="cpu") as f:
            positions = f.get_tensor("positions")
        return cls(
            TokenizedLog.from_dict(manifest["log"]),
            keys,
            values,
            positions,
            manifest["weights_digest"],
            manifest.get("meta", {}),
        )


def check_context(n_positions: int, max_context: int | None, what: str = "history") -> None:
    """Raise EventKVError when ``n_positions`` exceeds the model's context (tokens)."""
    if max_context is not None and n_positions > max_context:
        raise EventKVError(
            f"the {what} needs {n_positions} positions but the model's context is {max_context} tokens: "
            f"shorten the log (fewer or shorter events) or use a model with a longer context."
        )


@torch.inference_mode()
def prefill(
    model: PreTrainedModel,
    log: TokenizedLog,
    *,
    chunk_size: int | None = None,
    prefix: EventKV | None = None,
    max_context: int | None = None,
    weights_digest: str = "unhashed",
) -> EventKV:
    """Global prefill of a tokenized log (Study 1, "Setting": header + all events, causally,
    at the log's positions).

    Args:
        model: a Hugging Face causal LM (eval mode).
        log: the TokenizedLog.
        chunk_size: feed at most this many tokens per forward (bounds activation memory on long
            logs; the rows are identical up to float rounding).
        prefix: an EventKV whose rows are the first rows of ``log`` (same token ids and positions),
            e.g. a header-only prefill or the shared part of a donor pair; only the remaining
            rows are computed.
        max_context: the model's context in tokens; a longer history raises.

    Returns:
        EventKV with ``log.n_rows`` rows per layer.

    Raises:
        EventKVError: ``chunk_size`` not a positive int; history longer than the context; a prefix
            that is not a prefix of the log.

    Example (a tiny random model; a real one comes from :func:`eventkv.models.load`):

        >>> from eventkv.testing import tiny_lm
        >>> from eventkv.log import Event, EventLog, tokenize
        >>> lm = tiny_lm("llama")
        >>> events = [Event("a", "register A set to ON"), Event("b", "register B mirrors A")]
        >>> log = tokenize(EventLog(events), lm.tokenizer, lm.profile)
        >>> ekv = prefill(lm.model, log)
        >>> ekv.n_rows == log.n_rows, tuple(ekv.keys[0].shape)  # [batch, kv_heads, rows, head_dim]
        (True, (1, 2, 48, 16))
    """
    check_chunk_size(chunk_size)
    check_context(log.history_end, max_context)
    device = model_device(model)
    ids = torch.tensor([log.input_ids], dtype=torch.long, device=device)
    pos = torch.tensor([log.position_ids], dtype=torch.long, device=device)
    start = 0
    if prefix is not None:
        p = prefix.n_rows
        if (
            p > log.n_rows
            or prefix.log.input_ids[:p] != log.input_ids[:p]
            or prefix.positions.tolist() != log.position_ids[:p]
        ):
            raise EventKVError(
                "the prefix EventKV's rows are not the first rows of this log (token ids or positions differ)."
            )
        cache = cache_from_rows(prefix.keys, prefix.values)
        start = p
    else:
        cache = DynamicCache()
    step = chunk_size or log.n_rows
    for a in range(start, log.n_rows, step):
        b = min(a + step, log.n_rows)
        model_forward(model, ids[:, a:b], pos[:, a:b], cache, logits_to_keep=1)
    keys, values = cache_kv(cache)
    positions = torch.tensor(log.position_ids, dtype=torch.long, device="cpu")  # bookkeeping stays on the CPU
    return EventKV(log, keys, values, positions, weights_digest)
