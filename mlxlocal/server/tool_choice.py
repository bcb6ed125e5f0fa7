"""A tool choice that requires a call, the same way in every dialect.

Decoding is constrained to the model family's own tool-call syntax (grammar/tools.py): the
reply is one call (or, when parallel calls are allowed, several) of an offered tool (only
the named one for a named choice), with arguments under the tool's parameters schema, and
nothing else (after a think block, for a thinking model). A system hint also tells the
model which call is wanted, so a real model fills the arguments in knowingly rather than
only because it must. A family whose calls the grammar cannot express is a 400 naming the
field, never a silently unforced reply.

A forced call and a response format in one request: the call wins (its grammar replaces the
format's), as a reply cannot be both a tool call and a document.

tool_choice auto with a `strict: true` tool (OpenAI function.strict, Responses and Anthropic
`strict`): the reply may be text or calls, and a call holds to its tool's schema (the
grammar's optional form); without strict tools auto is left unconstrained.
"""

from __future__ import annotations

from mlxlocal.engine import Grammar
from mlxlocal.grammar.errors import GrammarError
from mlxlocal.grammar.parse import starts_in_reasoning
from mlxlocal.grammar.tools import tool_calls
from mlxlocal.server import lanes
from mlxlocal.server.errors import APIError


def require_call(messages: list[dict], name: str | None = None) -> None:
    """Add the hint to the conversation's system message (creating one at the start)."""
    hint = (f"You must answer by calling the function `{name}`." if name
            else "You must answer by calling one or more of the provided tools.")
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{hint}".strip()
    else:
        messages.insert(0, {"role": "system", "content": hint})


def _strict(tool: dict) -> bool:
    return tool.get("strict") is True or (tool.get("function") or {}).get("strict") is True


async def tool_grammar(engine, tools: list[dict] | None, required: bool, name: str | None, ids: list[int],
                       max_tokens: int, parallel: bool = True, think_budget: int | None = None) -> Grammar | None:
    """The grammar a request's tools ask for (None for none): a forced call (`required`, or
    `name`d), or under auto optional calls when a tool is strict. Every dialect decides here."""
    if not tools:
        return None
    if required or name is not None:
        return await forced_call_grammar(engine, tools, name, ids, max_tokens, parallel, think_budget)
    if any(_strict(t) for t in tools):
        return await forced_call_grammar(engine, tools, None, ids, max_tokens, parallel, think_budget,
                                         param="tools", optional=True)
    return None


async def forced_call_grammar(engine, tools: list[dict], name: str | None, ids: list[int], max_tokens: int,
                              parallel: bool = True, think_budget: int | None = None,
                              param: str = "tool_choice", optional: bool = False) -> Grammar:
    """The grammar for a required call of `tools` (chat-completions shaped, as rendered) or of
    the one named, for the prompt `ids`. A thinking model may think first, for at most
    `think_budget` tokens or else half of max_tokens (as formats.constrain allows before a
    response format), so the calls always get room. Built on a worker thread: compiling
    many tools' schemas takes a while. GrammarError -> a 400 on `param`."""
    budget = think_budget if think_budget is not None else max(1, max_tokens // 2)
    try:
        lane = lanes.grammar_lane(lanes.weight(tools))
        return await lane.run(tool_calls, engine.chat_format, tools, name, param, starts_in_reasoning(engine, ids),
                              parallel, budget, optional)
    except GrammarError as e:
        raise APIError(400, str(e), param=e.param) from None
