"""Where each message's tokens are in a conversation kept as token ids (AKV cache edits).

The chat REPL, the agent tool loop and `bench --scenario agent --akv` keep a conversation
as the ids the model saw and produced, and build each prompt as those ids plus the chat
template's continuation (`encode_continuation`), or, when that cannot work, the whole
conversation encoded. `ConversationSpans` builds those prompts and records, as it goes,
which tokens belong to which message (template glue included: the spans tile the prompt;
the generation prompt at the end belongs to the reply that follows it) and where each
reply's think block is. With a compaction policy, `edits(conversation)` then turns the
policy's plan into the engine's `CacheEdit`s for the prompt just built.

Boundaries are found in the template's text (where the rendering of the first k messages
stops agreeing with the rendering of all of them) and mapped to tokens by decoding
prefixes of the ids, so a reply's generated ids are never re-encoded. Without an active
policy nothing is rendered twice: the prompts are exactly what the front ends built before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxlocal.compaction.plan import Span, think_span, to_edits
from mlxlocal.compaction.policy import CompactionPolicy
from mlxlocal.engine.base import REPLY_MARKER
from mlxlocal.engine.types import CacheEdit

Messages = list[dict[str, Any]]


def computed_tokens(prompt_tokens: int, cached_tokens: int, dropped_before: int) -> int:
    """Prompt tokens a request computed (prefilled). With cache edits a request's
    `cached_tokens` counts the cache slots it reused, and the tokens its session had dropped
    before (`session.dropped_len` at submit) were neither reused nor computed; a session that
    started over (nothing reused) computed the whole prompt."""
    return prompt_tokens - cached_tokens - (dropped_before if cached_tokens else 0)


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix (slice comparisons: long texts stay cheap)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def token_bounds(decode: Callable[[list[int]], str], ids: list[int], chars: list[int]) -> list[int]:
    """For each character offset (ascending) into the text `ids` decode to, the number of
    tokens whose text reaches it: a token straddling a boundary goes to the earlier side.

    Searched from the previous boundary (galloping, then bisecting), decoding only the ids
    after it, so a long conversation costs about its length, not its length per boundary."""
    out, lo, base = [], 0, 0  # base: characters of the text up to token lo
    for c in chars:
        def reaches(n: int, lo: int = lo, base: int = base, c: int = c) -> bool:
            return base + len(decode(ids[lo:n])) >= c

        if c <= base:
            out.append(lo)
            continue
        step, a = 64, lo
        b = min(lo + step, len(ids))
        while b < len(ids) and not reaches(b):
            a, step = b, step * 2
            b = min(lo + step, len(ids))
        while a < b:
            mid = (a + b) // 2
            if reaches(mid):
                b = mid
            else:
                a = mid + 1
        base += len(decode(ids[lo:a]))
        lo = a
        out.append(a)
    return out


@dataclass
class _Layout:
    spans: list[Span] = field(default_factory=list)  # one per message, tiling [0, end)
    thinks: dict[int, Span] = field(default_factory=dict)
    end: int = 0  # ids covered: a prompt's generation prompt starts here


class SpanError(ValueError):
    """The template cannot be rendered message by message: no edits for this prompt."""


class ConversationSpans:
    """Prompt building plus message spans for one conversation kept as token ids.

    `prompt()` before each generation, `edits()` for that prompt, `replied()` once the
    reply (message `len(conversation)`) is kept; a prompt that got no reply (refused,
    cancelled before its first token) is simply forgotten at the next `prompt()`.
    """

    def __init__(self, policy: CompactionPolicy | None = None):
        self.policy = policy or CompactionPolicy()
        self._kept = _Layout()  # up to the last reply kept
        self._pending: _Layout | None = None  # the last prompt's messages (header from .end)
        self._prompt_len = 0
        self.note = ""  # why the last prompt got no edits although the policy is active

    @property
    def active(self) -> bool:
        return self.policy.active

    def reset(self) -> None:
        self._kept, self._pending, self._prompt_len, self.note = _Layout(), None, 0, ""

    # prompts ---------------------------------------------------------------------------
    def prompt(self, engine: Any, conversation: Messages, kept: list[int], reply_at: int | None,
               tools: list[dict] | None = None) -> list[int]:
        """The next prompt: `kept` (the ids of conversation[:reply_at + 1], ending with the
        reply conversation[reply_at]) plus the template's continuation with the messages
        after it; the whole conversation encoded when there is no reply to continue from
        (reply_at None), the template cannot continue, or (with a policy) the kept ids are
        not the ones recorded here."""
        self._pending, self.note = None, ""
        known = (len(self._kept.spans) == (reply_at or 0) + 1 and self._kept.end == len(kept))
        if reply_at is not None and kept and (known or not self.active):
            cont = engine.encode_continuation(conversation[:reply_at], conversation[reply_at + 1:], tools=tools)
            if cont is not None:
                if self.active:
                    self._spans_after(engine, conversation, reply_at, cont, tools, len(kept))
                self._prompt_len = len(kept) + len(cont)
                return kept + cont
        ids = engine.encode_chat(conversation, tools=tools)
        if self.active:
            self._spans_whole(engine, conversation, ids, tools)
        self._prompt_len = len(ids)
        return ids

    def edits(self, conversation: Messages) -> list[CacheEdit] | None:
        """The policy's cumulative CacheEdits for the last prompt (whose messages are
        `conversation`); None without a policy (send no edits at all)."""
        if not self.active:
            return None
        if self._pending is None or len(self._pending.spans) != len(conversation):
            self.note = self.note or "message spans unknown for this prompt: nothing dropped"
            return []
        spans = list(self._pending.spans)
        if spans:  # the generation prompt ends the last message's span (the spans tile the prompt)
            spans[-1] = (spans[-1][0], self._prompt_len)
        return to_edits(self.policy.plan(conversation), spans, self._pending.thinks)

    def replied(self, engine: Any, prompt: list[int], generated: list[int]) -> None:
        """The reply to the last prompt is kept (as message len(conversation)): its span is
        the generation prompt plus the generated ids."""
        if not self.active:
            return
        if self._pending is None:
            self._kept = _Layout()  # unknown layout: the next prompt re-encodes
            return
        layout = self._pending
        self._pending = None
        ids = prompt + generated
        span = (layout.end, len(ids))
        layout.spans.append(span)
        found = _think(engine, ids, span)
        if found is not None:
            layout.thinks[len(layout.spans) - 1] = found
        layout.end = len(ids)
        self._kept = layout

    def spans(self) -> list[Span]:
        """The kept messages' spans (for tests and /stats)."""
        return list(self._kept.spans)

    def thinks(self) -> dict[int, Span]:
        return dict(self._kept.thinks)

    # boundaries ------------------------------------------------------------------------
    def _spans_after(self, engine: Any, conv: Messages, reply_at: int, cont: list[int],
                     tools: list[dict] | None, kept_len: int) -> None:
        before, new = conv[:reply_at], conv[reply_at + 1:]
        reply = {"role": "assistant", "content": REPLY_MARKER}
        try:
            full = _render(engine, before + [reply] + new, tools, True)
            start = full.index(REPLY_MARKER) + len(REPLY_MARKER)
            chars = [common_prefix_len(_render(engine, before + [reply] + new[:k], tools, False), full) - start
                     for k in range(len(new) + 1)]
        except (SpanError, ValueError) as e:
            self.note = f"message spans unknown: {e}"
            return
        tail = full[start:]
        if not _verified(tail, list(zip(chars, chars[1:])), new, self):
            return
        bounds = [kept_len + b for b in token_bounds(_decoder(engine), cont, chars)]
        layout = _Layout(list(self._kept.spans), dict(self._kept.thinks))
        a, b = layout.spans[-1]
        layout.spans[-1] = (a, bounds[0])  # the reply's end-of-turn glue
        layout.spans += list(zip(bounds, bounds[1:]))
        layout.end = bounds[-1]
        self._pending = layout

    def _spans_whole(self, engine: Any, conv: Messages, ids: list[int], tools: list[dict] | None) -> None:
        try:
            full = _render(engine, conv, tools, True)
            chars = [common_prefix_len(_render(engine, conv[:i + 1], tools, False), full)
                     for i in range(len(conv))]
        except SpanError as e:
            self.note = f"message spans unknown: {e}"
            return
        if not _verified(full, list(zip([0] + chars[:-1], chars)), conv, self):
            return
        bounds = token_bounds(_decoder(engine), ids, chars)
        starts = [0] + bounds[:-1]
        layout = _Layout(list(zip(starts, bounds)), {}, bounds[-1] if bounds else 0)
        for i, m in enumerate(conv):
            found = _think(engine, ids, layout.spans[i]) if m.get("role") == "assistant" else None
            if found is not None:
                layout.thinks[i] = found
        self._pending = layout


def _verified(text: str, spans: list[Span], messages: Messages, owner: ConversationSpans) -> bool:
    """Every user / tool / system message's text inside its own span: a template that
    renders a message elsewhere once more follow (Mistral moves the system prompt into the
    last user turn) gives spans that would drop the wrong tokens, so none are used."""
    for i, (m, (a, b)) in enumerate(zip(messages, spans)):
        content = m.get("content")
        if m.get("role") == "assistant" or not isinstance(content, str) or not content.strip():
            continue
        if content.strip() not in text[a:b]:
            owner.note = (f"message spans unknown: the chat template does not render message {i} "
                          f"({m.get('role')}) in its place; nothing is dropped")
            return False
    return True


def _render(engine: Any, messages: Messages, tools: list[dict] | None, generation: bool) -> str:
    tok = engine.tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise SpanError("the tokenizer has no chat template")
    try:
        text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation, tokenize=False)
    except Exception as e:  # a template that refuses a prefix of the conversation
        raise SpanError(f"the chat template cannot render the conversation message by message ({e})") from None
    if not isinstance(text, str):
        raise SpanError("the chat template did not render text")
    return text


def _decoder(engine: Any) -> Callable[[list[int]], str]:
    tok = engine.tokenizer

    def decode(ids: list[int]) -> str:
        try:  # special tokens as text, spaces untouched: the template's text, character for character
            return tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except TypeError:
            return engine.decode(ids)

    return decode


def _marker_ids(engine: Any) -> tuple[list[int], list[int]]:
    tok = engine.tokenizer
    start = getattr(tok, "think_start", None) if getattr(tok, "has_thinking", False) else None
    end = getattr(tok, "think_end", None) if start else None
    if not start or not end:
        return [], []
    return list(tok.encode(start, add_special_tokens=False)), list(tok.encode(end, add_special_tokens=False))


def _think(engine: Any, ids: list[int], span: Span) -> Span | None:
    open_ids, close_ids = _marker_ids(engine)
    return think_span(ids, span, open_ids, close_ids)
