"""Property-based fuzzing of every numeric sampling field of every dialect, against a live
server: subnormals, ±0, float32's edges, huge and tiny values, negatives, ints past 2**63,
and bools / strings / null where a number is due. Never a 5xx, the engine never stops, and
a normal request works after. (test_server_fuzz.py fuzzes every field with generic hostile
values; this file goes deep on the numbers, where one value used to kill the process.)

The quick set runs a few hundred bodies; the slow set over 10,000 (CI's slow run). The
model's context is 48 tokens, so a body that asks for a long reply still costs little.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import mlx.core as mx
import pytest
from conftest import BASE, build_tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

M = "MODEL"
HI = [{"role": "user", "content": "hi"}]
# A valid body per route, two reply tokens (the second is fed the first), sampled
# (temperature 1, no top-k): the case in which a bad penalty went from NaN logits to an id
# past the vocabulary, read by the next forward.
ROUTES: dict[str, dict] = {
    "/v1/chat/completions": {"model": M, "messages": HI, "max_tokens": 2, "temperature": 1},
    "/v1/completions": {"model": M, "prompt": "hi", "max_tokens": 2, "temperature": 1},
    "/v1/responses": {"model": M, "input": "hi", "max_output_tokens": 2, "temperature": 1},
    "/v1/messages": {"model": M, "messages": HI, "max_tokens": 2, "temperature": 1},
    "/api/chat": {"model": M, "messages": HI, "stream": False,
                  "options": {"num_predict": 2, "temperature": 1, "top_k": 0}},
    "/api/generate": {"model": M, "prompt": "hi", "stream": False,
                      "options": {"num_predict": 2, "temperature": 1, "top_k": 0}},
}
_OPENAI = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
           "presence_penalty", "seed", "max_tokens", "n", "logit_bias"]
_OLLAMA = [f"options.{f}" for f in ("temperature", "top_p", "top_k", "min_p", "repeat_penalty",
                                    "frequency_penalty", "presence_penalty", "seed", "num_predict", "num_ctx",
                                    "thinking_budget")]
# Every numeric field each dialect reads (keep_alive is left out: 0 unloads the model).
FIELDS: dict[str, list[str]] = {
    "/v1/chat/completions": [*_OPENAI, "max_completion_tokens", "top_logprobs", "thinking_budget"],
    "/v1/completions": [*_OPENAI, "logprobs", "best_of"],
    "/v1/responses": ["temperature", "top_p", "max_output_tokens", "top_logprobs", "max_tool_calls",
                      "thinking_budget"],
    "/v1/messages": ["temperature", "top_p", "top_k", "max_tokens", "thinking.budget_tokens"],
    "/api/chat": _OLLAMA,
    "/api/generate": _OLLAMA,
}

F32_MAX, F32_TINY = 3.4028234663852886e38, 1.1754943508222875e-38  # largest, smallest normal
EDGES = [0, 0.0, -0.0, 5e-324, -5e-324, 1e-320, 2.2250738585072014e-308, 1.4e-45, 1e-39, F32_TINY,
         1e-38, 1e-30, 1e-10, 1e-5, 1.5e-5, 1e-4, 1e-3, 0.999, 1, 1.0, 2, 20, 21, 100, 100.5, 101,
         65504, 65520, F32_MAX, 3.5e38, 1e300, 1.7976931348623157e308, -1, -1e-39, -2, -2.0001, -100,
         -F32_MAX, -1e308, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), 10**30]
NUMBERS = st.one_of(
    st.sampled_from(EDGES),
    st.floats(allow_nan=False, allow_infinity=False),  # subnormals included
    st.floats(min_value=-1e-30, max_value=1e-30),
    st.floats(min_value=-3.0, max_value=3.0),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=-3, max_value=3000),
)
NOT_NUMBERS = st.one_of(st.none(), st.booleans(), st.sampled_from(["1", "0.5", "1e-39", "NaN", "", "inf"]),
                        st.sampled_from([float("nan"), float("inf"), float("-inf")]), st.just([1]), st.just({}))
# float32's subnormal and overflow ranges, where a value is nonzero and finite in JSON but
# 0 or infinite once the engine computes with it.
F32_EDGE_RANGES = st.one_of(st.floats(min_value=0.0, max_value=2e-38, exclude_min=True),
                            st.floats(min_value=1e37, max_value=1e39))
VALUES = st.one_of(st.sampled_from(EDGES), F32_EDGE_RANGES, NUMBERS, NOT_NUMBERS)


def _set(body: dict, field: str, value) -> None:
    if field == "logit_bias":
        body["logit_bias"] = {str(value) if isinstance(value, int) and value % 2 else "5": value}
    elif field == "thinking.budget_tokens":
        body["thinking"] = {"type": "enabled", "budget_tokens": value}
        body["max_tokens"] = 2048  # a budget must be >= 1024 and below max_tokens
    else:
        *path, last = field.split(".")
        target = body
        for key in path:
            target = target.setdefault(key, {})
        target[last] = value


@st.composite
def bodies(draw, route: str) -> bytes:
    body = json.loads(json.dumps(ROUTES[route]))
    # Mostly one field at a time: with several, one refused value hides what the others do.
    n = draw(st.sampled_from([1, 1, 1, 1, 2, 3]))
    for field in draw(st.lists(st.sampled_from(FIELDS[route]), min_size=n, max_size=n, unique=True)):
        _set(body, field, draw(VALUES))
        if field == "top_logprobs" and "messages" in body:
            body["logprobs"] = draw(st.sampled_from([True, False, None]))
    return json.dumps(body).encode()  # NaN / Infinity written as such: refused cleanly


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    from server_util import running_server

    from mlxlocal.server import ServerConfig

    model = build_tiny(tmp_path_factory.mktemp("ctx48") / "qwen3",
                       dict(BASE, model_type="qwen3", tie_word_embeddings=True, max_position_embeddings=48,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    with running_server(ServerConfig(models=[str(model)])) as (url, app):
        with httpx.Client(base_url=url, timeout=60) as client:  # one connection, kept alive
            yield client, app, app.state.registry.models[0].name


def _post(client: httpx.Client, route: str, raw: bytes, model: str) -> httpx.Response:
    return client.post(route, content=raw.replace(b'"MODEL"', json.dumps(model).encode()),
                       headers={"content-type": "application/json"})


def _fuzz(fuzz_server, route: str, examples: int) -> Counter:
    client, app, model = fuzz_server
    statuses: Counter = Counter()

    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(raw=bodies(route))
    def run(raw: bytes) -> None:
        r = _post(client, route, raw, model)
        statuses[r.status_code] += 1
        assert r.status_code < 500, (raw[:300], r.status_code, r.text[:300])
        if r.status_code >= 400:  # in the route's dialect, naming what is wrong
            assert r.headers["content-type"].startswith("application/json"), r.text[:200]

    t0 = time.perf_counter()
    run()
    print(f"{route}: {sum(statuses.values())} bodies in {time.perf_counter() - t0:.1f} s, {dict(statuses)}")
    assert sum(statuses.values()) >= examples * 0.9
    assert statuses[200] and statuses[400]  # both kinds were really generated
    engine = app.state.registry.models[0].engine
    assert engine.dead_reason is None
    assert client.get("/health").status_code == 200
    r = _post(client, route, json.dumps(ROUTES[route]).encode(), model)
    assert r.status_code == 200, r.text
    return statuses


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_numeric_fields_never_get_a_5xx(fuzz_server, route):
    _fuzz(fuzz_server, route, 50)


@pytest.mark.slow
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_numeric_fields_never_get_a_5xx_at_length(fuzz_server, route):
    _fuzz(fuzz_server, route, 1700)  # 6 routes: 10,200 bodies


def test_non_finite_logits_are_an_error_that_says_so_and_the_server_serves_on(fuzz_server, monkeypatch):
    client, app, model = fuzz_server
    body = {**ROUTES["/v1/chat/completions"], "model": model, "max_tokens": 4}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    engine = app.state.registry.models[0].engine
    forward = engine.runner.forward

    def spoiled(pools, seqs, n, after: int, **kw):
        logits = forward(pools, seqs, n, **kw)
        rows = mx.array([s.num_generated >= after for s in seqs])[:, None]
        # Tokens before the spoiled one are forced to an ordinary token: a sampled EOS would end
        # the reply before the NaN is reached.
        ordinary = mx.where(mx.arange(logits.shape[-1]) == 100, 0.0, -1e9).astype(logits.dtype)
        return mx.where(rows, mx.array(float("nan"), logits.dtype), ordinary)
    monkeypatch.setattr(engine.runner, "forward", lambda p, s, n, **kw: spoiled(p, s, n, 0, **kw))
    r = client.post("/v1/chat/completions", json=body)  # before any byte: a 500 naming it
    assert r.status_code == 500 and r.json()["error"]["code"] == "non_finite_logits", r.text
    assert "non-finite" in r.json()["error"]["message"]
    monkeypatch.setattr(engine.runner, "forward", lambda p, s, n, **kw: spoiled(p, s, n, 1, **kw))
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        text = s.read().decode()  # mid-stream: an error event, then the end of the stream
    assert s.status_code == 200 and '"code": "non_finite_logits"' in text.replace('":"', '": "'), text
    monkeypatch.setattr(engine.runner, "forward", lambda p, s, n, **kw: spoiled(p, s, n, 0, **kw))
    r = client.post("/api/generate", json={**ROUTES["/api/generate"], "model": model})
    assert r.status_code == 500 and "non-finite" in r.json()["error"], r.text
    monkeypatch.undo()
    assert engine.dead_reason is None and client.post("/v1/chat/completions", json=body).status_code == 200
