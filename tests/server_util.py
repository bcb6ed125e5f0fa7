"""Helpers for server tests: a real uvicorn server on loopback, and scripted model output."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import mlx.core as mx
import uvicorn

from mlxlocal.engine import sampling
from mlxlocal.server import ServerConfig, create_app


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(config: ServerConfig, like_serve: bool = False):
    """Serve `config` on 127.0.0.1 in a thread; yield the base URL; stop on exit.

    like_serve: behind the uvicorn settings `mlxlocal serve` uses (header timeout,
    connection cap, keep-alive) instead of uvicorn's defaults.
    """
    from mlxlocal.server.banner import uvicorn_config

    config.port = config.port if config.port not in (0, 8080) else free_port()
    app = create_app(config)
    settings = (uvicorn_config(app, config, log_level="warning", lifespan="on") if like_serve
                else uvicorn.Config(app, host="127.0.0.1", port=config.port, log_level="warning", lifespan="on"))
    server = uvicorn.Server(settings)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{config.port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def scripted_output(tokenizer, text: str):
    """Make every request's sampler emit `text` then EOS, whatever the model computes.

    Steers a tiny random model through paths that need real output (tool calls,
    reasoning): the next token is the script's continuation of what was generated.
    """
    # The turn's own end token: the one a grammar (a forced tool call) allows at its end.
    end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else min(tokenizer.eos_token_ids)
    script = list(tokenizer.encode(text, add_special_tokens=False)) + [end]

    def next_token(history) -> int:
        done = next((k for k in range(len(script), 0, -1) if history[-k:] == script[:k]), 0)
        return script[min(done, len(script) - 1)]

    with steered_output(next_token):
        yield script


@contextmanager
def steered_output(next_token):
    """Make every request's sampler emit next_token(prompt + generated ids so far)."""
    original, original_batch = sampling.Sampler.__call__, sampling.sample_batch

    def known(history, pending) -> list[int]:
        if pending is not None:  # the previous token is still in flight: wait for its value
            history = history + [int(pending.item())]
        return history

    def steered(self, logits, history, pending=None, allowed=None):  # the script ignores a grammar's mask
        _, logprobs = original(self, logits, history, pending)
        return mx.array([next_token(known(history, pending))]), logprobs

    def steered_batch(samplers, logits, histories, pendings, allowed=None):
        _, logprobs = original_batch(samplers, logits, histories, pendings)
        return mx.array([next_token(known(h, p)) for h, p in zip(histories, pendings)], mx.uint32), logprobs

    sampling.Sampler.__call__, sampling.sample_batch = steered, steered_batch
    try:
        yield
    finally:
        sampling.Sampler.__call__, sampling.sample_batch = original, original_batch


@contextmanager
def thinks_until_stopped(tokenizer, answer: str):
    """The model opens a think block and never closes it itself; once the think-end
    marker is in its history, it answers `answer` and stops."""
    def ids(text):
        return list(tokenizer.encode(text, add_special_tokens=False))

    (start,), (end,), x = ids("<think>"), ids("</think>"), ids("x")[0]
    reply, gap = ids(answer) + [min(tokenizer.eos_token_ids)], len(ids("\n\n"))

    def next_token(history: list[int]) -> int:
        if start not in history:
            return start
        if end not in history:
            return x
        k = len(history) - history.index(end) - 1 - gap
        return reply[min(max(k, 0), len(reply) - 1)]

    with steered_output(next_token):
        yield
