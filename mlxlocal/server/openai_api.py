"""The OpenAI dialect: /v1/models, /v1/chat/completions, /v1/completions.

Requests are pydantic models, so the OpenAPI schema documents what is accepted; anything
a client gets wrong is a 400 in OpenAI's error format (never a 5xx).

Notes on behaviour:
- temperature defaults to 1.0 and top_p to 1.0, as in OpenAI's API; max_tokens defaults to
  4096 for chat (the engine clips it to what is left of the context) and 16 for completions.
- frequency_penalty and presence_penalty count the tokens generated so far (as OpenAI);
  logit_bias maps token-id strings to a bias in [-100, 100] added to that token's logit.
- "speculative": false (extension, validation.speculative) opts the request out of the
  server's speculative decoding (--draft-model / --prompt-lookup).
- top_k, min_p and repetition_penalty are accepted as extensions; user, metadata, store are
  accepted and ignored; parallel_tool_calls=false limits a forced call (below) to one.
- Bodies go through the shared checks (validation.py) before FastAPI parses them: nested
  at most 64 deep, valid UTF-8 with no lone surrogates; numbers must be finite, booleans
  true/false; ranges the engine cannot honour (top_k over the vocabulary, seed outside
  [0, 2**63)) are 400s naming the field.
- tool_choice "none" renders the prompt without tools (and tool calls are not parsed);
  "required" or a named function forces a call: decoding is constrained to the family's
  tool-call syntax with the arguments under the tool's parameters schema (strict tools
  exactly), see constraints.py; a named one offers only that tool. With "auto" the model
  may answer in text. A forced call wins over a response_format in the same request.
- response_format (json_object, json_schema with strict) and the extension fields
  structured_outputs / guided_* / grammar / regex constrain the output (see constraints.py);
  an invalid or unsupported schema is a 400 naming the keyword. n > 1 is refused (400).
- AKV cache edits (prompt.py, docs/akv.md): the X-Session-Id header or session_id field names a session
  (its KV pinned between turns; 409 while it generates); drop_message / reposition /
  drop_rule index `messages` and need one; usage adds drop_skipped_tokens, repos_tokens.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Annotated, Any, Literal, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool

from mlxlocal.engine import ChatFormat, Chunk, SamplingParams
from mlxlocal.server import model_cards, pipeline
from mlxlocal.server.constraints import Format
from mlxlocal.server.errors import APIError
from mlxlocal.server.generation import (
    FLUSH,
    Flush,
    StreamEvent,
    Waiting,
    coalesced,
    keepalive_comment,
    usage_fields,
)
from mlxlocal.server.pipeline import check_params, template_arguments
from mlxlocal.server.prompt import Origins
from mlxlocal.server.validation import (
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    MAX_TOOLS,
    CheckedBodyRoute,
    speculative,
    stop_strings,
    thinking_budget,
)

router = APIRouter(route_class=CheckedBodyRoute)

DEFAULT_CHAT_MAX_TOKENS = 4096
DEFAULT_COMPLETION_MAX_TOKENS = 16
MAX_STOP = 16


# --- request models -------------------------------------------------------------------
class _Lenient(BaseModel):
    """OpenAI clients send fields this server does not know; ignore them rather than fail."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: StrictBool = False


class ResponseFormat(_Lenient):
    type: str


Probability = Annotated[float, Field(gt=0, le=1)]


class SamplingFields(_Lenient):
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: Probability | None = None
    top_k: int | None = Field(None, ge=0, lt=2**31,
                              description="extension: sample from the k most likely tokens (0 = off)")
    min_p: float | None = Field(None, ge=0, le=1, description="extension")
    repetition_penalty: float | None = Field(None, gt=0, description="extension")
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = Field(None, description=f"up to {MAX_STOP} stop strings of at most "
                                                           f"{MAX_STOP_CHARS} characters")
    n: int | None = Field(None, ge=1, description="only 1 is supported")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id (a string) -> bias in [-100, 100]")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1, lt=2**31)
    max_completion_tokens: int | None = Field(None, ge=1, lt=2**31)
    logprobs: StrictBool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(None, ge=1, lt=2**31)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    response_format: ResponseFormat | None = None


# --- helpers ---------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        if not key.isascii() or not key.isdigit():
            raise APIError(400, f"logit_bias: keys must be token ids (decimal integers), got {key!r}",
                           param="logit_bias")
        out[int(key)] = value
    return out


def _sampling(req: SamplingFields, max_tokens: int, logprobs: int | None, names: dict[str, str]) -> SamplingParams:
    """The request's sampling fields as SamplingParams, range-checked by the engine's rules."""
    if req.n not in (None, 1):
        raise APIError(400, f"n={req.n} is not supported: this server returns one choice per request", param="n")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0,
        logit_bias=_logit_bias(req.logit_bias),
        seed=req.seed,
        stop=stop_strings(req.stop, "stop"),  # how many: SamplingParams.validate
        logprobs=logprobs,
        speculative=speculative(req.model_extra),
    )
    check_params(params, names)
    return params


def _usage(stats) -> dict:
    prompt = stats.prompt_tokens if stats else 0
    completion = stats.completion_tokens if stats else 0
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens if stats else 0},
        **usage_fields(stats),  # AKV's: prompt tokens dropped from the cache, keys re-rotated
    }


def _finish_reason(reason: str | None, tool_calls: bool) -> str:
    if reason == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _stream_response(body: AsyncGenerator[str | Flush, None]) -> StreamingResponse:
    """One write per wake-up: the body's pieces up to each Flush joined (generation.coalesced)."""
    return StreamingResponse(coalesced(body), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _error_event(e: BaseException) -> str:
    if isinstance(e, APIError):
        kind = "invalid_request_error" if e.status < 500 else "server_error"  # a 503: the engine stopped
        return _sse({"error": {"message": e.message, "type": kind, "param": e.param, "code": e.code}})
    return _sse({"error": {"message": f"internal error: {type(e).__name__}: {e}", "type": "server_error",
                           "param": None, "code": None}})


class _TokenText:
    """Token id -> text (cached), for logprobs."""

    def __init__(self, fmt: ChatFormat):
        self.fmt = fmt
        self.cache: dict[int, str] = {}

    def __call__(self, token: int) -> str:
        text = self.cache.get(token)
        if text is None:
            text = self.cache[token] = self.fmt.decode([token])
        return text


def _chat_logprob(chunk: Chunk, text_of: _TokenText) -> dict:
    assert chunk.token is not None  # a Token event's chunk
    token = text_of(chunk.token)
    return {
        "token": token,
        "logprob": chunk.logprob,
        "bytes": list(token.encode("utf-8")),
        "top_logprobs": [{"token": (t := text_of(i)), "logprob": lp, "bytes": list(t.encode("utf-8"))}
                         for i, lp in (chunk.top_logprobs or [])],
    }


# --- models (shared with Anthropic clients: model_cards.py) ------------------------------------
@router.get("/v1/models")
async def list_models(request: Request):
    models = request.app.state.registry.models
    if model_cards.wants_anthropic(request):
        return model_cards.anthropic_list(models)
    return {"object": "list", "data": [model_cards.openai_card(m) for m in models]}


@router.get("/v1/models/{model_id:path}")
async def get_model(model_id: str, request: Request):
    # Under the name asked for, like every response: an alias is a model of that id to clients.
    if not model_cards.wants_anthropic(request):
        return model_cards.openai_card(request.app.state.registry.find(model_id), model_id)
    try:
        return model_cards.anthropic_card(request.app.state.registry.find(model_id), model_id)
    except APIError as e:  # the path is OpenAI's: answer in the format the client reads
        return JSONResponse({"type": "error", "error": {"type": "not_found_error", "message": e.message}},
                            status_code=e.status)


# --- chat ------------------------------------------------------------------------------------
def _text_of(content: str | list[ContentPart] | None, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text":
            raise APIError(400, f"{where}: content part type '{part.type}' is not supported "
                                f"(only 'text')", param=where)
        if part.text is None:
            raise APIError(400, f"{where}: a 'text' content part needs 'text'", param=where)
        texts.append(part.text)
    return "\n".join(texts)


def _template_messages(messages: list[ChatMessage], origins: Origins | None = None) -> list[dict]:
    """`origins` (AKV drop fields): message i of the request is chat message i."""
    out = []
    for i, m in enumerate(messages):
        where = f"messages.{i}.content"
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                               "content": _text_of(m.content, where)}
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(400, f"messages.{i}: only assistant messages carry tool_calls",
                               param=f"messages.{i}.tool_calls")
            msg["tool_calls"] = [
                {"id": c.id or f"call_{i}_{k}", "type": "function",
                 "function": {"name": c.function.name, "arguments": template_arguments(c.function.arguments)}}
                for k, c in enumerate(m.tool_calls)
            ]
        elif m.content is None and m.role != "assistant":
            raise APIError(400, f"{where}: a {m.role} message needs content", param=where)
        if msg["content"] is None:
            msg["content"] = ""
        if m.role == "tool":
            msg["tool_call_id"] = m.tool_call_id or ""
        if m.name:
            msg["name"] = m.name
        out.append(msg)
        if origins is not None:
            origins.add(msg, i)
    if origins is not None:
        origins.size = len(out)
    return out


def _chat_request(req: ChatCompletionRequest) -> pipeline.ChatRequest:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs requires logprobs: true", param="top_logprobs")
    origins = Origins()
    messages = _template_messages(req.messages, origins)
    max_tokens = req.max_completion_tokens or req.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    names = {"max_tokens": "max_completion_tokens" if req.max_completion_tokens else "max_tokens",
             "logprobs": "top_logprobs", "prompt": "messages"}
    params = _sampling(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None, names)
    params.think_budget = thinking_budget(req.model_extra)
    choice = req.tool_choice
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    extra = req.model_extra or {}
    rf = req.response_format.model_dump() if req.response_format is not None else None
    return pipeline.ChatRequest(
        req.model, "/v1/chat/completions", messages, params, names, "messages", tools,
        pipeline.ToolChoice(choice if isinstance(choice, str) else "auto", named, req.parallel_tool_calls is not False),
        Format("openai", rf, extra), cache_fields=extra, origins=origins, stream=bool(req.stream))


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, request: Request):
    ready = await pipeline.prepare(request, _chat_request(req))
    events = await pipeline.run(request, ready)
    params = ready.params
    assert params is not None  # a chat request has them (pipeline.run checked)
    meta = {"id": _new_id("chatcmpl"), "created": int(time.time()), "model": req.model}
    text_of = _TokenText(ready.engine.chat_format)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return _stream_response(_chat_stream(events, meta, params, include_usage, text_of))
    return await _chat_whole(events, meta, params, text_of)


async def _chat_whole(events: AsyncIterator[StreamEvent], meta: dict, params: SamplingParams, text_of) -> dict:
    content, reasoning, calls, logprobs = [], [], [], []
    async for e in events:
        if e.kind == "token":
            if params.logprobs is not None:
                logprobs.append(_chat_logprob(e.chunk, text_of))
        elif e.kind == "content":
            content.append(e.text)
        elif e.kind == "reasoning":
            reasoning.append(e.text)
        elif e.kind == "tool_call":
            calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": e.arguments}})
        elif e.kind == "finish":  # last (no keep-alives or flushes: not a stream)
            done = e
    message: dict[str, Any] = {"role": "assistant", "content": "".join(content)}
    if reasoning:
        message["reasoning_content"] = "".join(reasoning).rstrip()
    if calls:
        message["tool_calls"] = calls
        if not message["content"].strip():
            message["content"] = None
    choice = {
        "index": 0,
        "message": message,
        "logprobs": {"content": logprobs, "refusal": None} if params.logprobs is not None else None,
        "finish_reason": _finish_reason(done.reason, bool(calls)),
    }
    return {**meta, "object": "chat.completion", "choices": [choice], "usage": _usage(done.stats)}


async def _chat_stream(events: AsyncIterator[StreamEvent], meta: dict, params: SamplingParams,
                       include_usage: bool, text_of) -> AsyncGenerator[str | Flush, None]:
    base = {**meta, "object": "chat.completion.chunk"}
    pending_logprobs: list[dict] = []  # sent with the next delta
    n_calls = 0

    def delta_chunk(delta: dict, finish: str | None = None) -> str:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        if pending_logprobs:
            choice["logprobs"] = {"content": list(pending_logprobs), "refusal": None}
            pending_logprobs.clear()
        return _sse({**base, "choices": [choice]})

    started = False
    try:
        async for e in events:
            if e.kind == "flush":  # the end of a wake-up's events: what is framed goes out
                yield e
                continue
            if e.kind == "waiting":  # no output yet (or for a while): a keep-alive, not a chunk
                yield keepalive_comment(e)
                continue
            if not started:  # with the first output, as before keep-alives: clients time the first chunk
                started = True
                yield _sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
            if e.kind == "token":
                if params.logprobs is not None:
                    pending_logprobs.append(_chat_logprob(e.chunk, text_of))
            elif e.kind == "tool_call":
                yield delta_chunk({"tool_calls": [{"index": n_calls, "id": e.id, "type": "function",
                                                   "function": {"name": e.name, "arguments": e.arguments}}]})
                n_calls += 1
            elif e.kind == "content" or e.kind == "reasoning":
                yield delta_chunk({"reasoning_content" if e.kind == "reasoning" else "content": e.text})
            else:
                yield delta_chunk({}, _finish_reason(e.reason, n_calls > 0))
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": _usage(e.stats)})
    except Exception as e:  # after the headers went out: report in the stream
        yield _error_event(e)
    yield "data: [DONE]\n\n"


# --- legacy completions -------------------------------------------------------------------------
def _completion_prompt(req: CompletionRequest) -> tuple[str | None, list[int] | None]:
    """The prompt as (text, None) or (None, token ids)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return None, cast(list[int], prompt)  # all ints (mypy does not narrow on all())
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, f"prompt: exactly one prompt per request is supported (got {len(prompt)})",
                           param="prompt")
        prompt = cast(list[str], prompt)[0]  # not all ints, so the strings
    if not prompt:
        raise APIError(400, "prompt: the prompt is empty", param="prompt")
    return prompt, None


def _completion_logprobs(entries: list[tuple[Chunk, str]], text_of, offset: int) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    for chunk, _ in entries:
        token = text_of(chunk.token)
        tokens.append(token)
        token_logprobs.append(chunk.logprob)
        top.append({text_of(i): lp for i, lp in (chunk.top_logprobs or [])})
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def _batch_logprobs(batch: list[Chunk], text_of, offset: int) -> dict | None:
    """_completion_logprobs of a wake-up's chunks, each at its own text's offset; None without tokens."""
    out: dict | None = None
    for chunk in batch:
        if chunk.token is not None:
            one = _completion_logprobs([(chunk, chunk.text)], text_of, offset)
            out = one if out is None else {k: out[k] + one[k] for k in out}
        offset += len(chunk.text)
    return out


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    if req.suffix:
        raise APIError(400, "suffix is not supported by this server", param="suffix")
    if req.best_of not in (None, 1):
        raise APIError(400, f"best_of={req.best_of} is not supported (only 1)", param="best_of")
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported (no prompt logprobs)", param="echo")
    names = {"prompt": "prompt"}
    params = _sampling(req, req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS, req.logprobs, names)
    text, token_ids = _completion_prompt(req)
    rf = req.response_format.model_dump() if req.response_format is not None else None
    completion = pipeline.ChatRequest(req.model, "/v1/completions", [], params, names, "prompt",
                                      format=Format("openai", rf, req.model_extra or {}), stream=bool(req.stream),
                                      text=text, token_ids=token_ids, parsed=False)
    ready = await pipeline.prepare(request, completion)
    engine, ids = ready.engine, ready.ids
    echo = engine.decode(ids) if req.echo else ""
    chunks = await pipeline.run_chunks(request, ready)
    meta = {"id": _new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": req.model}
    text_of = _TokenText(engine.chat_format)
    want_logprobs = params.logprobs is not None
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def stream():
            offset, last = len(echo), None
            try:
                if echo:
                    yield _sse({**meta, "choices": [{"index": 0, "text": echo, "logprobs": None,
                                                     "finish_reason": None}]})
                async for batch in chunks:
                    if isinstance(batch, Waiting):
                        yield keepalive_comment(batch)
                        yield FLUSH
                        continue
                    # A wake-up's chunks, framed together: one event, its text and logprobs.
                    last = batch[-1]
                    text = "".join(chunk.text for chunk in batch)
                    lp = _batch_logprobs(batch, text_of, offset) if want_logprobs else None
                    offset += len(text)
                    finish = _finish_reason(last.finish_reason, False) if last.finish_reason else None
                    if text or lp or finish:
                        yield _sse({**meta, "choices": [{"index": 0, "text": text, "logprobs": lp,
                                                         "finish_reason": finish}]})
                    if finish is None:
                        yield FLUSH
                if include_usage:
                    yield _sse({**meta, "choices": [], "usage": _usage(last.stats if last else None)})
            except Exception as e:
                yield _error_event(e)
            yield "data: [DONE]\n\n"

        return _stream_response(stream())
    texts, entries, last = [echo], [], None
    async for batch in chunks:
        if isinstance(batch, Waiting):  # none come: keep-alives are for streams
            continue
        for chunk in batch:
            last = chunk
            texts.append(chunk.text)
            if want_logprobs and chunk.token is not None:
                entries.append((chunk, chunk.text))
    choice = {
        "index": 0,
        "text": "".join(texts),
        "logprobs": _completion_logprobs(entries, text_of, len(echo)) if want_logprobs else None,
        "finish_reason": _finish_reason(last.finish_reason if last else None, False),
    }
    return {**meta, "choices": [choice], "usage": _usage(last.stats if last else None)}
