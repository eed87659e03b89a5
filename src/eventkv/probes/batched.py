"""Moved: the batched readout is the one readout implementation, :mod:`eventkv.readout`. These
names stay importable from here for one release."""

from eventkv.readout import Batch, GrowingLayer, Readout, growing_cache, q_len_extra, read_out, stack

__all__ = ["Batch", "GrowingLayer", "Readout", "growing_cache", "q_len_extra", "read_out", "stack"]
