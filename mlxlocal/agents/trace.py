"""The offline inputs of `mlxlocal tools check`: TOOLS.json, TRACE.json and the policy keys of
the MCP configs, read strictly (every problem is a PolicyInputError naming the file and the
field), and the replay of a trace through RuleOfTwo.

TOOLS.json: `[{"server", "name", "description", "inputSchema", "annotations"}, ...]`, ids
"server.name". TRACE.json: `{"steps": [{"tool", "arguments", "result"}, ...],
"attempted_call": {"tool", "arguments"}}`; a step may instead be `{"user_input": TEXT,
"untrusted": true}`: the user pasted text they did not write (it sets [A]).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxlocal.agents.config import McpConfigError, load_configs
from mlxlocal.agents.policy import RuleOfTwo
from mlxlocal.agents.types import Decision, ServerConfig, ToolCall, ToolInfo, ToolResult
from mlxlocal.errors import MlxLocalError

HINTS = ("readOnlyHint", "destructiveHint", "idempotentHint", "openWorldHint")


class PolicyInputError(MlxLocalError):
    """A TOOLS.json / TRACE.json / MCP config problem; the message names the file and field."""


@dataclass(frozen=True)
class Step:
    call: ToolCall | None  # None: a user-input step
    result: str = ""
    untrusted_user_input: bool = False


@dataclass(frozen=True)
class Trace:
    steps: list[Step]
    attempted: ToolCall


def _load_json(path: Path, what: str) -> Any:
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise PolicyInputError(f"{what} {path}: cannot read: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PolicyInputError(f"{what} {path}: not valid JSON: {e}") from None


class _Fields:
    """Typed field access with the file and the JSON path in every error."""

    def __init__(self, path: Path, what: str):
        self.prefix = f"{what} {path}"

    def fail(self, where: str, problem: str) -> PolicyInputError:
        return PolicyInputError(f"{self.prefix}: {where}: {problem}")

    def get(self, obj: dict, key: str, where: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        if key not in obj:
            if default is ...:
                raise self.fail(f"{where}.{key}" if where else key, "missing")
            return default
        value = obj[key]
        # bool is an int in Python; no field here accepts one for the other.
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise self.fail(f"{where}.{key}" if where else key, f"expected {_json_type(names)}, got {type(value).__name__}")
        return value


def _json_type(names: str) -> str:
    return names.replace("dict", "an object").replace("list", "a list").replace("str", "a string").replace("bool", "true/false")


def load_tools_file(path: Path) -> list[ToolInfo]:
    data = _load_json(path, "tools file")
    f = _Fields(path, "tools file")
    if not isinstance(data, list):
        raise f.fail("(top level)", "expected a list of tools")
    tools: list[ToolInfo] = []
    seen: set[str] = set()
    for i, item in enumerate(data):
        where = f"[{i}]"
        if not isinstance(item, dict):
            raise f.fail(where, "expected an object")
        server = f.get(item, "server", where, str)
        name = f.get(item, "name", where, str)
        if not server or not name:
            raise f.fail(where, "server and name must not be empty")
        annotations = f.get(item, "annotations", where, dict, {}) or {}
        for hint in HINTS:
            if hint in annotations and not isinstance(annotations[hint], bool):
                raise f.fail(f"{where}.annotations.{hint}", "expected true/false")
        tool = ToolInfo(server=server, name=name, description=f.get(item, "description", where, str, ""),
                        input_schema=f.get(item, "inputSchema", where, dict, {"type": "object"}),
                        annotations=dict(annotations))
        if tool.id in seen:
            raise f.fail(where, f"duplicate tool {tool.id}")
        seen.add(tool.id)
        tools.append(tool)
    return tools


def _call(f: _Fields, obj: Any, where: str, tools: set[str]) -> ToolCall:
    if not isinstance(obj, dict):
        raise f.fail(where, "expected an object")
    tool = f.get(obj, "tool", where, str)
    if tool not in tools:
        raise f.fail(f"{where}.tool", f"unknown tool {tool!r} (not in the tools file)")
    return ToolCall(tool=tool, arguments=f.get(obj, "arguments", where, dict))


def load_trace_file(path: Path, tool_ids: set[str]) -> Trace:
    data = _load_json(path, "trace file")
    f = _Fields(path, "trace file")
    if not isinstance(data, dict):
        raise f.fail("(top level)", "expected an object with steps and attempted_call")
    steps: list[Step] = []
    for i, item in enumerate(f.get(data, "steps", "", list)):
        where = f"steps[{i}]"
        if isinstance(item, dict) and "user_input" in item and "tool" not in item:
            f.get(item, "user_input", where, str)
            steps.append(Step(None, untrusted_user_input=f.get(item, "untrusted", where, bool, False)))
            continue
        call = _call(f, item, where, tool_ids)
        steps.append(Step(call, result=f.get(item, "result", where, str)))
    return Trace(steps, _call(f, f.get(data, "attempted_call", "", dict), "attempted_call", tool_ids))


def servers_from_configs(paths: list[Path]) -> list[ServerConfig]:
    """The servers of the MCP config files, as the agent loop reads them (config.load_configs);
    for an offline check any problem in them is an error, not a server left out."""
    try:
        servers, problems = load_configs(paths)
    except McpConfigError as e:
        raise PolicyInputError(str(e)) from None
    if problems:
        raise PolicyInputError("; ".join(problems))
    return servers


def load_check_inputs(mcp: list[Path], tools_path: Path, trace_path: Path) -> tuple[RuleOfTwo, Trace]:
    servers = servers_from_configs(mcp)
    tools = load_tools_file(tools_path)
    known = {s.name for s in servers}
    for i, tool in enumerate(tools):
        if tool.server not in known:
            raise PolicyInputError(f"tools file {tools_path}: [{i}].server: {tool.server!r} is not a server of "
                                   f"the MCP config ({', '.join(sorted(known)) or 'none'})")
    return RuleOfTwo(servers, tools), load_trace_file(trace_path, {t.id for t in tools})


def replay(policy: RuleOfTwo, trace: Trace) -> Decision:
    """Record the trace's steps as calls that ran, then judge the attempted call."""
    for step in trace.steps:
        if step.call is None:
            policy.note_user_input(step.untrusted_user_input, "pasted user input")
            continue
        policy.record(step.call, ToolResult(text=step.result))
    return policy.check(trace.attempted)
