"""Cache compaction for agents (AKV): which parts of a conversation leave the KV cache.

Front ends describe drops in messages, as AKV's server does (`drop_message`,
`reposition`, `drop_rule`) or by a policy (`--kv-compact keep-last-tool-outputs=K`);
plan.py turns them into the engine's token-span `CacheEdit`s over the prompt it gets,
given where each message's tokens are (spans.py); policy.py holds the policies.
"""

from mlxlocal.compaction.plan import (
           DropPlan,
           PlanError,
           parse_drop_message,
           parse_reposition,
           think_span,
           to_edits,
)
from mlxlocal.compaction.policy import CompactionPolicy, parse_policy

__all__ = ["CompactionPolicy", "DropPlan", "PlanError", "parse_drop_message", "parse_policy", "parse_reposition",
           "think_span", "to_edits"]
