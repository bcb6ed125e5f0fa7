"""Anthropic Messages API: POST /v1/messages (streaming or not), /v1/messages/count_tokens."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlxlocal.engine import SamplingParams
from mlxlocal.server.errors import APIError, read_json_object
from mlxlocal.server.events import Finish, StreamEvent, open_events
from mlxlocal.server.parse import Event
from mlxlocal.server.validation import (
    MAX_MESSAGES,
    MAX_TOOLS,
    boolean,
    check_params,
    number,
    sized_list,
    stop_strings,
    string,
    text_bytes,
    tokenize,
)

router = APIRouter()


async def read_body(request: Request) -> dict:
    return await read_json_object(request, empty_ok=False)


def _text_of(content: Any, where: str) -> str:
    """A string, or a list of text blocks; anything else (images, documents) is refused."""
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
        else:
            raise APIError(400, f"{where}.{i}: block type {kind!r} is not supported here (text only)",
                           param=f"{where}.{i}")
    return "".join(parts)


def convert_messages(body: dict) -> list[dict]:
    """Anthropic system + messages -> OpenAI-style messages for the chat template."""
    out: list[dict] = []
    system = body.get("system")
    if system:
        out.append({"role": "system", "content": _text_of(system, "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages: a non-empty list is required", param="messages")
    sized_list(messages, "messages", MAX_MESSAGES)
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise APIError(400, f"{where}.role: must be 'user' or 'assistant'", param=f"{where}.role")
        role, content = m["role"], m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise APIError(400, f"{where}.content: must be a string or a list of blocks", param=f"{where}.content")
        texts: list[str] = []
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
                text = _text_of(block.get("content"), f"{bwhere}.content")
                if block.get("is_error"):
                    text = f"Error: {text}"
                results.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""),
                                "content": text})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # earlier reasoning is not replayed to the model
            elif kind in ("image", "document"):
                raise APIError(400, f"{bwhere}: {kind} blocks are not supported (text-only models)", param=bwhere)
            else:
                raise APIError(400, f"{bwhere}: unsupported block type {kind!r} in a {role} message", param=bwhere)
        out.extend(results)
        if role == "assistant":
            msg: dict = {"role": "assistant", "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
        elif texts or not results:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def convert_tools(body: dict) -> list[dict] | None:
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
        out.append({"type": "function", "function": {
            "name": t["name"], "description": string(t, "description", f"tools.{i}.description") or "",
            "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}})
    if choice["type"] == "tool":
        out = [t for t in out if t["function"]["name"] == choice.get("name")]
        if not out:
            raise APIError(400, f"tool_choice.name: no tool named {choice.get('name')!r}", param="tool_choice")
    return out


# SamplingParams field -> the name an Anthropic client knows it by.
_NAMES = {"stop": "stop_sequences", "prompt": "messages"}


def sampling_params(body: dict) -> SamplingParams:
    if body.get("max_tokens") is None:
        raise APIError(400, "max_tokens: Field required", param="max_tokens")
    temperature = number(body, "temperature", 1.0, "temperature")
    if not 0 <= temperature <= 1:  # Anthropic's range, narrower than the engine's
        raise APIError(400, f"temperature: must be between 0 and 1, got {temperature:g}", param="temperature")
    params = SamplingParams(
        max_tokens=number(body, "max_tokens", None, "max_tokens", integer=True),
        temperature=temperature,
        top_p=number(body, "top_p", 1.0, "top_p"),
        top_k=number(body, "top_k", 0, "top_k", integer=True),
        stop=stop_strings(body.get("stop_sequences"), "stop_sequences"),
    )
    check_params(params, _NAMES)
    boolean(body, "stream", False)
    return params


async def prepare(request: Request, body: dict, params: SamplingParams | None = None):
    """Validate, load the model, build the prompt: (engine, ids, tools). With `params`, the
    prompt is also checked against the model (context, vocabulary), as it will be generated."""
    model = string(body, "model", required=True)
    registry = request.app.state.registry
    registry.find(model)  # 404 before anything else
    messages = convert_messages(body)
    tools = convert_tools(body)
    engine = await registry.engine(model)
    # Not assistant turns: a template may drop their text (reasoning); the rest it keeps.
    sure = text_bytes(*(m["content"] for m in messages if m["role"] in ("system", "user", "tool")))
    ids = await tokenize(engine, sure, "messages", engine.encode_chat, messages, tools=tools,
                         check_length=params is not None)
    if params is not None:
        check_params(params, _NAMES, engine, ids)
    return engine, ids, tools


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


class Blocks:
    """Parser events -> Anthropic content-block stream events (also used to build the
    non-streaming message, so both agree)."""

    def __init__(self):
        self.index = -1
        self.open: str | None = None  # type of the open block
        self.seen_text = False

    def _start(self, block: dict) -> list[dict]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def feed(self, event: Event) -> list[dict]:
        out: list[dict] = []
        if event.kind == "content":
            text = event.text
            if self.open != "text":
                text = text.lstrip()
                if not text:
                    return []  # whitespace between blocks
                out += self._start({"type": "text", "text": ""})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "text_delta", "text": text}})
        elif event.kind == "reasoning":
            if self.open != "thinking":
                if not event.text.strip():
                    return []
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "thinking_delta", "thinking": event.text}})
        elif event.kind == "tool_call":
            out += self._start({"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24],
                                "name": event.name, "input": {}})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": event.arguments or "{}"}})
            out += self.close()
        return out


def stop_info(engine, done: Finish, stops: list[str]) -> tuple[str, str | None]:
    if done.tool_calls:
        return "tool_use", None
    if done.reason == "length":
        return "max_tokens", None
    if done.reason == "stop" and stops:
        raw = engine.decode(done.tokens)
        hits = [(raw.find(s), s) for s in stops if s in raw]
        if hits:
            return "stop_sequence", min(hits)[1]
    return "end_turn", None


def usage(stats, prompt_len: int, out_tokens: int) -> dict:
    cached = stats.cached_tokens if stats else 0
    return {"input_tokens": prompt_len - cached, "output_tokens": out_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


async def _events(engine, ids, params, events: AsyncIterator[StreamEvent]) -> AsyncIterator[dict]:
    """All of a message's stream events after message_start."""
    blocks = Blocks()
    async for ev in events:
        if ev.kind == "token":
            continue
        if ev.kind != "finish":
            for out in blocks.feed(ev):
                yield out
            continue
        for out in blocks.close():
            yield out
        reason, seq = stop_info(engine, ev, params.stop)
        out_tokens = ev.stats.completion_tokens if ev.stats else len(ev.tokens)
        yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
               "usage": usage(ev.stats, len(ids), out_tokens)}


def _message(model: str, content: list, prompt_len: int) -> dict:
    return {"id": new_message_id(), "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": prompt_len, "output_tokens": 0, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0}}


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


@router.post("/v1/messages")
async def messages(request: Request):
    body = await read_body(request)
    params = sampling_params(body)
    engine, ids, tools = await prepare(request, body, params)
    model = body["model"]
    # Errors before any output (context, queue, dead engine) raise here, as HTTP errors.
    parsed = await open_events(request, engine, ids, params, tools, request.app.state.metrics)
    events = _events(engine, ids, params, parsed)

    if not body.get("stream", False):
        message = _message(model, [], len(ids))
        partial: dict[int, str] = {}
        async for ev in events:
            if ev["type"] == "content_block_start":
                message["content"].append(dict(ev["content_block"]))
            elif ev["type"] == "content_block_delta":
                block, delta = message["content"][ev["index"]], ev["delta"]
                if delta["type"] == "text_delta":
                    block["text"] += delta["text"]
                elif delta["type"] == "thinking_delta":
                    block["thinking"] += delta["thinking"]
                else:
                    partial[ev["index"]] = partial.get(ev["index"], "") + delta["partial_json"]
            elif ev["type"] == "message_delta":
                message.update(ev["delta"])
                message["usage"] = ev["usage"]
        for index, text in partial.items():
            try:
                message["content"][index]["input"] = json.loads(text)
            except ValueError:
                message["content"][index]["input"] = {"_raw": text}
        return JSONResponse(message)

    async def stream():
        yield _sse({"type": "message_start", "message": _message(model, [], len(ids))})
        yield _sse({"type": "ping"})
        try:
            async for ev in events:
                yield _sse(ev)
        except APIError as e:
            yield _sse({"type": "error", "error": {"type": "api_error", "message": e.message}})
            return
        except Exception as e:  # mid-stream: the status line is gone, report in-band
            yield _sse({"type": "error", "error": {"type": "api_error", "message": f"{type(e).__name__}: {e}"}})
            return
        yield _sse({"type": "message_stop"})

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    body = await read_body(request)
    _, ids, _ = await prepare(request, body)
    return {"input_tokens": len(ids)}
