"""eventkv: event-structured KV-cache memory for transformer language models."""

from eventkv.errors import EventKVError

__version__ = "0.1.0"

__all__ = ["EventKVError", "__version__"]
