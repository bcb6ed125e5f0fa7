"""Forced tool calls end to end: tiny random-weight models (whose free output is never a
call) behind a real server, driven by the official openai (chat and Responses) and
anthropic clients. tool_choice required / named (Anthropic any / tool) always returns a
call of an offered tool whose arguments validate against its schema, in each chat family's
own syntax, streaming or not, across seeds and temperatures. (Ollama's API has no
tool_choice, so there is nothing to force there.)

Schemas are bounded (maxLength, maxItems, enums, closed objects: a schema open to more
properties lets a random model add keys forever, as JSON Schema allows it) so a random
model's document ends well inside max_tokens; one that keeps making parallel calls stops at
MAX_CALLS.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import jsonschema
import openai
import pytest

from mlxlocal.grammar.tools import MAX_CALLS

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search notes by tags",
    "parameters": {"type": "object", "additionalProperties": False, "properties": {
        "query": {"type": "string", "maxLength": 8},
        "filters": {"type": "object", "additionalProperties": False, "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2},
            "limit": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["tags"]}},
        "required": ["query", "filters"]}}}
ALARM = {"type": "function", "function": {
    "name": "set_alarm", "description": "Set an alarm", "strict": True,
    "parameters": {"type": "object", "properties": {
        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
        "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "maxItems": 2},
        "loud": {"type": "boolean"}},
        "required": ["time"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH, ALARM]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MAX_TOKENS = 3000  # a bounded call is a few hundred tokens at most, even spelled byte by byte
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FAMILIES = ["qwen3", "llama", "mistral"]  # chatml <tool_call>, bare JSON, [TOOL_CALLS] list
# (seed, temperature): greedy and sampled
RUNS = [(0, 0.0), (1, 0.7), (2, 1.0)]
TEMPERATURES = [t for _, t in RUNS]  # Responses and Anthropic take no seed


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One server holding the three families' tiny models, with room for three tool schemas
    in the prompt (the 384-token vocabulary spells them out nearly byte by byte) and a long
    reply: (base URL, {family: model name})."""
    from conftest import FAMILY_CONFIGS, TEMPLATES, build_tiny
    from server_util import running_server

    from mlxlocal.server import ServerConfig

    root = tmp_path_factory.mktemp("tool_choice")
    paths = {f: str(build_tiny(root / f, dict(FAMILY_CONFIGS[f], max_position_embeddings=8192),
                               template=TEMPLATES[f])) for f in FAMILIES}
    # A thinker whose template opens the think block (as DeepSeek-R1 / QwQ templates do): the
    # grammar must let it close the block before the call.
    thinker = build_tiny(root / "thinker", dict(FAMILY_CONFIGS["qwen3"], max_position_embeddings=8192))
    config = json.loads((thinker / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"].replace(
        "{{- '<|im_start|>assistant\\n' }}", "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    assert "assistant\\n<think>" in config["chat_template"]
    (thinker / "tokenizer_config.json").write_text(json.dumps(config))
    paths["thinker"] = str(thinker)
    with running_server(ServerConfig(models=list(paths.values()))) as (url, _):
        yield url, paths


@pytest.fixture(scope="module")
def oai(served):
    c = openai.OpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0, timeout=300)
    yield c
    c.close()


@pytest.fixture(scope="module")
def claude(served):
    c = anthropic.Anthropic(base_url=served[0], api_key="unused", max_retries=0, timeout=300)
    yield c
    c.close()


def valid(calls: list[tuple[str, str]], allowed: set[str], at_most: int = MAX_CALLS) -> None:
    """Each call names an allowed tool and its arguments (JSON text) validate."""
    assert 1 <= len(calls) <= at_most, calls
    for name, arguments in calls:
        assert name in allowed, calls
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _choice(name: str | None):
    return {"type": "function", "function": {"name": name}} if name else "required"


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", [None, "search"])
def test_chat_completions_always_call(oai, served, family, name):
    model = served[1][family]
    for seed, temperature in RUNS:
        r = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=_choice(name),
                                        max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                                        parallel_tool_calls=seed != 0)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        valid(calls, {name} if name else set(SCHEMAS), 1 if seed == 0 or family == "llama" else MAX_CALLS)


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_completions_stream_calls(oai, served, family):
    model = served[1][family]
    for seed, temperature in RUNS[1:]:
        stream = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                             max_tokens=MAX_TOKENS, temperature=temperature, seed=seed,
                                             parallel_tool_calls=False, stream=True)
        calls, finish = {}, None
        for chunk in stream:
            delta = chunk.choices[0].delta if chunk.choices else None
            for c in (delta.tool_calls or []) if delta else []:
                entry = calls.setdefault(c.index, ["", ""])
                entry[0] += c.function.name or ""
                entry[1] += c.function.arguments or ""
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert finish == "tool_calls"
        valid([tuple(v) for v in calls.values()], set(SCHEMAS), 1)


def _responses_tools(names=None) -> list[dict]:
    return [{"type": "function", **t["function"]} for t in TOOLS if names is None or t["function"]["name"] in names]


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
@pytest.mark.parametrize("stream", [False, True])
def test_responses_always_call(oai, served, family, stream):
    model = served[1][family]
    for temperature, choice in zip(TEMPERATURES, ["required", {"type": "function", "name": "set_alarm"},
                                                  {"type": "allowed_tools", "mode": "required",
                                                   "tools": [{"type": "function", "name": "get_weather"}]}]):
        named = {"set_alarm"} if isinstance(choice, dict) and choice["type"] == "function" else \
            {"get_weather"} if isinstance(choice, dict) else set(SCHEMAS)
        kwargs = dict(model=model, input="Wake me at seven.", tools=_responses_tools(), tool_choice=choice,
                      max_output_tokens=MAX_TOKENS, temperature=temperature, parallel_tool_calls=False)
        if stream:
            with oai.responses.stream(**kwargs) as events:
                response = events.get_final_response()
        else:
            response = oai.responses.create(**kwargs)
        calls = [(o.name, o.arguments) for o in response.output if o.type == "function_call"]
        valid(calls, named, 1)
        assert not [o for o in response.output if o.type == "message"], response.output


def _anthropic_tools(strict: bool = False) -> list[dict]:
    return [{"name": t["function"]["name"], "description": t["function"]["description"],
             "input_schema": t["function"]["parameters"], **({"strict": True} if strict else {})}
            for t in TOOLS]


@pytest.mark.parametrize("family", FAMILIES)
def test_anthropic_any_and_tool_always_call(claude, served, family):
    model = served[1][family]
    choices = [{"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"},
               {"type": "any"}]
    for temperature, choice in zip(TEMPERATURES, choices):
        msg = claude.messages.create(model=model, max_tokens=MAX_TOKENS, messages=ASK, tools=_anthropic_tools(),
                                     tool_choice=choice, extra_body={"temperature": temperature})
        assert msg.stop_reason == "tool_use", msg
        uses = [b for b in msg.content if b.type == "tool_use"]
        assert [b for b in msg.content if b.type == "text" and b.text.strip()] == []
        single = choice.get("disable_parallel_tool_use") or family == "llama"
        valid([(u.name, json.dumps(u.input)) for u in uses],
              {choice["name"]} if choice["type"] == "tool" else set(SCHEMAS), 1 if single else MAX_CALLS)


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_anthropic_stream_strict_tools(claude, served, family):
    model = served[1][family]
    with claude.messages.stream(model=model, max_tokens=MAX_TOKENS, messages=ASK, extra_body={"temperature": 1.0},
                                tools=_anthropic_tools(strict=True),
                                tool_choice={"type": "tool", "name": "search", "disable_parallel_tool_use": True}) as s:
        msg = s.get_final_message()
    assert msg.stop_reason == "tool_use"
    valid([(b.name, json.dumps(b.input)) for b in msg.content if b.type == "tool_use"], {"search"}, 1)


def test_a_schema_that_cannot_be_enforced_is_a_400(oai, claude, served):
    model = served[1]["qwen3"]
    odd = {"type": "function", "function": {"name": "odd", "strict": True, "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "dependentRequired": {"n": ["m"]}}}}
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model, messages=ASK, tools=[odd], tool_choice="required", max_tokens=8)
    assert "odd" in err.value.message and err.value.body["param"] == "tool_choice"
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=model, max_tokens=8, messages=ASK, tool_choice={"type": "any"},
                               tools=[{"name": "odd", "strict": True, "input_schema": odd["function"]["parameters"]}])
    # Not forced, but strict: a call it makes must hold to the schema, which cannot be enforced.
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=model, messages=ASK, tools=[odd], max_tokens=4, temperature=0)
    assert "odd" in err.value.message and err.value.body["param"] == "tools"
    # Neither forced nor strict: the tool is only offered, and the model may answer in text.
    loose = {"type": "function", "function": {k: v for k, v in odd["function"].items() if k != "strict"}}
    r = oai.chat.completions.create(model=model, messages=ASK, tools=[loose], max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_forced_call_wins_over_a_response_format(oai, claude, served):
    model = served[1]["qwen3"]
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 5}},
              "required": ["answer"], "additionalProperties": False}
    r = oai.chat.completions.create(
        model=model, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=MAX_TOKENS, temperature=0.7,
        seed=3, parallel_tool_calls=False,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}})
    calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
    valid(calls, set(SCHEMAS), 1)
    msg = claude.messages.create(model=model, max_tokens=MAX_TOKENS, messages=ASK, tools=_anthropic_tools(),
                                 tool_choice={"type": "tool", "name": "set_alarm", "disable_parallel_tool_use": True},
                                 extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}})
    valid([(b.name, json.dumps(b.input)) for b in msg.content if b.type == "tool_use"], {"set_alarm"}, 1)


def test_forced_and_free_requests_in_one_batch(served):
    """Concurrent requests share the engine's batch: each forced one still gets valid calls,
    and the free ones run alongside (only their own limits end them)."""
    import asyncio

    model = served[1]["qwen3"]

    async def run():
        async with openai.AsyncOpenAI(base_url=served[0] + "/v1", api_key="unused", max_retries=0,
                                      timeout=300) as client:
            forced = [client.chat.completions.create(
                model=model, messages=ASK, tools=TOOLS, tool_choice=_choice((None, "search", "set_alarm")[k % 3]),
                max_tokens=MAX_TOKENS, temperature=1.0, seed=10 + k, parallel_tool_calls=False) for k in range(4)]
            free = [client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=40,
                                                   temperature=1.0, seed=20 + k) for k in range(2)]
            return await asyncio.gather(*forced, *free)

    results = asyncio.run(run())
    for k, r in enumerate(results[:4]):
        name = (None, "search", "set_alarm")[k % 3]
        valid([(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls],
              {name} if name else set(SCHEMAS), 1)
    assert all(r.choices[0].finish_reason in ("stop", "length", "tool_calls") for r in results[4:])


def test_a_think_block_the_prompt_opened_closes_before_the_call(oai, claude, served):
    model = served[1]["thinker"]
    # The budget (half of max_tokens here) ends the think block if the model does not.
    r = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                    max_tokens=600, temperature=1.0, seed=5, parallel_tool_calls=False)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and not (message.content or "").strip()
    assert getattr(message, "reasoning_content", None) is not None
    valid([(c.function.name, c.function.arguments) for c in message.tool_calls], set(SCHEMAS), 1)
    msg = claude.messages.create(model=model, max_tokens=1600, messages=ASK, tools=_anthropic_tools(),
                                 tool_choice={"type": "tool", "name": "search", "disable_parallel_tool_use": True},
                                 extra_body={"thinking": {"type": "enabled", "budget_tokens": 1024}})
    assert [b.type for b in msg.content] == ["thinking", "tool_use"], msg.content
    valid([(b.name, json.dumps(b.input)) for b in msg.content if b.type == "tool_use"], {"search"}, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_many_seeds_always_call(oai, served, family):
    """The acceptance bar on a random model: every forced request, whatever the seed and
    temperature, is a call whose arguments validate."""
    model = served[1][family]
    for seed in range(10):
        name = (None, "get_weather", "search", "set_alarm")[seed % 4]
        r = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=_choice(name),
                                        max_tokens=MAX_TOKENS, temperature=(0.3, 0.8, 1.5)[seed % 3], seed=100 + seed,
                                        parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        valid([(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls],
              {name} if name else set(SCHEMAS), 1)


def test_auto_with_strict_tools_constrains_the_calls_it_makes(oai, served):
    """tool_choice auto with strict tools: the reply may be text, and a call it makes holds
    to its schema. logit_bias pushes the random model to open a call, which it then can only
    complete validly; the same push without the grammar (no strict tool) gives no valid call."""
    from mlxlocal.source.loader import load_from_dir

    model = served[1]["qwen3"]
    tok = load_from_dir(Path(model)).tokenizer
    marker = tok.encode(tok.tool_call_start, add_special_tokens=False)
    assert len(marker) == 1
    push = {str(marker[0]): 100}
    for seed in range(3):
        r = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=MAX_TOKENS,
                                        temperature=1.0, seed=seed, logit_bias=push)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        valid([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], set(SCHEMAS))
    loose = [{"type": "function", "function": {k: v for k, v in t["function"].items() if k != "strict"}}
             for t in TOOLS]
    r = oai.chat.completions.create(model=model, messages=ASK, tools=loose, max_tokens=60, temperature=1.0,
                                    seed=0, logit_bias=push)
    assert r.choices[0].finish_reason != "tool_calls"  # unconstrained: the push alone makes no call
    # Without the push the random model answers in text, which may not contain a call marker.
    r = oai.chat.completions.create(model=model, messages=ASK, tools=TOOLS, max_tokens=40, temperature=1.0, seed=1)
    assert tok.tool_call_start not in (r.choices[0].message.content or "")
