"""Chat messages as templates take them, for every dialect (through pipeline.py): tool-call
arguments as templates expect them, tool_choice as tools and a system hint (the forced call's
grammar: tool_choice.py), and system turns where the client put them (`place_system_turns`)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from mlxlocal.server import akv
from mlxlocal.server.errors import APIError
from mlxlocal.server.tool_choice import require_call

if TYPE_CHECKING:
    from mlxlocal.engine import ChatFormat


def template_arguments(arguments: str | dict) -> Any:
    """Templates expect a mapping (most do `arguments | tojson`); keep text that is not JSON."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


# A conversation with a system turn after other messages, as a probe of the chat template.
_PROBE = (("system", "mlxlocal-probe-0"), ("user", "mlxlocal-probe-1"),
          ("system", "mlxlocal-probe-2"), ("assistant", "mlxlocal-probe-3"),
          ("user", "mlxlocal-probe-4"), ("system", "mlxlocal-probe-5"))
_LATER_SYSTEM: dict[str, bool] = {}  # chat template -> renders later system turns in place


def renders_later_system(fmt: ChatFormat) -> bool:
    """Whether the chat template writes a system message that follows other messages where
    it stands (Qwen's and Llama 3's do; Mistral's and Gemma's refuse one, some drop it)."""
    template = fmt.chat_template
    if template is None:
        return True  # encode_chat writes every message in order
    key = template if isinstance(template, str) else repr(template)
    if key not in _LATER_SYSTEM:
        try:
            text = fmt.render([{"role": r, "content": t} for r, t in _PROBE])
        except Exception:  # the template's raise_exception: roles must alternate, and the like
            text = ""
        marks = [t for _, t in _PROBE[1:]]
        at = [text.find(t) if isinstance(text, str) and text.count(t) == 1 else -1 for t in marks]
        _LATER_SYSTEM[key] = -1 not in at and at == sorted(at)
    return _LATER_SYSTEM[key]


def place_system_turns(messages: list[dict], fmt: ChatFormat,
                       origins: akv.Origins | None = None) -> list[dict]:
    """System messages after the first message stay where the client put them: clients put
    what changes (a date, an environment note) after what does not (tools, instructions), so
    the prompt's prefix, and the prefix cache, holds across turns and days. A template that
    cannot render them there gets them folded into the system prompt at the start instead."""
    later = [m for m in messages[1:] if m["role"] == "system"]
    if not later or renders_later_system(fmt):
        return messages
    rest = [m for m in messages if not any(m is x for x in later)]
    if rest and rest[0]["role"] == "system":
        head = rest[0]
    else:
        head = {"role": "system", "content": ""}
        rest.insert(0, head)
    head["content"] = "\n\n".join(t for t in [head["content"], *(m["content"] for m in later)] if t)
    if origins is not None:
        for m in later:
            for i in origins.owners.pop(id(m), ()):
                origins.add(head, i)
            if id(m) in origins.sealed:
                origins.seal(head)
    return rest


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
