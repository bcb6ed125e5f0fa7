"""Helpers for tests that drive the agent tool loop (mlxlocal/agents/loop.py) on a tiny
model: replies the model is made to "say" step by step, and an McpHub started from MCP
config files the way the front ends start it."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from pathlib import Path

from server_util import steered_output


def call(function: str, **arguments) -> str:
    """A reply that is one tool call, in the qwen3 (Hermes) syntax the tiny model's template uses."""
    return f'<tool_call>\n{{"name": "{function}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


@contextmanager
def scripted_steps(tokenizer, replies: list[str], interrupt: tuple[int, threading.Event] | None = None):
    """Step k of the conversation (counted by the assistant headers in the prompt) says
    replies[k] then the end of turn; past the list, the last reply again. `interrupt`
    (k, event): Ctrl-C (the event set) after step k has generated a few tokens."""
    end = tokenizer.eos_token_id
    scripts = [list(tokenizer.encode(r, add_special_tokens=False)) + [end] for r in replies]
    header = list(tokenizer.encode("<|im_start|>assistant", add_special_tokens=False))
    n = len(header)

    def next_token(history: list[int]) -> int:
        starts = [i for i in range(len(history) - n + 1) if history[i:i + n] == header]
        script = scripts[min(len(starts) - 1, len(scripts) - 1)]
        tail = history[starts[-1] + n:]
        if interrupt is not None and len(starts) - 1 == interrupt[0] and len(tail) > 4:
            interrupt[1].set()
        done = next((k for k in range(len(script), 0, -1) if tail[-k:] == script[:k]), 0)
        return script[min(done, len(script) - 1)]

    with steered_output(next_token):
        yield


@contextmanager
def hub_for(*configs: Path):
    """The servers of the config files (none may be broken) and a started McpHub for them."""
    from mlxlocal.agents.client import McpHub
    from mlxlocal.agents.config import load_configs

    servers, problems = load_configs(list(configs))
    assert not problems, problems
    with McpHub.start(servers, connect_timeout=30) as hub:
        yield servers, hub
