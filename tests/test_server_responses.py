"""POST /v1/responses (the OpenAI Responses API), driven by the official openai client
against a real server on the tiny model, plus a Codex-style request replayed with httpx."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from pydantic import TypeAdapter
from server_util import running_server, scripted_output

FIXTURES = Path(__file__).parent / "fixtures"
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": False,
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# What the synthetic ChatML template renders for an assistant turn with reasoning_content
# and one tool call: a model that answers like this re-renders token for token.
THINK_THEN_CALL = "<think>\nI should look it up.\n</think>\n\n\n" + CALL


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The tiny qwen3 with an 8k context (the tools' system prompt and Codex's instructions do
    not fit in 512 tokens), served under the name Codex would use for a local model."""
    from conftest import FAMILY_CONFIGS, build_tiny
    from server_util import running_server

    from mlxlocal.server import ServerConfig

    path = build_tiny(tmp_path_factory.mktemp("long") / "qwen3",
                      dict(FAMILY_CONFIGS["qwen3"], max_position_embeddings=8192))
    with running_server(ServerConfig(models=[str(path)], served_model_names=["gpt-oss:20b"])) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def model(server) -> str:
    return "gpt-oss:20b"


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tokenizer(server, model):
    return server[1].state.registry.models[0].engine.tokenizer


def test_text_non_streaming(client, model):
    r = client.responses.create(model=model, input="hello", max_output_tokens=6, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert r.status in ("completed", "incomplete")
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.output_text == message.content[0].text
    u = r.usage
    assert u.input_tokens > 0 and 0 < u.output_tokens <= 6
    assert u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    assert u.input_tokens_details.cached_tokens + u.input_tokens_details.cache_write_tokens == u.input_tokens


def test_max_output_tokens_makes_it_incomplete(client, model, tokenizer):
    with scripted_output(tokenizer, "a long answer that goes on and on"):
        r = client.responses.create(model=model, input="talk", max_output_tokens=3, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"


def test_streaming_event_order(client, model, tokenizer):
    kwargs = dict(model=model, input="stream me", max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 0
    final = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added"] + ["response.output_text.delta"] * deltas + [
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", final]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    # The SDK's own accumulator must follow every event (of a response that completes).
    with scripted_output(tokenizer, "a short answer"), client.responses.stream(**kwargs) as stream:
        final_response = stream.get_final_response()
    assert final_response.status == "completed" and final_response.output_text == "a short answer"


def test_tool_call_and_its_output(client, model, tokenizer):
    ask = [{"role": "user", "content": "weather in Paris?"}]
    with scripted_output(tokenizer, CALL):
        r = client.responses.create(model=model, input=ask, tools=[WEATHER_TOOL], max_output_tokens=120, temperature=0)
        with client.responses.stream(model=model, input=ask, tools=[WEATHER_TOOL], max_output_tokens=120,
                                     temperature=0) as stream:
            events = list(stream)
            streamed = stream.get_final_response()
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris"} and call.status == "completed"
    assert r.tools[0].name == "get_weather"
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}
    assert not any(e.type == "response.output_text.delta" for e in events)  # the whitespace around it too
    [streamed_call] = streamed.output  # the SDK's accumulator built the same item from the events
    assert (streamed_call.name, streamed_call.arguments) == (call.name, call.arguments)

    follow = client.responses.create(
        model=model, max_output_tokens=3, temperature=0, tools=[WEATHER_TOOL],
        input=ask + [{"type": "function_call", "call_id": call.call_id, "name": call.name,
                      "arguments": call.arguments},
                     {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete")
    # The call and its result are in the prompt: longer than the question alone, mostly cached.
    assert follow.usage.input_tokens > r.usage.input_tokens + 10
    assert follow.usage.input_tokens_details.cached_tokens >= r.usage.input_tokens - 16


def test_reasoning_round_trip_hits_the_prefix_cache(client, model, tokenizer):
    """Codex's loop: reasoning + call, then the call's output with the reasoning item sent
    back (store=false, encrypted_content only). The turn re-renders as generated, so turn 2
    finds turn 1's prompt AND its generated tokens in the cache."""
    ask = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "weather in Rome?"}]}]
    common = dict(model=model, tools=[WEATHER_TOOL], temperature=0, store=False,
                  include=["reasoning.encrypted_content"])
    with scripted_output(tokenizer, THINK_THEN_CALL):
        first = client.responses.create(input=ask, max_output_tokens=200, **common)
    reasoning, call = first.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "I should look it up."
    assert reasoning.summary == [] and reasoning.encrypted_content
    assert first.usage.output_tokens_details.reasoning_tokens > 0
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    as_codex = {"type": "reasoning", "id": reasoning.id, "summary": [],
                "encrypted_content": reasoning.encrypted_content}  # Codex drops `content`
    call_item = call.model_dump(exclude_none=True)
    second = client.responses.create(input=ask + [as_codex, call_item, result], max_output_tokens=2, **common)
    turn1 = first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens >= turn1 - 1  # all but the last token's KV

    # Without the reasoning the assistant turn renders differently: the hit stops there.
    bare = client.responses.create(input=ask + [call_item, result], max_output_tokens=2, **common)
    assert bare.usage.input_tokens_details.cached_tokens <= first.usage.input_tokens
    # The reasoning's own text (the official client sends content back) works the same.
    with_content = reasoning.model_dump(exclude_none=True)
    again = client.responses.create(input=ask + [with_content, call_item, result], max_output_tokens=2, **common)
    assert again.usage.input_tokens == second.usage.input_tokens


def test_reasoning_streams_as_reasoning_text(client, model, tokenizer):
    with scripted_output(tokenizer, "<think>plan</think>Answer"):
        events = list(client.responses.create(model=model, input="think", max_output_tokens=20, temperature=0,
                                              stream=True))
    kinds = [e.type for e in events]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "plan"
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].encrypted_content is None  # only when include asks for it
    assert final.output_text == "Answer"


def test_previous_response_id_continues_the_conversation(client, model):
    first = client.responses.create(model=model, instructions="Be brief.", input="first question " * 4,
                                    max_output_tokens=4, temperature=0)
    second = client.responses.create(model=model, previous_response_id=first.id, input="and then?",
                                     max_output_tokens=4, temperature=0)
    assert second.previous_response_id == first.id
    # The earlier input and answer are in the prompt (instructions are not carried over).
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert client.responses.retrieve(first.id).output_text == first.output_text
    third = client.responses.create(model=model, previous_response_id=second.id, input="last",
                                    max_output_tokens=2, temperature=0)
    assert third.usage.input_tokens > second.usage.input_tokens
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    # The chain survives: each stored response holds its whole conversation.
    assert client.responses.create(model=model, previous_response_id=second.id, input="x",
                                   max_output_tokens=1).status in ("completed", "incomplete")


def test_store_false_keeps_nothing(client, model, server):
    r = client.responses.create(model=model, input="forget me", max_output_tokens=2, store=False)
    assert r.store is False
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=model, input="again", previous_response_id=r.id, max_output_tokens=2)
    body = e.value.response.json()["error"]
    assert r.id in body["message"] and body["param"] == "previous_response_id"
    assert httpx.get(f"{server[0]}/v1/responses/{r.id}").status_code == 404


def test_parallel_tool_calls_false_keeps_the_first_call(client, model, tokenizer):
    two = CALL + "\n" + CALL.replace("Paris", "Rome")
    with scripted_output(tokenizer, two):
        both = client.responses.create(model=model, input="weather?", tools=[WEATHER_TOOL], max_output_tokens=200,
                                       temperature=0)
        one = client.responses.create(model=model, input="weather?", tools=[WEATHER_TOOL], max_output_tokens=200,
                                      temperature=0, parallel_tool_calls=False)
    assert [json.loads(c.arguments)["city"] for c in both.output if c.type == "function_call"] == ["Paris", "Rome"]
    assert [json.loads(c.arguments)["city"] for c in one.output if c.type == "function_call"] == ["Paris"]


def test_tool_choice_none_returns_text(client, model, tokenizer):
    with scripted_output(tokenizer, CALL):
        r = client.responses.create(model=model, input="weather?", tools=[WEATHER_TOOL], tool_choice="none",
                                    max_output_tokens=120, temperature=0)
    assert [i.type for i in r.output] == ["message"] and "get_weather" in r.output_text


def _user(content) -> list[dict]:
    return [{"type": "message", "role": "user", "content": content}]


@pytest.mark.parametrize("body, field", [
    ({"input": _user([{"type": "input_image", "image_url": "data:image/png;base64,AA=="}])}, "input.0.content.0.type"),
    ({"input": _user([{"type": "input_file", "file_id": "f"}])}, "input.0.content.0.type"),
    ({"input": [{"type": "local_shell_call", "id": "x"}]}, "input.0.type"),
    ({"input": [{"type": "message", "role": "robot", "content": "hi"}]}, "input.0.role"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input.0.name"),
    ({"tools": [{"type": "custom", "name": "grammar_tool"}]}, "tools.0.type"),
    ({"tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "custom", "name": "x"}]}]}, "tools.0.tools.0.type"),
    ({"tools": [{"type": "function"}]}, "tools.0.name"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"if": {}}}}}, "text.format.schema"),
    ({"text": {"verbosity": "low"}}, "text.verbosity"),
    ({"reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"temperature": 3}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"input": [{"type": "message", "role": "system", "content": "only a system prompt"}]}, "input"),
    ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
])
def test_bad_request_is_an_error_naming_the_field(server, model, body, field):
    r = httpx.post(server[0] + "/v1/responses", json={"model": model, "input": "hi", **body}, timeout=60)
    assert r.status_code == (404 if field == "previous_response_id" else 400), r.text
    error = r.json()["error"]
    assert error["param"] == field and field.split(".")[0] in error["message"]


def test_long_input_text_is_not_counted_as_items(client, model):
    r = client.responses.create(model=model, input="word " * 3000, max_output_tokens=1)
    assert r.usage.input_tokens > 3000
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=model, input=[{"role": "user", "content": "x"}] * 10_001, max_output_tokens=1)
    assert e.value.body["param"] == "input"


def test_harmless_fields_are_accepted(client, model):
    r = client.responses.create(model=model, input="hi", max_output_tokens=2, store=False, metadata={"k": "v"},
                                reasoning={"summary": "auto"}, prompt_cache_key="abc", truncation="disabled",
                                include=["reasoning.encrypted_content"], text={"format": {"type": "text"}},
                                user="u", service_tier="auto")
    assert r.status in ("completed", "incomplete")


# --- a Codex CLI request, replayed ------------------------------------------------------------------------
def _sse_events(text: str) -> list[tuple[str, dict]]:
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n") if not line.startswith(":"))
        if lines:  # else a keep-alive (a comment)
            out.append((lines["event"], json.loads(lines["data"])))
    return out


@pytest.fixture(scope="module")
def agent_server(agent_model):
    from mlxlocal.server import ServerConfig

    with running_server(ServerConfig(models=[str(agent_model)], served_model_names=["tiny"])) as (url, app):
        yield url, app


def test_codex_first_request_replays(agent_server):
    """The first request Codex CLI 0.171 sent (recorded from the real client): developer
    messages, 8 function tools, a namespace of sub-agent tools and the hosted web_search."""
    from openai.types.responses import ResponseStreamEvent

    url, app = agent_server
    body = json.loads((FIXTURES / "codex_first_request.json").read_text())
    assert {t["type"] for t in body["tools"]} == {"function", "namespace", "web_search"}
    tokenizer = app.state.registry.models[0].engine.tokenizer
    # The model (a random tiny one) is scripted to think, then call a namespaced tool.
    script = '<think>\nClose the helper first.\n</think>\n\n\n<tool_call>\n{"name": "multi_agent_v1__close_agent", ' \
             '"arguments": {"target": "agent-1"}}\n</tool_call>'
    with scripted_output(tokenizer, script), httpx.stream("POST", url + "/v1/responses", json=body, timeout=300) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-mlxlocal-ignored-tools"] == "web_search"  # hosted: left out, and said so
        events = _sse_events(r.read().decode())
    adapter = TypeAdapter(ResponseStreamEvent)
    for name, data in events:
        assert name == data["type"]
        adapter.validate_python(data)  # every event as the SDK's types define it
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    kinds = [n for i, (n, _) in enumerate(events) if i == 0 or n != events[i - 1][0]]  # runs of deltas as one
    assert kinds == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    final = events[-1][1]["response"]
    assert final["model"] == body["model"] and final["store"] is False
    reasoning, call = final["output"]
    assert reasoning["type"] == "reasoning" and reasoning["encrypted_content"]
    assert (call["type"], call["namespace"], call["name"]) == ("function_call", "multi_agent_v1", "close_agent")
    assert json.loads(call["arguments"]) == {"target": "agent-1"}
    assert final["usage"]["input_tokens"] > 5000  # developer messages and every tool rendered


def test_input_items_fold_into_chat_messages():
    from mlxlocal.server.responses_items import input_messages, seal

    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandboxed"}]},
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": seal("think first")},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "ls", "arguments": '{"path": "."}'},
        {"type": "function_call", "call_id": "c2", "name": "cat", "arguments": "not json"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "x"}]},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "a summary"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
    ]
    assert input_messages(items, "Be brief.") == [
        {"role": "system", "content": "Be brief.\n\nsandboxed"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "think first", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": {"path": "."}}},
            {"id": "c2", "type": "function", "function": {"name": "cat", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
        {"role": "tool", "tool_call_id": "c2", "content": "x"},
        {"role": "assistant", "content": "Done."},  # a summary is not the model's reasoning
    ]


def test_client_gone_mid_stream_cancels_the_request(server, model, tokenizer):
    from conftest import wait_for

    def metric(url: str, name: str) -> float:
        m = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics", timeout=30).text, re.M)
        return float(m[1]) if m else 0.0

    url, app = server
    engine = app.state.registry.models[0].engine
    before = metric(url, "mlxlocal_requests_cancelled_total")
    body = {"model": model, "input": "go on", "max_output_tokens": 6000, "stream": True}
    with scripted_output(tokenizer, "and on " * 3000):
        with httpx.stream("POST", url + "/v1/responses", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line == "event: response.output_text.delta":
                    break  # hang up while it is generating
        assert wait_for(lambda: engine.stats()["running"] == 0 and engine.stats()["waiting"] == 0, 10)
    assert metric(url, "mlxlocal_requests_cancelled_total") == before + 1
