"""Global prefill: the second arrow of the data path.

Global prefill runs the header and all events through the model once, causally, with the
log's position ids (Study 1, "Setting"). Every layer's K/V rows are kept — sliding-window
layers included, so that any event can later be served — together with their position ids
and the event span index, as an :class:`eventkv.kv.rows.EventKV`, which saves to disk so one
prefill can answer many later queries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from eventkv.errors import EventKVError
from eventkv.kv.log import TokenizedLog
from eventkv.kv.model import check_context, model_device, model_forward
from eventkv.kv.rows import EventKV, cache_from_rows, cache_kv
from eventkv.options import check_chunk_size

if TYPE_CHECKING:
    from transformers import PreTrainedModel


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
        >>> from eventkv.kv.log import Event, EventLog, tokenize
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
