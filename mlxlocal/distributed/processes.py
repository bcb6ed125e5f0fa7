"""`mlxlocal launch-cluster`: run one mlxlocal command as N ranks of MLX's ring backend.

On one machine (`-n N`) the ranks are started here, over loopback, with the environment
`mlx.launch` would give them (MLX_RANK, MLX_HOSTFILE): rank 0 gets this terminal (so `chat`
is interactive and `serve` logs as usual); the others follow rank 0 and print only problems,
each line prefixed with its rank. Unlike `mlx.launch`, a follower that dies does not take
rank 0 down: rank 0's engine stops with the reason at its next step, requests end with that
error, and a server keeps answering /health with it. When rank 0 exits the followers are
released (and terminated if they have not exited a few seconds later).

With `--hostfile` (several Macs) the ranks are started by `mlx.launch` itself, over SSH, with
its own policy (any rank failing ends them all).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence

FOLLOWER_GRACE_S = 5.0  # after rank 0 exits, how long followers get to exit on their own


def free_ports(n: int) -> list[int]:
    """n TCP ports free on loopback right now (bound then released: good enough to start on)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ring_hostfile(n: int, directory: str) -> str:
    """A ring-backend hostfile for n ranks on loopback: one address per rank."""
    path = os.path.join(directory, "hosts.json")
    with open(path, "w") as f:
        json.dump([[f"127.0.0.1:{p}"] for p in free_ports(n)], f)
    return path


def _relay(stream, rank: int) -> None:
    """A follower's output, each line prefixed with its rank, onto our stderr."""
    for line in iter(stream.readline, b""):
        sys.stderr.write(f"[rank {rank}] {line.decode(errors='replace')}")
        sys.stderr.flush()


def run_local(n: int, argv: Sequence[str], python: str | None = None) -> int:
    """Run `mlxlocal argv` as n ranks on this machine; returns rank 0's exit code."""
    if n < 2:
        raise ValueError(f"-n must be at least 2 (got {n})")
    python = python or sys.executable
    with tempfile.TemporaryDirectory(prefix="mlxlocal-cluster-") as tmp:
        env = dict(os.environ, MLX_HOSTFILE=ring_hostfile(n, tmp))
        cmd = [python, "-m", "mlxlocal", *argv]
        followers = []
        for rank in range(1, n):
            p = subprocess.Popen(cmd, env=dict(env, MLX_RANK=str(rank)), stdin=subprocess.DEVNULL,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            threading.Thread(target=_relay, args=(p.stdout, rank), daemon=True).start()
            followers.append(p)
        watch = threading.Thread(target=_report_deaths, args=(followers,), daemon=True)
        watch.start()
        leader = subprocess.Popen(cmd, env=dict(env, MLX_RANK="0"))
        try:
            code = leader.wait()
        except KeyboardInterrupt:  # the terminal's Ctrl-C reached rank 0 too: let it finish
            code = leader.wait()
        _end(followers)
        return code


def _report_deaths(followers: list[subprocess.Popen]) -> None:
    """Say when a follower dies while rank 0 runs (rank 0 itself is left running)."""
    alive = set(range(len(followers)))
    while alive:
        for i in list(alive):
            code = followers[i].poll()
            if code is not None:
                alive.discard(i)
                if code != 0:
                    sys.stderr.write(f"[launch-cluster] rank {i + 1} exited with code {code}; "
                                     "rank 0 stops its engine at its next step\n")
        time.sleep(0.2)


def _end(followers: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + FOLLOWER_GRACE_S
    for p in followers:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(2.0)
            except subprocess.TimeoutExpired:
                p.kill()


def hosts_in(hostfile: str) -> int:
    """How many ranks an mlx.launch hostfile describes (a JSON list of hosts)."""
    try:
        with open(hostfile) as f:
            hosts = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{hostfile}: cannot read the hostfile ({e})") from None
    if not isinstance(hosts, list) or not hosts:
        raise ValueError(f"{hostfile}: expected a JSON list of hosts")
    return len(hosts)


def run_hosts(hostfile: str, argv: Sequence[str], python: str | None = None) -> int:
    """Run `mlxlocal argv` on the hosts of `hostfile` through mlx.launch (ring backend)."""
    launcher = shutil.which("mlx.launch") or os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    return subprocess.call([launcher, "--backend", "ring", "--hostfile", hostfile,
                            "--python", python or sys.executable, "--", "-m", "mlxlocal", *argv])


__all__ = ["free_ports", "hosts_in", "ring_hostfile", "run_hosts", "run_local"]
