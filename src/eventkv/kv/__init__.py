"""The data path: an event log is tokenized (:mod:`~eventkv.kv.log`), prefilled once
(:mod:`~eventkv.kv.prefill`, windowed past the context by :mod:`~eventkv.kv.windowed`, many logs
at once by :mod:`~eventkv.kv.batched`) into rows (:mod:`~eventkv.kv.rows`), served for a query
(:mod:`~eventkv.kv.serve`; RoPE re-rotation :mod:`~eventkv.kv.rope`, selective recompute
:mod:`~eventkv.kv.blend`) and read out (:mod:`~eventkv.kv.readout`, decoding settings
:mod:`~eventkv.kv.decoding`); :mod:`~eventkv.kv.query` runs the whole path for one question, and
:mod:`~eventkv.kv.model` is the adapter every forward goes through. The modules are imported by
their own names; this package re-exports nothing."""
