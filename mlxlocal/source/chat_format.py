"""What a model's tokenizer says about its chat format, read once when the model loads.

mlx-lm's TokenizerWrapper infers tool-call and think markers from the chat template and
passes every other attribute through to the Hugging Face tokenizer; which attributes exist
depends on the tokenizer. Every probe of them happens here, in `chat_format_of`: front ends
read the typed fields of the ChatFormat the loaded model (and its engine) carries.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers is slow to import; these are annotations only
    import tokenizers
    from transformers import PreTrainedTokenizerBase


# eq=False: two formats are the same only when they are one object, so a format can key a
# cache (its hash is its identity; the fields hold a dict and callables).
@dataclass(frozen=True, eq=False)
class ChatFormat:
    """The chat template, tool-call and think markers, special tokens and capabilities of
    one tokenizer. The defaults are what a tokenizer without the attribute means."""

    # The Hugging Face chat template (a dict of named templates for some older tokenizers),
    # None without one: encode_chat then writes "role: content" lines.
    chat_template: str | dict[str, str] | None = field(default=None, repr=False)
    # Tool calls between these markers, read back by mlx-lm's parser for the family.
    has_tool_calling: bool = False
    tool_call_start: str | None = None
    tool_call_end: str | None = None
    tool_parser: Callable[..., Any] | None = None
    # Reasoning between these markers (as text and as the token ids they encode to).
    has_thinking: bool = False
    think_start: str | None = None
    think_end: str | None = None
    think_start_tokens: tuple[int, ...] = ()
    think_end_tokens: tuple[int, ...] = ()
    eos_token_id: int | None = None  # the turn's own end token
    eos_token_ids: frozenset[int] = frozenset()  # every id that ends a reply
    # Ids the tokenizer knows, added tokens included (the logits may be wider).
    vocab_size: int = 0
    added_token_ids: frozenset[int] = frozenset()  # added tokens (special or not)
    # The Hugging Face tokenizer (llguidance reads it; a fast one gives character offsets).
    hf: PreTrainedTokenizerBase | None = field(default=None, repr=False)
    is_fast: bool = False
    backend: tokenizers.Tokenizer | None = field(default=None, repr=False)  # its Rust tokenizer
    # What encodes, decodes and renders: mlx-lm's wrapper (it maps enable_thinking to the
    # template's own switch), or the HF tokenizer itself.
    tokenizer: Any = field(default=None, repr=False)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def decode_verbatim(self, ids: list[int]) -> str:
        """Special tokens as text, spaces untouched: the template's text, character for
        character (a tokenizer without those switches decodes as usual)."""
        try:
            return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except TypeError:
            return self.decode(ids)

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, **template_kwargs: Any) -> Any:
        """The chat template applied to `messages` as text (whatever the template returns)."""
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False,
            **template_kwargs)


def opens_think(start: str | None, decode: Callable[[list[int]], str], ids: list[int]) -> bool:
    """Whether `ids` (a prompt) end with the think block's opening marker `start`, whitespace
    after it allowed: generation then begins inside the block. Only the very end counts."""
    return start is not None and start != "" and decode(ids[-8:]).rstrip().endswith(start)


def chat_format_of(tokenizer: Any) -> ChatFormat:
    """The ChatFormat of mlx-lm's TokenizerWrapper (or a bare Hugging Face tokenizer)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # the wrapper holds the HF one
    return ChatFormat(
        chat_template=getattr(tokenizer, "chat_template", None),
        has_tool_calling=bool(getattr(tokenizer, "has_tool_calling", False)),
        tool_call_start=getattr(tokenizer, "tool_call_start", None),
        tool_call_end=getattr(tokenizer, "tool_call_end", None),
        tool_parser=getattr(tokenizer, "tool_parser", None),
        has_thinking=bool(getattr(tokenizer, "has_thinking", False)),
        think_start=getattr(tokenizer, "think_start", None),
        think_end=getattr(tokenizer, "think_end", None),
        think_start_tokens=_ids(getattr(tokenizer, "think_start_tokens", None)),
        think_end_tokens=_ids(getattr(tokenizer, "think_end_tokens", None)),
        eos_token_id=getattr(tokenizer, "eos_token_id", None),
        eos_token_ids=frozenset(int(t) for t in getattr(tokenizer, "eos_token_ids", None) or ()),
        vocab_size=len(hf),
        added_token_ids=frozenset(
            int(i) for i in getattr(tokenizer, "added_tokens_decoder", None) or {}),
        hf=hf,
        is_fast=bool(getattr(hf, "is_fast", False)),
        backend=getattr(hf, "backend_tokenizer", None),
        tokenizer=tokenizer,
    )


def _ids(tokens: Any) -> tuple[int, ...]:
    return tuple(int(t) for t in tokens or ())
