"""eventkv.memory: the sparse event-KV agent memory (Study 1, "compute globally,
materialize locally, serve sparsely"). See ``docs/memory.md``.

    >>> from eventkv.memory import EventMemory, MemoryEvent  # doctest: +SKIP
"""

from eventkv.memory.answer import PreparedQuery, answer_prepared
from eventkv.memory.core import prefill_many
from eventkv.memory.dates import resolve_relative_dates
from eventkv.memory.memory import EventMemory
from eventkv.memory.query import MemoryQuery, QueryOptions
from eventkv.memory.records import Added, CarrierResult, Hit, MemoryAnswer, MemoryEvent, MemoryRecord, MemoryStats

__all__ = [
    "Added",
    "CarrierResult",
    "EventMemory",
    "Hit",
    "MemoryAnswer",
    "MemoryEvent",
    "MemoryQuery",
    "MemoryRecord",
    "MemoryStats",
    "PreparedQuery",
    "QueryOptions",
    "answer_prepared",
    "prefill_many",
    "resolve_relative_dates",
]
