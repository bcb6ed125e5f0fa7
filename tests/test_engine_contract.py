"""The engine contract: both engines implement the whole `Engine` protocol, with the same
stats() keys, so front ends (chat /stats, the serve banner, /metrics) need no probing."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from mlxlocal.engine import (
    STATS_KEYS,
    Engine,
    EngineSession,
    PagedEngine,
    SamplingParams,
    SimpleEngine,
    open_engine,
)
from mlxlocal.repl.chat import ChatRepl
from mlxlocal.server import ServerConfig
from mlxlocal.server.banner import banner_text
from mlxlocal.server.metrics import Metrics
from mlxlocal.server.registry import ModelRegistry
from mlxlocal.source.loader import load_from_dir


@pytest.fixture(scope="module")
def engines(tiny_model, gemma_model):
    # The dense engine is what a model the paged engine cannot hold gets; built directly here.
    paged, simple = open_engine(load_from_dir(tiny_model)), SimpleEngine(load_from_dir(gemma_model))
    yield paged, simple
    paged.shutdown()
    simple.shutdown()


def test_both_engines_satisfy_the_protocol(engines):
    paged, simple = engines
    assert isinstance(paged, PagedEngine) and isinstance(simple, SimpleEngine)
    for engine in engines:
        assert isinstance(engine, Engine)
        assert isinstance(engine.new_session(), EngineSession)
        assert engine.dead_reason is None and engine.context_length == engine.info.context_length


def test_stats_have_the_same_keys_before_and_after_a_request(engines):
    paged, simple = engines
    assert set(paged.stats()) == set(simple.stats()) == STATS_KEYS
    for engine in engines:
        chunks = list(engine.generate([5, 17, 42, 99], SamplingParams(max_tokens=3, ignore_eos=True)))
        st = engine.stats()
        assert set(st) == STATS_KEYS
        assert st["tokens_in"] >= 4 and st["tokens_out"] >= len([c for c in chunks if c.token is not None]) > 0
        assert st["running"] == st["waiting"] == 0
    assert simple.stats()["blocks_total"] == 0


def test_kv_pool_describes_paged_and_dense(engines):
    paged, simple = engines
    assert paged.kv_pool == {"kind": "paged", "blocks": paged.num_blocks, "block_size": paged.config.block_size,
                             "bytes": paged.pools.nbytes, "max_blocks": paged.blocks.max_blocks,
                             "max_bytes": paged.pools.nbytes * paged.blocks.max_blocks // paged.num_blocks}
    assert paged.pools.block_nbytes * paged.num_blocks == paged.pools.nbytes  # no window layers here
    assert simple.kv_pool["kind"] == "dense"


def test_chat_stats_on_the_mlx_lm_path(engines):
    simple = engines[1]
    out = io.StringIO()
    repl = ChatRepl(simple, Console(file=out, width=200), params=SamplingParams(max_tokens=4))
    repl.turn("hello")
    repl.command("/stats")
    text = out.getvalue()
    assert "mlx-lm" in text and "kv cache dense" in text and "2 messages" in text, text


def test_serve_banner_metrics_and_unload_on_the_mlx_lm_path(gemma_model):
    simple = SimpleEngine(load_from_dir(gemma_model))  # its own: unload_idle shuts it down
    config = ServerConfig(models=[str(gemma_model)])
    registry = ModelRegistry(config.models, {}, 0.0, config.served_model_names)
    registry.models[0].engine, registry.models[0].expires_at = simple, 0.0
    assert "KV cache: per request (mlx-lm path, no paged pool)" in banner_text(config, registry)
    metrics = Metrics()
    metrics.refresh([simple])
    assert metrics.kv_total._value.get() == 0 and metrics.running._value.get() == 0
    assert registry.models[0].dead_reason is None
    assert registry.unload_idle() == [registry.models[0].name]  # idle, keep_alive 0: stats say nothing runs
    assert simple.dead_reason == "the engine was shut down" and set(simple.stats()) == STATS_KEYS | {"dead_reason"}


def test_mlx_lm_models_run_paged_and_unpageable_caches_fall_back_with_a_reason(gemma_model):
    from mlx_lm.models.cache import ChunkedKVCache

    from mlxlocal.engine import engine_kind

    loaded = load_from_dir(gemma_model)
    engine = open_engine(loaded)
    assert isinstance(engine, PagedEngine) and engine.kv_pool["kind"] == "paged"
    engine.shutdown()
    assert engine_kind(loaded).startswith("paged (mlx-lm model code)")
    # A cache type the pools cannot hold (llama4's chunked attention): the dense engine, and why.
    loaded.model.make_cache = lambda: [ChunkedKVCache(8) for _ in loaded.model.layers]
    engine = open_engine(loaded)
    assert isinstance(engine, SimpleEngine)
    assert "ChunkedKVCache" in engine.kv_pool["reason"] and "ChunkedKVCache" in engine_kind(loaded)
    tokens = [c.token for c in engine.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))]
    assert len([t for t in tokens if t is not None]) == 3
    engine.shutdown()
