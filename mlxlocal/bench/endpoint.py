"""Benchmark any OpenAI-compatible chat endpoint (mlxlocal serve, vLLM, SGLang, Ollama /v1,
llama-server) by streaming `POST {url}/v1/chat/completions`.

What is measured, and how:

- Every read from the socket is stamped with `time.perf_counter()` on arrival; the SSE parser
  (`mlxlocal.bench.sse`) gives each event the time of the read that completed it.
- TTFT: request sent -> first event carrying content, reasoning_content or tool_calls (the
  role-only opening chunk does not count).
- Generation time: first -> last output-bearing event. The finish chunk, the usage chunk and
  `[DONE]` are excluded, so a delay after the last token does not change TPOT or decode tok/s.
- TPOT: generation time / (completion_tokens - 1). ITL: gaps between output-bearing events;
  one event may carry several tokens, so ITL is per event, not per token.
- Token counts come from the server's `usage` (asked for with stream_options.include_usage);
  when a server sends none, they are counted with a tokenizer (`tokenizer=` or the model name,
  via transformers) or, failing that, estimated as characters / 4. The output says which.
- An SSE chunk is never taken for a token.

This module runs the requests and aggregates them; prompts.py makes the prompts and counts
tokens without usage, common.py has the percentiles, report.py prints the table and plot.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from mlxlocal.bench.common import summarize
from mlxlocal.bench.prompts import Prompt, TokenCounter, load_prompt_file, synthetic_prompts
from mlxlocal.bench.report import print_endpoint_table, require_matplotlib, write_endpoint_plot
from mlxlocal.bench.sse import StreamAccount
from mlxlocal.errors import EndpointBenchError

ITL_NOTE = "ITL is the gap between output-bearing SSE events; a server may put several tokens in one event"
OPTIONAL_FIELDS = ("ignore_eos", "stream_options")  # dropped (and noted) if a server rejects them


# --- one request --------------------------------------------------------------------------------
@dataclass
class RequestRecord:
    index: int
    status: str = "not_started"  # not_started | running | ok | error
    error: str | None = None
    error_message: str | None = None
    http_status: int | None = None
    account: StreamAccount | None = None
    prompt_tokens: int | None = None
    prompt_method: str | None = None
    completion_tokens: int | None = None
    completion_method: str | None = None
    cached_tokens: int | None = None
    dropped_fields: list[str] = field(default_factory=list)


def _error_text(body: bytes) -> str:
    text = body.decode("utf-8", errors="replace")
    try:
        obj = json.loads(text)
        err = obj.get("error", obj) if isinstance(obj, dict) else obj
        if isinstance(err, dict):
            return str(err.get("message") or err.get("detail") or err)[:300]
        return str(err)[:300]
    except (json.JSONDecodeError, AttributeError):
        return text[:300]


async def _stream_one(client: httpx.AsyncClient, endpoint: str, headers: dict, body: dict,
                      rec: RequestRecord, dialect: str = "chat") -> None:
    """Send one streaming request; fill rec.account as bytes arrive."""
    acc = StreamAccount(t_start=time.perf_counter(), dialect=dialect)
    rec.account = acc
    async with client.stream("POST", endpoint, json=body, headers=headers) as resp:
        if resp.status_code != 200:
            rec.http_status = resp.status_code
            raw = await resp.aread()
            acc.t_end = time.perf_counter()
            rec.error, rec.error_message = f"http_{resp.status_code}", _error_text(raw)
            return
        ctype = resp.headers.get("content-type", "")
        if "text/event-stream" not in ctype:
            raw = await resp.aread()
            acc.t_end = time.perf_counter()
            rec.error = "not_streamed"
            rec.error_message = f"content-type {ctype!r} instead of text/event-stream: {_error_text(raw)[:120]}"
            return
        try:
            async for chunk in resp.aiter_bytes():
                acc.feed_bytes(chunk, time.perf_counter())
                if acc.done:
                    break
        finally:
            acc.close(time.perf_counter())


async def _run_request(client, endpoint, headers, body, rec: RequestRecord, state: dict) -> None:
    rec.status = "running"
    for _ in range(len(OPTIONAL_FIELDS) + 1):
        payload = {k: v for k, v in body.items() if k not in state["dropped"]}
        rec.error = rec.error_message = rec.http_status = None
        try:
            await _stream_one(client, endpoint, headers, payload, rec)
        except httpx.TimeoutException as e:
            rec.error, rec.error_message = "timeout", f"{type(e).__name__} (no data within the read timeout)"
        except httpx.ConnectError as e:
            rec.error, rec.error_message = "connect_error", str(e)[:300]
        except httpx.HTTPError as e:  # connection dropped mid-stream, protocol errors
            rec.error, rec.error_message = "connection_error", f"{type(e).__name__}: {str(e)[:300]}"
        # a server that rejects an optional extra field: drop it for every later request, retry
        if rec.http_status in (400, 422) and rec.error_message:
            rejected = [f for f in OPTIONAL_FIELDS if f in rec.error_message and f in payload]
            if rejected:
                state["dropped"].update(rejected)
                rec.dropped_fields.extend(rejected)
                continue
        break
    acc = rec.account
    if rec.error is None and acc is not None and acc.error is not None:
        rec.error, rec.error_message = acc.error, acc.error_message
    rec.status = "error" if rec.error else "ok"


def _method_summary(methods: list[str | None]) -> str:
    """How the requests' tokens were counted: one method, or each with its request count."""
    counts = Counter(m for m in methods if m)
    if not counts:
        return "none"
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{m} ({n} requests)" for m, n in counts.most_common())


# --- the benchmark ------------------------------------------------------------------------------
def _base_url(url: str) -> str:
    u = url.strip().rstrip("/")
    if not u.startswith(("http://", "https://")):
        u = "http://" + u
    for suffix in ("/chat/completions", "/v1"):
        if u.endswith(suffix):
            u = u[: -len(suffix)].rstrip("/")
    return u


async def measure_endpoint(url: str, model: str | None, concurrency: int = 1, requests: int = 10,
                           prompt_tokens: int = 128, gen_tokens: int = 64,
                           prompt_file: str | None = None, api_key: str | None = None,
                           tokenizer: str | None = None, vary_prompts: bool = True,
                           ignore_eos: bool = True, timeout: float = 600.0,
                           request_timeout: float = 120.0, seed: int = 0,
                           transport: httpx.AsyncBaseTransport | None = None) -> dict:
    """Run the benchmark and return the result dict (prints nothing). `transport` replaces
    the network (tests)."""
    if concurrency < 1 or requests < 1 or gen_tokens < 1 or prompt_tokens < 1:
        raise EndpointBenchError("concurrency, requests, prompt_tokens and gen_tokens must be >= 1")
    base = _base_url(url)
    endpoint = f"{base}/v1/chat/completions"
    counter = TokenCounter(tokenizer, model)
    if prompt_file:
        prompts = load_prompt_file(prompt_file, requests)
        prompt_source = f"file:{prompt_file}"
    else:
        prompts = synthetic_prompts(requests, prompt_tokens, counter, vary=vary_prompts, seed=seed)
        how = f"tokenizer:{counter.name}" if counter.name else "chars/4 estimate"
        prompt_source = (f"synthetic, ~{prompt_tokens} tokens ({how}), "
                         f"{'distinct per request' if vary_prompts else 'identical (prefix cache may hit)'}")

    headers = {"Accept": "text/event-stream"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    records = [RequestRecord(index=i) for i in range(requests)]
    state: dict[str, Any] = {"dropped": set()}
    sem = asyncio.Semaphore(concurrency)

    def body_for(p: Prompt) -> dict:
        b: dict[str, Any] = {"model": model, "messages": p.messages, "stream": True,
                             "stream_options": {"include_usage": True},
                             "max_tokens": gen_tokens, "temperature": 0}
        if ignore_eos:
            b["ignore_eos"] = True
        return b

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    http_timeout = httpx.Timeout(connect=30.0, read=request_timeout, write=30.0, pool=None)
    async with httpx.AsyncClient(timeout=http_timeout, limits=limits, trust_env=False,
                                 transport=transport) as client:

        async def worker(i: int) -> None:
            async with sem:
                await _run_request(client, endpoint, headers, body_for(prompts[i]), records[i], state)

        t0 = time.perf_counter()
        tasks = [asyncio.create_task(worker(i)) for i in range(requests)]
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        t_now = time.perf_counter()
    for rec in records:
        if rec.status in ("running", "not_started"):
            rec.error = "timeout"
            rec.error_message = (f"benchmark time limit of {timeout:g}s reached "
                                 f"({'in flight' if rec.status == 'running' else 'never started'})")
            if rec.account is not None:
                rec.account.close(t_now)
            rec.status = "error"
    ends = [r.account.t_end for r in records if r.account is not None and r.account.t_end is not None]
    duration = (max(ends) if ends else t_now) - t0

    # token counts: the server's usage first, else a tokenizer, else chars / 4
    for rec, p in zip(records, prompts):
        acc = rec.account
        if acc is None:
            continue
        ct = acc.usage_tokens("completion_tokens")
        rec.completion_tokens, rec.completion_method = (ct, "usage") if ct is not None else counter.count(acc.output_text)
        pt = acc.usage_tokens("prompt_tokens")
        rec.prompt_tokens, rec.prompt_method = (pt, "usage") if pt is not None else counter.count(p.text)
        details = (acc.usage or {}).get("prompt_tokens_details") or {}
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            rec.cached_tokens = details["cached_tokens"]

    ok = [r for r in records if r.status == "ok"]
    accs = [r.account for r in ok if r.account is not None]
    itls = [g for a in accs for g in a.itls]
    tpot_or_none = [a.tpot(r.completion_tokens) for r, a in zip(ok, accs)]
    tpots = [t for t in tpot_or_none if t is not None]
    total_out = sum(r.completion_tokens or 0 for r in ok)
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    out_events = sum(len(a.output_times) for a in accs)
    errors = Counter(r.error for r in records if r.error)
    samples: dict[str, str] = {}
    for r in records:
        if r.error and r.error not in samples:
            samples[r.error] = r.error_message or ""

    notes = [ITL_NOTE,
             "TTFT and generation time use output-bearing events only (content, reasoning_content, "
             "tool_calls); the role chunk, finish chunk, usage chunk and [DONE] are excluded"]
    comp_method = _method_summary([r.completion_method for r in ok])
    if comp_method != "usage" and ok:
        why = f" (tokenizer unavailable: {counter.load_error})" if counter.load_error and not counter.name else ""
        notes.append(f"the server sent no usage for some requests; completion tokens counted by "
                     f"{comp_method}{why}")
    early = [r for r in ok if (r.completion_tokens or 0) < gen_tokens]
    if early:
        reasons = Counter((r.account.finish_reason if r.account else None) or "none" for r in early)
        notes.append(f"{len(early)} of {len(ok)} requests produced fewer than {gen_tokens} tokens "
                     f"(finish_reason: {dict(reasons)}); the server may not honour ignore_eos")
    if state["dropped"]:
        notes.append(f"the server rejected {sorted(state['dropped'])}; those fields were dropped")
    no_done = sum(1 for a in accs if not a.done)
    if no_done:
        notes.append(f"{no_done} streams ended without data: [DONE] (a finish_reason was received)")

    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    return {
        "url": base,
        "endpoint": endpoint,
        "model": model,
        "concurrency": concurrency,
        "requests": requests,
        "completed": len(ok),
        "failed": requests - len(ok),
        "errors": dict(errors),
        "error_samples": samples,
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
        "total_prompt_tokens": total_in,
        "total_completion_tokens": total_out,
        "cached_prompt_tokens": sum(cached) if cached else None,
        "prompt_tokens_requested": None if prompt_file else prompt_tokens,
        "gen_tokens_requested": gen_tokens,
        "prompt_source": prompt_source,
        "token_count_method": comp_method,
        "prompt_token_count_method": _method_summary([r.prompt_method for r in ok]),
        "tokens_per_event": total_out / out_events if out_events else None,
        "ttft_s": summarize([a.ttft for a in accs if a.ttft is not None]),
        "tpot_s": summarize(tpots),
        "itl_s": summarize(itls),
        "e2e_s": summarize([a.e2e for a in accs if a.e2e is not None]),
        "decode_tps_per_request": summarize([1.0 / t for t in tpots if t > 0]),
        "notes": notes,
        "_samples": {"ttft_s": [a.ttft for a in accs if a.ttft is not None], "itl_s": itls},
    }


def run_endpoint_bench(url: str, model: str | None, concurrency: int = 1, requests: int = 10,
                       prompt_tokens: int = 128, gen_tokens: int = 64, prompt_file: str | None = None,
                       as_json: bool = False, plot: str | None = None, api_key: str | None = None,
                       tokenizer: str | None = None, *, vary_prompts: bool = True,
                       ignore_eos: bool = True, timeout: float = 600.0,
                       request_timeout: float = 120.0, seed: int = 0) -> dict:
    """Benchmark an OpenAI-compatible endpoint; print a rich table (or one JSON object with
    as_json) and return the result dict. `timeout` bounds the whole run in seconds;
    `request_timeout` bounds the wait for any single read."""
    if plot:
        require_matplotlib()  # fail before the run, not after it
    result = asyncio.run(measure_endpoint(
        url, model, concurrency=concurrency, requests=requests, prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens, prompt_file=prompt_file, api_key=api_key, tokenizer=tokenizer,
        vary_prompts=vary_prompts, ignore_eos=ignore_eos, timeout=timeout,
        request_timeout=request_timeout, seed=seed))
    samples = result.pop("_samples")
    if plot:
        write_endpoint_plot({**result, "_samples": samples}, plot)
        result["plot"] = plot
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    else:
        print_endpoint_table(result)
        if plot:
            print(f"plot written to {plot}")
    return result
