"""Tool calls and reasoning split out of generated text, per model family's tokenizer."""

from __future__ import annotations

import json

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxlocal.engine import chat_format_of
from mlxlocal.grammar.parse import OutputParser

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizers(tiny_models):
    return {family: chat_format_of(load_tokenizer(path)) for family, path in tiny_models.items()}


def run(parser: OutputParser, pieces: list[str]):
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    return events + parser.finish()


def split_every(text: str, n: int) -> list[str]:
    return [text[i : i + n] for i in range(0, len(text), n)]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_qwen_hermes_tool_call_and_thinking(tokenizers, step):
    text = '<think>need weather</think>Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    events = run(OutputParser(tokenizers["qwen3"], TOOLS), split_every(text, step))
    reasoning = "".join(e.text for e in events if e.kind == "reasoning")
    content = "".join(e.text for e in events if e.kind == "content")
    calls = [e for e in events if e.kind == "tool_call"]
    assert reasoning == "need weather" and content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]


def test_llama3_bare_json_tool_call(tokenizers):
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    events = run(OutputParser(tokenizers["llama"], TOOLS), split_every(text, 4))
    assert [e.kind for e in events] == ["tool_call"]
    assert json.loads(events[0].arguments) == {"city": "Oslo"}
    plain = run(OutputParser(tokenizers["llama"], TOOLS), ["It is sunny ", "in Oslo."])
    assert "".join(e.text for e in plain) == "It is sunny in Oslo." and all(e.kind == "content" for e in plain)


def test_mistral_tool_calls_marker(tokenizers):
    tok = tokenizers["mistral"]
    if not tok.tool_call_start:
        pytest.skip("mlx-lm inferred no tool-call marker from the mistral template")
    text = f'{tok.tool_call_start}[{{"name": "get_weather", "arguments": {{"city": "Rome"}}}}]'
    events = run(OutputParser(tok, TOOLS), split_every(text, 5))
    calls = [e for e in events if e.kind == "tool_call"]
    assert calls and calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Rome"}


def test_invalid_tool_call_keeps_the_text(tokenizers):
    text = "<tool_call>not json</tool_call>"
    events = run(OutputParser(tokenizers["qwen3"], TOOLS), [text])
    assert [e.kind for e in events] == ["content"] and "not json" in events[0].text


def test_no_tools_means_markers_are_text(tokenizers):
    text = '<tool_call>{"name": "x", "arguments": {}}</tool_call>'
    events = run(OutputParser(tokenizers["qwen3"], None), [text])
    assert "".join(e.text for e in events if e.kind == "content") == text
