"""The ChatFormat a loaded model carries: what its tokenizer says about the chat format, read
once at load, and the only place tokenizer attributes are probed (inside mlxlocal/source/)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from mlxlocal.engine import ChatFormat, Engine, prompt_encoder
from mlxlocal.source.loader import load_from_dir

ROOT = Path(__file__).resolve().parents[1] / "mlxlocal"


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return {family: load_from_dir(path) for family, path in tiny_models.items()}


def test_chatml_markers_thinking_and_eos(loaded):
    m = loaded["qwen3"]
    fmt, tok = m.chat_format, m.tokenizer
    assert isinstance(fmt, ChatFormat) and fmt.chat_template == tok.chat_template
    assert fmt.has_tool_calling and (fmt.tool_call_start, fmt.tool_call_end) == ("<tool_call>", "</tool_call>")
    assert fmt.tool_parser.__module__.endswith("json_tools")
    assert fmt.has_thinking and (fmt.think_start, fmt.think_end) == ("<think>", "</think>")
    # The markers are added tokens of their own, matched by id.
    assert fmt.think_start_tokens == (tok.convert_tokens_to_ids("<think>"),)
    assert fmt.think_end_tokens == (tok.convert_tokens_to_ids("</think>"),)
    assert set(fmt.think_start_tokens + fmt.think_end_tokens) <= fmt.added_token_ids
    assert fmt.eos_token_id == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert fmt.eos_token_ids == frozenset(tok.eos_token_ids) and fmt.eos_token_id in fmt.eos_token_ids
    assert fmt.vocab_size == len(tok) == 384
    assert fmt.is_fast and fmt.backend is not None and fmt.hf is tok._tokenizer


def test_families_without_thinking_or_tool_markers(loaded):
    llama, mistral = loaded["llama"].chat_format, loaded["mistral"].chat_format
    # Llama 3 calls tools as bare JSON: no markers, no parser; neither thinks.
    assert not llama.has_tool_calling and llama.tool_call_start is None and llama.tool_parser is None
    assert not llama.has_thinking and llama.think_start is None and llama.think_start_tokens == ()
    assert mistral.has_tool_calling and mistral.tool_call_start == "[TOOL_CALLS]"
    assert not mistral.has_thinking and mistral.think_end_tokens == ()
    assert llama.eos_token_id == loaded["llama"].tokenizer.eos_token_id


def test_it_encodes_decodes_and_renders_as_the_tokenizer(loaded):
    m = loaded["qwen3"]
    fmt, tok = m.chat_format, m.tokenizer
    assert fmt.encode("<think>hi") == list(tok.encode("<think>hi", add_special_tokens=False))
    assert fmt.decode(fmt.encode("hello")) == "hello"
    messages = [{"role": "user", "content": "hi"}]
    assert fmt.render(messages) == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert fmt.render(messages, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_engines_hand_out_the_loaded_models_format(loaded):
    m = loaded["qwen3"]
    assert prompt_encoder(m).chat_format is m.chat_format
    assert "chat_format" in Engine.__annotations__
    # A format without the attributes (a tokenizer that has none of them) means: none of it.
    bare = ChatFormat()
    assert (bare.chat_template, bare.has_thinking, bare.has_tool_calling, bare.think_start_tokens) == (
        None, False, False, ())


# Tokenizer attributes: reading any of them with getattr / hasattr is probing a tokenizer.
TOKENIZER_ATTRS = {
    "chat_template", "has_chat_template", "has_tool_calling", "tool_call_start", "tool_call_end",
    "tool_parser", "has_thinking", "think_start", "think_end", "think_start_tokens",
    "think_end_tokens", "eos_token_id", "eos_token_ids", "added_tokens_decoder", "model_max_length",
    "_tokenizer", "backend_tokenizer", "is_fast", "vocab", "vocab_size", "detokenizer",
}


def probes(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
            continue
        target, name = ast.unparse(node.args[0]), node.args[1]
        attr = name.value if isinstance(name, ast.Constant) else ""
        if attr in TOKENIZER_ATTRS or any(w in target.lower() for w in ("tok", "template", "hf")):
            out.append((node.lineno, ast.unparse(node)))
    return out


def test_no_tokenizer_probes_outside_source():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if ROOT / "source" in path.parents:
            continue  # the one place that reads the tokenizer (chat_format.py)
        found += [f"{path.relative_to(ROOT.parent)}:{line}: {code}"
                  for line, code in probes(ast.parse(path.read_text()))]
    assert found == [], "probe tokenizers in mlxlocal/source/chat_format.py only:\n" + "\n".join(found)


def test_the_probe_check_sees_one():
    assert probes(ast.parse('x = getattr(engine.tokenizer, "chat_template", None)'))
    assert probes(ast.parse('hasattr(t, "think_start")'))
    assert not probes(ast.parse('getattr(request.app.state.config, "max_tools", None)'))
