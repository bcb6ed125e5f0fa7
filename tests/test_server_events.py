"""The shared event layer: engine chunks -> reasoning / content / tool-call events, for every dialect."""

from __future__ import annotations

import asyncio

import pytest

from mlxlocal.engine import ChatFormat, Chunk, EngineDeadError, SamplingParams
from mlxlocal.errors import ContextLengthError
from mlxlocal.grammar.parse import starts_in_reasoning
from mlxlocal.server.errors import APIError
from mlxlocal.server.generation import open_events
from mlxlocal.server.metrics import Metrics

THINKING = ChatFormat(has_thinking=True, think_start="<think>", think_end="</think>")


class Handle:
    def __init__(self, pieces, die=False):
        self.pieces, self.die, self.cancelled = pieces, die, False

    async def batches(self, idle=None):  # one chunk a wake-up, as a slow engine step gives
        if self.die:
            raise EngineDeadError("engine stopped")
        for i, text in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield [Chunk(text, token=i, finish_reason="stop" if last else None)]

    def cancel(self):
        self.cancelled = True


class Engine:
    """Token ids index `vocab`; submit replays `pieces` (or refuses / dies)."""

    context_length = 100

    def __init__(self, vocab=(), pieces=("",), refuse=False, die=False, thinking=True):
        self.vocab, self.pieces, self.refuse, self.die = list(vocab), list(pieces), refuse, die
        self.chat_format = THINKING if thinking else ChatFormat()
        self.submitted = 0

    def decode(self, ids):
        return "".join(self.vocab[i] for i in ids)

    def submit(self, prompt, params, loop=None):
        if self.refuse:
            raise ContextLengthError(len(prompt), self.context_length)
        self.submitted += 1
        return Handle(self.pieces, self.die)


class Request:
    class app:  # noqa: N801 - stands in for the FastAPI app: generation.stream asks its registry
        class state:  # noqa: N801
            class registry:  # noqa: N801 - no sessions held: nothing to free
                stopping = False  # not shutting down

                @staticmethod
                def make_room(engine, need, keep=None):
                    return []

    async def is_disconnected(self):
        return False


def ids_of(engine, *texts):
    engine.vocab = list(texts)
    return list(range(len(texts)))


@pytest.mark.parametrize("texts, expected", [
    (("<|user|>", "hi", "<|assistant|>", "<think>", "\n"), True),  # template opened the block
    (("<|user|>", "hi", "<|assistant|>", "<think>", "\n\n", "</think>", "\n\n"), False),  # opened and closed
    (("<|user|>", "what is <think>?", "<|assistant|>"), False),  # unclosed, but message text
    (("<|user|>", "hi", "<|assistant|>"), False),
])
def test_reasoning_starts_only_when_the_prompt_ends_with_the_opening_marker(texts, expected):
    engine = Engine()
    assert starts_in_reasoning(engine, ids_of(engine, *texts)) is expected
    plain = Engine(thinking=False)
    assert starts_in_reasoning(plain, ids_of(plain, *texts)) is False


def collect(engine, ids):
    async def go():
        events = await open_events(Request(), engine, ids, SamplingParams(max_tokens=20), None, Metrics())
        return [e async for e in events]
    return asyncio.run(go())


def test_whitespace_around_the_think_block_is_dropped_once():
    engine = Engine(pieces=["\n", "plan", " more\n", "</think>", "\n\n", " Answer", "\n", "end"])
    events = collect(engine, ids_of(engine, "<|assistant|>", "<think>", "\n"))
    text = [(e.kind, e.text) for e in events if e.kind in ("reasoning", "content")]
    assert "".join(t for k, t in text if k == "reasoning") == "plan more\n"
    assert "".join(t for k, t in text if k == "content") == "Answer\nend"  # inner whitespace kept
    assert [e.kind for e in events].count("token") == 8
    finish = events[-1]
    assert finish.kind == "finish" and finish.reason == "stop" and finish.tokens == list(range(8))
    assert not finish.tool_calls


def test_reasoning_opened_by_the_model_is_trimmed_too():
    engine = Engine(pieces=["<think>", "\n", "hmm", "</think>", "\n\n", "OK"])
    events = collect(engine, ids_of(engine, "<|assistant|>"))
    pairs = [(e.kind, e.text) for e in events if e.kind in ("reasoning", "content")]
    assert pairs == [("reasoning", "hmm"), ("content", "OK")]


def test_leading_content_without_reasoning_is_kept():
    engine = Engine(pieces=["  indented", " code"], thinking=False)
    events = collect(engine, ids_of(engine, "<|assistant|>"))
    assert "".join(e.text for e in events if e.kind == "content") == "  indented code"


@pytest.mark.parametrize("engine, status", [(Engine(refuse=True), 400), (Engine(die=True), 503)])
def test_a_refused_request_raises_before_any_event(engine, status):
    async def go():
        return await open_events(Request(), engine, [0], SamplingParams(max_tokens=4), None, Metrics())

    engine.vocab = ["x"]
    with pytest.raises(APIError) as err:
        asyncio.run(go())  # the await itself raises: a router has not started its response yet
    assert err.value.status == status
