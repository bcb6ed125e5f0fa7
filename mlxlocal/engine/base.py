"""What every engine offers front ends: prompt encoding and request validation."""

from __future__ import annotations

import array
from functools import cached_property
from typing import Any

import numpy as np

from mlxlocal.engine.constraint import Constraint, GrammarTokenizers
from mlxlocal.engine.think import ThinkBudget, ThinkMarkers, think_markers
from mlxlocal.engine.types import SamplingParams
from mlxlocal.errors import ContextLengthError
from mlxlocal.mlx_thread import WORKER_STREAM  # noqa: F401  (the engines' stream)
from mlxlocal.source.loader import LoadedModel, ModelInfo

# Stands in for an assistant reply's content when rendering a chat: no real message holds it.
REPLY_MARKER = "\x00mlxlocal-reply\x00"


class EngineBase:
    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.chat_format = loaded.chat_format
        self._grammars: GrammarTokenizers | None = None

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
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """`template_kwargs` go to the template as variables (enable_thinking=False: Qwen3's
        switch); a template that does not read a variable ignores it."""
        if self.chat_format.chat_template is None:
            text = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages)
            return self.encode_text(text + ("\nassistant:" if add_generation_prompt else ""))
        ids = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True,
            **(template_kwargs or {}),
        )
        if isinstance(ids, dict):  # transformers 5 may return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def encode_continuation(
        self,
        messages: list[dict[str, Any]],
        new_messages: list[dict[str, Any]],
        tools: list[dict] | None = None,
    ) -> list[int] | None:
        """Token ids the chat template puts after the assistant's reply to `messages`:
        the end-of-turn tokens, then `new_messages`, then the generation prompt.

        A chat that keeps the reply's generated ids appends these instead of re-encoding
        the reply's text (which may tokenize differently), so the KV cache stays a prefix.
        None when that cannot work: no chat template, or one that renders earlier turns
        differently once more follow (Mistral's moves the system prompt to the last user
        turn); the caller then encodes the whole conversation with `encode_chat`.
        """
        if self.chat_format.chat_template is None:
            return None
        seen = self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        reply = {"role": "assistant", "content": REPLY_MARKER}
        full = self.tokenizer.apply_chat_template(
            messages + [reply] + new_messages, tools=tools, add_generation_prompt=True, tokenize=False
        )
        if not isinstance(seen, str) or not isinstance(full, str) or full.count(REPLY_MARKER) != 1:
            return None
        head, _, tail = full.partition(REPLY_MARKER)
        # Only whitespace the template puts before a reply (Mistral's " ") may follow
        # what the model saw; anything else means the earlier turns render differently now.
        if not head.startswith(seen) or head[len(seen):].strip():
            return None
        # Special tokens written in the text (<|im_end|>) still map to their ids; no BOS added.
        return list(self.tokenizer.encode(tail, add_special_tokens=False))

    def encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    @property
    def vocab_size(self) -> int | None:
        """The logits' width (it may exceed the tokenizer's), if the config says."""
        cfg = self.loaded.model_config
        raw = self.loaded.config or {}
        return cfg.vocab_size if cfg is not None else (
            raw.get("vocab_size") or (raw.get("text_config") or {}).get("vocab_size"))

    @property
    def grammars(self) -> GrammarTokenizers:
        if self._grammars is None:
            vocab = self.vocab_size or len(self.tokenizer.vocab)
            self._grammars = GrammarTokenizers(self.chat_format, vocab)
        return self._grammars

    def think_budget(self, params: SamplingParams, prompt: list[int],
                     room: int) -> ThinkBudget | None:
        """The request's thinking budget (None without one); `room`: the context it may fill."""
        if params.think_budget is None:
            return None
        return ThinkBudget.start(self._think_markers, params, prompt, self.decode, room)

    @cached_property
    def _think_markers(self) -> ThinkMarkers | None:
        return think_markers(self.chat_format)

    def constraint(self, params: SamplingParams) -> Constraint | None:
        """The request's grammar matcher (None without a grammar); compiling it here, on the
        caller's thread, makes a grammar the tokenizer cannot take a ValueError at submit."""
        return self.grammars.compile(params.grammar) if params.grammar is not None else None

    def validate(self, prompt: list[int], params: SamplingParams, length: int | None = None) -> None:
        """Raise before anything is queued: bad parameters, empty or over-long prompt
        (`length`: the tokens it keeps in context, when cache edits drop some)."""
        self.checked_ids(prompt, params, length)

    def checked_ids(self, prompt: list[int], params: SamplingParams,
                    length: int | None = None) -> np.ndarray | None:
        """validate(), and the prompt as the int64s its ids were checked as (None where the
        vocabulary is not known): the paged engine's disk tier hashes their bytes."""
        ids = None
        params.validate()
        if not prompt:
            raise ValueError("the prompt is empty")
        # The checks against the vocabulary: the logits' width, which may exceed the tokenizer's.
        vocab = self.vocab_size
        if vocab:
            if params.top_k > vocab:
                raise ValueError(f"top_k must be at most the vocabulary size ({vocab}), got {params.top_k}")
            bad = [t for t in params.logit_bias or () if t >= vocab]
            if bad:
                raise ValueError(f"logit_bias token ids must be below the vocabulary size ({vocab}), got {bad[0]}")
            try:  # as int64s: the bounds of 16k ids in 0.25 ms, not 0.45 by min() and max()
                ids = np.frombuffer(array.array("q", prompt), np.int64)
            except (TypeError, OverflowError) as e:
                raise ValueError(f"prompt token ids must be integers in [0, {vocab}): {e}") from None
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= vocab:
                raise ValueError(f"prompt token ids must be in [0, {vocab}), got {lo if lo < 0 else hi}")
        length = len(prompt) if length is None else length
        if length >= self.context_length:
            # At least one position must stay free for the first generated token.
            raise ContextLengthError(length, self.context_length)
        return ids
