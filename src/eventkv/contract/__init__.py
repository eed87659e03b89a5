"""The memory contract (Study 1): the battery that runs every contract probe on one model,
resumably (:mod:`~eventkv.contract.battery`), and the report that assembles the probes' own
contract sections into contract.md / contract.json (:mod:`~eventkv.contract.report`)."""
