"""mlxlocal.grammar: schemas and grammars checked and compiled, refusals named; a matcher over
the tiny model's tokenizer accepts what the constraint allows and rejects the rest."""

from __future__ import annotations

import json

import pytest
from llguidance import LLMatcher

from mlxlocal import grammar
from mlxlocal.engine import ChatFormat, chat_format_of
from mlxlocal.grammar import GrammarError

P = "response_format.json_schema.schema"

SUPPORTED = {
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
    "pattern": {"type": "string", "pattern": "^[a-z]{2}[0-9]$"},
    "minItems/maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "enum": {"enum": ["red", "green", 3]},
    "const": {"const": "fixed"},
    "minimum/maximum": {"type": "integer", "minimum": 1, "maximum": 5},
    "$ref/$defs": {"$defs": {"n": {"type": "integer"}}, "type": "object",
                   "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"]},
    "additionalProperties": {"type": "object", "properties": {"a": {"type": "boolean"}},
                             "additionalProperties": False},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
    "oneOf/allOf": {"allOf": [{"oneOf": [{"type": "integer"}, {"type": "null"}]}]},
    "format": {"type": "string", "format": "date"},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "boolean schema": True,
}

REFUSED = {
    "not": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}},
    "if": {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    "uniqueItems": {"type": "array", "uniqueItems": True},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "propertyNames": {"type": "object", "propertyNames": {"maxLength": 3}},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "unevaluatedProperties": {"type": "object", "unevaluatedProperties": False},
}


@pytest.mark.parametrize("name", SUPPORTED)
def test_supported_keywords_compile(name):
    g = grammar.json_schema(SUPPORTED[name], P)
    assert g.param == P and json.loads(g.spec)["grammars"]


@pytest.mark.parametrize("keyword", REFUSED)
def test_refused_keyword_is_named_with_its_path(keyword):
    with pytest.raises(GrammarError) as e:
        grammar.json_schema(REFUSED[keyword], P)
    assert e.value.param == P and f"'{keyword}'" in str(e.value) and str(e.value).startswith(P)
    if keyword == "not":
        assert "#/properties/a" in str(e.value)


@pytest.mark.parametrize("schema, words", [
    ({"type": "strin"}, ["#/type", "'type'"]),
    ({"type": "object", "properties": {"a": {"minimum": "3"}}}, ["#/properties/a/minimum", "'minimum'"]),
    ({"required": "a"}, ["'required'"]),
    (5, ["must be an object or a boolean"]),
    ([], ["must be an object or a boolean"]),
    ({"type": "string", "pattern": "(?<=a)b"}, ["'pattern'", "look-around"]),
    ({"type": "integer", "minimum": 5, "maximum": 1}, ["minimum (5) is greater than maximum (1)"]),
    ({"$ref": "https://example.com/s.json"}, ["https://example.com/s.json"]),
    (False, ["false"]),
])
def test_invalid_schema_is_a_clear_error(schema, words):
    with pytest.raises(GrammarError) as e:
        grammar.json_schema(schema, P)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "\n" not in str(e.value)


def test_a_property_named_like_a_keyword_is_not_refused():
    grammar.json_schema({"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}}, P)


@pytest.mark.parametrize("build, text, where", [
    (lambda: grammar.regex("[a-", "regex"), "unclosed character class", "regex"),
    (lambda: grammar.lark("start: foo", "grammar"), "unknown name", "grammar"),
    (lambda: grammar.gbnf("root ::= foo", "grammar"), "Rule 'foo' not found", "grammar"),
    (lambda: grammar.gbnf("", "grammar"), "non-empty", "grammar"),
    (lambda: grammar.regex(5, "structured_outputs.regex"), "non-empty string", "structured_outputs.regex"),
    (lambda: grammar.choice([], "structured_outputs.choice"), "non-empty list", "structured_outputs.choice"),
])
def test_grammar_errors_name_the_field(build, text, where):
    with pytest.raises(GrammarError) as e:
        build()
    assert e.value.param == where and text in str(e.value) and str(e.value).startswith(where)


# --- a matcher over the tiny model's tokenizer ---------------------------------------------
@pytest.fixture(scope="module")
def tok(tiny_model):
    import llguidance.hf
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model))
    return hf, llguidance.hf.from_tokenizer(hf)


def accepts(tok, g, text: str, complete: bool = True) -> bool:
    hf, ll = tok
    m = LLMatcher(ll, g.spec)
    assert not m.is_error(), m.get_error()
    ok = m.consume_tokens(hf.encode(text, add_special_tokens=False))
    return ok and (m.is_accepting() or not complete)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
          "required": ["name", "age"]}


def test_matcher_accepts_valid_and_rejects_invalid_documents(tok):
    g = grammar.json_schema(SCHEMA, P)
    assert accepts(tok, g, '{"name":"bo","age":7}')
    assert accepts(tok, g, '{"name":"bo","age":7,"tags":["a","b"]}')
    assert not accepts(tok, g, '{"name":"bo"}')  # required age missing
    assert not accepts(tok, g, '{"name":"bo","age":700}')  # over maximum
    assert not accepts(tok, g, '{"name":"bo","age":7,"tags":["c"]}')  # not in enum
    assert not accepts(tok, g, '{"name": "bo","age":7}')  # compact JSON: no whitespace to ramble with
    assert not accepts(tok, g, '{"age":7,"name":"bo"}')  # properties come in the schema's order


def test_compiled_schemas_are_reused():
    reordered = {"type": "object", "properties": dict(reversed(list(SCHEMA["properties"].items())))}
    assert grammar.json_schema(SCHEMA, P) is grammar.json_schema(json.loads(json.dumps(SCHEMA)), P)
    assert grammar.json_schema(SCHEMA, P) is not grammar.json_schema(SCHEMA, "format")  # errors name the field
    in_order = {"type": "object", "properties": SCHEMA["properties"]}
    assert grammar.json_schema(reordered, P).spec != grammar.json_schema(in_order, P).spec  # order is kept


def test_strict_forbids_extra_properties(tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert accepts(tok, grammar.json_schema(schema, P), '{"a":1,"b":2}')
    assert not accepts(tok, grammar.json_schema(schema, P, strict=True), '{"a":1,"b":2}')
    assert accepts(tok, grammar.json_schema(schema, P, strict=True), '{"a":1}')


def test_json_object_regex_lark_gbnf_choice(tok):
    assert accepts(tok, grammar.json_object("format"), '{"x":[1,2]}')
    assert not accepts(tok, grammar.json_object("format"), '[1]')
    assert accepts(tok, grammar.regex(r"[0-9]{3}-[a-z]+", "regex"), "123-abc")
    assert not accepts(tok, grammar.regex(r"[0-9]{3}-[a-z]+", "regex"), "12-abc")
    lark = 'start: "yes" | "no" | NUM\nNUM: /[0-9]+/'
    assert accepts(tok, grammar.lark(lark, "grammar"), "42")
    assert not accepts(tok, grammar.lark(lark, "grammar"), "maybe")
    gbnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+'
    assert accepts(tok, grammar.gbnf(gbnf, "grammar"), "(ab,c)")
    assert not accepts(tok, grammar.gbnf(gbnf, "grammar"), "(ab,)")
    assert accepts(tok, grammar.gbnf(lark, "grammar"), "no")  # Lark passes through
    assert accepts(tok, grammar.choice(["left", "right"], "choice"), "right")
    assert not accepts(tok, grammar.choice(["left", "right"], "choice"), "up")


def test_with_reasoning_constrains_only_the_answer(tok, tiny_model):
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    wrapper = chat_format_of(load_tokenizer(tiny_model))
    assert wrapper.has_thinking
    g = grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, P)
    opt = grammar.with_reasoning(g, wrapper, starts_in_reasoning=False)
    assert opt.param == P
    assert accepts(tok, opt, '{"a":1}')
    assert accepts(tok, opt, '<think>free text {{{ here</think>\n\n{"a":1}')
    assert not accepts(tok, opt, '<think>free</think>not json')
    assert not accepts(tok, opt, '<think>one</think>{"a":1}</think>')
    inside = grammar.with_reasoning(g, wrapper, starts_in_reasoning=True)
    assert accepts(tok, inside, 'thinking...</think>{"a":1}')
    assert not accepts(tok, inside, '{"a":1}')  # the open block must close first

    # Bounded: after max_think_tokens of reasoning only the closing marker is allowed.
    hf, ll = tok
    bounded = grammar.with_reasoning(g, wrapper, starts_in_reasoning=True, max_think_tokens=3)
    m = LLMatcher(ll, bounded.spec)
    assert m.consume_tokens(hf.encode("abc", add_special_tokens=False)[:3])
    import numpy as np

    mask = np.frombuffer(m.compute_bitmask(), dtype=np.uint32)
    allowed = [i for i in range(len(mask) * 32) if mask[i // 32] >> (i % 32) & 1]
    assert allowed == list(wrapper.think_end_tokens)


def test_with_reasoning_leaves_models_without_thinking_alone():
    g = grammar.regex("a+", "regex")
    assert grammar.with_reasoning(g, ChatFormat(has_thinking=False), True) is g
    # Markers that are not token ids of their own leave it alone too.
    assert grammar.with_reasoning(g, ChatFormat(has_thinking=True, think_start="<think>"), True) is g
