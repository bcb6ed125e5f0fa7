"""MCP client config files -> ServerConfig.

The shape is the one users already have (Claude Desktop, Claude Code, Cursor):

    {"mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "${HOME}/notes"],
                  "env": {"TOKEN": "${TOKEN:-none}"}, "cwd": "."},
        "web": {"type": "http", "url": "https://example.com/mcp", "headers": {"Authorization": "Bearer ${KEY}"}}
    }}

plus our per-server keys: "trust": "trusted" | "untrusted", "sensitive": bool,
"tools": {"allow": [...], "deny": [...]} and "policy": {TOOL: {FLAG: bool}} (FLAG one of
untrusted_output, sensitive, state_change, destructive: overrides of what the Rule-of-Two
policy derives from the tool's annotations).

A file that cannot be used at all (missing, not JSON, no "mcpServers" object) raises
McpConfigError; a bad server entry only costs that server: load_configs returns it as a
problem message and keeps the others, so one typo does not take every tool away.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from mlxlocal.agents.types import ServerConfig
from mlxlocal.errors import MlxLocalError

POLICY_FLAGS = ("untrusted_output", "sensitive", "state_change", "destructive")
# "disabled" is Cline's and Claude Code's way to keep an entry without starting it.
SERVER_KEYS = {"type", "command", "args", "env", "cwd", "url", "headers", "trust", "sensitive", "tools",
               "policy", "disabled"}
STDIO_KEYS = {"command", "args", "env", "cwd"}
HTTP_KEYS = {"url", "headers"}
HTTP_TYPES = ("http", "streamable-http", "streamableHttp")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class McpConfigError(MlxLocalError):
    """An MCP config file or server entry that cannot be used; the message names the file
    and, where one is at fault, the server."""


class _EntryError(Exception):
    """One server entry is bad; turned into a problem message naming file and server."""


def load_configs(paths: list[Path], environ: dict[str, str] | None = None) -> tuple[list[ServerConfig], list[str]]:
    """Read every file (the order of `--mcp` options) into server configs.

    Returns (servers, problems): problems are one-line messages for the entries that were
    dropped (bad entry, unset variable, a name another file already uses). Raises
    McpConfigError only when a file as a whole is unusable. `environ` defaults to the
    process environment (the source of `${VAR}` values)."""
    environ = dict(os.environ) if environ is None else environ
    servers: list[ServerConfig] = []
    problems: list[str] = []
    seen: dict[str, str] = {}  # server name -> the file that defined it first
    read: set[Path] = set()
    for path in paths:
        if Path(path).resolve() in read:  # the same file twice is one config, not duplicates
            continue
        read.add(Path(path).resolve())
        for name, entry in _read_file(Path(path), problems):
            source = str(path)
            if name in seen:
                # Which of the two the user meant is unknowable; keep the first (earlier --mcp)
                # and say so, rather than silently letting one shadow the other.
                problems.append(f"{source}: server {name!r} is also defined in {seen[name]}; "
                                f"keeping the one from {seen[name]}")
                continue
            try:
                config = _server(name, entry, source, Path(path).parent, environ)
            except _EntryError as exc:
                problems.append(f"{source}: server {name!r}: {exc}")
                continue
            seen[name] = source
            if config is not None:
                servers.append(config)
    return servers, problems


def _read_file(path: Path, problems: list[str]) -> list[tuple[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise McpConfigError(f"MCP config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise McpConfigError(f"MCP config {path}: cannot read it ({exc})") from None
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        # json.loads keeps the last of two equal keys without a word; keeping the pairs
        # lets a server defined twice in one file (a copy-paste slip) be reported.
        return {"__pairs__": items}

    try:
        data = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as exc:
        raise McpConfigError(f"MCP config {path}: not valid JSON ({exc.msg} at line {exc.lineno} "
                             f"column {exc.colno})") from None
    top = _plain(data)
    if not isinstance(top, dict):
        raise McpConfigError(f"MCP config {path}: the file must hold a JSON object with \"mcpServers\"")
    # Other top-level keys are allowed: Claude Desktop's and Claude Code's files hold app
    # settings next to "mcpServers", and users point --mcp at those files as they are.
    if "mcpServers" not in top:
        raise McpConfigError(f"MCP config {path}: no \"mcpServers\" object (keys found: "
                             f"{', '.join(map(repr, top)) or 'none'})")
    raw_servers = dict(data["__pairs__"])["mcpServers"]
    if not isinstance(raw_servers, dict) or "__pairs__" not in raw_servers:
        raise McpConfigError(f"MCP config {path}: \"mcpServers\" must be an object of server entries")
    entries: list[tuple[str, Any]] = []
    names: set[str] = set()
    for name, entry in raw_servers["__pairs__"]:
        if name in names:
            problems.append(f"{path}: server {name!r} is defined twice in this file; keeping the first")
            continue
        names.add(name)
        entries.append((name, _plain(entry)))
    return entries


def _plain(value: Any) -> Any:
    """Undo the pairs hook: nested dicts back to plain dicts (last key wins below the
    server level, as in json.loads; duplicates there are not worth an error)."""
    if isinstance(value, dict) and "__pairs__" in value:
        return {k: _plain(v) for k, v in value["__pairs__"]}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _server(name: str, entry: Any, source: str, base: Path, environ: dict[str, str]) -> ServerConfig | None:
    if not name or not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        # Tool ids are "server.name" and become model-visible function names: keep the
        # server part to characters every chat template and tool parser accepts.
        raise _EntryError("server names may use only letters, digits, '_' and '-'")
    if not isinstance(entry, dict):
        raise _EntryError(f"must be an object, not {_kind(entry)}")
    unknown = sorted(set(entry) - SERVER_KEYS)
    if unknown:
        raise _EntryError(f"unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} "
                          f"(known: {', '.join(sorted(SERVER_KEYS))})")
    if _bool(entry, "disabled", False):
        return None
    kind = entry.get("type")
    if kind is not None and not isinstance(kind, str):
        raise _EntryError(f"\"type\" must be a string, not {_kind(kind)}")
    if kind == "sse":
        raise _EntryError("transport \"sse\" (the old HTTP+SSE transport, deprecated by MCP) is not "
                          "supported; use the server's Streamable HTTP endpoint with \"type\": \"http\"")
    if kind not in (None, "stdio", *HTTP_TYPES):
        raise _EntryError(f"unknown \"type\" {kind!r} (use \"stdio\" or \"http\")")
    has_command, has_url = "command" in entry, "url" in entry
    if has_command and has_url:
        raise _EntryError("give either \"command\" (stdio) or \"url\" (Streamable HTTP), not both")
    if not has_command and not has_url:
        raise _EntryError("needs \"command\" (a stdio server) or \"url\" (a Streamable HTTP server)")
    if kind == "stdio" and not has_command:
        raise _EntryError("\"type\": \"stdio\" needs \"command\"")
    if kind in HTTP_TYPES and not has_url:
        raise _EntryError(f"\"type\": {kind!r} needs \"url\"")
    wrong = sorted(set(entry) & (HTTP_KEYS if has_command else STDIO_KEYS))
    if wrong:
        raise _EntryError(f"{', '.join(map(repr, wrong))} do not apply to a "
                          f"{'stdio' if has_command else 'Streamable HTTP'} server")

    def expand(value: str, where: str) -> str:
        def one(match: re.Match) -> str:
            var, default = match.group(1), match.group(2)
            # Shell semantics for ":-": the default also replaces an empty value.
            if environ.get(var):
                return environ[var]
            if default is not None:
                return default
            if var in environ:
                return ""
            raise _EntryError(f"{where}: environment variable {var} is not set (write ${{{var}:-default}} "
                              f"for a fallback)")
        return _VAR.sub(one, value)

    fields: dict[str, Any] = {}
    if has_command:
        fields["command"] = expand(_str(entry, "command"), "command")
        if not fields["command"]:
            raise _EntryError("\"command\" is empty")
        args = entry.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise _EntryError("\"args\" must be a list of strings")
        fields["args"] = tuple(expand(a, f"args[{i}]") for i, a in enumerate(args))
        if "env" in entry:
            fields["env"] = {k: expand(v, f"env.{k}") for k, v in _str_map(entry, "env").items()}
        if "cwd" in entry:
            cwd = Path(expand(_str(entry, "cwd"), "cwd")).expanduser()
            # Relative to the config file, so a config works wherever mlxlocal is started.
            fields["cwd"] = str(cwd if cwd.is_absolute() else (base / cwd).resolve())
    else:
        url = expand(_str(entry, "url"), "url")
        if not re.match(r"https?://[^/\s]+", url):
            raise _EntryError(f"\"url\" must be an http:// or https:// URL, not {url!r}")
        fields["url"] = url
        if "headers" in entry:
            fields["headers"] = {k: expand(v, f"headers.{k}") for k, v in _str_map(entry, "headers").items()}

    trust = entry.get("trust", "trusted")
    if trust not in ("trusted", "untrusted"):
        raise _EntryError(f"\"trust\" must be \"trusted\" or \"untrusted\", not {trust!r}")
    allow, deny = _tool_filter(entry.get("tools"))
    return ServerConfig(name=name, source=source, trust=trust, sensitive=_bool(entry, "sensitive", False),
                        allow=allow, deny=deny, tool_policy=_policy(entry.get("policy")), **fields)


def _tool_filter(tools: Any) -> tuple[tuple[str, ...] | None, tuple[str, ...]]:
    if tools is None:
        return None, ()
    if not isinstance(tools, dict):
        raise _EntryError(f"\"tools\" must be an object with \"allow\" and/or \"deny\", not {_kind(tools)}")
    unknown = sorted(set(tools) - {"allow", "deny"})
    if unknown:
        raise _EntryError(f"unknown key {unknown[0]!r} in \"tools\" (known: allow, deny)")
    lists = {}
    for key in ("allow", "deny"):
        value = tools.get(key)
        if value is not None and (not isinstance(value, list) or not all(isinstance(t, str) for t in value)):
            raise _EntryError(f"\"tools.{key}\" must be a list of tool names")
        lists[key] = value
    return (tuple(lists["allow"]) if lists["allow"] is not None else None), tuple(lists["deny"] or ())


def _policy(policy: Any) -> dict[str, dict[str, bool]]:
    if policy is None:
        return {}
    if not isinstance(policy, dict):
        raise _EntryError(f"\"policy\" must be an object {{TOOL: {{FLAG: bool}}}}, not {_kind(policy)}")
    out: dict[str, dict[str, bool]] = {}
    for tool, flags in policy.items():
        if not isinstance(flags, dict):
            raise _EntryError(f"\"policy.{tool}\" must be an object of flags, not {_kind(flags)}")
        for flag, value in flags.items():
            if flag not in POLICY_FLAGS:
                raise _EntryError(f"unknown flag {flag!r} in \"policy.{tool}\" (known: {', '.join(POLICY_FLAGS)})")
            if not isinstance(value, bool):
                raise _EntryError(f"\"policy.{tool}.{flag}\" must be true or false, not {_kind(value)}")
        out[tool] = dict(flags)
    return out


def _str(entry: dict, key: str) -> str:
    value = entry[key]
    if not isinstance(value, str):
        raise _EntryError(f"\"{key}\" must be a string, not {_kind(value)}")
    return value


def _str_map(entry: dict, key: str) -> dict[str, str]:
    value = entry[key]
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise _EntryError(f"\"{key}\" must be an object of string values")
    return value


def _bool(entry: dict, key: str, default: bool) -> bool:
    value = entry.get(key, default)
    if not isinstance(value, bool):
        raise _EntryError(f"\"{key}\" must be true or false, not {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)
