"""The rows of the data path: :class:`EventKV` (every layer's K/V rows of a prefilled log with their
position ids and event spans, saved as safetensors + a JSON manifest), the conversions between
rows and a transformers cache (:func:`cache_kv`, :func:`cache_from_rows`), and the cache layer
the readout decodes into (:class:`GrowingLayer`, built by :func:`growing_cache`, beside the cache it
builds as transformers' own ``CacheLayerMixin`` layers are)."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from eventkv.errors import EventKVError
from eventkv.files import fsync_path, sha256_file
from eventkv.kv.log import HEADER_ID, TokenizedLog

LayerRows = torch.Tensor
"""One layer's keys or values: ``[batch, kv_heads, rows, head_dim]`` (batch 1 in an EventKV)."""

EVENTKV_MANIFEST = "eventkv.json"
"""File name of a saved EventKV's JSON manifest (log, spans, weights digest, checksum)."""
EVENTKV_TENSORS = "kv.safetensors"
"""File name of a saved EventKV's rows and positions (safetensors)."""
FORMAT_VERSION = 1


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


class GrowingLayer(DynamicLayer):
    """A cache layer over a preallocated buffer ``[batch, kv_heads, capacity, head_dim]``: new rows
    are written in place (no ``torch.cat`` of the whole cache per decode step); ``keys`` and
    ``values`` are views of the filled rows. The buffer doubles when full."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        super().__init__()
        b, h, n, d = keys.shape
        cap = max(capacity, n)
        self._k = keys.new_empty(b, h, cap, d)
        self._v = values.new_empty(b, h, cap, values.shape[3])
        self._k[:, :, :n] = keys
        self._v[:, :, :n] = values
        self.n = n
        self.device = keys.device
        self.is_initialized = True
        self._views()

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, n: int) -> "GrowingLayer":
        """A layer over the preallocated buffers ``keys`` / ``values`` ``[batch, kv_heads, capacity,
        head_dim]`` (not copied) whose first ``n`` rows are filled."""
        layer = cls.__new__(cls)
        DynamicLayer.__init__(layer)
        layer._k, layer._v, layer.n, layer.device, layer.is_initialized = keys, values, n, keys.device, True
        layer._views()
        return layer

    def _views(self) -> None:
        self.keys = self._k[:, :, : self.n]
        self.values = self._v[:, :, : self.n]

    def drop(self, n: int) -> None:
        """Forget the last ``n`` rows (their buffer slots are written again by the next update)."""
        self.n -= n
        self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the sequences ``indices`` (``[kept]`` int64, on the layer's device) of the batch axis:
        the buffer is copied, with its capacity (transformers' ``DynamicLayer`` would select the views and
        lose the buffer)."""
        self._k, self._v = self._k.index_select(0, indices), self._v.index_select(0, indices)
        self._views()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        q = key_states.shape[-2]
        if self.n + q > self._k.shape[2]:
            cap = 2 * (self.n + q)
            k, v = (
                self._k.new_empty(*self._k.shape[:2], cap, self._k.shape[3]),
                self._v.new_empty(*self._v.shape[:2], cap, self._v.shape[3]),
            )
            k[:, :, : self.n], v[:, :, : self.n] = self._k[:, :, : self.n], self._v[:, :, : self.n]
            self._k, self._v = k, v
        self._k[:, :, self.n : self.n + q] = key_states
        self._v[:, :, self.n : self.n + q] = value_states
        self.n += q
        self._views()
        return self.keys, self.values


def growing_cache(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], capacity: int) -> DynamicCache:
    """A ``DynamicCache`` whose layers are :class:`GrowingLayer` s holding these rows (copied)."""
    cache = DynamicCache()  # config-less: no layers until given
    cache.layers.extend(GrowingLayer(k, v, capacity) for k, v in zip(keys, values))
    return cache
