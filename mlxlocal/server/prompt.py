"""A request's prompt: its tokens (template, tokenization on a worker thread, refused early
when it cannot fit) and what it asks of the KV cache (its session, its cache edits).

Cache edits on the chat routes (AKV's fields, docs/akv.md for the client's view): the
routers only say which body holds the fields and how their own list maps onto the chat
messages (`Origins`).

- A session is named by the `X-Session-Id` header or the body field `session_id` (the
  same value if both). Its KV stays pinned in the engine between turns (registry.Sessions:
  per model, LRU-capped by --max-sessions, expired after --session-idle).
- `drop_message` {"<trigger index>": [indices]}, `reposition` [indices], `drop_rule`
  ("message_drop" | "thinking_drop") need a session. Indices are those of the request's
  own list (OpenAI / Anthropic `messages`, Responses `input`), mapped onto the chat
  messages; plan.to_edits turns the plan into CacheEdits over spans.message_spans.
- A session request without those fields gets the server's --kv-compact policy, if set.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from mlxlocal.edits import DropPlan, PlanError, parse_drop_message, parse_reposition, to_edits
from mlxlocal.edits.spans import message_spans, think_spans
from mlxlocal.engine import CacheEdit, ChatFormat
from mlxlocal.server import lanes
from mlxlocal.server.errors import APIError

log = logging.getLogger("mlxlocal.server")

SESSION_HEADER = "X-Session-Id"
SESSION_FIELD = "session_id"
DROP_FIELDS = ("drop_message", "reposition", "drop_rule")
DROP_RULES = ("message_drop", "thinking_drop")
MAX_SESSION_ID = 256
# Text one tokenization takes at most (max_text_bytes): 2 MiB is ~500k tokens, more than
# any context it is checked against; a 1.3 MB prompt briefly takes ~150 MB to tokenize.
MAX_TEXT_BYTES = 2 << 20
T = TypeVar("T")  # what a tokenize call's encoder returns


@dataclass
class Origins:
    """Which entries of the request's own list each chat message holds, by the message
    object's identity (a tool_choice hint inserted later shifts positions, not objects)."""

    size: int = 0  # entries in the request's list
    owners: dict[int, set[int]] = field(default_factory=dict)  # id(message) -> request indices
    sealed: set[int] = field(default_factory=set)  # id(message): also holds text without an index

    def add(self, message: dict, index: int) -> None:
        self.owners.setdefault(id(message), set()).add(index)

    def seal(self, message: dict) -> None:
        self.sealed.add(id(message))


@dataclass
class CacheRequest:
    """What a chat request asks of the KV cache: its session and its drop fields (raw)."""

    list_name: str  # the request's list the indices refer to: "messages" or "input"
    session_id: str | None = None
    drop_message: Any = None
    reposition: Any = None
    drop_rule: str = "message_drop"

    @property
    def explicit(self) -> bool:
        return self.drop_message is not None or self.reposition is not None


@dataclass
class CacheUse:
    """What generation.stream needs: the served model's name (its sessions), the session id,
    the prompt's edits, and the request field they came from (named in the engine's errors;
    None for the server's policy, whose edits are dropped where the engine cannot edit)."""

    model: str
    session_id: str | None = None
    edits: list[CacheEdit] = field(default_factory=list)
    field: str | None = None


def read(request: Request, fields: dict[str, Any], list_name: str) -> CacheRequest:
    """The session id and drop fields of a chat request (`fields`: its body, or the extra
    fields of a pydantic body); a 400 naming the field for a bad value or a drop field
    without a session."""
    header = request.headers.get(SESSION_HEADER)
    body = fields.get(SESSION_FIELD)
    for value, where in ((header, SESSION_HEADER), (body, SESSION_FIELD)):
        if value is not None and (not isinstance(value, str) or not value.strip() or len(value) > MAX_SESSION_ID):
            raise APIError(400, f"{where}: must be a non-empty string of at most {MAX_SESSION_ID} characters",
                           param=where)
    if header is not None and body is not None and header != body:
        raise APIError(400, f"{SESSION_FIELD}: {body!r} differs from the {SESSION_HEADER} header {header!r}; "
                            "send one, or the same value in both", param=SESSION_FIELD)
    out = CacheRequest(list_name, header if header is not None else body)
    for name in DROP_FIELDS:
        value = fields.get(name)
        if value is None:
            continue
        if out.session_id is None:
            raise APIError(400, f"{name}: needs a session: name one with the {SESSION_HEADER} header (or the "
                                f"{SESSION_FIELD} field) so the cache it edits stays with the conversation",
                           param=name)
        setattr(out, name, value)
    if out.drop_rule not in DROP_RULES:
        raise APIError(400, f"drop_rule: must be one of {', '.join(DROP_RULES)}, got {out.drop_rule!r}",
                       param="drop_rule")
    if fields.get("drop_rule") is not None and out.drop_message is None:
        raise APIError(400, "drop_rule: says how drop_message's messages leave the cache, and drop_message is "
                            "missing", param="drop_rule")
    return out


def _plan(req: CacheRequest, origins: Origins, messages: list[dict]) -> DropPlan:
    """The request's drop fields, from its own indices to the chat messages' (PlanError
    naming the field when a listed entry cannot leave the cache on its own)."""
    n, name = origins.size, req.list_name
    position = {id(m): k for k, m in enumerate(messages)}
    owned: dict[int, list[int]] = {}  # request index -> chat message positions
    holders: dict[int, set[int]] = {}  # chat message position -> request indices
    for key, indices in origins.owners.items():
        if key not in position:  # a message the route left out after all
            continue
        k = position[key]
        holders[k] = set(indices)
        for r in indices:
            owned.setdefault(r, []).append(k)
    sealed = {position[key] for key in origins.sealed if key in position}

    def chat_messages(r: int, where: str) -> list[int]:
        if r not in owned:  # every entry lands in some message; a guard, not a rule
            raise PlanError(where, f"{name} {r} is not rendered as a chat message here")
        return owned[r]

    drops = parse_drop_message(req.drop_message, n) if req.drop_message is not None else {}
    repos = parse_reposition(req.reposition, n) if req.reposition is not None else []
    plan = DropPlan(reposition=sorted({k for r in repos for k in chat_messages(r, "reposition")}))
    thinking = req.drop_rule == "thinking_drop"
    target = plan.thinking if thinking else plan.messages
    listed = {r for rs in drops.values() for r in rs}
    for trigger, dropped in drops.items():
        where = f"drop_message.{trigger}"
        at = min(chat_messages(trigger, where))
        out = set(target.get(at, []))  # two entries of one chat message may both be triggers
        for r in dropped:
            for k in chat_messages(r, where):
                # A think block goes with its message whichever entry names it; a whole
                # message only when everything it holds was listed.
                if not thinking and k in sealed:
                    raise PlanError(where, f"{name} {r} is part of the system prompt, which also holds text "
                                           "that has no index here")
                if not thinking and not holders[k] <= listed:
                    raise PlanError(where, f"{name} {r} is one chat message with {name} "
                                           f"{sorted(holders[k] - {r})}: drop them together")
                if k >= at:
                    raise PlanError(where, f"{name} {r} is in the same chat message as the trigger {trigger}")
                out.add(k)
        target[at] = sorted(out)
    return plan


def _edits_with_spans(engine, messages, tools, template_kwargs, plan: DropPlan):
    """On a worker thread: the prompt ids and the plan's edits (a PlanError is returned, not
    raised, so tokenize's handler does not call it the template's fault)."""
    try:
        ids, spans = message_spans(engine, messages, tools, template_kwargs)
    except PlanError as e:
        return None, e
    thinks = think_spans(engine, ids, messages, spans) if plan.thinking else {}
    return ids, to_edits(plan, spans, thinks)


async def encode(request: Request | None, engine, model: str, req: CacheRequest | None, messages: list[dict],
                 origins: Origins | None, tools: list[dict] | None, where: str, sure: int,
                 template_kwargs: dict | None = None, check_length: bool = True) -> tuple[list[int], CacheUse]:
    """The prompt ids (as encode_chat makes them, on a worker thread after the early length
    check) and what generation.stream needs for the request's cache."""
    use = CacheUse(model, req.session_id if req is not None else None)
    # The server's --kv-compact policy; a request from outside HTTP (the MCP tools) has none.
    config = request.app.state.config if request is not None else None
    plan, policy = None, getattr(config, "kv_compact", None)
    if req is not None and req.explicit:
        try:
            plan = _plan(req, origins or Origins(), messages)
        except PlanError as e:
            raise APIError(400, str(e), param=e.field) from None
        use.field = "drop_message" if req.drop_message is not None else "reposition"
    elif use.session_id is not None and policy is not None and policy.active:
        plan = policy.plan(messages)
    if plan is None or plan.empty:
        ids = await tokenize(engine, sure, where, engine.encode_chat, messages, tools,
                             template_kwargs=template_kwargs, check_length=check_length)
        return ids, use
    ids, result = await tokenize(engine, sure, where, _edits_with_spans, engine, messages, tools, template_kwargs,
                                 plan, check_length=check_length)
    if isinstance(result, PlanError):
        if use.field is not None:  # set from the request's own fields
            assert req is not None
            raise APIError(400, f"{use.field}: {_own_words(result, req, origins, messages)}", param=use.field)
        assert policy is not None  # the plan was the policy's
        # The server's own policy cannot fault a request it did not ask for: it runs uncompacted.
        log.warning("--kv-compact %s skipped for session %r: %s", policy.describe(), use.session_id, result)
        ids = await tokenize(engine, sure, where, engine.encode_chat, messages, tools,
                             template_kwargs=template_kwargs, check_length=check_length)
        return ids, use
    use.edits = result
    return ids, use


def _own_words(error: PlanError, req: CacheRequest, origins: Origins | None, messages: list[dict]) -> str:
    """spans.py's error about chat message i, told with the request's own indices."""
    i = getattr(error, "message", None)
    if i is None or origins is None or not 0 <= i < len(messages):
        return str(error)
    held = sorted(origins.owners.get(id(messages[i]), ()))
    what = f"{req.list_name} {', '.join(map(str, held))}" if held else "the system prompt"
    return (f"the chat template renders {what} differently once later messages follow (as Qwen3's "
            "hides think blocks before the last user message), so its tokens cannot be named by index")


async def reset_quietly(sessions: list) -> None:
    """Free evicted or expired sessions' KV (on the engine thread, so off the event loop);
    an engine stopped meanwhile holds nothing to free."""
    def reset_all():
        for s in sessions:
            try:
                s.reset()
            except Exception as e:  # EngineDeadError, a timeout: the session is gone either way
                log.debug("session reset failed: %s", e)

    if sessions:
        await asyncio.to_thread(reset_all)


# --- prompts: tokenized on a worker thread, refused early when they cannot fit ----------------
_BYTE_LIMITS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _normalizer_shrink(n: dict | None) -> int | None:
    """By how much a tokenizers normalizer can shrink UTF-8 text at most (None: unbounded)."""
    if n is None:
        return 1
    kind = n.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in n.get("normalizers") or []:
            f = _normalizer_shrink(inner)
            if f is None:
                return None
            factor *= f
        return factor
    if kind in ("NFC", "NFD", "NFKC", "NFKD", "Lowercase"):
        return 4  # at worst a 4-byte character becomes a 1-byte one (NFKC: U+1D400 -> "A")
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern = (n.get("pattern") or {}).get("String")
        if isinstance(pattern, str) and len(n.get("content", "").encode()) >= len(pattern.encode()):
            return 1
    return None  # strip, strip accents, precompiled char maps: text can vanish


def _byte_limit_uncached(fmt: ChatFormat) -> tuple[int, int] | None:
    """(longest token in bytes, normalizer shrink factor), or None when no bound holds."""
    backend = fmt.backend
    if backend is None or fmt.hf is None:
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    byte_level = "ByteLevel" in json.dumps([spec.get("pre_tokenizer"), spec.get("decoder")])
    # Only when every byte has a token: otherwise unknown text of any length can be one <unk>.
    if model.get("type") != "BPE" or not (byte_level or model.get("byte_fallback")):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None:
        return None
    # A vocabulary string's UTF-8 length is at least the bytes of text it stands for
    # (byte-level symbols are 1-2 bytes per byte, "<0x41>" and "▁" are longer than theirs).
    longest = max((len(s.encode("utf-8")) for s in fmt.hf.get_vocab()), default=0)
    return (longest, shrink) if longest else None


def prompt_byte_limit(engine) -> tuple[int, int] | None:
    """(max UTF-8 bytes of prompt text that can fit the context, longest token's bytes).

    A prompt of N tokens stands for at most N x (longest token) bytes of text after
    normalization, so text longer than context x longest x shrink cannot fit. Computed once
    per tokenizer (reading the vocabulary is slow for large ones): call it off the event loop.
    """
    tok = engine.chat_format
    try:
        cached = _BYTE_LIMITS.get(tok)
    except TypeError:  # not weak-referenceable: compute each time
        cached = None
    if cached is None:
        cached = _byte_limit_uncached(tok) or (0, 0)
        try:
            _BYTE_LIMITS[tok] = cached
        except TypeError:
            pass
    longest, shrink = cached
    if not longest:
        return None
    return engine.context_length * longest * shrink, longest


def text_bytes(*texts: Any) -> int:
    """UTF-8 size of the given strings (others are ignored)."""
    return sum(len(t.encode("utf-8")) for t in texts if isinstance(t, str))


def max_text_bytes(engine) -> int:
    """Most text one tokenization takes (count_tokens, or a tokenizer with no byte bound):
    MAX_TEXT_BYTES, or more for a context so long that it holds more (8 bytes a token)."""
    return max(MAX_TEXT_BYTES, 8 * engine.context_length)


async def tokenize(engine, n_bytes: int, where: str, encode: Callable[..., T], *args,
                   template: bool = True, check_length: bool = True, **kwargs) -> T:
    """`encode(*args)` on a worker thread; first refuse text that cannot fit the context.

    `n_bytes` counts text the prompt is sure to contain (a template adds, never removes,
    the user's messages). A chat template that raises is a 400 on `where`. Any prompt's
    text is capped at max_text_bytes (a 400 naming it); large ones tokenize one at a time on
    their own lane (lanes.LARGE_TEXT), so small requests never queue behind them.
    """
    weight = max(n_bytes, lanes.weight(args) + lanes.weight(kwargs))
    if check_length:
        limit = await asyncio.to_thread(prompt_byte_limit, engine)
        if limit is not None and n_bytes > limit[0]:
            ctx = engine.context_length
            raise APIError(400, f"{where}: the prompt is {n_bytes} bytes of text, more than the {limit[0]} bytes "
                                f"the model's context length of {ctx} tokens can hold (its longest token "
                                f"is {limit[1]} bytes)",
                           param=where, code="context_length_exceeded")
    cap = max_text_bytes(engine)
    if weight > cap:
        raise APIError(400, f"{where}: {weight} bytes of text to tokenize; at most {cap} bytes per request",
                       param=where, code="request_too_large")
    try:
        if weight > lanes.LARGE_TEXT_BYTES:
            return await lanes.LARGE_TEXT.run(encode, *args, **kwargs)
        return await asyncio.to_thread(encode, *args, **kwargs)
    except APIError:
        raise
    except Exception as e:
        if not template:
            raise APIError(400, f"{where}: cannot tokenize the prompt: {e}", param=where) from None
        raise APIError(400, f"{where}: the chat template rejected them: {e}", param=where) from None
