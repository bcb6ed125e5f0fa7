"""One request pipeline for every dialect. A router parses its body into a ChatRequest (its own
fields, errors in its own names); `prepare` turns that into a prompt and sampling parameters
on the loaded engine, the same steps in the same order for every dialect; `run` starts it and
yields the dialect-neutral events the router renders (`run_chunks`: the raw chunks, for the
text completions that are not parsed).

prepare, straight down: the output format's grammar (constraints.py, before any model loads)
-> the cache fields (prompt.py) -> tool_choice (tools and a system hint) -> tool pruning ->
the engine (the registry) -> system turns -> template + tokenize with the request's cache
edits (prompt.py) -> the tool grammar and the format's fitted to the prompt (constraints.py)
-> the checks against the model (context, vocabulary). run: generation.py.

A raw completion (/v1/completions, Ollama's raw generate, the MCP generate tool) is a
ChatRequest with `text` (or `token_ids`) instead of messages: no template, no tools.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from mlxlocal.agents.types import ToolInfo
from mlxlocal.engine import Engine, Grammar, SamplingParams
from mlxlocal.errors import ContextLengthError
from mlxlocal.server import constraints, generation, prompt
from mlxlocal.server.errors import APIError
from mlxlocal.server.prompt import Origins

if TYPE_CHECKING:
    from mlxlocal.engine import ChatFormat

log = logging.getLogger("mlxlocal.server")


@dataclass(frozen=True)
class ToolChoice:
    """Which tool calls a reply may or must make."""

    mode: str = "auto"  # "auto", "none" or "required"
    name: str | None = None  # a named function: that one call is forced
    parallel: bool = True  # several calls in one reply
    param: str = "tool_choice"  # the dialect's field, for errors


@dataclass
class ChatRequest:
    """A request in no dialect: what every router parses its body into."""

    model: str
    route: str  # the endpoint, for tool pruning's log and metrics
    messages: list[dict]  # template-ready turns
    params: SamplingParams | None  # None: the prompt only (a token count), nothing generated
    names: dict[str, str] = field(default_factory=dict)  # engine field -> the dialect's, for errors
    where: str = "messages"  # the dialect's list of turns (or prompt), for errors
    tools: list[dict] | None = None  # chat-completions shaped, before tool_choice
    tool_choice: ToolChoice = ToolChoice()
    # The output format fields as sent, or their grammar when the router parsed them first
    # (`output_grammar`: Ollama's routes load their model themselves, after parsing).
    format: constraints.Format | Grammar | None = None
    # The template's variables (a thinking switch), or a function of the model's chat template
    # that says which of them it reads (Anthropic's thinking modes).
    template_kwargs: dict | Callable[[Any], dict] | None = None
    cache_fields: dict | None = None  # the body's session and drop fields (HTTP only)
    origins: Origins | None = None  # request index -> chat message, for the drop fields
    stream: bool = False
    text: str | None = None  # a raw completion's prompt: tokenized as is, no template
    token_ids: list[int] | None = None  # a raw completion given as token ids
    # The reply is split into reasoning and content, so a format's grammar may let a think
    # block come first; a text completion's text is the document itself (False).
    parsed: bool = True


@dataclass
class Prepared:
    """A ChatRequest made ready on its engine: the prompt, the final parameters, the tools as
    rendered (the output parser looks for their calls) and what the KV cache is asked."""

    engine: Engine
    ids: list[int]
    params: SamplingParams | None
    tools: list[dict] | None
    cache: prompt.CacheUse
    stream: bool


async def prepare(request: Request | None, chat: ChatRequest, engine: Engine | None = None) -> Prepared:
    """`engine`: one the router already holds (Ollama's keep-alive accounting, the MCP tools),
    else the registry loads the request's model. `request` None: not over HTTP (the MCP
    tools): no tool pruning, no sessions, no server cache policy."""
    constraint = await output_grammar(chat.format)  # a bad schema: 400 before loading
    cache = prompt.read(request, chat.cache_fields, chat.where) \
        if request is not None and chat.cache_fields is not None else None
    choice = chat.tool_choice
    tools = apply_tool_choice(chat.tools, choice.mode, choice.name, chat.messages, choice.param)
    tools = await prune_tools(request, tools, chat.messages, chat.route)
    if engine is None:
        assert request is not None, "prepare needs the request's app or an engine"
        engine = await request.app.state.registry.engine(chat.model)
    params = chat.params
    raw = chat.text is not None or chat.token_ids is not None
    if raw:
        ids, use = await _raw_ids(engine, chat), prompt.CacheUse(chat.model)
    else:
        messages = place_system_turns(chat.messages, engine.chat_format, chat.origins)
        # Not assistant turns: a template may drop their text (reasoning); the rest it keeps.
        sure = prompt.text_bytes(*(m["content"] for m in messages if m["role"] != "assistant"))
        kwargs = chat.template_kwargs
        if callable(kwargs):
            kwargs = kwargs(engine.chat_format.chat_template)
        ids, use = await prompt.encode(request, engine, chat.model, cache, messages, chat.origins, tools,
                                       chat.where, sure, template_kwargs=kwargs, check_length=params is not None)
    if params is None:
        return Prepared(engine, ids, None, tools, use, chat.stream)
    params.grammar = await constraints.tool_grammar(engine, tools, choice.mode == "required", choice.name, ids,
                                                    params.max_tokens, choice.parallel, params.think_budget)
    await constraints.constrain(params, constraint, engine, ids, parsed=chat.parsed, think_budget=params.think_budget)
    if params.grammar is not None:  # the grammar bounds the think block itself
        params.think_budget = None
    check_params(params, chat.names, engine, ids)
    return Prepared(engine, ids, params, tools, use, chat.stream)


async def output_grammar(fmt: constraints.Format | Grammar | None) -> Grammar | None:
    """The output format's grammar (None: plain text); a bad one is a 400 naming its field."""
    return await constraints.parse(fmt) if isinstance(fmt, constraints.Format) else fmt


async def _raw_ids(engine: Engine, chat: ChatRequest) -> list[int]:
    if chat.token_ids is not None:
        vocab = engine.chat_format.vocab_size
        bad = [t for t in chat.token_ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"{chat.where}: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                           param=chat.where)
        return list(chat.token_ids)
    assert chat.text is not None
    return await prompt.tokenize(engine, prompt.text_bytes(chat.text), chat.where, engine.encode_text, chat.text,
                                 template=False)


async def run(request: Request | None, ready: Prepared) -> AsyncGenerator[generation.StreamEvent, None]:
    """Submit (a generation: the request had params); errors before any output (context, queue,
    a dead engine) raise here as HTTP errors, later ones end the events. Streams get keep-alives
    and a flush per wake-up. `request` None (the MCP tools): submitted as is, no session."""
    assert ready.params is not None, "a token count is not run"
    if request is None:
        return generation.local_events(ready.engine, ready.ids, ready.params, ready.tools)
    return await generation.open_events(request, ready.engine, ready.ids, ready.params, ready.tools,
                                        request.app.state.metrics, cache=ready.cache,
                                        keepalive=generation.stream_keepalive(request) if ready.stream else None,
                                        flushes=ready.stream)


async def run_chunks(request: Request, ready: Prepared) -> AsyncGenerator[generation.Item, None]:
    """`run` without the output parser: each wake-up's chunks as they come (raw completions)."""
    assert ready.params is not None, "a token count is not run"
    return await generation.open_chunks(request, ready.engine, ready.ids, ready.params, request.app.state.metrics,
                                        keepalive=generation.stream_keepalive(request) if ready.stream else None)


# --- the parameters' ranges, named in the dialect's terms ------------------------------------
_FIELD = re.compile(r"^(?:prompt token ids|[a-z_]+)")


def check_params(params: SamplingParams, names: dict[str, str], engine=None,
                 ids: list[int] | None = None) -> None:
    """SamplingParams.validate (and EngineBase.validate, given the engine and prompt) with the
    field in the error renamed by `names` (SamplingParams field -> the dialect's name)."""
    try:
        if engine is None:
            params.validate()
        else:
            engine.validate(ids, params)
    except ContextLengthError as e:
        raise APIError(400, str(e), param=names.get("prompt", "messages"), code="context_length_exceeded") from None
    except ValueError as e:
        message = str(e)
        m = _FIELD.match(message)
        field = "prompt" if m and m.group() == "prompt token ids" else m.group() if m else ""
        where = names.get(field, field) or None
        if where != field:  # the field as the dialect calls it, in place of the engine's name
            message = f"{where}{message[len(field):]}" if field and message.startswith(field + " ") \
                else f"{where}: {message}"
        raise APIError(400, message, param=where) from None


# --- messages as templates take them ---------------------------------------------------------
def template_arguments(arguments: str | dict) -> Any:
    """Templates expect a mapping (most do `arguments | tojson`); keep text that is not JSON."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


# A conversation with a system turn after other messages, as a probe of the chat template.
_PROBE = (("system", "mlxlocal-probe-0"), ("user", "mlxlocal-probe-1"),
          ("system", "mlxlocal-probe-2"), ("assistant", "mlxlocal-probe-3"),
          ("user", "mlxlocal-probe-4"), ("system", "mlxlocal-probe-5"))
_LATER_SYSTEM: dict[str, bool] = {}  # chat template -> renders later system turns in place


def renders_later_system(fmt: ChatFormat) -> bool:
    """Whether the chat template writes a system message that follows other messages where
    it stands (Qwen's and Llama 3's do; Mistral's and Gemma's refuse one, some drop it)."""
    template = fmt.chat_template
    if template is None:
        return True  # encode_chat writes every message in order
    key = template if isinstance(template, str) else repr(template)
    if key not in _LATER_SYSTEM:
        try:
            text = fmt.render([{"role": r, "content": t} for r, t in _PROBE])
        except Exception:  # the template's raise_exception: roles must alternate, and the like
            text = ""
        marks = [t for _, t in _PROBE[1:]]
        at = [text.find(t) if isinstance(text, str) and text.count(t) == 1 else -1 for t in marks]
        _LATER_SYSTEM[key] = -1 not in at and at == sorted(at)
    return _LATER_SYSTEM[key]


def place_system_turns(messages: list[dict], fmt: ChatFormat,
                       origins: Origins | None = None) -> list[dict]:
    """System messages after the first message stay where the client put them: clients put
    what changes (a date, an environment note) after what does not (tools, instructions), so
    the prompt's prefix, and the prefix cache, holds across turns and days. A template that
    cannot render them there gets them folded into the system prompt at the start instead."""
    later = [m for m in messages[1:] if m["role"] == "system"]
    if not later or renders_later_system(fmt):
        return messages
    rest = [m for m in messages if not any(m is x for x in later)]
    if rest and rest[0]["role"] == "system":
        head = rest[0]
    else:
        head = {"role": "system", "content": ""}
        rest.insert(0, head)
    head["content"] = "\n\n".join(t for t in [head["content"], *(m["content"] for m in later)] if t)
    if origins is not None:
        for m in later:
            for i in origins.owners.pop(id(m), ()):
                origins.add(head, i)
            if id(m) in origins.sealed:
                origins.seal(head)
    return rest


# --- tool_choice: the tools to render, and a hint when a call is required ----------------------
def require_call(messages: list[dict], name: str | None = None) -> None:
    """Add the hint to the conversation's system message (creating one at the start): a real
    model then fills the forced call's arguments in knowingly, not only because it must."""
    hint = (f"You must answer by calling the function `{name}`." if name
            else "You must answer by calling one or more of the provided tools.")
    if messages and messages[0]["role"] == "system":
        messages[0]["content"] = f"{messages[0]['content']}\n\n{hint}".strip()
    else:
        messages.insert(0, {"role": "system", "content": hint})


def apply_tool_choice(tools: list[dict] | None, choice: str | None, name: str | None,
                      messages: list[dict], where: str = "tool_choice") -> list[dict] | None:
    """The tools to render (None for none) for a tool_choice of "auto" / "none" / "required"
    (choice) or a named function (name). "required" and a named function add a system hint (a
    named one offers only that tool), and `messages` gets it in place; the call is then forced
    by constraints.tool_grammar once the prompt is encoded. `tools` are chat-completions
    shaped: {"type": "function", "function": {...}}."""
    if not tools:
        if name is not None or choice not in (None, "none", "auto"):
            raise APIError(400, f"{where} requires tools", param=where)
        return None
    if choice == "none":
        return None
    if choice == "required":
        require_call(messages)
    elif name is not None:
        tools = [t for t in tools if t["function"]["name"] == name]
        if not tools:
            raise APIError(400, f"{where} names function '{name}', which is not in tools", param=where)
        require_call(messages, name)
    return tools


# --- `serve --max-tools K`: a request carrying more than K tools is rendered with the top K ----
# Kept: the top K of the tool index (agents/tool_index.py) for the latest user message, plus
# every tool the request's history already called (a model that saw them called would call
# them again); a named tool_choice has already reduced the list to that one tool. Off by
# default: the client runs the tools, there is no `search_tools` to find a dropped one again,
# and a client such as Claude Code expects each of its ~20 tools to be callable. When tools
# are dropped the response says how many (header x-mlxlocal-tools-dropped) and the log names
# them. The index is built once per distinct tool list (clients resend it every request).
DROPPED_HEADER = "x-mlxlocal-tools-dropped"
SCOPE_KEY = "mlxlocal.tools_dropped"  # set on the ASGI scope; app.Guard turns it into the header
SERVER = "request"  # tool ids of a request's tools: "request.NAME"
CACHED_INDEXES = 8

_indexes: OrderedDict[str, Any] = OrderedDict()
_lock = threading.Lock()


def _catalog_key(tools: list[dict]) -> str:
    return hashlib.sha256(json.dumps(tools, sort_keys=True, default=str).encode()).hexdigest()


def _index(tools: list[dict]) -> Any:
    from mlxlocal.agents.tool_index import ToolIndex  # only when pruning is on

    key = _catalog_key(tools)
    with _lock:
        if key in _indexes:
            _indexes.move_to_end(key)
            return _indexes[key]
    infos = [ToolInfo(SERVER, t["function"]["name"], t["function"].get("description") or "",
                      t["function"].get("parameters") or {"type": "object"}) for t in tools]
    index = ToolIndex(infos)
    with _lock:
        _indexes[key] = index
        while len(_indexes) > CACHED_INDEXES:
            _indexes.popitem(last=False)
    return index


def latest_user_text(messages: list[dict]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user" and isinstance(m.get("content"), str) and m["content"].strip():
            return m["content"]
    return ""


def called_names(messages: list[dict]) -> set[str]:
    return {c["function"]["name"] for m in messages for c in m.get("tool_calls") or []
            if isinstance(c, dict) and isinstance(c.get("function"), dict) and "name" in c["function"]}


def select(tools: list[dict], messages: list[dict], max_tools: int) -> tuple[list[dict], list[str]]:
    """(kept tools in the request's order, dropped names)."""
    called = called_names(messages)
    query = latest_user_text(messages)
    ranked = _index(tools).rank(query, max_tools) if query else []
    top = {tool_id.partition(".")[2] for tool_id, _ in ranked[:max_tools]}
    if not top:  # nothing to rank by (no user text): the first K, as the client ordered them
        top = {t["function"]["name"] for t in tools[:max_tools]}
    keep = top | called
    kept = [t for t in tools if t["function"]["name"] in keep]
    return kept, [t["function"]["name"] for t in tools if t["function"]["name"] not in keep]


async def prune_tools(request: Request | None, tools: list[dict] | None, messages: list[dict],
                      where: str) -> list[dict] | None:
    """The tools to render for this request under `--max-tools` (app.state.config.max_tools);
    a request from outside HTTP (`request` None: the MCP tools) offers no tools."""
    if not tools or request is None:
        return tools
    max_tools = getattr(request.app.state.config, "max_tools", None)
    if max_tools is None or len(tools) <= max_tools:
        return tools
    # The index (BM25, maybe embeddings) is CPU work: off the event loop.
    kept, dropped = await asyncio.to_thread(select, tools, messages, max_tools)
    request.scope[SCOPE_KEY] = len(dropped)
    log.info("%s: --max-tools %d kept %d of %d tools, dropped: %s", where, max_tools, len(kept), len(tools),
             ", ".join(dropped))
    return kept
