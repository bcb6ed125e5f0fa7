"""What the served path alone can carry: `mlxlocal serve`'s HTTP side over an engine that
costs nothing, so the event loop, the event layer and SSE framing are all that is measured.

The paged engine's submit is replaced by a producer thread that, every --step-ms, hands
each live request one token (the engine's per-step delivery, Outbox where the tree has one)
until its max_tokens. --concurrency streaming chat requests run against it; reported: the
tokens/s delivered (the ceiling the served path puts on the engine) and the event loop's CPU
time per token. --baseline DIR runs the same against another source tree (e.g. main), the
two alternating; medians of --repeats.

    python scripts/bench_serve_path.py --baseline /tmp/wt-base --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import statistics
import sys
import threading
import time

from bench_serve import free_port, start, thread_cpu_s
from bench_servers import stop

from mlxlocal.bench.endpoint import measure_endpoint


def child(port: int, model: str, step_s: float) -> None:
    """Serve `model` with the zero-cost producer in place of the engine's submit."""
    import uvicorn

    from mlxlocal.engine import handle as handle_mod
    from mlxlocal.engine.paged import PagedEngine
    from mlxlocal.engine.types import Chunk, GenerationStats
    from mlxlocal.server import ServerConfig, create_app
    from mlxlocal.server.banner import uvicorn_config

    outbox = handle_mod.Outbox() if hasattr(handle_mod, "Outbox") else None
    inbox: queue.Queue = queue.Queue()

    def produce() -> None:
        live = []  # [handle, prompt tokens, tokens left, tokens given]
        while True:
            while True:
                try:
                    live.append(list(inbox.get(block=not live)))
                except queue.Empty:
                    break
            for entry in live:
                h, n, left, given = entry
                if h.cancelled.is_set() or left == 1:
                    reason = "cancelled" if h.cancelled.is_set() else "length"
                    stats = GenerationStats(prompt_tokens=n, completion_tokens=given + (reason == "length"),
                                            finish_reason=reason, truncated_by="max_tokens")
                    h.put(Chunk(" x", token=5 if reason == "length" else None, finish_reason=reason, stats=stats))
                    entry[2] = 0
                else:
                    h.put(Chunk(" x", token=5))
                    entry[2], entry[3] = left - 1, given + 1
            live = [e for e in live if e[2] > 0]
            if outbox is not None:
                outbox.flush()
            time.sleep(step_s)

    threading.Thread(target=produce, daemon=True).start()

    def submit(self, prompt, params=None, session=None, cancel=None, loop=None, edits=None):
        extra = {"outbox": outbox} if outbox is not None else {}
        h = handle_mod.RequestHandle(cancel, loop, **extra)
        inbox.put((h, len(prompt), params.max_tokens, 0))
        return h

    PagedEngine.submit = submit
    config = ServerConfig(models=[model], port=port)
    app = create_app(config)
    uvicorn.Server(uvicorn_config(app, config, log_level="warning", lifespan="on")).run()


def once(url: str, model: str, args, pid: int) -> dict:
    loop0 = thread_cpu_s(pid)
    r = asyncio.run(measure_endpoint(url, model, concurrency=args.concurrency, requests=args.concurrency,
                                     prompt_tokens=64, gen_tokens=args.gen_tokens, tokenizer=args.path))
    if r["failed"]:
        raise SystemExit(f"{url}: {r['failed']} requests failed: {r['error_samples']}")
    tokens = max(r["total_completion_tokens"], 1)
    return {"tok_s": r["output_throughput"], "loop_us_tok": (thread_cpu_s(pid) - loop0) * 1e6 / tokens,
            "tokens_per_event": r["tokens_per_event"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:tiny")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--gen-tokens", type=int, default=512)
    ap.add_argument("--step-ms", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", default=None)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args.child, args.model, args.step_ms / 1000)
        return
    from mlxlocal.source.hub import resolve

    args.path = str(resolve(args.model).path)
    trees = {"this tree": None, **({"baseline": args.baseline} if args.baseline else {})}
    procs, urls = {}, {}
    try:
        for name, tree in trees.items():
            port = free_port()
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (tree, os.path.dirname(__file__)) if p)}
            cmd = [sys.executable, __file__, "--child", str(port), "--model", args.model,
                   "--step-ms", str(args.step_ms)]
            urls[name] = f"http://127.0.0.1:{port}"
            procs[name] = start(cmd, urls[name], f"/tmp/bench_serve_path_{port}.log", env)
        for name in trees:  # warm-up
            once(urls[name], args.model, args, procs[name].pid)
        runs: dict[str, list[dict]] = {name: [] for name in trees}
        for rep in range(args.repeats):
            for name in trees:
                r = once(urls[name], args.model, args, procs[name].pid)
                runs[name].append(r)
                print(f"run {rep} {name:9s}: {r['tok_s']:7.0f} tok/s, event loop {r['loop_us_tok']:6.1f} µs CPU "
                      f"a token, {r['tokens_per_event']:.2f} tokens an SSE event", file=sys.stderr)
        out = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
        print(json.dumps(out))
    finally:
        for proc in procs.values():
            stop(proc)


if __name__ == "__main__":
    main()
