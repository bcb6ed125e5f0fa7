"""Every unit of heavy work has a budget and a cancel: one hostile client of each kind
(embeddings then hang-up, huge count_tokens, big grammar compiles, huge-body tokenization)
beside a normal client whose small chat requests must all succeed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_util import running_server
from test_embeddings import build_tiny_bert

from mlxlocal.server import ServerConfig, embeddings_api, lanes

CHAT = "/v1/chat/completions"
COUNT = "/v1/messages/count_tokens"


@pytest.fixture(scope="module")
def budget_server(tiny_model, tmp_path_factory):
    bert = build_tiny_bert(tmp_path_factory.mktemp("bert") / "tiny-bert")
    with running_server(ServerConfig(models=[str(tiny_model)], embed_models=[str(bert)])) as (url, app):
        yield url, app, str(tiny_model), str(bert)


class NormalClient:
    """Small chat requests one after another on a thread, until stopped."""

    def __init__(self, url: str, model: str):
        self.statuses: list[int | str] = []
        self._stop = threading.Event()
        body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}

        def run():
            with httpx.Client(timeout=300) as client:
                while not self._stop.is_set() or len(self.statuses) < 3:
                    try:
                        self.statuses.append(client.post(url + CHAT, json=body).status_code)
                    except httpx.HTTPError as e:
                        self.statuses.append(type(e).__name__)

        self._thread = threading.Thread(target=run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(300)
        assert self.statuses and set(self.statuses) == {200}, self.statuses


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS:")) / 1024


# --- embeddings ----------------------------------------------------------------------------------
@pytest.fixture
def slow_embedder(budget_server, monkeypatch):
    """The served embedding model with each batch's forward slowed to 50 ms, so a request of
    64 batches runs for seconds (the tiny encoder itself takes under a millisecond). Batches
    give way to the normal client's chats for 50 ms at most (5 s in the server)."""
    from mlxlocal import embeddings as embedding

    monkeypatch.setattr(embedding, "YIELD_S", 0.05)
    url, app, _, bert = budget_server
    httpx.post(url + "/v1/embeddings", json={"model": bert, "input": "warm"}, timeout=60)
    engine = app.state.registry.embedders[0].engine
    model = engine.model

    def slow(*args, **kwargs):
        time.sleep(0.05)
        return model(*args, **kwargs)

    engine.model = slow
    yield engine
    engine.model = model


def _wait_idle(engine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine._queued and time.monotonic() < deadline:
        time.sleep(0.05)


def test_embeddings_stop_when_the_client_hangs_up(budget_server, slow_embedder):
    url, _, model, bert = budget_server
    engine = slow_embedder
    before = dict(engine.stats())
    body = {"model": bert, "input": [f"text number {i}" for i in range(2048)]}  # 64 batches of 32
    with NormalClient(url, model):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/v1/embeddings", json=body, timeout=httpx.Timeout(0.6, connect=5))
        _wait_idle(engine)
    after = engine.stats()
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["batches"] - before["batches"] < 40  # 64 without the cancel
    assert after["requests"] == before["requests"]  # never completed


def test_embeddings_queue_is_bounded_and_tokens_budgeted(budget_server, slow_embedder, monkeypatch):
    url, _, model, bert = budget_server
    body = {"model": bert, "input": [f"text number {i}" for i in range(320)]}  # 10 batches: 0.5 s
    with NormalClient(url, model), ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: httpx.post(url + "/v1/embeddings", json=body, timeout=120), range(8)))
        statuses = sorted(r.status_code for r in codes)
    assert set(statuses) == {200, 429} and statuses.count(200) <= slow_embedder.max_queued, statuses
    busy = next(r for r in codes if r.status_code == 429)
    assert busy.headers["Retry-After"] and "running or waiting" in busy.json()["error"]["message"]
    monkeypatch.setattr(embeddings_api, "MAX_TOKENS", 100)
    r = httpx.post(url + "/v1/embeddings", json={"model": bert, "input": ["hello world"] * 30}, timeout=60)
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "input" and "at most 100 per request" in error["message"]


def test_embedding_shutdown_stops_between_batches(tmp_path):
    from mlxlocal.embeddings import open_embedder
    from mlxlocal.errors import EmbeddingCancelled

    engine = open_embedder(build_tiny_bert(tmp_path / "bert"))
    model = engine.model
    engine.model = lambda *a, **k: (time.sleep(0.05), model(*a, **k))[1]
    future = engine._submit([f"t {i}" for i in range(2048)], True, 32, True, None, None)
    time.sleep(0.3)
    engine.shutdown()
    with pytest.raises(EmbeddingCancelled):
        future.result(timeout=5)
    assert engine.stats()["batches"] < 40


def test_embedding_batches_are_token_bounded_and_give_way_to_chat(tmp_path):
    from mlxlocal import embeddings as embedding

    batches = embedding._batches([[1] * 300] * 3 + [[1] * 10] * 200, 32)
    assert [len(b) for b in batches] == [3, 32, 32, 32, 32, 32, 32, 8]  # 3 x 300 <= 1024 < 4 x 300
    engine = embedding.open_embedder(build_tiny_bert(tmp_path / "bert"))
    busy_until = time.monotonic() + 0.5
    engine.yield_to = lambda: time.monotonic() < busy_until  # a chat request runs for 0.5 s
    model, starts = engine.model, []
    engine.model = lambda *a, **k: (starts.append(time.monotonic()), model(*a, **k))[1]
    engine.embed(["hello world"])
    engine.shutdown()
    assert starts and starts[0] >= busy_until


# --- count_tokens and large tokenizations --------------------------------------------------------
def _count(url: str, model: str, text: str) -> httpx.Response:
    return httpx.post(url + COUNT, timeout=300,
                      json={"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]})


def test_count_tokens_is_capped(budget_server):
    url, _, model, _ = budget_server
    r = _count(url, model, "word " * 600_000)  # 3 MB
    error = r.json()["error"]
    assert r.status_code == 400 and error["message"].startswith("messages: ") and "at most 2097152 bytes" in error["message"]


@pytest.mark.slow
def test_count_tokens_gives_memory_back(budget_server):
    url, _, model, _ = budget_server
    with NormalClient(url, model):
        _count(url, model, "hello " * 1000)
        rss0 = _rss_mib()
        for _ in range(2):  # ~1.3 MB each: ~150 MB of tokenizer scratch per request
            r = _count(url, model, "word " * 260_000)
            assert r.status_code == 200 and r.json()["input_tokens"] > 250_000
    # Generous: before, the scratch stayed in malloc arenas (+290 MB after two requests).
    assert _rss_mib() - rss0 < 120, (rss0, _rss_mib())


def test_large_tokenizations_run_one_at_a_time(budget_server, monkeypatch):
    url, app, model, _ = budget_server
    engine = app.state.registry.find(model).engine
    encode, running, most = engine.encode_chat, [0], [0]
    lock = threading.Lock()

    def counted(*args, **kwargs):
        big = sum(len(m.get("content") or "") for m in args[0]) > lanes.LARGE_TEXT_BYTES
        with lock:
            running[0] += big
            most[0] = max(most[0], running[0])
        try:
            return encode(*args, **kwargs)
        finally:
            with lock:
                running[0] -= big

    monkeypatch.setattr(engine, "encode_chat", counted)
    with NormalClient(url, model), ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda i: _count(url, model, f"{i} " + "word " * 120_000).status_code, range(4)))
    assert codes == [200] * 4 and most[0] == 1


# --- grammars -------------------------------------------------------------------------------------
def _schema(properties: int, salt: int = 0, name_length: int = 8) -> dict:
    props = {f"f{salt}_{i}_".ljust(name_length, "x"): {"type": "integer"} for i in range(properties)}
    return {"type": "object", "properties": props, "required": list(props)[:1]}


def _constrained(url: str, model: str, **fields) -> httpx.Response:
    return httpx.post(url + CHAT, timeout=300, json={"model": model, "max_tokens": 24,
                                                     "messages": [{"role": "user", "content": "pick"}], **fields})


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_of_thousands_is_enforced(budget_server, stream):
    url, _, model, _ = budget_server
    options = [f"option {i}" for i in range(5000)]
    r = _constrained(url, model, guided_choice=options, stream=stream, max_tokens=64)
    assert r.status_code == 200 and "error" not in r.text, r.text[:300]


def test_constraints_over_their_limits_are_400s(budget_server):
    url, _, model, _ = budget_server
    cases = [({"guided_choice": [str(i) for i in range(10_001)]}, "guided_choice", "at most 10000"),
             ({"structured_outputs": {"json": _schema(5001)}}, "structured_outputs.json", "at most 5000"),
             ({"guided_regex": "a" * (1 << 20) + "b"}, "guided_regex", "at most 1048576"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _schema(5001)}}},
              "response_format.json_schema.schema", "at most 5000")]
    for fields, param, words in cases:
        r = _constrained(url, model, **fields)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == param and words in error["message"], (param, r.text[:300])


def test_a_repeated_grammar_compiles_once(budget_server):
    url, app, model, _ = budget_server
    grammars = app.state.registry.find(model).engine.grammars
    schema = _schema(3, salt=12345)
    before = dict(grammars.counters)
    for _ in range(3):
        assert _constrained(url, model, structured_outputs={"json": schema}).status_code == 200
    assert grammars.counters["compiles"] == before["compiles"] + 1
    assert grammars.counters["cache_hits"] == before["cache_hits"] + 2


@pytest.mark.slow
def test_big_grammar_compiles_are_bounded_beside_small_chats(budget_server):
    url, _, model, _ = budget_server
    # 400 properties with long names: over LARGE_GRAMMAR_BYTES, so one compile at a time.
    schemas = [_schema(400, salt=i, name_length=90) for i in range(16)]
    with NormalClient(url, model), ThreadPoolExecutor(16) as pool:
        codes = list(pool.map(lambda s: _constrained(url, model, max_tokens=1,
                                                     structured_outputs={"json": s}).status_code, schemas))
    # One running and eight waiting at most: the rest are told to come back.
    assert set(codes) == {200, 429} and codes.count(200) <= 1 + lanes.LARGE_GRAMMAR.queue, codes
