"""A grammar that forces tool calls, written in the model family's own tool-call syntax.

tool_choice "required" or a named tool (OpenAI chat and Responses, Anthropic any / tool) is
enforced by letting the model write only what its chat template taught it to write for a
call: the text grammar/parse.py's OutputParser turns back into tool calls (markers from the
model's ChatFormat, mlx-lm's tool parser for the family). Each call's arguments are
constrained by the tool's `parameters` JSON schema: fully for `strict` tools, for the others
as far as llguidance implements the schema (at worst to a JSON object). After the last call the
grammar is complete and the engine ends the reply (EOS).

Formats, by mlx-lm tool parser (what is generated):
  json_tools  Hermes / Qwen 2.5 / Qwen 3:  <tool_call>\\n{"name": N, "arguments": A}\\n</tool_call>
              one per call, "\\n" between calls
  longcat     the same JSON between <longcat_tool_call> ... </longcat_tool_call>
  mistral     [TOOL_CALLS] [{"name": N, "arguments": A}, ...]  (Mistral 7B v0.3, Nemo), or
              [TOOL_CALLS]N[ARGS]A per call where the template uses [ARGS] (v11+ templates)
  kimi_k2     <|tool_calls_section_begin|> then per call <|tool_call_begin|>functions.N:I
              <|tool_call_argument_begin|>A<|tool_call_end|>, then <|tool_calls_section_end|>
  (none)      families without tool markers (Llama 3.x, Gemma 3): one bare JSON object
              {"name": N, "parameters": A} ("arguments" if the template does not say
              "parameters"); one call only, as the parser reads a single object
  qwen3_coder <tool_call>\\n<function=N>\\n<parameter=K>\\nV\\n</parameter>\\n...</function>\\n</tool_call>
  glm47       <tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n...</tool_call> (also laguna)
              XML values: strings raw (the parser keeps them as text when the schema says
              string), everything else JSON; parameters in schema order, optional ones may
              be left out. A strict tool whose properties these cannot express (no single
              type, string formats) is a GrammarError.
Other families (minimax_m2, minicpm5 and muse_spark XML, whose parsers need the markup
escaped or CDATA; pythonic, gemma4, function_gemma) raise GrammarError naming the family:
the request is refused rather than answered without the constraint.

A thinking model may reason first, as for every other constraint (grammar.with_reasoning):
a think block the prompt opened must be closed before the calls; otherwise one may come
first. `max_think_tokens` bounds it, so the calls always get room.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llguidance import LLMatcher, regex_to_lark

from mlxlocal.engine import ChatFormat, Grammar
from mlxlocal.grammar.errors import GrammarError
from mlxlocal.grammar.formats import with_reasoning
from mlxlocal.grammar.schema import strict_schema

# JSON whitespace inside arguments: at most 8 characters wherever JSON allows some. llguidance's
# default ([ \t\n\r]+ at each spot) lets a model that is unsure, and a random-weight model
# always, write whitespace forever; 8 still fits a newline plus an indent.
WHITESPACE = r"[ \t\n\r]{1,8}"
# Calls in one reply when parallel calls are allowed: more than any real turn makes; it keeps a
# model that keeps calling from running to max_tokens mid-call.
MAX_CALLS = 16

_JSON_PARSERS = ("json_tools", "longcat", "mistral", "kimi_k2")
# XML-bodied formats: per parameter (open, close around the value), whether the parser
# strips the value (so a string must not start or end with whitespace), and whether it
# reads every value "null" as null (so a string must not be that word).
_XML = {
    "qwen3_coder": ("<parameter={key}>\n", "\n</parameter>\n", False, True),
    "glm47": ("<arg_key>{key}</arg_key>\n<arg_value>", "</arg_value>\n", True, False),
    "laguna": ("<arg_key>{key}</arg_key>\n<arg_value>", "</arg_value>\n", True, False),
}
# Formats that write a tool's name outside JSON, and the names their parsers read back
# (OpenAI's and Anthropic's own rule for tool names).
_RAW_NAMES = ("kimi_k2", *_XML)  # and mistral's [ARGS] format
_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
# String keywords a raw XML value can be held to; others are refused for strict tools.
_XML_STRING_KEYS = {"type", "enum", "const", "minLength", "maxLength", "pattern", "description", "title",
                    "default", "examples"}

def family(fmt: ChatFormat) -> str:
    """The tool-call format's name: mlx-lm's tool parser module ("json_tools", "mistral",
    ...), or "" for a tokenizer without tool markers (calls are bare JSON objects)."""
    parser = fmt.tool_parser
    if parser is None:
        return "unknown" if fmt.tool_call_start else ""
    return getattr(parser, "__module__", "").rsplit(".", 1)[-1] or "unknown"


def _lit(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _marker(fmt: ChatFormat, text: str) -> str:
    """A marker in Lark. Added tokens (special or not) in it are matched by id: llguidance
    keeps them apart from text, so spelling them out in ordinary tokens would also be allowed
    but is not what the model was trained to write (and text before a marker that starts
    with one cannot run into it). A marker of ordinary tokens only is a string."""
    ids = fmt.encode(text)
    added = fmt.added_token_ids
    if not any(i in added for i in ids):
        return _lit(text)
    parts: list[str] = []
    run: list[int] = []
    for i in ids:
        if i in added:
            if run:
                parts.append(_lit(fmt.decode(run)))
                run = []
            parts.append(f"<[{i}]>")
        else:
            run.append(i)
    if run:
        parts.append(_lit(fmt.decode(run)))
    return " ".join(parts)


def _compile_error(schema: dict) -> str | None:
    """llguidance's refusal of a JSON schema (one line), or None when it compiles."""
    try:
        spec = LLMatcher.grammar_from_json_schema(schema)
    except ValueError as e:
        return str(e)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(spec)
    if not is_error:
        return None
    lines = [ln.strip() for ln in (messages[0] if messages else "rejected").splitlines() if ln.strip()]
    return lines[0] if lines else "rejected"


def arguments_schema(tool: dict, param: str) -> dict:
    """The JSON schema a call's arguments are generated under (with our whitespace bound).

    strict tools: the schema exactly (objects closed by default); one llguidance cannot
    enforce is a GrammarError naming the tool. Other tools: the schema as far as it goes:
    as given, else with llguidance's `lenient` option (keywords it does not implement are
    ignored, the rest still holds), else any JSON object."""
    fn = tool.get("function", tool)
    name = fn["name"]
    strict = fn.get("strict") is True or tool.get("strict") is True
    schema = fn.get("parameters")
    if schema is None:
        schema = {"type": "object", "properties": {}}
    if not isinstance(schema, dict) or schema.get("type", "object") != "object":
        if strict:
            raise GrammarError(f"{param}: tool '{name}': parameters must be a JSON schema of type object", param)
        schema = {"type": "object"}
    schema = {k: v for k, v in schema.items() if k not in ("x-guidance", "$schema")}
    schema.setdefault("type", "object")
    guidance = {"whitespace_pattern": WHITESPACE}
    if strict:
        exact = {**strict_schema(schema), "x-guidance": guidance}
        error = _compile_error(exact)
        if error:
            raise GrammarError(f"{param}: tool '{name}': its parameters schema cannot be enforced: {error}", param)
        return exact
    for candidate in ({**schema, "x-guidance": guidance},
                      {**schema, "x-guidance": {**guidance, "lenient": True}}):
        if _compile_error(candidate) is None:
            return candidate
    return {"type": "object", "x-guidance": guidance}


def _repeat(item: str, sep: str, parallel: bool) -> str:
    return f"{item} ({sep} {item}){{0,{MAX_CALLS - 1}}}" if parallel else item


def _json_calls(names: list[str], key: str) -> list[str]:
    """Rules call_i: the JSON object {"name": N, key: A} of tool i (its arguments: args_i)."""
    heads = [_lit("{" + f'"name": {json.dumps(n, ensure_ascii=False)}, "{key}": ') for n in names]
    return [f"call_{i}: {head} args_{i} " + _lit("}") for i, head in enumerate(heads)]


def _one_of(rule: str, names: list[str]) -> str:
    return f"{rule}: " + " | ".join(f"call_{i}" for i in range(len(names)))


def _calls(fmt: ChatFormat, fam: str, names: list[str], parallel: bool) -> list[str]:
    """Lark rules for `calls` in the family's format (arguments: rules args_i)."""
    start, end, template = fmt.tool_call_start, fmt.tool_call_end, fmt.chat_template
    template = template if isinstance(template, str) else ""

    def marker(text: str | None) -> str:
        assert text is not None, f"{fam}: the format lacks a marker it writes"
        return _marker(fmt, text)
    if fam == "":
        key = "parameters" if '"parameters"' in template else "arguments"
        return [*_json_calls(names, key), _one_of("calls", names)]
    if fam in ("json_tools", "longcat"):
        rule = f"{marker(start)} \"\\n\" call \"\\n\" {marker(end)}"
        return [*_json_calls(names, "arguments"), _one_of("call", names),
                f"one: {rule}", f"calls: {_repeat('one', _lit(chr(10)), parallel)}"]
    if fam == "mistral":
        head = marker(start)
        if "[ARGS]" in template:
            args = _marker(fmt, "[ARGS]")
            rules = [f"call_{i}: {head} {_lit(n)} {args} args_{i}" for i, n in enumerate(names)]
            return [*rules, _one_of("call", names), f"calls: {_repeat('call', '', parallel)}"]
        # The v0.3 template writes "[TOOL_CALLS] [", Nemo's "[TOOL_CALLS][": either parses.
        return [*_json_calls(names, "arguments"), _one_of("call", names),
                f"calls: {head} \" \"? \"[\" {_repeat('call', _lit(', '), parallel)} \"]\""]
    if fam == "qwen3_coder":
        heads = [_lit(f"\n<function={n}>\n") for n in names]
        rules = [f"call_{i}: {h} args_{i} " + _lit("</function>\n") for i, h in enumerate(heads)]
        rule = f"{marker(start)} call {marker(end)}"
        return [*rules, _one_of("call", names), f"one: {rule}", f"calls: {_repeat('one', _lit(chr(10)), parallel)}"]
    if fam in ("glm47", "laguna"):
        rules = [f"call_{i}: {_lit(n + chr(10))} args_{i}" for i, n in enumerate(names)]
        rule = f"{marker(start)} call {marker(end)}"
        return [*rules, _one_of("call", names), f"one: {rule}", f"calls: {_repeat('one', _lit(chr(10)), parallel)}"]
    if fam == "kimi_k2":
        # Call ids are functions.N:I with I counting the calls of the reply, as Kimi writes them.
        begin, arg, stop = (_marker(fmt, m) for m in
                            ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"))
        rules = []
        count = MAX_CALLS if parallel else 1
        for k in range(count):
            alts = " | ".join(f"{begin} {_lit(f'functions.{n}:{k}')} {arg} args_{i} {stop}"
                              for i, n in enumerate(names))
            rules.append(f"call_at_{k}: {alts}")
        chain = "".join(f" (call_at_{k}" for k in range(1, count)) + ")?" * (count - 1)
        return [*rules, f"calls: {marker(start)} call_at_0{chain} {marker(end)}"]
    raise AssertionError(fam)


def _anchored(pattern: str) -> str:
    """A JSON Schema pattern (found anywhere in the string unless anchored) as a regex that
    must match the whole value, in llguidance's Lark regex syntax."""
    core = pattern
    head = "" if core.startswith("^") else "(?s:.*)"
    tail = "" if core.endswith("$") and not core.endswith("\\$") else "(?s:.*)"
    core = core[1:] if not head else core
    core = core[:-1] if not tail else core
    return regex_to_lark(f"{head}(?:{core}){tail}", "dw")


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 1 << 20


def _xml_string(rule: str, schema: dict, fam: str, where: str, strict: bool, param: str) -> list[str]:
    """A raw string value: its enum / const as literals, else a terminal held to the length
    bounds and pattern, never containing the closing tag (the parser would end there)."""
    _, close, stripped, null_word = _XML[fam]
    extra = sorted(set(schema) - _XML_STRING_KEYS)
    if extra and strict:
        raise GrammarError(f"{param}: {where}: {', '.join(extra)} cannot be enforced on a raw string "
                           f"in this model's tool-call format ({fam})", param)
    closing = close.strip("\n")
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if options is not None:
        ok = [o for o in options if isinstance(o, str) and closing not in o
              and not (stripped and o != o.strip()) and not (null_word and o.lower() == "null")]
        if not ok:
            raise GrammarError(f"{param}: {where}: no enum value can be written in this format ({fam})", param)
        return [f"{rule}: " + " | ".join(f"{_lit(o)} {_lit(close)}" for o in ok)]
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    lo = lo if _count(lo) else 0
    hi = hi if _count(hi) else None
    parts = [f"/(?s:.{{{lo},{'' if hi is None else hi}}})/",
             f"~/(?s:.*){regex_to_lark(re.escape(closing))}(?s:.*)/"]
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        regex = f"/{_anchored(pattern)}/"
        if not LLMatcher.validate_grammar_with_warnings(LLMatcher.grammar_from_lark(f"start: {regex}"))[0]:
            parts.append(regex)
        elif strict:
            raise GrammarError(f"{param}: {where}: pattern {pattern!r} cannot be enforced", param)
    if stripped:
        parts.append("/(?s:(\\S(.*\\S)?)?)/")
    if null_word:
        parts.append("~/(?i:null)/")
    terminal = rule.upper()
    return [f"{terminal}: " + " & ".join(parts), f"{rule}[suffix={_lit(close)}]: {terminal}"]


def _xml_arguments(i: int, tool: dict, fam: str, param: str) -> list[str]:
    """Rules args_i for tool i in an XML format: each parameter in schema order (optional
    ones may be left out), strings raw, other values JSON under their own schema."""
    fn = tool.get("function", tool)
    strict = fn.get("strict") is True or tool.get("strict") is True
    schema = arguments_schema(tool, param)
    guidance = schema.get("x-guidance", {})
    props = schema.get("properties")
    props = props if isinstance(props, dict) else {}
    required = set(schema.get("required") or [])
    missing = sorted(required - set(props))
    if missing and strict:
        raise GrammarError(f"{param}: tool '{fn['name']}': required {missing} not in properties", param)
    open_, *_ = _XML[fam]
    rules, seq = [], []
    for k, (key, sub) in enumerate(props.items()):
        rule, where = f"v_{i}_{k}", f"tool '{fn['name']}' parameter '{key}'"
        sub = sub if isinstance(sub, dict) else {}
        kind = sub.get("type")
        options = sub.get("enum", [sub["const"]] if "const" in sub else [None])
        if kind == "string" or (kind is None and all(isinstance(o, str) for o in options)):
            rules += _xml_string(rule, sub, fam, where, strict, param)
        else:
            if not isinstance(kind, str) and strict and fam == "qwen3_coder":
                # qwen3_coder's parser converts a value by its schema's one type.
                raise GrammarError(f"{param}: {where}: needs a single type in this model's "
                                   f"tool-call format ({fam})", param)
            value = {**sub, "x-guidance": {**guidance, **({} if strict else {"lenient": True})}}
            rules.append(f"{rule}: %json {json.dumps(value, ensure_ascii=False)} {_lit(_XML[fam][1])}")
        item = f"{_lit(open_.replace('{key}', key))} {rule}"
        seq.append(item if key in required else f"({item})?")
    return [*rules, f"args_{i}: {' '.join(seq)}" if seq else f'args_{i}: ""']


def _free_text(fmt: ChatFormat, fam: str) -> str:
    """A Lark token for a reply in plain text that the server's parser will not read as a
    call: it never contains the family's call marker (spelled in ordinary tokens either), and
    for families without markers it does not start like the bare JSON object of a call."""
    if fam == "":
        return r"TEXT: /(?s:.*)/ & ~/[ \t\r\n]*\{(?s:.*)/"
    marker = re.escape(fmt.tool_call_start or "").replace("/", "\\/")
    return f"TEXT: /(?s:.*)/ & ~/(?s:.*){marker}(?s:.*)/"


def tool_calls(fmt: ChatFormat, tools: list[dict], name: str | None, param: str,
               starts_in_reasoning: bool = False, parallel: bool = True,
               max_think_tokens: int | None = None, optional: bool = False) -> Grammar:
    """A grammar that admits only calls of `tools` (only `name` when given) in the format the
    tokenizer's family writes and its server parser reads: one call, or when `parallel` one or
    more (families without markers: always one). `tools` are chat-completions shaped
    ({"type": "function", "function": {name, parameters, strict?}}; a top-level `strict`
    counts too). `param` is the request field named in errors (GrammarError).
    For a thinking tokenizer the calls may follow a think block (must, when the prompt opened
    one: `starts_in_reasoning`) of at most `max_think_tokens`.
    `optional` (tool_choice auto with strict tools): the reply may be text instead, or text
    and then calls (families with markers); only the calls are constrained."""
    fam = family(fmt)
    if fam not in ("", *_JSON_PARSERS, *_XML):
        raise GrammarError(f"{param}: tool calls of this model's family ({fam}) cannot be enforced "
                           f"(only JSON and simple XML bodies are); use tool_choice auto", param)
    offered = [t for t in tools if name is None or t.get("function", t).get("name") == name]
    if not offered:
        raise GrammarError(f"{param}: names tool {name!r}, which is not in tools", param)
    names = [t.get("function", t)["name"] for t in offered]
    odd = [n for n in names if not _NAME.fullmatch(n)]
    template = fmt.chat_template
    raw = fam in _RAW_NAMES or (fam == "mistral" and isinstance(template, str) and "[ARGS]" in template)
    if odd and raw:
        raise GrammarError(f"{param}: tool name {odd[0]!r} cannot be written in this model's tool-call format "
                           f"({fam}): use letters, digits, '_' and '-'", param)
    rules = _calls(fmt, fam, names, parallel)
    for i, t in enumerate(offered):
        rules += (_xml_arguments(i, t, fam, param) if fam in _XML else
                  [f"args_{i}: %json {json.dumps(arguments_schema(t, param), ensure_ascii=False)}"])
    top = ["start: calls"]
    if optional:
        # Text then calls only where the marker is an added token: text ends where it starts.
        # A marker of ordinary tokens would have to be split from the text before it by a
        # greedy lexer that cannot look back (and without markers a reply is one or the other).
        split = fam != "" and "<[" in _marker(fmt, fmt.tool_call_start or "")
        top = ["start: TEXT? calls?" if split else "start: calls | TEXT", _free_text(fmt, fam)]
    lark = "\n".join([*top, *rules]) + "\n"
    spec = LLMatcher.grammar_from_lark(lark)
    is_error, messages = LLMatcher.validate_grammar_with_warnings(spec)
    if is_error:  # a tool name or schema that breaks the grammar text
        raise GrammarError(f"{param}: cannot build the tool-call grammar: {messages[0].splitlines()[0]}", param)
    return with_reasoning(Grammar(spec, param), fmt, starts_in_reasoning, max_think_tokens)
