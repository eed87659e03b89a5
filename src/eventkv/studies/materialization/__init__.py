"""Study 1, "Compute Globally, Materialize Locally": rows of a later event carry state computed from an
earlier event that is no longer served.

- the donor-pair engine (:mod:`~.pairs`) and probe (:mod:`~.donor_pair`);
- the memory contract: trigger bank, landing, access, programmed carriers, served patches, their
  contract rows (:mod:`~.contract_rows`) and the battery and report (:mod:`~.contract`);
- the eviction audit on donor-pair histories (:mod:`~.audit`);
- real dialogue: passive harvesting (:mod:`~.harvest`) and the memory eval on LoCoMo
  (:mod:`~.memory_eval`);
- the study's figures (:mod:`~.figures`).
"""
