"""The thinking budget on every dialect: `thinking_budget` in the body of /v1/chat/completions
and /v1/responses, options.thinking_budget for Ollama's /api/chat and /api/generate
(/v1/messages has thinking.budget_tokens: test_server_claude_code.py). The model opens a
think block it never closes by itself; at the budget the engine closes it, and the model
answers in the same request. Bad values are a 400 naming the field.
"""

from __future__ import annotations

import json

import httpx
import pytest
from server_util import thinks_until_stopped

BUDGET, MAX = 16, 40
THOUGHTS = "x" * (BUDGET - 1)  # <think> is the first of the budget's tokens
ASK = [{"role": "user", "content": "think hard"}]


@pytest.fixture(scope="module")
def served(server):
    url, app = server
    served = app.state.registry.models[0]
    return url, served.name, served.engine.tokenizer


def post(url: str, path: str, body: dict, tokenizer=None) -> httpx.Response:
    if tokenizer is None:
        return httpx.post(f"{url}{path}", json=body, timeout=120)
    with thinks_until_stopped(tokenizer, "Done"):
        return httpx.post(f"{url}{path}", json=body, timeout=120)


def output_tokens(tokenizer) -> int:
    """What the reply counts: the budget's tokens and the answer's, not the marker."""
    return BUDGET + len(tokenizer.encode("Done", add_special_tokens=False))


def test_chat_completions(served):
    url, model, tok = served
    body = {"model": model, "messages": ASK, "max_tokens": MAX, "thinking_budget": BUDGET}
    r = post(url, "/v1/chat/completions", body, tok)
    assert r.status_code == 200, r.text
    out = r.json()
    msg = out["choices"][0]["message"]
    assert msg["reasoning_content"] == THOUGHTS and msg["content"] == "Done"
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == output_tokens(tok)
    # Streamed: the marker's chunk carries no token, the deltas are the same.
    r = post(url, "/v1/chat/completions", {**body, "stream": True}, tok)
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas).rstrip() == THOUGHTS
    assert "".join(d.get("content") or "" for d in deltas) == "Done"
    # Without a budget the model thinks to max_tokens.
    del body["thinking_budget"]
    out = post(url, "/v1/chat/completions", body, tok).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"]["content"]


def test_responses(served):
    url, model, tok = served
    body = {"model": model, "input": "think hard", "max_output_tokens": MAX,
            "thinking_budget": BUDGET}
    r = post(url, "/v1/responses", body, tok)
    assert r.status_code == 200, r.text
    out = r.json()
    reasoning, message = out["output"]
    assert reasoning["type"] == "reasoning"
    assert reasoning["content"][0]["text"].rstrip() == THOUGHTS
    assert message["type"] == "message" and message["content"][0]["text"] == "Done"
    assert out["status"] == "completed" and out["usage"]["output_tokens"] == output_tokens(tok)


@pytest.mark.parametrize("path", ["/api/chat", "/api/generate"])
def test_ollama(served, path):
    url, model, tok = served
    body = {"model": model, "stream": False, "think": True,
            "options": {"num_predict": MAX, "thinking_budget": BUDGET}}
    body.update({"messages": ASK} if path == "/api/chat" else {"prompt": "think hard"})
    r = post(url, path, body, tok)
    assert r.status_code == 200, r.text
    out = r.json()
    reply = out["message"] if path == "/api/chat" else out
    assert reply["thinking"].strip() == THOUGHTS
    assert reply["content" if path == "/api/chat" else "response"] == "Done"
    assert out["done_reason"] == "stop" and out["eval_count"] == output_tokens(tok)


BAD = [0, -3, 2**31, 1.5, "8", True, [16]]


PATHS = ["/v1/chat/completions", "/v1/responses", "/api/chat", "/api/generate"]


@pytest.mark.parametrize("bad", BAD)
@pytest.mark.parametrize("path", PATHS)
def test_bad_budgets_are_400s(served, path, bad):
    url, model, _ = served
    if path.startswith("/api/"):
        options = {"num_predict": 4, "thinking_budget": bad}
        body = {"model": model, "stream": False, "options": options}
        body.update({"messages": ASK} if path == "/api/chat" else {"prompt": "hi"})
        where = "options.thinking_budget"
    else:
        body = {"model": model, "thinking_budget": bad}
        body.update({"messages": ASK, "max_tokens": 4} if path == "/v1/chat/completions"
                    else {"input": "hi", "max_output_tokens": 4})
        where = "thinking_budget"
    r = post(url, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if path.startswith("/api/"):
        assert error.startswith(where + ":"), error
    else:
        assert error["param"] == where and error["message"].startswith(where + ":"), error
