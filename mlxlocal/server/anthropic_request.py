"""Anthropic Messages request bodies -> chat-template messages, tools and template options.

Shared by POST /v1/messages and /v1/messages/count_tokens, so both render the same prompt.

Top-level fields (project rule: a field that changes the output and that we cannot honour
is a 400 naming it; one that only concerns billing, routing or caching is accepted):

  model, messages, max_tokens, system,      honoured
  stop_sequences, stream, temperature,
  top_p, top_k, tools, tool_choice
  thinking                                  honoured, see `thinking_mode`
  context_management                        clear_thinking_20251015 applied to the prompt;
                                            other edits (clear_tool_uses_...) -> 400
  output_config.effort                      to templates that read `reasoning_effort`
                                            (gpt-oss: low / medium / high; xhigh and max are
                                            high); elsewhere accepted without effect, as
                                            those models have no effort control
  output_config.format                      json_schema: the text is constrained to it
                                            (server/constraints.py; a bad schema -> 400)
  cache_control (top level and on blocks)   accepted: the prefix cache is automatic
  drop_message, reposition, drop_rule,      honoured with a session (X-Session-Id header or
  session_id                                session_id): cache edits (AKV fields), server/prompt.py;
                                            indices are `messages` entries (the top-level
                                            system prompt has none), docs/akv.md
  speculative                               extension: false opts out of the server's
                                            speculative decoding; not a bool -> 400
  metadata, service_tier, speed,            accepted, ignored (accounting and routing)
  inference_geo, diagnostics, container
  mcp_servers                               non-empty -> 400 (server-side tools)
  tool_choice any / tool                    the call is forced: decoding constrained to the
                                            family's tool-call syntax, input under the tool's
                                            input_schema (`strict` tools exactly), plus a
                                            system hint (pipeline.py); wins over
                                            output_config.format in the same request
  tool_choice.disable_parallel_tool_use     with any / tool: exactly one call; with auto:
                                            accepted, ignored
  anything else                             ignored, as clients send newer fields first

Messages: `system`-role entries inside `messages` before any other entry are folded into
the system prompt: top-level `system` first, then those entries in order, joined by a blank
line. A system entry after a user or assistant entry (Claude Code sends its environment,
ending in "Today's date is ...", after the first user message, and a "The date has changed"
entry at the end of a session continued on a later day) is a system turn where it stands,
so what changes comes after the tools and instructions, as the client ordered it, and the
prefix cache keeps them. For a template that cannot render a system turn there (Mistral's,
Gemma's), pipeline.place_system_turns folds it into the system prompt instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxlocal.server.errors import APIError
from mlxlocal.server.validation import MAX_MESSAGES, MAX_TOOLS, is_int, sized_list, string

# Block types a text-only model cannot read: a 400 naming the part and where it is.
_MEDIA = ("image", "document", "search_result", "container_upload")


@dataclass
class Thinking:
    """What the request's `thinking` asks for.

    mode: "default" (no `thinking`: the model's own default, as its template renders it),
    "enabled", "adaptive" (on for a model that thinks), "disabled" (enable_thinking=False
    to a template that reads it; any reasoning the model writes anyway is left out of the
    reply). budget: `budget_tokens` of "enabled" (checked as Anthropic does: >= 1024 and
    below max_tokens): a think block still open after that many generated tokens is
    closed by writing the think-end marker, and the answer follows (events._budgeted).
    Thinking counts toward max_tokens, as on Anthropic's API.
    omit: display "omitted": thinking blocks are sent without their text.
    """

    mode: str = "default"
    budget: int | None = None
    omit: bool = False
    effort: str | None = None  # output_config.effort

    @property
    def on(self) -> bool | None:
        return None if self.mode == "default" else self.mode != "disabled"

    def template_kwargs(self, chat_template: Any) -> dict:
        """Variables for the templates that read them: enable_thinking (Qwen3 and the like),
        reasoning_effort (gpt-oss); a template that reads neither gets nothing."""
        if not isinstance(chat_template, str):
            return {}
        kwargs: dict = {}
        if self.on is not None and "enable_thinking" in chat_template:
            kwargs["enable_thinking"] = self.on
        if self.effort is not None and "reasoning_effort" in chat_template:
            kwargs["reasoning_effort"] = {"xhigh": "high", "max": "high"}.get(self.effort, self.effort)
        return kwargs


def thinking_mode(body: dict, max_tokens: int | None) -> Thinking:
    config = body.get("output_config")
    effort = config.get("effort") if isinstance(config, dict) else None  # checked by check_fields
    spec = body.get("thinking")
    if spec is None:
        return Thinking(effort=effort)
    if not isinstance(spec, dict):
        raise APIError(400, "thinking: must be an object", param="thinking")
    kind = spec.get("type")
    if kind not in ("enabled", "adaptive", "disabled"):
        raise APIError(400, f"thinking.type: must be 'enabled', 'adaptive' or 'disabled', got {kind!r}",
                       param="thinking.type")
    display = spec.get("display")
    if display not in (None, "summarized", "omitted"):
        raise APIError(400, f"thinking.display: must be 'summarized' or 'omitted', got {display!r}",
                       param="thinking.display")
    budget = None
    if kind == "enabled":
        budget = spec.get("budget_tokens")
        if not is_int(budget) or budget < 1024:
            raise APIError(400, f"thinking.budget_tokens: must be an integer >= 1024, got {budget!r}",
                           param="thinking.budget_tokens")
        if max_tokens is not None and budget >= max_tokens:
            raise APIError(400, f"thinking.budget_tokens: must be less than max_tokens ({max_tokens})",
                           param="thinking.budget_tokens")
    return Thinking(kind, budget, display == "omitted", effort)


def check_fields(body: dict) -> None:
    """The top-level fields we refuse (see the table above)."""
    config = body.get("output_config")
    if config is not None:
        if not isinstance(config, dict):
            raise APIError(400, "output_config: must be an object", param="output_config")
        effort = config.get("effort")
        if effort is not None and effort not in ("low", "medium", "high", "xhigh", "max"):
            raise APIError(400, f"output_config.effort: must be low, medium, high, xhigh or max, got {effort!r}",
                           param="output_config.effort")
    if body.get("mcp_servers"):
        raise APIError(400, "mcp_servers: server-side MCP tools are not supported by this server; "
                            "give the tools in `tools`", param="mcp_servers")


def thinking_turns_kept(body: dict) -> int | None:
    """From context_management: how many recent assistant turns keep their thinking in the
    prompt (None: all of them)."""
    cm = body.get("context_management")
    if cm is None:
        return None
    if not isinstance(cm, dict):
        raise APIError(400, "context_management: must be an object", param="context_management")
    edits = cm.get("edits") or []
    if not isinstance(edits, list):
        raise APIError(400, "context_management.edits: must be a list", param="context_management.edits")
    kept = None
    for i, edit in enumerate(edits):
        where = f"context_management.edits.{i}"
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind != "clear_thinking_20251015":
            raise APIError(400, f"{where}.type: {kind!r} is not supported here (only clear_thinking_20251015)",
                           param=f"{where}.type")
        keep = edit.get("keep", {"type": "thinking_turns", "value": 1})  # Anthropic's default
        if keep == "all":
            kept = None
        elif isinstance(keep, dict) and keep.get("type") == "thinking_turns" and is_int(keep.get("value")) \
                and keep["value"] >= 0:
            kept = keep["value"]
        else:
            raise APIError(400, f"{where}.keep: must be 'all' or {{'type': 'thinking_turns', 'value': N}}",
                           param=f"{where}.keep")
    return kept


def _media_error(kind: str, where: str) -> APIError:
    return APIError(400, f"{where}: {kind} content is not supported: the model takes text only "
                         f"(part type {kind!r})", param=where)


def text_of(content: Any, where: str) -> str:
    """A string, or a list of text blocks (cache_control and citations are fine); images,
    documents and the like are refused, naming the part."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}: content must be a string or a list of blocks", param=where)
    parts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            parts.append(string(block, "text", f"{where}.{i}.text") or "")
        elif kind in _MEDIA:
            raise _media_error(kind, f"{where}.{i}")
        else:
            raise APIError(400, f"{where}.{i}: block type {kind!r} is not supported here (text only)",
                           param=f"{where}.{i}")
    return "".join(parts)


def convert_messages(body: dict, keep_thinking: int | None = None, origins=None) -> list[dict]:
    """Anthropic system + messages -> OpenAI-style messages for the chat template.

    `origins` (server/prompt.Origins, for AKV drop fields) learns which `messages` entries
    each chat message holds: a user entry with tool_result blocks is one tool message per
    result (plus its text as a user message); system entries are all in the system prompt.

    Echoed thinking blocks become the assistant message's `reasoning_content`, which
    templates that render reasoning (Qwen3's) put back in a think block, so a tool loop's
    prompt repeats what the model generated and the prefix cache covers it. `keep_thinking`
    (context_management) keeps it on the last N assistant turns only.
    """
    systems = [text_of(body.get("system"), "system")] if body.get("system") else []
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: a non-empty list is required", param="messages")
    sized_list(messages, "messages", MAX_MESSAGES)
    assistants = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"]
    thinking_from = (len(messages) if keep_thinking == 0 else assistants[-keep_thinking]
                     if keep_thinking is not None and keep_thinking < len(assistants) else 0)
    out: list[dict] = []
    system_entries: list[int] = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        role = m.get("role") if isinstance(m, dict) else None
        first = len(out)
        if role == "system":
            if out:  # after the conversation started: a system turn in its place
                out.append({"role": "system", "content": text_of(m.get("content"), f"{where}.content")})
                _owned(origins, out[first:], i)
            else:
                systems.append(text_of(m.get("content"), f"{where}.content"))
                system_entries.append(i)
            continue
        if role not in ("user", "assistant"):
            raise APIError(400, f"{where}.role: must be 'user', 'assistant' or 'system'", param=f"{where}.role")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            _owned(origins, out[first:], i)
            continue
        if not isinstance(content, list):
            raise APIError(400, f"{where}.content: must be a string or a list of blocks", param=f"{where}.content")
        texts: list[str] = []
        thoughts: list[str] = []
        calls: list[dict] = []
        results: list[dict] = []
        for j, block in enumerate(content):
            bwhere = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(string(block, "text", f"{bwhere}.text") or "")
            elif kind == "tool_use" and role == "assistant":
                args = block.get("input") or {}
                if not isinstance(args, dict):
                    raise APIError(400, f"{bwhere}.input: must be an object", param=f"{bwhere}.input")
                calls.append({"id": string(block, "id", f"{bwhere}.id") or "", "type": "function",
                              "function": {"name": string(block, "name", f"{bwhere}.name", required=True),
                                           "arguments": args}})
            elif kind == "tool_result" and role == "user":
                text = text_of(block.get("content"), f"{bwhere}.content")
                if block.get("is_error"):
                    text = f"Error: {text}"  # templates have no field for it: say it in the text
                results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""),
                                "content": text})
            elif kind == "thinking" and role == "assistant":
                if i >= thinking_from:
                    thoughts.append(string(block, "thinking", f"{bwhere}.thinking") or "")
            elif kind == "redacted_thinking" and role == "assistant":
                continue  # encrypted by Anthropic: nothing a local model can read
            elif kind in _MEDIA:
                raise _media_error(kind, bwhere)
            else:
                raise APIError(400, f"{bwhere}: unsupported block type {kind!r} in a {role} message", param=bwhere)
        out.extend(results)
        if role == "assistant":
            msg: dict = {"role": "assistant", "content": "".join(texts)}
            if any(thoughts):
                msg["reasoning_content"] = "\n\n".join(t for t in thoughts if t)
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts or not results:
            out.append({"role": "user", "content": "".join(texts)})
        _owned(origins, out[first:], i)
    if systems:
        out.insert(0, {"role": "system", "content": "\n\n".join(s for s in systems if s)})
        _owned(origins, out[:1], *system_entries)
        if body.get("system") and origins is not None:  # text no entry's index names
            origins.seal(out[0])
    if origins is not None:
        origins.size = len(messages)
    return out


def _owned(origins, held: list[dict], *indices: int) -> None:
    if origins is not None:
        for message in held:
            for i in indices:
                origins.add(message, i)


def forced_call(body: dict) -> tuple[str | None, bool] | None:
    """For tool_choice any / tool: (the tool's name or None for any, whether several calls
    may come); None when no call is forced. convert_tools has checked the choice."""
    choice = body.get("tool_choice")
    if not isinstance(choice, dict) or choice.get("type") not in ("any", "tool"):
        return None
    return (choice.get("name") if choice["type"] == "tool" else None,
            choice.get("disable_parallel_tool_use") is not True)


def convert_tools(body: dict) -> list[dict] | None:
    """The tools in chat-completions shape (None for none, or tool_choice none). The choice
    any / tool (`forced_call`) is applied by the pipeline, as every dialect's is: only the
    named tool, the shared system hint, the grammar that forces the call."""
    tools = body.get("tools")
    choice = body.get("tool_choice") or {"type": "auto"}
    if not tools:
        return None
    sized_list(tools, "tools", MAX_TOOLS)
    if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
        raise APIError(400, "tool_choice.type: must be auto, any, tool or none", param="tool_choice")
    if choice["type"] == "none":
        return None
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise APIError(400, f"tools.{i}: must be an object", param=f"tools.{i}")
        string(t, "name", f"tools.{i}.name", required=True)
        schema = t.get("input_schema")
        if schema is not None and not isinstance(schema, dict):
            raise APIError(400, f"tools.{i}.input_schema: must be an object", param=f"tools.{i}.input_schema")
        if t.get("type") not in (None, "custom"):
            raise APIError(400, f"tools.{i}: server tool {t.get('type')!r} is not supported", param=f"tools.{i}")
        function = {"name": t["name"], "description": string(t, "description", f"tools.{i}.description") or "",
                    "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
        if t.get("strict") is True:  # a forced call then holds its input to the schema exactly
            function["strict"] = True
        out.append({"type": "function", "function": function})
    return out
