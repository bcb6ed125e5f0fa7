"""The forced-tool-call grammar (mlxlocal.grammar.tools), driven by llguidance's matcher
directly: per family format, a well-formed call is accepted and ends with EOS; a wrong
name, a missing required argument or a wrongly typed one is refused; and text the grammar
lets a model write (a random walk over its token masks, standing in for a random-weight
model) always parses back, through the server's OutputParser, into calls whose arguments
validate against the tool's schema."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import jsonschema
import llguidance.hf
import numpy as np
import pytest
from llguidance import LLMatcher

from mlxlocal.engine import ChatFormat, chat_format_of
from mlxlocal.grammar.errors import GrammarError
from mlxlocal.grammar.parse import OutputParser
from mlxlocal.grammar.tools import MAX_CALLS, family, tool_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather", "strict": True,
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search documents",
    "parameters": {"type": "object", "additionalProperties": False, "properties": {
        "query": {"type": "string", "maxLength": 16},
        "filters": {"type": "object", "additionalProperties": False, "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
            "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["tags"]}},
        "required": ["query", "filters"]}}}
ALARM = {"type": "function", "function": {
    "name": "set_alarm", "description": "Set an alarm", "strict": True,
    "parameters": {"type": "object", "properties": {
        "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
        "days": {"type": "array", "items": {"enum": ["mon", "tue", "wed"]}, "maxItems": 3},
        "loud": {"type": "boolean"}},
        "required": ["time"]}}}
TOOLS = [WEATHER, SEARCH, ALARM]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def Family(fmt: ChatFormat, **attrs) -> ChatFormat:  # noqa: N802 - reads as the family it poses as
    """A tokenizer's format seen as another family: the given fields replace its own
    (markers, tool parser, template), everything else is the real tokenizer's."""
    return replace(fmt, **attrs)


@pytest.fixture(scope="module")
def toks(tmp_path_factory) -> dict[str, ChatFormat]:
    """Chat formats per format: the synthetic chatml (json_tools), llama3 (no markers) and
    mistral (v0.3 JSON list) tokenizers', and chatml's posing as other JSON-bodied families."""
    from mlx_lm.tokenizer_utils import load
    from mlx_lm.tool_parsers import glm47, kimi_k2, longcat, pythonic, qwen3_coder

    from mlxlocal.source.synthetic.tokenizer import write_tokenizer

    out = {}
    for name in ("chatml", "llama3", "mistral"):
        path = tmp_path_factory.mktemp(name)
        write_tokenizer(Path(path), 384, name)
        out[name] = chat_format_of(load(Path(path)))
    chatml = out["chatml_thinking"] = out["chatml"]
    # The formats' tests run without a think block (test_a_think_block_* have theirs).
    out["chatml"] = Family(chatml, has_thinking=False)

    def posing(module, **extra):
        return Family(chatml, tool_parser=module.parse_tool_call, tool_call_start=module.tool_call_start,
                      tool_call_end=module.tool_call_end, has_thinking=False, **extra)

    out["longcat"] = posing(longcat)
    out["kimi_k2"] = posing(kimi_k2)
    out["mistral_args"] = Family(out["mistral"], chat_template=out["mistral"].chat_template + "[ARGS]")
    out["qwen3_coder"] = posing(qwen3_coder)
    out["glm47"] = posing(glm47)
    out["pythonic"] = posing(pythonic)
    return out


_LL: dict[int, object] = {}


def ll_tokenizer(tok: ChatFormat):
    hf = tok.hf
    if id(hf) not in _LL:
        _LL[id(hf)] = llguidance.hf.from_tokenizer(hf, eos_token=sorted(tok.eos_token_ids)[0])
    return _LL[id(hf)]


def matcher(tok, grammar) -> LLMatcher:
    m = LLMatcher(ll_tokenizer(tok), grammar.spec, log_level=0)
    assert not m.is_error(), m.get_error()
    return m


def accepts(tok, grammar, text: str) -> bool:
    """The whole text is allowed and then the reply may end (EOS)."""
    m = matcher(tok, grammar)
    ids = tok.encode(text)
    return m.consume_tokens(ids) and not m.is_error() and m.consume_token(sorted(tok.eos_token_ids)[0])


def parse(tok, text: str, tools=TOOLS) -> list[tuple[str, dict]]:
    parser = OutputParser(tok, tools)
    events = parser.feed(text) + parser.finish()
    assert all(e.kind == "tool_call" or not e.text.strip() for e in events), events
    return [(e.name, json.loads(e.arguments)) for e in events if e.kind == "tool_call"]


def call_text(fmt: str, calls: list[tuple[str, dict]]) -> str:
    """Calls written the way each family's template writes them."""
    def obj(n, a, key="arguments"):
        return json.dumps({"name": n, key: a})
    if fmt == "chatml":
        return "\n".join(f"<tool_call>\n{obj(n, a)}\n</tool_call>" for n, a in calls)
    if fmt == "longcat":
        return "\n".join(f"<longcat_tool_call>\n{obj(n, a)}\n</longcat_tool_call>" for n, a in calls)
    if fmt == "llama3":
        (n, a), = calls
        return obj(n, a, "parameters")
    if fmt == "mistral":
        return "[TOOL_CALLS] [" + ", ".join(obj(n, a) for n, a in calls) + "]"
    if fmt == "mistral_args":
        return "".join(f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    def value(v):
        return v if isinstance(v, str) else json.dumps(v)
    if fmt == "qwen3_coder":
        return "\n".join(f"<tool_call>\n<function={n}>\n" + "".join(
            f"<parameter={k}>\n{value(v)}\n</parameter>\n" for k, v in a.items()) + "</function>\n</tool_call>"
            for n, a in calls)
    if fmt == "glm47":
        return "\n".join(f"<tool_call>{n}\n" + "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{value(v)}</arg_value>\n" for k, v in a.items()) + "</tool_call>"
            for n, a in calls)
    if fmt == "kimi_k2":
        return "<|tool_calls_section_begin|>" + "".join(
            f"<|tool_call_begin|>functions.{n}:{k}<|tool_call_argument_begin|>{json.dumps(a)}<|tool_call_end|>"
            for k, (n, a) in enumerate(calls)) + "<|tool_calls_section_end|>"
    raise AssertionError(fmt)


FORMATS = ["chatml", "llama3", "mistral", "mistral_args", "longcat", "kimi_k2", "qwen3_coder", "glm47"]
XML_FORMATS = ("qwen3_coder", "glm47")  # strings are written raw: 7 is a string there
GOOD = [("get_weather", {"city": "Oslo", "unit": "celsius"}),
        ("search", {"query": "mlx", "filters": {"tags": ["a", "b"], "limit": 3}})]


def test_family_names(toks):
    assert family(toks["chatml"]) == "json_tools"
    assert family(toks["llama3"]) == ""
    assert family(toks["mistral"]) == "mistral"
    assert family(toks["kimi_k2"]) == "kimi_k2"
    assert family(toks["qwen3_coder"]) == "qwen3_coder"


@pytest.mark.parametrize("fmt", FORMATS)
def test_well_formed_calls_are_accepted_and_parse_back(toks, fmt):
    tok = toks[fmt]
    grammar = tool_calls(tok, TOOLS, None, "tool_choice")
    calls = GOOD[:1] if fmt == "llama3" else GOOD  # no markers: one call per reply
    text = call_text(fmt, calls)
    assert accepts(tok, grammar, text), text
    assert parse(tok, text) == calls


@pytest.mark.parametrize("fmt", FORMATS)
def test_wrong_calls_are_refused(toks, fmt):
    tok = toks[fmt]
    grammar = tool_calls(tok, TOOLS, None, "tool_choice")
    wrong = [
        [("get_wether", {"city": "Oslo", "unit": "celsius"})],  # no such tool
        [("get_weather", {"city": "Oslo"})],  # required unit missing
        *([] if fmt in XML_FORMATS else [[("get_weather", {"city": 7, "unit": "celsius"})]]),  # city: a string
        [("search", {"query": "q", "filters": {"tags": ["a"], "limit": "3"}})],  # limit: an integer
        [("get_weather", {"city": "Oslo", "unit": "kelvin"})],  # not in the enum
        [("get_weather", {"city": "Oslo", "unit": "celsius", "extra": 1})],  # strict: closed object
        [("search", {"query": "q", "filters": {"tags": []}})],  # minItems 1
        [("set_alarm", {"time": "9am"})],  # pattern
    ]
    for calls in wrong:
        assert not accepts(tok, grammar, call_text(fmt, calls)), calls
    assert not accepts(tok, grammar, "Sure, let me check the weather.")  # text instead of a call


@pytest.mark.parametrize("fmt", ["chatml", "mistral", "kimi_k2", "qwen3_coder"])
def test_a_named_tool_admits_only_that_tool(toks, fmt):
    tok = toks[fmt]
    grammar = tool_calls(tok, TOOLS, "search", "tool_choice")
    assert accepts(tok, grammar, call_text(fmt, GOOD[1:]))
    assert not accepts(tok, grammar, call_text(fmt, GOOD[:1]))
    with pytest.raises(GrammarError) as err:
        tool_calls(tok, TOOLS, "nope", "tool_choice")
    assert err.value.param == "tool_choice"


@pytest.mark.parametrize("fmt", ["chatml", "mistral", "mistral_args", "kimi_k2", "glm47"])
def test_parallel_false_allows_exactly_one_call(toks, fmt):
    tok = toks[fmt]
    single = tool_calls(tok, TOOLS, None, "tool_choice", parallel=False)
    assert accepts(tok, single, call_text(fmt, GOOD[:1]))
    assert not accepts(tok, single, call_text(fmt, GOOD))
    assert accepts(tok, tool_calls(tok, TOOLS, None, "tool_choice"), call_text(fmt, GOOD))


def test_llama_takes_one_call_with_parameters(toks):
    tok = toks["llama3"]
    grammar = tool_calls(tok, TOOLS, None, "tool_choice")
    (n, a), = GOOD[:1]
    assert not accepts(tok, grammar, json.dumps({"name": n, "arguments": a}))  # the template says parameters
    assert not accepts(tok, grammar, call_text("llama3", GOOD[:1]) + "\n" + call_text("llama3", GOOD[1:]))


def test_whitespace_is_bounded(toks):
    tok = toks["chatml"]
    grammar = tool_calls(tok, [WEATHER], None, "tool_choice")
    spaced = '<tool_call>\n{"name": "get_weather", "arguments": {\n  "city": "Oslo",\n  "unit": "celsius"\n}}\n</tool_call>'
    assert accepts(tok, grammar, spaced)
    assert not accepts(tok, grammar, spaced.replace("\n  ", "\n" + " " * 12))


def test_a_think_block_is_closed_before_the_call(toks):
    tok = toks["chatml_thinking"]
    call = call_text("chatml", GOOD[:1])
    opened = tool_calls(tok, TOOLS, None, "tool_choice", starts_in_reasoning=True)
    assert accepts(tok, opened, "\nThe user wants the weather.\n</think>\n\n" + call)
    assert not accepts(tok, opened, call)  # still inside the think block: a call there is reasoning text
    parser = OutputParser(tok, TOOLS, starts_in_reasoning=True)
    events = parser.feed("\nThe user wants the weather.\n</think>\n\n" + call) + parser.finish()
    assert [e.kind for e in events if e.text.strip() or e.kind == "tool_call"] == ["reasoning", "tool_call"]


def test_a_thinking_model_may_think_first(toks):
    tok = toks["chatml_thinking"]
    call = call_text("chatml", GOOD[:1])
    grammar = tool_calls(tok, TOOLS, None, "tool_choice")
    assert accepts(tok, grammar, call) and accepts(tok, grammar, "<think>\nhm\n</think>\n\n" + call)
    assert not accepts(tok, grammar, "<think>\nhm\n</think>\n\nSunny.")


def test_non_strict_tools_fall_back_where_llguidance_stops(toks):
    tok = toks["chatml"]
    odd = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}},
        "required": ["n"], "additionalProperties": False,
        "dependentRequired": {"n": ["m"]}}}}  # a keyword llguidance does not implement
    grammar = tool_calls(tok, [odd], None, "tool_choice")  # lenient: the rest still holds
    assert accepts(tok, grammar, '<tool_call>\n{"name": "odd", "arguments": {"n": 3}}\n</tool_call>')
    assert not accepts(tok, grammar, '<tool_call>\n{"name": "odd", "arguments": {"n": "x"}}\n</tool_call>')
    strict = {"type": "function", "function": {**odd["function"], "strict": True}}
    with pytest.raises(GrammarError, match="odd"):
        tool_calls(tok, [strict], None, "tool_choice")


def test_families_the_grammar_cannot_write_are_refused(toks):
    with pytest.raises(GrammarError, match="pythonic") as err:
        tool_calls(toks["pythonic"], TOOLS, None, "tool_choice")
    assert err.value.param == "tool_choice"


def _random_walk(tok, grammar, seed: int, limit: int = 3000) -> list[int]:
    """What a random-weight model writes under the grammar: each token uniformly among the
    allowed ones (EOS too, once the grammar may end), until EOS."""
    rng = random.Random(seed)
    m = matcher(tok, grammar)
    eos = sorted(tok.eos_token_ids)[0]
    out: list[int] = []
    for _ in range(limit):
        bits = np.unpackbits(np.frombuffer(m.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[:tok.vocab_size])
        assert len(allowed), m.get_error()
        token = int(rng.choice(list(allowed)))
        if token == eos:
            return out
        assert m.consume_token(token), m.get_error()
        out.append(token)
    raise AssertionError(f"no EOS in {limit} tokens: {tok.decode(out)!r}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_what_the_grammar_lets_a_model_write_parses_and_validates(toks, fmt):
    tok = toks[fmt]
    for seed in range(6):
        name = (None, "search", "set_alarm")[seed % 3]
        grammar = tool_calls(tok, TOOLS, name, "tool_choice", parallel=seed % 2 == 0)
        text = tok.decode(_random_walk(tok, grammar, seed))
        calls = parse(tok, text)
        assert 1 <= len(calls) <= (MAX_CALLS if seed % 2 == 0 and fmt != "llama3" else 1), text
        for n, args in calls:
            assert name in (None, n)
            jsonschema.validate(args, SCHEMAS[n])


def test_a_thinking_budget_closes_the_block(toks):
    tok = toks["chatml_thinking"]
    grammar = tool_calls(tok, [WEATHER], None, "tool_choice", starts_in_reasoning=True, max_think_tokens=5)
    text = tok.decode(_random_walk(tok, grammar, 0))
    thought, sep, rest = text.partition("</think>")
    assert sep and len(tok.encode(thought)) <= 6, text
    assert {n for n, _ in parse(tok, rest)} == {"get_weather"}


def test_raw_xml_strings_stay_parseable(toks):
    q, g = toks["qwen3_coder"], toks["glm47"]
    note = {"type": "function", "function": {"name": "note", "strict": True, "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 30}}, "required": ["text"]}}}

    def written(tok, fmt, text):
        return accepts(tok, tool_calls(tok, [note], None, "tool_choice"), call_text(fmt, [("note", {"text": text})]))

    assert written(q, "qwen3_coder", " two\nlines ") and written(g, "glm47", "two\nlines")
    assert not written(q, "qwen3_coder", "a</parameter>b")  # the parser would end the value there
    assert not written(q, "qwen3_coder", "NULL")  # qwen3_coder's parser reads it as null
    assert not written(g, "glm47", " padded")  # glm47's parser strips values
    assert not written(g, "glm47", "a</arg_value>b")


def test_xml_formats_refuse_what_a_raw_string_cannot_hold(toks):
    dated = {"type": "function", "function": {"name": "dated", "strict": True, "parameters": {
        "type": "object", "properties": {"day": {"type": "string", "format": "date"}}, "required": ["day"]}}}
    tool_calls(toks["chatml"], [dated], None, "tool_choice")  # JSON: llguidance enforces the format
    with pytest.raises(GrammarError, match="format"):
        tool_calls(toks["qwen3_coder"], [dated], None, "tool_choice")
    either = {"type": "function", "function": {"name": "either", "strict": True, "parameters": {
        "type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}}}}
    with pytest.raises(GrammarError, match="single type"):
        tool_calls(toks["qwen3_coder"], [either], None, "tool_choice")
    grammar = tool_calls(toks["glm47"], [either], None, "tool_choice")  # glm47 reads any JSON value
    assert accepts(toks["glm47"], grammar, call_text("glm47", [("either", {"v": True})]))
    assert parse(toks["glm47"], call_text("glm47", [("either", {"v": 3})]), [either]) == [("either", {"v": 3})]


def test_arguments_may_use_local_definitions(toks):
    tok = toks["chatml"]
    moved = {"type": "function", "function": {"name": "move", "strict": True, "parameters": {
        "type": "object", "$defs": {"point": {"type": "object", "properties": {
            "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"]}},
        "properties": {"src": {"$ref": "#/$defs/point"}, "dst": {"$ref": "#/$defs/point"}},
        "required": ["src", "dst"]}}}
    grammar = tool_calls(tok, [moved], None, "tool_choice")
    ok = {"src": {"x": 1, "y": 2}, "dst": {"x": 3, "y": 4}}
    assert accepts(tok, grammar, call_text("chatml", [("move", ok)]))
    assert not accepts(tok, grammar, call_text("chatml", [("move", {**ok, "dst": {"x": 3}})]))
    assert not accepts(tok, grammar, call_text("chatml", [("move", {**ok, "dst": {"x": 3, "y": 4, "z": 5}})]))


ODD_TOOLS = [
    {"type": "function", "function": {"name": "say", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "a-b_c", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "minLength": "x", "pattern": "(?<=a)b"},
                                         "t": {"const": "fixed"}, "n": {"type": ["integer", "null"]}}}}},
    {"type": "function", "function": {"name": "listy", "parameters": {"type": "object", "properties": [1, 2]}}},
    {"type": "function", "function": {"name": "notobj", "parameters": {"type": "string"}}},
    {"type": "function", "function": {"name": "none"}},
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_odd_non_strict_tools_still_get_a_grammar(toks, fmt):
    """Whatever a non-strict tool's schema holds, a grammar is built (falling back where it
    must) and what it lets a model write parses back into calls of those tools."""
    tok = toks[fmt]
    grammar = tool_calls(tok, ODD_TOOLS, None, "tool_choice", parallel=False)
    for seed in range(3):
        calls = parse(tok, tok.decode(_random_walk(tok, grammar, seed)), ODD_TOOLS)
        assert len(calls) == 1 and calls[0][0] in {t["function"]["name"] for t in ODD_TOOLS}
        assert isinstance(calls[0][1], dict)


@pytest.mark.parametrize("fmt", FORMATS)
def test_names_outside_json_must_be_identifiers(toks, fmt):
    odd = [{"type": "function", "function": {"name": 'say "hi"', "parameters": {"type": "object"}}}]
    if fmt in ("chatml", "llama3", "longcat") or fmt == "mistral":  # the name is a JSON string
        grammar = tool_calls(toks[fmt], odd, None, "tool_choice")
        assert parse(toks[fmt], toks[fmt].decode(_random_walk(toks[fmt], grammar, 0)), odd)[0][0] == 'say "hi"'
    else:
        with pytest.raises(GrammarError, match="say"):
            tool_calls(toks[fmt], odd, None, "tool_choice")


# --- tool_choice auto with strict tools: text or calls, only the calls constrained -------------
@pytest.mark.parametrize("fmt", FORMATS)
def test_optional_calls_allow_text_or_valid_calls(toks, fmt):
    tok = toks[fmt]
    grammar = tool_calls(tok, TOOLS, None, "tools", optional=True)
    good = call_text(fmt, GOOD[:1])
    bad = call_text(fmt, [("get_weather", {"city": "Oslo", "unit": "kelvin"})])
    assert accepts(tok, grammar, "Sure, it is sunny today.")
    assert accepts(tok, grammar, good)
    assert not accepts(tok, grammar, bad)  # a strict tool's call still holds to its schema
    if fmt == "llama3":  # no markers: a reply starting like a call's JSON object must be one
        assert not accepts(tok, grammar, '{"weather": "sunny"}')
    else:  # text first, then the call (markers that are added tokens); never the marker in text
        if fmt not in ("longcat", "kimi_k2"):  # their markers are ordinary text in this tokenizer
            assert accepts(tok, grammar, "Let me check.\n" + good)
        marker = tok.tool_call_start
        assert not accepts(tok, grammar, f"Here is how I call tools: {marker} done.")
