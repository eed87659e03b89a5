"""Study 2, "Probing the Prompt KV Cache": splice a prompt span's K/V in upper layers with a
neutral scaffold's, zeroed, masked or averaged rows, across layer cutoffs and decoding steps.

Modules: :mod:`~eventkv.splice.engine` (the splice on the serving data path),
:mod:`~eventkv.splice.tasks` (built-in prompt tasks and scoring), :mod:`~eventkv.splice.probe`
(the ``splice`` probe: records, statistics) and :mod:`~eventkv.splice.figures`.
"""
