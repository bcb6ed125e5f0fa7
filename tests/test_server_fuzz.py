"""Property-based fuzzing of every route with raw request bodies: never a 5xx, never a dead engine.

Each example starts from a valid body for the route and replaces one field (top level, or
inside `options` / the first message) with a hostile value: wrong types, NaN and infinities,
huge and negative integers, lone surrogates, deep nesting, long lists. Raw byte bodies
(truncated or deeply nested JSON, binary) are sent too. After each route's run a normal
request must still succeed, so a request that silently kills the engine fails here.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

MODEL_FIELD = "__model__"  # replaced by the served model's id

# A valid body per route (tiny max_tokens so the examples that do generate stay cheap).
ROUTES: dict[str, dict] = {
    "/v1/chat/completions": {"model": MODEL_FIELD, "max_tokens": 2, "temperature": 0,
                             "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": MODEL_FIELD, "max_tokens": 2, "prompt": "hi"},
    "/v1/messages": {"model": MODEL_FIELD, "max_tokens": 2,
                     "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/count_tokens": {"model": MODEL_FIELD, "messages": [{"role": "user", "content": "hi"}]},
    "/api/chat": {"model": MODEL_FIELD, "stream": False, "options": {"num_predict": 2},
                  "messages": [{"role": "user", "content": "hi"}]},
    "/api/generate": {"model": MODEL_FIELD, "stream": False, "prompt": "hi", "options": {"num_predict": 2}},
    "/api/show": {"model": MODEL_FIELD},
    "/v1/responses": {"model": MODEL_FIELD, "max_output_tokens": 2,
                      "input": [{"type": "message", "role": "user", "content": "hi"}]},
}
# Fields worth hitting besides the ones in the bodies above (sampling knobs of every dialect).
EXTRA_FIELDS = {
    "/v1/chat/completions": ["seed", "top_p", "top_k", "min_p", "n", "stop", "logprobs", "top_logprobs",
                             "frequency_penalty", "presence_penalty", "logit_bias", "tools",
                             "tool_choice", "stream", "stream_options", "response_format",
                             "max_completion_tokens", "repetition_penalty"],
    "/v1/completions": ["seed", "top_p", "top_k", "stop", "stream", "logprobs", "echo",
                        "frequency_penalty", "logit_bias", "temperature"],
    "/v1/messages": ["system", "temperature", "top_p", "top_k", "stop_sequences", "stream", "tools",
                     "tool_choice", "thinking", "metadata"],
    "/v1/messages/count_tokens": ["system", "tools"],
    "/api/chat": ["tools", "format", "keep_alive", "think", "stream"],
    "/api/generate": ["system", "template", "raw", "keep_alive", "format", "images", "think", "suffix"],
    "/api/show": ["name", "verbose"],
    "/v1/responses": ["instructions", "tools", "tool_choice", "temperature", "top_p", "stream", "store",
                      "previous_response_id", "reasoning", "text", "include", "parallel_tool_calls",
                      "truncation", "max_tool_calls", "top_logprobs", "background", "prompt", "metadata"],
}
OPTION_FIELDS = ["num_predict", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                 "repeat_penalty", "frequency_penalty", "presence_penalty", "num_ctx"]
MESSAGE_FIELDS = ["role", "content", "tool_calls", "name", "images", "tool_call_id"]
INPUT_ITEM_FIELDS = ["type", "role", "content", "call_id", "name", "arguments", "output", "encrypted_content"]


def _nested(depth: int) -> object:
    value: object = 0
    for i in range(depth):
        value = [value] if i % 2 else {"a": value}
    return value


NUMBERS = st.sampled_from([-1, 0, 1, 2**31, 2**63, 2**64, 2**70, -(2**70), 10**400 // 10**300,
                           float("nan"), float("inf"), float("-inf"), 1e308, -1e308, 0.5, 1e-320])
HOSTILE = st.one_of(
    NUMBERS,
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "\ud800", "x\udfffy", "yes", "5", "NaN", "\x00", "a" * 10_000]),
    st.text(max_size=20),
    st.lists(st.one_of(st.integers(), st.text(max_size=5), st.none()), max_size=5),
    st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5)), max_size=3),
    st.sampled_from([_nested(200), _nested(3000), [{}] * 5000, ["x"] * 2000]),
)
RAW_BODIES = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b'{"model": ', b"[" * 100_000, b'{"a":' * 50_000, b"null", b"[]",
                     b'"str"', b"1e999999", b"\xff\xfe{}", b'{"model": "\\ud800"}']),
)


def _body(route: str, model: str) -> dict:
    body = json.loads(json.dumps(ROUTES[route]))
    for key, value in body.items():
        if value == MODEL_FIELD:
            body[key] = model
    return body


@st.composite
def mutated(draw, route: str) -> bytes:
    body = _body(route, "MODEL")
    where = draw(st.sampled_from(["top", "options", "message"]))
    value = draw(HOSTILE)
    if where == "options":
        body.setdefault("options", {})[draw(st.sampled_from(OPTION_FIELDS))] = value
    elif where == "message" and ("messages" in body or "input" in body):
        fields = MESSAGE_FIELDS if "messages" in body else INPUT_ITEM_FIELDS
        body.get("messages", body.get("input"))[0][draw(st.sampled_from(fields))] = value
    else:
        body[draw(st.sampled_from(sorted(set(body) | set(EXTRA_FIELDS[route]))))] = value
    # json.dumps writes NaN/Infinity and \ud800 escapes: the server must refuse them cleanly.
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def fuzz_target(server):
    url, app = server
    model = app.state.registry.models[0].name
    with httpx.Client(base_url=url, timeout=60) as client:
        yield client, model


def _post(client: httpx.Client, route: str, raw: bytes, model: str) -> httpx.Response:
    raw = raw.replace(b'"MODEL"', json.dumps(model).encode())
    return client.post(route, content=raw, headers={"content-type": "application/json"})


def _still_serves(client: httpx.Client, model: str) -> None:
    r = client.post("/v1/chat/completions", json=_body("/v1/chat/completions", model))
    assert r.status_code == 200, r.text
    assert client.get("/health").status_code == 200


FUZZ = settings(max_examples=40, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_mutated_bodies_never_get_a_5xx(fuzz_target, route):
    client, model = fuzz_target
    statuses: list[int] = []

    @FUZZ
    @given(raw=mutated(route))
    def run(raw: bytes) -> None:
        r = _post(client, route, raw, model)
        statuses.append(r.status_code)
        assert r.status_code < 500, (raw[:300], r.status_code, r.text[:300])

    run()
    assert len(statuses) >= 30 and any(s >= 400 for s in statuses)  # the fuzzing really ran
    _still_serves(client, model)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_raw_bodies_never_get_a_5xx(fuzz_target, route):
    client, model = fuzz_target
    statuses: list[int] = []

    @settings(FUZZ, max_examples=20)
    @given(raw=RAW_BODIES)
    def run(raw: bytes) -> None:
        r = _post(client, route, raw, model)
        statuses.append(r.status_code)
        assert r.status_code < 500, (raw[:300], r.status_code, r.text[:300])
        if r.status_code >= 400:  # an error in the route's dialect, not a bare string
            assert r.headers["content-type"].startswith("application/json"), r.text[:200]

    run()
    assert len(statuses) >= 15
    _still_serves(client, model)
