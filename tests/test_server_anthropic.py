"""The Anthropic Messages API, driven by the official anthropic client."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.server_util import scripted_output

TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# Short: the tiny model's tokenizer is nearly per-character and its context is 512.
TOOLS = [{"name": "get_weather", "description": "", "input_schema": {"type": "object"}}]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server[0], api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(server):
    return server[1].state.registry.models[0].engine.tokenizer


@pytest.fixture(scope="module")
def model(server):
    return server[1].state.registry.models[0].name


def test_message(client, model, tokenizer):
    with scripted_output(tokenizer, "Hello there") as script:
        msg = client.messages.create(model=model, max_tokens=20, system="Be brief.",
                                     messages=[{"role": "user", "content": "hi"}])
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == model
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "Hello there"
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    count = client.messages.count_tokens(model=model, system="Be brief.",
                                         messages=[{"role": "user", "content": "hi"}])
    assert count.input_tokens > 0
    assert msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0) == count.input_tokens
    assert msg.usage.output_tokens == len(script) - 1, script  # the script ends with EOS


def test_max_tokens_and_stop_sequence(client, model, tokenizer):
    with scripted_output(tokenizer, "a long answer that goes on and on"):
        msg = client.messages.create(model=model, max_tokens=3, extra_body={"temperature": 0.0, "top_k": 5},
                                     messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 3
    with scripted_output(tokenizer, "one two three four"):
        msg = client.messages.create(model=model, max_tokens=20, stop_sequences=["three", "zzz"],
                                     messages=[{"role": "user", "content": "count"}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "three"
    assert msg.content[0].text == "one two "


def test_stream(client, model, tokenizer):
    with scripted_output(tokenizer, "Hello streaming world") as script:
        with client.messages.stream(model=model, max_tokens=20,
                                    messages=[{"role": "user", "content": "hi"}]) as stream:
            texts = list(stream.text_stream)
            final = stream.get_final_message()
    assert "".join(texts) == "Hello streaming world" and len(texts) > 1
    assert final.content[0].text == "Hello streaming world"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == len(script) - 1


def test_stream_event_sequence(server, model, tokenizer):
    with scripted_output(tokenizer, "<think>\nhmm\n</think>\n\nOK"):
        r = httpx.post(f"{server[0]}/v1/messages", json={
            "model": model, "max_tokens": 30, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert names.count("content_block_start") == names.count("content_block_stop") == 2
    assert '"thinking_delta"' in r.text and '"text_delta"' in r.text


def test_tool_use_and_result(client, model, tokenizer):
    with scripted_output(tokenizer, TOOL_CALL):
        msg = client.messages.create(model=model, max_tokens=60, tools=TOOLS,
                                     messages=[{"role": "user", "content": "Paris?"}])
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].input == {"city": "Paris"}
    assert uses[0].id.startswith("toolu_")

    with scripted_output(tokenizer, "It is sunny"):
        reply = client.messages.create(model=model, max_tokens=20, tools=TOOLS, messages=[
            {"role": "user", "content": "Paris?"},
            {"role": "assistant", "content": [b.model_dump() for b in msg.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                          "content": [{"type": "text", "text": "22C"}]}]},
        ])
    assert reply.stop_reason == "end_turn" and reply.content[0].text == "It is sunny"


def test_tool_use_stream(client, model, tokenizer):
    with scripted_output(tokenizer, TOOL_CALL):
        with client.messages.stream(model=model, max_tokens=60, tools=TOOLS,
                                    messages=[{"role": "user", "content": "Weather?"}]) as stream:
            events = list(stream)
            final = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    assert final.stop_reason == "tool_use"
    assert final.content[-1].type == "tool_use" and final.content[-1].input == {"city": "Paris"}


def test_errors(client, model, server):
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError):
        # The client checks max_tokens itself: send the request around that check.
        client.post("/v1/messages", cast_to=object,
                    body={"model": model, "messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=model, max_tokens=5, extra_body={"temperature": 1.5},
                               messages=[{"role": "user", "content": "hi"}])
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    with pytest.raises(anthropic.BadRequestError, match="image"):
        client.messages.create(model=model, max_tokens=5, messages=[{"role": "user", "content": [image]}])
    # Errors before streaming are real HTTP errors too, in Anthropic's format.
    r = httpx.post(f"{server[0]}/v1/messages", timeout=30, json={
        "model": model, "max_tokens": 5, "stream": True,
        "messages": [{"role": "user", "content": "word " * 600}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
