"""Served model names (--served-model-name) in every dialect, the startup banner, /metrics hygiene."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import anthropic
import httpx
import ollama
import openai
import pytest
from server_util import running_server

from mlxlocal.server import ServerConfig
from mlxlocal.server.banner import DIALECTS, banner_text
from mlxlocal.server.registry import ModelRegistry, assign_names
from mlxlocal.units import human_bytes

NAMES = ["tiny", "tiny-chat"]


@pytest.fixture(scope="module")
def named(tiny_model):
    config = ServerConfig(models=[str(tiny_model)], served_model_names=NAMES)
    with running_server(config) as (url, app):
        yield url, app


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --- the naming rule -----------------------------------------------------------------------

def test_assign_names_rule():
    assert assign_names(["a", "b"], []) == [["a"], ["b"]]
    assert assign_names(["a"], ["x", "y", "x"]) == [["x", "y"]]  # one model: all are its names
    assert assign_names(["a", "b"], ["x", "y"]) == [["x"], ["y"]]  # several: one each, in order


@pytest.mark.parametrize("specs, names, words", [
    (["a", "b", "c"], ["x", "y"], ["2 --served-model-name for 3 --model", "one --served-model-name per --model"]),
    (["a", "b"], ["x"], ["1 --served-model-name for 2 --model"]),
    (["a", "b"], ["x", "x"], ["'x' would refer to two models"]),
    (["a", "b"], ["b", "a"], ["'a' would refer to two models (--model a and --model b)"]),  # a name that is another model's spec
    (["a", "a"], [], ["--model a is given twice"]),
    (["a"], [" "], ["cannot be empty"]),
])
def test_ambiguous_names_are_refused(specs, names, words):
    with pytest.raises(ValueError) as e:
        assign_names(specs, names)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_cli_refuses_ambiguous_names_with_exit_2(tmp_path):
    env = dict(os.environ, MLXLOCAL_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "mlxlocal", "serve", "-m", "synthetic:tiny", "-m", "synthetic:tiny:q4",
                          "--served-model-name", "only-one"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2, out.stderr
    assert "one --served-model-name per --model" in out.stderr and "Traceback" not in out.stderr


# --- the banner ----------------------------------------------------------------------------

def test_banner_text(named):
    url, app = named
    config, registry = app.state.config, app.state.registry
    engine = registry.models[0].engine
    text = banner_text(config, registry)
    lines = text.splitlines()
    assert lines[0].endswith(f"serving on {url}")
    model_line = next(line for line in lines if "model" in line and "tiny" in line)
    assert model_line.split()[1] == "tiny"  # the first served name is the id
    also = model_line.split("also: ")[1].split(", ")
    assert also[:2] == ["tiny-chat", str(registry.models[0].spec)]
    blocks, size = engine.num_blocks, engine.config.block_size
    assert f"KV pool: {blocks} blocks × {size} tokens = {blocks * size:,} tokens" in text
    # 2 layers × K,V × 16 tokens × 2 heads × 16 dims × 4 bytes a block
    assert engine.pools.nbytes == blocks * 2 * 2 * 16 * 2 * 16 * 4
    assert f"{blocks * size:,} tokens, {human_bytes(engine.pools.nbytes)}" in text
    # It starts with room for a context and a prefill chunk, and says what it may grow to.
    most = engine.blocks.max_blocks
    assert blocks == (512 + 512) // 16 + 1 < most
    assert f"grows on demand to {most * size:,} tokens, {human_bytes(most * engine.pools.nbytes // blocks)}" in text
    assert f"APIs     {DIALECTS}" in text
    assert DIALECTS == ("OpenAI /v1/chat/completions /v1/completions /v1/responses /v1/models · Anthropic /v1/messages"
                        " · Ollama /api/chat /api/generate")
    assert lines[-1] == "  API key  off"


def test_banner_text_ipv6_key_and_unloaded_models():
    config = ServerConfig(models=["m1", "m2"], host="::1", port=9000, api_key="k",
                          served_model_names=["one", "two"])
    registry = ModelRegistry(config.models, {}, float("inf"), config.served_model_names)
    text = banner_text(config, registry)
    assert "serving on http://[::1]:9000" in text
    assert "model    one  (also: m1)" in text and "model    two  (also: m2)" in text
    assert text.count("KV pool: allocated when the model is first used") == 2
    assert text.endswith("API key  on")


# --- aliases through the official clients -------------------------------------------------

def test_openai_aliases(named, tiny_model):
    url, _ = named
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny-chat").id == "tiny-chat"  # responses echo the name asked for
    for name in ("tiny", "tiny-chat", str(tiny_model)):
        # greedy: a sampled first token may be EOS on random weights (0 completion tokens, a flaky test)
        r = client.chat.completions.create(model=name, messages=ask("hi"), max_tokens=2, temperature=0)
        assert r.model == name and r.usage.completion_tokens > 0
    r = client.completions.create(model="tiny-chat", prompt="hello", max_tokens=2)
    assert r.model == "tiny-chat"
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="tiny-chat2", messages=ask("hi"), max_tokens=2)
    assert "served: tiny" in str(e.value)


def test_anthropic_alias(named):
    client = anthropic.Anthropic(base_url=named[0], api_key="x", max_retries=0)
    r = client.messages.create(model="tiny-chat", max_tokens=2, messages=ask("hi"), extra_body={"temperature": 0})
    assert r.model == "tiny-chat" and r.usage.output_tokens > 0
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="nope", max_tokens=2, messages=ask("hi"))


def test_ollama_aliases(named):
    client = ollama.Client(host=named[0])
    assert [m.model for m in client.list().models] == ["tiny"]
    assert client.show("tiny-chat").details.family == "qwen3"
    r = client.chat(model="tiny-chat", messages=ask("hi"), options={"num_predict": 2})
    assert r.model == "tiny-chat" and r.done
    r = client.generate(model="tiny-chat", prompt="hi", options={"num_predict": 2})
    assert r.model == "tiny-chat" and r.done
    assert [m.model for m in client.ps().models] == ["tiny"]


def test_directory_names_do_not_shadow_served_names(tiny_models):
    """Swapped names: the qwen3 directory is served as "llama" and the llama one as "qwen3".
    Once loaded, each model also answers to its directory's name; that must not win."""
    qwen, llama = tiny_models["qwen3"], tiny_models["llama"]
    config = ServerConfig(models=[str(qwen), str(llama)], served_model_names=["llama", "qwen3"])
    with running_server(config) as (url, _):
        client = ollama.Client(host=url)
        assert [m.model for m in client.list().models] == ["llama", "qwen3"]
        assert client.show("llama").details.family == "qwen3"  # loaded: found names include "qwen3"
        assert client.show("qwen3").details.family == "llama"
        assert client.show(str(llama)).details.family == "llama"


# --- /metrics ------------------------------------------------------------------------------

def test_metrics_have_no_created_series(named):
    url, _ = named
    httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=60)
    text = httpx.get(f"{url}/metrics").text
    assert "mlxlocal_requests_total{" in text and "mlxlocal_time_to_first_token_seconds_count" in text
    assert [line for line in text.splitlines() if "_created" in line] == []


# --- the real command ----------------------------------------------------------------------

def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


def test_serve_prints_banner_once_and_answers_to_aliases(tiny_model, tmp_path):
    env = dict(os.environ, MLXLOCAL_HOME=str(tmp_path), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxlocal", "serve", "-m", str(tiny_model), "--port", "0",
         "--served-model-name", "tiny", "--served-model-name", "tiny-alias", "--kv-blocks", "64"],
        stderr=subprocess.PIPE, stdout=(tmp_path / "stdout").open("w"), text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True).start()
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("  API key") for line in seen):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "serve exited early:\n" + "".join(seen)
            seen.append(line)
        text = "".join(seen)
        url = re.search(r"serving on (http://127\.0\.0\.1:(\d+))", text)
        assert url and int(url[2]) > 0, text  # the port actually bound, not the 0 asked for
        assert text.index("Uvicorn running on") < text.index("serving on")  # listening already
        assert "model    tiny  (also: tiny-alias, " in text
        assert "KV pool: 64 blocks × 16 tokens = 1,024 tokens" in text and DIALECTS in text
        assert "API key  off" in text
        r = httpx.get(url[1] + "/v1/models/tiny-alias", timeout=30)
        assert r.status_code == 200 and r.json()["id"] == "tiny-alias"
        assert [m["id"] for m in httpx.get(url[1] + "/v1/models", timeout=30).json()["data"]] == ["tiny"]
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl+C: uvicorn shuts down gracefully
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    while (line := lines.get(timeout=10)) is not None:
        seen.append(line)
    text = "".join(seen)
    assert code == 0, text
    assert text.count("serving on") == 1 and "Finished server process" in text
    access_log = (tmp_path / "stdout").read_text()  # uvicorn's access log (on stdout) is kept
    assert 'GET /v1/models/tiny-alias HTTP/1.1" 200' in access_log


def test_no_file_paths_to_clients_unless_the_operator_asks(named, tiny_model):
    """Before: /api/show's modelfile said FROM /the/absolute/path, and the MCP models resource
    listed the --model path among a named model's aliases."""
    from mlxlocal.server.mcp_tools import model_card

    url, app = named
    path = str(tiny_model)
    seen = {p: httpx.get(url + p, timeout=30).text for p in ("/v1/models", "/api/tags", "/api/ps", "/health")}
    seen["/api/show"] = httpx.post(url + "/api/show", json={"model": "tiny"}, timeout=30).text
    seen["404"] = httpx.post(url + "/v1/chat/completions", json={"model": "nope", "messages": ask("hi")}).text
    seen["mcp"] = json.dumps(model_card(app.state.registry.models[0]))
    for where, text in seen.items():
        assert path not in text, where
    assert "FROM tiny\n" in httpx.post(url + "/api/show", json={"model": "tiny"}, timeout=30).json()["modelfile"]
    assert httpx.post(url + "/api/show", json={"model": path}, timeout=30).status_code == 200  # still served

    app.state.config.expose_paths = True  # --expose-paths
    try:
        show = httpx.post(url + "/api/show", json={"model": "tiny"}, timeout=30).json()
        assert f"FROM {path}" in show["modelfile"]
        assert path in model_card(app.state.registry.models[0], expose_paths=True)["aliases"]
    finally:
        app.state.config.expose_paths = False
