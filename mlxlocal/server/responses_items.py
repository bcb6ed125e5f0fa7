"""Responses API input items and tools -> chat messages and tools for the chat template.

A Responses conversation is a flat list of items; one assistant turn is several of them
(reasoning, then a message, then function calls). They are folded back into one assistant
message, with the reasoning as `reasoning_content` (what Qwen3 / DeepSeek style templates
render as the think block), so a follow-up turn re-renders the prompt the model saw and
generated, and the prefix cache serves it.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Set
from typing import Any

from mlxlocal.server.errors import APIError
from mlxlocal.server.pipeline import template_arguments
from mlxlocal.server.validation import string

# Text parts: their text goes to the template as it is.
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
_MEDIA_PARTS = ("input_image", "input_file", "input_audio")

# Reasoning items returned with include=["reasoning.encrypted_content"] carry the model's
# reasoning text here. It is not encrypted (a local server has no secret worth keeping from
# its own client): it only has to come back unchanged, which clients such as Codex do with
# store=false (they drop `content` when they send reasoning items back).
SEALED_PREFIX = "mlxlocal.v1:"


def seal(text: str) -> str:
    return SEALED_PREFIX + base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii")


def unseal(blob: Any) -> str | None:
    """The reasoning text in our encrypted_content; None for another server's blob."""
    if not isinstance(blob, str) or not blob.startswith(SEALED_PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(blob[len(SEALED_PREFIX):]).decode("utf-8")
    except (binascii.Error, ValueError):
        return None


def _dict(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise APIError(400, f"{where}: must be an object", param=where)
    return value


def content_text(content: Any, where: str) -> str:
    """A string, or a list of text parts joined; media parts are refused by name."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: must be a string or a list of content parts", param=where)
    texts = []
    for k, part in enumerate(content):
        at = f"{where}.{k}"
        kind = _dict(part, at).get("type")
        if kind in _TEXT_PARTS:
            texts.append(string(part, "text", f"{at}.text") or "")
        elif kind == "refusal":
            texts.append(string(part, "refusal", f"{at}.refusal") or "")
        elif kind in _MEDIA_PARTS:
            raise APIError(400, f"{at}: content part type '{kind}' is not supported: the models this "
                                "server runs are text-only", param=f"{at}.type")
        else:
            raise APIError(400, f"{at}: unknown content part type {kind!r}", param=f"{at}.type")
    return "\n".join(texts)


class _Fold:
    """Items -> messages; consecutive assistant items (reasoning, message, function calls)
    become one assistant message, in the order a model produces them."""

    def __init__(self) -> None:
        self.messages: list[dict] = []
        self.open: dict | None = None  # the assistant message still taking items

    def assistant(self, after_text: bool = False) -> dict:
        """The open assistant message; a new one when the item cannot follow what it holds
        (reasoning after text or calls, text after calls or text)."""
        m = self.open
        if m is None or (after_text and (m["content"] or m.get("tool_calls"))):
            m = self.open = {"role": "assistant", "content": ""}
            self.messages.append(m)
        return m

    def add(self, message: dict) -> dict:
        """Append `message`; return the message that holds it (the first, for a system prompt folded in)."""
        self.open = None
        # One system prompt: instructions and the developer / system messages before the
        # conversation starts (Codex sends both). Many templates take only a first system
        # message, and some refuse a second one.
        if message["role"] == "system" and self.messages and all(m["role"] == "system" for m in self.messages):
            self.messages[0]["content"] = f"{self.messages[0]['content']}\n\n{message['content']}"
            return self.messages[0]
        self.messages.append(message)
        return message


def input_messages(items: list[Any], instructions: str | None, origins=None) -> list[dict]:
    """The request's instructions and input items as chat-template messages. `origins`
    (server/prompt.Origins, for AKV drop fields) learns which items each message holds."""
    fold = _Fold()
    if instructions:
        held = fold.add({"role": "system", "content": instructions})
        if origins is not None:  # text no item index names: this message never leaves whole
            origins.seal(held)
    for i, item in enumerate(items):
        held = _item(fold, i, item)
        if origins is not None:
            origins.add(held, i)
    if origins is not None:
        origins.size = len(items)
    return fold.messages


def _item(fold: _Fold, i: int, item: Any) -> dict:
    """Fold input item i into the conversation; return the message that holds it."""
    at = f"input.{i}"
    item = _dict(item, at)
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        text = content_text(item.get("content"), f"{at}.content")
        if role == "assistant":
            m = fold.assistant(after_text=True)
            m["content"] = text
            return m
        if role in ("user", "system", "developer"):
            return fold.add({"role": "system" if role == "developer" else role, "content": text})
        raise APIError(400, f"{at}.role: must be user, assistant, system or developer, got {role!r}",
                       param=f"{at}.role")
    if kind == "function_call":
        call_id = string(item, "call_id", f"{at}.call_id", required=True)
        name = qualified(string(item, "namespace", f"{at}.namespace"),
                         string(item, "name", f"{at}.name", required=True))
        arguments = string(item, "arguments", f"{at}.arguments") or "{}"
        m = fold.assistant()
        m.setdefault("tool_calls", []).append(
            {"id": call_id, "type": "function",
             "function": {"name": name, "arguments": template_arguments(arguments)}})
        return m
    if kind == "function_call_output":
        call_id = string(item, "call_id", f"{at}.call_id", required=True)
        output = item.get("output")
        if output is None:
            raise APIError(400, f"{at}.output: required", param=f"{at}.output")
        return fold.add({"role": "tool", "tool_call_id": call_id, "content": content_text(output, f"{at}.output")})
    if kind == "reasoning":
        text = _reasoning_text(item, at)
        m = fold.assistant()
        if m["content"] or m.get("tool_calls") or m.get("reasoning_content"):
            fold.open = None
            m = fold.assistant()
        if text:
            m["reasoning_content"] = text
        return m
    raise APIError(400, f"{at}.type: input item type {kind!r} is not supported (message, function_call, "
                        "function_call_output and reasoning are)", param=f"{at}.type")


def _reasoning_text(item: dict, at: str) -> str:
    """What the model thought: `content` when sent back, else our encrypted_content. A
    summary is not what the model said, so it does not stand in for the think block."""
    content = item.get("content")
    if content:
        return content_text(content, f"{at}.content")
    return unseal(item.get("encrypted_content")) or ""


# Tools the Responses API runs itself (or whose calls it defines). We cannot run them, and
# clients send them by default (Codex: web_search): they are left out of what the model is
# offered, named in the x-mlxlocal-ignored-tools response header and the log, never a 400.
HOSTED_TOOLS = {"web_search", "web_search_preview", "file_search", "code_interpreter", "image_generation",
                "computer_use_preview", "computer", "mcp", "local_shell", "shell", "apply_patch", "tool_search"}
NAMESPACE_SEP = "__"


def qualified(namespace: str | None, name: str) -> str:
    """A namespaced function's name as the model sees it (templates know no namespaces)."""
    return f"{namespace}{NAMESPACE_SEP}{name}" if namespace else name


def split_qualified(name: str, namespaces: Set[str]) -> tuple[str | None, str]:
    """(namespace, name) of a function the model called, for the function_call item."""
    head, sep, tail = name.partition(NAMESPACE_SEP)
    return (head, tail) if sep and head in namespaces and tail else (None, name)


def chat_tools(tools: list[Any] | None) -> tuple[list[dict] | None, list[str], set[str]]:
    """Responses function tools ({type, name, description, parameters}) in the chat shape
    the templates render; a namespace's functions flattened as "<namespace>__<name>".
    Returns (tools, hosted tool types left out, namespaces). Other tool types (custom
    grammars, unknown ones) are refused: a request that silently lost them would get
    different answers."""
    if not tools:
        return None, [], set()
    out: list[dict] = []
    hosted: list[str] = []
    namespaces: set[str] = set()

    def function(tool: dict, at: str, namespace: str | None = None) -> None:
        name = string(tool, "name", f"{at}.name", required=True)
        spec: dict[str, Any] = {"name": qualified(namespace, name)}
        description = string(tool, "description", f"{at}.description")
        if description is not None:
            spec["description"] = description
        parameters = tool.get("parameters")
        if parameters is not None:
            spec["parameters"] = _dict(parameters, f"{at}.parameters")
        if tool.get("strict") is True:  # a forced call then holds its arguments to the schema exactly
            spec["strict"] = True
        out.append({"type": "function", "function": spec})

    for i, tool in enumerate(tools):
        at = f"tools.{i}"
        kind = _dict(tool, at).get("type")
        if kind == "function":
            function(tool, at)
        elif kind == "namespace":
            namespace = string(tool, "name", f"{at}.name", required=True)
            namespaces.add(namespace)
            for j, inner in enumerate(tool.get("tools") or []):
                if _dict(inner, f"{at}.tools.{j}").get("type") != "function":
                    raise APIError(400, f"{at}.tools.{j}.type: only 'function' tools are supported in a namespace",
                                   param=f"{at}.tools.{j}.type")
                function(inner, f"{at}.tools.{j}", namespace)
        elif kind in HOSTED_TOOLS:
            hosted.append(kind)
        else:
            raise APIError(400, f"{at}.type: tool type {kind!r} is not supported by this server "
                                "(function and namespace tools are; hosted tools are left out)", param=f"{at}.type")
    return out or None, hosted, namespaces


def tool_choice(choice: Any, tools: list[dict] | None) -> tuple[list[dict] | None, str | None, str | None]:
    """(tools narrowed by an allowed_tools choice, "auto"/"none"/"required" or None, named function)."""
    if choice is None or isinstance(choice, str):
        if choice not in (None, "auto", "none", "required"):
            raise APIError(400, f"tool_choice: must be auto, none, required or an object, got {choice!r}",
                           param="tool_choice")
        return tools, choice, None
    kind = _dict(choice, "tool_choice").get("type")
    if kind == "function":
        return tools, None, string(choice, "name", "tool_choice.name", required=True)
    if kind == "allowed_tools":
        mode = choice.get("mode", "auto")
        if mode not in ("auto", "required"):
            raise APIError(400, f"tool_choice.mode: must be auto or required, got {mode!r}", param="tool_choice.mode")
        allowed = {t.get("name") for t in choice.get("tools") or [] if isinstance(t, dict)}
        narrowed = [t for t in tools or [] if t["function"]["name"] in allowed]
        if not narrowed:
            raise APIError(400, "tool_choice.tools: names no function in tools", param="tool_choice.tools")
        return narrowed, mode, None
    raise APIError(400, f"tool_choice.type: {kind!r} is not supported (function or allowed_tools)",
                   param="tool_choice.type")
