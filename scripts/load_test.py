"""Load and fault test of `mlxlocal serve`, on loopback only, bounded in count and time.

Starts a server on 127.0.0.1 (or uses --url of one already running on this machine),
sends --requests chat requests at --concurrency, a share of whose clients hang up
mid-stream, while --slow-clients connections trickle a byte a second and --prestart-drops
clients hang up before their (non-streaming) response starts; then reports errors, latency
percentiles, how the slow clients were cut off, cancellations, the server's RSS after
warm-up and at the end, and whether the KV blocks in use returned to the idle baseline.

    python scripts/load_test.py --model synthetic:tiny --requests 300 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import threading
import time
from urllib.parse import urlsplit

import httpx


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m[1]) if m else float("nan")


def kv_blocks_used(url: str) -> float:
    return metric(url, "mlxlocal_kv_blocks_used")


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of the server process (Linux /proc; None elsewhere or without a pid)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None
    return round(kib / 1024, 1)


async def slow_client(host: str, port: int, seconds: float) -> dict:
    """A connection that sends its request head a byte a second: how long until the server hangs up."""
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection(host, port)
    except OSError as e:
        return {"refused": type(e).__name__, "held_s": 0.0}
    head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000
    closed = False
    try:
        for byte in head:
            if time.perf_counter() - t0 > seconds:
                break
            writer.write(bytes([byte]))
            await writer.drain()
            try:  # the server closing shows up as EOF on the read side
                if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                    closed = True
                    break
            except asyncio.TimeoutError:
                pass
    except OSError:
        closed = True
    finally:
        writer.close()
    return {"closed_by_server": closed, "held_s": time.perf_counter() - t0}


async def prestart_drop(host: str, port: int, model: str, i: int, delay: float) -> None:
    """A non-streaming request with a long prompt whose client hangs up before the response starts."""
    body = json.dumps({"model": model, "max_tokens": 200, "temperature": 0, "messages": [
        {"role": "user", "content": f"{i} " + "tell me everything about paged attention " * 40}]}).encode()
    try:
        _, writer = await asyncio.open_connection(host, port)
    except OSError:
        return
    writer.write(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                 f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    await writer.drain()
    await asyncio.sleep(delay)
    writer.close()


async def one(client: httpx.AsyncClient, url: str, model: str, i: int, drop: bool, max_tokens: int) -> dict:
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": f"request {i}: tell me about paged attention {i % 7}"}]}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "status": r.status_code, "latency": time.perf_counter() - t0}
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks += 1
                    if drop and chunks == 3:  # the client goes away mid-stream
                        return {"ok": True, "dropped": True, "latency": time.perf_counter() - t0}
        return {"ok": True, "dropped": False, "latency": time.perf_counter() - t0}
    except httpx.HTTPError as e:
        return {"ok": False, "status": type(e).__name__, "latency": time.perf_counter() - t0}


async def load(url: str, model: str, n: int, concurrency: int, drop_share: float, max_tokens: int,
               slow: int, slow_seconds: float, prestart: int) -> tuple[list[dict], list[dict]]:
    rng = random.Random(0)
    gate = asyncio.Semaphore(concurrency)
    host, port = urlsplit(url).hostname, urlsplit(url).port
    slow_tasks = [asyncio.create_task(slow_client(host, port, slow_seconds)) for _ in range(slow)]

    async def drops():
        for i in range(prestart):  # spread over the run, a few at a time
            await prestart_drop(host, port, model, i, 0.1)
            await asyncio.sleep(0.05)

    drop_task = asyncio.create_task(drops())
    async with httpx.AsyncClient(timeout=120) as client:
        async def bounded(i):
            async with gate:
                return await one(client, url, model, i, rng.random() < drop_share, max_tokens)
        results = await asyncio.gather(*(bounded(i) for i in range(n)))
    await drop_task
    return results, await asyncio.gather(*slow_tasks)


def start_server(model: str) -> tuple[str, object]:
    import uvicorn

    from mlxlocal.server import ServerConfig, create_app
    from mlxlocal.server.banner import raise_open_file_limit, uvicorn_config

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServerConfig(models=[model], port=port, engine_options={"max_num_seqs": 16})
    # The settings `mlxlocal serve` uses (header timeout, connection cap, keep-alive).
    files = raise_open_file_limit()
    server = uvicorn.Server(uvicorn_config(create_app(config), config, files, log_level="warning"))
    server.thread = threading.Thread(target=server.run, daemon=True)
    server.thread.start()
    deadline = time.monotonic() + 120
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.1)
    if not server.started:
        raise SystemExit("server did not start")
    return f"http://127.0.0.1:{port}", server


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:tiny")
    ap.add_argument("--url", help="an mlxlocal server already running on this machine")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--drop", type=float, default=0.2, help="share of clients that hang up mid-stream")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--slow-clients", type=int, default=32, help="connections sending a byte a second (max 256)")
    ap.add_argument("--slow-seconds", type=float, default=15.0, help="how long a slow client keeps trying (max 60)")
    ap.add_argument("--prestart-drops", type=int, default=20,
                    help="non-streaming clients that hang up before the response starts (max 200)")
    ap.add_argument("--server-pid", type=int, help="with --url: the server's pid, for its memory")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.url and urlsplit(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("load tests only target this machine (127.0.0.1 / localhost)")
    url, server = (args.url, None) if args.url else start_server(args.model)
    model = args.model if not args.url else httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    pid = args.server_pid if args.url else os.getpid()  # started here: the server runs in this process
    slow = min(max(0, args.slow_clients), 256)
    slow_seconds = min(max(1.0, args.slow_seconds), 60.0)
    prestart = min(max(0, args.prestart_drops), 200)
    # Warm-up, so the memory baseline includes the model and its compiled steps.
    asyncio.run(load(url, model, 16, 4, 0.0, args.max_tokens, 0, 0, 0))
    baseline, rss_warm = kv_blocks_used(url), rss_mib(pid)
    cancelled0 = metric(url, "mlxlocal_requests_cancelled_total")
    unspent0 = metric(url, "mlxlocal_cancelled_max_tokens_unspent_total")
    t0 = time.perf_counter()
    results, slow_results = asyncio.run(load(url, model, args.requests, args.concurrency, args.drop,
                                             args.max_tokens, slow, slow_seconds, prestart))
    wall = time.perf_counter() - t0
    time.sleep(1.0)  # cancelled requests free their blocks at the engine's next step
    after = kv_blocks_used(url)
    held = sorted(r["held_s"] for r in slow_results)
    completed = sorted(r["latency"] for r in results if r["ok"] and not r.get("dropped"))
    errors = [r for r in results if not r["ok"]]
    report = {
        "requests": args.requests, "concurrency": args.concurrency, "wall_s": round(wall, 2),
        "completed": len(completed), "dropped_by_client": sum(1 for r in results if r.get("dropped")),
        "errors": len(errors), "error_kinds": sorted({str(r["status"]) for r in errors}),
        "latency_p50_s": round(statistics.median(completed), 3) if completed else None,
        "latency_p99_s": round(completed[min(len(completed) - 1, int(0.99 * len(completed)))], 3) if completed else None,
        "slow_clients": slow, "slow_closed_by_server": sum(1 for r in slow_results if r.get("closed_by_server")),
        "slow_held_max_s": round(held[-1], 2) if held else None,
        "prestart_drops": prestart,
        "cancelled_by_disconnect": metric(url, "mlxlocal_requests_cancelled_total") - cancelled0,
        "cancelled_max_tokens_unspent": metric(url, "mlxlocal_cancelled_max_tokens_unspent_total") - unspent0,
        "kv_blocks_used_idle_before": baseline, "kv_blocks_used_after": after,
        "kv_blocks_back_to_baseline": after == baseline,
        "server_rss_mib_after_warmup": rss_warm, "server_rss_mib_end": rss_mib(pid),
    }
    print(json.dumps(report) if args.json else "\n".join(f"{k:28} {v}" for k, v in report.items()))
    if server is not None:
        # Wait for the lifespan shutdown (engine thread joined): exiting while the engine
        # thread still holds its MLX stream aborts the process.
        server.should_exit = True
        server.thread.join(timeout=30)


if __name__ == "__main__":
    main()
