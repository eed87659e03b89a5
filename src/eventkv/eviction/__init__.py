"""eventkv.eviction: KV-cache eviction policies written from their papers, scored on our real
position ids, and the per-(layer, head) keep masks they produce — every policy class importable from here
(the scoring rules of :mod:`~eventkv.eviction.scorers`, the budgets and compositions of
:mod:`~eventkv.eviction.budgets`). See ``docs/eviction.md``."""

from eventkv.eviction.budgets import (
    AdaKV,
    ChunkKV,
    Composed,
    CriticalAdaKV,
    CriticalKV,
    DuoAttention,
    PerLayer,
    PerLayerRatio,
    PyramidKV,
    SimLayerKV,
)
from eventkv.eviction.policies import (
    EventTopK,
    ExpectedAttention,
    Knorm,
    LayerCapture,
    Policy,
    Random,
    SnapKV,
    StreamingLLM,
    Tova,
    UserPolicy,
    keep_mask,
    kept_count,
)
from eventkv.eviction.scorers import Finch, KeyDiff, KVzip, LagKV, ObservedAttention, QFilter, ThinK
from eventkv.eviction.specs import POLICIES, make_policy, parse_policy_spec, policy_from_spec, split_policy_specs

__all__ = [
    "POLICIES",
    "AdaKV",
    "ChunkKV",
    "Composed",
    "CriticalAdaKV",
    "CriticalKV",
    "DuoAttention",
    "Finch",
    "KVzip",
    "KeyDiff",
    "LagKV",
    "ObservedAttention",
    "PerLayer",
    "PerLayerRatio",
    "PyramidKV",
    "QFilter",
    "SimLayerKV",
    "ThinK",
    "UserPolicy",
    "EventTopK",
    "ExpectedAttention",
    "Knorm",
    "LayerCapture",
    "Policy",
    "Random",
    "SnapKV",
    "StreamingLLM",
    "Tova",
    "keep_mask",
    "kept_count",
    "make_policy",
    "parse_policy_spec",
    "policy_from_spec",
    "split_policy_specs",
]
