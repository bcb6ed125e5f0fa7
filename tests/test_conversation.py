"""The Conversation the REPLs and the tool loop keep: prompts that reuse the kept ids, turn
bookkeeping, reset, engine switch and the /save shape, on a recording fake engine, then once
on a real tiny model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlxlocal.agents.conversation import Conversation


class FakeEngine:
    """Encodes each message as one id (its content length); records what was asked."""

    def __init__(self, name: str = "fake"):
        self.info = SimpleNamespace(name=name)
        self.calls: list[tuple] = []
        self.sessions: list[object] = []

    def new_session(self) -> object:
        self.sessions.append(object())
        return self.sessions[-1]

    def encode_chat(self, messages, tools=None):
        self.calls.append(("chat", [m["content"] for m in messages], tools))
        return [len(m["content"]) for m in messages] + [0]  # 0: the generation prompt

    def encode_continuation(self, before, after, tools=None):
        self.calls.append(("cont", [m["content"] for m in before], [m["content"] for m in after], tools))
        return [-1] + [len(m["content"]) for m in after] + [0]  # -1: the end of the reply


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_first_prompt_encodes_all_then_turns_continue_from_the_kept_ids():
    engine = FakeEngine()
    conv = Conversation(engine, system="sys")
    first = conv.prompt_ids(user("hi"))
    assert first == [3, 2, 0] and engine.calls == [("chat", ["sys", "hi"], None)]
    assert conv.messages == []  # a prompt alone records nothing
    conv.record(user("hi"), "hello", first, [7, 8])
    assert conv.messages == [user("hi"), {"role": "assistant", "content": "hello"}]
    assert conv.ids == [3, 2, 0, 7, 8] and conv.fed == 2
    second = conv.prompt_ids(user("more"))
    # The kept ids as they were (not the reply re-encoded) plus the continuation after the reply.
    assert second == [3, 2, 0, 7, 8, -1, 4, 0]
    assert engine.calls[-1] == ("cont", ["sys", "hi"], ["more"], None)
    conv.record(user("more"), "ok", second, [9])
    assert conv.ids == second + [9] and conv.fed == 4 and len(engine.sessions) == 1


def test_no_reuse_and_tools_go_through():
    engine = FakeEngine()
    conv = Conversation(engine)
    conv.record(user("a"), "b", conv.prompt_ids(user("a")), [5])
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert conv.prompt_ids(user("c"), tools=tools, reuse=False) == [1, 1, 1, 0]
    assert engine.calls[-1] == ("chat", ["a", "b", "c"], tools)
    conv.prompt_ids(user("c"), tools=tools)
    assert engine.calls[-1] == ("cont", ["a"], ["c"], tools)


def test_loop_style_replies_continue_after_the_last_fed_message():
    # The tool loop appends the user and tool messages itself, then asks for the prompt.
    engine = FakeEngine()
    conv = Conversation(engine, system="s")
    conv.messages.append(user("q"))
    prompt = conv.prompt_ids()
    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}
    conv.replied(call, prompt, [4])
    conv.messages.append({"role": "tool", "tool_call_id": "1", "content": "result"})
    assert conv.prompt_ids() == prompt + [4, -1, 6, 0]
    assert engine.calls[-1] == ("cont", ["s", "q"], ["result"], None)
    assert conv.rendered()[0] == {"role": "system", "content": "s"} and len(conv.rendered()) == 4


def test_reset_forgets_everything_but_the_system_prompt():
    engine = FakeEngine()
    conv = Conversation(engine, system="s")
    conv.record(user("a"), "b", conv.prompt_ids(user("a")), [5])
    old_session = conv.session
    conv.reset()
    assert conv.messages == [] and conv.ids == [] and conv.fed == 0 and conv.system == "s"
    assert conv.session is not old_session and conv.session is engine.sessions[-1]
    conv.prompt_ids(user("x"))
    assert engine.calls[-1][0] == "chat"  # nothing to continue from


def test_switch_engine_keeps_the_messages_and_reencodes():
    conv = Conversation(FakeEngine())
    conv.record(user("a"), "b", conv.prompt_ids(user("a")), [5])
    other = FakeEngine("other")
    conv.switch_engine(other)
    assert conv.engine is other and conv.session is other.sessions[-1] and conv.ids == []
    assert len(conv.messages) == 2
    assert conv.prompt_ids(user("c")) == [1, 1, 1, 0] and other.calls[-1][0] == "chat"


def test_save_load_round_trip_and_a_bad_file_changes_nothing():
    conv = Conversation(FakeEngine("m"), system="be brief")
    conv.record(user("a"), "b", conv.prompt_ids(user("a")), [5])
    saved = conv.to_saved()
    assert saved == {"model": "m", "system": "be brief", "messages": conv.messages}
    engine = FakeEngine()
    loaded = Conversation(engine)
    loaded.record(user("old"), "gone", loaded.prompt_ids(user("old")), [1])
    loaded.from_saved(saved)
    assert loaded.system == "be brief" and loaded.messages == conv.messages
    assert loaded.ids == [] and loaded.session is engine.sessions[-1]
    assert loaded.messages is not saved["messages"]  # later turns do not edit the saved data
    before = (loaded.system, list(loaded.messages), loaded.session)
    with pytest.raises(ValueError):
        loaded.from_saved({"messages": [{"role": "robot", "content": "x"}]})
    assert (loaded.system, loaded.messages, loaded.session) == before


def test_a_real_template_continues_what_a_full_encode_starts(tiny_model):
    from mlxlocal.engine import SamplingParams, open_engine
    from mlxlocal.source.loader import load_from_dir

    engine = open_engine(load_from_dir(tiny_model))
    try:
        conv = Conversation(engine, system="be brief")
        params = SamplingParams(max_tokens=4)
        kept: list[list[int]] = []
        for text in ("hello world", "and again"):
            kept.append(list(conv.ids))
            prompt = conv.prompt_ids(user(text))
            generated = [c.token for c in engine.generate(prompt, params, session=conv.session)
                         if c.token is not None]
            conv.record(user(text), engine.decode(generated), prompt, generated)
        # The second prompt starts with every id the first turn saw and produced.
        assert kept[1] and prompt[: len(kept[1])] == kept[1] and len(prompt) > len(kept[1])
        assert conv.session.cached_len > 0 and len(conv.messages) == 4
    finally:
        engine.shutdown()
