"""Embeddings over HTTP: OpenAI's POST /v1/embeddings, Ollama's POST /api/embed and its legacy
POST /api/embeddings. The models are the registry's embedding models (--embed-model, or a
--model that is a BERT-family encoder); a text-generation model asked for embeddings is a
400 naming it.

Over-long inputs are truncated as sentence-transformers truncates them (OpenAI's dialect has
no switch for it; Ollama's `truncate: false` makes them a 400), and never silently: usage /
prompt_eval_count count the tokens the model read, and OpenAI responses name the truncated
inputs in `truncated_inputs` (an extra field clients ignore).
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from typing import Any

from fastapi import APIRouter, Request

from mlxlocal.errors import (
    EmbeddingBusyError,
    EmbeddingCancelled,
    InputTooLongError,
    TokenBudgetError,
)
from mlxlocal.server.errors import RETRY_AFTER, APIError, read_json_object

router = APIRouter()

# OpenAI's own limits per request: inputs, and tokens in all (here counted after truncation,
# what the model reads); together they bound one request's work.
MAX_INPUTS = 2048
MAX_TOKENS = 300_000


def _openai_inputs(value: Any) -> list[str] | list[list[int]]:
    """`input`: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise APIError(400, "input must be a string, a non-empty list of strings, or token ids", param="input")
    if len(value) > MAX_INPUTS:
        raise APIError(400, f"input has {len(value)} items; at most {MAX_INPUTS} per request", param="input")
    if all(isinstance(x, str) for x in value):
        return list(value)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in value):
        return [list(value)]
    if all(isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
           for x in value):
        return [list(x) for x in value]
    raise APIError(400, "input must be a string, a list of strings, a list of token ids or a list of "
                   "non-empty lists of token ids (not a mix)", param="input")


async def _watch(request: Request, cancel: threading.Event) -> None:
    """A client that hangs up stops its request at the next batch (see generation._watch)."""
    while not cancel.is_set():
        await asyncio.sleep(0.1)
        if await request.is_disconnected():
            cancel.set()


async def _embed(request: Request, engine, inputs, truncate: bool, where: str):
    cancel = threading.Event()
    watcher = asyncio.create_task(_watch(request, cancel))
    try:
        return await engine.aembed_detailed(inputs, normalize=True, truncate=truncate, max_tokens=MAX_TOKENS,
                                            cancel=cancel)
    except InputTooLongError as e:
        raise APIError(400, str(e), param=where) from None
    except TokenBudgetError as e:
        raise APIError(400, f"{where}: {e}", param=where, code="request_too_large") from None
    except ValueError as e:  # a token id outside the vocabulary
        raise APIError(400, str(e), param=where) from None
    except EmbeddingBusyError as e:
        raise APIError(429, f"server busy: {e}; retry later", headers={"Retry-After": RETRY_AFTER}) from None
    except EmbeddingCancelled as e:  # the client is gone (nobody reads this) or the server stops
        raise APIError(503, f"embedding stopped: {e}", headers={"Retry-After": RETRY_AFTER}) from None
    finally:
        watcher.cancel()


@router.post("/v1/embeddings")
async def openai_embeddings(request: Request):
    body = await read_json_object(request)
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError(400, "'model' is required", param="model")
    engine = await request.app.state.registry.embedder(model)
    inputs = _openai_inputs(body.get("input"))
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise APIError(400, f"encoding_format must be 'float' or 'base64', got {fmt!r}", param="encoding_format")
    dims = body.get("dimensions")
    if dims is not None:
        if not isinstance(dims, int) or isinstance(dims, bool) or dims < 1:
            raise APIError(400, "dimensions must be a positive integer", param="dimensions")
        if dims != engine.info.dim:
            # Shortening (Matryoshka) is only meaningful for models trained for it; ours are not.
            raise APIError(400, f"model '{model}' produces {engine.info.dim}-dimensional embeddings and "
                           f"cannot shorten them to {dims}", param="dimensions")
    result = await _embed(request, engine, inputs, True, "input")
    data = []
    for i, row in enumerate(result.embeddings):
        vector: Any = (base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") if fmt == "base64"
                       else [float(x) for x in row])
        data.append({"object": "embedding", "index": i, "embedding": vector})
    out: dict[str, Any] = {"object": "list", "data": data, "model": model,
                           "usage": {"prompt_tokens": result.total_tokens, "total_tokens": result.total_tokens}}
    if result.truncated:
        out["truncated_inputs"] = [{"index": i, "tokens": result.original_tokens[i], "used": result.tokens[i]}
                                   for i in result.truncated]
    return out


def _ollama_inputs(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
        if len(value) > MAX_INPUTS:
            raise APIError(400, f"input has {len(value)} items; at most {MAX_INPUTS} per request", param="input")
        return list(value)
    raise APIError(400, "input must be a string or a non-empty list of strings", param="input")


@router.post("/api/embed")
async def ollama_embed(request: Request):
    t0 = time.perf_counter_ns()
    body = await read_json_object(request)
    registry = request.app.state.registry
    model = body.get("model")
    loaded_before = registry.find_embedder(model).engine is not None
    engine = await registry.embedder(model)
    load_ns = 0 if loaded_before else time.perf_counter_ns() - t0
    inputs = _ollama_inputs(body.get("input"))
    truncate = body.get("truncate", True)
    if not isinstance(truncate, bool):
        raise APIError(400, "truncate must be true or false", param="truncate")
    dims = body.get("dimensions")
    if dims is not None and dims != engine.info.dim:
        raise APIError(400, f"model '{model}' produces {engine.info.dim}-dimensional embeddings and cannot "
                       f"shorten them to {dims}", param="dimensions")
    result = await _embed(request, engine, inputs, truncate, "input")
    return {"model": model, "embeddings": result.embeddings.tolist(),
            "total_duration": time.perf_counter_ns() - t0, "load_duration": load_ns,
            "prompt_eval_count": result.total_tokens}


@router.post("/api/embeddings")
async def ollama_embeddings_legacy(request: Request):
    """Ollama's older endpoint: one `prompt`, one `embedding` (truncated if too long)."""
    body = await read_json_object(request)
    engine = await request.app.state.registry.embedder(body.get("model"))
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise APIError(400, "prompt must be a string", param="prompt")
    result = await _embed(request, engine, [prompt], True, "prompt")
    return {"embedding": [float(x) for x in result.embeddings[0]]}
