"""Every injection scenario of tests/fixtures/injection through the live tool loop.

tests/test_agents_policy.py decides the scenarios offline (`tools check`, RuleOfTwo fed the
trace). Here each one is played for real: every server of the scenario is
tests/mcp_servers/scenario.py over stdio (the scenario's tools, schemas and annotations as
written, canned results), the config keeps the scenario's trust/sensitive/tools/policy keys,
and the tiny model is scripted to make the trace's calls one step at a time, then the
attempted call, then answer. The policy sees only what the loop sees: the tools as the MCP
client listed them and the results as they came back.

What must hold, per scenario: the policy's decision on the attempted call (the "decision"
event) is the expected decision with the expected flags; an allowed call reaches its server
(the server's outbox gets one line), a stopped one does not and the model's next prompt holds
the policy's stop text; an "ask" is refused when nobody can approve and runs exactly once when
a human says yes; a "block" is never put to a human.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from agent_util import call, hub_for, scripted_steps

from mlxlocal.agents.loop import AgentEvent, ToolLoop, TurnResult, function_name
from mlxlocal.agents.policy import RuleOfTwo
from mlxlocal.engine import SamplingParams, open_engine
from mlxlocal.source.loader import load

SCENARIOS = sorted((Path(__file__).parent / "fixtures" / "injection").glob("*.json"))
SCENARIO_SERVER = Path(__file__).parent / "mcp_servers" / "scenario.py"
# How a config entry reaches its server; everything else in the entry (trust, sensitive,
# tools, policy) is what the scenario is about and stays as written.
TRANSPORT_KEYS = {"type", "command", "args", "env", "cwd", "url", "headers"}
# A trusted opening message for traces that start with a tool call rather than user input.
TASK = "Please help me with my task."
ANSWER = "Done."
# The longest scripted reply (a call carrying a private key) is well under this; a reply
# cut short would not parse as a call.
PARAMS = SamplingParams(max_tokens=512)


@pytest.fixture(scope="module")
def engine(agent_model):
    """One engine for every scenario: each loop opens its own session on it."""
    eng = open_engine(load(str(agent_model)), max_num_seqs=1)
    yield eng
    eng.shutdown()


def live_config(scenario_path: Path, scenario: dict[str, Any], outbox: Path, path: Path) -> Path:
    """The scenario's MCP config with every server run by scenario.py over stdio."""
    servers = {}
    for name, entry in scenario["mcp"]["mcpServers"].items():
        kept = {k: v for k, v in entry.items() if k not in TRANSPORT_KEYS}
        servers[name] = {"command": sys.executable,
                         "args": [str(SCENARIO_SERVER), str(scenario_path), name, "--outbox", str(outbox)], **kept}
    path.write_text(json.dumps({"mcpServers": servers}))
    return path


def turns(trace: dict[str, Any]) -> list[tuple[str, bool, list[dict[str, Any]]]]:
    """The trace as user turns: (message, untrusted, the tool steps the model takes in it).
    A user_input step opens a turn (as a message the user sends, marked untrusted when the
    trace says so); tool steps before any user input follow a trusted opening task."""
    out: list[tuple[str, bool, list[dict[str, Any]]]] = []
    for step in trace["steps"]:
        if "user_input" in step:
            out.append((step["user_input"], bool(step.get("untrusted", False)), []))
        else:
            if not out:
                out.append((TASK, False, []))
            out[-1][2].append(step)
    return out or [(TASK, False, [])]


def scripted_replies(trace: dict[str, Any]) -> list[str]:
    """What the model "says", step after step across all turns (scripted_steps counts the
    assistant headers of the whole conversation): each turn's calls then an answer, with the
    attempted call as the last call of the last turn."""
    replies: list[str] = []
    plan = turns(trace)
    for i, (_, _, steps) in enumerate(plan):
        replies += [call(function_name(s["tool"]), **s["arguments"]) for s in steps]
        if i == len(plan) - 1:
            attempted = trace["attempted_call"]
            replies.append(call(function_name(attempted["tool"]), **attempted["arguments"]))
        replies.append(ANSWER)
    return replies


def play(engine, servers, hub, trace: dict[str, Any], approve=None) -> tuple[ToolLoop, list[AgentEvent], list[TurnResult]]:
    """The scenario's trace as a live conversation on a fresh policy and session."""
    events: list[AgentEvent] = []
    loop = ToolLoop(engine, hub, RuleOfTwo(servers, hub.tools), params=PARAMS, approve=approve,
                    on_event=events.append)
    with scripted_steps(engine.tokenizer, scripted_replies(trace)):
        results = [loop.run(text, untrusted=untrusted) for text, untrusted, _ in turns(trace)]
    return loop, events, results


def attempted_record(events: list[AgentEvent], trace: dict[str, Any]):
    """The call record of the attempted call, from its one "decision" event."""
    attempted = trace["attempted_call"]
    matching = [e.call for e in events if e.kind == "decision"
                and (e.call.tool, e.call.arguments) == (attempted["tool"], attempted["arguments"])]
    assert len(matching) == 1, [e.as_dict() for e in events if e.kind == "decision"]
    return matching[0]


def sent(outbox: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in outbox.read_text().splitlines()] if outbox.exists() else []


def assert_played(results: list[TurnResult], trace: dict[str, Any]) -> None:
    """Every turn answered, and every trace step ran as it did offline: allowed, with the
    scenario's canned result (so the policy judged the attempted call on the same history)."""
    assert [r.finish for r in results] == ["answer"] * len(results), [(r.finish, r.note) for r in results]
    records = [c for r in results for s in r.steps for c in s.calls]
    expected = [(s["tool"], s["arguments"]) for s in trace["steps"] if "tool" in s] + [
        (trace["attempted_call"]["tool"], trace["attempted_call"]["arguments"])]
    assert [(c.tool, c.arguments) for c in records] == expected
    for record, step in zip(records, [s for s in trace["steps"] if "tool" in s]):
        assert record.decision.decision == "allow", (record.tool, record.decision.reasons)
        assert record.result.text == step["result"] and not record.result.error


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_scenario_through_the_live_loop(engine, path, tmp_path):
    scenario = json.loads(path.read_text())
    trace, expected = scenario["trace"], scenario["expected"]
    attempted = {"tool": trace["attempted_call"]["tool"], "arguments": trace["attempted_call"]["arguments"]}
    outbox = tmp_path / "outbox.jsonl"
    asked: list[tuple[str, str]] = []

    def yes(call_, decision) -> bool:
        asked.append((call_.tool, decision.decision))
        return True

    with hub_for(live_config(path, scenario, outbox, tmp_path / "mcp.json")) as (servers, hub):
        # The servers list the scenario's tools as written: the live policy judges the same tools
        # `tools check` does. (A scenario whose config hid tools with "tools": allow/deny would
        # differ here on purpose: the hub drops them, TOOLS.json does not.)
        listed = {t.id: (t.description, t.input_schema, t.annotations) for t in hub.tools}
        assert listed == {f"{t['server']}.{t['name']}": (t["description"], t["inputSchema"], t["annotations"])
                          for t in scenario["tools"]}

        # A block is never put to a human, so a willing one is offered: it must not be asked.
        loop, events, results = play(engine, servers, hub, trace, approve=yes if expected["decision"] == "block" else None)
        assert_played(results, trace)
        record = attempted_record(events, trace)
        assert {"decision": record.decision.decision, "flags": record.decision.flags} == expected, record.decision.reasons
        assert asked == []

        if expected["decision"] == "allow":
            assert record.approved is None and record.result.text == "done" and not record.result.error
            assert sent(outbox) == [attempted]
            return

        # Stopped: it never reached the server, and the model was told why in its next prompt.
        assert sent(outbox) == []
        assert record.result == RuleOfTwo.stopped_result(record.decision)
        assert record.result.text in engine.decode(loop.ids)
        if expected["decision"] == "block":
            assert record.approved is None
            return

        # An "ask" nobody could answer was refused; a human who says yes lets it run, once.
        assert record.approved is False
        loop, events, results = play(engine, servers, hub, trace, approve=yes)
        assert_played(results, trace)
        record = attempted_record(events, trace)
        assert record.decision.decision == "ask" and record.approved is True
        assert asked == [(attempted["tool"], "ask")]
        assert record.result.text == "done" and not record.result.error
        assert sent(outbox) == [attempted]
