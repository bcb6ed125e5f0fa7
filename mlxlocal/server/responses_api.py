"""The OpenAI Responses API: POST /v1/responses (as the Codex CLI uses it), GET and DELETE
/v1/responses/{id}. A format adapter: input items -> chat messages (responses_items.py),
the shared prompt and validation code, generation.py's parsed events -> output items.

Notes on behaviour:
- Output items: `reasoning` (the model's think block, as `content` [reasoning_text]; no
  summary is written, whatever reasoning.summary asks), `message` (output_text), and
  `function_call` (call_id, name, arguments as JSON text). Streaming sends the matching
  events (reasoning_text.delta / .done for the think block), each with a sequence_number.
- include=["reasoning.encrypted_content"] puts the reasoning text, encoded, in
  encrypted_content so a store=false client (Codex) can send it back. Reasoning that comes
  back (content, or that encrypted_content) goes to the template as the assistant's
  reasoning_content, which Qwen3 / DeepSeek style templates render as the think block: the
  turn re-renders as generated and the follow-up hits the prefix cache.
- store (default true) keeps the last 256 responses in memory, for previous_response_id and
  GET / DELETE; store=false keeps nothing. instructions are not carried over (as OpenAI).
- Tools: function tools, and namespace tools (Codex's multi_agent_v1) flattened for the
  template as "<namespace>__<name>" and split back into the function_call's namespace and
  name. Hosted tools the API would run itself (web_search, file_search, local_shell, mcp,
  ...; Codex always sends web_search) cannot run here: they are left out, named in the
  x-mlxlocal-ignored-tools response header and the log (never a 400, which would make
  every Codex turn fail).
- Refused with a 400 naming the field, because they change the output and are not honoured:
  other tool types (custom grammars, unknown types), image /
  file / audio content, text.verbosity other than medium,
  reasoning.effort other than medium, max_tool_calls, top_logprobs, background, prompt,
  conversation, include "message.output_text.logprobs".
- Accepted and ignored, as they do not change what is generated: reasoning.summary, metadata, user, safety_identifier, prompt_cache_key, prompt_cache_retention,
  service_tier, stream_options, the other include values; truncation "auto" too (a
  conversation over the context is a 400, never silently cut). strict on a function
  tool: its arguments are held to the schema exactly when a call is forced (tool_choice);
  without strict they are held to it as far as the grammar engine implements it.
- text.format json_object / json_schema (and the extension fields structured_outputs,
  grammar, regex) constrain the output message: see constraints.py.
- parallel_tool_calls=false keeps only the model's first function call (and a forced call
  is one call).
- instructions and the system / developer messages before the first other item are one
  system prompt (many templates take a single one); later developer messages are system turns
  where they stand (folded into the system prompt for a template that cannot render them
  there: pipeline.place_system_turns).
- tool_choice as in chat completions ("required" / a named function: the call is forced by
  a grammar over the family's tool-call syntax, see constraints.py), plus allowed_tools (the
  tools it names are the ones offered; mode "required" forces a call of one of them). A
  forced call wins over text.format in the same request.
- AKV cache edits (prompt.py, docs/akv.md): the X-Session-Id header or session_id field names a session;
  drop_message / reposition / drop_rule index the conversation's items (a previous
  response's first, then `input`); usage adds drop_skipped_tokens and repos_tokens.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Set
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from mlxlocal.engine import SamplingParams
from mlxlocal.grammar.parse import Event
from mlxlocal.server import pipeline
from mlxlocal.server.constraints import Format
from mlxlocal.server.errors import APIError
from mlxlocal.server.generation import (
    Finish,
    Flush,
    StreamEvent,
    coalesced,
    keepalive_comment,
    usage_fields,
)
from mlxlocal.server.pipeline import check_params
from mlxlocal.server.prompt import Origins
from mlxlocal.server.responses_items import (
    chat_tools,
    input_messages,
    seal,
    split_qualified,
    tool_choice,
)
from mlxlocal.server.validation import (
    MAX_MESSAGES,
    MAX_TOOLS,
    CheckedBodyRoute,
    sized_list,
    speculative,
    thinking_budget,
)

log = logging.getLogger("mlxlocal.server")
router = APIRouter(route_class=CheckedBodyRoute)

DEFAULT_MAX_OUTPUT_TOKENS = 4096  # as chat completions; the engine clips it to the context
MAX_STORED = 256


class ResponseStore:
    """The last responses created with store=true: id -> (conversation items, response).
    Bounded LRU, per server. The items are shared with earlier entries (lists of the same
    dicts), so a long chain costs a pointer per item per entry, not copies of its text."""

    def __init__(self, capacity: int = MAX_STORED):
        self.capacity = capacity
        self.entries: OrderedDict[str, tuple[list, dict]] = OrderedDict()

    def put(self, response: dict, items: list) -> None:
        self.entries[response["id"]] = (items, response)
        self.entries.move_to_end(response["id"])
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def get(self, response_id: str, where: str = "response_id") -> tuple[list, dict]:
        entry = self.entries.get(response_id)
        if entry is None:
            raise APIError(404, f"{where}: no response with id '{response_id}' is stored here (created "
                                f"with store=false, evicted, or never made)", param=where)
        self.entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self.entries[response_id]


def store_of(request: Request) -> ResponseStore:
    return request.app.state.responses


# --- request ---------------------------------------------------------------------------
class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class ReasoningConfig(_Lenient):
    effort: str | None = None
    summary: str | None = None


class TextConfig(_Lenient):
    format: dict[str, Any] | None = None
    verbosity: str | None = None


class ResponsesRequest(_Lenient):
    model: str
    input: str | list[Any]  # at most MAX_MESSAGES items: checked in the route (a pydantic
    # max_length here would limit a string's characters too, and name the wrong field)
    instructions: str | None = None
    tools: list[Any] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: int | None = Field(None, ge=1, lt=2**31)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: StrictBool = False
    store: StrictBool | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, Any] | None = None
    # Refused when set (they change the output): see _refuse.
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    background: StrictBool | None = None
    prompt: Any = None
    conversation: Any = None


def _refuse(req: ResponsesRequest) -> None:
    def no(field: str, why: str):
        raise APIError(400, f"{field}: {why}", param=field)

    if req.max_tool_calls is not None:
        no("max_tool_calls", "not supported by this server")
    if req.top_logprobs:
        no("top_logprobs", "logprobs are not supported on /v1/responses (use /v1/chat/completions)")
    if req.background:
        no("background", "background responses are not supported")
    if req.prompt is not None:
        no("prompt", "stored prompt templates are not supported; send instructions and input")
    if req.conversation is not None:
        no("conversation", "conversations are not supported; use previous_response_id")
    if req.include and "message.output_text.logprobs" in req.include:
        no("include", "message.output_text.logprobs is not supported")
    if req.text and req.text.verbosity not in (None, "medium"):
        no("text.verbosity", f"{req.text.verbosity!r} cannot be honoured by a local model (leave it unset)")
    if req.reasoning and req.reasoning.effort not in (None, "medium"):
        no("reasoning.effort", f"{req.reasoning.effort!r} cannot be honoured: a local model reasons as its chat "
                               "template makes it (leave effort unset or 'medium')")


# --- output ---------------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _usage(stats, reasoning_tokens: int) -> dict:
    prompt = stats.prompt_tokens if stats else 0
    completion = stats.completion_tokens if stats else 0
    cached = stats.cached_tokens if stats else 0
    return {
        "input_tokens": prompt,
        # Written: the tokens prefilled, which go into the prefix cache when the request ends.
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": prompt - cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, completion)},
        "total_tokens": prompt + completion,
        **usage_fields(stats),  # AKV's: prompt tokens dropped from the cache, keys re-rotated
    }


class _Builder:
    """Parsed events -> output items and the stream events that build them. Non-streaming
    requests run the same builder and keep only the final response."""

    def __init__(self, response: dict, parallel: bool, sealed: bool, namespaces: Set[str] = frozenset()):
        self.response, self.parallel, self.sealed = response, parallel, sealed
        self.namespaces = namespaces  # namespace tools offered: a call's name is split back
        self.output: list[dict] = response["output"]
        self.seq = 0
        self.item: dict | None = None  # the open reasoning or message item
        self.text: list[str] = []  # its text so far
        self.space = ""  # leading whitespace held back: a message is not opened for it alone
        self.calls = 0
        self.pending_tokens = 0  # tokens whose text has not arrived yet
        self.reasoning_tokens = 0

    def event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def snapshot(self) -> dict:
        return json.loads(json.dumps(self.response))  # later changes must not reach sent events

    def start(self) -> list[dict]:
        return [self.event("response.created", response=self.snapshot()),
                self.event("response.in_progress", response=self.snapshot())]

    def _where(self) -> dict:
        assert self.item is not None  # called with an item open
        return {"item_id": self.item["id"], "output_index": len(self.output) - 1}

    def _open(self, item: dict, part: dict) -> list[dict]:
        self.output.append(item)
        self.item, self.text = item, []
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=dict(item)),
                self.event("response.content_part.added", **self._where(), content_index=0, part=part)]

    def close(self, status: str = "completed") -> list[dict]:
        item, text = self.item, "".join(self.text)
        if item is None:
            return []
        where, out = self._where(), []
        part: dict[str, Any]
        if item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": text.rstrip()}
            item["content"] = [part]
            if self.sealed:
                item["encrypted_content"] = seal(part["text"])
            out.append(self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"]))
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
        item["status"] = status
        out += [self.event("response.content_part.done", **where, content_index=0, part=part),
                self.event("response.output_item.done", output_index=where["output_index"], item=item)]
        self.item, self.text = None, []
        return out

    def feed(self, e: StreamEvent) -> list[dict]:
        if e.kind == "token":
            self.pending_tokens += 1
            return []
        if e.kind == "reasoning":
            self.reasoning_tokens += self.pending_tokens
        self.pending_tokens = 0
        out: list[dict] = []
        if e.kind == "reasoning":
            self.space = ""  # whitespace before a think block belongs to no message
            if self.item is None or self.item["type"] != "reasoning":
                out += self.close()
                item = {"id": _new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                        "status": "in_progress"}
                out += self._open(item, {"type": "reasoning_text", "text": ""})
            self.text.append(e.text)
            out.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=e.text))
        elif e.kind == "content":
            text = self.space + e.text
            if self.item is None or self.item["type"] != "message":
                if not text.strip() and e.text:  # whitespace between items (before a call): no message of its own
                    self.space = text
                    return []
                out += self.close()
                item = {"id": _new_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                        "content": []}
                out += self._open(item, {"type": "output_text", "text": "", "annotations": [], "logprobs": []})
            self.space = ""
            self.text.append(text)
            out.append(self.event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                  logprobs=[]))
        elif e.kind == "tool_call":
            out += self.close()
            self.space = ""
            self.calls += 1
            if self.calls > 1 and not self.parallel:
                return out  # parallel_tool_calls=false: the first call only
            namespace, name = split_qualified(e.name, self.namespaces)
            item = {"id": _new_id("fc"), "type": "function_call", "call_id": e.id, "name": name,
                    "arguments": "", "status": "in_progress"}
            if namespace is not None:
                item["namespace"] = namespace
            self.output.append(item)
            index = len(self.output) - 1
            out.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
            item["arguments"], item["status"] = e.arguments, "completed"
            out += [self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=e.arguments),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               name=name, arguments=e.arguments),
                    self.event("response.output_item.done", output_index=index, item=item)]
        return out

    def finish(self, done: Finish) -> list[dict]:
        incomplete = done.reason == "length"
        # Whitespace held back and followed by nothing is the answer after all.
        out = self.feed(Event("content", "")) if self.space else []
        out += self.close("incomplete" if incomplete else "completed")
        r = self.response
        r["status"] = "incomplete" if incomplete else "completed"
        r["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        r["completed_at"] = None if incomplete else int(time.time())
        r["usage"] = _usage(done.stats, self.reasoning_tokens)
        out.append(self.event("response.incomplete" if incomplete else "response.completed", response=r))
        return out

    def fail(self, e: BaseException) -> list[dict]:
        r = self.response
        message = e.message if isinstance(e, APIError) else f"internal error: {type(e).__name__}: {e}"
        r["status"], r["error"] = "failed", {"code": "server_error", "message": message}
        return [self.event("response.failed", response=r)]


def _sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


# --- routes --------------------------------------------------------------------------------------
def _response_object(req: ResponsesRequest, tools: list | None) -> dict:
    return {
        "id": _new_id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": req.model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort, "summary": req.reasoning.summary} if req.reasoning else None,
        "store": req.store is not False,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "text": {"format": (req.text.format if req.text and req.text.format else {"type": "text"})},
        "tool_choice": req.tool_choice or "auto",
        "tools": tools or [],
        "truncation": req.truncation or "disabled",
        "metadata": req.metadata or {},
        "usage": None,
    }


@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, request: Request):
    _refuse(req)
    items = [{"type": "message", "role": "user", "content": req.input}] if isinstance(req.input, str) \
        else list(sized_list(req.input, "input", MAX_MESSAGES))
    if req.previous_response_id is not None:
        previous_items, previous = store_of(request).get(req.previous_response_id, "previous_response_id")
        items = previous_items + previous["output"] + items
    origins = Origins()  # AKV indices: the conversation's items (previous response's first)
    messages = input_messages(items, req.instructions, origins)
    if not any(m["role"] != "system" for m in messages):
        raise APIError(400, "input: no message to answer", param="input")
    offered, hosted, namespaces = chat_tools(req.tools)
    if hosted:
        log.warning("/v1/responses: hosted tools left out (this server cannot run them): %s", ", ".join(hosted))
    tools, choice, named = tool_choice(req.tool_choice, offered)
    names = {"max_tokens": "max_output_tokens", "prompt": "input"}
    params = SamplingParams(max_tokens=req.max_output_tokens or DEFAULT_MAX_OUTPUT_TOKENS,
                            temperature=1.0 if req.temperature is None else req.temperature,
                            top_p=1.0 if req.top_p is None else req.top_p,
                            speculative=speculative(req.model_extra),
                            think_budget=thinking_budget(req.model_extra))
    check_params(params, names)
    extra = req.model_extra or {}
    fmt = Format("responses", req.text.model_dump() if req.text else None, extra)
    chat = pipeline.ChatRequest(req.model, "/v1/responses", messages, params, names, "input", tools,
                                pipeline.ToolChoice(choice or "auto", named, req.parallel_tool_calls is not False),
                                fmt, cache_fields=extra, origins=origins, stream=bool(req.stream))
    events = await pipeline.run(request, await pipeline.prepare(request, chat))

    builder = _Builder(_response_object(req, req.tools), req.parallel_tool_calls is not False,
                       "reasoning.encrypted_content" in (req.include or []), namespaces)
    store = store_of(request) if req.store is not False else None

    def keep(done: Finish) -> None:
        if store is not None and done.reason != "cancelled":  # a cancelled one has no client left
            store.put(builder.response, items)

    headers = {"x-mlxlocal-ignored-tools": ",".join(hosted)} if hosted else {}
    if not req.stream:
        async for e in events:
            if isinstance(e, Finish):
                builder.finish(e)
                keep(e)
            else:
                builder.feed(e)
        return JSONResponse(builder.response, headers=headers)

    async def stream() -> AsyncGenerator[str | Flush, None]:
        for event in builder.start():
            yield _sse(event)
        try:
            async for e in events:
                if e.kind == "flush":  # the end of a wake-up's events: what is framed goes out
                    yield e
                    continue
                if e.kind == "waiting":  # no output yet (or for a while)
                    yield keepalive_comment(e)
                    continue
                if isinstance(e, Finish):
                    keep(e)  # before the last event: a client may send its follow-up right after it
                for event in builder.finish(e) if isinstance(e, Finish) else builder.feed(e):
                    yield _sse(event)
        except Exception as e:  # after the headers went out: report in the stream
            for event in builder.fail(e):
                yield _sse(event)
        finally:
            await events.aclose()  # a client gone mid-stream: cancel the request now

    # One write per wake-up: the events framed since the last Flush, joined.
    return StreamingResponse(coalesced(stream()), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request):
    return store_of(request).get(response_id)[1]


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request):
    store_of(request).delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
