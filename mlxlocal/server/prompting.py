"""Chat messages -> prompt ids, shared by the OpenAI-style routers (chat completions and
responses): tool-call arguments as templates expect them, tool_choice as tools and a system
hint (the forced call's grammar: tool_choice.py), and the templated prompt tokenized off the
event loop with the early length check."""

from __future__ import annotations

import json
from typing import Any

from mlxlocal.server import akv
from mlxlocal.server.errors import APIError
from mlxlocal.server.tool_choice import require_call
from mlxlocal.server.validation import text_bytes


def template_arguments(arguments: str | dict) -> Any:
    """Templates expect a mapping (most do `arguments | tojson`); keep text that is not JSON."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def apply_tool_choice(tools: list[dict] | None, choice: str | None, name: str | None,
                      messages: list[dict], where: str = "tool_choice") -> list[dict] | None:
    """The tools to render (None for none) for a tool_choice of "auto" / "none" / "required"
    (choice) or a named function (name). "required" and a named function add a system hint (a
    named one offers only that tool), and `messages` gets it in place; the routes then force
    the call with tool_choice.forced_call_grammar once the prompt is encoded. `tools` are
    chat-completions shaped: {"type": "function", "function": {...}}."""
    if not tools:
        if name is not None or choice not in (None, "none", "auto"):
            raise APIError(400, f"{where} requires tools", param=where)
        return None
    if choice == "none":
        return None
    if choice == "required":
        require_call(messages)
    elif name is not None:
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise APIError(400, f"{where} names function '{name}', which is not in tools", param=where)
        require_call(messages, name)
    return tools


async def encode_messages(request, engine, model: str, messages: list[dict], tools: list[dict] | None, where: str,
                          cache: akv.CacheRequest | None = None,
                          origins: akv.Origins | None = None) -> tuple[list[int], akv.CacheUse]:
    """The chat template over `messages` (and tools), tokenized on a worker thread; text that
    cannot fit the context is refused before the template runs (a 400 on `where`). Also
    what the request asks of the KV cache (session, edits: akv.encode)."""
    # Not assistant turns: a template may drop their text (reasoning); the rest it keeps.
    sure = text_bytes(*(m["content"] for m in messages if m["role"] != "assistant"))
    return await akv.encode(request, engine, model, cache, messages, origins, tools, where, sure)
