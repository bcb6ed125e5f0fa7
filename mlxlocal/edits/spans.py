"""Where each message's tokens are in a chat prompt: the spans plan.to_edits needs.

`message_spans` returns the prompt ids exactly as `engine.encode_chat` makes them (what
the server submits) and one span per message, tiling them: message i runs from where the
template's render of messages[:i] ends to where the render of messages[:i + 1] ends (the
last one to the end of the prompt, generation prompt included), so the template's glue
before a message (its role header) belongs to it and the glue after the last message's
content belongs to the next one.

How: the template renders each prefix as text (Jinja, cheap next to tokenizing), and the
full prompt is tokenized once with the fast tokenizer's character offsets; a boundary
in characters maps to the tokens that start before it. 42 messages with 20 tool outputs
of ~1 KB each (15k tokens) take ~0.07 s this way on the CPU (tests/test_akv_spans.py),
where tokenizing every prefix instead takes ~0.25 s, growing with the square of the length. Without offsets (a slow tokenizer, or offsets
that do not reproduce encode_chat's ids) each boundary's text prefix is tokenized instead.

A prefix's render may end differently from the same place in the full prompt when more
messages follow: ChatML templates close a tool-response turn only after the last of
several consecutive tool messages. Such a boundary is where the two texts part, which
only moves template glue to the next message. What is refused (PlanError): a message whose
own content is not inside its span in the full prompt, i.e. the template renders it
differently once later messages follow (Qwen3's drops the think block of turns before
the last user message): its tokens cannot be named by the request's message index.

`ConversationSpans` is the same for a conversation kept as token ids (the chat REPL, the
agent tool loop, `bench akv`): each prompt is the ids the model saw and
produced plus the template's continuation (`encode_continuation`), so a reply's generated
ids are never re-encoded; it records the spans as messages are added (the boundaries in the
continuation's text, mapped to its tokens by decoding), the reply's span from its
generation prompt on, each reply's think block, and gives a policy's cumulative edits for
each prompt. Without an active policy nothing is rendered twice: the prompts are exactly
what the front ends built before.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mlxlocal.edits.plan import PlanError, Span, think_span, to_edits
from mlxlocal.edits.policy import CompactionPolicy
from mlxlocal.engine import REPLY_MARKER, CacheEdit


def _render(engine, messages: list[dict], tools: list[dict] | None, kwargs: dict,
            generation_prompt: bool) -> tuple[str, bool]:
    """The prompt text encode_chat tokenizes, and whether it adds special tokens (BOS) when
    tokenizing it (only the no-template fallback does: templates write their own)."""
    fmt = engine.chat_format
    if fmt.chat_template is None:  # EngineBase.encode_chat's fallback
        text = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages)
        return text + ("\nassistant:" if generation_prompt else ""), True
    if not messages:
        return "", False
    text = fmt.render(messages, tools, generation_prompt, **kwargs)
    return text, False


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _own_texts(message: dict, reasoning: bool = True) -> list[str]:
    """The text a message brings to the prompt (not the template's): content, reasoning
    (unless not asked: templates leave out older turns' reasoning), called tools' names."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    texts = [content, message.get("reasoning_content") if reasoning else None]
    texts += [(c.get("function") or {}).get("name") for c in message.get("tool_calls") or () if isinstance(c, dict)]
    return [t.strip() for t in texts if isinstance(t, str) and t.strip()]


def _changed(i: int) -> PlanError:
    error = PlanError("messages", f"the chat template renders message {i} differently once later messages "
                                  "follow, so its tokens cannot be dropped or repositioned by index")
    error.message = i  # a front end whose indices differ names the message its own way
    return error


def _char_bounds(engine, messages: list[dict], tools, kwargs: dict, full: str) -> list[int]:
    """Character boundaries 0 = b0 <= b1 <= ... <= bn = len(full) between the messages."""
    bounds = [0]
    for i in range(1, len(messages)):
        part, _ = _render(engine, messages[:i], tools, kwargs, False)
        cut = _common_prefix(part, full)
        # Where the prefix's render parts from the full prompt, only template glue may
        # follow (a turn closed early); the last message's own text there means the
        # template renders it differently once more messages follow.
        # (Texts of a few characters could be glue's too: "end" is in "<|im_end|>".)
        tail = part[cut:]
        if any(len(t) > 3 and t in tail for t in _own_texts(messages[i - 1])):
            raise _changed(i - 1)
        bounds.append(max(bounds[-1], cut))
    bounds.append(len(full))
    for i, m in enumerate(messages):
        # A template may trim a message's edges (Qwen3's strips reasoning's newlines); its
        # text must still be there, whole, inside its own span.
        span = full[bounds[i]:bounds[i + 1]]
        if any(t not in span for t in _own_texts(m, reasoning=False)):
            raise _changed(i)
    return bounds


def _token_bounds_by_offsets(engine, full: str, special: bool, ids: list[int], chars: list[int]) -> list[int] | None:
    fmt = engine.chat_format
    if not fmt.is_fast or fmt.hf is None:
        return None
    enc = fmt.hf(full, add_special_tokens=special, return_offsets_mapping=True)
    if list(enc["input_ids"]) != ids:
        return None
    # Message boundary c -> the tokens that start before it. A token that straddles c (BPE
    # merged glue across it) so goes with the message before: only glue moves, never text.
    starts, top = [], 0
    for start, _ in enc["offset_mapping"]:
        top = max(top, start)
        starts.append(top)
    return [bisect_left(starts, c) for c in chars]


def _token_bounds_by_prefix(engine, full: str, special: bool, ids: list[int], chars: list[int]) -> list[int]:
    out = [0]
    for c in chars[1:-1]:
        part = engine.chat_format.encode(full[:c], add_special_tokens=special)
        k = next((j for j in range(min(len(part), len(ids))) if part[j] != ids[j]), min(len(part), len(ids)))
        out.append(max(out[-1], k))
    return out + [len(ids)]


def message_spans(engine, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], list[Span]]:
    """(prompt ids as encode_chat makes them, one [start, end) token span per message)."""
    kwargs = template_kwargs or {}
    ids = engine.encode_chat(messages, tools, add_generation_prompt=True, template_kwargs=template_kwargs)
    full, special = _render(engine, messages, tools, kwargs, True)
    chars = _char_bounds(engine, messages, tools, kwargs, full)
    bounds = _token_bounds_by_offsets(engine, full, special, ids, chars)
    if bounds is None:
        bounds = _token_bounds_by_prefix(engine, full, special, ids, chars)
    bounds = [min(max(b, 0), len(ids)) for b in bounds]
    for k in range(1, len(bounds)):
        bounds[k] = max(bounds[k], bounds[k - 1])
    return ids, [(bounds[i], bounds[i + 1]) for i in range(len(messages))]


def think_spans(engine, ids: list[int], messages: list[dict], spans: list[Span]) -> dict[int, Span]:
    """The think block (markers included) of each assistant message that shows one, by the
    model family's think markers (the tokenizer's, as grammar/parse.py reads them)."""
    start, end = _marker_ids(engine)
    out = {}
    for i, m in enumerate(messages):
        found = think_span(ids, spans[i], start, end) if m.get("role") == "assistant" else None
        if found is not None:
            out[i] = found
    return out


def _marker_ids(engine: Any) -> tuple[list[int], list[int]]:
    """The think markers as token ids (empty without thinking: think_span then finds none)."""
    fmt = engine.chat_format
    if not fmt.has_thinking:
        return [], []
    start, end = list(fmt.think_start_tokens), list(fmt.think_end_tokens)
    if not start and fmt.think_start and fmt.think_end:
        start, end = fmt.encode(fmt.think_start), fmt.encode(fmt.think_end)
    return start, end


# --- conversations kept as token ids --------------------------------------------------
Messages = list[dict[str, Any]]


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
        found = think_span(ids, span, *_marker_ids(engine))
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
            full = _template_text(engine, before + [reply] + new, tools, True)
            start = full.index(REPLY_MARKER) + len(REPLY_MARKER)
            chars = [_common_prefix(_template_text(engine, before + [reply] + new[:k], tools, False), full) - start
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
            full = _template_text(engine, conv, tools, True)
            chars = [_common_prefix(_template_text(engine, conv[:i + 1], tools, False), full)
                     for i in range(len(conv))]
        except SpanError as e:
            self.note = f"message spans unknown: {e}"
            return
        if not _verified(full, list(zip([0] + chars[:-1], chars)), conv, self):
            return
        bounds = token_bounds(_decoder(engine), ids, chars)
        starts = [0] + bounds[:-1]
        spans = list(zip(starts, bounds))
        self._pending = _Layout(spans, think_spans(engine, ids, conv, spans), bounds[-1] if bounds else 0)


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


def _template_text(engine: Any, messages: Messages, tools: list[dict] | None, generation: bool) -> str:
    fmt = engine.chat_format
    if fmt.chat_template is None:
        raise SpanError("the tokenizer has no chat template")
    try:
        text = fmt.render(messages, tools, generation)
    except Exception as e:  # a template that refuses a prefix of the conversation
        raise SpanError(f"the chat template cannot render the conversation message by message ({e})") from None
    if not isinstance(text, str):
        raise SpanError("the chat template did not render text")
    return text


def _decoder(engine: Any) -> Callable[[list[int]], str]:
    return engine.chat_format.decode_verbatim
