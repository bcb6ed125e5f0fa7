"""A session continued on another day keeps its prompt prefix in the cache.

tests/fixtures/date_change_sessions.json holds two turns each of the real Claude Code and
Codex CLI, recorded with turn 1 on one date and turn 2 on the next (trimmed: see its
"about"). Both clients keep what they sent before and add the new date at the end (Claude
Code a system entry, "The date has changed ...", Codex a new <environment_context>); an
older client may instead rewrite the date line where it was. Either way the client put the
date after the tools and instructions, so the rendered prompt must keep that order: turn 2
then finds as many tokens cached as it does on the same day (>= 95%). The quick tests
check the rendered token ids for each template that renders tools; the `slow` ones replay
the turns against a live server and read the cached-token counts the clients see.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import pytest
from server_util import running_server

from mlxlocal.engine import chat_format_of
from mlxlocal.server import ServerConfig
from mlxlocal.server.anthropic_request import convert_messages, convert_tools
from mlxlocal.server.pipeline import place_system_turns, renders_later_system
from mlxlocal.server.prompt import Origins
from mlxlocal.server.responses_items import chat_tools, input_messages
from mlxlocal.source.loader import load_from_dir

FIXTURE = Path(__file__).parent / "fixtures" / "date_change_sessions.json"
DAY1, DAY2 = "2026-12-01", "2026-12-02"
HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "x"}


@pytest.fixture(scope="module")
def url(agent_model):
    config = ServerConfig(models=[str(agent_model)], served_model_names=["tiny-agent"])
    with running_server(config) as (base, _):
        yield base


@pytest.fixture(scope="module")
def sessions() -> dict:
    return json.loads(FIXTURE.read_text())


def redated(body: dict, old: str, new: str) -> dict:
    return json.loads(json.dumps(body).replace(old, new))


def variants(sessions: dict, client: str) -> tuple[dict, dict, dict, dict]:
    """(turn 1, turn 2 as recorded: the new date appended, turn 2 with the old date line
    rewritten in place instead, turn 2 on the same day: no date added)."""
    turn1, turn2 = sessions[client]
    listed = "messages" if client == "claude_code" else "input"
    added = -1 if client == "claude_code" else -2  # the entry only a new day adds
    assert DAY2 in json.dumps(turn2[listed][added]) and DAY1 in json.dumps(turn1[listed])
    same_day = copy.deepcopy(turn2)
    del same_day[listed][added]
    return turn1, turn2, redated(same_day, DAY1, DAY2), same_day


def prompt_ids(tokenizer, client: str, body: dict) -> list[int]:
    """The prompt as the routes render it (their ChatRequests through pipeline.prepare)."""
    if client == "claude_code":
        messages = convert_messages(body)
        tools = convert_tools(body)
    else:
        messages, tools = input_messages(body["input"], None), chat_tools(body["tools"])[0]
    messages = place_system_turns(messages, chat_format_of(tokenizer))
    return list(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                              tokenize=True))


def shared(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# chatml: the tools in the system turn; llama3: in the first user turn.
@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("client", ["claude_code", "codex"])
def test_date_change_keeps_the_rendered_prefix(tiny_models, sessions, family, client):
    tokenizer = load_from_dir(tiny_models[family]).tokenizer
    turn1, appended, rewritten, same_day = (prompt_ids(tokenizer, client, body)
                                            for body in variants(sessions, client))
    same = shared(turn1, same_day)
    assert same > 4000 and same >= len(turn1) - 8  # all of turn 1 but its generation prompt
    found = {"appended": shared(turn1, appended) / same,
             "rewritten": shared(turn1, rewritten) / same}
    assert min(found.values()) >= 0.95, found


def test_later_system_turns_fold_for_a_template_that_refuses_them(tiny_models):
    """Mistral's template takes one system prompt, at the start: later system turns join it
    (the text kept, in order), and each keeps its origin for AKV's drop fields."""
    mistral, qwen = (load_from_dir(tiny_models[f]).chat_format for f in ("mistral", "qwen3"))
    assert not renders_later_system(mistral) and renders_later_system(qwen)
    body = {"system": "Be brief.", "messages": [
        {"role": "user", "content": "hi"}, {"role": "system", "content": "Today is Monday."},
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"},
        {"role": "system", "content": "The date has changed: Tuesday."}]}
    origins = Origins()
    messages = convert_messages(body, origins=origins)
    assert place_system_turns(messages, qwen) is messages  # rendered where they stand
    folded = place_system_turns(messages, mistral, origins)
    assert folded[0] == {"role": "system", "content": "Be brief.\n\nToday is Monday.\n\n"
                                                      "The date has changed: Tuesday."}
    assert [m["role"] for m in folded] == ["system", "user", "assistant", "user"]
    assert origins.owners[id(folded[0])] == {1, 4} and id(folded[0]) in origins.sealed
    text = mistral.render(folded, add_generation_prompt=True)
    assert "Today is Monday." in text and "Tuesday" in text
    # Without a system prompt of its own, the folded turns make one.
    alone = place_system_turns(convert_messages({"messages": body["messages"]}), mistral)
    assert alone[0] == {"role": "system",
                        "content": "Today is Monday.\n\nThe date has changed: Tuesday."}


def cached_messages(url: str, body: dict) -> int:
    body = {**body, "stream": False, "max_tokens": 1}
    r = httpx.post(f"{url}/v1/messages", json=body, headers=HEADERS, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["cache_read_input_tokens"]


def cached_responses(url: str, body: dict) -> int:
    body = {**body, "stream": False, "max_output_tokens": 1}
    r = httpx.post(f"{url}/v1/responses", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["input_tokens_details"]["cached_tokens"]


def ratios(url: str, send, turn1: dict, appended: dict, rewritten: dict,
           same_day: dict) -> dict[str, float]:
    """Turn 2's cached tokens after a date change over those on the same day. The changed
    turns go first: each finds only turn 1 (and the other changed turn, which shares no
    more with it) in the cache; the same-day turn may also find the appended one, which
    only raises the bar."""
    send(url, turn1)
    changed = {"appended": send(url, appended), "rewritten": send(url, rewritten)}
    same = send(url, same_day)
    assert same > 4000  # all of turn 1's prompt
    return {k: round(v / same, 3) for k, v in changed.items()}


@pytest.mark.slow
@pytest.mark.parametrize("client", ["claude_code", "codex"])
def test_date_change_keeps_the_prefix_cached(url, sessions, client):
    send = cached_messages if client == "claude_code" else cached_responses
    found = ratios(url, send, *variants(sessions, client))
    assert min(found.values()) >= 0.95, found
