"""eventkv.memory: the sparse event-KV agent memory (Study 1, "compute globally,
materialize locally, serve sparsely"). See ``docs/memory.md``.

    >>> from eventkv.memory import EventMemory, MemoryEvent  # doctest: +SKIP
"""

from eventkv.memory.memory import EventMemory
from eventkv.memory.records import Added, CarrierResult, MemoryAnswer, MemoryEvent, MemoryRecord, MemoryStats

__all__ = [
    "Added",
    "CarrierResult",
    "Client",
    "EventMemory",
    "MemoryAnswer",
    "MemoryEvent",
    "MemoryRecord",
    "MemoryStats",
]


def __getattr__(name: str):
    if name == "Client":  # the HTTP client needs httpx (the server extra): imported on first use
        from eventkv.memory.client import Client

        return Client
    raise AttributeError(f"module 'eventkv.memory' has no attribute {name!r}")
