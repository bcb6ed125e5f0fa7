"""Bad requests found by fuzzing: each is a 4xx in the caller's dialect naming the field, and
the server keeps serving. Also: sampling fields we accept change the output, and a huge
prompt is refused or tokenized without stalling the event loop."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from mlxlocal.server.validation import MAX_DEPTH, json_depth

M = "MODEL"  # replaced by the served model's path in bodies
HI = '[{"role": "user", "content": "hi"}]'


def deep(n: int) -> str:
    return "[" * n + "]" * n


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model)


@pytest.fixture(scope="module")
def tokenizer(server, model):
    url, app = server
    httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1}, timeout=60)
    return app.state.registry.models[0].engine.tokenizer


def post(url: str, path: str, body: str | bytes, model: str) -> httpx.Response:
    raw = body if isinstance(body, bytes) else body.replace(M, model).encode("utf-8", "surrogatepass")
    return httpx.post(url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=120)


def error_text(r: httpx.Response, path: str) -> tuple[str, str | None]:
    """The error's message (and OpenAI's param), asserting the dialect's error format."""
    body = r.json()
    if path.startswith("/api/"):
        assert set(body) == {"error"} and isinstance(body["error"], str), body
        return body["error"], None
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error", body
        return body["error"]["message"], None
    assert body["error"]["type"] == "invalid_request_error", body
    return body["error"]["message"], body["error"]["param"]


def still_serves(url: str, model: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


CHAT = "/v1/chat/completions"
COMPLETE = "/v1/completions"
MESSAGES = "/v1/messages"
OLLAMA_GEN = '{"model": "MODEL", "prompt": "a", "stream": false, "options": {%s}}'

# (path, body, the field the error must name)
CASES = [
    # JSON nested past Python's recursion limit (was a RecursionError -> 500)
    (MESSAGES, '{"model": "MODEL", "max_tokens": 2, "messages": %s, "x": %s}' % (HI, deep(1000)), None),
    ("/api/chat", '{"model": "MODEL", "x": %s}' % deep(1000), None),
    ("/api/generate", '{"model": "MODEL", "prompt": "a", "x": %s}' % deep(100_000), None),
    (CHAT, '{"model": "MODEL", "messages": %s, "metadata": {"a": %s}}' % (HI, deep(100_000)), None),
    (CHAT, '{"model": "MODEL", "messages": %s, "metadata": {"a": %s}}' % (HI, deep(500)), None),
    # a lone surrogate cannot be encoded to UTF-8 (was a 500 while writing the response)
    (CHAT, '{"model": "\\ud800", "messages": %s}' % HI, "model"),
    (COMPLETE, '{"model": "\\udfff", "prompt": "a"}', "model"),
    (MESSAGES, '{"model": "\\ud800", "max_tokens": 2, "messages": %s}' % HI, "model"),
    ("/v1/messages/count_tokens", '{"model": "\\ud800", "messages": %s}' % HI, "model"),
    ("/api/chat", '{"model": "\\ud800", "messages": %s}' % HI, "model"),
    ("/api/generate", '{"model": "\\ud800", "prompt": "a"}', "model"),
    ("/api/show", '{"model": "\\ud800"}', "model"),
    (COMPLETE, '{"model": "MODEL", "prompt": "a\\ud800"}', "prompt"),
    ("/api/generate", '{"model": "MODEL", "prompt": "a\\ud800", "stream": false}', "prompt"),
    (CHAT, '{"model": "MODEL", "messages": [{"role": "user", "content": "\\udc00x"}]}', "messages.0.content"),
    # Ollama numbers that are not finite, not integers, or out of range
    ("/api/generate", OLLAMA_GEN % '"num_predict": NaN', "options.num_predict"),
    ("/api/generate", OLLAMA_GEN % '"num_predict": Infinity', "options.num_predict"),
    ("/api/generate", OLLAMA_GEN % '"num_predict": 1180591620717411303424', "options.num_predict"),
    ("/api/generate", OLLAMA_GEN % '"top_k": NaN', "options.top_k"),
    ("/api/generate", OLLAMA_GEN % '"top_k": -Infinity', "options.top_k"),
    ("/api/generate", OLLAMA_GEN % '"top_k": 2.5', "options.top_k"),
    ("/api/generate", OLLAMA_GEN % '"seed": 1180591620717411303424', "options.seed"),
    ("/api/generate", OLLAMA_GEN % '"temperature": 1e308', "options.temperature"),
    ("/api/generate", OLLAMA_GEN % '"top_p": 0', "options.top_p"),
    ("/api/generate", OLLAMA_GEN % '"repeat_penalty": 0', "options.repeat_penalty"),
    ("/api/generate", OLLAMA_GEN % '"frequency_penalty": NaN', "options.frequency_penalty"),
    ("/api/generate", OLLAMA_GEN % '"stop": [""]', "options.stop"),
    ("/api/generate", '{"model": "MODEL", "prompt": "a", "stream": false, "keep_alive": NaN}', "keep_alive"),
    # repetition_penalty 0 in float32 (at or below ~1e-38) with temperature > 0: inf logits, NaN,
    # an id past the vocabulary read by the next forward: a segfault (the curl first)
    (CHAT, '{"model": "MODEL", "messages": %s, "max_tokens": 4, "repetition_penalty": 1e-39}' % HI,
     "repetition_penalty"),
    (COMPLETE, '{"model": "MODEL", "prompt": "a", "max_tokens": 4, "repetition_penalty": 5e-324}',
     "repetition_penalty"),
    (CHAT, '{"model": "MODEL", "messages": %s, "repetition_penalty": 1e39}' % HI, "repetition_penalty"),
    ("/api/generate", OLLAMA_GEN % '"num_predict": 4, "temperature": 1, "top_k": 0, "repeat_penalty": 1e-39',
     "options.repeat_penalty"),
    ("/api/chat", '{"model": "MODEL", "stream": false, "messages": %s, "options": {"num_predict": 4, '
                  '"temperature": 1, "top_k": 0, "repeat_penalty": 1e-39}}' % HI, "options.repeat_penalty"),
    # top_p that is 0 in float32 kept no token: a uniformly random one was drawn
    (CHAT, '{"model": "MODEL", "messages": %s, "top_p": 5e-324}' % HI, "top_p"),
    (MESSAGES, '{"model": "MODEL", "max_tokens": 2, "top_p": 5e-324, "messages": %s}' % HI, "top_p"),
    ("/api/generate", OLLAMA_GEN % '"top_p": 5e-324', "options.top_p"),
    # top_k over the vocabulary (384) or past any integer the sampler takes, in every dialect
    (CHAT, '{"model": "MODEL", "messages": %s, "top_k": 100000}' % HI, "top_k"),
    (COMPLETE, '{"model": "MODEL", "prompt": "a", "top_k": 385}', "top_k"),
    (COMPLETE, '{"model": "MODEL", "prompt": "a", "top_k": 1180591620717411303424}', "top_k"),
    (MESSAGES, '{"model": "MODEL", "max_tokens": 2, "top_k": 100000, "messages": %s}' % HI, "top_k"),
    (MESSAGES, '{"model": "MODEL", "max_tokens": 2, "top_k": 1180591620717411303424, "messages": %s}' % HI,
     "top_k"),
    ("/api/generate", OLLAMA_GEN % '"top_k": 100000', "options.top_k"),
    ("/api/chat", '{"model": "MODEL", "stream": false, "messages": %s, "options": {"top_k": 1e30}}' % HI,
     "options.top_k"),
    # seeds outside [0, 2**63) (used to kill the engine thread)
    (CHAT, '{"model": "MODEL", "messages": %s, "seed": -1}' % HI, "seed"),
    (COMPLETE, '{"model": "MODEL", "prompt": "a", "seed": 18446744073709551616}', "seed"),
    (COMPLETE, '{"model": "MODEL", "prompt": "a", "seed": 9223372036854775808}', "seed"),
    # Ollama shapes
    ("/api/chat", '{"model": "MODEL", "stream": false, "messages": [{"role": "user", "content": "hi"}, '
                  '{"role": "assistant", "content": "", "tool_calls": 5}]}', "messages.1.tool_calls"),
    ("/api/chat", '{"model": "MODEL", "stream": false, "messages": [{"role": "user", "content": "hi"}, '
                  '{"role": "assistant", "content": "", "tool_calls": [5]}]}', "messages.1.tool_calls.0.function"),
    ("/api/chat", '{"model": "MODEL", "stream": false, "messages": %s, "tools": [1]}' % HI, "tools.0"),
    ("/api/chat", '{"model": "MODEL", "stream": false, "messages": %s, "tools": [{"type": "function"}]}' % HI,
     "tools.0.function.name"),
    ("/api/show", '{"model": ["x"]}', "model"),
    ("/api/show", '{"name": {"a": 1}}', "name"),
    ("/api/generate", '{"model": ["x"], "prompt": ""}', "model"),
    ("/api/generate", '{"model": "MODEL", "prompt": "a", "system": 5}', "system"),
    # booleans are true or false, not 5 or "yes"
    (MESSAGES, '{"model": "MODEL", "max_tokens": 2, "stream": 5, "messages": %s}' % HI, "stream"),
    ("/api/generate", '{"model": "MODEL", "prompt": "a", "stream": "yes"}', "stream"),
    ("/api/chat", '{"model": "MODEL", "messages": %s, "stream": 1}' % HI, "stream"),
    ("/api/generate", '{"model": "MODEL", "prompt": "a", "stream": false, "raw": "yes"}', "raw"),
    ("/api/chat", '{"model": "MODEL", "messages": %s, "stream": false, "think": 5}' % HI, "think"),
    (CHAT, '{"model": "MODEL", "messages": %s, "stream": "yes"}' % HI, "stream"),
    (COMPLETE, '{"model": "MODEL", "prompt": "a", "echo": 1}', "echo"),
    # OpenAI numbers and sampling extensions
    (CHAT, '{"model": "MODEL", "messages": %s, "temperature": NaN}' % HI, "temperature"),
    (CHAT, '{"model": "MODEL", "messages": %s, "frequency_penalty": 2.5}' % HI, "frequency_penalty"),
    (CHAT, '{"model": "MODEL", "messages": %s, "presence_penalty": Infinity}' % HI, "presence_penalty"),
    (CHAT, '{"model": "MODEL", "messages": %s, "logit_bias": {"abc": 1}}' % HI, "logit_bias"),
    (CHAT, '{"model": "MODEL", "messages": %s, "logit_bias": {"5": 101}}' % HI, "logit_bias"),
    (COMPLETE, '{"model": "MODEL", "prompt": "a", "logit_bias": {"384": 5}}', "logit_bias"),
    (COMPLETE, '{"model": "MODEL", "prompt": "a", "max_tokens": 2147483648}', "max_tokens"),
    # list sizes
    (COMPLETE, '{"model": "MODEL", "prompt": "a", "stop": [%s]}' % ",".join(['"s%d"' % i for i in range(17)]),
     "stop"),
    (COMPLETE, '{"model": "MODEL", "prompt": "a", "stop": "%s"}' % ("x" * 1001), "stop"),
    (MESSAGES, '{"model": "MODEL", "max_tokens": 2, "stop_sequences": [""], "messages": %s}' % HI,
     "stop_sequences"),
    (CHAT, '{"model": "MODEL", "messages": [%s]}' % ",".join(['{"role": "user", "content": "x"}'] * 10_001),
     "messages"),
    (CHAT, '{"model": "MODEL", "messages": %s, "tools": [%s]}'
     % (HI, ",".join(['{"type": "function", "function": {"name": "f"}}'] * 129)), "tools"),
    ("/api/chat", '{"model": "MODEL", "messages": [%s]}' % ",".join(['{"role": "user", "content": "x"}'] * 10_001),
     "messages"),
    # not UTF-8 at all
    ("/api/chat", b'{"model": "\xff\xfe"}', None),
]


@pytest.mark.parametrize(("path", "body", "field"), CASES,
                         ids=[f"{i}-{c[0]}-{c[2]}" for i, c in enumerate(CASES)])
def test_bad_request_is_a_400_naming_the_field(server, model, path, body, field):
    url, _ = server
    r = post(url, path, body, model)
    assert r.status_code == 400, (r.status_code, r.text[:300])
    message, param = error_text(r, path)
    if field is not None:
        assert field in message, message
        if param is not None or not path.startswith(("/api/", "/v1/messages")):
            assert param == field, (param, message)
        if "repe" in field:  # the range, in the dialect's name for the field
            assert message.startswith(f"{field} must be a finite number in [0.001, 100]"), message
    elif "deep" in path or "[[[[" in str(body):
        assert f"deeper than {MAX_DEPTH}" in message, message
    still_serves(url, model)


def test_values_in_range_still_work(server, model):
    url, _ = server
    nested = {"a": 1}
    for _ in range(MAX_DEPTH - 4):
        nested = {"a": nested}
    ok = [
        (CHAT, {"model": model, "messages": [{"role": "user", "content": "hi 😀"}], "max_tokens": 2,
                "metadata": nested, "seed": 2**63 - 1, "top_k": 384, "logit_bias": {"5": -100}}),
        ("/api/generate", {"model": model, "prompt": "a", "stream": False, "raw": True,
                           "options": {"num_predict": 2, "seed": -1, "top_k": 40.0, "temperature": 100}}),
        ("/api/chat", {"model": model, "stream": False, "think": "high", "keep_alive": "5m",
                       "messages": [{"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "", "tool_calls": []},
                                    {"role": "user", "content": "again"}], "options": {"num_predict": 2}}),
        (MESSAGES, {"model": model, "max_tokens": 2, "top_k": 384, "stream": False,
                    "messages": [{"role": "user", "content": "hi"}]}),
    ]
    for path, body in ok:
        r = httpx.post(url + path, json=body, timeout=60)
        assert r.status_code == 200, (path, r.text[:300])
    # a surrogate pair (an emoji escaped by an ASCII-only encoder) is valid text
    r = post(url, COMPLETE, '{"model": "MODEL", "prompt": "\\ud83d\\ude00", "max_tokens": 2}', model)
    assert r.status_code == 200, r.text


def test_json_depth_ignores_brackets_in_strings():
    assert json_depth(b'{"a": [1, {"b": []}]}') <= MAX_DEPTH
    assert json_depth(("[" * 70 + "]" * 70).encode()) == 70
    text = b'{"s": "' + b"[{" * 100 + b'\\"[[[", "t": [[1]]}'
    assert json_depth(text) == 3


def test_logit_bias_and_penalties_change_the_output(server, model, tokenizer):
    url, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")

    def complete(prompt: str = "The story goes", **kw) -> str:
        return client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0,
                                         **kw).choices[0].text

    ids = {c: tokenizer.encode(c, add_special_tokens=False) for c in "abcdex"}
    assert all(len(i) == 1 for i in ids.values())
    assert complete(logit_bias={str(ids["x"][0]): 100}) == "x" * 16
    # +100 on a..e: greedy picks among them only, by the model's own (random) preference.
    letters = {str(ids[c][0]): 100 for c in "abcde"}
    plain = complete(logit_bias=letters)
    assert set(plain) <= set("abcde") and len(set(plain)) == 1, plain  # the tiny model repeats itself
    banned = complete(logit_bias={**letters, str(ids[plain[0]][0]): -100})
    assert set(banned) <= set("abcde") - {plain[0]}, banned
    # frequency_penalty grows with each repeat: the letters take turns
    assert len(set(complete(logit_bias=letters, frequency_penalty=2.0))) >= 3
    # presence_penalty is a flat 2: it changes the pick where the model's preference is weaker
    prompts = ["The story goes", "hello", "Once upon a time"]
    assert any(complete(p, logit_bias=letters, presence_penalty=2.0) != complete(p, logit_bias=letters)
               for p in prompts)


def _health_while(url: str, send) -> tuple[float, httpx.Response]:
    """The worst /health latency while `send()` runs on another thread, and its response."""
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("r", send()))
    thread.start()
    worst = 0.0
    with httpx.Client() as c:
        while thread.is_alive():
            t = time.perf_counter()
            c.get(f"{url}/health", timeout=60)
            worst = max(worst, time.perf_counter() - t)
            time.sleep(0.02)
    thread.join()
    return worst, out["r"]


def test_huge_prompt_is_refused_before_tokenizing(server, model):
    url, _ = server
    big = "hello world " * (7_500_000 // 12)  # about 3.75M tokens; used to take 6 s on the event loop
    for path, body in [(COMPLETE, {"model": model, "prompt": big, "max_tokens": 2}),
                       ("/api/chat", {"model": model, "stream": False, "messages": [{"role": "user", "content": big}]}),
                       (MESSAGES, {"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": big}]})]:
        t = time.perf_counter()
        worst, r = _health_while(url, lambda: httpx.post(url + path, json=body, timeout=120))  # noqa: B023
        assert r.status_code == 400, r.text[:300]
        message, _ = error_text(r, path)
        assert "7500000 bytes" in message and "512 tokens" in message, message
        assert time.perf_counter() - t < 3 and worst < 1.0, (time.perf_counter() - t, worst)


def test_tokenizing_runs_off_the_event_loop(server, model):
    """count_tokens tokenizes text past the context (up to max_text_bytes): /health stays quick."""
    url, _ = server
    body = {"model": model, "messages": [{"role": "user", "content": "hello world " * 150_000}]}
    t = time.perf_counter()
    worst, r = _health_while(url, lambda: httpx.post(f"{url}/v1/messages/count_tokens", json=body, timeout=120))
    took = time.perf_counter() - t
    assert r.status_code == 200 and r.json()["input_tokens"] > 300_000
    # On the loop, /health would wait the whole time; off it, at most a share of it (more on
    # a loaded 2-core machine, where the tokenizer's threads compete with the loop's).
    assert worst < max(0.5, took * 0.6), (worst, took)


def test_prompt_under_the_byte_bound_gets_the_exact_token_count(server, model):
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": "word " * 700, "max_tokens": 2})
    message, param = error_text(r, COMPLETE)
    assert r.status_code == 400 and "tokens" in message and "512" in message and param == "prompt"
    assert r.json()["error"]["code"] == "context_length_exceeded"
