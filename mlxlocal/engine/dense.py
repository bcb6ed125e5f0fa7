"""The dense engine (SimpleEngine): one sequence on dense caches, a session keeping the KV between turns.

Used for models that run on mlx-lm's model code (no paged attention there).
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.sample_utils import make_sampler

from mlxlocal.engine.base import WORKER_STREAM, EngineBase
from mlxlocal.engine.constraint import Constraint, allowed_tokens
from mlxlocal.engine.contract import DISK_STATS_KEYS
from mlxlocal.engine.errors import EngineDeadError
from mlxlocal.engine.handle import RequestHandle
from mlxlocal.engine.output import Output
from mlxlocal.engine.sampling import Sampler, mask_logprobs
from mlxlocal.engine.session import Session, common_prefix
from mlxlocal.engine.types import Chunk, SamplingParams
from mlxlocal.errors import NonFiniteLogitsError
from mlxlocal.source.loader import LoadedModel


class DenseSession(Session):
    """A conversation's dense KV cache (mlx-lm's cache objects), reused across turns."""

    def __init__(self, cache: list[Any], make_cache: Callable[[], list[Any]] | None = None):
        super().__init__()
        self.cache = cache
        self._make_cache = make_cache

    @property
    def cached_len(self) -> int:
        # After an interrupted step, layers may disagree: trust the shortest. Recurrent
        # caches (ArraysCache, CacheList of hybrids) have no offset: they hold self.tokens.
        lengths = [int(c.offset) for c in self.cache if hasattr(c, "offset")]
        return min(lengths) if lengths else len(self.tokens)

    def reuse(self, prompt: list[int]) -> int:
        """Trim the cache to the longest common prefix with `prompt`; return its length.

        A cache that cannot be trimmed (a recurrent state) is kept only when the prompt
        extends everything it holds; otherwise the turn starts on a fresh cache.
        """
        held = self.tokens[: self.cached_len]
        common = common_prefix(held, prompt)
        drop = self.cached_len - common
        if drop and not self._trim(drop):
            common = 0
            self.start_over()
        self.tokens = held[:common]
        return common

    def _trim(self, n: int) -> bool:
        if all(hasattr(c, "trim") and getattr(c, "is_trimmable", lambda: True)() for c in self.cache):
            for c in self.cache:
                c.trim(n)
            return True
        return False

    def start_over(self) -> None:
        """A fresh cache holding nothing (a recurrent state cannot be trimmed, a failed step
        leaves it out of step). The engine's new_session always passes the factory; a
        caller-built cache without one cannot be renewed here."""
        if self._make_cache is not None:
            self.cache = self._make_cache()
        self.tokens = []

    def reset(self) -> None:
        if not self._trim(self.cached_len):
            self.start_over()
        self.tokens = []


def _cache_arrays(cache: list[Any]) -> list[mx.array]:
    # CacheList.state holds type names and ArraysCache.state may hold None: eval arrays only.
    return [v for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)]


class SimpleEngine(EngineBase):
    """One sequence at a time on dense caches: the path for models mlx-lm runs for us."""

    def __init__(self, loaded: LoadedModel, max_step_tokens: int = 512,
                 paged_reason: str = "chosen by the caller", **_ignored: Any):
        super().__init__(loaded)
        self.prefill_step = max_step_tokens
        self._native = loaded.info.native
        self.paged_reason = paged_reason  # why the paged engine cannot hold this model (open_engine)
        self._busy = threading.Lock()  # submitted requests run one at a time
        self._live: dict[RequestHandle, threading.Thread] = {}  # submitted, not yet ended
        self.dead_reason: str | None = None  # set by shutdown: no more requests
        # The paged engine's counters, so stats() has the same keys; updated by the one
        # generating thread at a time (plain ints).
        self.tokens_in = 0
        self.tokens_out = 0
        self.prefix_hit_tokens = 0
        self._running = 0

    def new_session(self) -> DenseSession:
        return DenseSession(self.loaded.make_cache(), self.loaded.make_cache)

    # --- generation ----------------------------------------------------------------
    def _forward(self, tokens: mx.array, cache: list[Any]) -> mx.array:
        if self._native:
            logits = self.model(tokens[None], cache, last_only=True)
        else:
            logits = self.model(tokens[None], cache=cache)
        return logits[:, -1, :]

    def generate(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        session: DenseSession | None = None,
        cancel: threading.Event | None = None,
        edits: list | None = None,
    ) -> Iterator[Chunk]:
        """Validate now (errors raise here, before any chunk), then stream Chunks."""
        params = params or SamplingParams()
        self._refuse_edits(edits)
        self.validate(prompt, params)
        self._check_alive()
        return self._generate(prompt, params, session or self.new_session(), cancel, self.constraint(params))

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        session: DenseSession | None = None,
        cancel: threading.Event | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        edits: list | None = None,
    ) -> RequestHandle:
        """The paged engine's submit, for callers that need it (the server): one worker
        thread per request, one request at a time, chunks through a RequestHandle."""
        params = params or SamplingParams()
        self._refuse_edits(edits)
        self.validate(prompt, params)  # bad requests raise here, before any thread starts
        constraint = self.constraint(params)
        self._check_alive()
        session = session or self.new_session()
        prefilled = [0]  # prompt tokens in the cache: written by the worker, read by progress()

        def work():
            try:
                # MLX streams belong to threads: this worker runs on its own.
                with self._busy, mx.stream(WORKER_STREAM):
                    self._check_alive()  # shut down while this one waited its turn?
                    chunks = self._generate(prompt, params, session, handle.cancelled, constraint, prefilled)
                    for chunk in chunks:
                        handle.put(chunk)
            except Exception as e:  # raised in the consumer
                handle.put(e)
            finally:
                self._live.pop(handle, None)
                mx.clear_streams()

        worker = threading.Thread(target=work, name="mlxlocal-simple-request", daemon=True)
        # Should the worker end without a last word, its consumer still wakes up.
        handle = RequestHandle(cancel, loop, progress=lambda: (prefilled[0], len(prompt)),
                               dead=lambda: None if worker.is_alive() else "its worker thread ended")
        self._live[handle] = worker
        worker.start()
        return handle

    def _refuse_edits(self, edits: list | None) -> None:
        if edits:
            raise ValueError("cache edits (drop / reposition) need the paged KV cache; this model runs on "
                             f"the dense engine ({self.paged_reason})")

    @property
    def kv_pool(self) -> dict:
        # A growing cache per request or session, no shared pool; the reason it is not paged.
        return {"kind": "dense", "reason": self.paged_reason}

    def stats(self) -> dict:
        """The paged engine's keys: no blocks (dense caches), one request running at a time."""
        running = min(self._running, 1)
        stats = {
            "blocks_total": 0, "blocks_max": 0, "blocks_used": 0, "blocks_cached": 0, "blocks_free": 0, "block_size": 0,
            "waste": 0.0, "prefix_hit_tokens": self.prefix_hit_tokens,
            "running": running, "waiting": max(len(self._live) - running, 0),
            "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
            "tokens_dropped": 0, "tokens_repositioned": 0,
            "spec_steps": 0, "spec_rows": 0, "spec_drafted": 0, "spec_accepted": 0,
            **dict.fromkeys(DISK_STATS_KEYS, 0),
        }
        if self.dead_reason is not None:
            stats["dead_reason"] = self.dead_reason
        return stats

    def shutdown(self, timeout: float = 5.0) -> None:
        """Refuse new requests, cancel the submitted ones (they stop at the next token or
        prefill chunk) and wait for them about `timeout` seconds; fail any still going."""
        self.dead_reason = self.dead_reason or "the engine was shut down"
        live = list(self._live.items())
        for handle, _ in live:
            handle.cancel()
        deadline = time.monotonic() + timeout
        for handle, worker in live:
            worker.join(max(deadline - time.monotonic(), 0))
            if worker.is_alive():
                handle.put(self._dead_error())

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"the engine for {self.info.name} has stopped: {self.dead_reason}")

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise self._dead_error()

    def _generate(
        self, prompt: list[int], params: SamplingParams, session: DenseSession, cancel: threading.Event | None,
        constraint: Constraint | None = None, prefilled: list[int] | None = None,
    ) -> Iterator[Chunk]:
        session.claim()  # at the first chunk: a generator never started holds nothing
        self._running += 1
        try:
            yield from self._stream(prompt, params, session, cancel, constraint, prefilled)
        except Exception:
            # A step that failed halfway leaves the cache out of step with session.tokens:
            # the session's next turn starts over on a fresh cache.
            session.start_over()
            raise
        finally:
            self._running -= 1
            session.busy = False

    def _stream(
        self, prompt: list[int], params: SamplingParams, session: DenseSession, cancel: threading.Event | None,
        constraint: Constraint | None, prefilled: list[int] | None = None,
    ) -> Iterator[Chunk]:
        mx.reset_peak_memory()
        if params.seed is not None:
            mx.random.seed(params.seed)
        sampler = make_sampler(params.temperature, params.top_p, params.min_p, 1, params.top_k)
        # Penalties and logit_bias through the paged engine's code; sampling stays mlx-lm's
        # (seeded through the global generator, as mlx-lm's generate is).
        shaper = Sampler(params, prompt_len=len(prompt))
        out = Output(self.tokenizer.detokenizer, params, set(self.tokenizer.eos_token_ids), len(prompt),
                     min(params.max_tokens, self.context_length - len(prompt)))
        stats = out.stats
        think = self.think_budget(params, prompt, self.context_length - len(prompt))
        stats.cached_tokens = session.reuse(prompt)
        self.tokens_in += len(prompt)
        self.prefix_hit_tokens += stats.cached_tokens
        cache = session.cache

        # Prefill what the cache does not hold, in chunks; only the last chunk's logits matter.
        # A cancel is honoured between chunks (before the first one too).
        todo = prompt[stats.cached_tokens :]
        prefilled = prefilled if prefilled is not None else [0]
        prefilled[0] = stats.cached_tokens
        while True:
            if cancel is not None and cancel.is_set():
                yield out.finish("cancelled")
                return
            if len(todo) <= self.prefill_step:
                break
            self._forward(mx.array(todo[: self.prefill_step], mx.uint32), cache)
            mx.eval(_cache_arrays(cache))
            session.tokens.extend(todo[: self.prefill_step])
            todo = todo[self.prefill_step :]
            prefilled[0] = len(prompt) - len(todo)
        session.tokens.extend(todo)

        def sample(logits: mx.array, history: list[int]) -> tuple[mx.array, mx.array]:
            """(token [1], the logits' log-sum-exp [1, 1]: not finite when they were not), lazy."""
            logits = shaper.adjust(logits, history)
            lse = mx.logsumexp(logits, axis=-1, keepdims=True)
            logprobs = logits - lse
            if constraint is not None:  # its matcher has seen every token before this one
                logprobs = mask_logprobs(logprobs, allowed_tokens(self.grammars, [constraint]))
            # mlx-lm's sampler in float32 (1/T overflows float16); on NaN its draw can land
            # past the vocabulary, and the next forward reads that row: kept in range.
            token = mx.minimum(sampler(logprobs.astype(mx.float32)), logprobs.shape[-1] - 1)
            return token, lse

        history = list(prompt)  # prompt + generated, grown in place: the sampler's penalties read it
        y, lse = sample(self._forward(mx.array(todo, mx.uint32), cache), history)
        mx.async_eval(y, lse)
        cause = None
        while True:
            token = int(y.item())
            if not math.isfinite(lse.item()):
                raise NonFiniteLogitsError(out.generated)
            prefilled[0] = len(prompt)
            out.first_token()
            if constraint is not None:
                constraint.advance(token)
            chunk, finish = out.token(token)
            if chunk is None:  # EOS
                break
            history.append(token)
            self.tokens_out += 1
            cancelled = cancel is not None and cancel.is_set()
            # A thinking budget's marker: fed with this token, its text after this chunk.
            close = think.after(token, out.generated) if think and finish is None else None
            written = None
            if close and not cancelled:
                written, finish, cause = think.write(out, close)
                close = close if written is not None else None
            if finish is None and not cancelled:
                # Queue the next step before handing this token out, so the device keeps working.
                feed = y.reshape(1)
                if close:
                    feed = mx.concatenate([feed, mx.array(close, y.dtype)])
                history.extend(close or ())
                next_y, next_lse = sample(self._forward(feed, cache), history)
                mx.async_eval(next_y, next_lse)
                session.tokens += [token, *(close or ())]
            yield chunk
            if written is not None:
                yield written
            if finish is not None or cancelled:
                finish = "cancelled" if cancelled and finish != "stop" else finish
                break
            y, lse = next_y, next_lse
        if constraint is not None:
            stats.grammar_complete = constraint.complete
        yield out.finish(finish, cause)
