"""`mlxlocal serve` next to `mlx_lm.server` on the same weights: concurrent streaming load.

Starts both servers on loopback (same HF-layout directory), then runs, alternating between
them, `measure_endpoint` with --concurrency streams (each --prompt-tokens long, --gen-tokens
generated) and a single stream; prints the median of --repeats runs of each figure.

    python scripts/bench_serve.py --model synthetic:tiny --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

from mlxlocal.bench.endpoint import measure_endpoint
from mlxlocal.source.hub import resolve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], url: str, log: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{cmd[0]} exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{cmd} did not come up within 300 s; see {log}")


def once(url: str, model: str, concurrency: int, args) -> dict:
    r = asyncio.run(measure_endpoint(url, model, concurrency=concurrency, requests=concurrency,
                                     prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                                     tokenizer=args.path, seed=args.seed))
    if r["failed"]:
        raise SystemExit(f"{url}: {r['failed']} requests failed: {r['error_samples']}")
    return {"tok_s": r["output_throughput"], "ttft_p50": r["ttft_s"]["p50"],
            "tokens": r["total_completion_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:tiny")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["mlxlocal", "mlx_lm"], default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.path = str(resolve(args.model).path)
    servers = {}
    if args.only in (None, "mlxlocal"):
        port = free_port()
        servers["mlxlocal"] = ([sys.executable, "-m", "mlxlocal", "serve", "-m", args.model, "--port", str(port)],
                               f"http://127.0.0.1:{port}")
    if args.only in (None, "mlx_lm"):
        port = free_port()
        servers["mlx_lm"] = ([sys.executable, "-m", "mlx_lm", "server", "--model", args.path, "--port", str(port),
                              "--log-level", "WARNING"], f"http://127.0.0.1:{port}")
    procs = {}
    try:
        for name, (cmd, url) in servers.items():
            procs[name] = start(cmd, url, f"/tmp/bench_serve_{name}_{os.getpid()}.log")
        model = {"mlxlocal": args.model, "mlx_lm": args.path}
        runs: dict[str, dict[str, list]] = {name: {"multi": [], "single": []} for name in servers}
        for name, (_, url) in servers.items():  # warm-up: compile, caches
            once(url, model[name], args.concurrency, args)
        for rep in range(args.repeats):
            for name, (_, url) in servers.items():
                runs[name]["multi"].append(once(url, model[name], args.concurrency, args))
                runs[name]["single"].append(once(url, model[name], 1, args))
                m, s = runs[name]["multi"][-1], runs[name]["single"][-1]
                print(f"run {rep} {name:8s}: {args.concurrency} streams {m['tok_s']:7.1f} tok/s "
                      f"p50 TTFT {m['ttft_p50'] * 1000:6.0f} ms ({m['tokens']} tokens); "
                      f"single {s['tok_s']:6.1f} tok/s", file=sys.stderr)
        out = {}
        for name, r in runs.items():
            out[name] = {"streams_tok_s": statistics.median(x["tok_s"] for x in r["multi"]),
                         "streams_ttft_p50_s": statistics.median(x["ttft_p50"] for x in r["multi"]),
                         "single_tok_s": statistics.median(x["tok_s"] for x in r["single"]),
                         "single_ttft_s": statistics.median(x["ttft_p50"] for x in r["single"])}
        if args.json:
            print(json.dumps(out))
        else:
            print(f"{'server':10s} {args.concurrency} streams tok/s   p50 TTFT   single tok/s   single TTFT")
            for name, o in out.items():
                print(f"{name:10s} {o['streams_tok_s']:15.1f} {o['streams_ttft_p50_s'] * 1000:8.0f} ms "
                      f"{o['single_tok_s']:12.1f} {o['single_ttft_s'] * 1000:10.0f} ms")
    finally:
        for proc in procs.values():
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
