"""The memory contract (Study 1): the battery that runs every contract probe on one model,
resumably (:mod:`~eventkv.studies.materialization.contract.battery`), and the report that assembles the probes' own
contract sections into contract.md / contract.json (:mod:`~eventkv.studies.materialization.contract.report`). The main
names are re-exported here (``from eventkv.studies.materialization.contract import run_contract`` keeps working from
when the battery was the module ``eventkv.studies.materialization.contract``)."""

from eventkv.studies.materialization.contract.battery import Step, plan, provenance, run_contract
from eventkv.studies.materialization.contract.report import CONTRACT_PROBES, contract_sections, write_contract

__all__ = ["CONTRACT_PROBES", "Step", "contract_sections", "plan", "provenance", "run_contract", "write_contract"]
