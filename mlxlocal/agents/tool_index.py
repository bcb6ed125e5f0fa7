"""The tool index: which of an agent's MCP tools matter for a request (dynamic tool pruning).

An agent with a few MCP servers carries 50-150 tools whose schemas cost thousands of prompt
tokens a turn; a search over them picks the few the current sub-task needs. Two stages:

1. Recall, over the whole catalog: BM25 (bm25s) on each tool's document (its name split into
   words, server, description, parameter names and descriptions, annotation title) plus
   dense cosine similarity with an embedder (optional; mlxlocal.embeddings), fused by
   min-max normalised score fusion. Measured against reciprocal rank fusion on the fixture
   set with all-MiniLM-L6-v2 (scripts/eval_tool_retrieval.py), score fusion kept more of the
   dense ranking's lead where BM25 has no evidence (a query sharing no word with any tool
   gives BM25 a flat list whose ranks RRF still counts as votes; min-max of a near-flat
   list is small noise next to a confident cosine), and it gave stage 2 the higher MRR.
   Neither fusion beats dense alone by much here: most queries share no word with their tool.
2. Precision, over the top RECALL_DEPTH of stage 1: offline (no chat model) the candidates
   are re-scored by dense similarity per field (name / description / parameters, each its
   own embedding) added to the whole document's and to the stage-1 evidence; a query
   phrased as users speak often matches one field strongly ("what's in the downloads
   folder" -> list_directory's "path: directory to list") and that is diluted in the
   document's single embedding. With a chat model (rerank.ChatReranker) the model orders
   the candidates itself.

Embeddings are cached per tool, keyed by a hash of the tool's document: `update(tools)` (an
MCP `tools/list_changed`, McpHub.tools_version moved) embeds only tools whose text changed.
The index uses the embedder only through `embed(texts, normalize=True) -> float32 [n, d]`.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from mlxlocal.agents.types import ToolInfo

RECALL_DEPTH = 20  # candidates stage 2 sees: the "top ~20", a listwise prompt that fits
RRF_K = 60  # the constant of Cormack et al.; flattens the head so both rankings get a say
FIELDS = ("doc", "name", "description", "params")
# Stage-2 (offline) weights of: stage-1 RRF evidence (scaled to [0, 1]), the whole document's
# cosine, and the best field's cosine. Chosen on the fixture set; see the eval script.
STAGE2_WEIGHTS = (0.2, 0.4, 1.0)

_STOP = frozenset("""a an the and or of to in on for with by from at as is are was were be been it its this
that these those i me my we our you your he she they them their his her do does did can could would
should will shall may might must has have had not no yes so if then than there here what which who whom
whose when where why how all any some into out up down over about just also please want need let get
something anything one""".split())


class Embedder(Protocol):
    def embed(self, texts: list[str], normalize: bool = True) -> np.ndarray: ...


def split_identifier(name: str) -> str:
    """`read_multiple_files` / `getFileInfo` / `kubectl-logs` -> words a query would use."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    spaced = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1 \2", spaced)
    return " ".join(re.split(r"[_\-.\s/]+", spaced)).lower().strip()


def _stem(word: str) -> str:
    # A light suffix strip so "files" meets "file" and "commits" meets "commit"; a real stemmer
    # (Porter) would be a dependency for a few points, and it merges words that must differ here.
    for suffix, keep in (("ies", "y"), ("sses", "ss"), ("ing", ""), ("ed", ""), ("s", "")):
        if word.endswith(suffix) and len(word) - len(suffix) >= 3 and not word.endswith("ss"):
            return word[: len(word) - len(suffix)] + keep
    return word


def tokenize(text: str) -> list[str]:
    words = re.findall(r"[a-z0-9]+", split_identifier(text))
    return [_stem(w) for w in words if w not in _STOP and len(w) > 1]


def _schema_params(schema: dict[str, Any]) -> list[tuple[str, str]]:
    props = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(props, dict):
        return []
    out = []
    for pname, spec in props.items():
        desc = spec.get("description", "") if isinstance(spec, dict) else ""
        out.append((str(pname), desc if isinstance(desc, str) else ""))
    return out


def tool_fields(tool: ToolInfo) -> dict[str, str]:
    """The texts a tool is found by: its name in words (with the annotation title), its
    description, its parameters (names in words with their descriptions), and all of them
    as one document (the server name included: "github" or "slack" in a query is evidence)."""
    title = tool.annotations.get("title", "") if isinstance(tool.annotations.get("title"), str) else ""
    name = split_identifier(tool.name)
    if title and title.lower() != name:
        name = f"{name} ({title})"
    params = "; ".join(f"{split_identifier(p)}: {d}" if d else split_identifier(p)
                       for p, d in _schema_params(tool.input_schema))
    desc = tool.description.strip()
    doc = f"{name}. {desc} Server: {split_identifier(tool.server)}. Parameters: {params}".strip()
    return {"doc": doc, "name": name, "description": desc or name, "params": params or name}


def tool_key(tool: ToolInfo) -> str:
    """The cache key of a tool's embeddings: a hash of the texts they are computed from."""
    return hashlib.sha256(json.dumps(tool_fields(tool), sort_keys=True).encode()).hexdigest()


@dataclass
class Ranking:
    """One query's answer: [(tool id, score)] best first, the stages that ran ("bm25",
    "dense", "fusion", "fields", "chat"), and a note when a stage fell back."""

    results: list[tuple[str, float]]
    stages: list[str]
    candidates: list[str] = field(default_factory=list)  # stage 1's top RECALL_DEPTH
    note: str = ""


Reranker = Callable[[str, list[ToolInfo], int], "list[str] | None"]


class ToolIndex:
    """`ToolIndex(tools, embedder=None)`; `rank(query, k)` -> [(tool id, score)].

    Without an embedder the index is BM25 only (stage 2's field scores need embeddings, so
    stage 1 is the answer). `reranker(query, candidates, k) -> ids or None` (a ChatReranker)
    replaces the offline stage 2; None from it (a malformed answer) keeps the offline order.
    """

    def __init__(self, tools: Sequence[ToolInfo], embedder: Embedder | None = None, *,
                 fusion: str = "score", recall_depth: int = RECALL_DEPTH,
                 reranker: Reranker | None = None):
        if fusion not in ("rrf", "score"):
            raise ValueError(f"fusion must be 'rrf' or 'score', got {fusion!r}")
        self.embedder = embedder
        self.fusion = fusion
        self.recall_depth = recall_depth
        self.reranker = reranker
        self._cache: dict[str, dict[str, np.ndarray]] = {}  # tool_key -> field -> unit vector
        self.embedded_tools = 0  # tools whose embeddings were computed (not cached), ever
        self.tools: list[ToolInfo] = []
        self.update(tools)

    # -- building ----------------------------------------------------------------------------

    def update(self, tools: Sequence[ToolInfo]) -> int:
        """Index `tools` (the whole new catalog); returns how many tools were embedded anew.
        Unchanged tools keep their cached embeddings; tools gone from the catalog leave it."""
        import bm25s  # imported here: `mlxlocal --help` should not pay for it

        self.tools = list(tools)
        self.ids = [t.id for t in self.tools]
        self._by_id = {t.id: t for t in self.tools}
        self.fields = [tool_fields(t) for t in self.tools]
        corpus = [tokenize(f"{f['name']} {f['doc']}") or ["_empty_"] for f in self.fields]  # name twice: weight
        self._bm25 = bm25s.BM25()
        if self.tools:
            self._bm25.index(corpus, show_progress=False)
        fresh = 0
        if self.embedder is not None:
            keys = [tool_key(t) for t in self.tools]
            todo = [i for i, key in enumerate(keys) if key not in self._cache]
            if todo:
                texts = [self.fields[i][f] for i in todo for f in FIELDS]
                vectors = np.asarray(self.embedder.embed(texts, normalize=True), dtype=np.float32)
                for j, i in enumerate(todo):
                    self._cache[keys[i]] = {f: vectors[j * len(FIELDS) + n] for n, f in enumerate(FIELDS)}
            fresh = len(todo)
            self.embedded_tools += fresh
            live = set(keys)
            self._cache = {k: v for k, v in self._cache.items() if k in live}
            self._matrix = {f: np.stack([self._cache[k][f] for k in keys]) if keys else np.zeros((0, 1), np.float32)
                            for f in FIELDS}
        return fresh

    def tool(self, tool_id: str) -> ToolInfo:
        return self._by_id[tool_id]

    # -- scoring -----------------------------------------------------------------------------

    def bm25_scores(self, query: str) -> np.ndarray:
        tokens = [t for t in tokenize(query) if t in self._bm25.vocab_dict] if self.tools else []
        if not tokens:
            return np.zeros(len(self.tools), np.float32)
        return np.asarray(self._bm25.get_scores(tokens), dtype=np.float32)

    def _query_vector(self, query: str) -> np.ndarray:
        if self.embedder is None:
            raise ValueError("dense scoring needs an embedder")
        return np.asarray(self.embedder.embed([query], normalize=True), dtype=np.float32)[0]

    def dense_scores(self, query: str, q: np.ndarray | None = None, fld: str = "doc") -> np.ndarray:
        q = self._query_vector(query) if q is None else q
        return self._matrix[fld] @ q

    def stage1(self, query: str, q: np.ndarray | None = None) -> tuple[np.ndarray, list[str]]:
        """Fused stage-1 scores over the whole catalog (higher is better) and the stages used."""
        bm = self.bm25_scores(query)
        if self.embedder is None:
            return bm, ["bm25"]
        dense = self.dense_scores(query, q)
        if self.fusion == "rrf":
            fused = _rrf(bm) + _rrf(dense)
        else:
            fused = _minmax(bm) + _minmax(dense)
        return fused, ["bm25", "dense", "fusion"]

    def stage2_fields(self, query: str, q: np.ndarray, candidates: np.ndarray, stage1: np.ndarray) -> np.ndarray:
        """Offline precision over the candidates: stage-1 evidence + the document's cosine +
        the best single field's cosine (max-sim over name / description / parameters)."""
        w_s1, w_doc, w_field = STAGE2_WEIGHTS
        s1 = stage1[candidates]
        s1 = (s1 - s1.min()) / (s1.max() - s1.min()) if s1.max() > s1.min() else np.zeros_like(s1)
        per_field = np.stack([self._matrix[f][candidates] @ q for f in ("name", "description", "params")])
        doc = self._matrix["doc"][candidates] @ q
        return w_s1 * s1 + w_doc * doc + w_field * per_field.max(axis=0)

    def rank_detail(self, query: str, k: int = 5, stage1_only: bool = False, *, method: str | None = None,
                    use_reranker: bool = True) -> Ranking:
        """The ranking with its provenance. `method` (for evaluation) restricts stage 1 to
        "bm25" or "dense" alone."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        if not self.tools:
            return Ranking([], [])
        q = self._query_vector(query) if self.embedder is not None else None
        if method == "bm25":
            scores, stages = self.bm25_scores(query), ["bm25"]
        elif method == "dense":
            if q is None:
                raise ValueError("dense ranking needs an embedder")
            scores, stages = self.dense_scores(query, q), ["dense"]
        else:
            scores, stages = self.stage1(query, q)
        order = np.argsort(-scores, kind="stable")
        cand = order[: self.recall_depth]
        candidates = [self.ids[i] for i in cand]
        # BM25 alone with no query word in any tool: the order is the catalog's, not a ranking.
        note = ("no word of the query matches any tool; an embedder (--embed-model) finds tools by meaning"
                if stages == ["bm25"] and not scores.any() else "")
        if stage1_only or method is not None:
            return Ranking([(self.ids[i], float(scores[i])) for i in order[:k]], stages, candidates, note)
        if q is not None:
            s2 = self.stage2_fields(query, q, cand, scores)
            inner = np.argsort(-s2, kind="stable")
            ranked = [(self.ids[cand[j]], float(s2[j])) for j in inner]
            stages = stages + ["fields"]
        else:
            ranked = [(self.ids[i], float(scores[i])) for i in cand]
        if self.reranker is not None and use_reranker:
            chosen = self.reranker(query, [self._by_id[i] for i, _ in ranked], k)
            if chosen:
                ranked = _promote(ranked, chosen)
                stages = stages + ["chat"]
            else:
                why = getattr(self.reranker, "last_note", "")
                note = f"the chat model's answer named no candidate; kept the offline order{': ' + why if why else ''}"
        return Ranking(ranked[:k], stages, candidates, note)

    def rank(self, query: str, k: int = 5, stage1_only: bool = False) -> list[tuple[str, float]]:
        return self.rank_detail(query, k, stage1_only).results


def _rrf(scores: np.ndarray) -> np.ndarray:
    ranks = np.empty(len(scores), np.float32)
    ranks[np.argsort(-scores, kind="stable")] = np.arange(1, len(scores) + 1)
    return 1.0 / (RRF_K + ranks)


def _minmax(scores: np.ndarray) -> np.ndarray:
    lo, hi = float(scores.min()), float(scores.max())
    return (scores - lo) / (hi - lo) if hi > lo else np.zeros_like(scores)


def _promote(ranked: list[tuple[str, float]], chosen: list[str]) -> list[tuple[str, float]]:
    """The model's ids first in its order, then the remaining candidates in their order.
    Scores are positional (the model gives an order, not scores): 1/position for its picks,
    the rest spread below the last pick, so scores decrease down the whole list."""
    picked = [c for c in dict.fromkeys(chosen) if any(c == i for i, _ in ranked)]
    out = [(c, 1.0 / (n + 1)) for n, c in enumerate(picked)]
    floor = 1.0 / (len(picked) + 1)
    rest = [i for i, _ in ranked if i not in set(picked)]
    out += [(i, floor * (len(rest) - n) / (len(rest) + 1)) for n, i in enumerate(rest)]
    return out
