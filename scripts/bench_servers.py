"""Serve one model directory with `mlxlocal serve`, `mlx_lm.server` and (where installed)
vllm-mlx and rapid-mlx, then run `bench endpoint --url ... --compare-url ...` against them: the same
concurrent load, one server at a time, alternating, medians (mlxlocal.bench.endpoint_compare).

    python scripts/bench_servers.py synthetic:tiny -c 8 -p 256 -g 64 -n 3
    python scripts/bench_servers.py /path/to/hf-model --peers /tmp/peers/bin

vllm-mlx and rapid-mlx are looked up in --peers (a virtual environment's bin, kept apart from
this project's lock) and then on PATH; a server that is missing or does not start is skipped.
Idle RSS is read once each server answers, before any load.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

from mlxlocal.bench.endpoint_compare import compare_endpoints, print_comparison


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def commands(model_dir: str, peers: str | None) -> dict[str, list[str]]:
    """name -> command line with a {port} placeholder, for each server found."""
    py = sys.executable
    out = {
        "mlxlocal": [py, "-m", "mlxlocal", "serve", "-m", model_dir, "--port", "{port}"],
        "mlx_lm.server": [py, "-m", "mlx_lm.server", "--model", model_dir, "--port", "{port}"],
    }
    for name, extra in (("vllm-mlx", ["--continuous-batching"]), ("rapid-mlx", [])):
        exe = shutil.which(name, path=peers) if peers else None
        exe = exe or shutil.which(name)
        if exe:
            out[name] = [
                exe,
                "serve",
                model_dir,
                "--host",
                "127.0.0.1",
                "--port",
                "{port}",
                *extra,
            ]
    return out


def start(
    name: str, cmd: list[str], log_dir: Path, wait_s: float
) -> tuple[subprocess.Popen, str] | None:
    port = _port()
    log = open(log_dir / f"{name}.log", "wb")
    proc = subprocess.Popen(
        [c.replace("{port}", str(port)) for c in cmd], stdout=log, stderr=subprocess.STDOUT
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/v1/models", timeout=2.0, trust_env=False).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    print(f"{name} did not start (see {log_dir / name}.log); skipped", file=sys.stderr)
    stop(proc)
    return None


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def rss_mb(pid: int) -> float | None:
    try:
        return int(subprocess.check_output(["ps", "-o", "rss=", "-p", str(pid)]).strip()) / 1024
    except (subprocess.CalledProcessError, ValueError):
        return None


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("model", help="HF-layout model directory, or a synthetic:NAME spec")
    ap.add_argument("-c", "--concurrency", type=int, default=8)
    ap.add_argument("--requests", type=int, default=None)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=256)
    ap.add_argument("-g", "--gen-tokens", type=int, default=64)
    ap.add_argument("-n", "--repeats", type=int, default=3)
    ap.add_argument(
        "--peers", default="/tmp/peers/bin", help="bin folder with vllm-mlx / rapid-mlx"
    )
    ap.add_argument("--seed", type=int, default=None,
                    help="prompt seed (default: a fresh one, so no server's disk cache holds them)")
    ap.add_argument("--only", default=None, help="comma-separated server names to run")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--logs", default="/tmp/bench_servers", help="where the servers' logs go")
    args = ap.parse_args()

    model_dir = args.model
    if model_dir.startswith("synthetic:"):  # the directory the spec materializes to
        from mlxlocal.source.loader import load

        model_dir = str(load(model_dir).info.path)
    log_dir = Path(args.logs)
    log_dir.mkdir(parents=True, exist_ok=True)
    cmds = commands(model_dir, args.peers if Path(args.peers).is_dir() else None)
    if args.only:
        cmds = {k: v for k, v in cmds.items() if k in args.only.split(",")}
    running: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name, cmd in cmds.items():  # one at a time: each loads while the others idle
            started = start(name, cmd, log_dir, args.start_timeout)
            if started:
                running[name] = started
                print(
                    f"{name}: {started[1]}, idle RSS {rss_mb(started[0].pid) or 0:.0f} MB",
                    file=sys.stderr,
                )
        if len(running) < 2:
            sys.exit("fewer than two servers started: nothing to compare")
        # mlx_lm.server lists the Hugging Face cache too: name it the directory it serves
        names = {url: model_dir for name, (_, url) in running.items() if name == "mlx_lm.server"}
        res = compare_endpoints(
            [url for _, url in running.values()],
            None,
            names=names,
            concurrency=args.concurrency,
            requests=args.requests,
            prompt_tokens=args.prompt_tokens,
            gen_tokens=args.gen_tokens,
            repeats=args.repeats,
            seed=args.seed,
        )
        for (name, _), row in zip(running.items(), res["rows"]):
            row["label"] = name
        print_comparison(res)
    finally:
        for proc, _ in running.values():
            stop(proc)


if __name__ == "__main__":
    main()
