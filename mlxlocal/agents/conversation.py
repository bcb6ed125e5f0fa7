"""One conversation on one engine session: what the chat REPL and the agent tool loop keep.

It holds the messages, the system prompt, the token ids exactly as the model saw and
produced them, the engine session whose KV cache holds those ids, and each message's token
span (for `--kv-compact`'s cache edits). A new prompt is the kept ids plus the chat
template's continuation, so each turn prefills only its new tokens. Engine contract only: no
terminal I/O here (the REPLs read and render), nothing from the front ends.
"""

from __future__ import annotations

from typing import Any

from mlxlocal.edits import CompactionPolicy
from mlxlocal.edits.spans import ConversationSpans
from mlxlocal.engine import CacheEdit, Engine, EngineSession

Message = dict[str, Any]


def parse_saved(data: Any) -> tuple[str | None, list[dict[str, str]]]:
    """Validate a /save file's JSON; return (system, messages) or raise ValueError."""
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise ValueError("expected an object with a 'messages' list")
    system = data.get("system")
    if system is not None and not isinstance(system, str):
        raise ValueError("'system' must be a string or null")
    messages = []
    for i, m in enumerate(data["messages"]):
        ok = isinstance(m, dict) and m.get("role") in ("user", "assistant", "system")
        if not ok or not isinstance(m.get("content"), str):
            raise ValueError(f"message {i} needs a role (user/assistant/system) and string content")
        messages.append({"role": m["role"], "content": m["content"]})
    return system, messages


class Conversation:
    def __init__(self, engine: Engine, *, system: str | None = None,
                 compact: CompactionPolicy | None = None):
        self.engine = engine
        self.system = system
        self.messages: list[Message] = []
        # The token ids exactly as the model saw and produced them (the last prompt + its
        # reply's generated ids). Re-encoding a reply's text may give other ids, and then the
        # session's KV cache would no longer be a prefix of the next prompt.
        self.ids: list[int] = []
        self.fed = 0  # how many of `messages` the ids cover (they end with an assistant reply)
        # Each message's token span, for a compaction policy's cache edits (--kv-compact).
        self.spans = ConversationSpans(compact)
        self.session: EngineSession = engine.new_session()

    def rendered(self, *extra: Message) -> list[Message]:
        """The messages the template renders: the system prompt, the messages, then `extra`."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.messages + list(extra)

    def prompt_ids(self, user: Message | None = None, tools: list[dict[str, Any]] | None = None,
                   reuse: bool = True) -> list[int]:
        """The next prompt (with `user` appended, when given): the kept ids plus the template's
        continuation after the last reply they hold, or else the whole conversation encoded
        (first turn, after reset/load/switch_engine, or `reuse=False`: the ids were rendered
        another way, e.g. with other tools=; the session still reuses the common prefix)."""
        conv = self.rendered(*([user] if user is not None else []))
        offset = len(conv) - len(self.messages) - (user is not None)  # the system message
        reply_at = offset + self.fed - 1 if reuse and self.ids and self.fed else None
        return self.spans.prompt(self.engine, conv, self.ids, reply_at, tools)

    def edits(self, user: Message | None = None) -> list[CacheEdit] | None:
        """The compaction policy's cache edits for that prompt; None without a policy."""
        return self.spans.edits(self.rendered(*([user] if user is not None else [])))

    def replied(self, message: Message, prompt: list[int], generated: list[int]) -> None:
        """The model answered `prompt` with `generated`: keep its message and the ids."""
        self.messages.append(message)
        self.ids, self.fed = prompt + generated, len(self.messages)
        self.spans.replied(self.engine, prompt, generated)

    def record(self, user: Message, reply_text: str, prompt: list[int], generated: list[int]) -> None:
        """A chat turn: the user's message and the reply to it (even a cut-off one)."""
        self.messages.append(user)
        self.replied({"role": "assistant", "content": reply_text}, prompt, generated)

    def reset(self) -> None:
        """Forget the messages, ids and KV (a new session): nothing is left to reuse."""
        self.messages, self.ids, self.fed = [], [], 0
        self.spans.reset()
        self.session = self.engine.new_session()

    def switch_engine(self, engine: Engine) -> None:
        """Another model: keep the messages; the old ids and KV mean nothing to its tokenizer,
        so the next prompt encodes the text again."""
        self.engine = engine
        self.session = engine.new_session()
        self.ids, self.fed = [], 0
        self.spans.reset()

    def to_saved(self) -> dict[str, Any]:
        """What /save writes (as JSON): the model, the system prompt, the messages."""
        return {"model": self.engine.info.name, "system": self.system, "messages": self.messages}

    def from_saved(self, data: Any) -> None:
        """Become a saved conversation (`to_saved`'s shape): its system prompt and messages,
        no ids, a new session. ValueError, and nothing changed, when it is not one."""
        system, messages = parse_saved(data)
        self.reset()
        self.system, self.messages = system, messages  # parse_saved made new dicts
