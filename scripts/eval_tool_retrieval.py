"""Tool retrieval quality and latency on the fixture set (tests/fixtures/tool_retrieval).

    python scripts/eval_tool_retrieval.py [--embed-model M] [--model CHAT_MODEL] [--json]

Prints recall@1/5/10 and MRR for BM25, dense, hybrid (RRF and min-max score fusion), the
two-stage offline ranking, and with --model the chat model as the stage-2 re-ranker; then
ranking latency on a 120-tool catalog (the fixture's tools plus renamed copies): index build
time and p50 / p95 per query. A query counts as found at rank r when any of its relevant
tools is at rank r (several tools may be right: "remember that Alice..." is create_entities
or add_observations).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tool_retrieval"


def load_set(fixtures: Path = FIXTURES):
    from mlxlocal.agents.trace import load_tools_file

    tools = load_tools_file(fixtures / "tools.json")
    queries = json.loads((fixtures / "queries.json").read_text())
    return tools, queries


def metrics(index, queries, **rank_kwargs) -> dict[str, float]:
    """recall@1/5/10 and MRR (over the top 10) of `index.rank_detail(query, 10, **rank_kwargs)`."""
    hits = {1: 0, 5: 0, 10: 0}
    rr = 0.0
    for item in queries:
        ids = [i for i, _ in index.rank_detail(item["query"], 10, **rank_kwargs).results]
        rank = next((n + 1 for n, i in enumerate(ids) if i in item["relevant"]), None)
        if rank is not None:
            rr += 1.0 / rank
            for cut in hits:
                hits[cut] += rank <= cut
    n = len(queries)
    return {"recall@1": hits[1] / n, "recall@5": hits[5] / n, "recall@10": hits[10] / n, "mrr": rr / n}


def evaluate(tools, queries, embedder=None, reranker=None) -> dict[str, dict[str, float]]:
    from mlxlocal.agents.tool_index import ToolIndex

    index = ToolIndex(tools, embedder)
    rows = {"bm25": metrics(index, queries, method="bm25")}
    if embedder is None:
        rows["two-stage offline (bm25 only)"] = metrics(index, queries)
        return rows
    rows["dense"] = metrics(index, queries, method="dense")
    rows["hybrid (score fusion, default)"] = metrics(index, queries, stage1_only=True)
    rrf = ToolIndex(tools, embedder, fusion="rrf")
    rows["hybrid (rrf)"] = metrics(rrf, queries, stage1_only=True)
    rows["two-stage offline (rrf stage 1)"] = metrics(rrf, queries)
    rows["two-stage offline (default)"] = metrics(index, queries)
    if reranker is not None:
        index.reranker = reranker
        rows["two-stage chat re-ranker"] = metrics(index, queries)
    return rows


class Recorded:
    """An embedder that answers from recorded vectors (text -> vector) and records what it
    must compute: the fixture set's MiniLM vectors are kept in tests/fixtures so the tests
    and a rerun of the table do not wait minutes for the CPU encoder."""

    def __init__(self, embedder=None, path: Path | None = None):
        import numpy as np

        self.embedder = embedder
        self.table: dict[str, np.ndarray] = {}
        if path is not None and path.exists():
            data = np.load(path)
            self.table = dict(zip(data["texts"].tolist(), data["vectors"].astype(np.float32)))

    def embed(self, texts, normalize=True):
        import numpy as np

        missing = list(dict.fromkeys(t for t in texts if t not in self.table))
        if missing:
            if self.embedder is None:
                raise KeyError(f"no recorded vector for {missing[0]!r}")
            self.table.update(zip(missing, np.asarray(self.embedder.embed(missing, normalize=True), np.float32)))
        return np.stack([self.table[t] for t in texts])

    def save(self, path: Path) -> None:
        import numpy as np

        np.savez_compressed(path, texts=np.array(list(self.table)), vectors=np.stack(list(self.table.values())).astype(np.float16))


def catalog_120(tools):
    """The fixture's tools plus copies under a second server name, up to 120."""
    extra = [replace(t, server=f"{t.server}-mirror") for t in tools[: max(0, 120 - len(tools))]]
    return list(tools) + extra


def latency(tools, queries, embedder=None) -> dict[str, float]:
    from mlxlocal.agents.tool_index import ToolIndex

    big = catalog_120(tools)
    t0 = time.perf_counter()
    index = ToolIndex(big, embedder)
    build = time.perf_counter() - t0
    t0 = time.perf_counter()
    index.update(big)  # nothing changed: the cache answers
    rebuild = time.perf_counter() - t0
    times = []
    for item in queries:
        t0 = time.perf_counter()
        index.rank(item["query"], 5)
        times.append(time.perf_counter() - t0)
    times.sort()
    return {"tools": len(big), "build_s": build, "rebuild_unchanged_s": rebuild,
            "p50_ms": 1000 * statistics.median(times), "p95_ms": 1000 * times[int(0.95 * (len(times) - 1))]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--embed-model", help="embedding model spec for the dense stage (default: none, BM25 only)")
    ap.add_argument("--model", help="chat model used as the stage-2 re-ranker")
    ap.add_argument("--record", type=Path, help="read / write the embedder's vectors here (npz: texts, vectors)")
    ap.add_argument("--no-latency", action="store_true", help="skip the 120-tool latency run")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tools, queries = load_set()
    embedder = None
    if args.embed_model:
        from mlxlocal.embeddings import open_embedder

        embedder = open_embedder(args.embed_model)
    if args.record:
        embedder = Recorded(embedder, args.record)
    reranker = None
    if args.model:
        from mlxlocal.agents.rerank import ChatReranker
        from mlxlocal.engine import open_engine
        from mlxlocal.source.loader import load

        reranker = ChatReranker(open_engine(load(args.model), max_num_seqs=1))
    rows = evaluate(tools, queries, embedder, reranker)
    if args.record:
        embedder.save(args.record)
    # Latency with the live embedder (recorded vectors would hide the encoder's cost).
    live = embedder.embedder if isinstance(embedder, Recorded) else embedder
    lat = None if args.no_latency or (args.record and live is None) else latency(tools, queries, live)
    if args.json:
        print(json.dumps({"tools": len(tools), "queries": len(queries), "rows": rows, "latency": lat}))
        return 0
    servers = len({t.server for t in tools})
    print(f"{len(tools)} tools on {servers} servers, {len(queries)} queries"
          f"{'' if embedder else ' (no --embed-model: BM25 only)'}")
    print(f"{'method':36} {'R@1':>6} {'R@5':>6} {'R@10':>6} {'MRR':>6}")
    for name, m in rows.items():
        print(f"{name:36} {m['recall@1']:6.3f} {m['recall@5']:6.3f} {m['recall@10']:6.3f} {m['mrr']:6.3f}")
    if lat is None:
        return 0
    print(f"latency, {lat['tools']} tools: build {lat['build_s']:.2f} s (unchanged rebuild "
          f"{1000 * lat['rebuild_unchanged_s']:.1f} ms), rank p50 {lat['p50_ms']:.1f} ms, p95 {lat['p95_ms']:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
