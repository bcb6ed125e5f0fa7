"""`--kv-compact` in the front ends and `bench --scenario agent --akv` (issue 17, AKV).

What must hold: the message spans the front ends record tile each prompt and decode to each
message's text (template glue included), with think blocks found in replies; without a
policy the prompts are what they were and no edits are sent; with one, the agent loop and the
REPL send the policy's cumulative edits every step, a long session drops tokens and /stats
says how many; the bench's numbers agree with each other (drops attend fewer tokens, text
engineering prefills more, drops cost less). No timing is asserted.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from agent_util import call, scripted_steps
from conftest import FAMILY_CONFIGS, build_tiny
from rich.console import Console
from typer.testing import CliRunner

from mlxlocal.agents.loop import ToolLoop
from mlxlocal.agents.policy import RuleOfTwo
from mlxlocal.agents.types import ServerConfig, ToolInfo, ToolResult
from mlxlocal.cli import app
from mlxlocal.edits import CompactionPolicy, parse_policy
from mlxlocal.edits.spans import ConversationSpans, token_bounds
from mlxlocal.engine import SamplingParams, open_engine
from mlxlocal.engine.base import EngineBase
from mlxlocal.repl.agent import AgentRepl
from mlxlocal.repl.chat import ChatRepl
from mlxlocal.source.loader import load, load_from_dir

TOOLS = [{"type": "function", "function": {"name": "files__read_file", "description": "Read a file",
                                           "parameters": {"type": "object"}}}]


def result_text(k: int, lines: int = 30) -> str:
    return "\n".join(f"file{k}.txt line {n}: the quick brown fox {k * 100 + n}" for n in range(lines))


def reply_ids(eng, text: str) -> list[int]:
    return list(eng.tokenizer.encode(text, add_special_tokens=False))


def tool_call_message(k: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{k}", "type": "function", "function": {"name": "files__read_file", "arguments": {"path": f"{k}"}}}]}


# --- spans ---------------------------------------------------------------------------------------
def test_token_bounds():
    pieces = ["ab", "cd", "e", "fgh"]

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    # "abcd|e|fgh": boundaries at 4 and 5 chars; one inside a token goes to the earlier side
    assert token_bounds(decode, [0, 1, 2, 3], [4, 5, 8]) == [2, 3, 4]
    assert token_bounds(decode, [0, 1, 2, 3], [3]) == [2]


@pytest.fixture(scope="module")
def qwen(agent_model) -> EngineBase:
    return EngineBase(load_from_dir(agent_model))


def decoded(eng, ids, spans) -> list[str]:
    return [eng.decode(ids[a:b]) for a, b in spans]


def test_spans_tile_the_prompt_and_decode_to_each_message(qwen):
    spans = ConversationSpans(parse_policy("keep-last-tool-outputs=1,drop-thinking"))
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "read the files"}]
    prompt = spans.prompt(qwen, conv, [], None, TOOLS)
    assert prompt == qwen.encode_chat(conv, tools=TOOLS)
    assert spans.edits(conv) == []  # nothing to drop yet
    generated = reply_ids(qwen, "<think>which file first?</think>" + call("files__read_file", path="0"))
    spans.replied(qwen, prompt, generated)
    ids = prompt + generated
    conv += [tool_call_message(0), {"role": "tool", "content": result_text(0)},
             {"role": "tool", "content": result_text(1)}]
    prompt = spans.prompt(qwen, conv, ids, 2, TOOLS)
    assert prompt == ids + qwen.encode_continuation(conv[:2], conv[3:], tools=TOOLS)
    edits = spans.edits(conv)
    kept = spans._pending.spans
    # The spans tile the prompt (the generation prompt ends the last message's span).
    assert kept[0][0] == 0 and all(a[1] == b[0] for a, b in zip(kept, kept[1:]))
    text = decoded(qwen, prompt, kept[:-1] + [(kept[-1][0], len(prompt))])
    assert "be brief" in text[0] and "files__read_file" in text[0]  # the tools render in the system turn
    assert text[1].startswith("<|im_start|>user") and "read the files" in text[1]
    assert "which file first?" in text[2] and text[2].rstrip().endswith("<|im_end|>")
    assert result_text(0) in text[3] and result_text(1) not in text[3]
    assert result_text(1) in text[4] and text[4].endswith("<|im_start|>assistant\n")
    # The reply's think block, markers included.
    a, b = spans._pending.thinks[2]
    assert qwen.decode(prompt[a:b]) == "<think>which file first?</think>"
    # keep-last-tool-outputs=1: the first result leaves when the second arrives.
    [edit] = edits
    assert edit.at == kept[4][0] and edit.drop == (kept[3],) and edit.reposition == ()


@pytest.mark.parametrize("family, system", [("llama", "be brief"), ("mistral", None), ("mistral", "be brief"),
                                            ("qwen2", None)])
def test_spans_in_other_templates(family, system, tiny_models):
    """Llama 3's headers, Mistral's [INST] (with a system prompt its template cannot be
    continued: the whole conversation is encoded each turn), ChatML."""
    eng = EngineBase(load_from_dir(tiny_models[family]))
    spans = ConversationSpans(parse_policy("drop-thinking"))
    conv = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "hello there"}]
    ids: list[int] = []
    for k, reply in enumerate(["the quick brown fox", "jumps over the lazy dog"]):
        reply_at = len(conv) - 2 if ids else None
        prompt = spans.prompt(eng, conv, ids, reply_at)
        assert spans.edits(conv) == []
        if family == "mistral" and system:
            # Its template writes the system prompt into the last user turn: no message spans,
            # so no edits (dropping by wrong spans would cut the wrong tokens).
            assert spans._pending is None and "does not render message 0 (system)" in spans.note
            return
        layout = spans._pending.spans
        assert layout[0][0] == 0 and all(a[1] == b[0] for a, b in zip(layout, layout[1:]))
        for m, (a, b) in zip(conv, layout):
            assert m["content"] in eng.decode(prompt[a:b]), (family, m, eng.decode(prompt[a:b]))
        generated = reply_ids(eng, reply)
        spans.replied(eng, prompt, generated)
        ids = prompt + generated
        conv = conv + [{"role": "assistant", "content": reply}, {"role": "user", "content": f"and then {k}?"}]


def test_reposition_and_full_encodes_agree(qwen):
    policy = CompactionPolicy(keep_tool_outputs=1, reposition=True)
    conv = [{"role": "user", "content": "go"}]
    for k in range(3):
        conv += [tool_call_message(k), {"role": "tool", "content": result_text(k, 5)}]
    # A whole conversation encoded at once gets the same kind of spans as one built step by step.
    whole = ConversationSpans(policy)
    prompt = whole.prompt(qwen, conv, [], None, TOOLS)
    edits = whole.edits(conv)
    layout = whole._pending.spans
    assert len(layout) == len(conv) and layout[-1][1] <= len(prompt)
    assert [e.at for e in edits] == [layout[4][0], layout[6][0]]
    assert edits[0].drop == (layout[2],) and edits[1].drop == (layout[4],)
    # Everything cached after the first gap moves up to close it.
    assert edits[0].reposition == ((layout[3][0], layout[4][0]),)
    for k, (a, b) in zip(range(3), layout[2::2]):
        assert result_text(k, 5) in qwen.decode(prompt[a:b])


def test_without_a_policy_nothing_changes(qwen):
    spans = ConversationSpans()
    conv = [{"role": "user", "content": "hi"}]
    prompt = spans.prompt(qwen, conv, [], None)
    assert prompt == qwen.encode_chat(conv) and spans.edits(conv) is None
    generated = reply_ids(qwen, "hello")
    spans.replied(qwen, prompt, generated)
    conv += [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    assert spans.prompt(qwen, conv, prompt + generated, 1) == prompt + generated + qwen.encode_continuation(
        conv[:1], conv[2:])
    assert spans.spans() == []  # nothing rendered twice


def test_a_prompt_without_reply_is_forgotten(qwen):
    spans = ConversationSpans(parse_policy("drop-thinking"))
    conv = [{"role": "user", "content": "hi"}]
    prompt = spans.prompt(qwen, conv, [], None)
    spans.replied(qwen, prompt, reply_ids(qwen, "<think>x</think>hello"))
    ids = prompt + reply_ids(qwen, "<think>x</think>hello")
    refused = conv + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "too long"}]
    spans.prompt(qwen, refused, ids, 1)  # say the engine refused it: no replied()
    again = conv + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "short"}]
    prompt = spans.prompt(qwen, again, ids, 1)
    [edit] = spans.edits(again)
    a, b = edit.drop[0]
    assert qwen.decode(prompt[a:b]) == "<think>x</think>" and edit.at == spans._pending.spans[2][0]


# --- the agent loop and the REPLs on the engine -------------------------------------------------------
class FileHub:
    """An MCP hub stand-in: one read-only tool whose results are a few hundred tokens."""

    tools = [ToolInfo("files", "read_file", "Read a file", {"type": "object", "properties": {
        "path": {"type": "string"}}}, {"readOnlyHint": True})]
    failed: dict = {}
    tools_version = 0

    def call(self, tool_id, arguments, timeout=60, cancel=None):
        return ToolResult(result_text(int(arguments.get("path", 0))))


SERVERS = [ServerConfig("files", "test.json", command="files")]


@pytest.fixture(scope="module")
def engine(agent_model):
    eng = open_engine(load(str(agent_model)), max_num_seqs=1)
    yield eng
    eng.shutdown()


class Recording:
    """The real engine; every generate's edits kept."""

    def __init__(self, engine):
        self.engine, self.edits = engine, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, *args, **kw):
        self.edits.append(kw.get("edits"))
        return self.engine.generate(*args, **kw)


def test_tool_loop_sends_cumulative_edits_and_drops(engine):
    rec = Recording(engine)
    replies = [call("files__read_file", path=str(k)) for k in range(5)] + ["All read."]
    loop = ToolLoop(rec, FileHub(), RuleOfTwo(SERVERS, FileHub.tools), params=SamplingParams(max_tokens=60),
                    max_steps=8, compact=parse_policy("keep-last-tool-outputs=2"))
    with scripted_steps(engine.tokenizer, replies):
        result = loop.run("read the files 0 to 4")
    assert result.finish == "answer" and len(result.steps) == 6
    # Each step's edit list extends the last one: the engine matches it against the session.
    assert rec.edits[0] == [] and len(rec.edits[-1]) == 3
    for before, now in zip(rec.edits, rec.edits[1:]):
        assert now[:len(before)] == before
    conv = loop.conversation()
    layout = loop.conv.spans.spans()
    tools = [i for i, m in enumerate(conv) if m["role"] == "tool"]
    for i in tools:
        a, b = layout[i]
        assert conv[i]["content"] in engine.decode(loop.ids[a:b])
    assert [e.drop for e in rec.edits[-1]] == [(layout[i],) for i in tools[:3]]
    dropped = [s.stats.dropped_tokens for s in result.steps]
    assert dropped[:3] == [0, 0, 0] and dropped[3] > 0 and dropped[-1] == sum(b - a for a, b in
                                                                           (layout[i] for i in tools[:3]))
    assert loop.session.dropped_len == dropped[-1]
    assert loop.transcript()["dropped_tokens_per_step"] == dropped


def test_agent_repl_stats_show_dropped_and_attended(engine):
    out = io.StringIO()
    repl = AgentRepl(engine, Console(file=out, width=200), SERVERS, FileHub(), max_steps=8,
                     params=SamplingParams(max_tokens=60), compact=parse_policy("keep-last-tool-outputs=1"))
    replies = [call("files__read_file", path=str(k)) for k in range(3)] + ["Done."]
    with scripted_steps(engine.tokenizer, replies):
        repl.turn("read three files")
    assert "dropped from the KV cache" in out.getvalue()  # the step lines say it
    repl.command("/stats")
    text = out.getvalue()
    m = re.search(r"session\s+(\d+) tokens attended \(in the KV cache\), (\d+) dropped", text)
    assert m and int(m[2]) > 0 and int(m[1]) == repl.session.cached_len
    assert "compact  keep-last-tool-outputs=1" in text and re.search(r"engine [1-9]\d* tokens dropped", text)


def test_chat_repl_drops_old_thinking(engine):
    out = io.StringIO()
    repl = ChatRepl(engine, Console(file=out, width=200), params=SamplingParams(max_tokens=40),
                    compact=parse_policy("drop-thinking"))
    with scripted_steps(engine.tokenizer, ["<think>let me think</think>Hi.", "<think>again</think>Yes."]):
        repl.turn("hello")
        repl.turn("more")
    assert repl.last_stats.dropped_tokens == len(engine.tokenizer.encode("<think>let me think</think>",
                                                                         add_special_tokens=False))
    assert f"cached, {repl.last_stats.dropped_tokens} dropped from the KV cache) · reply" in out.getvalue()
    repl.command("/stats")
    assert f"{repl.session.dropped_len} dropped" in out.getvalue() and repl.session.dropped_len > 0


# --- the CLI ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["chat", "-m", "x", "--kv-compact", "keep-last-tool-outputs=0"], "keep-last-tool-outputs needs a count"),
    (["chat", "-m", "x", "--kv-compact", "forget-everything"], "unknown policy 'forget-everything'"),
    (["run", "-m", "x", "--mcp", "none.json", "--kv-compact", "drop-thinking=2", "task"], "unknown policy"),
])
def test_bad_policy_is_a_clear_error(args, message):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "--kv-compact" in result.output and message in result.output, result.output


@pytest.mark.parametrize("args, message", [
    (["akv", "--compare", "mlx-lm"], "--compare"),  # not an option of akv: it runs its own modes
    (["akv", "--akv-keep", "0"], "--akv-keep must be >= 1"),
    (["akv", "-p", "100"], "-p"),  # it sizes its own trace
    (["akv", "--cached-discount", "2"], "--cached-discount must be in [0, 1]"),
    (["agent", "--akv-keep", "3"], "--akv-keep"),  # akv's, not agent's
])
def test_bad_bench_options(args, message):
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 2 and message in result.output, result.output


# --- the bench -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench_model(tmp_path_factory) -> Path:
    """A 4k context: the trace's tool results are scaled down to fit, so the run stays short."""
    return build_tiny(tmp_path_factory.mktemp("akv") / "qwen3",
                      dict(FAMILY_CONFIGS["qwen3"], vocab_size=4096, max_position_embeddings=4096))


def test_akv_bench_numbers_are_consistent(bench_model):
    result = CliRunner().invoke(app, ["bench", "akv", "-m", str(bench_model),
                                      "--turns", "8", "--akv-keep", "2", "-g", "4", "-n", "2", "--json"])
    assert result.exit_code == 0, result.output
    a = json.loads(result.output.strip().splitlines()[-1])["akv"]
    assert a["steps"] == 8 and a["keep"] == 2 and a["modes"] == ["standard", "akv_drop", "akv_drop_reposition", "text"]
    assert a["final_prompt_tokens"] <= a["context"] and a["prices"]["cached_input"] == 0.1
    assert a["repeats"] == 2 and all(a["runs"][m]["passes"] == 2 for m in a["modes"])
    t, r = a["totals"], a["ratios_vs_standard"]
    runs = a["runs"]
    assert all(len(runs[m]["steps"]) == 8 for m in a["modes"])
    # The same conversation in every AKV mode: the same prompts.
    prompts = {m: [s["prompt_tokens"] for s in runs[m]["steps"]] for m in a["modes"]}
    assert prompts["standard"] == prompts["akv_drop"] == prompts["akv_drop_reposition"]
    assert t["standard"]["dropped_tokens_last"] == 0 and t["text"]["dropped_tokens_last"] == 0
    for mode in ("akv_drop", "akv_drop_reposition"):
        assert t[mode]["dropped_tokens_last"] > 0
        assert t[mode]["attended_mean"] < t["standard"]["attended_mean"]
        assert t[mode]["attended_last"] < t["standard"]["attended_last"]
        assert t[mode]["peak_blocks"] <= t["standard"]["peak_blocks"]
        assert r[mode]["cost"] < 1
        assert t["text"]["prefill_tokens"] > t[mode]["prefill_tokens"]
    assert any(s["repositioned_tokens"] > 0 for s in runs["akv_drop_reposition"]["steps"])
    assert all(s["repositioned_tokens"] == 0 for s in runs["akv_drop"]["steps"])
    # Text engineering attends fewer tokens too (placeholders), but pays in prefill.
    assert t["text"]["attended_last"] < t["standard"]["attended_last"]
    assert r["text"]["prefill_tokens"] > 1
    # The table prints too.
    table = CliRunner().invoke(app, ["bench", "akv", "-m", str(bench_model),
                                     "--turns", "6", "--akv-keep", "2", "-g", "2"])
    assert table.exit_code == 0 and "akv_drop_reposition" in table.output and "API cost" in table.output


def test_a_dense_engine_is_refused_up_front():
    from types import SimpleNamespace

    from mlxlocal.repl.chat import compact_refusal

    dense = SimpleNamespace(kv_pool={"kind": "dense", "reason": "chunked attention"},
                            info=SimpleNamespace(name="llama4"))
    paged = SimpleNamespace(kv_pool={"kind": "paged"}, info=SimpleNamespace(name="qwen3"))
    policy = parse_policy("keep-last-tool-outputs=4")
    assert compact_refusal(dense, policy) == ("--kv-compact needs the paged KV cache; llama4 runs on a dense "
                                              "cache (chunked attention)")
    assert compact_refusal(paged, policy) is None
    assert compact_refusal(dense, None) is None and compact_refusal(dense, parse_policy("off")) is None


def test_the_cli_passes_the_policy_on(monkeypatch, tmp_path):
    import mlxlocal.repl.agent
    import mlxlocal.repl.chat

    seen = {}
    monkeypatch.setattr(mlxlocal.repl.chat, "run_chat", lambda model, **kw: seen.update(chat=kw["compact"]) or 0)
    monkeypatch.setattr(mlxlocal.repl.agent, "run_agent_chat", lambda model, mcp, **kw: seen.update(mcp=kw["compact"]) or 0)
    monkeypatch.setattr(mlxlocal.repl.agent, "run_task", lambda model, mcp, task, **kw: seen.update(run=kw["compact"]) or 0)
    runner = CliRunner()
    config = tmp_path / "mcp.json"
    for args in (["chat", "-m", "x"], ["chat", "-m", "x", "--mcp", str(config)], ["run", "-m", "x", "--mcp", str(config), "go"]):
        result = runner.invoke(app, [*args, "--kv-compact", "keep-last-tool-outputs=3,reposition"])
        assert result.exit_code == 0, result.output
    assert seen["chat"] == seen["mcp"] == seen["run"] == CompactionPolicy(3, False, True)
