"""`serve --prompt-lookup`: every dialect's per-request opt-out ("speculative": false;
Ollama options.speculative), a non-bool a 400 naming the field, greedy text the same with
and without speculation (official openai and anthropic clients), the engine's counters on
/metrics, /health and the banner saying speculation is on."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from server_util import running_server

from mlxlocal.engine import SpeculationChoice
from mlxlocal.server import ServerConfig
from mlxlocal.server.banner import banner_text

REPEATING = "alpha beta gamma delta, alpha beta gamma delta, alpha beta gamma delta, alpha beta"
MAX = 24


@pytest.fixture(scope="module")
def server(tiny_model):
    # What `serve -m MODEL --prompt-lookup --num-draft-tokens 3` configures (test_spec_cli checks that mapping).
    config = ServerConfig(models=[str(tiny_model)],
                          engine_options={"speculative": SpeculationChoice("lookup", None, 3)})
    with running_server(config) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def model(server) -> str:
    return server[1].state.registry.models[0].name


def drafted(server) -> int:
    """The engine's spec_drafted counter, as /metrics exports it."""
    text = httpx.get(server[0] + "/metrics").text
    line = next(line for line in text.splitlines() if line.startswith("mlxlocal_spec_draft_tokens "))
    return int(float(line.split()[-1]))


def engine_stats(server) -> dict:
    return server[1].state.registry.models[0].engine.stats()


def test_openai_client_same_text_with_and_without_speculation(server, model):
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
    ask = dict(model=model, messages=[{"role": "user", "content": REPEATING}], max_tokens=MAX, temperature=0)
    before = drafted(server)
    spec = client.chat.completions.create(**ask)
    after_spec = drafted(server)
    plain = client.chat.completions.create(**ask, extra_body={"speculative": False})
    after_plain = drafted(server)
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert spec.usage.completion_tokens == plain.usage.completion_tokens > 1
    assert after_spec > before  # the speculative request drafted ...
    assert after_plain == after_spec  # ... the opted-out one did not
    assert engine_stats(server)["spec_drafted"] == after_plain


def test_openai_completions_opt_out(server, model):
    client = openai.OpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0)
    ask = dict(model=model, prompt=REPEATING, max_tokens=MAX, temperature=0)
    before = drafted(server)
    plain = client.completions.create(**ask, extra_body={"speculative": False})
    assert drafted(server) == before
    spec = client.completions.create(**ask)
    assert drafted(server) > before
    assert spec.choices[0].text == plain.choices[0].text


def test_anthropic_client_same_text_with_and_without_speculation(server, model):
    client = anthropic.Anthropic(base_url=server[0], api_key="x", max_retries=0, timeout=120)
    # temperature as a body field: this anthropic client version no longer takes it as an argument
    ask = dict(model=model, max_tokens=MAX, messages=[{"role": "user", "content": REPEATING}])
    greedy = {"temperature": 0}
    before = drafted(server)
    plain = client.messages.create(**ask, extra_body={**greedy, "speculative": False})
    assert drafted(server) == before
    spec = client.messages.create(**ask, extra_body=greedy)
    assert drafted(server) > before
    assert [b.model_dump() for b in spec.content] == [b.model_dump() for b in plain.content]


def test_responses_and_ollama_opt_out(server, model):
    url = server[0]
    for path, body in (
        ("/v1/responses", {"model": model, "input": REPEATING, "max_output_tokens": MAX, "temperature": 0,
                           "speculative": False}),
        ("/api/generate", {"model": model, "prompt": REPEATING, "stream": False,
                           "options": {"num_predict": MAX, "temperature": 0, "speculative": False}}),
    ):
        before = drafted(server)
        r = httpx.post(url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert drafted(server) == before, path
        body = {**body, "options": {**body["options"], "speculative": True}} if "options" in body \
            else {**body, "speculative": True}
        assert httpx.post(url + path, json=body, timeout=120).status_code == 200
        assert drafted(server) > before, path


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "speculative": "yes"}, "speculative"),
    ("/v1/completions", {"prompt": "hi", "speculative": 1}, "speculative"),
    ("/v1/responses", {"input": "hi", "speculative": "false"}, "speculative"),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], "speculative": "no"},
     "speculative"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "options": {"speculative": "yes"}},
     "options.speculative"),
    ("/api/generate", {"prompt": "hi", "options": {"speculative": 0}}, "options.speculative"),
])
def test_non_bool_speculative_is_a_400_naming_the_field(server, model, path, body, field):
    r = httpx.post(server[0] + path, json={"model": model, **body}, timeout=60)
    assert r.status_code == 400, r.text
    assert f"{field}: must be true or false" in r.text, r.text


def test_health_banner_and_metrics_say_speculation_is_on(server):
    url, app = server
    health = httpx.get(url + "/health").json()
    assert health["speculative"] == {"method": "lookup", "draft_model": None, "num_draft_tokens": 3}
    text = banner_text(app.state.config, app.state.registry, 8080)
    assert "spec     speculative decoding, prompt lookup, up to 3 draft tokens per step" in text
    metrics = httpx.get(url + "/metrics").text
    st = engine_stats(server)
    for series, key in (("mlxlocal_spec_verify_steps", "spec_steps"), ("mlxlocal_spec_draft_tokens", "spec_drafted"),
                        ("mlxlocal_spec_accepted_tokens", "spec_accepted")):
        line = next(line for line in metrics.splitlines() if line.startswith(series + " "))
        assert int(float(line.split()[-1])) == st[key], series
    value = {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
             if line.startswith("mlxlocal_spec_") and " " in line}
    assert st["spec_drafted"] > 0 and st["spec_rows"] >= st["spec_steps"] > 0
    assert value["mlxlocal_spec_acceptance_ratio"] == pytest.approx(st["spec_accepted"] / st["spec_drafted"])
    assert value["mlxlocal_spec_tokens_per_forward"] == pytest.approx(
        (st["spec_rows"] + st["spec_accepted"]) / st["spec_rows"])


def test_server_without_speculation_says_so(tiny_model):
    with running_server(ServerConfig(models=[str(tiny_model)])) as (url, app):
        assert httpx.get(url + "/health").json()["speculative"] is None
        assert "speculative" not in banner_text(app.state.config, app.state.registry, 8080)
        # the opt-out is accepted (and changes nothing) on a server that does not speculate
        r = httpx.post(url + "/v1/completions", json={"model": str(tiny_model), "prompt": "hi", "max_tokens": 2,
                                                      "speculative": False}, timeout=60)
        assert r.status_code == 200, r.text
