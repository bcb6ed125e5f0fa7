"""`mlxlocal bench --url --replay`: the three dialects' SSE streams parsed from recorded text, the
replay file format, and a replay of chat-completions turns against a real server."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from server_util import running_server

from mlxlocal.bench.replay import load_replay, measure_replay, prepare, run_replay_bench
from mlxlocal.bench.sse import account_stream
from mlxlocal.errors import EndpointBenchError
from mlxlocal.server import ServerConfig


def ev(name: str, obj: dict) -> bytes:
    return f"event: {name}\ndata: {json.dumps(obj)}\n\n".encode()


# Recorded the way Anthropic's API streams /v1/messages (ping, a thinking block, text, a tool_use).
ANTHROPIC = [
    (0.5, ev("message_start", {"type": "message_start", "message": {
        "id": "msg_1", "type": "message", "role": "assistant", "content": [], "model": "m",
        "stop_reason": None, "usage": {"input_tokens": 12, "cache_read_input_tokens": 100,
                                       "cache_creation_input_tokens": 3, "output_tokens": 1}}})),
    (0.6, ev("ping", {"type": "ping"})),
    (0.7, ev("content_block_start", {"type": "content_block_start", "index": 0,
                                     "content_block": {"type": "thinking", "thinking": ""}})),
    (1.0, ev("content_block_delta", {"type": "content_block_delta", "index": 0,
                                     "delta": {"type": "thinking_delta", "thinking": "hmm"}})),
    (1.1, ev("content_block_stop", {"type": "content_block_stop", "index": 0})),
    (1.1, ev("content_block_start", {"type": "content_block_start", "index": 1,
                                     "content_block": {"type": "text", "text": ""}})),
    (1.2, ev("content_block_delta", {"type": "content_block_delta", "index": 1,
                                     "delta": {"type": "text_delta", "text": "Hello"}})),
    (1.3, ev("content_block_stop", {"type": "content_block_stop", "index": 1})),
    (1.3, ev("content_block_start", {"type": "content_block_start", "index": 2, "content_block": {
        "type": "tool_use", "id": "toolu_1", "name": "Read", "input": {}}})),
    (1.4, ev("content_block_delta", {"type": "content_block_delta", "index": 2,
                                     "delta": {"type": "input_json_delta", "partial_json": '{"path": '}})),
    (1.5, ev("content_block_delta", {"type": "content_block_delta", "index": 2,
                                     "delta": {"type": "input_json_delta", "partial_json": '"a.py"}'}})),
    (1.6, ev("content_block_stop", {"type": "content_block_stop", "index": 2})),
    (2.0, ev("message_delta", {"type": "message_delta", "delta": {"stop_reason": "tool_use"},
                               "usage": {"output_tokens": 9}})),
    (2.1, ev("message_stop", {"type": "message_stop"})),
]

# Recorded the way the OpenAI Responses API streams (reasoning, text, a function call).
RESPONSES = [
    (0.2, ev("response.created", {"type": "response.created", "response": {
        "id": "resp_1", "status": "in_progress", "error": None, "usage": None}})),
    (0.3, ev("response.output_item.added", {"type": "response.output_item.added", "output_index": 0,
                                            "item": {"type": "reasoning", "id": "rs_1"}})),
    (0.8, ev("response.reasoning_text.delta", {"type": "response.reasoning_text.delta", "output_index": 0,
                                               "delta": "think"})),
    (0.9, ev("response.output_item.added", {"type": "response.output_item.added", "output_index": 1,
                                            "item": {"type": "message", "id": "m1", "role": "assistant"}})),
    (1.0, ev("response.output_text.delta", {"type": "response.output_text.delta", "output_index": 1,
                                            "content_index": 0, "delta": "Hi"})),
    (1.1, ev("response.output_text.delta", {"type": "response.output_text.delta", "output_index": 1,
                                            "content_index": 0, "delta": " there"})),
    (1.2, ev("response.output_item.added", {"type": "response.output_item.added", "output_index": 2, "item": {
        "type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "shell", "arguments": ""}})),
    (1.3, ev("response.function_call_arguments.delta", {"type": "response.function_call_arguments.delta",
                                                        "output_index": 2, "delta": '{"cmd": "ls"}'})),
    (1.9, ev("response.completed", {"type": "response.completed", "response": {
        "id": "resp_1", "status": "completed", "error": None, "usage": {
            "input_tokens": 200, "input_tokens_details": {"cached_tokens": 128}, "output_tokens": 7,
            "output_tokens_details": {"reasoning_tokens": 1}, "total_tokens": 207}}})),
]


def test_anthropic_stream_from_recorded_text():
    acc = account_stream(ANTHROPIC, t_start=0.0, dialect="anthropic")
    assert acc.ok and acc.done and acc.finish_reason == "tool_use"
    assert acc.reasoning == "hmm" and acc.content == "Hello"
    call = acc.tool_calls[2]
    assert (call.id, call.name, json.loads(call.arguments)) == ("toolu_1", "Read", {"path": "a.py"})
    assert acc.ttft == 1.0  # the first thinking delta; message_start, ping, empty block starts are not output
    assert acc.gen_time == pytest.approx(0.5)
    assert acc.usage_summary() == {"prompt_tokens": 115, "cached_tokens": 100, "output_tokens": 9}


def test_anthropic_stream_byte_by_byte_and_errors():
    raw = b"".join(b for _, b in ANTHROPIC)
    acc = account_stream(((float(i), raw[i:i + 1]) for i in range(len(raw))), dialect="anthropic")
    assert acc.ok and acc.content == "Hello" and acc.usage_summary()["output_tokens"] == 9
    err = ev("error", {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    acc = account_stream([(1.0, ANTHROPIC[0][1] + err)], dialect="anthropic")
    assert acc.error == "stream_error" and acc.error_message == "Overloaded"
    acc = account_stream(ANTHROPIC[:7], dialect="anthropic")  # cut before message_stop
    assert acc.error == "truncated" and "message_stop" in acc.error_message


def test_responses_stream_from_recorded_text():
    acc = account_stream(RESPONSES, t_start=0.0, dialect="responses")
    assert acc.ok and acc.done and acc.finish_reason == "completed"
    assert acc.reasoning == "think" and acc.content == "Hi there"
    call = acc.tool_calls[2]
    assert (call.id, call.name, json.loads(call.arguments)) == ("call_1", "shell", {"cmd": "ls"})
    assert acc.ttft == 0.8 and acc.output_times[-1] == 1.3
    assert acc.usage_summary() == {"prompt_tokens": 200, "cached_tokens": 128, "output_tokens": 7}


def test_responses_failed_and_error_events():
    failed = ev("response.failed", {"type": "response.failed", "response": {
        "status": "failed", "error": {"code": "server_error", "message": "engine stopped"}}})
    acc = account_stream([(1.0, RESPONSES[0][1] + failed)], dialect="responses")
    assert acc.error == "stream_error" and acc.error_message == "engine stopped"
    err = ev("error", {"type": "error", "code": "bad", "message": "nope"})
    acc = account_stream([(1.0, err)], dialect="responses")
    assert acc.error == "stream_error" and acc.error_message == "nope"
    acc = account_stream(RESPONSES[:5], dialect="responses")
    assert acc.error == "truncated"


def test_chat_usage_summary():
    raw = (b'data: {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"}]}\n\n'
           b'data: {"choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 1, '
           b'"prompt_tokens_details": {"cached_tokens": 32}}}\n\ndata: [DONE]\n\n')
    assert account_stream([(1.0, raw)]).usage_summary() == {"prompt_tokens": 40, "cached_tokens": 32,
                                                            "output_tokens": 1}


# --- the file format ----------------------------------------------------------------------------
def test_replay_file_format(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text('{"path": "/v1/messages?beta=true", "body": {"model": "x", "max_tokens": 5, "messages": []},'
                 ' "headers": {"anthropic-beta": "b1", "Content-Length": "99", "Host": "api.anthropic.com"}}\n'
                 '\n{"path": "/v1/responses", "body": {"model": "x", "input": "hi"}}\n'
                 '{"model": "x", "messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(EndpointBenchError, match="r.jsonl:4.*--replay-path"):
        load_replay(str(f))
    reqs = load_replay(str(f), "/v1/chat/completions")
    assert [(r.line, r.dialect) for r in reqs] == [(1, "anthropic"), (3, "responses"), (4, "chat")]
    body, headers = prepare(reqs[0], model="local")
    assert body["stream"] is True and body["model"] == "local" and body["max_tokens"] == 5
    assert headers["anthropic-version"] == "2023-06-01" and headers["anthropic-beta"] == "b1"
    assert "Content-Length" not in headers and "Host" not in headers
    body, _ = prepare(reqs[2])
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "x"
    for text, message in (('{"path": "/v2/x", "body": {}}', "path must be one of"), ("[1]", "JSON object"),
                          ('{"path": "/v1/messages", "body": 3}', "'body' must be an object"), ("{", "not JSON")):
        f.write_text(text + "\n")
        with pytest.raises(EndpointBenchError, match=message):
            load_replay(str(f))
    with pytest.raises(EndpointBenchError, match="--replay-path"):
        load_replay(str(f), "/v1/nope")


def test_replay_over_a_scripted_transport(tmp_path):
    """Each dialect goes to its route with its headers, and is parsed by its own rules."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("anthropic-version"), json.loads(request.content)))
        raw = b"".join(b for _, b in (ANTHROPIC if request.url.path == "/v1/messages" else RESPONSES))
        if request.url.path == "/v1/chat/completions":
            return httpx.Response(404, json={"error": {"message": "no such route"}})
        return httpx.Response(200, content=raw, headers={"content-type": "text/event-stream"})

    f = tmp_path / "r.jsonl"
    f.write_text("\n".join(json.dumps(x) for x in [
        {"path": "/v1/messages", "body": {"model": "a", "max_tokens": 4, "messages": []}},
        {"path": "/v1/responses", "body": {"model": "a", "input": "hi"}},
        {"path": "/v1/chat/completions", "body": {"model": "a", "messages": []}}]) + "\n")
    r = asyncio.run(measure_replay("http://x.test/v1", str(f), transport=httpx.MockTransport(handler)))
    assert [s[0] for s in seen] == ["/v1/messages", "/v1/responses", "/v1/chat/completions"]
    assert seen[0][1] == "2023-06-01" and all(s[2]["stream"] is True for s in seen)
    t1, t2, t3 = r["turns"]
    assert (t1["prompt_tokens"], t1["cached_tokens"], t1["output_tokens"]) == (115, 100, 9)
    assert (t2["prompt_tokens"], t2["cached_tokens"], t2["output_tokens"]) == (200, 128, 7)
    assert t3["status"] == "error" and t3["error"] == "http_404" and t3["http_status"] == 404
    assert r["completed"] == 2 and r["failed"] == 1 and r["total_cached_tokens"] == 228


# --- against a real `mlxlocal serve` ------------------------------------------------------------
def test_replay_chat_turns_against_mlxlocal_serve(tiny_model, tmp_path, capsys):
    long = " ".join(f"word{i}" for i in range(30))  # several KV blocks shared by every turn
    turns, history = [], [{"role": "system", "content": "You are terse. " + long}]
    for i, question in enumerate(["first question", "second question", "third question"]):
        history = history + [{"role": "user", "content": question}]
        turns.append({"path": "/v1/chat/completions",
                      "body": {"model": "recorded-model-name", "messages": history, "max_tokens": 4,
                               "temperature": 0}})
        history = history + [{"role": "assistant", "content": f"answer {i}"}]
    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join(json.dumps(t) for t in turns) + "\n")
    bare = tmp_path / "bare.jsonl"
    bare.write_text(json.dumps(turns[0]["body"]) + "\n")
    with running_server(ServerConfig(models=[str(tiny_model)], served_model_names=["tiny"])) as (url, _app):
        result = run_replay_bench(url, str(f), model="tiny", as_json=True)
        printed = json.loads(capsys.readouterr().out)
        table = run_replay_bench(url + "/v1", str(bare), "/v1/chat/completions", model="tiny")
        out = capsys.readouterr().out
    assert printed["turns"] == result["turns"], [(t["error"], t["error_message"]) for t in result["turns"]]
    assert result["completed"] == 3 and result["failed"] == 0, [(t["error"], t["error_message"]) for t in result["turns"]]
    prompts = [t["prompt_tokens"] for t in result["turns"]]
    assert prompts[0] > 60 and prompts[0] < prompts[1] < prompts[2]
    for t in result["turns"]:
        assert t["model"] == "tiny" and 0 < t["ttft_s"] <= t["total_s"] and 0 < t["output_tokens"] <= 4
    cached = [t["cached_tokens"] for t in result["turns"]]
    assert cached[1] > 0 and cached[2] > 0  # later turns reuse the earlier prompt through the prefix cache
    assert result["total_cached_tokens"] == sum(cached)
    assert table["completed"] == 1 and "Replay" in out and "1/1 turns ok" in out


def test_replay_cli_errors(tmp_path):
    from typer.testing import CliRunner

    from mlxlocal.cli import app

    runner = CliRunner()
    out = runner.invoke(app, ["bench", "replay", "x.jsonl"])
    assert out.exit_code == 2 and "--url" in out.output  # required
    out = runner.invoke(app, ["bench", "replay", "x.jsonl", "--url", "http://127.0.0.1:9", "-c", "2"])
    assert out.exit_code == 2 and "-c" in out.output  # not one of its options: it sends them in order
    out = runner.invoke(app, ["bench", "replay", str(tmp_path / "none.jsonl"), "--url", "http://127.0.0.1:9"])
    assert out.exit_code == 1 and "does not exist" in out.output


def test_gen_tokens_caps_every_dialect_reply():
    from mlxlocal.bench.replay import ReplayRequest, prepare

    cases = [("/v1/messages", {"max_tokens": 32000}, "max_tokens"),
             ("/v1/chat/completions", {"max_completion_tokens": 5000}, "max_completion_tokens"),
             ("/v1/responses", {}, "max_output_tokens")]
    for path, body, field in cases:
        req = ReplayRequest(path=path, body={"model": "m", **body}, headers={}, line=1)
        sent, _ = prepare(req, max_tokens=16)
        assert sent[field] == 16 and sent["stream"] is True
    small = ReplayRequest(path="/v1/messages", body={"model": "m", "max_tokens": 4}, headers={}, line=1)
    assert prepare(small, max_tokens=16)[0]["max_tokens"] == 4  # never raised


def test_recorded_claude_code_session_converts_to_chat():
    """scripts/anthropic_to_chat.py on the recorded 5-turn Claude Code session: same turns,
    the system entry folded after the top-level system, tools as function tools."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("anthropic_to_chat", root / "scripts" / "anthropic_to_chat.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    convert = script.convert
    lines = [json.loads(x) for x in (root / "tests" / "fixtures" / "claude_code_session.jsonl").read_text().splitlines()]
    assert len(lines) == 5
    for i, rec in enumerate(lines):
        body = rec["body"]
        chat = convert(body)
        roles = [m["role"] for m in chat["messages"]]
        assert roles[0] == "system" and roles.count("system") == 1
        assert roles[1:] == ["user"] + ["assistant", "user"] * i
        system_entry = next(m for m in body["messages"] if m["role"] == "system")
        assert chat["messages"][0]["content"].endswith(script._text(system_entry["content"]))
        assert [t["function"]["name"] for t in chat["tools"]] == [t["name"] for t in body["tools"]]
