"""The local model as an MCP server (the official `mcp` SDK's MCPServer): tools `generate`,
`chat` and `count_tokens`, and the served models as the resource `mlxlocal://models`.

The tools reach models through the server's ModelRegistry and the engine contract only
(encode_*, validate, submit), with the same edge checks as the HTTP dialects: a prompt that
cannot fit is refused before tokenizing, SamplingParams ranges and context limits raise
APIErrors naming the field. Every failure becomes an MCP tool error (`isError` result with
the message), never a protocol error or a crash: arguments outside the tools' inputSchema
are refused by the SDK's pydantic validation, whose message names the field.

The transports (stdio, Streamable HTTP, the /mcp mount on `mlxlocal serve`) are in
mcp_http.py; this module knows nothing of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel, Field

from mlxlocal import __version__
from mlxlocal.engine import MAX_STOP_STRINGS, EngineDeadError, SamplingParams
from mlxlocal.grammar.parse import Event
from mlxlocal.server import embeddings_api, pipeline
from mlxlocal.server.errors import APIError
from mlxlocal.server.generation import Finish
from mlxlocal.server.model_cards import client_names
from mlxlocal.server.prompt import tokenize
from mlxlocal.server.registry import ModelRegistry
from mlxlocal.server.validation import MAX_MESSAGES

MODELS_URI = "mlxlocal://models"
# Static bounds for the schemas; the engine clips max_tokens to what the context leaves and
# refuses prompts that do not fit, so these only keep absurd values out.
MAX_TOKENS = 131072
MAX_TEXT_CHARS = 4 << 20
# Reading the model's output and counting tokens change nothing, and nothing leaves the
# machine: clients' policies (Rule of Two) may treat these tools as safe.
ANNOTATIONS = ToolAnnotations(read_only_hint=True, destructive_hint=False, idempotent_hint=False,
                              open_world_hint=False)

ModelName = Annotated[str | None, Field(description="Served model name (default: the first served model)",
                                        max_length=1024)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS, description="Most tokens to generate (clipped to "
                                 "what the context window leaves)")]
Temperature = Annotated[float, Field(ge=0.0, le=2.0, description="Sampling temperature (0 = greedy)")]
TopP = Annotated[float, Field(gt=0.0, le=1.0, description="Nucleus sampling: keep the most likely tokens "
                              "whose probabilities sum to this")]
TopK = Annotated[int, Field(ge=0, le=1 << 20, description="Keep only the k most likely tokens (0: off)")]
Seed = Annotated[int | None, Field(ge=0, lt=2**63, description="Random seed, for reproducible sampling")]
Stop = Annotated[list[Annotated[str, Field(min_length=1, max_length=256)]],
                 Field(max_length=MAX_STOP_STRINGS, description="Strings that end the output (not included)")]


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


Messages = Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES,
                                          description="The conversation, oldest first")]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache")


class GenerateResult(BaseModel):
    text: str
    finish_reason: str | None = Field(description="stop, or length (max_tokens or the context window)")
    usage: Usage


class ChatResult(BaseModel):
    content: str
    reasoning: str | None = Field(description="The reply's think block, for models that think; else null")
    finish_reason: str | None
    usage: Usage


class EmbedResult(BaseModel):
    model: str
    embeddings: list[list[float]] = Field(description="One unit-length vector per text, in order")
    tokens: list[int] = Field(description="Tokens the model read per text")
    truncated: list[int] = Field(description="Indices of texts cut to the model's maximum length")


class TokenCount(BaseModel):
    count: int
    context_length: int


def _tool_error(e: APIError) -> ToolError:
    """The API error as a tool error; its message leads with the field when it has one."""
    message = e.message
    if e.param and not message.startswith(e.param):
        message = f"{e.param}: {message}"
    return ToolError(message)


def _usage(stats) -> Usage:
    if stats is None:
        return Usage(prompt_tokens=0, completion_tokens=0, cached_tokens=0)
    return Usage(prompt_tokens=stats.prompt_tokens, completion_tokens=stats.completion_tokens,
                 cached_tokens=stats.cached_tokens)


def _params(where: str, max_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
            stop: list[str]) -> tuple[SamplingParams, dict[str, str]]:
    names = {"prompt": where}  # SamplingParams' own field names are the tools' argument names
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          stop=list(stop)), names


async def _run(chat: pipeline.ChatRequest, engine) -> AsyncIterator:
    """The request's parsed events (content / reasoning, then Finish). Leaving early (the
    client cancelled the call) cancels the request, so its KV blocks are freed next step."""
    try:
        events = await pipeline.run(None, await pipeline.prepare(None, chat, engine))
    except APIError as e:
        raise _tool_error(e) from None
    try:
        async for event in events:
            yield event
    except EngineDeadError as e:  # the registry restarts the engine on the next call
        raise ToolError(f"the engine stopped: {e}; retry the call") from None
    finally:
        await events.aclose()


def build_mcp(registry: ModelRegistry, own_registry: bool = False, expose_paths: bool = False) -> MCPServer:
    """An MCPServer over `registry`. own_registry: the server's lifespan loads the first model
    (fail fast on a bad --model) and shuts the engines down at the end (`mlxlocal mcp serve`);
    otherwise the host app does (`mlxlocal serve`). expose_paths: see model_cards.client_names."""

    @contextlib.asynccontextmanager
    async def lifespan(_server: MCPServer) -> AsyncIterator[dict]:
        if registry.models:
            await registry.engine(registry.models[0].name)
        for e in registry.embedders:
            await registry.embedder(e.name)
        try:
            yield {}
        finally:
            # Stopping (SIGTERM, see banner.py): an engine stuck in a step must not hold the exit.
            await asyncio.to_thread(registry.shutdown, 1.0 if registry.stopping else 5.0)

    # MCPServer's constructor calls logging.basicConfig on the root logger; an embedding
    # server (uvicorn's loggers, the CLI's console) must keep its own logging as it was.
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        mcp = MCPServer("mlxlocal", version=__version__, log_level="WARNING",
                        lifespan=lifespan if own_registry else None,
                        instructions="The local model served by mlxlocal: generate text, chat, count tokens. "
                                     f"Served models, their context windows and engines: {MODELS_URI}.")
    finally:
        root.handlers[:], root.level = handlers, level

    async def engine_of(model: str | None):
        try:
            return await registry.engine(model or registry.models[0].name)
        except APIError as e:
            raise _tool_error(APIError(e.status, e.message, param="model")) from None

    @mcp.tool(annotations=ANNOTATIONS)
    async def generate(
        prompt: Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS,
                                     description="Text to continue, as is (no chat template)")],
        max_tokens: MaxTokens = 256, temperature: Temperature = 0.0, top_p: TopP = 1.0, top_k: TopK = 0,
        seed: Seed = None, stop: Stop = [], model: ModelName = None,  # noqa: B006 (pydantic copies defaults)
    ) -> GenerateResult:
        """Continue a text with the local model (a raw completion, no chat template)."""
        engine = await engine_of(model)
        params, names = _params("prompt", max_tokens, temperature, top_p, top_k, seed, stop)
        completion = pipeline.ChatRequest(model or registry.models[0].name, "mcp generate", [], params, names,
                                          "prompt", text=prompt)
        text, finish = [], None
        # No tools: the text comes through as content (and reasoning, when the prompt opens a think block).
        async for event in _run(completion, engine):
            if isinstance(event, Event):
                text.append(event.text)
            elif isinstance(event, Finish):
                finish = event
        return GenerateResult(text="".join(text), finish_reason=finish.reason if finish else None,
                              usage=_usage(finish.stats if finish else None))

    @mcp.tool(annotations=ANNOTATIONS)
    async def chat(
        messages: Messages, max_tokens: MaxTokens = 512, temperature: Temperature = 0.0, top_p: TopP = 1.0,
        top_k: TopK = 0, seed: Seed = None, stop: Stop = [],  # noqa: B006 (pydantic copies defaults)
        thinking: Annotated[bool | None, Field(description="Models with a thinking switch (Qwen3): "
                                                           "think first (true) or not (false)")] = None,
        model: ModelName = None,
    ) -> ChatResult:
        """Answer a conversation with the local model through its chat template: the reply,
        and the reasoning separately for models that think."""
        engine = await engine_of(model)
        turns = [m.model_dump() for m in messages]
        params, names = _params("messages", max_tokens, temperature, top_p, top_k, seed, stop)
        kwargs = None if thinking is None else {"enable_thinking": thinking}
        chat_request = pipeline.ChatRequest(model or registry.models[0].name, "mcp chat", turns, params, names,
                                            template_kwargs=kwargs)
        parts: dict[str, list[str]] = {"content": [], "reasoning": []}
        finish = None
        async for event in _run(chat_request, engine):
            if isinstance(event, Event) and event.kind in parts:
                parts[event.kind].append(event.text)
            elif isinstance(event, Finish):
                finish = event
        reasoning = "".join(parts["reasoning"]).strip()
        return ChatResult(content="".join(parts["content"]).strip(), reasoning=reasoning or None,
                          finish_reason=finish.reason if finish else None,
                          usage=_usage(finish.stats if finish else None))

    @mcp.tool(annotations=ANNOTATIONS)
    async def count_tokens(
        text: Annotated[str | None, Field(max_length=MAX_TEXT_CHARS, description="Plain text, as is")] = None,
        messages: Annotated[list[Message] | None, Field(min_length=1, max_length=MAX_MESSAGES,
                                                        description="A conversation, through the chat template")] = None,
        add_generation_prompt: Annotated[bool, Field(description="messages: count the assistant header a "
                                                                 "reply would start with")] = True,
        model: ModelName = None,
    ) -> TokenCount:
        """Count the tokens of a text or of a conversation (through the chat template) as the
        model sees them. Give exactly one of text and messages."""
        if (text is None) == (messages is None):
            raise ToolError("text, messages: give exactly one of them")
        engine = await engine_of(model)
        try:
            # No early length check: counting a text longer than the context is a fair question.
            if text is not None:
                ids = await tokenize(engine, 0, "text", engine.encode_text, text, template=False, check_length=False)
            else:
                assert messages is not None  # exactly one of them (checked above)
                ids = await tokenize(engine, 0, "messages", engine.encode_chat, [m.model_dump() for m in messages],
                                     None, add_generation_prompt, check_length=False)
        except APIError as e:
            raise _tool_error(e) from None
        return TokenCount(count=len(ids), context_length=engine.context_length)

    if registry.embedders:
        @mcp.tool(annotations=ANNOTATIONS.model_copy(update={"idempotent_hint": True}))
        async def embed(
            texts: Annotated[list[Annotated[str, Field(max_length=MAX_TEXT_CHARS)]],
                             Field(min_length=1, max_length=2048, description="Texts to embed")],
            model: Annotated[str | None, Field(description="Served embedding model (default: the first)",
                                               max_length=1024)] = None,
        ) -> EmbedResult:
            """Sentence embeddings of texts (unit vectors: cosine similarity is their dot product).
            Texts longer than the model's maximum length are truncated and listed in `truncated`."""
            name = model or registry.embedders[0].name
            try:
                engine = await registry.embedder(name)
            except APIError as e:
                raise _tool_error(APIError(e.status, e.message, param="model")) from None
            result = await engine.aembed_detailed(list(texts), max_tokens=embeddings_api.MAX_TOKENS)
            return EmbedResult(model=name, embeddings=result.embeddings.tolist(), tokens=result.tokens,
                               truncated=result.truncated)

    @mcp.resource(MODELS_URI, name="models", mime_type="application/json",
                  description="The served models: names, context window, engine, whether loaded")
    def models() -> str:
        return json.dumps({"models": [model_card(m, expose_paths) for m in registry.models]}, indent=1)

    return mcp


def model_card(m, expose_paths: bool = False) -> dict[str, Any]:
    """One served model for the resource. Context and engine are known once it was loaded
    (the first model is loaded at startup)."""
    card: dict[str, Any] = {"name": m.name, "aliases": client_names(m.names[1:], expose_paths),
                            "loaded": m.engine is not None,
                            "context_length": m.info.context_length if m.info is not None else None,
                            "capabilities": m.capabilities}
    if m.engine is not None:
        pool = m.engine.kv_pool
        # paged: our block pools and prefix cache; dense: mlx-lm's per-request cache.
        card["engine"] = pool["kind"]
        card["kv_pool"] = {k: v for k, v in pool.items() if k != "kind"}
    else:
        card["engine"] = None
    if m.info is not None:
        card.update(model_type=m.info.model_type, native=m.info.native, quantization=m.info.quantization)
    return card
