"""eventkv.eviction: KV-cache eviction policies written from their papers, scored on our real
position ids, and the per-(layer, head) keep masks they produce. See
``docs/eviction.md``."""

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
from eventkv.eviction.specs import POLICIES, make_policy, parse_policy_spec, policy_from_spec, split_policy_specs

__all__ = [
    "POLICIES",
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
