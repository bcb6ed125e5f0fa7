"""`serve --max-tools K`: a request carrying more than K tools is rendered with the top K only.

One helper for the three chat dialects (OpenAI chat completions, Responses, Anthropic
messages); each calls `prune_tools` on its chat-completions-shaped tool list after its own
tool_choice handling. Kept: the top K of the tool index (agents/tool_index.py) for the
latest user message, plus every tool the request's history already called (the
conversation names them; a model that saw them called would call them again). A named
tool_choice has already reduced the list to that one tool, so it is always kept.

Off by default. The server does not run the tools, the client does: there is no
`search_tools` to find a dropped one again, and a client such as Claude Code sends its ~20
tools on every request expecting each of them to be callable. Pruning there is a trade the
user opts into (a small local model that prefills slowly and is distracted by many tools).
When it drops tools the response says how many (header `x-mlxlocal-tools-dropped`) and the
log names them.

The index is built once per distinct tool list (clients resend the same list on every
request) and kept in a small LRU.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from typing import Any

from mlxlocal.agents.types import ToolInfo

log = logging.getLogger("mlxlocal.server")

DROPPED_HEADER = "x-mlxlocal-tools-dropped"
SCOPE_KEY = "mlxlocal.tools_dropped"  # set on the ASGI scope; app.Guard turns it into the header
SERVER = "request"  # tool ids of a request's tools: "request.NAME"
CACHED_INDEXES = 8

_indexes: OrderedDict[str, Any] = OrderedDict()
_lock = threading.Lock()


def _catalog_key(tools: list[dict]) -> str:
    return hashlib.sha256(json.dumps(tools, sort_keys=True, default=str).encode()).hexdigest()


def _index(tools: list[dict]) -> Any:
    from mlxlocal.agents.tool_index import ToolIndex  # only when pruning is on

    key = _catalog_key(tools)
    with _lock:
        if key in _indexes:
            _indexes.move_to_end(key)
            return _indexes[key]
    infos = [ToolInfo(SERVER, t["function"]["name"], t["function"].get("description") or "",
                      t["function"].get("parameters") or {"type": "object"}) for t in tools]
    index = ToolIndex(infos)
    with _lock:
        _indexes[key] = index
        while len(_indexes) > CACHED_INDEXES:
            _indexes.popitem(last=False)
    return index


def latest_user_text(messages: list[dict]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user" and isinstance(m.get("content"), str) and m["content"].strip():
            return m["content"]
    return ""


def called_names(messages: list[dict]) -> set[str]:
    return {c["function"]["name"] for m in messages for c in m.get("tool_calls") or []
            if isinstance(c, dict) and isinstance(c.get("function"), dict) and "name" in c["function"]}


def select(tools: list[dict], messages: list[dict], max_tools: int) -> tuple[list[dict], list[str]]:
    """(kept tools in the request's order, dropped names)."""
    called = called_names(messages)
    query = latest_user_text(messages)
    ranked = _index(tools).rank(query, max_tools) if query else []
    top = {tool_id.partition(".")[2] for tool_id, _ in ranked[:max_tools]}
    if not top:  # nothing to rank by (no user text): the first K, as the client ordered them
        top = {t["function"]["name"] for t in tools[:max_tools]}
    keep = top | called
    kept = [t for t in tools if t["function"]["name"] in keep]
    return kept, [t["function"]["name"] for t in tools if t["function"]["name"] not in keep]


async def prune_tools(request: Any, tools: list[dict] | None, messages: list[dict], where: str) -> list[dict] | None:
    """The tools to render for this request under `--max-tools` (app.state.config.max_tools);
    a request from outside HTTP (`request` None: the MCP tools) offers no tools."""
    if not tools:
        return tools
    max_tools = getattr(request.app.state.config, "max_tools", None)
    if max_tools is None or len(tools) <= max_tools:
        return tools
    # The index (BM25, maybe embeddings) is CPU work: off the event loop.
    kept, dropped = await asyncio.to_thread(select, tools, messages, max_tools)
    request.scope[SCOPE_KEY] = len(dropped)
    log.info("%s: --max-tools %d kept %d of %d tools, dropped: %s", where, max_tools, len(kept), len(tools),
             ", ".join(dropped))
    return kept
