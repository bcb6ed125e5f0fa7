"""`mlxlocal bench replay FILE.jsonl --url URL`: replay recorded client traffic, turn by turn.

The file is JSON Lines, one request per line, sent in file order, one at a time (a coding
agent's conversation is sequential turns, each extending the previous prompt, which is what a
prefix cache is for):

    {"path": "/v1/messages", "body": {...}, "headers": {"anthropic-beta": "..."}}
    {"path": "/v1/chat/completions", "body": {...}}
    {"path": "/v1/responses", "body": {...}}

`path` is one of those three routes (a query string is kept: /v1/messages?beta=true);
`headers` is optional (Host, Content-Length, Connection and encodings are dropped). With
`--replay-path PATH` a line may also be a bare request body, sent to PATH. Blank lines are
skipped. Every body is sent with "stream": true (chat completions also ask for usage with
stream_options.include_usage); `--model` replaces each body's model.

Per turn: TTFT (request sent -> first event carrying text, reasoning or a tool call, parsed per
dialect by bench/sse.py), total time, and prompt, cached and output tokens as the server
reported them in its usage (Anthropic: input_tokens + cache_read_input_tokens +
cache_creation_input_tokens, cached = cache_read_input_tokens; chat:
usage.prompt_tokens_details.cached_tokens; Responses: usage.input_tokens_details.cached_tokens).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from mlxlocal.bench.common import summarize
from mlxlocal.bench.endpoint import RequestRecord, _base_url, _stream_one
from mlxlocal.errors import EndpointBenchError

ROUTES = {"/v1/chat/completions": "chat", "/v1/messages": "anthropic", "/v1/responses": "responses"}
DROPPED_HEADERS = {"host", "content-length", "connection", "accept-encoding", "transfer-encoding"}


@dataclass
class ReplayRequest:
    line: int
    path: str
    body: dict
    headers: dict = field(default_factory=dict)

    @property
    def dialect(self) -> str:
        return ROUTES[self.path.split("?", 1)[0]]


def _route(path: str, where: str) -> str:
    if not isinstance(path, str) or path.split("?", 1)[0] not in ROUTES:
        raise EndpointBenchError(f"{where}: path must be one of {', '.join(ROUTES)}, not {path!r}")
    return path


def load_replay(file: str, default_path: str | None = None) -> list[ReplayRequest]:
    p = Path(file)
    if not p.is_file():
        raise EndpointBenchError(f"replay file {file} does not exist")
    if default_path is not None:
        _route(default_path, "--replay-path")
    out: list[ReplayRequest] = []
    for n, raw in enumerate(p.read_text().splitlines(), 1):
        if not raw.strip():
            continue
        where = f"{file}:{n}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise EndpointBenchError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise EndpointBenchError(f"{where}: a line must be a JSON object")
        if "path" in obj or "body" in obj:
            if not isinstance(obj.get("body"), dict):
                raise EndpointBenchError(f"{where}: 'body' must be an object")
            headers = obj.get("headers") or {}
            if not isinstance(headers, dict):
                raise EndpointBenchError(f"{where}: 'headers' must be an object")
            path = obj.get("path", default_path)
            if path is None:
                raise EndpointBenchError(f"{where}: no 'path' (or give --replay-path)")
            out.append(ReplayRequest(n, _route(path, where), obj["body"], {str(k): str(v) for k, v in headers.items()}))
        elif default_path is not None:
            out.append(ReplayRequest(n, default_path, obj))
        else:
            raise EndpointBenchError(f"{where}: expected {{\"path\": ..., \"body\": {{...}}}}; "
                                     "for bare request bodies give --replay-path")
    if not out:
        raise EndpointBenchError(f"replay file {file} has no requests")
    return out


MAX_TOKEN_FIELDS = {"chat": ("max_tokens", "max_completion_tokens"), "anthropic": ("max_tokens",),
                    "responses": ("max_output_tokens",)}


def prepare(req: ReplayRequest, model: str | None = None, api_key: str | None = None,
            max_tokens: int | None = None) -> tuple[dict, dict]:
    """The body and headers actually sent for one recorded request; `max_tokens` caps the
    reply's length (recorded agents ask for up to 32k tokens: TTFT is what a replay measures)."""
    body = dict(req.body, stream=True)
    if model:
        body["model"] = model
    if max_tokens is not None:
        fields = MAX_TOKEN_FIELDS.get(req.dialect, ("max_tokens",))
        present = [f for f in fields if f in body]
        for f in present or fields[:1]:
            body[f] = min(int(body.get(f) or max_tokens), max_tokens)
    if req.dialect == "chat":
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    headers = {"Accept": "text/event-stream"}
    if req.dialect == "anthropic":
        headers["anthropic-version"] = "2023-06-01"
    headers.update({k: v for k, v in req.headers.items() if k.lower() not in DROPPED_HEADERS})
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
        if req.dialect == "anthropic":
            headers["x-api-key"] = api_key
    return body, headers


async def measure_replay(url: str, file: str, replay_path: str | None = None, model: str | None = None,
                         api_key: str | None = None, request_timeout: float = 600.0,
                         transport: httpx.AsyncBaseTransport | None = None, max_tokens: int | None = None) -> dict:
    requests = load_replay(file, replay_path)
    base = _base_url(url)
    turns: list[dict] = []
    http_timeout = httpx.Timeout(connect=30.0, read=request_timeout, write=30.0, pool=None)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=http_timeout, trust_env=False, transport=transport) as client:
        for i, req in enumerate(requests):
            body, headers = prepare(req, model, api_key, max_tokens)
            rec = RequestRecord(index=i)
            try:
                await _stream_one(client, base + req.path, headers, body, rec, dialect=req.dialect)
            except httpx.HTTPError as e:
                rec.error, rec.error_message = type(e).__name__, str(e)[:300]
            acc = rec.account
            if rec.error is None and acc is not None and acc.error is not None:
                rec.error, rec.error_message = acc.error, acc.error_message
            usage = acc.usage_summary() if acc is not None else {}
            turns.append({
                "turn": i + 1, "line": req.line, "path": req.path, "model": body.get("model"),
                "status": "error" if rec.error else "ok", "error": rec.error, "error_message": rec.error_message,
                "http_status": rec.http_status,
                "ttft_s": acc.ttft if acc is not None else None,
                "total_s": acc.e2e if acc is not None else None,
                "prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": usage.get("cached_tokens"),
                "output_tokens": usage.get("output_tokens"),
                "finish_reason": acc.finish_reason if acc is not None else None,
            })
    duration = time.perf_counter() - t0
    ok = [t for t in turns if t["status"] == "ok"]

    def total(key: str) -> int | None:
        values = [t[key] for t in ok if t[key] is not None]
        return sum(values) if values else None

    return {
        "url": base, "file": file, "turns": turns, "requests": len(turns), "completed": len(ok),
        "failed": len(turns) - len(ok), "duration_s": duration,
        "total_prompt_tokens": total("prompt_tokens"), "total_cached_tokens": total("cached_tokens"),
        "total_output_tokens": total("output_tokens"),
        "ttft_s": summarize([t["ttft_s"] for t in ok if t["ttft_s"] is not None]),
        "notes": ["TTFT: request sent -> first event carrying text, reasoning or a tool call",
                  "token counts are the server's usage; Anthropic prompt = input_tokens + "
                  "cache_read_input_tokens + cache_creation_input_tokens"],
    }


def print_replay_table(result: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()

    def ms(v):
        return "-" if v is None else f"{v * 1000:.1f}"

    def n(v):
        return "-" if v is None else str(v)

    table = Table(title=f"Replay: {result['file']} @ {result['url']}")
    for col in ("turn", "route", "TTFT (ms)", "total (ms)", "prompt tok", "cached tok", "output tok", "status"):
        table.add_column(col, justify="left" if col in ("route", "status") else "right")
    for t in result["turns"]:
        status = "ok" if t["status"] == "ok" else f"{t['error']}: {(t['error_message'] or '')[:60]}"
        table.add_row(str(t["turn"]), t["path"], ms(t["ttft_s"]), ms(t["total_s"]), n(t["prompt_tokens"]),
                      n(t["cached_tokens"]), n(t["output_tokens"]), status)
    console.print(table)
    console.print(f"{result['completed']}/{result['requests']} turns ok in {result['duration_s']:.2f} s; "
                  f"prompt {n(result['total_prompt_tokens'])} tokens, cached {n(result['total_cached_tokens'])}, "
                  f"output {n(result['total_output_tokens'])}", highlight=False)


def run_replay_bench(url: str, file: str, replay_path: str | None = None, model: str | None = None,
                     as_json: bool = False, api_key: str | None = None, max_tokens: int | None = None) -> dict:
    result = asyncio.run(measure_replay(url, file, replay_path, model, api_key, max_tokens=max_tokens))
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    else:
        print_replay_table(result)
    return result
