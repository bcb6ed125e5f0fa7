"""The grammars a request decodes under, for every dialect: its output format's and its tools'
(a 400 naming the field when one cannot be built). `parse` reads the format fields a router
hands over (a `Format`), `constrain` fits the grammar to the prompt, `tool_grammar` forces or
bounds tool calls.

Output formats: what each surface accepts:
- OpenAI chat / completions: `response_format` {"type": "text" | "json_object"} or
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}.
- OpenAI Responses: `text.format` {"type": "text" | "json_object"} or
  {"type": "json_schema", "name", "schema", "strict"}.
- Extensions on chat, completions and responses, for power users (one constraint per request):
  `structured_outputs`: {"json": schema} | {"regex": str} | {"grammar": str (Lark or GBNF)}
  | {"choice": [str, ...]} (vLLM's shape; its older `guided_json`, `guided_regex`,
  `guided_grammar`, `guided_choice` are accepted too), or llama.cpp-style top-level `grammar`
  (GBNF or llguidance Lark, detected) or `regex`.
- Ollama /api/chat and /api/generate: `format`: "json" or a JSON schema object.
- Anthropic /v1/messages: `output_config.format` {"type": "json_schema", "schema": {...}}.

The schema keywords supported and refused are listed in mlxlocal/grammar/schema.py. The
reply's content is the generated JSON text; for a thinking model the constraint starts after
its think block (mlxlocal.grammar.with_reasoning), which may use at most half of max_tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from mlxlocal import grammar
from mlxlocal.engine import Grammar, SamplingParams
from mlxlocal.grammar.errors import GrammarError
from mlxlocal.grammar.parse import starts_in_reasoning
from mlxlocal.grammar.tools import tool_calls
from mlxlocal.server import lanes
from mlxlocal.server.errors import APIError

# Extension fields: top-level name -> structured_outputs key it means.
_TOP_LEVEL = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar",
              "guided_choice": "choice", "regex": "regex", "grammar": "grammar"}


def _json(value: Any, param: str, strict: bool) -> Grammar:
    if isinstance(value, str):  # vLLM's guided_json may be the schema's JSON text
        try:
            value = json.loads(value)
        except ValueError as e:
            raise grammar.GrammarError(f"{param}: not valid JSON: {e}", param) from None
    return grammar.json_schema(value, param, strict=strict)


_BUILDERS = {
    "json": _json,
    "json_object": lambda value, param, strict: grammar.json_object(param),
    "regex": lambda value, param, strict: grammar.regex(value, param),
    "grammar": lambda value, param, strict: grammar.gbnf(value, param),  # detects Lark too
    "choice": lambda value, param, strict: grammar.choice(value, param),
}


def _build(kind: str, value: Any, param: str, strict: bool = False) -> Grammar:
    """Compile a constraint (a large schema takes a while: callers run this off the event loop)."""
    try:
        return _BUILDERS[kind](value, param, strict)
    except grammar.GrammarError as e:
        raise APIError(400, str(e), param=e.param) from None


def _strict(value: Any, param: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise APIError(400, f"{param}: must be true or false, got {value!r}", param=param)
    return value


def _object(value: Any, param: str) -> dict:
    if not isinstance(value, dict):
        raise APIError(400, f"{param}: must be an object", param=param)
    return value


def _typed_format(fmt: Any, param: str, schema_holder: str | None) -> Grammar | None:
    """OpenAI-style {"type": ...}; the schema sits in fmt[schema_holder] (chat's "json_schema")
    or in fmt itself (Responses, Anthropic)."""
    fmt = _object(fmt, param)
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return _build("json_object", None, param)
    if kind != "json_schema":
        raise APIError(400, f"{param}.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                       param=f"{param}.type")
    where = f"{param}.{schema_holder}" if schema_holder else param
    holder = _object(fmt.get(schema_holder), where) if schema_holder else fmt
    schema = holder.get("schema")
    if schema is None:  # OpenAI allows a json_schema without a schema: any JSON object
        return _build("json_object", None, f"{where}.schema")
    return _build("json", schema, f"{where}.schema", _strict(holder.get("strict"), f"{where}.strict"))


def _extension(body: dict, base: Grammar | None = None, base_param: str | None = None) -> Grammar | None:
    """`structured_outputs` or a top-level grammar field; 400 when more than one constraint
    is asked for (including `base`, what the dialect's own field gave)."""
    found: list[tuple[str, str, Any]] = []  # (param, kind, value)
    so = body.get("structured_outputs")
    if so is not None:
        so = _object(so, "structured_outputs")
        for key in ("json", "regex", "grammar", "choice"):
            if so.get(key) is not None:
                found.append((f"structured_outputs.{key}", key, so[key]))
    for name, kind in _TOP_LEVEL.items():
        if body.get(name) is not None:
            found.append((name, kind, body[name]))
    asked = ([base_param] if base is not None and base_param else []) + [p for p, _, _ in found]
    if len(asked) > 1:
        raise APIError(400, f"{asked[1]}: only one output constraint per request (also got {asked[0]})",
                       param=asked[1])
    if not found:
        return base
    param, kind, value = found[0]
    return _build(kind, value, param)


def _lane(fmt: Any, body: dict | None = None) -> lanes.Lane:
    """The compile lane for a request's constraint fields, by their size."""
    fields = [fmt] + ([body.get("structured_outputs")] + [body.get(k) for k in _TOP_LEVEL] if body else [])
    return lanes.grammar_lane(lanes.weight(fields))


def _asks(body: dict) -> bool:
    return body.get("structured_outputs") is not None or any(body.get(k) is not None for k in _TOP_LEVEL)


def _openai_chat(response_format: Any, body: dict) -> Grammar | None:
    base = None if response_format is None else _typed_format(response_format, "response_format", "json_schema")
    return _extension(body, base, "response_format")


async def openai_chat(response_format: Any, body: dict) -> Grammar | None:
    """Chat and completions: response_format, then the extension fields."""
    if response_format is None and not _asks(body):
        return None
    return await _lane(response_format, body).run(_openai_chat, response_format, body)


def _responses(fmt: Any, body: dict) -> Grammar | None:
    base = None if fmt is None else _typed_format(fmt, "text.format", None)
    return _extension(body, base, "text.format")


async def responses(text: Any, body: dict) -> Grammar | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None and not _asks(body):
        return None
    return await _lane(fmt, body).run(_responses, fmt, body)


async def ollama(fmt: Any) -> Grammar | None:
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return _build("json_object", None, "format")
    if isinstance(fmt, dict):
        return await _lane(fmt).run(_build, "json", fmt, "format")
    raise APIError(400, f"format: must be \"json\" or a JSON schema object, got {fmt!r}", param="format")


async def anthropic(output_config: Any) -> Grammar | None:
    fmt = output_config.get("format") if isinstance(output_config, dict) else None
    if fmt is None:
        return None
    fmt = _object(fmt, "output_config.format")
    if fmt.get("type") != "json_schema":
        raise APIError(400, f"output_config.format.type: must be 'json_schema', got {fmt.get('type')!r}",
                       param="output_config.format.type")
    if fmt.get("schema") is None:
        raise APIError(400, "output_config.format.schema: required", param="output_config.format.schema")
    return await _lane(fmt).run(_build, "json", fmt["schema"], "output_config.format.schema")


@dataclass(frozen=True)
class Format:
    """A request's output-format fields as its dialect sent them, parsed by `parse`."""

    dialect: Literal["openai", "responses", "ollama", "anthropic"]
    value: Any  # response_format, text, format or output_config
    extensions: dict = field(default_factory=dict)  # structured_outputs, guided_*, grammar, regex


async def parse(fmt: Format | None) -> Grammar | None:
    """The format's grammar (None for plain text): a 400 naming the field for a bad one."""
    if fmt is None:
        return None
    if fmt.dialect == "openai":
        return await openai_chat(fmt.value, fmt.extensions)
    if fmt.dialect == "responses":
        return await responses(fmt.value, fmt.extensions)
    if fmt.dialect == "ollama":
        return await ollama(fmt.value)
    return await anthropic(fmt.value)


async def constrain(params: SamplingParams, constraint: Grammar | None, engine, ids: list[int],
                    parsed: bool = True, think_budget: int | None = None) -> None:
    """Set params.grammar for this prompt: after the model's think block when it has one.

    `parsed`: the dialect splits reasoning from content, so the model may open a think block
    before answering. Raw completions do not: their text must be the document itself, unless
    the prompt ends inside a think block, which the model then has to close first.
    `think_budget`: the grammar bounds the block to it (instead of half of max_tokens), so a
    constrained request needs no second pass to close the block.
    A grammar already set (a forced tool call, tool_grammar) wins: the call is the reply."""
    if constraint is None or params.grammar is not None:
        return
    opened = starts_in_reasoning(engine, ids)
    if not (parsed or opened):
        params.grammar = constraint
        return
    try:
        budget = think_budget if think_budget is not None else params.max_tokens // 2
        params.grammar = await lanes.grammar_lane(len(constraint.spec)).run(grammar.with_reasoning, constraint, engine.chat_format, opened,
                                                 max(1, budget))
    except grammar.GrammarError as e:
        raise APIError(400, str(e), param=e.param) from None


# --- tools --------------------------------------------------------------------------------
# A tool choice that requires a call (a system hint is added to the prompt: pipeline.py),
# the same way in every dialect.
#
# Decoding is constrained to the model family's own tool-call syntax (grammar/tools.py): the
# reply is one call (or, when parallel calls are allowed, several) of an offered tool (only
# the named one for a named choice), with arguments under the tool's parameters schema, and
# nothing else (after a think block, for a thinking model). A system hint also tells the
# model which call is wanted, so a real model fills the arguments in knowingly rather than
# only because it must. A family whose calls the grammar cannot express is a 400 naming the
# field, never a silently unforced reply.
#
# A forced call and a response format in one request: the call wins (its grammar replaces the
# format's), as a reply cannot be both a tool call and a document.
#
# tool_choice auto with a `strict: true` tool (OpenAI function.strict, Responses and Anthropic
# `strict`): the reply may be text or calls, and a call holds to its tool's schema (the
# grammar's optional form); without strict tools auto is left unconstrained.


def _strict_tool(tool: dict) -> bool:
    return tool.get("strict") is True or (tool.get("function") or {}).get("strict") is True


async def tool_grammar(engine, tools: list[dict] | None, required: bool, name: str | None, ids: list[int],
                       max_tokens: int, parallel: bool = True, think_budget: int | None = None) -> Grammar | None:
    """The grammar a request's tools ask for (None for none): a forced call (`required`, or
    `name`d), or under auto optional calls when a tool is strict. Every dialect decides here."""
    if not tools:
        return None
    if required or name is not None:
        return await forced_call_grammar(engine, tools, name, ids, max_tokens, parallel, think_budget)
    if any(_strict_tool(t) for t in tools):
        return await forced_call_grammar(engine, tools, None, ids, max_tokens, parallel, think_budget,
                                         param="tools", optional=True)
    return None


async def forced_call_grammar(engine, tools: list[dict], name: str | None, ids: list[int], max_tokens: int,
                              parallel: bool = True, think_budget: int | None = None,
                              param: str = "tool_choice", optional: bool = False) -> Grammar:
    """The grammar for a required call of `tools` (chat-completions shaped, as rendered) or of
    the one named, for the prompt `ids`. A thinking model may think first, for at most
    `think_budget` tokens or else half of max_tokens (as `constrain` allows before a
    response format), so the calls always get room. Built on a worker thread: compiling
    many tools' schemas takes a while. GrammarError -> a 400 on `param`."""
    budget = think_budget if think_budget is not None else max(1, max_tokens // 2)
    try:
        lane = lanes.grammar_lane(lanes.weight(tools))
        return await lane.run(tool_calls, engine.chat_format, tools, name, param, starts_in_reasoning(engine, ids),
                              parallel, budget, optional)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param) from None
