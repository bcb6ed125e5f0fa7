"""Starting ranks for the distributed tests (tensor and pipeline parallel)."""

from __future__ import annotations

import random
import socket
import sys
from pathlib import Path

LAUNCH = str(Path(sys.executable).parent / "mlx.launch")


def port_run(n: int) -> int:
    """The first of n consecutive loopback ports free now: mlx.launch's ring listens on
    --starting-port + rank (its fixed default would collide with any other launch running)."""
    while True:
        start = random.randint(20000, 60000)
        socks = []
        try:
            for port in range(start, start + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return start
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def mlx_launch(n: int) -> list[str]:
    return [LAUNCH, "--backend", "ring", "-n", str(n), "--starting-port", str(port_run(n)), "--python", sys.executable, "--"]
