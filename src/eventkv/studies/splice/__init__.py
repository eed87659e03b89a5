"""Study 2, "Probing the Prompt KV Cache": splice a prompt span's K/V in upper layers with a
neutral scaffold's, zeroed, masked or averaged rows, across layer cutoffs and decoding steps.

Modules: :mod:`~eventkv.studies.splice.engine` (the splice on the serving data path),
:mod:`~eventkv.studies.splice.tasks` (built-in prompt tasks and scoring), :mod:`~eventkv.studies.splice.probe`
(the ``splice`` probe: records, statistics) and :mod:`~eventkv.studies.splice.figures`. The engine's
public names are re-exported here.
"""

from eventkv.studies.splice.engine import (
    ARMS,
    DEFAULT_FILLER,
    TAILS,
    CleanRun,
    Splice,
    SplicePrompt,
    SpliceResult,
    clean_run,
    donor_rows,
    filler_ids,
    layers_from,
    span_masked,
    splice_choice,
    splice_generate,
    splice_sweep,
)

__all__ = [
    "ARMS",
    "DEFAULT_FILLER",
    "TAILS",
    "CleanRun",
    "Splice",
    "SplicePrompt",
    "SpliceResult",
    "clean_run",
    "donor_rows",
    "filler_ids",
    "layers_from",
    "span_masked",
    "splice_choice",
    "splice_generate",
    "splice_sweep",
]
