"""AKV cache engineering on the server (server/prompt.py), with the official openai and anthropic
clients: sessions (X-Session-Id), drop_message / reposition / drop_rule on the three chat
routes, the --kv-compact policy, usage's drop_skipped_tokens and repos_tokens.

The server runs the tiny agent model (64k context) on a small KV pool: 20 tool outputs of
~300 tokens do not fit it whole, and fit it once keep-last-12 drops the older ones."""

from __future__ import annotations

import threading
import time

import anthropic
import httpx
import openai
import pytest
from conftest import wait_for
from server_util import running_server, steered_output

from mlxlocal.edits import parse_policy

BLOCK = 16
POOL_BLOCKS = 360  # 5760 tokens: the 20-output conversation (~7.5k tokens) does not fit whole
SESSION = "X-Session-Id"


@pytest.fixture(scope="module")
def server(agent_model):
    from mlxlocal.server import ServerConfig

    config = ServerConfig(models=[str(agent_model)], max_sessions=4,
                          engine_options=dict(kv_blocks=POOL_BLOCKS, block_size=BLOCK, max_num_seqs=2),
                          kv_compact=parse_policy("keep-last-tool-outputs=12"))
    with running_server(config) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def model(server) -> str:
    return server[1].state.registry.models[0].name


@pytest.fixture(scope="module")
def engine(server):
    return server[1].state.registry.models[0].engine


@pytest.fixture(scope="module")
def oai(server):
    c = openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key="x", max_retries=0, timeout=120)


def session(name: str) -> dict:
    return {"extra_headers": {SESSION: name}}


def tool_output(k: int) -> str:
    return " ".join(f"file{k} line {i}: the quick brown fox jumps over the lazy dog" for i in range(11))


def agent_messages(n_tools: int) -> list[dict]:
    """OpenAI chat messages: system, task, then n (tool call, ~300-token tool output) pairs."""
    msgs = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Read the files."}]
    for k in range(n_tools):
        msgs += [{"role": "assistant", "content": None,
                  "tool_calls": [{"id": f"call{k}", "type": "function",
                                  "function": {"name": "read_file", "arguments": f'{{"path": "f{k}"}}'}}]},
                 {"role": "tool", "tool_call_id": f"call{k}", "content": tool_output(k)}]
    return msgs


def extra(usage, name: str):
    return (usage.model_extra or {}).get(name)


@pytest.fixture
def captured(engine, monkeypatch):
    """Record what the routes submit (prompt, session, edits) and run it without edits: the
    mapping from request indices to token spans is checked here whatever the engine does."""
    calls: list[dict] = []
    original = engine.submit

    def submit(prompt, params=None, session=None, cancel=None, loop=None, edits=None):
        calls.append({"prompt": list(prompt), "session": session, "edits": list(edits or [])})
        return original(prompt, params, session=session, cancel=cancel, loop=loop)

    monkeypatch.setattr(engine, "submit", submit)
    return calls


def dropped_text(engine, call: dict) -> list[str]:
    ids = call["prompt"]
    return [engine.decode(ids[a:b]) for e in call["edits"] for a, b in e.drop]


# --- sessions -------------------------------------------------------------------------------------
def test_session_pins_its_conversation(oai, model, engine):
    """A session's KV stays when other requests fill the pool: its second turn reads the
    first from the cache. Without a session the radix cache evicts it (the control)."""
    def two_turns(k: int, **kwargs) -> tuple:
        first = [{"role": "user", "content": tool_output(k)}]
        r1 = oai.chat.completions.create(model=model, messages=first, max_tokens=2, **kwargs)
        for j in range(3):  # ~2.5k tokens each, no session: together more than the pool
            oai.chat.completions.create(model=model, max_tokens=1, messages=[
                {"role": "user", "content": " ".join([tool_output(200 + 10 * k + j)] * 8)}])
        second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                          {"role": "user", "content": "and then?"}]
        return r1, oai.chat.completions.create(model=model, messages=second, max_tokens=2, **kwargs)

    r1, r2 = two_turns(100)
    assert r2.usage.prompt_tokens_details.cached_tokens < r1.usage.prompt_tokens // 2  # evicted
    r1, r2 = two_turns(101, **session("pin"))
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - BLOCK
    assert extra(r2.usage, "drop_skipped_tokens") == 0 and extra(r2.usage, "repos_tokens") == 0


def test_session_id_in_the_body_is_the_same_session(oai, model, server):
    oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=1,
                                extra_body={"session_id": "body-id"})
    assert "body-id" in server[1].state.registry.models[0].sessions.held
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=1,
                                    extra_body={"session_id": "a"}, **session("b"))
    assert e.value.body["param"] == "session_id" and SESSION in e.value.body["message"]


def test_sessions_are_capped_least_recently_used_first(oai, model, server):
    held = server[1].state.registry.models[0].sessions.held
    for k in range(6):
        oai.chat.completions.create(model=model, messages=[{"role": "user", "content": f"hi {k}"}], max_tokens=1,
                                    **session(f"cap{k}"))
    assert len(held) == 4 and list(held)[-4:] == ["cap2", "cap3", "cap4", "cap5"]


def test_a_busy_session_is_a_409(oai, model, engine):
    token = engine.tokenizer.encode("a", add_special_tokens=False)[0]
    with steered_output(lambda history: token):  # never EOS: the first request runs until closed
        stream = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "long"}],
                                             max_tokens=2000, stream=True, **session("busy"))
        next(iter(stream))
        with pytest.raises(openai.ConflictError) as e:
            oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "again"}],
                                        max_tokens=1, **session("busy"))
        assert "already generating" in e.value.body["message"] and e.value.body["param"] == SESSION
        stream.close()
    assert wait_for(lambda: engine.stats()["running"] == 0, 30)
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "again"}], max_tokens=1,
                                    **session("busy"))
    assert r.choices[0].finish_reason in ("stop", "length")


def test_sessions_unit_lru_and_expiry():
    from mlxlocal.server.registry import Sessions

    class S:
        busy = False

    class E:
        def new_session(self):
            return S()

    eng, sessions = E(), Sessions(cap=2, idle=10.0)
    a, _ = sessions.get(eng, "a")
    b, _ = sessions.get(eng, "b")
    assert sessions.get(eng, "a")[0] is a  # the same id: the same session, now most recent
    b.busy = True
    c, evicted = sessions.get(eng, "c")
    assert evicted == [a] and list(sessions.held) == ["b", "c"]  # b is older, but generating
    b.busy = False
    _, evicted = sessions.get(eng, "d")
    assert evicted == [b] and list(sessions.held) == ["c", "d"]
    assert sessions.get(E(), "c")[0] is not c  # another engine (a reload): a new session
    assert len(sessions.expired(time.monotonic() + 11)) == 2 and not sessions.held


def test_sessions_unit_make_room():
    """Idle sessions never pin the room a request needs: the engine would wait for it for ever."""
    from mlxlocal.server.registry import Sessions

    class S:
        def __init__(self, n):
            self.cached_len, self.busy = n, False

    sessions = Sessions(cap=8)
    held = {sid: S(n) for sid, n in (("a", 300), ("b", 300), ("c", 300))}
    sessions.held.update({sid: (s, None, 0.0) for sid, s in held.items()})
    assert sessions.make_room(1000, 100) == []  # 900 pinned + 100 fit
    held["a"].busy = True
    # a generates (its 300 stay pinned after), c is the request's own (in its 500)
    assert sessions.make_room(1000, 500, keep=held["c"]) == [held["b"]]
    assert list(sessions.held) == ["a", "c"]


# --- usage ----------------------------------------------------------------------------------------
def test_usage_fields_in_every_dialect(oai, claude, model):
    ask = [{"role": "user", "content": "hello there"}]
    r = oai.chat.completions.create(model=model, messages=ask, max_tokens=2, **session("u"))
    assert extra(r.usage, "drop_skipped_tokens") == 0 and extra(r.usage, "repos_tokens") == 0
    chunks = list(oai.chat.completions.create(model=model, messages=ask, max_tokens=2, stream=True,
                                              stream_options={"include_usage": True}, **session("u")))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0
    assert extra(chunks[-1].usage, "drop_skipped_tokens") == 0
    m = claude.messages.create(model=model, max_tokens=2, messages=ask, **session("ua"))
    assert extra(m.usage, "drop_skipped_tokens") == 0 and extra(m.usage, "repos_tokens") == 0
    deltas = [e for e in claude.messages.create(model=model, max_tokens=2, messages=ask, stream=True,
                                                **session("ua")) if e.type == "message_delta"]
    assert deltas[-1].usage.cache_read_input_tokens > 0 and extra(deltas[-1].usage, "repos_tokens") == 0
    resp = oai.responses.create(model=model, input="hello there", max_output_tokens=2, **session("ur"))
    assert extra(resp.usage, "drop_skipped_tokens") == 0
    events = list(oai.responses.create(model=model, input="hello there", max_output_tokens=2, stream=True,
                                       **session("ur")))
    done = [e for e in events if e.type in ("response.completed", "response.incomplete")][-1]
    assert done.response.usage.input_tokens_details.cached_tokens > 0
    assert extra(done.response.usage, "repos_tokens") == 0


# --- validation -----------------------------------------------------------------------------------
def bad_openai(oai, model, messages, body, headers=None) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=messages, max_tokens=1, extra_body=body,
                                    extra_headers=headers or {})
    return e.value.body


@pytest.mark.parametrize("body, param, words", [
    ({"drop_message": {"3": [1]}}, "drop_message", "X-Session-Id"),
    ({"reposition": [1]}, "reposition", "needs a session"),
    ({"drop_rule": "thinking_drop"}, "drop_rule", "needs a session"),
])
def test_drop_fields_need_a_session(oai, model, body, param, words):
    err = bad_openai(oai, model, agent_messages(2), body)
    assert err["param"] == param and words in err["message"]


@pytest.mark.parametrize("body, param, words", [
    ({"drop_message": [3]}, "drop_message", "must be an object"),
    ({"drop_message": {"9": [1]}}, "drop_message", "not a message of this request (0..5)"),
    ({"drop_message": {"3": [3]}}, "drop_message.3", "not before its trigger"),
    ({"drop_message": {"3": ["x"]}}, "drop_message.3", "message index"),
    ({"drop_message": {"3": [1]}, "drop_rule": "erase"}, "drop_rule", "message_drop, thinking_drop"),
    ({"drop_rule": "message_drop"}, "drop_rule", "drop_message is missing"),
    ({"drop_message": {"5": [3]}, "reposition": {"4": 1}}, "reposition", "must be a list"),
])
def test_bad_drop_fields_name_the_field(oai, model, body, param, words):
    err = bad_openai(oai, model, agent_messages(2), body, {SESSION: "bad"})
    assert err["param"] == param and words in err["message"], err


def test_anthropic_system_prompt_cannot_be_dropped(claude, model):
    messages = [{"role": "system", "content": "extra rules"}, {"role": "user", "content": "a"},
                {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model, max_tokens=1, system="base", messages=messages,
                               extra_body={"drop_message": {"3": [0]}}, **session("sys"))
    assert "drop_message.3" in e.value.message and "system prompt" in e.value.message
    with pytest.raises(anthropic.BadRequestError) as e:  # no session
        claude.messages.create(model=model, max_tokens=1, messages=messages[1:],
                               extra_body={"drop_message": {"2": [0]}})
    assert "drop_message" in e.value.message and SESSION in e.value.message


def test_responses_items_of_one_turn_leave_together(oai, model):
    items = [{"role": "user", "content": "go"},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
             {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "result"},
             {"role": "user", "content": "next"}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=model, input=items, max_output_tokens=1, extra_body={"drop_message": {"4": [2]}},
                             **session("items"))
    assert e.value.body["param"] == "drop_message.4" and "drop them together" in e.value.body["message"]


# --- index mapping (what reaches the engine) ---------------------------------------------------------
def test_openai_drop_message_spans(oai, model, engine, captured):
    msgs = agent_messages(3)  # 0 system, 1 user, 2/3, 4/5, 6/7 call and output
    oai.chat.completions.create(model=model, messages=msgs, max_tokens=1,
                                extra_body={"drop_message": {"5": [3], "7": [5]}, "reposition": [4, 6]},
                                **session("map"))
    call = captured[-1]
    assert call["session"] is not None and len(call["edits"]) == 2
    first, second = dropped_text(engine, call)
    assert "file0 line 10" in first and "file1" not in first and "call" not in first
    assert "file1 line 10" in second and "file2" not in second
    ids = call["prompt"]
    assert engine.decode(ids[call["edits"][0].at:]).startswith("<|im_start|>user\n<tool_response>\nfile1")
    assert [engine.decode(ids[a:b]).count("read_file") for a, b in call["edits"][0].reposition] == [1]


def test_anthropic_indices_are_its_messages(claude, model, engine, captured):
    messages = [{"role": "user", "content": "Read the files."}]
    for k in range(2):
        messages += [{"role": "assistant", "content": [
                         {"type": "thinking", "thinking": f"I need file {k}", "signature": "x"},
                         {"type": "tool_use", "id": f"t{k}", "name": "read_file", "input": {"path": f"f{k}"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{k}",
                                                   "content": tool_output(k)}]}]
    claude.messages.create(model=model, max_tokens=1, system="Be an agent.", messages=messages,
                           extra_body={"drop_message": {"4": [2]}}, **session("anth"))
    [text] = dropped_text(engine, captured[-1])
    assert "file0 line 10" in text and "file1" not in text  # the system prompt has no index: 2 is tool result 0
    claude.messages.create(model=model, max_tokens=1, system="Be an agent.", messages=messages,
                           extra_body={"drop_message": {"4": [1, 3]}, "drop_rule": "thinking_drop"},
                           **session("anth2"))
    # tool results are not user turns: both replies follow the last user message and show their think block
    texts = dropped_text(engine, captured[-1])
    assert texts == ["<think>\nI need file 0\n</think>", "<think>\nI need file 1\n</think>"]


def test_responses_indices_are_its_input_items(oai, model, engine, captured):
    items = [{"role": "user", "content": "Read the files."}]
    for k in range(2):
        items += [{"type": "function_call", "call_id": f"c{k}", "name": "read_file", "arguments": "{}"},
                  {"type": "function_call_output", "call_id": f"c{k}", "output": tool_output(k)}]
    oai.responses.create(model=model, input=items, instructions="Be an agent.", max_output_tokens=1,
                         extra_body={"drop_message": {"4": [2]}}, **session("resp"))
    [text] = dropped_text(engine, captured[-1])
    assert "file0 line 10" in text and "file1" not in text


def test_policy_applies_to_sessions_only(oai, model, engine, captured):
    msgs = agent_messages(13)  # fits the pool whole: the engine runs it without the edits here
    oai.chat.completions.create(model=model, messages=msgs[:2 + 2 * 12], max_tokens=1, **session("pol"))
    assert captured[-1]["edits"] == []  # 12 outputs: none is older than the last 12
    oai.chat.completions.create(model=model, messages=msgs, max_tokens=1, **session("pol"))
    [edit] = captured[-1]["edits"]
    [text] = dropped_text(engine, captured[-1])
    assert "file0 line 10" in text and "file1" not in text
    assert engine.decode(captured[-1]["prompt"][edit.at:]).startswith("<|im_start|>user\n<tool_response>\nfile12")
    oai.chat.completions.create(model=model, messages=msgs, max_tokens=1)  # no session: no policy
    assert captured[-1]["edits"] == [] and captured[-1]["session"] is None
    oai.chat.completions.create(model=model, messages=msgs, max_tokens=1,  # the request's own fields win
                                extra_body={"drop_message": {"27": [3, 5]}}, **session("pol2"))
    assert len(captured[-1]["edits"]) == 1


# --- acceptance: the engine drops -------------------------------------------------------------------
def test_keep_last_12_stays_within_the_pool(oai, model, engine):
    """A session's 20 tool outputs under the server's keep-last-12: every turn fits the pool
    and the last reports dropped tokens; the same conversation uncompacted does not fit."""
    msgs = agent_messages(20)
    last = None
    for n in range(4, 21, 4):  # the agent's turns: 4 more tool outputs each time
        last = oai.chat.completions.create(model=model, messages=msgs[:2 + 2 * n], max_tokens=2, **session("akv"))
        assert last.choices[0].finish_reason in ("stop", "length")
    assert last.usage.prompt_tokens > POOL_BLOCKS * BLOCK
    assert extra(last.usage, "drop_skipped_tokens") > 0
    assert last.usage.prompt_tokens_details.cached_tokens > 0  # the session's earlier turns were reused
    with pytest.raises(openai.BadRequestError) as e:  # no session, no policy: the whole prompt
        oai.chat.completions.create(model=model, messages=msgs, max_tokens=2)
    assert "KV blocks" in e.value.body["message"]


def test_explicit_drops_and_reposition_report_usage(claude, model):
    """Anthropic's indices, 20 short tool results, keep-last-12 by hand plus reposition."""
    messages = [{"role": "user", "content": "Read the files."}]
    for k in range(20):
        messages += [{"role": "assistant", "content": [{"type": "tool_use", "id": f"t{k}", "name": "read_file",
                                                        "input": {"path": f"f{k}"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"t{k}",
                                                   "content": f"file{k}: the quick brown fox jumps over the dog"}]}]
    results = [i for i, m in enumerate(messages) if i and m["role"] == "user"]
    drops = {str(results[j + 12]): [results[j]] for j in range(len(results) - 12)}
    body = {"drop_message": drops, "reposition": list(range(len(messages)))}
    with claude.messages.stream(model=model, max_tokens=2, messages=messages, extra_body=body,
                                **session("explicit")) as stream:
        deltas = [e for e in stream if e.type == "message_delta"]
    usage = deltas[-1].usage
    assert extra(usage, "drop_skipped_tokens") > 0 and extra(usage, "repos_tokens") > 0
    # the next turn of the session reuses the edited cache: nothing re-rotated twice
    again = claude.messages.create(model=model, max_tokens=2, extra_body=body, messages=messages + [
        {"role": "assistant", "content": "done"}, {"role": "user", "content": "thanks"}], **session("explicit"))
    assert again.usage.cache_read_input_tokens > 0
    assert extra(again.usage, "drop_skipped_tokens") >= extra(usage, "drop_skipped_tokens")


def test_concurrent_sessions_do_not_share(oai, model):
    """Two sessions at once: each gets its own reply (no 409 between different ids)."""
    errors: list[BaseException] = []

    def turn(name):
        try:
            oai.chat.completions.create(model=model, messages=[{"role": "user", "content": name}], max_tokens=3,
                                        **session(name))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=turn, args=(f"par{k}",)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_header_is_documented_in_cors(server):
    """Browsers may send the header: CORS allows any request header."""
    r = httpx.options(server[0] + "/v1/chat/completions",
                      headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                               "Access-Control-Request-Headers": "x-session-id"})
    assert r.status_code == 200 and "x-session-id" in r.headers.get("access-control-allow-headers", "").lower()


def test_a_message_the_template_rerenders_is_named_by_the_requests_index(claude, model):
    """chatml (as Qwen3's) hides the think block of replies before the last user message:
    such a reply's tokens differ from its own render, so no drop can name them."""
    messages = [{"role": "user", "content": "first"},
                {"role": "assistant", "content": [{"type": "thinking", "thinking": "pondering", "signature": "x"},
                                                  {"type": "text", "text": "an answer"}]},
                {"role": "user", "content": "second"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=model, max_tokens=1, system="sys", messages=messages,
                               extra_body={"drop_message": {"2": [0]}}, **session("rerender"))
    assert "drop_message: the chat template renders messages 1 differently" in e.value.message


@pytest.mark.parametrize("policy, words", [
    ("keep-last-tool-outputs=0", "needs a count >= 1"),
    ("compact", "unknown policy 'compact'"),
    ("reposition", "reposition closes the gaps drops leave"),
])
def test_serve_refuses_a_bad_policy(policy, words, tmp_path):
    from typer.testing import CliRunner

    from mlxlocal.cli import app

    out = CliRunner().invoke(app, ["serve", "--model", str(tmp_path), "--kv-compact", policy],
                             env={"COLUMNS": "200"})
    assert out.exit_code == 2 and "--kv-compact" in out.output and words in out.output, out.output


def test_banner_shows_sessions_and_policy():
    from mlxlocal.server import ServerConfig
    from mlxlocal.server.banner import banner_text
    from mlxlocal.server.registry import ModelRegistry

    config = ServerConfig(models=["m"], kv_compact=parse_policy("keep-last-tool-outputs=12,reposition"),
                          max_sessions=8, session_idle=600.0)
    text = banner_text(config, ModelRegistry(config.models, {}, float("inf")))
    assert "sessions X-Session-Id: up to 8 per model, freed after 600 s idle" in text
    assert "--kv-compact keep-last-tool-outputs=12,reposition" in text
    assert "--kv-compact off" in banner_text(ServerConfig(models=["m"]), ModelRegistry(["m"], {}, float("inf")))


def test_responses_indices_continue_after_the_previous_response(oai, model, engine, captured):
    """With previous_response_id the stored conversation's items come first (its input, then
    its output), then this request's input."""
    from server_util import scripted_output

    first = [{"role": "user", "content": "Read the files."},
             {"type": "function_call", "call_id": "c0", "name": "read_file", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c0", "output": tool_output(0)}]
    with scripted_output(engine.tokenizer, "Noted."):
        r1 = oai.responses.create(model=model, input=first, max_output_tokens=8, **session("prev"))
    assert [o.type for o in r1.output] == ["message"]  # items 0-2 its input, 3 its output
    more = [{"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": tool_output(1)}]
    oai.responses.create(model=model, input=more, previous_response_id=r1.id, max_output_tokens=1,
                         extra_body={"drop_message": {"5": [2]}}, **session("prev"))
    [text] = dropped_text(engine, captured[-1])
    assert "file0 line 10" in text and "file1" not in text
