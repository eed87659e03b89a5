"""The donor-pair engine: donor pairs with one or several histories and many arms.

The donor-pair probe (:mod:`eventkv.studies.materialization.donor_pair`, Study 1, "Donor pair") answers one
history layout with fixed arms. The contract probes (Study 1, "The memory contract", "Programmed
carriers", "Updates") need the same unit of evidence — two variants identical except for what an
unserved event wrote — over *several* histories per item (e.g. with and without a carrier), with arms that serve any
roles, mix rows of the two variants (the landing factorial), or answer with the query at a fixed
absolute position. This package is the one donor-pair engine under all of them, the donor-pair
probe included, by job:

* :mod:`.scoring` — a pair's outcome (:func:`outcome`) and donor statistic (:func:`donor_d`);
* :mod:`.arms` — the arms (:class:`PairArm`) and which events they read;
* :mod:`.prefill` — the two variants of a history with shared positions (:func:`tokenize_pair`)
  and prefills that share their common prefix (:class:`PrefillCache`);
* :mod:`.serve` — each arm's served cache (:func:`serve_mixed` for swapped rows);
* :mod:`.engine` — :func:`run_pairs` / :func:`run_pair`: tokenize, prefill in batched rounds,
  serve, one batched readout, and every arm scored as a donor pair;
* :mod:`.probe` — the layout options the pair probes share (:class:`PairLayout`) and the probe
  base (:class:`PairProbe`), whose items run in two phases: each item's :class:`PairRequest`,
  one engine call over every request of a batch, then each item's record from its
  :class:`PairRun` (:func:`pair_record`);
* :mod:`.tables` — the donor-pair statistics and tables of a summary (:func:`outcome_tables`).

An item (a JSON-able dict built by the probe, deterministic in ``(seed, index)``) holds:

* ``values``: ``[a, b]`` — what variant A's and variant B's donor wrote (the gold answers);
* ``histories``: ``{name: [events_A, events_B]}`` — event texts per variant;
* ``roles``: ``{name: {role: slot}}`` — which slot plays which role in that history;
* ``pad``: optional ``{name: {slot: [texts]}}`` — alternative texts whose longest tokenization
  sets that slot's position budget (so positions do not depend on which alternative was used);
* ``questions``: ``{name: text}``;
* ``candidates``: candidate answer texts for the logit readout, and ``gold_candidates``: the
  candidates that stand for ``a`` and ``b`` (usually the values themselves).

Positions. Within a history, every slot whose tokens differ between the variants gets a position
budget equal to the longer tokenization, so every later event — and the query — sits at the same
positions in both variants. An arm with ``fixed_position`` asks its question at position ``P`` =
the largest ``history_end`` over the item's histories, the same for every such arm of the item
(the position control of Study 1: the query's absolute position does not vary across arms).
"""

from eventkv.studies.materialization.pairs.arms import PairArm, event_id, events_read, served_ids
from eventkv.studies.materialization.pairs.engine import PairRequest, PairRun, run_pair, run_pairs
from eventkv.studies.materialization.pairs.prefill import PrefillCache, leading_log, shared_log, tokenize_pair
from eventkv.studies.materialization.pairs.probe import (
    READOUT_OPTIONS,
    PairLayout,
    PairProbe,
    pair_record,
    variant_events,
)
from eventkv.studies.materialization.pairs.scoring import (
    OUTCOME_COLUMNS,
    OUTCOMES,
    VARIANTS,
    candidate_share,
    correct,
    donor_d,
    log_odds,
    outcome,
)
from eventkv.studies.materialization.pairs.serve import (
    encode_isolated,
    isolated_events,
    leading_rows,
    serve_arm,
    serve_mixed,
)
from eventkv.studies.materialization.pairs.tables import (
    D_CAPTION,
    arm_table,
    d_stats,
    d_table,
    describe_d,
    outcome_tables,
    pair_stats,
    primary_readout,
)

__all__ = [
    "D_CAPTION",
    "OUTCOMES",
    "OUTCOME_COLUMNS",
    "PairArm",
    "PairLayout",
    "PairProbe",
    "PairRequest",
    "PairRun",
    "PrefillCache",
    "READOUT_OPTIONS",
    "VARIANTS",
    "arm_table",
    "candidate_share",
    "correct",
    "d_stats",
    "d_table",
    "describe_d",
    "donor_d",
    "encode_isolated",
    "event_id",
    "events_read",
    "isolated_events",
    "leading_log",
    "leading_rows",
    "log_odds",
    "outcome",
    "outcome_tables",
    "pair_record",
    "pair_stats",
    "primary_readout",
    "run_pair",
    "run_pairs",
    "serve_arm",
    "serve_mixed",
    "served_ids",
    "shared_log",
    "tokenize_pair",
    "variant_events",
]
