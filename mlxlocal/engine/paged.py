"""The paged engine: one thread owns all MLX work; requests arrive through a queue.

Each step the scheduler picks a decode batch and at most one prefill chunk; the model
runs them through the paged KV pools; sampled tokens stream back to each request's
queue. Finished sequences leave their blocks (the last one as a partial leaf, copied on
reuse) in the radix prefix cache.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterator

import mlx.core as mx

from mlxlocal.cache import BlockManager, KVPools
from mlxlocal.cache.disk import default_kv_dir
from mlxlocal.cache.disk.tier import DiskTier
from mlxlocal.cache.states import StateSnapshots
from mlxlocal.cache.window import WindowBlocks
from mlxlocal.engine import edits as cache_edits
from mlxlocal.engine.base import WORKER_STREAM, EngineBase
from mlxlocal.engine.config import EngineConfig, size_pools
from mlxlocal.engine.contract import DISK_STATS_KEYS
from mlxlocal.engine.errors import EngineDeadError, OutOfCapacity, QueueFull
from mlxlocal.engine.handle import Outbox, RequestHandle
from mlxlocal.engine.idle import IdleChores
from mlxlocal.engine.kernels import warm_up
from mlxlocal.engine.output import Output
from mlxlocal.engine.profile import StepProfile
from mlxlocal.engine.reuse import PrefixReuse
from mlxlocal.engine.runner import Runner, make_runner, warm_thread
from mlxlocal.engine.sampling import Sampler
from mlxlocal.engine.scheduler import Scheduler
from mlxlocal.engine.sequence import Sequence, Status
from mlxlocal.engine.session import PagedSession, Session
from mlxlocal.engine.speculative import ModelDrafter, MTPDrafter, Speculator
from mlxlocal.engine.step import Sampled, StepPhases
from mlxlocal.engine.types import CacheEdit, Chunk, SamplingParams
from mlxlocal.errors import FatalEngineError
from mlxlocal.source.loader import LoadedModel

log = logging.getLogger("mlxlocal.engine")


class PagedEngine(EngineBase, StepPhases):
    """Sampling and hand-out, the phases after the forward, are StepPhases' (step.py)."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None,
                 runner: Runner | None = None):
        super().__init__(loaded)
        self.config = cfg = config or EngineConfig()
        self.runner = runner = runner or make_runner(loaded)
        runner.on_lost = self._die  # tensor parallel: ranks that stop answering stop the engine
        bs = cfg.block_size
        spec = cfg.speculative
        drafter = (None if spec is None or spec.method == "lookup" else
                   MTPDrafter(loaded) if spec.method == "mtp" else ModelDrafter(spec.draft, loaded))
        size = size_pools(cfg, runner, self.context_length, drafter.bytes_per_block(bs) if drafter else 0)
        window_blocks, window = size.window_blocks, size.window
        windowed = [w is not None for w in runner.windows]
        q = dict(bits=cfg.kv_bits, group_size=cfg.kv_group_size)
        # Pools grow on demand up to the budget where nothing else shares their block ids (a
        # draft model's pools) or must follow (a cluster's mirrored pools).
        resizable = (bool(size.start_blocks) and drafter is None
                     and getattr(runner, "pools_resizable", False))
        start = size.start_blocks if resizable else size.num_blocks
        self.pools = runner.new_pools(runner.shapes, start, bs, runner.dtype, windowed, window_blocks,
                                      **q)
        self.blocks = BlockManager(start, bs, cfg.prefix_cache, max_blocks=size.num_blocks,
                                   on_resize=self.pools.resize if resizable else None)
        self._start_blocks = start
        self._idle = IdleChores(cfg.kv_shrink_idle_s, lambda: self._shrink())
        self.windows = WindowBlocks(window_blocks, bs, window) if window else None
        snapshots = None
        if runner.recurrent:
            # State snapshots may take a quarter of what the K/V pools take.
            snapshots = runner.snapshots = StateSnapshots(self.pools.nbytes_at(size.num_blocks) // 4,
                                                          runner.state_bytes)
        self.reuse = PrefixReuse(self.blocks, self.windows, snapshots)
        # Hybrid and window models resume a prefix only where their extra state is; a partly
        # matching block is never reused (no recurrent state mid-block, window blocks whole).
        whole = self.reuse.whole_blocks
        if drafter is not None:
            drafter.allocate(self.blocks.num_blocks, bs)
        self.tier = self.reuse.tier = self._open_tier(cfg, loaded, drafter)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_step_tokens,
                                   None if whole else self._copy_block, self.reuse.resume if whole else None,
                                   self.windows, snapshot_chunks=runner.recurrent, apply_edit=self._apply_edit,
                                   match_edited=self.reuse.match_edited,
                                   restore=self.tier.restore if self.tier is not None else None)
        self.spec = spec and Speculator(spec, runner, self.pools, self.scheduler, self.context_length, drafter)
        # Kernels decided (measured) and compiled for every decode shape before any request.
        self.kernel_plan = warm_up(runner, cfg, drafter.runner if drafter is not None else None)
        self._rotator: cache_edits.Rotator | None = None  # built at the first reposition
        self._ids = itertools.count()
        self._inbox: queue.Queue = queue.Queue()
        self.outbox = Outbox()  # consumers' loops woken once per step, not per token
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        # Set once, when the engine stops for good (a fault, or shutdown). Checked and set
        # under _start_lock with the inbox's puts and drain, so no request slips past it.
        self.dead_reason: str | None = None
        self.tokens_in = 0
        self.tokens_out = 0
        self.tokens_dropped = 0
        self.tokens_repositioned = 0
        self._queued = 0  # submitted, not yet running: read from any thread, so an int
        self._inflight: list[Sampled] = []  # the tokens of the step in flight
        self._fence: list[mx.array] = []  # an output of the last forward sent to evaluation
        self._wrote = False  # _write ran: this step's sampled tokens may be stale (step())
        self.profile: StepProfile | None = None  # set: step() times its phases (bench profile)
        # Started and warmed now, not at the first request: the thread, its MLX streams and
        # compiled functions (1.1 ms here) are not that request's wait.
        self._start_thread()
        self.call(lambda: warm_thread(self.runner, self.pools, self.blocks))

    # --- front-end API (any thread) ----------------------------------------------
    def new_session(self) -> PagedSession:
        return PagedSession(self)

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        session: Session | None = None,
        cancel: threading.Event | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        edits: list[CacheEdit] | None = None,
    ) -> RequestHandle:
        params = params or SamplingParams()
        kept, peak = self._check_edits(prompt, edits) if edits else (len(prompt), len(prompt))
        ids = self.checked_ids(prompt, params, length=kept)
        constraint = self.constraint(params)
        need = -(-(peak + 1) // self.config.block_size)
        if need > self.blocks.max_blocks:
            raise OutOfCapacity(
                f"prompt of {len(prompt)} tokens needs {need} KV blocks; the pool holds "
                f"{self.blocks.max_blocks} (raise --kv-cache-memory)"
            )
        if self._queued >= self.config.max_waiting:
            raise QueueFull(f"{self._queued} requests are already waiting (limit {self.config.max_waiting})")
        if self.dead_reason is not None:
            raise self._dead_error()
        if session is not None:
            session.claim()
        n = len(prompt)  # progress(): a read of the engine thread's counter, nothing on its hot path
        seq = Sequence(
            id=next(self._ids), prompt=list(prompt), params=params, sampler=None,
            out=Output(self.tokenizer.detokenizer, params, set(self.tokenizer.eos_token_ids), len(prompt),
                       min(params.max_tokens, self.context_length - kept)),
            handle=RequestHandle(cancel, loop, dead=lambda: self.dead_reason,
                                 progress=lambda: (min(seq.num_computed, n), n), outbox=self.outbox),
            session=session, prompt_ids=ids,
        )
        if edits:
            seq.edit = cache_edits.EditState.start(prompt, edits)
        seq.handle.seq = seq
        seq.constraint = constraint
        seq.think = self.think_budget(params, prompt, self.context_length - kept)
        try:
            self._post(("submit", seq))
        except EngineDeadError:
            if session is not None:
                session.busy = False
            raise
        self._queued += 1
        return seq.handle

    def generate(self, prompt, params=None, session=None, cancel=None, edits=None) -> Iterator[Chunk]:
        """Submit and stream: errors in the request raise here, before any chunk."""
        return iter(self.submit(prompt, params, session, cancel, edits=edits))

    def _check_edits(self, prompt: list[int], edits: list[CacheEdit]) -> tuple[int, int]:
        """ValueError for edits this prompt or model cannot take; else edits.fit's (context
        used, the most tokens held at once)."""
        if any(self.pools.windowed) or self.runner.recurrent:
            raise ValueError("cache edits are not supported for models with sliding-window or recurrent "
                             f"layers ({self.info.name}): their state cannot drop a span")
        if not self.pools.editable:
            raise ValueError("cache edits are not supported under tensor parallelism (--tp)")
        if any(e.reposition for e in edits) and self._rotator is None:
            self._rotator = cache_edits.Rotator(self.runner.model)
        return cache_edits.fit(len(prompt), edits, self.context_length)

    def _open_tier(self, cfg: EngineConfig, loaded: LoadedModel, drafter) -> DiskTier | None:
        """The disk tier under the prefix cache (--kv-disk), or None. In a cluster every rank
        keeps its part of the KV, window layers' blocks included (the runner mirrors rank 0's
        tier); clusters run no recurrent layers, and a runner without a mirror is said."""
        if not cfg.kv_disk or not cfg.prefix_cache:
            return None
        cluster = self.runner if type(self.pools) is not KVPools else None
        if cluster is not None:
            why = ("recurrent layers" if self.reuse.snapshots is not None else
                   None if hasattr(cluster, "tier_mirror") else "pools of this kind")
            if why is not None:
                log.warning("--kv-disk: not used for %s in a cluster (%s)", self.info.name, why)
                return None
        draft = drafter.disk_draft if drafter is not None else None
        return DiskTier.open(cfg.kv_disk_dir or str(default_kv_dir()), cfg.kv_disk,
                             str(loaded.info.path), self.pools, self.blocks, self.runner.dtype,
                             cfg.kv_bits, cfg.kv_group_size, self.info.name, self.reuse.snapshots,
                             draft=draft, windows=self.windows, cluster=cluster)

    def _copy_block(self, src: int, dst: int) -> None:
        self.pools.copy_block(src, dst)
        if self.spec is not None and self.spec.drafter is not None:
            self.spec.drafter.copy_block(src, dst)

    def _apply_edit(self, seq: Sequence) -> None:
        """The scheduler's hook: seq's next cache edit is due (raises OutOfBlocks)."""
        before = seq.edit.repositioned
        self.tokens_dropped += cache_edits.apply_edit(seq, self.pools, self.blocks, self._rotator)
        self.tokens_repositioned += seq.edit.repositioned - before

    def call(self, fn, timeout: float = 60.0):
        """Run fn on the engine thread (where all cache state lives) and return its result."""
        reply: queue.Queue = queue.Queue()
        self._post(("call", fn, reply))
        deadline = time.monotonic() + timeout
        while True:
            try:
                ok, value = reply.get(timeout=min(0.25, max(deadline - time.monotonic(), 0.001)))
                break
            except queue.Empty:  # a stopped engine answers every queued call; this is a backstop
                if self.dead_reason is not None:
                    raise self._dead_error() from None
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"the engine did not answer within {timeout:g} s") from None
        if not ok:
            raise value
        return value

    @property
    def num_blocks(self) -> int:
        """The pools' blocks now (they grow on demand up to blocks.max_blocks)."""
        return self.blocks.num_blocks

    @property
    def kv_pool(self) -> dict:
        n, most = self.blocks.num_blocks, self.blocks.max_blocks
        pool = {"kind": "paged", "blocks": n, "block_size": self.config.block_size,
                "bytes": self.pools.nbytes, "max_blocks": most, "max_bytes": self.pools.nbytes_at(most)}
        if self.config.kv_bits:  # quantized K/V (absent: the model dtype)
            pool.update(kv_bits=self.config.kv_bits, kv_group_size=self.config.kv_group_size)
        if self.windows is not None:  # sliding-window layers' own blocks
            pool.update(window_blocks=self.windows.num_blocks, window=self.windows.window)
        return pool

    def stats(self) -> dict:
        if self.dead_reason is not None:  # no thread owns the state any more: read it here
            return {**self._stats(), "dead_reason": self.dead_reason}
        return self.call(self._stats)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop for good within about `timeout` seconds: running requests end "cancelled"
        at the next step, queued ones get EngineDeadError."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._inbox.put(("stop",))
            thread.join(timeout)
            if thread.is_alive():
                log.warning("engine thread still busy after %.1f s; failing its requests", timeout)
        # Idempotent; if the thread is stuck in a long step it stops at its next loop turn.
        self._die("the engine was shut down")
        if thread is None or not thread.is_alive():
            self.runner.close()  # tensor parallel: the followers' loops end too
        gc.unfreeze()  # frozen at start (_start_thread): else this engine's cycles, model and
        # pools included, would never be collected
        if self.tier is not None:  # queued block writes get `timeout` to reach the disk
            self.tier.close(timeout)

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"the engine for {self.info.name} has stopped: {self.dead_reason}")

    def _post(self, item: tuple) -> None:
        """Queue work for the engine thread; refused once the engine stopped."""
        with self._start_lock:
            if self.dead_reason is not None:
                raise self._dead_error()
            self._inbox.put(item)

    # --- engine thread ---------------------------------------------------------------
    def _start_thread(self) -> None:  # at construction
        # What is alive by now (modules, the model's objects) is never scanned again by a
        # full collection: one scanned them all, 45 ms here, on the engine thread in the
        # middle of a 16k-token prompt's restore.
        gc.freeze()
        self._thread = threading.Thread(target=self._run, name="mlxlocal-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # MLX streams belong to threads: all engine work runs on this thread's own stream,
        # destroyed when the thread ends (a leftover stream aborts the process at exit).
        reason = "the engine was shut down"
        try:
            with mx.stream(WORKER_STREAM):
                self._loop()
        except BaseException as e:  # whatever it was, nobody may wait on this engine any more
            log.exception("the engine thread for %s stopped", self.info.name)
            reason = f"{type(e).__name__}: {e}"
        finally:
            self._die(reason)
            mx.clear_streams()

    def _die(self, reason: str) -> None:
        """Stop for good: refuse new work, fail every request and call still held."""
        with self._start_lock:
            if self.dead_reason is None:
                self.dead_reason = reason
            held = []
            while True:
                try:
                    held.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
        error = self._dead_error()
        seqs = [item[1] for item in held if item[0] == "submit"]
        seqs += list(self.scheduler.running) + list(self.scheduler.waiting)
        if threading.current_thread() is self._thread:  # the owner may clear its own state
            self.scheduler.running.clear()
            self.scheduler.waiting.clear()
            self._inflight = []
        self._queued = 0
        for seq in seqs:  # the KV state is abandoned with the engine: only the callers matter
            seq.handle.cancel()
            if seq.session is not None:
                seq.session.busy = False
            seq.emit(error)
        for item in held:
            if item[0] == "call":
                item[2].put((False, error))
        self.outbox.flush()

    def _loop(self) -> None:
        while self.dead_reason is None:
            block = not self.scheduler.has_work
            wait = self._idle.due_in(block, block and not self._inflight,
                                     self.blocks.num_blocks > self._start_blocks, time.monotonic())
            try:
                while True:
                    item = self._inbox.get(block=block, timeout=wait)
                    block = False
                    if item[0] == "stop":
                        for seq in list(self.scheduler.running):  # the waiting ones fail in _die
                            self._guarded(seq, self._finish, seq, "cancelled")
                        return
                    self._handle(item)
            except queue.Empty:  # a chore is due (the next turn runs it)
                pass
            try:
                self.step()
            except Exception as e:  # not pinned on one request: fail what is in flight, go on
                log.exception("engine step failed; failing %d requests", len(self.scheduler.running)
                              + len(self.scheduler.waiting))
                self._inflight = []
                for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                    self._fail(seq, e)
            self.outbox.flush()  # this step's chunks: one wake-up per consumer loop
            self._queued = len(self.scheduler.waiting)

    def _shrink(self) -> None:
        """Idle: the pools' free tail given back, down to their start size at most (blocks
        that sessions hold or the prefix cache keeps stay)."""
        before = self.blocks.num_blocks
        after = self.blocks.shrink(self._start_blocks)
        if after < before:
            mx.clear_cache()
            log.info("idle: KV pool shrunk from %d to %d blocks", before, after)

    def _handle(self, item) -> None:
        if item[0] == "submit":
            seq = item[1]
            try:
                seq.sampler = Sampler(seq.params)  # its RNG key is an MLX array: made on this thread
                if seq.session is not None:
                    seq.stats.cached_tokens = self.reuse.attach_session(seq)
                    self.scheduler.prefix_hit_tokens += seq.stats.cached_tokens
                self.scheduler.add(seq)
                self.tokens_in += len(seq.prompt)
                if self.scheduler.running:  # others decode meanwhile: read its disk blocks ahead
                    self.reuse.prefetch(seq)
            except Exception as e:  # a request the engine cannot take fails alone
                self._fail(seq, e)
        elif item[0] == "call":
            _, fn, reply = item
            try:
                reply.put((True, fn()))
            except Exception as e:
                reply.put((False, e))

    def _fail(self, seq: Sequence, error: Exception) -> None:
        """End one request with an error: its blocks freed, its session emptied; others go on."""
        if isinstance(error, FatalEngineError):  # not the request's fault: the engine stops (_run)
            raise error
        if seq.status is not Status.FINISHED:
            self.scheduler.free(seq)
            if seq.session is not None:  # what it held may be half-written: start the next turn over
                self.reuse.release_session(seq.session)
                seq.session.busy = False
            self.scheduler.finish(seq)
            seq.pending = seq.pending_from = None
        seq.emit(error)

    def _guarded(self, seq: Sequence, fn, *args, **kwargs) -> None:
        """fn(*args, **kwargs) on one request's behalf: if it raises, only that request fails."""
        try:
            fn(*args, **kwargs)
        except Exception as e:
            log.exception("request %d failed", seq.id)
            self._fail(seq, e)

    def step(self) -> None:
        """Queue this step's forward, then accept the previous step's tokens while it runs.

        Decode inputs are the previous step's sampled tokens as lazy arrays, so building
        and evaluating step N+1 overlaps with handing out step N's tokens. A sequence that
        turns out to have finished computes one wasted token, which is dropped.
        """
        if (prof := self.profile) is not None:
            prof.start()
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            if seq.cancelled.is_set():
                self._guarded(seq, self._finish, seq, "cancelled")
        if self._inflight and (any(not e.seq.out.t_first for e in self._inflight) or (
                self.spec is not None and self.spec.wants_known_tokens(self.scheduler.running))):
            # A first token goes out before the next forward is submitted, not after (MLX's
            # CPU backend blocks a submit until most of it has run: a 16k-token RAM hit's
            # TTFT 27 -> 21 ms); drafting needs the last tokens' values. The event loops
            # waiting on them are woken now too, not at the step's end.
            self._take(self._inflight)
            self._inflight = []
            self.outbox.flush()
        plan = self.scheduler.plan()
        for seq in plan.starved:  # alone and still no free block: the KV pool is full
            self._guarded(seq, self._finish, seq, "length", cause="kv_cache")
        verify, drafts = self.spec.select(plan.decode) if self.spec is not None else ([], [])
        if verify:
            plan.decode = [seq for seq in plan.decode if seq not in verify]
        groups = []
        if plan.decode:
            groups.append((plan.decode, 1))
        if plan.prefill is not None:
            groups.append(([plan.prefill], plan.prefill_tokens))
        if prof is not None:
            prof.lap("schedule")
        ready: list[tuple[list[Sequence], mx.array]] = []  # (sequences to sample, their logits)
        for seqs, n in groups:
            logits = self._forward(seqs, n)  # a batch's failure is no one request's: _loop fails all
            for seq in seqs:
                # Prompt tokens among those fed (a decode of the first sampled token may
                # already run before that token is handed out).
                seq.prefilled += max(0, min(seq.num_computed + n, len(seq.prompt)) - seq.num_computed)
                seq.num_computed += n
            rows = [i for i, seq in enumerate(seqs) if seq.remaining == 0]
            if rows:
                ready.append(([seqs[i] for i in rows], logits if len(rows) == len(seqs) else logits[mx.array(rows)]))
        previous, self._inflight = self._inflight, []
        masks: list = [None] * len(ready)
        if prof is not None:
            prof.lap("build")
        if any(seq.constraint is not None for seqs, _ in ready for seq in seqs):
            # A grammar's mask needs the previous token: take the previous step's tokens
            # while the forward runs, then work out the masks.
            self._take(previous)
            previous = []
            ready, masks = self._constrain(ready)
        sampled: list[Sampled] = []
        for (seqs, logits), allowed in zip(ready, masks):
            sampled += self._sample(seqs, logits, allowed)
        if sampled:
            checks = list({id(c[0]): c[0] for *_, c in sampled if c is not None}.values())
            logprobs = [a for _, _, lp, *_ in sampled for a in lp]
            if prof is not None:
                prof.lap("sample")
            mx.async_eval([t for _, t, *_ in sampled] + logprobs + checks)
            if prof is not None:
                prof.lap("submit")
        self._inflight = sampled
        if prof is not None:
            prof.wait(previous)
        self._take(previous)
        if self._wrote:  # a think marker was written after a token whose successor is sampled
            self._wrote = False  # here: that successor is stale, dropped; the marker is fed next
            self._inflight = [e for e in sampled if e.seq.status is Status.FINISHED
                              or len(e.seq.tokens) == e.seq.num_computed]
        for seq, token, _, src, _ in self._inflight:
            if seq.status is not Status.FINISHED:
                seq.pending, seq.pending_from = token, src
        if verify:  # drafts checked in one forward; the accepted tokens handed out now
            self._wait_forward()  # its writes then go to the pools in place (_submit)
            self.spec.verify(verify, drafts,
                             lambda seq, token, lp: self._guarded(seq, self._accept, seq, token, lp),
                             self._non_finite)
        if prof is not None:
            prof.lap("output")
            prof.end(len(plan.decode), plan.prefill_tokens if plan.prefill is not None else 0)

    def _accept(self, seq: Sequence, token: int | mx.array, lp: list[mx.array] | None = None) -> None:
        token = token if isinstance(token, int) else int(token.item())
        first = not seq.out.t_first
        if first:
            if seq.edit is not None:
                seq.stats.dropped_tokens, seq.stats.repositioned_tokens = seq.edit.dropped, seq.edit.repositioned
            seq.out.first_token(seq.prefilled)
        logprob = top = None
        if lp:
            logprob = lp[0].item()
            if len(lp) == 3:
                top = list(zip(lp[1][0].tolist(), lp[2][0].tolist()))
        if seq.constraint is not None:
            seq.constraint.advance(token)
        chunk, finish = seq.out.token(token, logprob, top)
        if chunk is not None:
            seq.tokens.append(token)
            self.tokens_out += 1
            seq.emit(chunk)
        if first:  # the prompt is computed: its full blocks shared with later requests, and
            # (no session pins it) its partial last block as a leaf they may copy from; after
            # the token went out (time to first token does not wait on it)
            self.reuse.cache_prefix(seq)
        if finish is not None:
            self._finish(seq, finish)
        elif chunk is not None and seq.think is not None:
            close = seq.think.after(token, seq.out.generated)
            if close:
                self._write(seq, close)

    def _write(self, seq: Sequence, tokens: tuple[int, ...]) -> None:
        """Write tokens after the last one, unsampled and not counted (a thinking budget's
        think-end marker); the next step feeds them, then sampling goes on."""
        chunk, finish, cause = seq.think.write(seq.out, tokens)
        if chunk is not None:
            self._wrote = True
            seq.tokens.extend(tokens)
            seq.written += len(tokens)
            seq.emit(chunk)
        if finish is not None:
            self._finish(seq, finish, cause)

    def _finish(self, seq: Sequence, reason: str, cause: str | None = None) -> None:
        if seq.constraint is not None:
            seq.stats.grammar_complete = seq.constraint.complete
        computed = seq.tokens[: seq.num_computed]
        if seq.block_table:
            self.reuse.cache_prefix(seq)
        if seq.session is not None:
            seq.session.tokens, seq.session.block_table = computed, seq.block_table
            seq.session.window_table, seq.window_table = seq.window_table, []
            # Hybrids: the state after exactly these tokens (None: the next turn rolls back
            # to a snapshot).
            seq.session.recurrent = seq.state_at(len(computed))
            seq.session.edit = seq.edit and cache_edits.held_by_session(seq.edit, computed)
            seq.block_table = []
            seq.session.busy = False
        else:
            self.scheduler.free(seq)
        self.scheduler.finish(seq)
        seq.emit(seq.out.finish(reason, cause))

    def _stats(self) -> dict:
        bs = self.config.block_size
        fill: dict[int, int] = {}
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        for seq in live:
            for i, b in enumerate(seq.block_table):
                fill[b] = max(fill.get(b, 0), min(bs, seq.num_computed - i * bs))
        used = self.blocks.num_referenced
        stored = sum(max(v, 0) for v in fill.values())
        return {
            "blocks_total": self.blocks.num_blocks,
            "blocks_max": self.blocks.max_blocks,
            "blocks_used": used,
            "blocks_cached": self.blocks.num_cached,
            "blocks_free": len(self.blocks.free),
            "block_size": bs,
            "waste": 1 - stored / (len(fill) * bs) if fill else 0.0,
            "prefix_hit_tokens": self.scheduler.prefix_hit_tokens,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
            "tokens_dropped": self.tokens_dropped,
            "tokens_repositioned": self.tokens_repositioned,
            "spec_steps": self.spec.steps if self.spec else 0,
            "spec_rows": self.spec.rows if self.spec else 0,
            "spec_drafted": self.spec.drafted if self.spec else 0,
            "spec_accepted": self.spec.accepted if self.spec else 0,
            **(self.tier.stats() if self.tier is not None else dict.fromkeys(DISK_STATS_KEYS, 0)),
        }
