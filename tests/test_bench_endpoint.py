"""Endpoint benchmark: SSE parsing and stream accounting without a server, then a real run."""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import pytest
from server_util import running_server

from mlxlocal.bench.common import percentile, summarize
from mlxlocal.bench.endpoint import measure_endpoint, run_endpoint_bench
from mlxlocal.bench.prompts import load_prompt_file, synthetic_prompts
from mlxlocal.bench.sse import SSEParser, StreamAccount, account_stream
from mlxlocal.errors import EndpointBenchError
from mlxlocal.server import ServerConfig

ROLE = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}


def sse(obj) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def delta(**d) -> dict:
    return {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}


def finish(reason="stop") -> dict:
    return {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}


def usage(prompt=5, completion=3) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                                     "total_tokens": prompt + completion}}


def stream_bytes(*parts: str) -> bytes:
    return b"".join([sse(ROLE)] + [sse(delta(content=p)) for p in parts]
                    + [sse(finish()), sse(usage(completion=len(parts))), sse("[DONE]")])


# --- parser -------------------------------------------------------------------------------------
def test_fragmented_bytes_one_at_a_time():
    raw = stream_bytes("Hel", "lo", " world")
    acc = account_stream((float(i), raw[i:i + 1]) for i in range(len(raw)))
    assert acc.ok and acc.done and acc.content == "Hello world"
    assert acc.usage_tokens("completion_tokens") == 3 and acc.finish_reason == "stop"
    assert len(acc.output_times) == 3  # role chunk, finish, usage and [DONE] carry no output
    # each event is stamped with the read that completed it: the last byte of its line
    ends = [raw.index(sse(delta(content=p))) + len(sse(delta(content=p))) - 2 for p in ("Hel", "lo", " world")]
    assert acc.output_times == [float(e) for e in ends]


def test_data_line_split_across_chunks_and_line_endings():
    p = SSEParser()
    assert p.feed(b"da", 1.0) == []
    assert p.feed(b'ta: {"a"', 2.0) == []
    assert p.feed(b": 1}\r", 3.0) == [] and p.pending  # the line ended (CR); the event has not
    evs = p.feed(b"\n\r\n: keep-alive comment\n\nevent: ping\ndata: x\ndata: y\rid: 7\r\r", 4.0)
    assert [(e.data, e.event, e.t) for e in evs] == [('{"a": 1}', None, 3.0), ("x\ny", "ping", 4.0)]
    assert evs[1].id == "7" and p.comments == 1


def test_multibyte_utf8_split_across_chunks():
    text = "héllo 世界 🎉 ok"
    raw = stream_bytes(text)
    # split every 1..3 bytes, so every multi-byte character is cut somewhere
    chunks, i, n = [], 0, 1
    while i < len(raw):
        chunks.append((float(i), raw[i:i + n]))
        i, n = i + n, n % 3 + 1
    acc = account_stream(chunks)
    assert acc.ok and acc.content == text and "\ufffd" not in acc.content


def test_bom_and_leading_space_rules():
    p = SSEParser()
    evs = p.feed("\ufeffdata:no-space\n\ndata:  two\n\n".encode(), 1.0)
    assert [e.data for e in evs] == ["no-space", " two"]


def test_streamed_tool_call_arguments_assembled_by_index():
    parts = [
        ROLE,
        delta(tool_calls=[{"index": 0, "id": "call_a", "type": "function",
                           "function": {"name": "get_weather", "arguments": ""}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": '{"ci'}}]),
        delta(tool_calls=[{"index": 1, "id": "call_b", "type": "function",
                           "function": {"name": "get_time", "arguments": '{"tz": '}}]),
        delta(tool_calls=[{"index": 0, "function": {"arguments": 'ty": "Paris"}'}}]),
        delta(tool_calls=[{"index": 1, "function": {"arguments": '"UTC"}'}}]),
        finish("tool_calls"),
        "[DONE]",
    ]
    acc = account_stream((float(i), sse(p)) for i, p in enumerate(parts))
    assert acc.ok and acc.finish_reason == "tool_calls"
    calls = acc.tool_calls
    assert [(c.id, c.name) for c in calls.values()] == [("call_a", "get_weather"), ("call_b", "get_time")]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    assert json.loads(calls[1].arguments) == {"tz": "UTC"}
    assert acc.ttft == 1.0 and acc.gen_time == 4.0  # tool-call deltas are output


def test_reasoning_counts_as_output_role_chunk_does_not():
    parts = [(0.5, sse(ROLE)), (1.0, sse(delta(reasoning_content="hmm"))),
             (1.5, sse(delta(content="yes"))), (1.6, sse(finish())), (1.6, sse("[DONE]"))]
    acc = account_stream(parts, t_start=0.0)
    assert acc.ttft == 1.0 and acc.reasoning == "hmm" and acc.content == "yes"
    assert acc.output_text == "hmmyes"


def test_usage_absent():
    raw = b"".join([sse(ROLE), sse(delta(content="abc")), sse(finish()), sse("[DONE]")])
    acc = account_stream([(1.0, raw)])
    assert acc.ok and acc.usage is None and acc.usage_tokens("completion_tokens") is None


def test_late_final_chunk_does_not_change_generation_time():
    """Tokens at 1.0 .. 1.4 s, then the finish/usage chunks and [DONE] arrive 5 s later."""
    parts = [(0.2, sse(ROLE))] + [(1.0 + 0.1 * i, sse(delta(content=f"t{i}"))) for i in range(5)]
    parts += [(6.0, sse(finish())), (6.0, sse(usage(completion=9))), (6.5, sse("[DONE]"))]
    acc = account_stream(parts, t_start=0.0)
    assert acc.ttft == pytest.approx(1.0)
    assert acc.gen_time == pytest.approx(0.4)
    assert acc.tpot(acc.usage_tokens("completion_tokens")) == pytest.approx(0.4 / 8)  # usage, not chunks
    assert acc.itls == pytest.approx([0.1] * 4)
    assert acc.e2e == pytest.approx(6.5)


def test_error_object_mid_stream():
    raw = b"".join([sse(ROLE), sse(delta(content="a")),
                    sse({"error": {"message": "engine exploded", "type": "server_error"}}), sse("[DONE]")])
    acc = account_stream([(1.0, raw)])
    assert not acc.ok and acc.error == "stream_error" and acc.error_message == "engine exploded"


def test_error_event_with_plain_text_data():
    acc = account_stream([(1.0, sse(ROLE) + b"event: error\ndata: overloaded\n\n")])
    assert acc.error == "stream_error" and acc.error_message == "overloaded"


def test_done_missing_but_finished_is_ok():
    raw = b"".join([sse(ROLE), sse(delta(content="a")), sse(finish()), sse(usage(completion=1))])
    acc = account_stream([(1.0, raw)], t_close=2.0)
    assert acc.ok and not acc.done and acc.e2e == 2.0


def test_connection_closed_mid_stream_is_truncated():
    raw = sse(ROLE) + sse(delta(content="a")) + b'data: {"choices": [{"delta": {"cont'
    acc = account_stream([(1.0, raw)])
    assert acc.error in ("truncated", "bad_json") and acc.content == "a"
    acc = account_stream([(1.0, sse(ROLE) + sse(delta(content="a")))])
    assert acc.error == "truncated"


def test_unterminated_last_event_is_kept_at_close():
    raw = sse(ROLE) + sse(delta(content="a")) + b'data: {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}'
    acc = account_stream([(1.0, raw)])
    assert acc.ok and acc.finish_reason == "length"


def test_stream_account_ignores_events_after_done():
    acc = StreamAccount()
    acc.feed_bytes(sse(delta(content="a")) + sse("[DONE]") + sse(delta(content="b")), 1.0)
    acc.close(2.0)
    assert acc.content == "a" and acc.t_end == 1.0


# --- statistics and prompts ---------------------------------------------------------------------
def test_percentiles():
    xs = [float(i) for i in range(1, 101)]
    assert percentile(xs, 50) == pytest.approx(50.5)
    assert percentile(xs, 99) == pytest.approx(99.01)
    s = summarize([3.0, 1.0, 2.0])
    assert s["p50"] == 2.0 and s["mean"] == 2.0 and s["min"] <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    assert summarize([])["p50"] is None


def test_synthetic_prompts_vary_and_are_deterministic():
    a = synthetic_prompts(3, 32)
    b = synthetic_prompts(3, 32)
    assert [p.text for p in a] == [p.text for p in b]
    assert len({p.text[:40] for p in a}) == 3  # distinct openings: no free prefix-cache hit
    assert all(len(p.text) <= 32 * 4 for p in a)
    same = synthetic_prompts(3, 32, vary=False)
    assert len({p.text for p in same}) == 1


def test_prompt_file(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    assert [p.text for p in load_prompt_file(str(txt), 3)] == ["first prompt", "second prompt", "first prompt"]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "a"}\n"b"\n{"messages": [{"role": "user", "content": "c"}]}\n')
    ps = load_prompt_file(str(jl), 3)
    assert [p.messages[-1]["content"] for p in ps] == ["a", "b", "c"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"nope": 1}\n')
    with pytest.raises(EndpointBenchError, match="bad.jsonl:1"):
        load_prompt_file(str(bad), 1)
    with pytest.raises(EndpointBenchError, match="does not exist"):
        load_prompt_file(str(tmp_path / "missing.txt"), 1)


# --- the bench over a scripted transport --------------------------------------------------------
def _run(handler, **kw):
    kw.setdefault("model", "no-such-model-for-a-tokenizer")
    return asyncio.run(measure_endpoint("http://bench.test/v1", requests=kw.pop("requests", 4),
                                        concurrency=2, prompt_tokens=8, gen_tokens=3,
                                        transport=httpx.MockTransport(handler), **kw))


def test_http_errors_and_mid_stream_errors_are_counted_by_kind():
    def handler(request: httpx.Request) -> httpx.Response:
        n = int(json.loads(request.content)["messages"][0]["content"].split(".")[0].split()[-1])
        if n == 0:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        if n == 1:
            body = sse(ROLE) + sse({"error": {"message": "boom"}}) + sse("[DONE]")
        else:
            body = stream_bytes("a", "b", "c")
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    r = _run(handler)
    assert r["errors"] == {"http_503": 1, "stream_error": 1}
    assert r["error_samples"]["http_503"] == "busy" and r["completed"] == 2 and r["failed"] == 2
    assert r["token_count_method"] == "usage" and r["total_completion_tokens"] == 6


def test_no_usage_falls_back_and_says_so():
    def handler(request):
        body = b"".join([sse(ROLE), sse(delta(content="abcdefgh")), sse(finish()), sse("[DONE]")])
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    r = _run(handler)
    assert r["completed"] == 4 and r["token_count_method"] == "chars/4 estimate"
    assert r["total_completion_tokens"] == 4 * 2
    assert any("no usage" in n for n in r["notes"])


def test_rejected_ignore_eos_is_dropped_and_noted():
    seen = []

    def handler(request):
        body = json.loads(request.content)
        seen.append("ignore_eos" in body)
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["temperature"] == 0 and body["max_tokens"] == 3
        if "ignore_eos" in body:
            return httpx.Response(400, json={"error": {"message": "Unrecognized request argument: ignore_eos"}})
        return httpx.Response(200, content=stream_bytes("x", "y", "z"), headers={"content-type": "text/event-stream"})

    r = _run(handler, requests=4)  # concurrency 2: two requests may be rejected at once
    assert r["completed"] == 4 and r["errors"] == {}
    assert seen[0] is True and seen[-1] is False
    assert any("ignore_eos" in n for n in r["notes"])


def test_total_time_bound():
    async def slow_stream():
        yield sse(ROLE)
        await asyncio.sleep(30)

    def handler(request):
        return httpx.Response(200, content=slow_stream(), headers={"content-type": "text/event-stream"})

    r = _run(handler, timeout=0.5)
    assert r["errors"] == {"timeout": 4} and r["completed"] == 0
    assert r["duration_s"] < 5


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch):
    # A None entry in sys.modules makes `import matplotlib` raise ImportError, as on a machine
    # without it (the dev extra installs it, so this is the only way to see the message here).
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(EndpointBenchError, match="pip install matplotlib"):
        run_endpoint_bench("http://127.0.0.1:9", "m", plot="out.png")


# --- against a real `mlxlocal serve` ------------------------------------------------------------
def test_bench_against_mlxlocal_serve(tiny_model, capsys):
    with running_server(ServerConfig(models=[str(tiny_model)])) as (base_url, _app):
        result = run_endpoint_bench(base_url, str(tiny_model), concurrency=4, requests=8,
                                    prompt_tokens=16, gen_tokens=8, as_json=True)
    printed = json.loads(capsys.readouterr().out)
    assert printed["completed"] == result["completed"] == 8
    assert result["failed"] == 0 and result["errors"] == {}
    assert result["token_count_method"] == "usage"
    assert result["prompt_token_count_method"] == "usage"
    assert result["total_completion_tokens"] > 0 and result["total_prompt_tokens"] >= 8 * 16
    for key in ("ttft_s", "e2e_s"):
        s = result[key]
        assert s["n"] == 8 and 0 < s["p50"] <= s["p90"] <= s["p99"] <= s["max"]
    itl = result["itl_s"]
    if itl["n"]:
        assert itl["p50"] <= itl["p90"] <= itl["p99"]
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    assert result["prompt_source"].startswith("synthetic, ~16 tokens (tokenizer:")


# --- --compare-url: the same load against two real servers ------------------------------------
def test_compare_url_against_a_second_server(tiny_model, capsys):
    import typer
    from typer.testing import CliRunner

    from mlxlocal.cli.bench import register

    app = typer.Typer()
    register(app)
    app.callback()(lambda: None)
    with running_server(ServerConfig(models=[str(tiny_model)])) as (first, _), \
            running_server(ServerConfig(models=[str(tiny_model)], served_model_names=["other"])) as (second, _):
        result = CliRunner().invoke(app, ["bench", "endpoint", "--url", first, "--compare-url", second,
                                          "-c", "2", "--requests", "4", "-p", "16", "-g", "6", "-n", "2",
                                          "--json"])
    assert result.exit_code == 0, result.output
    res = json.loads(result.stdout.strip().splitlines()[-1])
    assert [row["url"] for row in res["rows"]] == [first, second]
    assert res["order"] == [first, second, second, first]
    # each server is sent the name it lists
    assert [row["model"] for row in res["rows"]] == [str(tiny_model), "other"]
    for row in res["rows"]:
        assert row["completed"] == 8 and row["failed"] == 0 and row["errors"] == []
        assert row["aggregate_tps"] > 0 and row["ttft_p50_s"] > 0
        assert row["single_decode_tps"] > 0 and row["stream_decode_tps_p50"] > 0
        assert len(row["aggregate_tps_runs"]) == 2
    assert res["rows"][0]["aggregate_ratio"] == 1.0
    assert res["rows"][1]["aggregate_ratio"] == pytest.approx(res["rows"][1]["aggregate_tps"]
                                                              / res["rows"][0]["aggregate_tps"])


def test_compare_url_needs_url_and_distinct_servers():
    from mlxlocal.bench.endpoint_compare import compare_endpoints

    with pytest.raises(EndpointBenchError, match="different servers"):
        compare_endpoints(["http://127.0.0.1:9/v1", "127.0.0.1:9"], "m")


def test_compare_url_sends_prompts_no_server_has_seen(monkeypatch):
    # vllm-mlx and rapid-mlx keep prefix caches on disk: fixed prompts would be their cache hits
    from mlxlocal.bench import endpoint_compare

    sent: list[tuple[str, int, int]] = []

    async def fake(url, model, *, concurrency, requests, prompt_tokens, gen_tokens, seed, timeout):
        sent.append((url, concurrency, seed))
        return dict(output_throughput=1.0, ttft_s={"p50": 0.1}, decode_tps_per_request={"p50": 1.0},
                    completed=requests, failed=0, errors=[])

    monkeypatch.setattr(endpoint_compare, "measure_endpoint", fake)
    urls = ["http://a:1", "http://b:2"]
    names = {u: "m" for u in urls}

    def seeds_of(res_seed=None):
        sent.clear()
        res = endpoint_compare.compare_endpoints(urls, names=names, repeats=2, seed=res_seed)
        by_server = {u: [s for v, c, s in sent if v == u] for u in urls}
        return res["seed"], by_server

    seed1, first = seeds_of()
    seed2, second = seeds_of()
    assert first[urls[0]] == first[urls[1]]  # within one comparison every server gets the same
    assert len(set(first[urls[0]])) == 4  # two loads and two single requests, all distinct
    assert seed1 != seed2 and not set(first[urls[0]]) & set(second[urls[0]])
    again, fixed = seeds_of(seed1)  # a given seed reproduces a comparison
    assert again == seed1 and fixed == first


def test_a_served_synthetic_model_is_counted_with_its_own_tokenizer(tmp_path, monkeypatch):
    # `bench --url` against `mlxlocal serve --model synthetic:tiny`: the name is no Hub repo, but
    # the model was built on this machine, so prompts are sized in its tokens, not chars / 4.
    from mlxlocal.bench.prompts import TokenCounter
    from mlxlocal.source import synthetic

    monkeypatch.setenv("MLXLOCAL_HOME", str(tmp_path))
    assert TokenCounter(None, "synthetic:tiny").count("hello world")[1] == "chars/4 estimate"  # not built
    synthetic.materialize("synthetic:tiny", quiet=True)
    n, method = TokenCounter(None, "synthetic:tiny").count("hello world, " * 20)
    assert method == f"tokenizer:{tmp_path / 'synthetic' / 'tiny_fp32'}" and n > 0
