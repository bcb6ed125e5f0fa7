"""`mlxlocal serve` next to `mlx_lm.server` on the same weights: concurrent streaming load.

Starts both servers on loopback (same HF-layout directory), then runs, alternating between
them, `measure_endpoint` with --concurrency streams (each --prompt-tokens long, --gen-tokens
generated) and a single stream; prints the median of --repeats runs of each figure, and
each server's CPU time per generated token (less swayed by a loaded machine than tok/s).
--baseline DIR also serves the mlxlocal source tree in DIR (e.g. a worktree of main).

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
from bench_servers import stop

from mlxlocal.bench.endpoint import measure_endpoint
from mlxlocal.source.hub import resolve


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], url: str, log: str, env: dict | None = None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
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


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its threads (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_s(pid: int, name: str | None = None) -> float:
    """CPU seconds, to the nanosecond, of the process's main thread (the event loop) or of
    its threads called `name` (schedstat)."""
    total = 0.0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                comm = f.read().strip()
            if (int(tid) == pid) if name is None else comm == name:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0]) / 1e9
        except OSError:  # a thread that just ended
            pass
    return total


def once(url: str, model: str, concurrency: int, args, pid: int) -> dict:
    cpu0, loop0, engine0 = cpu_s(pid), thread_cpu_s(pid), thread_cpu_s(pid, "mlxlocal-engine")
    r = asyncio.run(measure_endpoint(url, model, concurrency=concurrency, requests=concurrency,
                                     prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                                     tokenizer=args.path, seed=args.seed))
    if r["failed"]:
        raise SystemExit(f"{url}: {r['failed']} requests failed: {r['error_samples']}")
    return {"tok_s": r["output_throughput"], "ttft_p50": r["ttft_s"]["p50"],
            "tokens": r["total_completion_tokens"],
            "cpu_ms_tok": (cpu_s(pid) - cpu0) * 1000 / max(r["total_completion_tokens"], 1),
            "loop_ms_tok": (thread_cpu_s(pid) - loop0) * 1000 / max(r["total_completion_tokens"], 1),
            "engine_ms_tok": (thread_cpu_s(pid, "mlxlocal-engine") - engine0) * 1000
            / max(r["total_completion_tokens"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:tiny")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=["mlxlocal", "mlx_lm"], default=None)
    ap.add_argument("--baseline", default=None, help="another mlxlocal source tree to serve too")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.path = str(resolve(args.model).path)
    servers = {}
    if args.only in (None, "mlxlocal"):
        port = free_port()
        servers["mlxlocal"] = ([sys.executable, "-m", "mlxlocal", "serve", "-m", args.model, "--port", str(port)],
                               f"http://127.0.0.1:{port}")
    if args.baseline:
        port = free_port()
        servers["baseline"] = ([sys.executable, "-m", "mlxlocal", "serve", "-m", args.model, "--port", str(port)],
                               f"http://127.0.0.1:{port}")
    if args.only in (None, "mlx_lm"):
        port = free_port()
        servers["mlx_lm"] = ([sys.executable, "-m", "mlx_lm", "server", "--model", args.path, "--port", str(port),
                              "--log-level", "WARNING"], f"http://127.0.0.1:{port}")
    procs = {}
    try:
        for name, (cmd, url) in servers.items():
            env = {**os.environ, "PYTHONPATH": args.baseline} if name == "baseline" else None
            procs[name] = start(cmd, url, f"/tmp/bench_serve_{name}_{os.getpid()}.log", env)
        model = {"mlxlocal": args.model, "baseline": args.model, "mlx_lm": args.path}
        runs: dict[str, dict[str, list]] = {name: {"multi": [], "single": []} for name in servers}
        for name, (_, url) in servers.items():  # warm-up: compile, caches
            once(url, model[name], args.concurrency, args, procs[name].pid)
        for rep in range(args.repeats):
            for name, (_, url) in servers.items():
                pid = procs[name].pid
                runs[name]["multi"].append(once(url, model[name], args.concurrency, args, pid))
                runs[name]["single"].append(once(url, model[name], 1, args, pid))
                m, s = runs[name]["multi"][-1], runs[name]["single"][-1]
                print(f"run {rep} {name:8s}: {args.concurrency} streams {m['tok_s']:7.1f} tok/s "
                      f"p50 TTFT {m['ttft_p50'] * 1000:6.0f} ms ({m['tokens']} tokens); "
                      f"{m['cpu_ms_tok']:.2f} CPU ms/token, {m['loop_ms_tok']:.3f} in the loop, "
                      f"{m['engine_ms_tok']:.3f} in the engine thread; single {s['tok_s']:6.1f} tok/s "
                      f"{s['cpu_ms_tok']:.2f} CPU ms/token", file=sys.stderr)
        out = {}
        for name, r in runs.items():
            out[name] = {"streams_tok_s": statistics.median(x["tok_s"] for x in r["multi"]),
                         "streams_ttft_p50_s": statistics.median(x["ttft_p50"] for x in r["multi"]),
                         "single_tok_s": statistics.median(x["tok_s"] for x in r["single"]),
                         "single_ttft_s": statistics.median(x["ttft_p50"] for x in r["single"]),
                         "streams_cpu_ms_tok": statistics.median(x["cpu_ms_tok"] for x in r["multi"]),
                         "single_cpu_ms_tok": statistics.median(x["cpu_ms_tok"] for x in r["single"]),
                         "streams_loop_ms_tok": statistics.median(x["loop_ms_tok"] for x in r["multi"]),
                         "single_loop_ms_tok": statistics.median(x["loop_ms_tok"] for x in r["single"]),
                         "streams_engine_ms_tok": statistics.median(x["engine_ms_tok"] for x in r["multi"])}
        if args.json:
            print(json.dumps(out))
        else:
            print(f"{'server':10s} {args.concurrency} streams tok/s   p50 TTFT  CPU ms/tok   single tok/s"
                  "   single TTFT  CPU ms/tok")
            for name, o in out.items():
                print(f"{name:10s} {o['streams_tok_s']:15.1f} {o['streams_ttft_p50_s'] * 1000:8.0f} ms "
                      f"{o['streams_cpu_ms_tok']:10.2f} {o['single_tok_s']:14.1f} "
                      f"{o['single_ttft_s'] * 1000:10.0f} ms {o['single_cpu_ms_tok']:10.2f}")
    finally:
        for proc in procs.values():
            stop(proc)


if __name__ == "__main__":
    main()
