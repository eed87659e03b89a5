"""eventkv.memory: the sparse event-KV agent memory (issue 11; Study 1, "compute globally,
materialize locally, serve sparsely"). See ``docs/memory.md``.

    >>> from eventkv.memory import EventMemory, MemoryEvent  # doctest: +SKIP
"""

from eventkv.memory.memory import EventMemory
from eventkv.memory.records import Added, MemoryAnswer, MemoryEvent, MemoryRecord, MemoryStats

__all__ = ["Added", "EventMemory", "MemoryAnswer", "MemoryEvent", "MemoryRecord", "MemoryStats"]
