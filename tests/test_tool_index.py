"""The tool index (mlxlocal/agents/tool_index.py), the chat-model re-ranker (agents/rerank.py)
and `mlxlocal tools rank`.

The dense stage is tested through the embedder interface (`embed(texts, normalize=True) ->
float32 [n, d]`) with a small local embedding: hashed character trigrams of the words, which
is deterministic, fast and gives real (if lexical) similarity. Retrieval quality with
all-MiniLM-L6-v2 is measured by scripts/eval_tool_retrieval.py, not asserted here. The chat
re-ranker's mechanics run on a tiny random-weight model; its quality cannot be measured
without a real chat model.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from server_util import scripted_output
from typer.testing import CliRunner

from mlxlocal.agents.rerank import ChatReranker, answer_pattern, parse_answer
from mlxlocal.agents.tool_index import ToolIndex, split_identifier, tokenize, tool_fields
from mlxlocal.agents.types import ToolInfo
from mlxlocal.cli import app

FIXTURES = Path(__file__).parent / "fixtures" / "tool_retrieval"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
import eval_tool_retrieval as ev  # noqa: E402


class TrigramEmbedder:
    """Hashed character trigrams of each word, 256 dims; counts what it embedded."""

    def __init__(self, dim: int = 256):
        self.dim = dim
        self.texts: list[str] = []

    def embed(self, texts: list[str], normalize: bool = True) -> np.ndarray:
        self.texts += texts
        out = np.zeros((len(texts), self.dim), np.float32)
        for row, text in enumerate(texts):
            for word in re.findall(r"[a-z0-9]+", text.lower()):
                w = f"#{word}#"
                for i in range(len(w) - 2):
                    h = int.from_bytes(hashlib.blake2b(w[i:i + 3].encode(), digest_size=4).digest(), "little")
                    out[row, h % self.dim] += 1.0
        if normalize:
            out /= np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-9)
        return out


@pytest.fixture(scope="module")
def catalog():
    return ev.load_set(FIXTURES)


def test_fixture_set_is_what_the_issue_asks(catalog):
    tools, queries = catalog
    assert len(tools) >= 80 and len({t.server for t in tools}) >= 10 and len(queries) >= 50
    ids = {t.id for t in tools}
    assert all(set(q["relevant"]) <= ids for q in queries)
    # Most queries share no word with the right tool's name.
    disjoint = sum(not set(tokenize(q["query"])) & set(tokenize(split_identifier(q["relevant"][0].split(".", 1)[1])))
                   for q in queries)
    assert disjoint / len(queries) > 0.5


def test_documents_split_names_and_carry_parameters():
    tool = ToolInfo("fs", "readMultipleFiles", "Read files.", {"type": "object", "properties": {
        "file_paths": {"type": "array", "description": "Paths to read"}}}, {"title": "Read Many"})
    f = tool_fields(tool)
    assert f["name"].startswith("read multiple files") and "Read Many" in f["name"]
    assert "file paths: Paths to read" in f["params"] and "Server: fs" in f["doc"]
    assert tokenize("getFileInfo of the files") == ["file", "info", "file"]  # "get" is a stopword


def test_bm25_finds_lexical_matches(catalog):
    tools, _ = catalog
    index = ToolIndex(tools)
    top = [i for i, _ in index.rank("forward a local port to a pod", 3)]
    assert top[0] == "kubernetes.port_forward"
    assert index.rank_detail("jql query", 1).results[0][0] == "jira.jira_search"
    assert index.rank_detail("jql query", 1).stages == ["bm25"]  # no embedder: stage 1 is BM25
    assert index.rank("zzzz qqqq", 2) and all(s == 0 for _, s in index.rank("zzzz qqqq", 2))


def test_fusion_combines_both_rankings(catalog):
    tools, _ = catalog
    index = ToolIndex(tools, TrigramEmbedder())
    query = "what columns does the orders table have"
    bm = index.bm25_scores(query)
    dense = index.dense_scores(query)
    fused, stages = index.stage1(query)
    assert stages == ["bm25", "dense", "fusion"]
    best_bm, best_dense = int(np.argmax(bm)), int(np.argmax(dense))
    # The fused top beats neither list's winner by less than the other list's evidence: each
    # winner's fused score is at least its own RRF term (1 / (60 + 1)).
    assert fused[best_bm] >= 1 / 61 and fused[best_dense] >= 1 / 61
    assert fused.argmax() in {best_bm, best_dense} or fused.max() >= max(fused[best_bm], fused[best_dense])
    score = ToolIndex(tools, TrigramEmbedder(), fusion="score")
    assert score.stage1(query)[0].max() <= 2.0
    with pytest.raises(ValueError):
        ToolIndex(tools, fusion="max")


def test_stage2_improves_mrr_over_stage1(catalog):
    tools, queries = catalog
    index = ToolIndex(tools, TrigramEmbedder())
    one = ev.metrics(index, queries, stage1_only=True)
    two = ev.metrics(index, queries)
    assert two["mrr"] > one["mrr"], (one, two)
    r = index.rank_detail(queries[0]["query"], 5)
    assert r.stages == ["bm25", "dense", "fusion", "fields"] and len(r.results) == 5 and len(r.candidates) == 20
    assert [s for _, s in r.results] == sorted((s for _, s in r.results), reverse=True)


def test_cache_recomputes_only_changed_tools(catalog):
    tools, _ = catalog
    emb = TrigramEmbedder()
    index = ToolIndex(tools, emb)
    assert index.embedded_tools == len(tools)
    before = len(emb.texts)
    assert index.update(tools) == 0 and len(emb.texts) == before  # unchanged catalog: nothing
    changed = list(tools)
    changed[3] = replace(changed[3], description=changed[3].description + " Now with globbing.")
    assert index.update(changed) == 1 and index.embedded_tools == len(tools) + 1
    assert len(emb.texts) == before + 4  # the one tool's four fields
    # A tool removed and one added: only the new one is embedded; the index follows the catalog.
    smaller = changed[:-1] + [ToolInfo("extra", "ping_host", "Ping a host.")]
    assert index.update(smaller) == 1 and "extra.ping_host" in index.ids and tools[-1].id not in index.ids


def test_rank_rejects_a_bad_k_and_handles_an_empty_catalog():
    assert ToolIndex([]).rank("anything", 3) == []
    with pytest.raises(ValueError):
        ToolIndex([ToolInfo("a", "b")]).rank("x", 0)


# -- the chat model as re-ranker ---------------------------------------------------------------

def test_answer_pattern_and_parsing():
    ids = ["github.create_issue", "github.create_issue_comment", "jira.jira_search"]
    pattern = answer_pattern(ids, 2)
    assert re.fullmatch(pattern, "github.create_issue_comment, jira.jira_search")
    assert not re.fullmatch(pattern, "github.create_issue, jira.jira_search, github.create_issue")
    text = "1. github.create_issue_comment\n2) jira.jira_search and again github.create_issue_comment"
    assert parse_answer(text, ids) == ["github.create_issue_comment", "jira.jira_search"]
    assert parse_answer("none of these", ids) == []


@pytest.fixture(scope="module")
def engine(agent_model):
    from mlxlocal.engine import open_engine
    from mlxlocal.source.loader import load

    eng = open_engine(load(str(agent_model)), max_num_seqs=1)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def small_catalog(catalog):
    tools, _ = catalog
    return [t for t in tools if t.server in ("git", "github")]


def test_grammar_keeps_a_random_model_on_valid_ids(engine, small_catalog):
    """A random-weight model says nothing sensible; under the grammar its answer is still a
    list of candidate ids, and the index puts them first."""
    reranker = ChatReranker(engine)
    index = ToolIndex(small_catalog, reranker=reranker)
    r = index.rank_detail("open a PR from my branch", 3)
    assert r.stages == ["bm25", "chat"], (r, reranker.last_text, reranker.last_note)
    ids = {t.id for t in small_catalog}
    said = [s.strip() for s in reranker.last_text.split(",")]
    assert said and all(s in ids for s in said), reranker.last_text
    assert [i for i, _ in r.results][: len(set(said))] == list(dict.fromkeys(said))[:3]


def test_scripted_answer_reorders_and_a_malformed_one_falls_back(engine, small_catalog):
    index = ToolIndex(small_catalog, reranker=ChatReranker(engine, constrain=False))
    stage1 = [i for i, _ in index.rank_detail("open a PR from my branch", 3, use_reranker=False).results]
    with scripted_output(engine.tokenizer, "github.fork_repository, git.git_log"):
        r = index.rank_detail("open a PR from my branch", 3)
    assert r.stages == ["bm25", "chat"] and [i for i, _ in r.results][:2] == ["github.fork_repository", "git.git_log"]
    assert r.results[0][1] > r.results[1][1] > r.results[2][1]
    with scripted_output(engine.tokenizer, "I think the best tool is the pull request one!"):
        r = index.rank_detail("open a PR from my branch", 3)
    assert r.stages == ["bm25"] and "kept the offline order" in r.note
    assert [i for i, _ in r.results] == stage1


# -- mlxlocal tools rank ------------------------------------------------------------------------

def test_tools_rank_json(tmp_path):
    res = CliRunner().invoke(app, ["tools", "rank", "--tools", str(FIXTURES / "tools.json"),
                                   "--queries", str(FIXTURES / "queries.json"), "--k", "3", "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["k"] == 3 and out["tools"] >= 80 and len(out["queries"]) >= 50
    first = out["queries"][0]
    assert set(first) >= {"query", "results", "stages"} and first["stages"] == ["bm25"]
    assert len(first["results"]) == 3 and all(set(r) == {"id", "score"} for r in first["results"])
    (tmp_path / "q.json").write_text(json.dumps(["start a new branch"]))
    res = CliRunner().invoke(app, ["tools", "rank", "--tools", str(FIXTURES / "tools.json"),
                                   "--query", "switch to the develop branch", "--stage1-only"])
    assert res.exit_code == 0 and "git.git_checkout" in res.stdout


@pytest.mark.parametrize("setup, args, message", [
    ("tools", ["--query", "x"], "[1].name: missing"),
    ("queries", ["--queries", "{q}"], "[1]: expected a non-empty string"),
    ("none", ["--query", "x", "--queries", "{q}"], "exactly one of --query and --queries"),
    ("none", ["--query", "x", "--k", "0"], "--k must be at least 1"),
])
def test_tools_rank_errors_name_the_file_and_field(tmp_path, setup, args, message):
    tools = FIXTURES / "tools.json"
    q = tmp_path / "q.json"
    q.write_text(json.dumps(["fine", 3] if setup == "queries" else ["fine"]))
    if setup == "tools":
        tools = tmp_path / "tools.json"
        tools.write_text(json.dumps([{"server": "a", "name": "b"}, {"server": "a"}]))
    res = CliRunner().invoke(app, ["tools", "rank", "--tools", str(tools), *[a.format(q=q) for a in args]])
    assert res.exit_code == 2, res.output
    assert message in res.output
    if setup in ("tools", "queries"):
        assert str(tools if setup == "tools" else q) in res.output.replace("\n", "")
