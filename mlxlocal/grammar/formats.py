"""Regex, Lark and GBNF grammars, and a grammar that lets a thinking model reason first."""

from __future__ import annotations

import functools
import json

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

from mlxlocal.engine import ChatFormat, Grammar
from mlxlocal.grammar.errors import GrammarError
from mlxlocal.grammar.schema import compile_checked

# Text between the end of a think block and the constrained answer: models put a newline
# or two there; bounded so it cannot become a way to ramble.
_GAP = r"/[ \t\r\n]{0,8}/"


# Sizes a request's constraint may have (a 400 naming the field beyond them): compiling is
# work per option / per byte, and llguidance's own limits only bite at generation time.
MAX_GRAMMAR_BYTES = 1 << 20
MAX_CHOICES = 10_000


def _text(value, param: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise GrammarError(f"{param}: {what} must be a non-empty string", param)
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"{param}: {what} of {size} bytes; at most {MAX_GRAMMAR_BYTES}", param)
    return value


def regex(pattern: str, param: str) -> Grammar:
    """The whole output matches `pattern` (Rust regex syntax: no look-around, no backrefs)."""
    return compile_checked(LLMatcher.grammar_from_regex(_text(pattern, param, "a regex")), param,
                           "invalid regex")


def lark(text: str, param: str) -> Grammar:
    """A grammar in llguidance's Lark dialect (`start` is the top rule; `%json {...}` inlines
    a schema)."""
    return compile_checked(LLMatcher.grammar_from_lark(_text(text, param, "a Lark grammar")), param,
                           "invalid Lark grammar")


def gbnf(text: str, param: str) -> Grammar:
    """A llama.cpp GBNF grammar (`root ::= ...`); Lark text is accepted too (detected)."""
    try:
        converted = any_to_lark(_text(text, param, "a grammar"))
    except GrammarError:
        raise
    except Exception as e:  # the converter raises bare Exceptions on unknown rules, bad syntax
        raise GrammarError(f"{param}: invalid GBNF grammar: {e}", param) from None
    return compile_checked(LLMatcher.grammar_from_lark(converted), param, "invalid grammar")


def choice(options, param: str) -> Grammar:
    """Exactly one of the given strings.

    The options are one lexeme (a terminal), matched by the lexer's automaton: as parser
    alternatives, a list of ~2,000 overflows llguidance's items-per-row limit mid-generation."""
    if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
        raise GrammarError(f"{param}: must be a non-empty list of non-empty strings", param)
    if len(options) > MAX_CHOICES:
        raise GrammarError(f"{param}: {len(options)} options; at most {MAX_CHOICES}", param)
    size = sum(len(o.encode("utf-8", "surrogatepass")) for o in options)
    if size > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"{param}: the options are {size} bytes; at most {MAX_GRAMMAR_BYTES}", param)
    lark = "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(o) for o in options)
    return compile_checked(LLMatcher.grammar_from_lark(lark), param, "invalid choice")


def _grammars(spec: str) -> dict:
    """llguidance's top-level grammar object ({"grammars": [...]}) for any spec text."""
    try:
        obj = json.loads(spec)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("grammars"), list) and obj["grammars"]:
        return obj
    return {"grammars": [{"lark_grammar": spec}]}  # grammar_from_lark returns the Lark text itself


def _marker(tokens) -> str:
    return " ".join(f"<[{int(t)}]>" for t in tokens)


def with_reasoning(grammar: Grammar, fmt: ChatFormat, starts_in_reasoning: bool,
                   max_think_tokens: int | None = None) -> Grammar:
    """`grammar` after an optional think block, for models that reason before answering.

    The think block is free text between the model's own marker tokens (matched by token id,
    so text that merely spells the marker does not end it); the constraint applies from the
    first token after it, as vLLM applies grammars after reasoning. When generation starts
    inside the block (the prompt ends with the opening marker) the block must be closed;
    otherwise the model may think or answer straight away. `max_think_tokens` bounds the
    block: at the limit only the closing marker is allowed, so the answer always gets room.
    A format without a think marker pair gets `grammar` unchanged.
    """
    if not fmt.has_thinking:
        return grammar
    start, end = fmt.think_start_tokens, fmt.think_end_tokens
    if not start or not end:
        return grammar
    return _wrap(grammar, start, end, bool(starts_in_reasoning),
                 int(max_think_tokens) if max_think_tokens and max_think_tokens > 0 else 0)


@functools.lru_cache(maxsize=128)  # the same format on every turn of a conversation
def _wrap(grammar: Grammar, start: tuple[int, ...], end: tuple[int, ...], starts_in_reasoning: bool,
          max_think_tokens: int) -> Grammar:
    obj = _grammars(grammar.spec)
    # The wrapper must be grammar 0 (the top). The original top moves to the end under a
    # name, so references by index between the other grammars still point where they did.
    answer = dict(obj["grammars"][0])
    name = answer.setdefault("name", "mlxlocal_answer")
    limit = f"[max_tokens={max_think_tokens}]" if max_think_tokens else ""
    block = f"think {_marker(end)} GAP"
    top = (f"start: {block} @{name}\n" if starts_in_reasoning
           else f"start: ({_marker(start)} {block})? @{name}\n")
    top += f"think{limit}: /(.|\\n)*/\nGAP: {_GAP}\n"
    spec = json.dumps({**obj, "grammars": [{"lark_grammar": top}, *obj["grammars"][1:], answer]})
    return compile_checked(spec, grammar.param, "cannot combine the grammar with reasoning")
