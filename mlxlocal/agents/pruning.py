"""Dynamic tool pruning for the tool loop: which of the MCP tools the model is offered.

With more tools than `max_tools`, the prompt's `tools=` holds only
- the top K of the tool index (agents/tool_index.py) for the turn's query,
- every tool called before in the session (the model may want it again; dropping it would
  also make the earlier calls in the conversation name a tool the prompt no longer has),
- every tool found earlier through the built-in `search_tools`,
- `search_tools` itself: the model's way to ask for more.

The set is chosen once per user turn, not per step. Templates render tools in the system
prompt, ahead of the conversation, so a changed tool list changes the prompt from (almost)
its first token: the session's KV cache would be lost and the whole conversation prefilled
again at every step. Chosen per turn, the steps of a turn extend each other's prompt and
prefill only their new tokens. A tool the model needs mid-turn comes through `search_tools`,
whose result (a tool message, so the cache is kept) carries the found tools' schemas; they
are callable from the next step on, for the rest of the session. At a turn boundary the list
is kept as it is (cache kept) when the new query's top K are all callable already; otherwise
it is rebuilt (new top K + called + found) and the conversation re-rendered once.

Turn query: the latest user message plus the start of the model's previous answer — a
follow-up ("now do the same for the other repo") often names no tool-related word itself,
and the answer it follows says what the sub-task is. Within a turn the model states the
sub-task itself, as the `search_tools` query.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mlxlocal.agents.types import ToolInfo

SEARCH_TOOLS = "search_tools"
SEARCH_K = 3  # tools a search_tools call returns (each joins the offered set)
DEFAULT_MAX_TOOLS = 8
CONTEXT_CHARS = 300  # of the previous answer, in the turn query


class Ranker(Protocol):
    """What the selection needs of the tool index (agents/tool_index.py ToolIndex)."""

    def rank(self, query: str, k: int, stage1_only: bool = False) -> list[tuple[str, float]]: ...


def search_tools_schema() -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": SEARCH_TOOLS,
        "description": ("Find more tools. Only some of the available tools are listed; describe what you "
                        "need to do and this returns the matching tools, which you can call from then on."),
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "what the tool should do, in a few words"}},
            "required": ["query"]}}}


def parse_max_tools(value: str | int | None) -> int | None:
    """--max-tools: a count, or 0 / "all" for no pruning (None)."""
    if value is None:
        return None
    text = str(value).strip().lower()
    if text in ("all", "0", "none"):
        return None
    try:
        k = int(text)
    except ValueError:
        raise ValueError(f"--max-tools must be a positive count, 0 or 'all', got {value!r}") from None
    if k < 0:
        raise ValueError(f"--max-tools must be a positive count, 0 or 'all', got {value!r}")
    return k


def default_index(tools: list[ToolInfo]) -> Ranker:
    # Imported here: the index (bm25s, optional embeddings) is only needed when pruning is on.
    from mlxlocal.agents.tool_index import ToolIndex

    return ToolIndex(tools)


@dataclass(frozen=True)
class Why:
    """Why a tool is offered: kind "top" (rank for the turn query), "called" or "found"."""

    kind: str
    detail: str

    def text(self) -> str:
        return self.detail


class ToolSelection:
    """The offered tools of one conversation. `prompt` (ids rendered in the system prompt)
    changes only in `start_turn`; `callable` is `prompt` plus what search_tools found this
    turn. Without pruning (max_tools None, or no more tools than it) everything is offered
    and there is no search_tools."""

    def __init__(self, max_tools: int | None = DEFAULT_MAX_TOOLS, index: Ranker | None = None,
                 make_index: Callable[[list[ToolInfo]], Ranker] = default_index):
        if max_tools is not None and max_tools < 1:
            raise ValueError(f"max_tools must be at least 1 (None: no pruning), got {max_tools}")
        self.max_tools = max_tools
        self._given_index = index  # built for the catalog the caller had; used while it is the same
        self._make_index = make_index
        self._index: Ranker | None = None
        self._catalog: tuple[str, ...] | None = None
        self.tools: dict[str, ToolInfo] = {}
        self.prompt: list[str] = []
        self.found: list[str] = []  # found by search_tools during this turn, not yet in `prompt`
        self.why: dict[str, Why] = {}
        self.called: set[str] = set()
        self.query = ""

    def reset(self) -> None:
        """A new conversation: nothing called or found yet."""
        self.prompt, self.found, self.why, self.called, self.query = [], [], {}, set(), ""

    # the catalog ---------------------------------------------------------------------------
    def set_catalog(self, tools: Sequence[ToolInfo]) -> None:
        ids = tuple(t.id for t in tools)
        self.tools = {t.id: t for t in tools}
        if ids != self._catalog:
            # The index is per catalog (a server's list_changed changes it). ToolIndex.update
            # re-indexes and embeds only the tools it has not seen (its cache is per tool).
            if self._catalog is None and self._given_index is not None:
                self._index = self._given_index
            elif self._index is not None and hasattr(self._index, "update"):
                self._index.update(list(tools))
            else:
                self._index = None
            self._catalog = ids
        if not self.pruning:
            self.prompt, self.found = list(ids), []
        else:
            self.prompt = [i for i in self.prompt if i in self.tools]
            self.found = [i for i in self.found if i in self.tools]

    @property
    def pruning(self) -> bool:
        return self.max_tools is not None and len(self.tools) > self.max_tools

    def index(self) -> Ranker:
        if self._index is None:
            self._index = self._make_index(list(self.tools.values()))
        return self._index

    # turns and steps -------------------------------------------------------------------------
    def start_turn(self, user_text: str, previous_answer: str = "") -> bool:
        """Choose the prompt's tools for a new user turn; True when the list changed."""
        if not self.pruning:
            return False
        assert self.max_tools is not None  # self.pruning is False without a limit
        self.query = " ".join(p for p in (user_text.strip(), previous_answer.strip()[:CONTEXT_CHARS]) if p)
        ranked = self.index().rank(self.query, self.max_tools)
        top = [tool_id for tool_id, _ in ranked if tool_id in self.tools][: self.max_tools]
        keep = set(self.prompt) | set(self.found)
        # Tools that merely fill the K slots (a BM25 score of 0: no word in common) do not
        # justify a rebuild; the ones the query matched do.
        wanted = {i for i, score in ranked if i in top and score > 0} or set(top)
        if self.prompt and wanted <= keep:
            # Everything the query wants is offered already (found tools are callable through
            # the schemas in their search result): the prompt stays, and with it the cache.
            return False
        why: dict[str, Why] = {}
        for tool_id in self.prompt + self.found:
            old = self.why.get(tool_id)
            if tool_id in self.called:
                why[tool_id] = Why("called", "called before in this session")
            elif old is not None and old.kind == "found":
                why[tool_id] = old
        for rank, (tool_id, score) in enumerate(ranked, 1):
            if tool_id in top and tool_id not in why:
                why[tool_id] = Why("top", f"top {self.max_tools}: #{rank} (score {score:.3g}) for {short(self.query)!r}")
        before = self.prompt
        # Catalog order, not rank order: a stable list renders the same text for the same set.
        self.prompt = [i for i in self.tools if i in why]
        self.found, self.why = [], why
        return self.prompt != before

    def search(self, query: str) -> tuple[str, list[str]]:
        """search_tools: the result text for the model and the ids it made callable."""
        query = query.strip()
        if not query:
            return "error: search_tools needs a non-empty query", []
        ranked = [(i, s) for i, s in self.index().rank(query, SEARCH_K) if i in self.tools]
        offered = set(self.prompt) | set(self.found)
        new = [i for i, _ in ranked if i not in offered]
        for i in new:
            self.found.append(i)
            self.why[i] = Why("found", f"found by search_tools({short(query)!r})")
        listing = [tool_entry(self.tools[i], i in new) for i, _ in ranked]
        if not listing:
            return f"no tool matches {query!r}", []
        head = "Matching tools (callable now; the schemas give their arguments):"
        return head + "\n" + json.dumps(listing, ensure_ascii=False), new

    def note_called(self, tool_id: str) -> None:
        self.called.add(tool_id)

    @property
    def callable(self) -> list[str]:
        return self.prompt + [i for i in self.found if i not in self.prompt]

    def inactive(self) -> list[str]:
        offered = set(self.callable)
        return [i for i in self.tools if i not in offered]


def tool_entry(tool: ToolInfo, new: bool) -> dict[str, Any]:
    from mlxlocal.agents.loop import function_name  # loop imports this module at its top

    entry = {"name": function_name(tool.id), "description": tool.description or tool.annotations.get("title", ""),
             "parameters": tool.input_schema or {"type": "object"}}
    if not new:
        entry["note"] = "already available"
    return entry


def short(text: str, limit: int = 60) -> str:
    one_line = " ".join(text.split())
    return one_line if len(one_line) <= limit else one_line[: limit - 1] + "…"
