"""edits/plan.py and policy.py: AKV drop plans by message -> CacheEdits in token spans."""

from __future__ import annotations

import pytest

from mlxlocal.edits import (
    CompactionPolicy,
    DropPlan,
    PlanError,
    parse_drop_message,
    parse_policy,
    parse_reposition,
    think_span,
    to_edits,
)
from mlxlocal.engine.types import CacheEdit

# Six messages of 10 tokens each, tiling a 60-token prompt.
SPANS = [(i * 10, i * 10 + 10) for i in range(6)]


# --- parse_drop_message ---------------------------------------------------------------------
def test_drop_message_parses_string_keys_and_sorts():
    assert parse_drop_message({"4": [2, 1], "3": ["0"]}, 6) == {3: [0], 4: [1, 2]}
    assert parse_drop_message({" 5 ": []}, 6) == {}  # a trigger with nothing to drop is no edit
    assert parse_drop_message({}, 6) == {}


@pytest.mark.parametrize("value, field, words", [
    ([1, 2], "drop_message", "must be an object"),
    ({"x": [0]}, "drop_message", "must be a message index"),
    ({"--3": [0]}, "drop_message", "must be a message index"),
    ({"²": [0]}, "drop_message", "must be a message index"),
    ({"6": [0]}, "drop_message", "is not a message of this request (0..5)"),
    ({"-1": [0]}, "drop_message", "is not a message"),
    ({"3": 1}, "drop_message.3", "must be a list"),
    ({"3": [True]}, "drop_message.3", "must be a message index"),
    ({"3": [1.0]}, "drop_message.3", "must be a message index"),
    ({"3": [3]}, "drop_message.3", "not before its trigger 3"),
    ({"3": [4]}, "drop_message.3", "not before its trigger 3"),
    ({"3": [1], "4": [1]}, "drop_message.4", "already dropped at trigger 3"),
    ({"3": [1, 1]}, "drop_message.3", "already dropped"),
])
def test_drop_message_errors_name_the_field(value, field, words):
    with pytest.raises(PlanError) as e:
        parse_drop_message(value, 6)
    assert e.value.field == field and words in str(e.value) and str(e.value).startswith(field + ":")


def test_drop_message_field_name_is_the_callers():
    with pytest.raises(PlanError) as e:
        parse_drop_message({"9": []}, 6, field="extra.drop_message")
    assert e.value.field == "extra.drop_message"


def test_reposition():
    assert parse_reposition([3, "1", 3], 6) == [1, 3]
    assert parse_reposition([], 6) == []
    for bad, words in (({"1": 2}, "must be a list"), ([6], "not a message"), ([None], "message index")):
        with pytest.raises(PlanError) as e:
            parse_reposition(bad, 6)
        assert e.value.field == "reposition" and words in str(e.value)


# --- think_span -------------------------------------------------------------------------------
def test_think_span_finds_the_block_inside_the_span_only():
    ids = [1, 2, 7, 8, 3, 3, 9, 4, 7, 8, 5, 9]
    assert think_span(ids, (0, 12), [7, 8], [9]) == (2, 7)
    assert think_span(ids, (4, 12), [7, 8], [9]) == (8, 12)
    assert think_span(ids, (0, 6), [7, 8], [9]) is None  # its end is past the span
    assert think_span(ids, (0, 12), [], [9]) is None  # a model without think markers
    assert think_span(ids, (0, 12), [6], [9]) is None


# --- to_edits ---------------------------------------------------------------------------------
def test_whole_messages_at_their_trigger():
    plan = DropPlan(messages={3: [1], 5: [2, 4]})
    assert to_edits(plan, SPANS) == [CacheEdit(at=30, drop=((10, 20),)),
                                     CacheEdit(at=50, drop=((20, 30), (40, 50)))]


def test_adjacent_drops_merge_and_an_empty_trigger_is_no_edit():
    plan = DropPlan(messages={4: [1, 2], 5: []})
    assert to_edits(plan, SPANS) == [CacheEdit(at=40, drop=((10, 30),))]
    assert to_edits(DropPlan(), SPANS) == [] and DropPlan().empty
    assert DropPlan(reposition=[1, 2]).empty and to_edits(DropPlan(reposition=[1, 2]), SPANS) == []


def test_thinking_then_the_rest_of_the_message():
    thinks = {1: (12, 16), 2: (22, 25)}
    plan = DropPlan(messages={5: [1]}, thinking={3: [1, 2], 4: [0]})  # message 0 has no think block
    assert to_edits(plan, SPANS, thinks) == [
        CacheEdit(at=30, drop=((12, 16), (22, 25))),
        # message 1 leaves whole later: only what its think block did not take
        CacheEdit(at=50, drop=((10, 12), (16, 20))),
    ]


def test_reposition_moves_what_follows_the_first_new_gap():
    plan = DropPlan(messages={3: [1], 5: [3]}, reposition=list(range(6)))
    assert to_edits(plan, SPANS) == [  # the trigger is repositioned too: what follows closes the gap
        CacheEdit(at=30, drop=((10, 20),), reposition=((20, 30),), close_tail=True),  # message 2 closes the gap
        # message 2 is before this gap: only message 4 (before the trigger) moves again
        CacheEdit(at=50, drop=((30, 40),), reposition=((40, 50),), close_tail=True),
    ]


def test_reposition_of_a_partly_dropped_message_moves_its_pieces_after_the_gap():
    thinks = {1: (12, 16)}
    plan = DropPlan(thinking={3: [1]}, reposition=[1, 2])
    assert to_edits(plan, SPANS, thinks) == [
        CacheEdit(at=30, drop=((12, 16),), reposition=((16, 30),)),  # the message's own tail, then message 2
    ]


def test_reposition_only_the_listed_messages():
    plan = DropPlan(messages={4: [0]}, reposition=[2])
    assert to_edits(plan, SPANS) == [CacheEdit(at=40, drop=((0, 10),), reposition=((20, 30),))]


def test_edits_are_valid_for_the_engine_contract():
    """Sorted by at; spans before at, sorted, disjoint, never overlapping earlier drops."""
    plan = DropPlan(messages={2: [0], 4: [1, 3], 5: [2]}, thinking={3: [2]}, reposition=list(range(6)))
    edits = to_edits(plan, SPANS, {2: (21, 24)})
    gone: list[tuple[int, int]] = []
    assert [e.at for e in edits] == sorted(e.at for e in edits)
    for e in edits:
        for spans in (e.drop, e.reposition):
            assert list(spans) == sorted(spans)
            assert all(a < b <= e.at for a, b in spans)
            assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:]))
        assert not any(a < y and x < b for a, b in e.drop for x, y in gone)
        assert not any(a < y and x < b for a, b in e.reposition for x, y in gone + list(e.drop))
        gone += e.drop


# --- policies ---------------------------------------------------------------------------------
def _agent(n_tools: int) -> list[dict]:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "task"}]
    for _ in range(n_tools):
        msgs += [{"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool", "content": "out"}]
    return msgs


def test_keep_last_tool_outputs():
    msgs = _agent(5)
    tools = [i for i, m in enumerate(msgs) if m["role"] == "tool"]  # 3, 5, 7, 9, 11
    plan = parse_policy("keep-last-tool-outputs=2").plan(msgs)
    # tool j leaves when tool j + 2 arrives
    assert plan.messages == {tools[2]: [tools[0]], tools[3]: [tools[1]], tools[4]: [tools[2]]}
    assert not plan.thinking and not plan.reposition
    assert parse_policy("keep-last-tool-outputs=5").plan(msgs).empty


def test_plans_extend_turn_by_turn():
    """The plan for a longer conversation keeps every drop of the shorter one's: the cache of
    turn n stays reusable at turn n + 1."""
    policy = parse_policy("keep-last-tool-outputs=3,drop-thinking,reposition")
    short, long = policy.plan(_agent(6)), policy.plan(_agent(9) + [{"role": "user", "content": "more"}])
    for trigger, dropped in short.messages.items():
        assert long.messages[trigger] == dropped
    for trigger, dropped in short.thinking.items():
        assert long.thinking[trigger] == dropped


def test_drop_thinking_at_the_next_user_message():
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
            {"role": "tool", "content": "t"}, {"role": "assistant", "content": "c"},
            {"role": "user", "content": "d"}, {"role": "assistant", "content": "e"}]
    plan = parse_policy("drop-thinking").plan(msgs)
    assert plan.thinking == {4: [1, 3]} and not plan.messages  # the last reply has no later user message


def test_reposition_policy_lists_every_message():
    assert parse_policy("reposition").plan(_agent(1)).reposition == [0, 1, 2, 3]
    assert not parse_policy("reposition").active


@pytest.mark.parametrize("text, expected", [
    (None, CompactionPolicy()),
    ("", CompactionPolicy()),
    ("off", CompactionPolicy()),
    ("keep-last-tool-outputs=12", CompactionPolicy(12)),
    (" keep-last-tool-outputs=12 , drop-thinking,reposition ", CompactionPolicy(12, True, True)),
    ("drop-thinking", CompactionPolicy(None, True)),
])
def test_parse_policy(text, expected):
    policy = parse_policy(text)
    assert policy == expected
    assert parse_policy(policy.describe()) == policy  # describe round-trips


@pytest.mark.parametrize("text, words", [
    ("keep-last-tool-outputs=0", "needs a count >= 1"),
    ("keep-last-tool-outputs=", "needs a count"),
    ("keep-last-tool-outputs=x", "needs a count"),
    ("drop-thinking=1", "unknown policy"),
    ("compact", "unknown policy 'compact'"),
])
def test_parse_policy_errors(text, words):
    with pytest.raises(ValueError) as e:
        parse_policy(text)
    assert "--kv-compact" in str(e.value) and words in str(e.value)


def test_describe():
    assert CompactionPolicy().describe() == "off"
    assert CompactionPolicy(12, True, True).describe() == "keep-last-tool-outputs=12,drop-thinking,reposition"
    assert CompactionPolicy(12).active and CompactionPolicy(None, True).active and not CompactionPolicy().active
