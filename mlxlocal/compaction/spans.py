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
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from mlxlocal.compaction.plan import PlanError, Span, think_span


def _render(engine, messages: list[dict], tools: list[dict] | None, kwargs: dict,
            generation_prompt: bool) -> tuple[str, bool]:
    """The prompt text encode_chat tokenizes, and whether it adds special tokens (BOS) when
    tokenizing it (only the no-template fallback does: templates write their own)."""
    tok = engine.tokenizer
    if getattr(tok, "chat_template", None) is None:  # EngineBase.encode_chat's fallback
        text = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages)
        return text + ("\nassistant:" if generation_prompt else ""), True
    if not messages:
        return "", False
    text = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                   tokenize=False, **kwargs)
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
    hf = getattr(engine.tokenizer, "_tokenizer", engine.tokenizer)
    if not getattr(hf, "is_fast", False):
        return None
    enc = hf(full, add_special_tokens=special, return_offsets_mapping=True)
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
    hf = getattr(engine.tokenizer, "_tokenizer", engine.tokenizer)
    out = [0]
    for c in chars[1:-1]:
        part = list(hf.encode(full[:c], add_special_tokens=special))
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
    tok = engine.tokenizer
    if not getattr(tok, "has_thinking", False):
        return {}
    start = [int(t) for t in getattr(tok, "think_start_tokens", None) or ()]
    end = [int(t) for t in getattr(tok, "think_end_tokens", None) or ()]
    out = {}
    for i, m in enumerate(messages):
        if m.get("role") == "assistant":
            found = think_span(ids, spans[i], start, end)
            if found is not None:
                out[i] = found
    return out
