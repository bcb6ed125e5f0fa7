"""Load and fault test of `mlxlocal serve`, on loopback only, bounded in count and time.

Starts a server on 127.0.0.1 (or uses --url of one already running on this machine),
sends --requests chat requests at --concurrency, a share of whose clients hang up
mid-stream, then reports errors, latency percentiles and whether the KV blocks in use
returned to the idle baseline.

    python scripts/load_test.py --model synthetic:tiny --requests 300 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import statistics
import threading
import time
from urllib.parse import urlsplit

import httpx


def kv_blocks_used(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    m = re.search(r"^mlxlocal_kv_blocks_used (\S+)$", text, re.M)
    return float(m[1]) if m else float("nan")


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


async def load(url: str, model: str, n: int, concurrency: int, drop_share: float, max_tokens: int) -> list[dict]:
    rng = random.Random(0)
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=120) as client:
        async def bounded(i):
            async with gate:
                return await one(client, url, model, i, rng.random() < drop_share, max_tokens)
        return await asyncio.gather(*(bounded(i) for i in range(n)))


def start_server(model: str) -> tuple[str, object]:
    import uvicorn

    from mlxlocal.server import ServerConfig, create_app

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = ServerConfig(models=[model], port=port, engine_options={"max_num_seqs": 16})
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.url and urlsplit(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("load tests only target this machine (127.0.0.1 / localhost)")
    url, server = (args.url, None) if args.url else start_server(args.model)
    model = args.model if not args.url else httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    baseline = kv_blocks_used(url)
    t0 = time.perf_counter()
    results = asyncio.run(load(url, model, args.requests, args.concurrency, args.drop, args.max_tokens))
    wall = time.perf_counter() - t0
    time.sleep(1.0)  # cancelled requests free their blocks at the engine's next step
    after = kv_blocks_used(url)
    completed = sorted(r["latency"] for r in results if r["ok"] and not r.get("dropped"))
    errors = [r for r in results if not r["ok"]]
    report = {
        "requests": args.requests, "concurrency": args.concurrency, "wall_s": round(wall, 2),
        "completed": len(completed), "dropped_by_client": sum(1 for r in results if r.get("dropped")),
        "errors": len(errors), "error_kinds": sorted({str(r["status"]) for r in errors}),
        "latency_p50_s": round(statistics.median(completed), 3) if completed else None,
        "latency_p99_s": round(completed[min(len(completed) - 1, int(0.99 * len(completed)))], 3) if completed else None,
        "kv_blocks_used_idle_before": baseline, "kv_blocks_used_after": after,
        "kv_blocks_back_to_baseline": after == baseline,
    }
    print(json.dumps(report) if args.json else "\n".join(f"{k:28} {v}" for k, v in report.items()))
    if server is not None:
        server.should_exit = True


if __name__ == "__main__":
    main()
