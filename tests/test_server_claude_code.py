"""Claude Code 2.1's first /v1/messages?beta=true request, replayed against the server.

tests/fixtures/claude_code_first_request.json is the body the real Claude Code 2.1.332 sent
(recorded with `claude -p`): system blocks with cache_control, a system-role entry inside
messages after the user's, adaptive thinking with display omitted, context_management,
output_config, metadata, 21 tools with long schemas (~61 KB), stream, max_tokens 32000. It
is tens of thousands of tokens on the test tokenizer, which a tiny model prefills slowly
on a CPU: the quick test sends it to count_tokens whole (tokenizing only) and streams a
copy with the tools' prose cut (every field, tool and schema kept); the whole body is
streamed by a `slow` test. The model: conftest's agent_model (64k context, 4k vocabulary).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import httpx
import pytest
from server_util import thinks_until_stopped

FIXTURE = Path(__file__).parent / "fixtures" / "claude_code_first_request.json"
CONTEXT = 65536


@pytest.fixture(scope="module")
def big_server(agent_model):
    from server_util import running_server

    from mlxlocal.server import ServerConfig

    with running_server(ServerConfig(models=[str(agent_model)])) as (url, app):
        served = app.state.registry.models[0]
        yield url, served.name, served.engine.tokenizer


def fixture_body(model: str) -> dict:
    body = json.loads(FIXTURE.read_text())
    body["model"] = model  # Claude Code sends its own id; serve it under --served-model-name in use
    return body


def trimmed(body: dict) -> dict:
    """The same request with the tools' and system prompt's prose cut."""
    body = copy.deepcopy(body)
    for tool in body["tools"]:
        tool["description"] = tool["description"].split("\n", 1)[0]
        for prop in tool["input_schema"].get("properties", {}).values():
            prop.pop("description", None)
    body["system"][1]["text"] = body["system"][1]["text"][:300]
    return body


HEADERS = {"anthropic-version": "2023-06-01", "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
           "context-management-2025-06-27", "x-api-key": "x", "user-agent": "claude-cli/2.1.0 (external, cli)"}


def count_tokens(url: str, body: dict) -> int:
    request = {k: v for k, v in body.items() if k not in ("stream", "max_tokens", "metadata", "temperature")}
    r = httpx.post(f"{url}/v1/messages/count_tokens?beta=true", json=request, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) per SSE event; each must have both, and agree on the type."""
    events = []
    for raw in text.strip().split("\n\n"):
        if raw.startswith(":"):  # a keep-alive comment (the prefill's progress)
            assert re.fullmatch(r": keepalive \d+/\d+", raw), raw
            continue
        lines = dict(line.split(": ", 1) for line in raw.splitlines())
        assert set(lines) == {"event", "data"}, raw
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"], raw
        events.append((lines["event"], data))
    return events


def check_stream(text: str) -> dict:
    """A well-formed Messages stream; returns its final usage."""
    events = sse_events(text)
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"], names
    assert "error" not in names
    open_index = None
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        else:
            assert name == "ping", name
    assert open_index is None
    start, delta = events[0][1]["message"], events[-2][1]
    assert start["role"] == "assistant" and start["content"] == []
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    return {"start": start["usage"], "end": delta["usage"]}


def replay(url: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/messages?beta=true", json=body, headers=HEADERS, timeout=900)
    assert r.status_code == 200, r.text[:500]
    assert r.headers["content-type"].startswith("text/event-stream")
    return check_stream(r.text)


def test_fixture_is_what_claude_code_sends():
    body = json.loads(FIXTURE.read_text())
    assert len(body["tools"]) == 21 and len(json.dumps(body["tools"])) > 60_000
    assert [m["role"] for m in body["messages"]] == ["user", "system"]
    assert body["thinking"]["type"] == "adaptive" and body["stream"] is True and body["max_tokens"] == 32000
    assert {"context_management", "output_config", "metadata"} <= set(body)


def test_whole_fixture_counts_and_fits(big_server):
    url, model, _ = big_server
    n = count_tokens(url, fixture_body(model))
    assert 30_000 < n < CONTEXT  # every tool schema is in the prompt


def test_fixture_replay_stream(big_server):
    url, model, _ = big_server
    body = trimmed(fixture_body(model))
    body["max_tokens"] = 8  # the random model rambles; 32000 is only a cap
    n = count_tokens(url, body)
    usage = replay(url, body)
    assert usage["start"]["input_tokens"] == n
    end = usage["end"]
    assert end["input_tokens"] + end["cache_read_input_tokens"] + end["cache_creation_input_tokens"] == n
    assert 0 < end["output_tokens"] <= 8
    # Claude Code's next request repeats the prefix: it comes from the cache.
    again = replay(url, body)["end"]
    assert again["cache_read_input_tokens"] >= n - 16 and again["input_tokens"] + again["cache_read_input_tokens"] == n


@pytest.mark.slow
def test_whole_fixture_replay_stream(big_server):
    url, model, _ = big_server
    body = fixture_body(model)
    body["max_tokens"] = 4
    usage = replay(url, body)
    assert usage["start"]["input_tokens"] == count_tokens(url, body)


def test_thinking_budget_closes_the_think_block(big_server):
    url, model, tokenizer = big_server
    body = {"model": model, "max_tokens": 1100, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "messages": [{"role": "user", "content": "think hard"}]}
    with thinks_until_stopped(tokenizer, "Done"):
        r = httpx.post(f"{url}/v1/messages", json=body, headers=HEADERS, timeout=300)
    assert r.status_code == 200, r.text
    msg = r.json()
    assert [b["type"] for b in msg["content"]] == ["thinking", "text"], msg["content"]
    assert msg["content"][0]["thinking"].rstrip() == "x" * 1023  # <think> then x up to the budget
    assert msg["content"][1]["text"] == "Done" and msg["stop_reason"] == "end_turn"
    # One request to the client: its prompt, every generated token (the marker is not output).
    assert msg["usage"]["output_tokens"] == 1024 + len(tokenizer.encode("Done", add_special_tokens=False))
    assert msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"] == count_tokens(url, body)
    # Without a budget the same model thinks until max_tokens.
    del body["thinking"]
    with thinks_until_stopped(tokenizer, "Done"):
        msg = httpx.post(f"{url}/v1/messages", json=body, headers=HEADERS, timeout=300).json()
    assert [b["type"] for b in msg["content"]] == ["thinking"] and msg["stop_reason"] == "max_tokens"
