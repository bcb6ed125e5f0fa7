"""What clients read about a served model (context window, capabilities), in each dialect.

GET /v1/models is both OpenAI's and Anthropic's path: Anthropic clients send an
`anthropic-version` header, and get Anthropic's shape (type "model", display_name,
created_at, max_input_tokens); everyone else gets OpenAI's list, with the extension
fields local servers add (vLLM's max_model_len, LM Studio / llama-server style
context_length). Ollama's /api/show reads `capabilities` from here too.

Context fields appear once a model has been loaded (the first model is loaded at startup;
another one on its first request): before that its window is not known.
"""

from __future__ import annotations

import os
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlxlocal.engine import ChatFormat

STARTED = int(time.time())


def is_local_path(name: str) -> bool:
    """An absolute (or ~) file path: where the operator keeps models, not for clients."""
    return name.startswith("~") or os.path.isabs(name)


def client_names(names: list[str], expose_paths: bool = False) -> list[str]:
    """The names clients may see: without --expose-paths, none that is a file path (the
    --model value of a model served under --served-model-name stays accepted, not shown)."""
    return list(names) if expose_paths else [n for n in names if not is_local_path(n)]


def capabilities_of(fmt: ChatFormat) -> list[str]:
    """Ollama's capability names: completion always; tools and thinking when the chat
    template has the markers the output parser needs."""
    caps = ["completion"]
    if fmt.has_tool_calling:
        caps.append("tools")
    if fmt.has_thinking:
        caps.append("thinking")
    return caps


def wants_anthropic(request) -> bool:
    return "anthropic-version" in request.headers


def created(m) -> int:
    return int(m.loaded_at) or STARTED


def openai_card(m, model_id: str | None = None) -> dict:
    card = {"id": model_id or m.name, "object": "model", "created": created(m), "owned_by": "mlxlocal"}
    if m.info is not None:
        card.update(context_length=m.info.context_length, max_model_len=m.info.context_length)
    if m.capabilities is not None:
        card["capabilities"] = m.capabilities
    return card


def _supported(flag: bool) -> dict:
    return {"supported": flag}


def anthropic_card(m, model_id: str | None = None) -> dict:
    """Anthropic's ModelInfo. Claude Code reads max_input_tokens from here only for
    api.anthropic.com: against another base URL it assumes its default window, so set
    CLAUDE_CODE_AUTO_COMPACT_WINDOW to the model's context there (README)."""
    model_id = model_id or m.name
    card = {"type": "model", "id": model_id, "display_name": model_id, "lifecycle": "active",
            "created_at": datetime.fromtimestamp(created(m), timezone.utc).isoformat().replace("+00:00", "Z")}
    if m.info is not None:
        # One window for prompt and reply: a reply can use whatever the prompt leaves.
        card.update(max_input_tokens=m.info.context_length, max_tokens=m.info.context_length)
    if m.capabilities is not None:
        thinks = "thinking" in m.capabilities
        no = _supported(False)
        card["capabilities"] = {
            "batch": no, "citations": no, "code_execution": no, "image_input": no, "pdf_input": no,
            "structured_outputs": no,
            "context_management": {"supported": True, "clear_thinking_20251015": _supported(True),
                                   "clear_tool_uses_20250919": no},
            # Only templates that read reasoning_effort (gpt-oss) act on it (anthropic_request.py).
            "effort": {"supported": False, "low": no, "medium": no, "high": no, "max": no},
            "server_tools": {"supported": False, "code_execution": no, "web_search": no},
            "thinking": {"supported": thinks, "types": {
                "adaptive": _supported(thinks), "enabled": _supported(thinks), "disabled": _supported(True),
                "between_tools": no}},
        }
    return card


def anthropic_list(models) -> dict:
    data = [anthropic_card(m) for m in models]
    return {"data": data, "has_more": False, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}
