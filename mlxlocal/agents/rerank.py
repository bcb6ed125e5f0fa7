"""The loaded chat model as a listwise re-ranker of tool candidates (stage 2 of the tool index).

This is what a Mac user runs: no cross-encoder, but the chat model is already in memory. The
prompt lists the ~20 stage-1 candidates, one line each (`server.name: short description`),
and asks for the ids of the tools that fit the request, best first. The answer is
constrained by a regex grammar to a comma-separated list of candidate ids, so even a weak
model produces a parseable list; a model without the constraint (or one whose grammar
cannot be built) is parsed leniently: every candidate id found in the text, in order. An
answer naming none returns None, and the index keeps its offline order.

Engine contract only (encode_chat, generate); no MLX here.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace

from mlxlocal.agents.types import ToolInfo
from mlxlocal.engine import Engine, SamplingParams
from mlxlocal.errors import MlxLocalError
from mlxlocal.grammar.errors import GrammarError
from mlxlocal.grammar.formats import regex, with_reasoning
from mlxlocal.grammar.parse import OutputParser, starts_in_reasoning

DESCRIPTION_CHARS = 160  # per candidate line: 20 candidates stay near 1k prompt tokens
MAX_THINK_TOKENS = 256  # a thinking model may reason first, but briefly: ranking is per step

SYSTEM = ("You select tools for an assistant. Given a user request and a list of tools, answer with "
          "the ids of the tools that can do what the request asks, most useful first, separated by "
          "commas. Answer only with ids from the list.")


def _line(tool: ToolInfo) -> str:
    text = " ".join((tool.description or tool.annotations.get("title", "") or "").split())
    if len(text) > DESCRIPTION_CHARS:
        text = text[: DESCRIPTION_CHARS - 1] + "…"
    return f"{tool.id}: {text}"


def prompt_messages(query: str, candidates: Sequence[ToolInfo], k: int) -> list[dict[str, str]]:
    listing = "\n".join(_line(t) for t in candidates)
    user = (f"Tools:\n{listing}\n\nRequest: {query}\n\n"
            f"Answer with up to {k} tool ids, best first, comma-separated.")
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def answer_pattern(ids: Sequence[str], k: int) -> str:
    """A regex for 1..k candidate ids separated by ", " (ids are longest first so the regex
    engine never stops at an id that is a prefix of another)."""
    alts = "|".join(re.escape(i) for i in sorted(ids, key=len, reverse=True))
    return f"({alts})(, ({alts})){{0,{max(0, k - 1)}}}"


def parse_answer(text: str, ids: Sequence[str]) -> list[str]:
    """Candidate ids in the order the text names them, each once. Longest ids first in the
    alternation, so "github.create_issue" is not read as a shorter id it starts with."""
    if not ids:
        return []
    pattern = re.compile("|".join(re.escape(i) for i in sorted(ids, key=len, reverse=True)))
    return list(dict.fromkeys(m.group(0) for m in pattern.finditer(text)))


class ChatReranker:
    """`ChatReranker(engine)(query, candidates, k) -> ids best first, or None`.

    `constrain`: the answer is generated under the id-list grammar (default). `last_text`
    keeps the model's raw answer for `tools rank --json` and for tests.
    """

    def __init__(self, engine: Engine, *, constrain: bool = True, params: SamplingParams | None = None):
        self.engine = engine
        self.constrain = constrain
        self.params = params or SamplingParams(max_tokens=160, temperature=0.0)
        self.last_text = ""
        self.last_note = ""

    def __call__(self, query: str, candidates: Sequence[ToolInfo], k: int) -> list[str] | None:
        ids = [t.id for t in candidates]
        if not ids:
            return None
        k = max(1, min(k, len(ids)))
        prompt = self.engine.encode_chat(prompt_messages(query, candidates, k))
        opened = starts_in_reasoning(self.engine, prompt)
        params = self.params
        self.last_note = ""
        if self.constrain:
            try:
                grammar = with_reasoning(regex(answer_pattern(ids, k), "rerank"), self.engine.chat_format, opened,
                                         MAX_THINK_TOKENS)
                # The longest answer is k ids plus separators, and a bounded think block.
                budget = sum(sorted((len(self.engine.encode_text(i)) + 2 for i in ids), reverse=True)[:k])
                params = replace(params, grammar=grammar, max_tokens=max(params.max_tokens, budget + MAX_THINK_TOKENS))
            except GrammarError as e:  # e.g. a tokenizer llguidance cannot read: parse leniently
                self.last_note = f"unconstrained: {e}"
        parser = OutputParser(self.engine.chat_format, [], opened)
        content = []
        try:
            for chunk in self.engine.generate(prompt, params):
                events = parser.feed(chunk.text) if chunk.text else []
                if chunk.stats is not None:
                    events += parser.finish()
                content += [ev.text for ev in events if ev.kind == "content" and ev.text]
        except (MlxLocalError, ValueError) as e:  # e.g. the listing exceeds a small context
            self.last_text, self.last_note = "", f"the chat model could not rank: {e}"
            return None
        self.last_text = "".join(content)
        chosen = parse_answer(self.last_text, ids)
        return chosen[:k] or None
