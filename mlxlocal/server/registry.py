"""The models a server serves: loaded on demand, unloaded after keep_alive of idleness.

The registry's `find` is the one place that knows which names mean which model. Listings
(/v1/models, /api/tags, /api/ps) show each model's id; responses echo the name a request used.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from mlxlocal.distributed import cluster_problem
from mlxlocal.engine import Engine, open_engine, speculation_of
from mlxlocal.errors import MlxLocalError
from mlxlocal.mlx_thread import in_own_thread
from mlxlocal.server import lanes
from mlxlocal.server.errors import APIError
from mlxlocal.server.model_cards import capabilities_of

log = logging.getLogger("mlxlocal.server")


def parse_duration(value: Any) -> float | None:
    """Ollama-style keep_alive: '5m', '30s', '1h', seconds as a number; negative = forever."""
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float("inf") if value < 0 else float(value)
    text = str(value).strip().lower()
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}
    for suffix in ("ms", "s", "m", "h"):
        if text.endswith(suffix):
            try:
                number = float(text[: -len(suffix)])
            except ValueError:
                break
            return float("inf") if number < 0 else number * units[suffix]
    try:
        number = float(text)
    except ValueError:
        raise APIError(400, f"keep_alive: cannot read a duration from {value!r} (e.g. '5m', 30, -1)",
                       param="keep_alive") from None
    return float("inf") if number < 0 else number


def assign_names(specs: list[str], names: list[str]) -> list[list[str]]:
    """The names each model is served under (the first is its id), by --served-model-name's rule.

    No names: a model's id is its --model spec. One model: every name is one of its names.
    Several models: exactly one name per model, in --model order. Raises ValueError otherwise,
    or when a name (or a spec, which stays accepted) would refer to two models.
    """
    if any(not n.strip() for n in names):
        raise ValueError("--served-model-name: a name cannot be empty")
    if not names:
        groups = [[s] for s in specs]
    elif len(specs) == 1:
        groups = [list(dict.fromkeys(names))]
    elif len(names) == len(specs):
        groups = [[n] for n in names]
    else:
        raise ValueError(f"{len(names)} --served-model-name for {len(specs)} --model: with several models, "
                         "give exactly one --served-model-name per --model, in the same order")
    owner: dict[str, int] = {}
    for i, (spec, group) in enumerate(zip(specs, groups)):
        for n in dict.fromkeys([*group, spec]):
            first = owner.setdefault(n, i)
            if first == i:
                continue
            if n == spec == specs[first]:
                raise ValueError(f"--model {spec} is given twice")
            raise ValueError(f"the name {n!r} would refer to two models (--model {specs[first]} "
                             f"and --model {spec}); give each model its own --served-model-name")
    return groups


class Sessions:
    """A model's engine sessions by client session id (the X-Session-Id header): each
    pins its conversation's KV between turns. At most `cap`, least recently used evicted
    first; one idle for `idle` seconds expires. Evicted and expired sessions are returned
    for the caller to reset (that frees their KV on the engine thread, off the event loop);
    a generating session is never evicted (the engine still owns it)."""

    def __init__(self, cap: int = 32, idle: float = 1800.0):
        self.cap, self.idle = cap, idle
        # id -> (session, its engine, last used)
        self.held: OrderedDict[str, tuple[Any, Engine, float]] = OrderedDict()

    def get(self, engine: Engine, session_id: str) -> tuple[Any, list]:
        """(the id's session, sessions evicted to make room for it)."""
        entry = self.held.pop(session_id, None)
        # A session of an engine since replaced (unloaded, restarted) holds nothing any more.
        session = entry[0] if entry is not None and entry[1] is engine else engine.new_session()
        self.held[session_id] = (session, engine, time.monotonic())
        evicted = []
        for sid, (old, _, _) in list(self.held.items()):
            if len(self.held) <= self.cap:
                break
            if sid != session_id and not old.busy:
                self.held.pop(sid, None)
                evicted.append(old)
        return session, evicted

    def make_room(self, pool_tokens: int, need: int, keep: Any = None) -> list:
        """Idle sessions to free, least recently used first, so that those left pin at most
        `pool_tokens - need`: the engine never takes pinned blocks back, so a request that
        needs them would wait for ever. `keep`: the request's own session (its blocks are
        the start of its prompt, counted in `need`)."""
        others = [(sid, s) for sid, (s, _, _) in list(self.held.items()) if s is not keep]
        # A generating session's blocks are pinned again when it finishes: counted, not freed.
        pinned = sum(s.cached_len for _, s in others)
        idle = [(sid, s) for sid, s in others if not s.busy]
        freed = []
        for sid, s in idle:
            if pinned + need <= pool_tokens:
                break
            if self.held.pop(sid, None) is not None:
                pinned -= s.cached_len
                freed.append(s)
        return freed

    def expired(self, now: float | None = None) -> list:
        now = time.monotonic() if now is None else now
        gone = [sid for sid, (s, _, used) in list(self.held.items()) if now - used >= self.idle and not s.busy]
        return [entry[0] for sid in gone if (entry := self.held.pop(sid, None)) is not None]

    def clear(self) -> None:
        """Forget every session: the engine that held them is gone (its KV with it)."""
        self.held.clear()


@dataclass
class ServedModel:
    name: str  # the id listings show
    spec: str  # what --model said: loaded from this
    aliases: list[str]  # other names it answers to: further served names, then the spec
    found_names: set[str] = field(default_factory=set)  # its own name and directory, once loaded
    engine: Engine | None = None
    keep_alive: float = float("inf")
    expires_at: float = float("inf")
    loaded_at: float = 0.0
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    info: Any = None  # ModelInfo of the last load, kept for /api/show after unload
    capabilities: list[str] | None = None  # model_cards.capabilities_of, from the last load
    sessions: Sessions = field(default_factory=Sessions)

    @property
    def names(self) -> list[str]:
        """Every name it answers to, its id first."""
        return list(dict.fromkeys([self.name, *self.aliases, *sorted(self.found_names)]))

    @property
    def dead_reason(self) -> str | None:
        """Why its loaded engine stopped (it is restarted on the next request), or None."""
        return self.engine.dead_reason if self.engine is not None else None


@dataclass
class ServedEmbedder:
    """An embedding model (mlxlocal/embeddings.py): served by /v1/embeddings, /api/embed and the
    MCP `embed` tool, never by the chat routes. Small, so it stays loaded (no keep_alive)."""

    name: str
    spec: str
    found_names: set[str] = field(default_factory=set)
    engine: Any = None  # EmbeddingEngine once loaded
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys([self.name, *sorted(self.found_names)]))


class ModelRegistry:
    def __init__(self, specs: list[str], engine_options: dict, keep_alive: float,
                 names: list[str] | None = None, embed_specs: list[str] | None = None,
                 max_sessions: int = 32, session_idle: float = 1800.0):
        self.engine_options = engine_options
        self.embedders = [ServedEmbedder(spec, spec) for spec in dict.fromkeys(embed_specs or [])]
        clash = {e.name for e in self.embedders} & {n for spec, g in zip(specs, assign_names(specs, names or []))
                                                    for n in [*g, spec]}
        if clash:
            raise ValueError(f"{sorted(clash)[0]!r} is given both as a chat model and an embedding model")
        self.default_keep_alive = keep_alive
        self.models: list[ServedModel] = [
            ServedModel(group[0], spec, [n for n in dict.fromkeys([*group[1:], spec]) if n != group[0]],
                        keep_alive=keep_alive, sessions=Sessions(max_sessions, session_idle))
            for spec, group in zip(specs, assign_names(specs, names or []))
        ]
        # begin_shutdown (SIGTERM): requests in flight end now (generation.stream), new ones get 503.
        self.stopping = False
        self.on_stop: list[Callable[[], Awaitable[None]]] = []  # the MCP endpoint closes its sessions

    async def begin_shutdown(self) -> None:
        """The server stops: before it waits for its connections, so that streams end at once
        with a final event rather than being cut when the wait runs out."""
        self.stopping = True
        for hook in self.on_stop:
            await hook()

    def find(self, name: str | None) -> ServedModel:
        if not name:
            raise APIError(400, "'model' is required", param="model")
        for m in self.models:
            if name == m.name or name in m.aliases:
                return m
        # Names found on loading come second: a directory's name must not shadow another
        # model's --served-model-name.
        for m in self.models:
            if name in m.found_names:
                return m
        if self._find_embedder(name) is not None:
            raise APIError(400, f"model '{name}' is an embedding model: it serves /v1/embeddings and "
                           "/api/embed, not text generation", param="model", code="model_not_supported")
        served = ", ".join(m.name for m in self.models)
        raise APIError(404, f"model '{name}' is not served here (served: {served})", param="model",
                       code="model_not_found")

    async def engine(self, name: str | None, keep_alive: float | None = None):
        """The model's engine, loading it first if needed; refreshes its idle timer."""
        m = self.find(name)
        async with m.lock:
            if m.dead_reason is not None:
                # A stopped engine serves nothing: drop it, like a keep_alive unload, and load afresh.
                log.warning("engine for %s had stopped (%s); restarting it", m.name, m.dead_reason)
                engine, m.engine = m.engine, None
                assert engine is not None  # only a loaded engine stops
                m.sessions.clear()
                await asyncio.to_thread(engine.shutdown)
            if m.engine is None:
                try:
                    m.engine = loaded = await asyncio.to_thread(self._load, m.spec)
                except MlxLocalError as e:
                    raise APIError(500, f"cannot load model '{m.name}': {e}") from None
                m.info, m.loaded_at = loaded.info, time.time()
                m.capabilities = capabilities_of(loaded.chat_format)
                m.found_names |= {m.info.name, m.info.path.name}
            if keep_alive is not None:
                m.keep_alive = keep_alive
            m.expires_at = time.monotonic() + m.keep_alive
            return m.engine

    # --- embedding models ----------------------------------------------------------------
    def _find_embedder(self, name: str) -> ServedEmbedder | None:
        for e in self.embedders:
            if name in e.names:
                return e
        return None

    def find_embedder(self, name: str | None) -> ServedEmbedder:
        if not name:
            raise APIError(400, "'model' is required", param="model")
        found = self._find_embedder(name)
        if found is not None:
            return found
        served = ", ".join(e.name for e in self.embedders) or "none; start the server with --embed-model"
        if any(name == m.name or name in m.aliases or name in m.found_names for m in self.models):
            raise APIError(400, f"model '{name}' is a text-generation model and cannot compute embeddings "
                           f"(embedding models served: {served})", param="model", code="model_not_supported")
        raise APIError(404, f"embedding model '{name}' is not served here (embedding models served: {served})",
                       param="model", code="model_not_found")

    async def embedder(self, name: str | None):
        """The embedding model's EmbeddingEngine, loading it first if needed."""
        e = self.find_embedder(name)
        async with e.lock:
            if e.engine is None:
                from mlxlocal.embeddings import open_embedder

                try:
                    e.engine = await asyncio.to_thread(in_own_thread, open_embedder, e.spec)
                except MlxLocalError as err:
                    raise APIError(500, f"cannot load embedding model '{e.name}': {err}") from None
                e.engine.yield_to = lanes.chat_busy  # embeddings give way to chat between batches
                e.found_names |= {e.engine.info.name, e.engine.info.path.name}
            return e.engine

    def _load(self, spec: str):
        from mlxlocal.source.loader import load

        # On a thread of its own that clears its MLX streams: a pooled one would keep them
        # to interpreter exit, where MLX may abort the process.
        return in_own_thread(lambda: open_engine(load(spec), **self.engine_options))

    def make_room(self, engine: Engine, need: int, keep: Any = None) -> list:
        """Idle sessions on `engine` to free (reset them) before a request that needs `need`
        tokens of its KV pool (see Sessions.make_room); none on a dense engine. Every route's
        requests call it, sessions or not: pinned sessions must not starve any of them."""
        m = next((m for m in self.models if m.engine is engine), None)
        pool = engine.kv_pool if m is not None else {}
        if m is None or pool.get("kind") != "paged" or not m.sessions.held:
            return []
        return m.sessions.make_room(pool["blocks"] * pool["block_size"], need, keep)

    def session(self, name: str, session_id: str) -> tuple[Any, list]:
        """The loaded model's engine session for a client's session id (created on first
        use), and the sessions evicted for it (reset them: prompt.reset_quietly)."""
        m = self.find(name)
        if m.engine is None:
            raise APIError(503, f"model '{m.name}' was unloaded; retry", headers={"Retry-After": "1"})
        return m.sessions.get(m.engine, session_id)

    def expired_sessions(self) -> list:
        """Sessions idle past --session-idle, taken out of their models (reset them)."""
        return [s for m in self.models if m.engine is not None for s in m.sessions.expired()]

    def touch(self, name: str) -> None:
        m = self.find(name)
        m.expires_at = time.monotonic() + m.keep_alive

    def unload_idle(self) -> list[str]:
        """Drop engines idle past their keep_alive (nothing running); return their names."""
        dropped = []
        now = time.monotonic()
        for m in self.models:
            if m.engine is None or now < m.expires_at:
                continue
            # A stopped engine answers stats at once; it stays until a request restarts it.
            stats = m.engine.stats()
            if stats["running"] or stats["waiting"]:
                continue
            m.engine.shutdown()
            m.engine = None
            m.sessions.clear()
            dropped.append(m.name)
        return dropped

    def loaded(self) -> list[ServedModel]:
        return [m for m in self.models if m.engine is not None]

    def health(self) -> tuple[int, dict]:
        """/health: 200 while every loaded engine runs; 503 naming the models whose engine stopped."""
        body: dict[str, Any] = {"status": "ok", "models": [m.name for m in self.models],
                                "loaded": [m.name for m in self.loaded()]}
        spec = speculation_of(self.engine_options)  # --draft-model / --prompt-lookup: every model's engine
        body["speculative"] = spec.as_dict() if spec is not None else None
        dead = [m for m in self.loaded() if m.dead_reason is not None]
        cluster = cluster_problem()  # a multi-rank run that lost a rank: nothing restarts it
        if not dead and cluster is None:
            return 200, body
        reasons = [f"model '{m.name}': engine stopped: {m.dead_reason} (restarted on its next request)"
                   for m in dead if cluster is None]
        return 503, {**body, "status": "error", "reason": "; ".join(reasons + ([cluster] if cluster else []))}

    def shutdown(self, timeout: float = 5.0) -> None:
        for e in self.embedders:
            if e.engine is not None:
                e.engine.shutdown(timeout)
            e.engine = None
        for m in self.models:
            if m.engine is not None:
                m.engine.shutdown(timeout)
            m.engine = None
            m.sessions.clear()
