"""The README's server quickstart works as written: its `serve` line starts a server, its curl
command and its openai-client snippet get replies (on a free port instead of 8080)."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
README = Path(__file__).parent.parent / "README.md"


def blocks(heading: str) -> dict[str, str]:
    """The first ```sh and ```python blocks of a README section."""
    text = README.read_text()
    section = text[text.index(heading):]
    section = section[: section.index("\n## ", 1)]
    return {lang: re.search(rf"```{lang}\n(.*?)```", section, re.S)[1] for lang in ("sh", "python")}


def test_the_serve_quickstart_answers_curl_and_the_openai_client(tmp_path):
    got = blocks("## Serve:")
    serve, wait, curl = got["sh"].replace("\\\n", " ").strip().splitlines()
    assert serve.endswith(" &") and "mlxlocal serve" in serve and "8080" in serve
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # The same arguments, run by this environment's Python instead of `uv run`.
    argv = shlex.split(serve.removesuffix(" &").replace("8080", str(port)))
    argv = [sys.executable, "-m", "mlxlocal", *argv[argv.index("mlxlocal") + 1:]]
    env = dict(os.environ, MLXLOCAL_HOME=str(tmp_path))
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below; a pipe nobody reads could fill
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        # The README's own wait for the server (its loop, bounded here).
        assert "/health" in wait and "until" in wait
        waited = subprocess.run(["timeout", "180", "bash", "-c", wait.split("#")[0].replace("8080", str(port))],
                                capture_output=True, text=True)
        assert waited.returncode == 0 and proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
        out = subprocess.run(["bash", "-c", curl.replace("8080", str(port))], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        reply = json.loads(out.stdout)
        assert reply["choices"][0]["message"]["content"] and reply["usage"]["completion_tokens"] <= 16
        code = got["python"].replace("8080", str(port))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip(), out.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
