"""The Ollama API, driven by the official ollama client."""

from __future__ import annotations

import time

import httpx
import ollama
import pytest

from tests.server_util import scripted_output

TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "",
                                           "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server[0])


@pytest.fixture(scope="module")
def model(server):
    return server[1].state.registry.models[0].name


@pytest.fixture
def tokenizer(server, model):
    registry = server[1].state.registry
    if registry.models[0].engine is None:  # unloaded by a keep_alive test
        ollama.Client(host=server[0]).generate(model=model, prompt="")
    return registry.models[0].engine.tokenizer


def test_chat(client, model, tokenizer):
    with scripted_output(tokenizer, "Hello there") as script:
        r = client.chat(model=model, messages=[{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "hi"}], stream=False)
    assert r.message.role == "assistant" and r.message.content == "Hello there"
    assert r.done and r.done_reason == "stop" and r.model == model
    assert r.eval_count == len(script) - 1 and r.prompt_eval_count > 0
    assert r.total_duration > 0 and r.eval_duration >= 0 and r.load_duration >= 0
    assert r.prompt_eval_duration > 0

    with scripted_output(tokenizer, "Hello streaming world"):
        parts = list(client.chat(model=model, messages=[{"role": "user", "content": "hi"}], stream=True))
    assert "".join(p.message.content for p in parts) == "Hello streaming world"
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == "stop"
    assert len(parts) > 2 and parts[-1].eval_count > 0


def test_thinking(client, model, tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    with scripted_output(tokenizer, "<think>\nhmm\n</think>\n\nOK"):
        r = client.chat(model=model, messages=msgs, think=True)
        parts = list(client.chat(model=model, messages=msgs, think=True, stream=True))
        quiet = client.chat(model=model, messages=msgs, think=False)
    assert r.message.thinking.strip() == "hmm" and r.message.content == "OK"
    assert "".join(p.message.thinking or "" for p in parts).strip() == "hmm"
    assert "".join(p.message.content for p in parts) == "OK"
    assert not quiet.message.thinking and quiet.message.content == "OK"


def test_stream_is_default_ndjson(server, model, tokenizer):
    with scripted_output(tokenizer, "abc"):
        r = httpx.post(f"{server[0]}/api/chat", timeout=60,
                       json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
    lines = [line for line in r.text.splitlines() if line]
    assert len(lines) > 1 and '"done": true' in lines[-1]


def test_generate(client, model, tokenizer):
    with scripted_output(tokenizer, "Once upon"):
        r = client.generate(model=model, prompt="Tell a story", system="You tell stories.", stream=False)
    assert r.response == "Once upon" and r.done and r.done_reason == "stop" and r.eval_count > 0
    with scripted_output(tokenizer, "Once upon"):
        parts = list(client.generate(model=model, prompt="Tell a story", stream=True))
    assert "".join(p.response for p in parts) == "Once upon" and parts[-1].done
    with scripted_output(tokenizer, "more text"):
        r = client.generate(model=model, prompt="raw text", raw=True, stream=False)
    assert r.response == "more text"


def test_options(client, model, tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    r = client.chat(model=model, messages=msgs, options={"num_predict": 4, "seed": 7, "temperature": 0.9})
    r2 = client.chat(model=model, messages=msgs, options={"num_predict": 4, "seed": 7, "temperature": 0.9})
    assert r.eval_count <= 4 and r.message.content == r2.message.content  # same seed, same text
    if r.eval_count == 4:
        assert r.done_reason == "length"
    with scripted_output(tokenizer, "one two three four"):
        r = client.chat(model=model, messages=msgs, options={"stop": ["three"], "num_ctx": 4096})
    assert r.message.content == "one two " and r.done_reason == "stop"
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=model, messages=msgs, options={"temperature": -1})
    assert e.value.status_code == 400


def test_tool_calls(client, model, tokenizer):
    msgs = [{"role": "user", "content": "Paris?"}]
    with scripted_output(tokenizer, TOOL_CALL):
        r = client.chat(model=model, messages=msgs, tools=TOOLS, stream=False)
    calls = r.message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert dict(calls[0].function.arguments) == {"city": "Paris"}
    with scripted_output(tokenizer, TOOL_CALL):
        parts = list(client.chat(model=model, messages=msgs, tools=TOOLS, stream=True))
    streamed = [c for p in parts for c in (p.message.tool_calls or [])]
    assert [c.function.name for c in streamed] == ["get_weather"]
    # The call and its result go back in the next turn.
    with scripted_output(tokenizer, "Sunny"):
        r = client.chat(model=model, tools=TOOLS, messages=[
            *msgs, {"role": "assistant", "content": "", "tool_calls": [c.model_dump() for c in calls]},
            {"role": "tool", "content": "22C", "tool_name": "get_weather"}])
    assert r.message.content == "Sunny"


def test_listings(client, model, server):
    tags = client.list()
    assert [m.model for m in tags.models] == [model]
    entry = tags.models[0]
    assert entry.size > 0 and entry.digest and entry.details.format == "safetensors"
    assert entry.details.family == "qwen3" and entry.details.parameter_size.endswith("K")
    assert entry.details.quantization_level == "F32"
    show = client.show(model)
    assert show.details.family == "qwen3" and show.modelinfo["qwen3.context_length"] == 512
    assert "im_start" in show.template
    with pytest.raises(ollama.ResponseError) as e:
        client.show("nope")
    assert e.value.status_code == 404
    ps = client.ps()
    assert [m.model for m in ps.models] == [model] and ps.models[0].size_vram > 0
    assert ps.models[0].expires_at is not None
    assert httpx.get(f"{server[0]}/api/version").json()["version"]


def test_errors(client, model, server):
    for call in (lambda: client.chat(model="nope", messages=[{"role": "user", "content": "hi"}]),
                 lambda: client.generate(model="nope", prompt="hi"),
                 lambda: list(client.chat(model="nope", messages=[{"role": "user", "content": "x"}], stream=True))):
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 404 and "nope" in str(e.value)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=model, messages=[{"role": "user", "content": "hi", "images": ["AAAA"]}])
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=model, prompt="hi", suffix="end")
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=model, messages=[{"role": "user", "content": "hi"}],
                    format={"type": "object", "uniqueItems": True, "propertyNames": {}})
    assert e.value.status_code == 400 and "propertyNames" in str(e.value)
    r = httpx.post(f"{server[0]}/api/chat", json={"model": model, "messages": [
        {"role": "user", "content": "word " * 600}]}, timeout=30)
    assert r.status_code == 400 and "context" in r.json()["error"]


def _wait_unloaded(client, seconds=5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not client.ps().models:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture
def unloads_allowed(server):
    config = server[1].state.config
    config.allow_client_unload = True  # --allow-client-unload
    yield
    config.allow_client_unload = False


def test_keep_alive_cannot_unload_a_shared_model_unless_allowed(client, model, tokenizer, server):
    """Before: any client's keep_alive 0 unloaded the model and ended every client's sessions."""
    chat = [{"role": "user", "content": "hi"}]
    for keep_alive in (0, "0s", "1s", 10, "4m"):
        for call in (lambda k: client.chat(model=model, messages=chat, keep_alive=k, options={"num_predict": 1}),
                     lambda k: client.chat(model=model, messages=[], keep_alive=k),
                     lambda k: client.generate(model=model, prompt="", keep_alive=k)):
            with pytest.raises(ollama.ResponseError) as e:
                call(keep_alive)
            assert e.value.status_code == 400 and "keep_alive" in str(e.value)
            assert "--allow-client-unload" in str(e.value)
    time.sleep(1.5)  # the unloader runs every second
    assert server[1].state.registry.models[0].engine is not None
    assert [m.model for m in client.ps().models] == [model]
    for keep_alive in ("5m", "1h", -1):
        assert client.generate(model=model, prompt="hi", options={"num_predict": 1}, keep_alive=keep_alive).done


def test_keep_alive(client, model, tokenizer, unloads_allowed):
    with scripted_output(tokenizer, "ok"):
        r = client.chat(model=model, messages=[{"role": "user", "content": "hi"}], keep_alive=0)
    assert r.message.content == "ok"
    assert _wait_unloaded(client)
    # The next request loads it again.
    r = client.generate(model=model, prompt="hi", options={"num_predict": 2}, keep_alive="5m")
    assert r.done and r.load_duration > 0
    assert [m.model for m in client.ps().models] == [model]
    # An empty prompt with keep_alive 0 unloads; an empty prompt loads.
    r = client.generate(model=model, prompt="", keep_alive=0)
    assert r.done_reason == "unload"
    assert _wait_unloaded(client)
    r = client.generate(model=model, prompt="")
    assert r.done_reason == "load" and [m.model for m in client.ps().models] == [model]
