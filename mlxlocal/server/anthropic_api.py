"""Anthropic Messages API: POST /v1/messages (streaming or not), /v1/messages/count_tokens.

The body -> prompt translation (and which fields are honoured, ignored or refused) is in
anthropic_request.py; this module runs the request and writes Anthropic's events.

Usage: input_tokens + cache_read_input_tokens is the prompt's length (= count_tokens);
cache_read_input_tokens is what the prefix cache held, cache_creation_input_tokens is 0
(every prompt is cached without being asked, and Anthropic counts that write only for
cache_control breakpoints). message_start carries the whole prompt as input_tokens, since
the cache hit is known only at the end; message_delta carries the split (the SDKs and
Claude Code take the last values).
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlxlocal.engine import SamplingParams
from mlxlocal.grammar.parse import Event
from mlxlocal.server import pipeline
from mlxlocal.server.anthropic_request import (
    Thinking,
    check_fields,
    convert_messages,
    convert_tools,
    forced_call,
    thinking_mode,
    thinking_turns_kept,
)
from mlxlocal.server.constraints import Format
from mlxlocal.server.errors import APIError, read_json_object
from mlxlocal.server.generation import (
    Finish,
    Flush,
    StreamEvent,
    Waiting,
    coalesced,
    keepalive_comment,
    usage_fields,
)
from mlxlocal.server.pipeline import check_params
from mlxlocal.server.prompt import Origins
from mlxlocal.server.validation import (
    boolean,
    number,
    speculative,
    stop_strings,
    string,
)

router = APIRouter()


async def read_body(request: Request) -> dict:
    return await read_json_object(request, empty_ok=False)


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
        speculative=speculative(body),
    )
    check_params(params, _NAMES)
    boolean(body, "stream", False)
    return params


def chat_request(request: Request, body: dict, params: SamplingParams | None = None,
                 ) -> tuple[pipeline.ChatRequest, Thinking]:
    """The body as a ChatRequest, and its thinking mode. With `params` (a generation, not
    count_tokens), the AKV session and drop fields are read too, and the prompt will be checked
    against the model (context, vocabulary) as it will be generated."""
    model = string(body, "model", required=True)
    request.app.state.registry.find(model)  # 404 before anything else
    check_fields(body)
    thinking = thinking_mode(body, params.max_tokens if params is not None else None)
    origins = Origins()
    messages = convert_messages(body, thinking_turns_kept(body), origins)
    tools = convert_tools(body)
    forced = forced_call(body) if tools else None
    choice = pipeline.ToolChoice("required" if forced and forced[0] is None else "auto",
                                 forced[0] if forced else None, forced[1] if forced else True)
    if params is not None:
        params.think_budget = thinking.budget
    # A generation's output format (count_tokens has none: it only encodes).
    fmt = Format("anthropic", body.get("output_config")) if params is not None else None
    chat = pipeline.ChatRequest(model, "/v1/messages", messages, params, _NAMES, "messages", tools, choice,
                                fmt, template_kwargs=thinking.template_kwargs,
                                cache_fields=body if params is not None else None,
                                origins=origins, stream=bool(body.get("stream", False)))
    return chat, thinking


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


class Blocks:
    """Parser events -> Anthropic content-block stream events (also used to build the
    non-streaming message, so both agree)."""

    def __init__(self, thinking: Thinking | None = None):
        self.index = -1
        self.open: str | None = None  # type of the open block
        self.thinking = thinking or Thinking()
        self.thought: list[str] = []  # the open thinking block's text, for its signature

    def _start(self, block: dict) -> list[dict]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        return events + [{"type": "content_block_start", "index": self.index, "content_block": block}]

    def close(self) -> list[dict]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append({"type": "content_block_delta", "index": self.index,
                           "delta": {"type": "signature_delta", "signature": signature("".join(self.thought))}})
            self.thought = []
        self.open = None
        return events + [{"type": "content_block_stop", "index": self.index}]

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
            if self.thinking.mode == "disabled":
                return []  # a model whose template has no switch thought anyway: not asked for
            if self.open != "thinking":
                if not event.text.strip():
                    return []
                out += self._start({"type": "thinking", "thinking": "", "signature": ""})
            self.thought.append(event.text)
            if not self.thinking.omit:
                out.append({"type": "content_block_delta", "index": self.index,
                            "delta": {"type": "thinking_delta", "thinking": event.text}})
        elif event.kind == "tool_call":
            out += self._start({"type": "tool_use", "id": "toolu_" + uuid.uuid4().hex[:24],
                                "name": event.name, "input": {}})
            out.append({"type": "content_block_delta", "index": self.index,
                        "delta": {"type": "input_json_delta", "partial_json": event.arguments or "{}"}})
            out += self.close()
        return out


def signature(thinking: str) -> str:
    """A thinking block's signature: Anthropic's is an encrypted copy; ours is a digest of
    the text, so a client that wants one non-empty has it (clients echo it back unread)."""
    return "mlxlocal-" + hashlib.sha256(thinking.encode("utf-8", "surrogatepass")).hexdigest()[:32]


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
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            **usage_fields(stats)}  # AKV's: prompt tokens dropped from the cache, keys re-rotated


async def _events(engine, ids, params, thinking: Thinking,
                  events: AsyncIterator[StreamEvent]) -> AsyncIterator[dict | Waiting | Flush]:
    """All of a message's stream events after message_start (and the keep-alive cues, and
    the Flush that ends each wake-up's)."""
    blocks = Blocks(thinking)
    async for ev in events:
        if ev.kind == "token":
            continue
        if ev.kind == "waiting" or ev.kind == "flush":  # a keep-alive cue, sent as a ping (stream only)
            yield ev
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
    chat, thinking = chat_request(request, body, params)
    ready = await pipeline.prepare(request, chat)
    engine, ids, model, stream = ready.engine, ready.ids, chat.model, chat.stream
    # Errors before any output (context, queue, dead engine) raise here, as HTTP errors; when
    # streaming, from submit on they are error events (the response starts at once: keep-alives).
    parsed = await pipeline.run(request, ready)
    events = _events(engine, ids, params, thinking, parsed)

    if not stream:
        message = _message(model, [], len(ids))
        partial: dict[int, str] = {}
        async for ev in events:
            if not isinstance(ev, dict):  # keep-alive cues and flushes: streams only
                continue
            if ev["type"] == "content_block_start":
                message["content"].append(dict(ev["content_block"]))
            elif ev["type"] == "content_block_delta":
                block, delta = message["content"][ev["index"]], ev["delta"]
                if delta["type"] == "text_delta":
                    block["text"] += delta["text"]
                elif delta["type"] == "thinking_delta":
                    block["thinking"] += delta["thinking"]
                elif delta["type"] == "signature_delta":
                    block["signature"] = delta["signature"]
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

    async def sse():
        yield _sse({"type": "message_start", "message": _message(model, [], len(ids))})
        yield _sse({"type": "ping"})
        try:
            async for ev in events:
                if isinstance(ev, Waiting):  # Anthropic's keep-alive, the prefill progress as a comment
                    yield keepalive_comment(ev) + _sse({"type": "ping"})
                    continue
                if isinstance(ev, Flush):
                    yield ev
                    continue
                yield _sse(ev)
        except APIError as e:
            yield _sse({"type": "error", "error": {"type": "api_error", "message": e.message}})
            return
        except Exception as e:  # mid-stream: the status line is gone, report in-band
            yield _sse({"type": "error", "error": {"type": "api_error", "message": f"{type(e).__name__}: {e}"}})
            return
        yield _sse({"type": "message_stop"})

    # One write per wake-up: the events framed since the last Flush, joined.
    return StreamingResponse(coalesced(sse()), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request):
    body = await read_body(request)
    chat, _ = chat_request(request, body)
    return {"input_tokens": len((await pipeline.prepare(request, chat)).ids)}
