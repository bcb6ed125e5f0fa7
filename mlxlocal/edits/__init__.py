"""Cache edits: which tokens leave the KV cache or move, planned by message.

Front ends describe edits in messages, as AKV's protocol does (`drop_message`,
`reposition`, `drop_rule`) or by a policy (`--kv-compact keep-last-tool-outputs=K`);
plan.py turns them into the engine's token-span `CacheEdit`s over the prompt it gets,
given where each message's tokens are (spans.py); policy.py holds the policies.
The engine applies them through `CacheEdit`.
"""

from mlxlocal.edits.plan import (
           DropPlan,
           PlanError,
           parse_drop_message,
           parse_reposition,
           think_span,
           to_edits,
)
from mlxlocal.edits.policy import CompactionPolicy, parse_policy

__all__ = ["CompactionPolicy", "DropPlan", "PlanError", "parse_drop_message", "parse_policy", "parse_reposition",
           "think_span", "to_edits"]
