"""What every engine offers front ends: prompt encoding and request validation."""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxlocal.engine.types import SamplingParams
from mlxlocal.errors import ContextLengthError
from mlxlocal.loader import LoadedModel, ModelInfo

# A stream per worker thread (MLX streams belong to the thread that made them); a thread
# using it calls mx.clear_streams() before it ends, or the process aborts at exit.
WORKER_STREAM = mx.new_thread_local_stream(mx.default_device())


class EngineBase:
    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer

    @property
    def info(self) -> ModelInfo:
        return self.loaded.info

    @property
    def context_length(self) -> int:
        return self.loaded.info.context_length

    # --- prompts -------------------------------------------------------------------
    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            text = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages)
            return self.encode_text(text + ("\nassistant:" if add_generation_prompt else ""))
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
        )
        if isinstance(ids, dict):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise before anything is queued: bad parameters, empty or over-long prompt."""
        params.validate()
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= self.context_length:
            # At least one position must stay free for the first generated token.
            raise ContextLengthError(len(prompt), self.context_length)
