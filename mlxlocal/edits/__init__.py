"""Cache edits: which tokens leave the KV cache or move, planned by message.

Front ends describe edits in messages, as AKV's protocol does (`drop_message`,
`reposition`, `drop_rule`) or by a policy (`--kv-compact keep-last-tool-outputs=K`);
plan.py turns them into the engine's token-span `CacheEdit`s over the prompt it gets,
given where each message's tokens are (spans.py); policy.py holds the policies.
The engine applies them through `CacheEdit`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxlocal.edits.plan import (
        DropPlan,
        PlanError,
        parse_drop_message,
        parse_reposition,
        think_span,
        to_edits,
    )
    from mlxlocal.edits.policy import CompactionPolicy, parse_policy

# Loaded on first use: the CLI reads policy.py's help text without the engine behind plan.py.
_HOME = {"DropPlan": "plan", "PlanError": "plan", "parse_drop_message": "plan", "parse_reposition": "plan",
         "think_span": "plan", "to_edits": "plan", "CompactionPolicy": "policy", "parse_policy": "policy"}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)


__all__ = ["CompactionPolicy", "DropPlan", "PlanError", "parse_drop_message", "parse_policy", "parse_reposition",
           "think_span", "to_edits"]
