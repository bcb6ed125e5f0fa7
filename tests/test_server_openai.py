"""The OpenAI dialect, driven by the official openai client against a real server."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest
from server_util import scripted_output

TOOL_OUTPUT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model)


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def tokenizer(server, model):
    app = server[1]
    return next(m for m in app.state.registry.models if m.name == model).engine.tokenizer


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_models(client, server, model):
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    assert models.data[0].owned_by == "mlxlocal"
    assert client.models.retrieve(model).id == model
    r = httpx.get(server[0] + "/v1/models/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_chat_non_streaming(client, model):
    r = client.chat.completions.create(model=model, messages=ask("hello"), max_tokens=6, temperature=0)
    assert r.object == "chat.completion"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_matches_whole(client, model):
    kwargs = dict(model=model, messages=ask("stream me"), max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    plain = list(client.chat.completions.create(**kwargs, stream=True))
    assert all(c.usage is None for c in plain)


def test_cached_tokens_on_second_turn(client, model):
    messages = ask("a first question that is long enough to fill a few cache blocks " * 3)
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "and a follow-up"}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_stop_strings(client, model):
    kwargs = dict(model=model, messages=ask("stop test"), max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    assert len(full) >= 4
    stop = full[2:4]
    r = client.chat.completions.create(**kwargs, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].message.content
    assert full.startswith(r.choices[0].message.content)


def test_seed_reproducible(client, model):
    kwargs = dict(model=model, messages=ask("random"), max_tokens=10, temperature=1.0)
    a = client.chat.completions.create(**kwargs, seed=7).choices[0].message.content
    b = client.chat.completions.create(**kwargs, seed=7).choices[0].message.content
    assert a == b


def test_logprobs(client, model):
    r = client.chat.completions.create(model=model, messages=ask("logprobs"), max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.bytes == list(entry.token.encode())
        # greedy: the chosen token is the most likely one
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)
    assert "".join(e.token for e in content) == r.choices[0].message.content
    chunks = list(client.chat.completions.create(model=model, messages=ask("logprobs"), max_tokens=4,
                                                 temperature=0, logprobs=True, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_completions(client, model):
    r = client.completions.create(model=model, prompt="Once upon", max_tokens=5, temperature=0, logprobs=2)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 5
    assert r.choices[0].finish_reason in ("stop", "length")
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    chunks = list(client.completions.create(model=model, prompt="Once upon", max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    echo = client.completions.create(model=model, prompt="Once upon", max_tokens=5, temperature=0, echo=True)
    assert echo.choices[0].text == "Once upon" + r.choices[0].text
    default = client.completions.create(model=model, prompt=[5, 6, 7], temperature=0)
    assert default.usage.prompt_tokens == 3 and default.usage.completion_tokens <= 16


def test_tool_call(client, model, tokenizer):
    with scripted_output(tokenizer, TOOL_OUTPUT):
        r = client.chat.completions.create(model=model, messages=ask("weather in Paris?"), tools=[WEATHER_TOOL],
                                           max_tokens=60, temperature=0)
        chunks = list(client.chat.completions.create(model=model, messages=ask("weather in Paris?"),
                                                     tools=[WEATHER_TOOL], max_tokens=60, temperature=0,
                                                     stream=True))
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert not choice.message.content

    calls: dict[int, dict] = {}
    for c in chunks:
        for d in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            slot = calls.setdefault(d.index, {"name": "", "arguments": ""})
            slot["name"] += d.function.name or ""
            slot["arguments"] += d.function.arguments or ""
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]

    # The assistant's call and the tool's result go back into the template.
    follow = client.chat.completions.create(
        model=model, max_tokens=3, temperature=0,  # no tools: the tiny tokenizer makes them long
        messages=ask("weather in Paris?") + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": call.function.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        ])
    assert follow.usage.prompt_tokens > 0 and follow.choices[0].message.content is not None


def test_tool_choice_none_returns_text(client, model, tokenizer):
    with scripted_output(tokenizer, TOOL_OUTPUT):
        r = client.chat.completions.create(model=model, messages=ask("weather?"), tools=[WEATHER_TOOL],
                                           tool_choice="none", max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert "get_weather" in r.choices[0].message.content


def test_reasoning(client, model, tokenizer):
    assert tokenizer.has_thinking
    with scripted_output(tokenizer, "<think>plan</think>Answer"):
        r = client.chat.completions.create(model=model, messages=ask("think"), max_tokens=20, temperature=0)
        chunks = list(client.chat.completions.create(model=model, messages=ask("think"), max_tokens=20,
                                                     temperature=0, stream=True))
    message = r.choices[0].message
    assert message.reasoning_content == "plan" and message.content == "Answer"
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "plan"
    assert "".join(d.content or "" for d in deltas) == "Answer"


def test_concurrent_greedy_matches_sequential(server, model):
    prompts = [f"prompt number {i} " + "x" * (i % 5) for i in range(16)]

    async def one(c, p):
        r = await c.chat.completions.create(model=model, messages=ask(p), max_tokens=8, temperature=0)
        return r.choices[0].message.content

    async def main():
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            sequential = [await one(c, p) for p in prompts]
            concurrent = await asyncio.gather(*(one(c, p) for p in prompts))
        return sequential, concurrent

    sequential, concurrent = asyncio.run(main())
    assert concurrent == sequential


def test_errors(client, model, server):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=ask("hi"), max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ask("word " * 600), max_tokens=2)
    message = e.value.body["message"]
    assert "512" in message and any(str(n) in message for n in range(513, 2000))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ask("hi"), max_tokens=2, temperature=3)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ask("hi"), max_tokens=2, n=2)
    assert "n" == e.value.body["param"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}])
    assert "image_url" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, messages=ask("hi"), max_tokens=2,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "schema": {"type": "object", "not": {}}}})
    assert "'not'" in e.value.body["message"] and e.value.body["param"] == "response_format.json_schema.schema"
    with pytest.raises(openai.BadRequestError):  # over-long prompt refused before streaming starts
        client.chat.completions.create(model=model, messages=ask("word " * 600), max_tokens=2, stream=True)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", suffix="tail")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt=[10**7])
    bad = [{}, {"model": model}, {"model": model, "messages": []}, {"model": model, "messages": ask("hi"), "stop": [""]},
           {"model": model, "messages": [{"role": "wizard", "content": "x"}]},
           {"model": model, "messages": ask("hi"), "top_logprobs": 30, "logprobs": True}]
    for body in bad:
        r = httpx.post(server[0] + "/v1/chat/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(server[0] + "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_openapi_schema_lists_request_models(server):
    schema = httpx.get(server[0] + "/openapi.json").json()
    assert "ChatCompletionRequest" in schema["components"]["schemas"]
    assert "CompletionRequest" in schema["components"]["schemas"]


def test_sse_framing(server, model):
    body = {"model": model, "messages": ask("hi"), "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server[0] + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = [e for e in raw.split("\n\n") if e]
    # The keep-alive sent once the request is accepted: a comment with the prefill's progress.
    assert re.fullmatch(r": keepalive \d+/\d+", frames[0])
    events = [e for e in frames if not e.startswith(":")]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["choices"][0]["delta"]["role"] == "assistant"


def test_named_tool_choice(client, model, tokenizer):
    other = {"type": "function", "function": {"name": "other", "parameters": {"type": "object"}}}
    with scripted_output(tokenizer, TOOL_OUTPUT):
        r = client.chat.completions.create(
            model=model, messages=ask("weather?"), tools=[WEATHER_TOOL, other], max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ask("hi"), tools=[WEATHER_TOOL], max_tokens=2,
                                       tool_choice={"type": "function", "function": {"name": "missing"}})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=ask("hi"), max_tokens=2, tool_choice="required")
