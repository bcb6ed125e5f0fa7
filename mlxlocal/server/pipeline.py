"""One request pipeline for every chat dialect. A router parses its body into a ChatRequest
(its own fields, errors in its own names); `prepare` turns that into a prompt and sampling
parameters on the loaded engine, the same steps in the same order for every dialect; `run`
starts it and yields the dialect-neutral events (events.py) the router renders.

prepare: tool_choice -> tool pruning -> the engine -> system turns -> template + tokenize
(with the request's cache edits, akv.py) -> the tool grammar -> the response format's grammar
-> the checks against the model (context, vocabulary)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from mlxlocal.engine import Engine, Grammar, SamplingParams
from mlxlocal.server import akv, formats
from mlxlocal.server.events import StreamEvent, open_events, stream_keepalive
from mlxlocal.server.prompting import apply_tool_choice, place_system_turns
from mlxlocal.server.tool_choice import tool_grammar
from mlxlocal.server.tool_pruning import prune_tools
from mlxlocal.server.validation import check_params, text_bytes


@dataclass(frozen=True)
class ToolChoice:
    """Which tool calls a reply may or must make."""

    mode: str = "auto"  # "auto", "none" or "required"
    name: str | None = None  # a named function: that one call is forced
    parallel: bool = True  # several calls in one reply
    param: str = "tool_choice"  # the dialect's field, for errors


@dataclass
class ChatRequest:
    """A chat request in no dialect: what every router parses its body into."""

    model: str
    route: str  # the endpoint, for tool pruning's log and metrics
    messages: list[dict]  # template-ready turns
    params: SamplingParams | None  # None: the prompt only (a token count), nothing generated
    names: dict[str, str] = field(default_factory=dict)  # engine field -> the dialect's, for errors
    where: str = "messages"  # the dialect's list of turns, for errors
    tools: list[dict] | None = None  # chat-completions shaped, before tool_choice
    tool_choice: ToolChoice = ToolChoice()
    constraint: Grammar | None = None  # the response format's grammar
    # The template's variables (a thinking switch), or a function of the model's chat template
    # that says which of them it reads (Anthropic's thinking modes).
    template_kwargs: dict | Callable[[Any], dict] | None = None
    cache: akv.CacheRequest | None = None  # session and drop fields
    origins: akv.Origins | None = None  # request index -> chat message, for the drop fields
    stream: bool = False


@dataclass
class Prepared:
    """A ChatRequest made ready on its engine: the prompt, the final parameters, the tools as
    rendered (the output parser looks for their calls) and what the KV cache is asked."""

    engine: Engine
    ids: list[int]
    params: SamplingParams | None
    tools: list[dict] | None
    cache: akv.CacheUse
    stream: bool


async def prepare(request: Request | None, chat: ChatRequest, engine: Engine | None = None) -> Prepared:
    """`engine`: one the router already holds (Ollama's keep-alive accounting, the MCP tools),
    else the registry loads the request's model. `request` None: not over HTTP (the MCP
    tools): no tool pruning, no server cache policy."""
    choice = chat.tool_choice
    tools = apply_tool_choice(chat.tools, choice.mode, choice.name, chat.messages, choice.param)
    tools = await prune_tools(request, tools, chat.messages, chat.route)
    if engine is None:
        assert request is not None, "prepare needs the request's app or an engine"
        engine = await request.app.state.registry.engine(chat.model)
    messages = place_system_turns(chat.messages, engine.chat_format, chat.origins)
    # Not assistant turns: a template may drop their text (reasoning); the rest it keeps.
    sure = text_bytes(*(m["content"] for m in messages if m["role"] != "assistant"))
    kwargs = chat.template_kwargs
    if callable(kwargs):
        kwargs = kwargs(engine.chat_format.chat_template)
    params = chat.params
    ids, use = await akv.encode(request, engine, chat.model, chat.cache, messages, chat.origins, tools,
                                chat.where, sure, template_kwargs=kwargs, check_length=params is not None)
    if params is None:
        return Prepared(engine, ids, None, tools, use, chat.stream)
    params.grammar = await tool_grammar(engine, tools, choice.mode == "required", choice.name, ids,
                                        params.max_tokens, choice.parallel, params.think_budget)
    await formats.constrain(params, chat.constraint, engine, ids, think_budget=params.think_budget)
    if params.grammar is not None:  # the grammar bounds the think block itself
        params.think_budget = None
    check_params(params, chat.names, engine, ids)
    return Prepared(engine, ids, params, tools, use, chat.stream)


async def run(request: Request, ready: Prepared) -> AsyncGenerator[StreamEvent, None]:
    """Submit (a generation: the request had params); errors before any output (context, queue, a dead engine) raise here as HTTP
    errors, later ones end the events. Streams get keep-alives and a flush per wake-up."""
    assert ready.params is not None, "a token count is not run"
    return await open_events(request, ready.engine, ready.ids, ready.params, ready.tools,
                             request.app.state.metrics, cache=ready.cache,
                             keepalive=stream_keepalive(request) if ready.stream else None,
                             flushes=ready.stream)
