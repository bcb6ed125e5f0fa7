"""A normal client's latency alone and beside each kind of hostile client, on loopback.

Starts `serve` in this process on 127.0.0.1 with a tiny chat model (synthetic:tiny) and an
embedding model (minilm), then runs a normal client (small chat requests, one at a time)
alone, then beside each hostile client:

  embed      big /v1/embeddings requests whose client hangs up after a second, again and again
  count      big /v1/messages/count_tokens bodies one after another (server RSS watched)
  tokenize   huge count_tokens bodies four at a time (tokenization of multi-MB text)
  grammar    chat requests with large distinct JSON schemas, eight at a time

and prints the normal client's p50 / p99 per condition (--json: one object), with what the
hostile client saw (statuses, how long the embedding engine stayed busy after hang-ups, RSS).
A condition's normal client stops after --max-seconds; a request still unfinished then counts
with its time so far, and the row's figures are marked as lower bounds (>=).

    python scripts/bench_hostile.py --requests 30
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import threading
import time
from collections import Counter

import httpx

from mlxlocal.bench.common import percentile

CHAT_MODEL = "synthetic:tiny"
EMBED_MODEL = "minilm"


def rss_mib() -> float | None:
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            return round(next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024, 1)
    except (OSError, StopIteration):
        return None


def start_server():
    import uvicorn

    from mlxlocal.server import ServerConfig, create_app
    from mlxlocal.server.banner import uvicorn_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServerConfig(models=[CHAT_MODEL], embed_models=[EMBED_MODEL], port=port)
    server = uvicorn.Server(uvicorn_config(create_app(config), config, log_level="warning"))
    server.thread = threading.Thread(target=server.run, daemon=True)
    server.thread.start()
    deadline = time.monotonic() + 180
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.1)
    if not server.started:
        raise SystemExit("server did not start")
    return f"http://127.0.0.1:{port}", server


# --- the normal client ------------------------------------------------------------------------
async def normal_client(url: str, n: int, max_seconds: float = 600.0) -> list[dict]:
    """n small chat requests one at a time; after max_seconds the one in flight is given up
    (recorded as unfinished, its latency so far a lower bound) and no more are sent."""
    body = {"model": CHAT_MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "hi there"}]}
    out = []
    deadline = time.perf_counter() + max_seconds
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            if t0 >= deadline:
                break
            try:
                r = await asyncio.wait_for(client.post(f"{url}/v1/chat/completions", json=body), deadline - t0)
                status = r.status_code
            except asyncio.TimeoutError:
                status = "unfinished"
            except httpx.HTTPError as e:
                status = type(e).__name__
            out.append({"status": status, "latency": time.perf_counter() - t0})
            await asyncio.sleep(0.05)
    return out


# --- hostile clients: each runs until `done` is set, returns what it saw -----------------------
async def hostile_embed(url: str, done: asyncio.Event, inputs: int, chars: int) -> dict:
    text = ("lorem ipsum dolor sit amet " * (chars // 27 + 1))[:chars]
    body = {"model": EMBED_MODEL, "input": [f"{i} {text}" for i in range(inputs)]}
    statuses: Counter = Counter()
    async with httpx.AsyncClient(timeout=httpx.Timeout(1.0, connect=5.0)) as client:
        while not done.is_set():
            try:
                r = await client.post(f"{url}/v1/embeddings", json=body)
                statuses[r.status_code] += 1
            except httpx.TimeoutException:
                statuses["hung up"] += 1  # the client goes away after a second
            await asyncio.sleep(0.2)
    # How long until the embedding engine answers a one-word request (bounded).
    t0 = time.perf_counter()
    probe: str | float
    try:
        async with httpx.AsyncClient(timeout=60) as client:
            for _ in range(60):  # a full queue answers 429 at once: retry until it drains
                r = await client.post(f"{url}/v1/embeddings", json={"model": EMBED_MODEL, "input": "hi"})
                if r.status_code != 429:
                    break
                await asyncio.sleep(1.0)
        probe = round(time.perf_counter() - t0, 2) if r.status_code == 200 else f"status {r.status_code}"
    except httpx.TimeoutException:
        probe = "> 60 s"
    return {"statuses": dict(statuses), "embed_probe_after_s": probe}


def count_body(n_bytes: int) -> dict:
    text = "word " * (n_bytes // 5)
    return {"model": CHAT_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}


async def hostile_count(url: str, done: asyncio.Event, n_bytes: int, parallel: int) -> dict:
    body = json.dumps(count_body(n_bytes)).encode()
    statuses: Counter = Counter()
    rss = [rss_mib()]

    async def one(client):
        while not done.is_set():
            try:
                r = await client.post(f"{url}/v1/messages/count_tokens", content=body,
                                      headers={"Content-Type": "application/json"})
                statuses[r.status_code] += 1
            except httpx.HTTPError as e:
                statuses[type(e).__name__] += 1
            rss.append(rss_mib())

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client) for _ in range(parallel)))
    await asyncio.sleep(2.0)
    return {"statuses": dict(statuses), "rss_mib_start": rss[0], "rss_mib_peak": max(x or 0 for x in rss),
            "rss_mib_after_2s": rss_mib()}


def big_schema(properties: int, salt: int) -> dict:
    props = {f"field_{salt}_{i}": {"type": "string", "maxLength": 8} for i in range(properties)}
    return {"type": "object", "properties": props, "required": list(props)[:10]}


async def hostile_grammar(url: str, done: asyncio.Event, properties: int, parallel: int) -> dict:
    statuses: Counter = Counter()
    counter = iter(range(10**9))

    async def one(client):
        while not done.is_set():
            body = {"model": CHAT_MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                    "response_format": {"type": "json_schema", "json_schema": {
                        "name": "big", "schema": big_schema(properties, next(counter))}}}
            try:
                r = await client.post(f"{url}/v1/chat/completions", json=body)
                statuses[r.status_code] += 1
            except httpx.HTTPError as e:
                statuses[type(e).__name__] += 1

    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(one(client) for _ in range(parallel)))
    return {"statuses": dict(statuses)}


async def condition(url: str, n: int, hostile, max_seconds: float) -> dict:
    done = asyncio.Event()
    task = asyncio.create_task(hostile(done)) if hostile is not None else None
    if task is not None:
        await asyncio.sleep(1.5)  # let the hostile load build up first
    t0 = time.perf_counter()
    results = await normal_client(url, n, max_seconds)
    wall = time.perf_counter() - t0
    done.set()
    seen = await task if task is not None else {}
    # Unfinished requests count with their time so far: the percentiles are then lower bounds.
    lat = [r["latency"] for r in results if r["status"] in (200, "unfinished")]
    unfinished = sum(1 for r in results if r["status"] == "unfinished")
    p50, p99 = percentile(lat, 50), percentile(lat, 99)
    return {"requests": len(results), "ok": sum(1 for r in results if r["status"] == 200),
            "unfinished": unfinished,
            "errors": dict(Counter(str(r["status"]) for r in results if r["status"] not in (200, "unfinished"))),
            "p50_s": round(p50, 3) if p50 is not None else None,
            "p99_s": round(p99, 3) if p99 is not None else None,
            "max_s": round(max(lat), 3) if lat else None, "wall_s": round(wall, 1), "hostile": seen}


def row(name: str, r: dict) -> str:
    bound = ">=" if r["unfinished"] else ""
    return (f"{name:10} {r['ok']:>3}/{r['requests']:<3} {bound + str(r['p50_s']):>9} {bound + str(r['p99_s']):>9} "
            f"{bound + str(r['max_s']):>9}  {json.dumps(r['hostile'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=30, help="normal-client requests per condition")
    ap.add_argument("--embed-inputs", type=int, default=256)
    ap.add_argument("--embed-chars", type=int, default=2000)
    ap.add_argument("--count-bytes", type=int, default=1_300_000)
    ap.add_argument("--tokenize-bytes", type=int, default=6_000_000)
    ap.add_argument("--schema-properties", type=int, default=2000)
    ap.add_argument("--max-seconds", type=float, default=120.0, help="normal client's time per condition")
    ap.add_argument("--only", help="comma-separated conditions to run (alone always runs)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    url, server = start_server()
    hostiles = {
        "count": lambda d: hostile_count(url, d, args.count_bytes, 1),
        "tokenize": lambda d: hostile_count(url, d, args.tokenize_bytes, 4),
        "grammar": lambda d: hostile_grammar(url, d, args.schema_properties, 8),
        "embed": lambda d: hostile_embed(url, d, args.embed_inputs, args.embed_chars),  # last: it may linger
    }
    chosen = [k for k in hostiles if args.only is None or k in args.only.split(",")]
    report: dict = {}
    try:
        asyncio.run(normal_client(url, 3))  # warm-up: model loaded, steps compiled
        httpx.post(f"{url}/v1/embeddings", json={"model": EMBED_MODEL, "input": "warm"}, timeout=300)
        for name in ["alone", *chosen]:
            report[name] = asyncio.run(condition(url, args.requests, hostiles.get(name), args.max_seconds))
            print(row(name, report[name]), file=sys.stderr, flush=True)
    finally:
        server.should_exit = True
        server.thread.join(timeout=60)
    if args.json:
        print(json.dumps(report))
        return
    print(f"{'condition':10} {'ok':>7} {'p50 s':>9} {'p99 s':>9} {'max s':>9}  hostile")
    for name, r in report.items():
        print(row(name, r))


if __name__ == "__main__":
    main()
