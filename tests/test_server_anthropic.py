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


# --- what current clients (Claude Code 2.1) send -------------------------------------------
THINK_THEN_ANSWER = "<think>\nplan\n</think>\n\nOK"
HI = [{"role": "user", "content": "hi"}]


def count(client, model, **kw) -> int:
    return client.messages.count_tokens(model=model, **kw).input_tokens


def test_system_entries_in_messages(client, model, tokenizer):
    from mlxlocal.server.anthropic_request import convert_messages

    inside = [{"role": "user", "content": "hi"}, {"role": "system", "content": "Be terse."},
              {"role": "user", "content": [{"type": "text", "text": "again"}]}]
    with scripted_output(tokenizer, "fine"):
        msg = client.messages.create(model=model, max_tokens=10, system="Be brief.", messages=inside)
    assert msg.content[0].text == "fine"
    # Entries before the conversation join the system prompt: top-level system, then each in
    # order, joined by a blank line.
    leading = [{"role": "system", "content": "Be terse."}, *HI]
    assert count(client, model, system="Be brief.", messages=leading) == count(
        client, model, system="Be brief.\n\nBe terse.", messages=HI)
    assert count(client, model, messages=leading) == count(client, model, system="Be terse.", messages=HI)
    # Later ones are system turns where the client put them (tests/test_prefix_stability.py).
    assert convert_messages({"system": "Be brief.", "messages": inside}) == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
        {"role": "system", "content": "Be terse."}, {"role": "user", "content": "again"}]


def test_thinking_modes(client, model, tokenizer):
    default = count(client, model, messages=HI)
    assert count(client, model, messages=HI, thinking={"type": "adaptive"}) == default
    assert count(client, model, messages=HI, thinking={"type": "enabled", "budget_tokens": 1024}) == default
    # disabled: the template's enable_thinking=False switch (an empty think block) is rendered
    assert count(client, model, messages=HI, thinking={"type": "disabled"}) > default

    for thinking in ({"type": "adaptive"}, {"type": "enabled", "budget_tokens": 2000}):
        with scripted_output(tokenizer, THINK_THEN_ANSWER):
            msg = client.messages.create(model=model, max_tokens=4000, messages=HI, thinking=thinking)
        assert [b.type for b in msg.content] == ["thinking", "text"]
        assert msg.content[0].thinking.rstrip() == "plan" and msg.content[0].signature.startswith("mlxlocal-")
        assert msg.content[1].text == "OK"
    with scripted_output(tokenizer, THINK_THEN_ANSWER):
        msg = client.messages.create(model=model, max_tokens=40, messages=HI, thinking={"type": "disabled"})
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == "OK"
    with scripted_output(tokenizer, THINK_THEN_ANSWER):
        msg = client.messages.create(model=model, max_tokens=40, messages=HI,
                                     thinking={"type": "adaptive", "display": "omitted"})
    assert msg.content[0].type == "thinking" and msg.content[0].thinking == ""
    assert msg.content[0].signature.startswith("mlxlocal-")


def test_thinking_stream_has_signature(client, model, tokenizer):
    with scripted_output(tokenizer, THINK_THEN_ANSWER):
        with client.messages.stream(model=model, max_tokens=40, messages=HI,
                                    thinking={"type": "adaptive"}) as stream:
            kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
    assert "thinking_delta" in kinds and "signature_delta" in kinds and "text_delta" in kinds
    assert final.content[0].thinking.rstrip() == "plan" and final.content[0].signature.startswith("mlxlocal-")
    assert final.content[1].text == "OK"


@pytest.mark.parametrize("thinking, field", [
    ({"type": "enabled", "budget_tokens": 500}, "thinking.budget_tokens"),
    ({"type": "enabled", "budget_tokens": 5000}, "thinking.budget_tokens"),  # not below max_tokens
    ({"type": "sometimes"}, "thinking.type"),
])
def test_thinking_refused(client, model, thinking, field):
    with pytest.raises(anthropic.BadRequestError, match=field):
        client.messages.create(model=model, max_tokens=2000, messages=HI, thinking=thinking)


def test_tool_loop_echoing_thinking_hits_the_prefix_cache(client, model, tokenizer):
    first = [{"role": "user", "content": "Weather in Paris, please?"}]
    with scripted_output(tokenizer, "<think>\nI should call the tool\n</think>\n\n" + TOOL_CALL):
        msg = client.messages.create(model=model, max_tokens=100, tools=TOOLS, messages=first,
                                     thinking={"type": "adaptive"})
    assert [b.type for b in msg.content] == ["thinking", "tool_use"] and msg.stop_reason == "tool_use"
    prompt1 = msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    use = msg.content[1]
    second = first + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "22C",
                                      "cache_control": {"type": "ephemeral"}}]}]
    with scripted_output(tokenizer, "It is sunny"):
        reply = client.messages.create(model=model, max_tokens=20, tools=TOOLS, messages=second,
                                       thinking={"type": "adaptive"})
    assert reply.content[-1].text == "It is sunny"
    total = count(client, model, tools=TOOLS, messages=second, thinking={"type": "adaptive"})
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == total
    assert reply.usage.cache_creation_input_tokens == 0
    # The echoed thinking is rendered as the model wrote it: the cache covers the whole first
    # prompt and on into what turn 1 generated.
    assert reply.usage.cache_read_input_tokens > prompt1
    # context_management: keep no thinking turns -> the thinking leaves the prompt.
    cleared = {"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}]}
    fewer = client.messages.count_tokens(model=model, tools=TOOLS, messages=second,
                                         extra_body={"context_management": cleared}).input_tokens
    assert fewer < total
    kept = {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}
    assert client.messages.count_tokens(model=model, tools=TOOLS, messages=second,
                                        extra_body={"context_management": kept}).input_tokens == total


def test_media_parts_are_refused_naming_them(client, model):
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AAAA"}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.2\.content\.1: image"):
        client.messages.create(model=model, max_tokens=5, messages=history + [
            {"role": "user", "content": [{"type": "text", "text": "look"}, image]}])
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.0\.content\.0: document"):
        client.messages.count_tokens(model=model, messages=[{"role": "user", "content": [pdf]}])
    result = {"type": "tool_result", "tool_use_id": "t", "content": [image]}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.0\.content\.0\.content\.0: image"):
        client.messages.create(model=model, max_tokens=5, messages=[{"role": "user", "content": [result]}])


def test_harmless_fields_accepted_and_the_rest_refused(client, model, tokenizer):
    extra = {"metadata": {"user_id": "u"}, "output_config": {"effort": "low"}, "service_tier": "auto",
             "container": None, "a_field_from_the_future": {"x": 1}, "cache_control": {"type": "ephemeral"},
             "context_management": {"edits": [{"type": "clear_thinking_20251015"}]}}
    system = [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]
    tools = [{**TOOLS[0], "cache_control": {"type": "ephemeral"}}]
    with scripted_output(tokenizer, "fine"):
        msg = client.messages.create(model=model, max_tokens=10, system=system, tools=tools, extra_body=extra,
                                     extra_query={"beta": "true"},
                                     extra_headers={"anthropic-beta": "context-management-2025-06-27"},
                                     messages=[{"role": "user", "content": [
                                         {"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}])
    assert msg.content[0].text == "fine"
    for body, field in [({"output_config": {"format": {"type": "json_schema", "schema": {"not": {}}}}}, "'not'"),
                        ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
                        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}},
                         r"context_management\.edits\.0\.type")]:
        with pytest.raises(anthropic.BadRequestError, match=field):
            client.messages.create(model=model, max_tokens=10, messages=HI, extra_body=body)


def test_model_metadata_per_dialect(client, model, server):
    listed = client.models.list()  # the SDK sends anthropic-version
    assert [m.id for m in listed.data] == [model] and listed.data[0].type == "model"
    info = client.models.retrieve(model)
    assert info.max_input_tokens == 512 and info.display_name == model and info.created_at.year >= 2024
    assert info.capabilities.thinking.supported and not info.capabilities.image_input.supported
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("nope")
    openai = httpx.get(f"{server[0]}/v1/models", timeout=10).json()
    assert openai["object"] == "list"
    assert openai["data"][0]["context_length"] == openai["data"][0]["max_model_len"] == 512
    one = httpx.get(f"{server[0]}/v1/models/{model}", timeout=10).json()
    assert one["object"] == "model" and one["context_length"] == 512
    show = httpx.post(f"{server[0]}/api/show", json={"model": model}, timeout=10).json()
    assert show["model_info"]["qwen3.context_length"] == 512
    assert {"completion", "tools", "thinking"} <= set(show["capabilities"])


def test_tool_choice_any_and_tool_ask_for_a_call(client, model):
    two = TOOLS + [{"name": "get_time", "description": "", "input_schema": {"type": "object"}}]
    auto = count(client, model, tools=two, messages=HI)
    # The same system hint as OpenAI's "required" / named choice (pipeline.require_call).
    assert count(client, model, tools=two, messages=HI, tool_choice={"type": "any"}) > auto
    named = count(client, model, tools=two, messages=HI, tool_choice={"type": "tool", "name": "get_time"})
    only = count(client, model, tools=two[1:], messages=HI)
    assert only < named  # one tool offered, plus the hint naming it
    assert count(client, model, tools=two, messages=HI, tool_choice={"type": "none"}) == count(
        client, model, messages=HI)


def test_template_variables_only_where_a_template_reads_them():
    from mlxlocal.server.anthropic_request import check_fields, thinking_mode

    def kwargs(body, template):
        check_fields(body)
        return thinking_mode(body, 4000).template_kwargs(template)

    qwen, gpt_oss = "{% if enable_thinking is false %}", "Reasoning: {{ reasoning_effort }}"
    assert kwargs({"thinking": {"type": "disabled"}}, qwen) == {"enable_thinking": False}
    assert kwargs({"thinking": {"type": "adaptive"}}, qwen) == {"enable_thinking": True}
    assert kwargs({}, qwen) == {}  # no `thinking`: the template's own default
    assert kwargs({"thinking": {"type": "disabled"}}, gpt_oss) == {}
    assert kwargs({"output_config": {"effort": "low"}}, gpt_oss) == {"reasoning_effort": "low"}
    assert kwargs({"output_config": {"effort": "max"}}, gpt_oss) == {"reasoning_effort": "high"}
    assert kwargs({"output_config": {"effort": "low"}}, qwen) == {}


def test_tool_result_error_is_said_in_the_text(client, model):
    def turn(**flags):
        return [{"role": "user", "content": "Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "boom", **flags}]}]

    plain = count(client, model, tools=TOOLS, messages=turn())
    assert count(client, model, tools=TOOLS, messages=turn(is_error=True)) > plain
    assert count(client, model, tools=TOOLS, messages=turn(is_error=False)) == plain
