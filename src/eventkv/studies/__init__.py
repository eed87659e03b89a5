"""The studies: experiments built on the probe framework (:mod:`eventkv.probes`) and the data path.

- :mod:`eventkv.studies.materialization`: "Compute Globally, Materialize Locally" — donor pairs,
  the memory contract (trigger, landing, access, programmed carriers, served patches), the eviction
  audit, passive harvesting and the memory eval on real dialogue.
- :mod:`eventkv.studies.splice`: "Probing the Prompt KV Cache" — a prompt span's K/V spliced in upper
  layers with a neutral scaffold's, across layer cutoffs and decoding steps.

The product packages (:mod:`eventkv.memory`, :mod:`eventkv.service`, :mod:`eventkv.eviction`, the
data path) import no study; the studies do not import each other.
"""
