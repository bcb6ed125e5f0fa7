"""Ollama API: /api/chat, /api/generate, /api/tags, /api/show, /api/ps, /api/version."""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from mlxlocal import __version__
from mlxlocal.engine import SamplingParams
from mlxlocal.server import pipeline
from mlxlocal.server.constraints import Format
from mlxlocal.server.errors import APIError, read_json_object
from mlxlocal.server.generation import FLUSH, StreamEvent, coalesced
from mlxlocal.server.pipeline import check_params
from mlxlocal.server.registry import parse_duration
from mlxlocal.server.validation import (
    MAX_MESSAGES,
    MAX_TOOLS,
    boolean,
    number,
    sized_list,
    speculative,
    stop_strings,
    string,
    thinking_budget,
)

router = APIRouter()

NS = 1_000_000_000


async def read_body(request: Request) -> dict:
    return await read_json_object(request, empty_ok=True)


def now_iso(t: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if t is None else t, timezone.utc).isoformat().replace("+00:00", "Z")


# SamplingParams field -> its Ollama option (the engine's range errors name these).
_OPTION = {"max_tokens": "num_predict", "repetition_penalty": "repeat_penalty"}
_NAMES = {f: f"options.{_OPTION.get(f, f)}" for f in (
    "max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop",
    "frequency_penalty", "presence_penalty")}


def sampling_params(options: Any, context_length: int) -> SamplingParams:
    """Ollama options -> SamplingParams (Ollama's defaults where a client sends nothing).

    Ranges are the engine's (SamplingParams.validate): temperature in [0, 100], top_p in
    [1e-8, 1] (Ollama lets 0 through; here it is refused rather than guessed at), top_k at most
    the vocabulary (checked with the prompt), seed in [0, 2**63) or negative for a random one.
    num_ctx is the model's context here (the KV pool is shared): other values are ignored.
    options.speculative (extension): false opts out of the server's speculative decoding;
    options.thinking_budget (extension): a think block open after that many tokens is closed.
    """
    if options is None:
        options = {}
    if not isinstance(options, dict):
        raise APIError(400, "options: must be an object", param="options")

    def opt(key: str, default, integer: bool = False):
        return number(options, key, default, f"options.{key}", integer)

    num_predict = opt("num_predict", -1, integer=True)
    if num_predict == 0:
        raise APIError(400, "options.num_predict: must not be 0", param="options.num_predict")
    seed = opt("seed", None, integer=True)
    params = SamplingParams(
        # Negative: until the context is full (-1) or fill it (-2); the engine clips to what is left.
        max_tokens=context_length if num_predict < 0 else num_predict,
        temperature=opt("temperature", 0.8),
        top_p=opt("top_p", 0.9),
        top_k=opt("top_k", 40, integer=True),
        min_p=opt("min_p", 0.0),
        repetition_penalty=opt("repeat_penalty", 1.0),
        frequency_penalty=opt("frequency_penalty", 0.0),
        presence_penalty=opt("presence_penalty", 0.0),
        seed=seed if seed is None or seed >= 0 else None,  # Ollama: -1 is a random seed
        stop=stop_strings(options.get("stop"), "options.stop"),
        speculative=speculative(options, "options.speculative"),
        think_budget=thinking_budget(options, "options.thinking_budget"),
    )
    check_params(params, _NAMES)
    return params




# --- the model's lifetime during a request -----------------------------------------

async def acquire(request: Request, body: dict):
    """Load (or find) the model; keep it loaded while the request runs. (engine, model, load_ns)."""
    registry = request.app.state.registry
    name = string(body, "model", required=True)
    m = registry.find(name)
    keep_alive = request_keep_alive(request, body)
    t0 = time.perf_counter()
    engine = await registry.engine(name, keep_alive)
    m.expires_at = math.inf  # not unloaded mid-request; release() restarts the idle timer
    return engine, m, int((time.perf_counter() - t0) * NS)


# The shortest keep_alive a request may ask for unless the server runs with --allow-client-unload:
# Ollama's default, what its clients send. Shorter (0: unload now) would let one client unload
# the model between everyone else's turns, ending their sessions.
MIN_CLIENT_KEEP_ALIVE = 300.0


def request_keep_alive(request: Request, body: dict) -> float:
    """Like Ollama, a request without keep_alive gets the server's default, not the last one's."""
    registry = request.app.state.registry
    keep_alive = parse_duration(body.get("keep_alive"))
    if keep_alive is not None and math.isnan(keep_alive):
        raise APIError(400, f"keep_alive: must be a duration, got {body.get('keep_alive')!r}", param="keep_alive")
    if keep_alive is None:
        return registry.default_keep_alive
    floor = min(MIN_CLIENT_KEEP_ALIVE, registry.default_keep_alive)  # never less than the operator's own
    if keep_alive < floor and not request.app.state.config.allow_client_unload:
        raise APIError(400, f"keep_alive: {body['keep_alive']!r} would unload the model for every client of this "
                       f"server and end their sessions; the shortest a request may ask for here is "
                       f"{floor:g} s (the server allows unloads with --allow-client-unload)", param="keep_alive")
    return keep_alive


def release(m) -> None:
    m.expires_at = time.monotonic() + m.keep_alive


# --- chat ----------------------------------------------------------------------------

def convert_messages(messages: Any) -> list[dict]:
    sized_list(messages, "messages", MAX_MESSAGES)
    out = []
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise APIError(400, f"{where}.role: must be system, user, assistant or tool", param=f"{where}.role")
        if m.get("images"):
            raise APIError(400, f"{where}.images: images are not supported (text-only models)",
                           param=f"{where}.images")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise APIError(400, f"{where}.content: must be a string", param=f"{where}.content")
        msg: dict = {"role": m["role"], "content": content}
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            calls = []
            for j, call in enumerate(sized_list(m["tool_calls"], f"{where}.tool_calls", MAX_TOOLS)):
                fwhere = f"{where}.tool_calls.{j}.function"
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict):
                    raise APIError(400, f"{fwhere}: must be an object", param=fwhere)
                name = string(fn, "name", f"{fwhere}.name", required=True)
                arguments = fn.get("arguments") or {}
                if not isinstance(arguments, (dict, str)):
                    raise APIError(400, f"{fwhere}.arguments: must be an object", param=f"{fwhere}.arguments")
                calls.append({"id": f"call_{i}_{j}", "type": "function",
                              "function": {"name": name, "arguments": arguments}})
            if calls:
                msg["tool_calls"] = calls
        if m["role"] == "tool" and m.get("tool_name"):
            msg["name"] = string(m, "tool_name", f"{where}.tool_name")
        out.append(msg)
    if not out:
        raise APIError(400, "messages: at least one message is required", param="messages")
    return out


def _timings(t_start: float, load_ns: int, stats, n_out: int) -> dict:
    total = int((time.perf_counter() - t_start) * NS)
    prompt_ns = int(stats.ttft_s * NS) if stats else 0
    eval_ns = int(n_out / stats.decode_tps * NS) if stats and stats.decode_tps else max(0, total - load_ns - prompt_ns)
    return {"total_duration": total, "load_duration": load_ns,
            "prompt_eval_count": stats.prompt_tokens if stats else 0, "prompt_eval_duration": prompt_ns,
            "eval_count": stats.completion_tokens if stats else n_out, "eval_duration": eval_ns}


async def _pieces(events: AsyncIterator[StreamEvent], think) -> AsyncIterator[tuple[str, Any]]:
    """("content"|"thinking", text), ("tool_call", {...}) and finally ("done", (reason, stats, n))."""
    async for ev in events:
        if ev.kind == "content":
            yield "content", ev.text
        elif ev.kind == "reasoning":
            if think is not False:
                yield "thinking", ev.text
        elif ev.kind == "tool_call":
            try:
                args = json.loads(ev.arguments or "{}")
            except ValueError:
                args = {"_raw": ev.arguments}
            yield "tool_call", {"function": {"name": ev.name, "arguments": args}}
        elif ev.kind == "finish":
            yield "done", ("length" if ev.reason == "length" else "stop", ev.stats, len(ev.tokens))
        elif ev.kind == "waiting":
            yield "waiting", None
        elif ev.kind == "flush":
            yield "flush", None


async def _respond(request, body, ready: pipeline.Prepared, m, load_ns, t_start, think, chat: bool):
    try:  # bad requests fail here, as HTTP errors
        events = await pipeline.run(request, ready)
    except BaseException:
        release(m)
        raise
    pieces = _pieces(events, think)
    model = body["model"]

    def base() -> dict:
        return {"model": model, "created_at": now_iso()}

    def message(content: str = "", thinking: str = "", tool_calls: list | None = None) -> dict:
        msg: dict = {"role": "assistant", "content": content}
        if thinking:
            msg["thinking"] = thinking
        if tool_calls:
            msg["tool_calls"] = tool_calls
        return msg

    def final(reason, stats, n) -> dict:
        return {"done": True, "done_reason": reason, **_timings(t_start, load_ns, stats, n)}

    if not body.get("stream", True):  # checked by _flags
        content, thinking, calls = [], [], []
        try:
            async for kind, value in pieces:
                if kind == "content":
                    content.append(value)
                elif kind == "thinking":
                    thinking.append(value)
                elif kind == "tool_call":
                    calls.append(value)
                else:
                    done = final(*value)
        finally:
            release(m)
        text, reasoning = "".join(content), "".join(thinking).strip()
        if chat:
            out = {**base(), "message": message(text.strip() if calls else text, reasoning, calls), **done}
        else:
            out = {**base(), "response": text, **({"thinking": reasoning} if reasoning else {}), **done}
        return JSONResponse(out)

    def line(obj: dict) -> str:
        return json.dumps(obj) + "\n"

    async def stream():
        try:
            async for kind, value in pieces:
                if kind == "flush":  # the end of a wake-up's lines: they go out as one write
                    yield FLUSH
                elif kind == "done":
                    last = {**base(), **final(*value)}
                    last.update({"message": message()} if chat else {"response": ""})
                    yield line(last)
                elif kind == "waiting":  # a keep-alive: an empty chunk, which Ollama's clients accept
                    empty = {"message": message()} if chat else {"response": ""}
                    yield line({**base(), **empty, "done": False})
                elif chat:
                    msg = (message(content=value) if kind == "content" else
                           message(thinking=value) if kind == "thinking" else message(tool_calls=[value]))
                    yield line({**base(), "message": msg, "done": False})
                elif kind == "tool_call":
                    continue  # /api/generate has no tools
                else:
                    yield line({**base(), ("response" if kind == "content" else "thinking"): value,
                                **({"response": ""} if kind == "thinking" else {}), "done": False})
        except Exception as e:  # mid-stream: the status line is gone, report in-band
            message_text = e.message if isinstance(e, APIError) else f"{type(e).__name__}: {e}"
            yield line({"error": message_text})
        finally:
            release(m)

    return StreamingResponse(coalesced(stream()), media_type="application/x-ndjson")


def _flags(body: dict, *names: str):
    """Strict booleans (think may also be a level, as in Ollama's API)."""
    boolean(body, "stream", True)
    for name in names:
        boolean(body, name, None)
    think = body.get("think")
    if think is not None and not isinstance(think, bool) and think not in ("low", "medium", "high"):
        raise APIError(400, f"think: must be true, false, 'low', 'medium' or 'high', got {think!r}", param="think")


@router.post("/api/chat")
async def chat(request: Request):
    t_start = time.perf_counter()
    body = await read_body(request)
    # Before the model loads: a bad format is a 400 at once.
    constraint = await pipeline.output_grammar(Format("ollama", body.get("format")))
    _flags(body)
    messages = convert_messages(body["messages"]) if body.get("messages") else []
    tools = body.get("tools") or None
    if tools is not None:
        for i, t in enumerate(sized_list(tools, "tools", MAX_TOOLS)):
            if not isinstance(t, dict):
                raise APIError(400, f"tools.{i}: must be an object", param=f"tools.{i}")
            function = t.get("function")
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                # The pipeline (tool pruning, the call grammar) finds a tool by this name.
                raise APIError(400, f"tools.{i}.function.name: required, a non-empty string",
                               param=f"tools.{i}.function.name")
    engine, m, load_ns = await acquire(request, body)
    try:
        if not messages:  # Ollama: an empty chat loads (or, with keep_alive 0, unloads) the model
            return JSONResponse(_load_reply(body, m, chat=True))
        params = sampling_params(body.get("options"), engine.context_length)
        chat = pipeline.ChatRequest(body["model"], "/api/chat", messages, params, {**_NAMES, "prompt": "messages"},
                                    "messages", tools, format=constraint, stream=bool(body.get("stream", True)))
        ready = await pipeline.prepare(request, chat, engine)
    except BaseException:
        release(m)
        raise
    return await _respond(request, body, ready, m, load_ns, t_start, body.get("think"), chat=True)


def _load_reply(body: dict, m, chat: bool) -> dict:
    release(m)
    unload = m.keep_alive == 0
    reply = {"model": body["model"], "created_at": now_iso(), "done": True,
             "done_reason": "unload" if unload else "load"}
    reply.update({"message": {"role": "assistant", "content": ""}} if chat else {"response": ""})
    return reply


@router.post("/api/generate")
async def generate(request: Request):
    t_start = time.perf_counter()
    body = await read_body(request)
    constraint = await pipeline.output_grammar(Format("ollama", body.get("format")))
    _flags(body, "raw")
    for unsupported in ("suffix", "images", "template"):
        if body.get(unsupported):
            raise APIError(400, f"{unsupported}: not supported by this server", param=unsupported)
    prompt = string(body, "prompt") or ""
    system = string(body, "system")
    registry = request.app.state.registry
    if not prompt:
        m = registry.find(string(body, "model", required=True))
        if request_keep_alive(request, body) == 0:  # unload: no need to load it first
            m.keep_alive, m.expires_at = 0.0, 0.0
            return {"model": body["model"], "created_at": now_iso(), "response": "", "done": True,
                    "done_reason": "unload"}
    engine, m, load_ns = await acquire(request, body)
    try:
        if not prompt:
            return JSONResponse(_load_reply(body, m, chat=False))
        params = sampling_params(body.get("options"), engine.context_length)
        stream = bool(body.get("stream", True))
        if body.get("raw"):  # the prompt as is
            completion = pipeline.ChatRequest(body["model"], "/api/generate", [], params, {**_NAMES, "prompt": "prompt"},
                                              "prompt", format=constraint, stream=stream, text=prompt)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}]
            completion = pipeline.ChatRequest(body["model"], "/api/generate", messages, params,
                                              {**_NAMES, "prompt": "prompt"}, "prompt", format=constraint,
                                              stream=stream)
        ready = await pipeline.prepare(request, completion, engine)
    except BaseException:
        release(m)
        raise
    return await _respond(request, body, ready, m, load_ns, t_start, body.get("think"), chat=False)


# --- model listings -------------------------------------------------------------------

def _model_dir(m) -> Path | None:
    if m.info is not None:
        return Path(m.info.path)
    p = Path(m.spec).expanduser()
    return p if p.is_dir() else None


def _size(m) -> int:
    if m.info is not None:
        return int(m.info.weights.total_bytes)
    d = _model_dir(m)
    return sum(f.stat().st_size for f in d.glob("*.safetensors")) if d else 0


def _digest(m) -> str:
    d = _model_dir(m)
    stamp = f"{m.spec}|{_size(m)}|{d.stat().st_mtime if d else ''}"
    return hashlib.sha256(stamp.encode()).hexdigest()


def _modified(m) -> str:
    d = _model_dir(m)
    return now_iso(d.stat().st_mtime if d else None)


def _param_size(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _quant_level(info) -> str:
    q = (info.quantization or "").lower() if info else ""
    if not q or q == "none":
        return {"float16": "F16", "bfloat16": "BF16", "float32": "F32"}.get(info.dtype if info else "", "unknown")
    digits = "".join(ch for ch in q.split("-")[0].split()[0] if ch.isdigit())
    return f"Q{digits}" if digits else q.upper()


def _details(m) -> dict:
    info = m.info
    family = info.model_type if info else ""
    return {"parent_model": "", "format": "safetensors", "family": family,
            "families": [family] if family else None,
            "parameter_size": _param_size(info.n_params) if info else "",
            "quantization_level": _quant_level(info) if info else ""}


def _entry(m) -> dict:
    return {"name": m.name, "model": m.name, "modified_at": _modified(m), "size": _size(m),
            "digest": _digest(m), "details": _details(m)}


@router.get("/api/tags")
async def tags(request: Request):
    return {"models": [_entry(m) for m in request.app.state.registry.models]}


@router.get("/api/ps")
async def ps(request: Request):
    out = []
    for m in request.app.state.registry.loaded():
        left = m.expires_at - time.monotonic()
        if math.isinf(left) or left > 10 * 365 * 86400:
            expires = "2318-01-01T00:00:00Z"  # what Ollama reports for "forever"
        else:
            expires = (datetime.now(timezone.utc) + timedelta(seconds=max(0.0, left))).isoformat().replace(
                "+00:00", "Z")
        out.append({**_entry(m), "expires_at": expires, "size_vram": _size(m),
                    "context_length": m.info.context_length if m.info else 0})
    return {"models": out}


@router.post("/api/show")
async def show(request: Request):
    body = await read_body(request)
    name = string(body, "model") or string(body, "name", required=True)
    registry = request.app.state.registry
    m = registry.find(name)
    engine = m.engine
    if m.info is None:  # never loaded: load it to read what it is
        engine = await registry.engine(name)
    info = m.info
    template = (engine.chat_format.chat_template if engine is not None else None) or ""
    capabilities = m.capabilities or ["completion"]
    arch = info.model_type
    model_info = {"general.architecture": arch, "general.parameter_count": info.n_params,
                  "general.basename": info.name, f"{arch}.context_length": info.context_length,
                  "general.file_type": info.dtype, "general.quantization": info.quantization}
    parameters = _default_parameters(Path(info.path))
    # The model's directory only when the operator asks (--expose-paths); else the name it is served as.
    source = info.path if request.app.state.config.expose_paths else m.name
    return {"license": "", "modelfile": f"# mlxlocal model\nFROM {source}\n", "parameters": parameters,
            "template": template if isinstance(template, str) else json.dumps(template),
            "details": _details(m), "model_info": model_info, "capabilities": capabilities,
            "modified_at": _modified(m)}


def _default_parameters(path: Path) -> str:
    """generation_config.json's sampling defaults, in Modelfile PARAMETER style."""
    try:
        config = json.loads((path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return ""
    names = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
             "repetition_penalty": "repeat_penalty"}
    return "\n".join(f"{names[k]:<16} {config[k]}" for k in names if k in config)


@router.get("/api/version")
async def version():
    return {"version": __version__}
