"""Structured output end to end: a tiny random-weight model behind the server, driven by the
official openai, ollama and anthropic clients. Only the constraint can make such a model's
output valid, so every reply must parse and validate; bad schemas are 400s naming the keyword."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

# Bounded strings and arrays: a random model fills them to the limit.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "minItems": 1, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
MAX = 120  # enough for a document of SCHEMA; the model stops when it is complete


class Person(BaseModel):
    # additionalProperties false in its schema (clients that do not add strict mode, Ollama's):
    # otherwise a random model invents extra properties until max_tokens.
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=99)
    color: Literal["red", "green", "blue"]


class Pick(BaseModel):
    color: Literal["red", "green", "blue"]
    size: Literal[1, 2, 3]
    ok: bool


@pytest.fixture(scope="module")
def model(server) -> str:
    return server[1].state.registry.models[0].name


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)


def valid(text: str, schema: dict = SCHEMA):
    doc = json.loads(text)
    jsonschema.validate(doc, schema)
    return doc


# --- OpenAI ------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_chat_json_schema(oai, model, seed):
    r = oai.chat.completions.create(model=model, messages=ASK, max_tokens=MAX, temperature=1.0, seed=seed,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "person", "schema": SCHEMA, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    valid(r.choices[0].message.content)


def test_chat_json_object_streamed(oai, model):
    stream = oai.chat.completions.create(model=model, messages=ASK, max_tokens=MAX, temperature=0.8, seed=3,
                                         response_format={"type": "json_object"}, stream=True,
                                         extra_body={"top_k": 5})
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # an unbounded object may not finish in MAX tokens: then it says so
        assert finish == "length" and text.startswith("{")


def test_parse_with_pydantic(oai, model):
    r = oai.chat.completions.parse(model=model, messages=ASK, max_tokens=MAX, temperature=1.0, seed=5,
                                   response_format=Person)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 99


def test_parse_cut_short_raises_in_the_client(oai, model):
    """A document max_tokens cuts short is a "length" finish: the client's parse says so
    (LengthFinishReasonError) instead of handing back broken JSON."""
    with pytest.raises(openai.LengthFinishReasonError):
        oai.chat.completions.parse(model=model, messages=ASK, max_tokens=3, temperature=1.0, seed=5,
                                   response_format=Person)


def test_completions_formats(oai, model):
    r = oai.completions.create(model=model, prompt="JSON:", max_tokens=MAX, temperature=1.0, seed=2,
                               extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                   "name": "p", "schema": SCHEMA}}})
    valid(r.choices[0].text)
    r = oai.completions.create(model=model, prompt="Date:", max_tokens=20, temperature=1.0, seed=2,
                               extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    assert r.choices[0].finish_reason == "stop"
    assert len(r.choices[0].text) == 10 and r.choices[0].text[:2] == "20"


def test_a_prompt_inside_a_think_block_closes_it_then_answers(oai, model):
    """The prompt ends with the opening think marker: the model reasons freely (at most half
    of max_tokens), must close the block, and only then is the answer constrained."""
    small = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}
    for seed in range(3):
        r = oai.completions.create(model=model, prompt="Think first.\n<think>\n", max_tokens=60, temperature=1.0,
                                   seed=seed, extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                       "name": "ok", "schema": small}}})
        reasoning, marker, answer = r.choices[0].text.partition("</think>")
        assert marker and r.choices[0].finish_reason == "stop", r.choices[0].text
        # Reasoning capped at 30 tokens leaves room for the marker and the document.
        assert r.usage.completion_tokens < 60
        valid(answer.strip(), small)


@pytest.mark.parametrize("extra, check", [
    ({"grammar": 'root ::= "(" [a-c]{1,3} ("," [a-c]{1,3}){0,2} ")"'}, r"\([a-c]{1,3}(,[a-c]{1,3}){0,2}\)"),
    ({"grammar": 'start: "yes" | "no"'}, "yes|no"),
    ({"regex": "[0-9]{4}"}, "[0-9]{4}"),
    ({"structured_outputs": {"choice": ["left", "right"]}}, "left|right"),
    ({"guided_choice": ["up", "down"]}, "up|down"),
    ({"guided_json": '{"enum": ["on", "off"]}'}, '"on"|"off"'),
    ({"structured_outputs": {"json": {"type": "integer", "minimum": 10, "maximum": 20}}}, "1[0-9]|20"),
])
def test_chat_extension_fields(oai, model, extra, check):
    r = oai.chat.completions.create(model=model, messages=ASK, max_tokens=30, temperature=1.0, seed=1,
                                    extra_body=extra)
    assert re.fullmatch(check, r.choices[0].message.content), r.choices[0].message.content


def test_responses_json_schema(oai, model):
    # Responses takes no seed: unseeded sampling may spend up to half the budget thinking,
    # so the document gets room for its longest form (MAX was cut short once in CI).
    budget = 3 * MAX
    r = oai.responses.create(model=model, input="Describe a person.", max_output_tokens=budget, temperature=1.0,
                             text={"format": {"type": "json_schema", "name": "person", "schema": SCHEMA,
                                              "strict": True}})
    valid(r.output_text)
    assert r.text.format.type == "json_schema"
    parsed = oai.responses.parse(model=model, input="A person.", max_output_tokens=budget, temperature=1.0,
                                 text_format=Person)
    assert isinstance(parsed.output_parsed, Person)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", ["'uniqueItems'"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format.json_schema.schema",
     ["#/properties/a/type"]),
    ({"response_format": {"type": "yaml"}}, "response_format.type", ["yaml"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict", ["true or false"]),
    ({"grammar": "root ::= nope"}, "grammar", ["nope"]),
    ({"regex": "(unclosed"}, "regex", ["regex"]),
    ({"guided_json": "{nope"}, "guided_json", ["not valid JSON"]),
    ({"structured_outputs": {"regex": "a+"}, "grammar": 'start: "a"'}, "grammar", ["only one"]),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex", ["only one"]),
])
def test_openai_bad_constraints_are_400s(server, model, body, param, words):
    for path, base in (("/v1/chat/completions", {"messages": ASK}), ("/v1/completions", {"prompt": "x"})):
        r = httpx.post(server[0] + path, json={"model": model, "max_tokens": 5, **base, **body}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and all(w in error["message"] for w in words), error


def test_responses_bad_schema_is_400(server, model):
    r = httpx.post(server[0] + "/v1/responses", json={"model": model, "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"type": "object", "dependentSchemas": {"a": {}}}}}},
        timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format.schema"
    assert "'dependentSchemas'" in r.json()["error"]["message"]


# --- Ollama ----------------------------------------------------------------------------------
def test_ollama_format(server, model):
    client = ollama.Client(host=server[0])
    r = client.chat(model=model, messages=ASK, format=SCHEMA, options={"num_predict": MAX, "seed": 4,
                                                                       "temperature": 1.0})
    valid(r.message.content)
    r = client.generate(model=model, prompt="JSON please", format=Person.model_json_schema(),
                        options={"num_predict": MAX, "seed": 4, "temperature": 1.0})
    Person.model_validate_json(r.response)
    r = client.generate(model=model, prompt="JSON please", format="json",
                        options={"num_predict": 40, "seed": 1, "temperature": 0.5, "top_k": 3})
    assert r.response.startswith("{")
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.response), dict)
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=model, messages=ASK, format={"type": "object", "not": {}})
    assert e.value.status_code == 400 and "'not'" in str(e.value)
    r = httpx.post(server[0] + "/api/generate", json={"model": model, "prompt": "x", "format": "yaml"}, timeout=60)
    assert r.status_code == 400 and "format" in r.json()["error"]  # the client refuses it before sending


# --- Anthropic -------------------------------------------------------------------------------
def test_anthropic_output_format(server, model):
    client = anthropic.Anthropic(base_url=server[0], api_key="x", max_retries=0)
    budget = 3 * MAX  # no seed in this API either: room for a long think block and the document
    msg = client.messages.create(model=model, max_tokens=budget, messages=ASK,
                                 output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    assert msg.stop_reason == "end_turn", msg
    valid(msg.content[-1].text)
    # The SDK drops the keywords Anthropic does not enforce (maxLength, maximum) from the schema
    # it sends, so only a model without them is safe to fill with random tokens.
    parsed = client.messages.parse(model=model, max_tokens=budget, messages=ASK, output_format=Pick)
    assert isinstance(parsed.parsed_output, Pick)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=model, max_tokens=5, messages=ASK, output_config={"format": {
            "type": "json_schema", "schema": {"type": "object", "if": {}, "then": {}}}})
    assert "'if'" in str(e.value) and e.value.body["error"]["type"] == "invalid_request_error"


# --- CLI ---------------------------------------------------------------------------------------
def test_generate_json_schema(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from mlxlocal.cli import app

    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    out = CliRunner().invoke(app, ["generate", "--model", str(tiny_model), "--prompt", "JSON", "--max-tokens",
                                   str(MAX), "--temp", "1.0", "--seed", "7", "--json-schema", str(path), "--json"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["finish_reason"] == "stop"
    valid(result["text"])

    path.write_text(json.dumps({"type": "object", "properties": {"a": {"not": {}}}}))
    out = CliRunner().invoke(app, ["generate", "--model", str(tiny_model), "--prompt", "x",
                                   "--json-schema", str(path)])
    assert out.exit_code == 2 and str(path) in out.output and "'not'" in out.output and "Traceback" not in out.output
    path.write_text("{nope")
    out = CliRunner().invoke(app, ["generate", "--model", str(tiny_model), "--prompt", "x",
                                   "--json-schema", str(path)])
    assert out.exit_code == 2 and "not valid JSON" in out.output
    out = CliRunner().invoke(app, ["generate", "--model", str(tiny_model), "--prompt", "x",
                                   "--json-schema", str(tmp_path / "missing.json")])
    assert out.exit_code == 2 and "missing.json" in out.output


def test_generate_says_when_the_document_was_cut_short(tiny_model, tmp_path):
    """max_tokens too small for the schema: finish "length", and both outputs say the text
    is not a whole document."""
    from typer.testing import CliRunner

    from mlxlocal.cli import app

    path = tmp_path / "long.json"
    path.write_text(json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 40}))
    args = ["generate", "--model", str(tiny_model), "--prompt", "x", "--max-tokens", "6", "--json-schema", str(path)]
    out = CliRunner().invoke(app, args + ["--json"])
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["finish_reason"] == "length" and result["grammar_complete"] is False
    out = CliRunner().invoke(app, args)
    assert out.exit_code == 0 and "output incomplete: the constraint was not finished" in out.stderr


def test_constrain_bounds_the_think_block_by_the_budget(server, oai, model):
    """Anthropic's thinking budget with a format: the grammar itself closes the block at the
    budget (no second pass that would restart the grammar); otherwise half of max_tokens."""
    from mlxlocal.engine import SamplingParams
    from mlxlocal.grammar import json_object, json_schema
    from mlxlocal.server import constraints

    oai.completions.create(model=model, prompt="load", max_tokens=1)  # the model is loaded on first use
    engine = server[1].state.registry.models[0].engine
    ids = engine.encode_text("Hi\n<think>\n")
    params = SamplingParams(max_tokens=100)
    asyncio.run(constraints.constrain(params, json_object("format"), engine, ids, think_budget=7))
    assert "max_tokens=7" in params.grammar.spec and params.grammar.param == "format"
    params = SamplingParams(max_tokens=100)
    asyncio.run(constraints.constrain(params, json_object("format"), engine, ids))
    assert "max_tokens=50" in params.grammar.spec
    plain = engine.encode_text("Hi")
    params = SamplingParams(max_tokens=100)
    asyncio.run(constraints.constrain(params, json_object("format"), engine, plain, parsed=False))
    assert params.grammar == json_object("format")  # raw text, not in a think block: as is
    asyncio.run(constraints.constrain(params, json_schema({"type": "integer"}, "format"), engine, plain))
    assert params.grammar == json_object("format")  # one set before (a forced tool call) wins


def test_generate_regex_grammar_and_conflicts(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from mlxlocal.cli import app

    def run(*args):
        return CliRunner().invoke(app, ["generate", "--model", str(tiny_model), "--prompt", "x", "--temp", "1.0",
                                        "--seed", "1", "--max-tokens", "30", *args])

    out = run("--regex", "[a-c]{3}-[0-9]{2}", "--json")
    assert out.exit_code == 0, out.output
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", json.loads(out.stdout.strip().splitlines()[-1])["text"])
    gbnf = tmp_path / "yes.gbnf"
    gbnf.write_text('root ::= "yes" | "no"')
    out = run("--grammar", str(gbnf), "--json")
    assert out.exit_code == 0 and json.loads(out.stdout.strip().splitlines()[-1])["text"] in ("yes", "no")
    gbnf.write_text("root ::= undefined-rule")
    out = run("--grammar", str(gbnf))
    assert out.exit_code == 2 and str(gbnf) in out.output and "undefined-rule" in out.output
    out = run("--regex", "a", "--grammar", str(gbnf))
    assert out.exit_code == 2 and "at most one" in out.output
    out = run("--regex", "a+", "--ignore-eos")
    assert out.exit_code == 2 and "ignore_eos" in out.output
