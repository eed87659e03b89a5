"""KV rows at rest in fewer bits: KIVI's layout (Liu et al. 2024, "KIVI: A Tuning-Free Asymmetric 2bit Quantization
for KV Cache", arXiv 2402.02750, sections 3-4), for rows a memory stores and serves later.

A row format is one of :data:`ROW_FORMATS`:

* ``native``: the rows as the model computed them (its dtype), bit for bit.
* ``int8`` / ``int4``: asymmetric round-to-nearest quantization with a scale and a minimum per group of
  :data:`GROUP` values, the layout KIVI measured (its section 3.2: key caches have outlier *channels*, value caches
  do not):

  - **keys per channel**: each (KV head, channel) of each run of ``group`` consecutive rows shares one scale and
    minimum (groups along the rows);
  - **values per token**: each (KV head, row) of each run of ``group`` consecutive channels shares one scale and
    minimum (groups along ``head_dim``);
  - **full precision where a key group cannot form**: KIVI keeps the most recent tokens, which do not fill a key
    group yet, in full precision (its "residual", section 4). Stored rows are written once and never rewritten, so
    here the keys of a write's rows that do not fill a whole key group (its last ``rows mod group``) stay native;
    their values, grouped within each row, are quantized like every other row's (a write of one short event still
    stores its values in ``bits``). The instruction header's rows (``native_head``: every served set serves them)
    stay native, keys and values;
  - scales and minima in float16 (KIVI's own kernels keep them in half precision), or in float32 for a layer's
    keys or values of one write that reach past float16's range (:func:`param_dtype`); a value is reconstructed as
    ``minimum + q * scale`` and is within ``scale / 2`` of the original (plus the rounding of the result into the
    native dtype: :func:`error_bound`).

  ``int4`` packs two values per byte (the lower-indexed channel in the low nibble). At ``group`` 32 a value costs
  ``bits + 32 / group`` bits against 16 in bfloat16: ``int8`` 1.78x and ``int4`` 3.2x smaller than bfloat16 rows
  (3.56x and 6.4x than float32), before the native rows.

Why not a library: transformers' ``QuantizedCache`` (``cache_utils.QuantizedLayer``) is a decode-time cache whose
backends (optimum-quanto, HQQ) quantize keys and values along the same axis -- "in contrast to what was described
in the paper", as its docstring says -- and hold backend tensor objects, not a layout a file stores; eventkv needs
the paper's layout as plain tensors a safetensors file holds and a checksum covers.
"""

from __future__ import annotations

from typing import Literal, Sequence, get_args

import torch

from eventkv.errors import OptionError

RowFormat = Literal["native", "int8", "int4"]
#: the row formats a memory stores its rows in
ROW_FORMATS: tuple[str, ...] = get_args(RowFormat)
#: bits per value of each quantized format
BITS = {"int8": 8, "int4": 4}
#: values per scale and minimum (KIVI's group size, section 4)
GROUP = 32
#: the dtype of scales and minima
PARAM_DTYPE = torch.float16


def check_row_format(fmt: object) -> str:
    """``fmt`` if it is one of :data:`ROW_FORMATS`.

    Raises:
        OptionError: anything else (names the value and the choices).
    """
    if not isinstance(fmt, str) or fmt not in ROW_FORMATS:
        raise OptionError(
            "rows",
            fmt,
            "give native (the model's own rows), int8 or int4 (rows quantized as KIVI lays them out: keys per "
            "channel, values per token).",
        )
    return fmt


def value_group(head_dim: int, group: int = GROUP) -> int:
    """The channels per value group for heads of ``head_dim`` channels: ``group``, or the whole head where
    ``head_dim`` is not a multiple of it (small test models)."""
    return group if head_dim % group == 0 else head_dim


def param_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype of the scales and minima of ``x``'s groups: :data:`PARAM_DTYPE`, or float32 where a value of ``x``
    lies past float16's finite range (+-65504), whose minimum float16 would turn into an infinity and every value of
    its group into NaN on reading."""
    if x.numel() and float(x.abs().amax()) > torch.finfo(PARAM_DTYPE).max:
        return torch.float32
    return PARAM_DTYPE


def _params(lo: torch.Tensor, hi: torch.Tensor, bits: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and minimum in ``dtype`` of groups ranging ``[lo, hi]`` (float32). A constant group gets scale 1
    (every value is its minimum)."""
    levels = (1 << bits) - 1
    minimum = lo.to(dtype)
    # rounding into dtype: the minimum must not pass the group's lowest value (it would be clamped, not rounded)
    minimum = torch.where(minimum.float() > lo, torch.nextafter(minimum, torch.full_like(minimum, -torch.inf)), minimum)
    scale = ((hi - minimum.float()) / levels).to(dtype)
    # rounding into dtype: the scale must still reach the group's maximum from the rounded minimum
    short = minimum.float() + scale.float() * levels < hi
    scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, torch.inf)), scale)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, minimum


def _codes(x: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int) -> torch.Tensor:
    levels = (1 << bits) - 1
    return torch.clamp(torch.round((x - minimum.float()) / scale.float()), 0, levels).to(torch.uint8)


def _quantize_along(x: torch.Tensor, dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes, scale and minimum of ``x`` (float32, its groups along ``dim``): codes flattened back to ``[kv_heads,
    rows, head_dim]`` and packed for 4 bits; scale and minimum without ``dim``, in :func:`param_dtype`."""
    scale, minimum = _params(x.amin(dim=dim), x.amax(dim=dim), bits, param_dtype(x))
    # the group axis folded back into the axis it was cut from: rows (keys, dim 2) or channels (values, dim 3)
    codes = _codes(x, scale.unsqueeze(dim), minimum.unsqueeze(dim), bits).flatten(dim - 1, dim)
    return (pack_int4(codes) if bits == 4 else codes), scale, minimum


def _dequantize_along(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dim: int) -> torch.Tensor:
    """``minimum + q * scale`` in float32, ``q``'s groups along ``dim`` (scale and minimum without it)."""
    return q.float() * scale.float().unsqueeze(dim) + minimum.float().unsqueeze(dim)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last axis (even length): ``[..., n]`` uint8 -> ``[..., n // 2]``."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """:func:`pack_int4` undone: ``[..., n // 2]`` uint8 -> ``[..., n]``."""
    out = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def quantize_keys(keys: torch.Tensor, bits: int, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys per channel (KIVI section 3.2): groups of ``group`` consecutive rows per (head, channel).

    Args:
        keys: ``[kv_heads, rows, head_dim]``, ``rows`` a multiple of ``group``.
        bits: 8 or 4.

    Returns:
        ``(codes, scale, minimum)``: codes ``[kv_heads, rows, head_dim]`` uint8 (``head_dim // 2`` packed for 4 bits),
        scale and minimum ``[kv_heads, rows // group, head_dim]``
        float16 (float32 past float16's range: :func:`param_dtype`).
    """
    h, n, d = keys.shape
    return _quantize_along(keys.float().reshape(h, n // group, group, d), 2, bits)


def dequantize_keys(
    codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`quantize_keys` undone: ``[kv_heads, rows, head_dim]`` in ``dtype``."""
    q = unpack_int4(codes) if bits == 4 else codes
    h, n, d = q.shape
    groups = scale.shape[1]
    if groups == 0:  # a write too short to fill one key group
        return torch.empty((h, 0, d), dtype=dtype)
    return _dequantize_along(q.reshape(h, groups, n // groups, d), scale, minimum, 2).reshape(h, n, d).to(dtype)


def quantize_values(
    values: torch.Tensor, bits: int, group: int = GROUP
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Values per token (KIVI section 3.2): groups of :func:`value_group` consecutive channels per (head, row).

    Args:
        values: ``[kv_heads, rows, head_dim]``.
        bits: 8 or 4.

    Returns:
        ``(codes, scale, minimum)``: codes as :func:`quantize_keys`; scale and minimum ``[kv_heads, rows, head_dim //
        value_group]`` float16 (or float32: :func:`param_dtype`).
    """
    h, n, d = values.shape
    g = value_group(d, group)
    return _quantize_along(values.float().reshape(h, n, d // g, g), 3, bits)


def dequantize_values(
    codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`quantize_values` undone: ``[kv_heads, rows, head_dim]`` in ``dtype``."""
    q = unpack_int4(codes) if bits == 4 else codes
    h, n, d = q.shape
    groups = scale.shape[2]
    return _dequantize_along(q.reshape(h, n, groups, d // groups), scale, minimum, 3).reshape(h, n, d).to(dtype)


def split_rows(n_rows: int, native_head: int, group: int = GROUP, kind: str = "keys") -> tuple[int, int]:
    """``(head, quantized)``: a write of ``n_rows`` rows keeps its first ``min(native_head, n_rows)`` rows native
    and quantizes the rest: for ``keys`` (groups along the rows) the next whole groups of ``group`` rows, the last
    ``rows mod group`` staying native; for ``values`` (groups along the channels of each row) every one."""
    head = min(max(native_head, 0), n_rows)
    return head, (n_rows - head) // group * group if kind == "keys" else n_rows - head


def encode_rows(
    keys: Sequence[torch.Tensor],
    values: Sequence[torch.Tensor],
    fmt: str,
    *,
    native_head: int = 0,
    group: int = GROUP,
) -> dict[str, torch.Tensor]:
    """One write's rows in format ``fmt`` as named tensors (the module docstring's layout).

    Args:
        keys, values: per layer ``[kv_heads, rows, head_dim]`` (one dtype).
        fmt: one of :data:`ROW_FORMATS`.
        native_head: the first rows kept native whatever the format (the instruction header's rows in this write).

    Returns:
        ``native``: ``keys.{l}`` / ``values.{l}``. Quantized: per layer ``{keys,values}.{l}.head`` and ``.tail``
        (native rows, possibly 0 of them), ``.codes``, ``.scale``, ``.minimum`` (:func:`quantize_keys`,
        :func:`quantize_values`). All contiguous CPU tensors of their own.

    Raises:
        OptionError: an unknown format; ``int4`` with an odd ``head_dim``.
    """
    check_row_format(fmt)

    def own(t: torch.Tensor) -> torch.Tensor:  # safetensors refuses views that share memory
        return t.detach().to("cpu").clone(memory_format=torch.contiguous_format)

    out: dict[str, torch.Tensor] = {}
    if fmt == "native":
        for i, (k, v) in enumerate(zip(keys, values)):
            out[f"keys.{i}"], out[f"values.{i}"] = own(k), own(v)
        return out
    bits = BITS[fmt]
    for i, (k, v) in enumerate(zip(keys, values)):
        n, d = k.shape[1], k.shape[2]
        if bits == 4 and d % 2:
            raise OptionError("rows", fmt, f"int4 packs two channels per byte: head_dim {d} is odd; use int8.")
        for name, x, quantize in (("keys", k, quantize_keys), ("values", v, quantize_values)):
            head, quantized = split_rows(n, native_head, group, name)
            x = x.detach().to("cpu")
            codes, scale, minimum = quantize(x[:, head : head + quantized], bits, group)
            out[f"{name}.{i}.head"] = own(x[:, :head])
            out[f"{name}.{i}.codes"], out[f"{name}.{i}.scale"], out[f"{name}.{i}.minimum"] = codes, scale, minimum
            out[f"{name}.{i}.tail"] = own(x[:, head + quantized :])
    return out


def decode_rows(
    tensors: dict[str, torch.Tensor], fmt: str, n_layers: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """:func:`encode_rows` undone: per layer keys and values ``[kv_heads, rows, head_dim]`` in the native dtype
    (the dtype of the native rows).

    Raises:
        KeyError: a tensor the format needs is missing (the caller names the damaged file).
        OptionError: an unknown format.
    """
    check_row_format(fmt)
    if fmt == "native":
        return [tensors[f"keys.{i}"] for i in range(n_layers)], [tensors[f"values.{i}"] for i in range(n_layers)]
    bits = BITS[fmt]
    out: dict[str, list[torch.Tensor]] = {"keys": [], "values": []}
    for i in range(n_layers):
        for name, dequantize in (("keys", dequantize_keys), ("values", dequantize_values)):
            head, tail = tensors[f"{name}.{i}.head"], tensors[f"{name}.{i}.tail"]
            codes = tensors[f"{name}.{i}.codes"]
            middle = dequantize(codes, tensors[f"{name}.{i}.scale"], tensors[f"{name}.{i}.minimum"], bits, head.dtype)
            out[name].append(torch.cat((head, middle, tail), dim=1))
    return out["keys"], out["values"]


def error_bound(
    original: torch.Tensor, fmt: str, *, native_head: int = 0, group: int = GROUP, kind: str = "keys"
) -> torch.Tensor:
    """The most each value of ``original`` (``[kv_heads, rows, head_dim]``) may move when written in ``fmt`` and read
    back: 0 for native rows, else half its group's float16 scale, plus four float32 units in the last place at the
    group's magnitude ``|minimum| + levels * scale`` (the arithmetic of the codes and of ``minimum + q * scale``), plus
    half a unit in the last place of the native dtype at the result's magnitude (its rounding into that dtype).
    ``kind``: ``keys`` or ``values`` (which groups apply). Same shape as ``original``, float32."""
    check_row_format(fmt)
    bound = torch.zeros(original.shape, dtype=torch.float32)
    if fmt == "native":
        return bound
    bits = BITS[fmt]
    x = original.detach().to("cpu")
    head, quantized = split_rows(x.shape[1], native_head, group, kind)
    part = x[:, head : head + quantized]
    if kind == "keys":
        _, scale, minimum = quantize_keys(part, bits, group)
        spread = lambda t: t.float().repeat_interleave(group, dim=1)  # noqa: E731 - one use per kind
    else:
        _, scale, minimum = quantize_values(part, bits, group)
        spread = lambda t: t.float().repeat_interleave(value_group(x.shape[2], group), dim=2)  # noqa: E731
    # float32 arithmetic of the codes and of minimum + q * scale: a few units in the last place at the group's size
    magnitude = minimum.float().abs() + scale.float() * ((1 << bits) - 1)
    bound[:, head : head + quantized] = spread(scale.float() / 2 + 4 * torch.finfo(torch.float32).eps * magnitude)
    # the result rounded into the native dtype: half a unit in the last place at its magnitude
    bound += torch.finfo(x.dtype).eps / 2 * (x.float().abs() + bound)
    bound[:, :head] = 0
    bound[:, head + quantized :] = 0
    return bound
