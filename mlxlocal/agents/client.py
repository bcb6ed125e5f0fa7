"""McpHub: every configured MCP server behind one synchronous, thread-safe object.

The official SDK is async (anyio); the REPL, the CLI and the tool loop are synchronous. So
the hub runs one asyncio loop on a background thread and every public method hands a
coroutine to it and waits with a bound. Each server lives in one long-running task that owns
its transport and ClientSession (anyio cancel scopes and task groups must be entered and
left by the same task); calls run as separate tasks over that session.

Failure is per server: one that cannot start, does not initialize in time, or dies mid-call
is recorded in `hub.failed` with the reason, its tools stop being offered, and every call to
it returns an error ToolResult. Calls never raise for tool-side trouble: the model gets a
tool message saying what happened (invalid arguments, timeout, crash, cancel, truncation).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import math
import tempfile
import threading
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import IO, Any

import anyio
import httpx2
import jsonschema
import mcp.types as mt
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from mlxlocal import __version__
from mlxlocal.agents.types import ServerConfig, ToolInfo, ToolResult

DEFAULT_MAX_RESULT_CHARS = 20_000
DEFAULT_CONNECT_TIMEOUT = 30.0
DEFAULT_CALL_TIMEOUT = 60.0
CLOSE_TIMEOUT = 10.0  # the SDK's stdio shutdown is bounded at ~6 s (stdin close, SIGTERM, SIGKILL)
_MAX_TOOL_PAGES = 100  # a paginating server that never stops must not hang start()
_STDERR_TAIL = 600  # characters of a failed stdio server's stderr quoted in its reason

# The SDK logs transport failures with tracebacks (logger.exception). With no handler
# anywhere, Python's last-resort handler would print them into the chat although the hub
# reports every failure itself (hub.failed, error results). A NullHandler stops only that
# fallback: records still propagate to whatever logging the application configures.
logging.getLogger("mcp").addHandler(logging.NullHandler())


class _CallControl:
    """One in-flight call's cancel scope and why it was cancelled (set on the loop thread)."""

    def __init__(self) -> None:
        self.scope: anyio.CancelScope | None = None
        self.why: str | None = None  # "user", "closed" or "dead: <reason>"

    def cancel(self, why: str) -> None:
        if self.why is None:
            self.why = why
        if self.scope is not None:
            self.scope.cancel()


@dataclass
class _Server:
    config: ServerConfig
    session: ClientSession | None = None
    tools: dict[str, ToolInfo] = field(default_factory=dict)  # after allow/deny
    validators: dict[str, Any] = field(default_factory=dict)  # tool name -> jsonschema validator
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    errlog: IO[str] | None = None  # a stdio server's stderr, quoted when it fails
    calls: set[_CallControl] = field(default_factory=set)
    dead: bool = False


class McpHub:
    """Connections to MCP servers, used synchronously from any thread.

    >>> with McpHub.start(servers) as hub:
    ...     hub.tools                   # [ToolInfo] of the live servers, after allow/deny
    ...     hub.call("files.read_file", {"path": "notes.txt"}, timeout=30)   # -> ToolResult
    """

    def __init__(self, max_result_chars: int = DEFAULT_MAX_RESULT_CHARS):
        self.max_result_chars = max_result_chars
        self.tools_version = 0  # bumped whenever the offered tools change (list_changed, a death)
        self._servers: dict[str, _Server] = {}
        self._failed: dict[str, str] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="mcp-hub", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------- lifecycle

    @classmethod
    def start(cls, servers: list[ServerConfig], connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
              max_result_chars: int = DEFAULT_MAX_RESULT_CHARS) -> McpHub:
        """Connect to every server at once; returns when each is ready or has failed
        (`hub.failed`). Never raises for a server's failure."""
        hub = cls(max_result_chars)
        try:
            hub._run(hub._connect_all(list(servers), connect_timeout), connect_timeout + CLOSE_TIMEOUT)
        except BaseException:
            hub.close()
            raise
        return hub

    def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
        """Shut every connection down (stdio children that ignore it are killed); bounded."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._run(self._close_all(timeout), timeout + 2)
        except (concurrent.futures.TimeoutError, RuntimeError):
            pass  # a wedged loop: the daemon thread is abandoned below rather than joined forever
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=2)
        if not self._thread.is_alive():
            self._loop.close()
        for server in self._servers.values():
            if server.errlog is not None:
                server.errlog.close()

    def __enter__(self) -> McpHub:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- queries

    @property
    def failed(self) -> dict[str, str]:
        """Servers that could not start or died: name -> reason (a copy)."""
        with self._lock:
            return dict(self._failed)

    @property
    def servers(self) -> list[ServerConfig]:
        """Every configured server, live or failed (the policy reads trust/sensitive here)."""
        with self._lock:
            return [s.config for s in self._servers.values()]

    def server(self, name: str) -> ServerConfig:
        with self._lock:
            if name not in self._servers:
                raise KeyError(f"no MCP server named {name!r}")
            return self._servers[name].config

    @property
    def tools(self) -> list[ToolInfo]:
        """The tools of the live servers, in config order, after allow/deny."""
        with self._lock:
            return [t for s in self._servers.values() if not s.dead for t in s.tools.values()]

    def tool(self, tool_id: str) -> ToolInfo:
        """The offered tool "server.name"; KeyError (naming what exists) if there is none."""
        server_name, _, name = tool_id.partition(".")
        with self._lock:
            server = self._servers.get(server_name)
            if server is not None and not server.dead and name in server.tools:
                return server.tools[name]
            if server_name in self._failed:
                raise KeyError(f"{tool_id}: server {server_name!r} is unavailable ({self._failed[server_name]})")
            offered = ", ".join(t.id for s in self._servers.values() if not s.dead for t in s.tools.values())
        raise KeyError(f"unknown tool {tool_id!r} (offered: {offered or 'none'})")

    # ----------------------------------------------------------------- calls

    def call(self, tool_id: str, arguments: dict[str, Any], timeout: float = DEFAULT_CALL_TIMEOUT,
             cancel: threading.Event | None = None) -> ToolResult:
        """Call a tool; always returns a ToolResult (error=True when it did not work).

        Arguments are checked against the tool's inputSchema first (no call when invalid).
        `timeout` bounds the call (it is then cancelled on the server, the session stays
        usable); setting `cancel`, or Ctrl-C in the calling thread (which then also sets
        `cancel`), cancels it too: the result says "cancelled by the user"."""
        try:
            tool = self.tool(tool_id)
        except KeyError as exc:
            return ToolResult(str(exc.args[0]), error=True)
        if not isinstance(arguments, dict):
            return ToolResult(f"{tool_id}: arguments must be a JSON object, not {type(arguments).__name__}",
                              error=True)
        problem = self._validate(tool, arguments)
        if problem is not None:
            return ToolResult(problem, error=True)
        with self._lock:
            if self._closed:
                return ToolResult(f"{tool_id}: the MCP connections are closed", error=True)
            server = self._servers[tool.server]
        control = _CallControl()
        future = asyncio.run_coroutine_threadsafe(self._call(server, tool, arguments, timeout, control), self._loop)
        # The loop enforces `timeout`; this outer bound only guards against a wedged loop.
        hard_deadline = time.monotonic() + timeout + CLOSE_TIMEOUT
        try:
            while time.monotonic() < hard_deadline:
                try:
                    return future.result(timeout=0.05)  # short waits: Ctrl-C and `cancel` get seen
                except concurrent.futures.TimeoutError:
                    if (cancel is not None and cancel.is_set()) or not self._thread.is_alive():
                        break
        except KeyboardInterrupt:
            # Ctrl-C cancels the call, not the program; the caller's event is set too so a
            # tool loop can tell the user wants to stop (the result alone reads like any error).
            if cancel is not None:
                cancel.set()
        try:
            self._loop.call_soon_threadsafe(control.cancel, "user")
            return future.result(timeout=5)
        except (RuntimeError, concurrent.futures.TimeoutError, concurrent.futures.CancelledError,
                KeyboardInterrupt):  # RuntimeError: the hub was closed under the call
            future.cancel()
            return ToolResult(f"{tool_id}: cancelled by the user", error=True)

    def _validate(self, tool: ToolInfo, arguments: dict[str, Any]) -> str | None:
        with self._lock:
            validator = self._servers[tool.server].validators.get(tool.name)
        if validator is None:
            return None
        errors = sorted(validator.iter_errors(arguments), key=lambda e: list(map(str, e.absolute_path)))
        if not errors:
            return None
        lines = []
        for error in errors[:5]:
            where = "/".join(map(str, error.absolute_path))
            lines.append(f"{where}: {error.message}" if where else error.message)
        more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
        return f"invalid arguments for {tool.id}: " + "; ".join(lines) + more + "; the tool was not called"

    async def _call(self, server: _Server, tool: ToolInfo, arguments: dict[str, Any], timeout: float,
                    control: _CallControl) -> ToolResult:
        session = server.session
        if session is None or server.dead:
            return ToolResult(f"{tool.id}: server {server.config.name!r} is unavailable "
                              f"({self.failed.get(server.config.name, 'not connected')})", error=True)
        control.scope = anyio.CancelScope(deadline=anyio.current_time() + timeout)
        if control.why is not None:  # cancelled before this coroutine got to run
            control.scope.cancel()
        server.calls.add(control)
        try:
            with control.scope:
                result = await session.call_tool(tool.name, arguments)
        except MCPError as exc:
            if exc.code == mt.CONNECTION_CLOSED:
                reason = f"the connection closed during a call to {tool.name} (the server crashed or exited)"
                self._mark_dead(server, reason)
                return ToolResult(f"{tool.id}: server {server.config.name!r} died: {reason}{self._stderr(server)}; "
                                  f"its tools are no longer available", error=True)
            return ToolResult(f"{tool.id}: the server answered with an error: {exc.message}", error=True)
        except Exception as exc:  # a malformed result, an output-schema mismatch, transport trouble
            return ToolResult(f"{tool.id}: the call failed: {_describe(exc)}", error=True)
        finally:
            server.calls.discard(control)
        if control.scope.cancelled_caught:
            if control.why == "user":
                return ToolResult(f"{tool.id}: cancelled by the user", error=True)
            if control.why == "closed":
                return ToolResult(f"{tool.id}: the MCP connections were closed during the call", error=True)
            if control.why is not None and control.why.startswith("dead: "):
                return ToolResult(f"{tool.id}: server {server.config.name!r} died during the call: "
                                  f"{control.why[6:]}; its tools are no longer available", error=True)
            return ToolResult(f"{tool.id}: no answer within {timeout:g} s; the call was cancelled", error=True)
        return self._result(result)

    def _result(self, result: mt.CallToolResult) -> ToolResult:
        parts = [_describe_block(block) for block in result.content]
        has_text = any(isinstance(b, mt.TextContent) for b in result.content)
        if not has_text and result.structured_content is not None:
            parts.append(json.dumps(result.structured_content, ensure_ascii=False))
        text = "\n".join(parts) if parts else "(no output)"
        truncated = len(text) > self.max_result_chars
        if truncated:
            text = (text[:self.max_result_chars] + f"\n[... truncated: {len(text):,} characters, "
                    f"showing the first {self.max_result_chars:,}]")
        return ToolResult(text, error=bool(result.is_error), truncated=truncated)

    # ----------------------------------------------------------------- the loop side

    def _run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=timeout)

    async def _connect_all(self, configs: list[ServerConfig], timeout: float) -> None:
        waits = []
        for config in configs:
            if config.name in self._servers:
                self._fail(config.name, f"a server named {config.name!r} is already connected")
                continue
            server = _Server(config)
            with self._lock:
                self._servers[config.name] = server
            ready = self._loop.create_future()
            server.task = self._loop.create_task(self._serve(server, ready, timeout))
            waits.append(ready)
        await asyncio.gather(*waits)

    async def _serve(self, server: _Server, ready: asyncio.Future, timeout: float) -> None:
        """The server's whole life in one task: connect, initialize, list tools, then wait
        for close; any exit after `ready` means the server is gone."""
        scope = anyio.CancelScope(deadline=anyio.current_time() + timeout)
        reason = None
        try:
            with scope:
                async with AsyncExitStack() as stack:
                    read, write = await stack.enter_async_context(self._transport(server, stack))
                    session = await stack.enter_async_context(ClientSession(
                        read, write, message_handler=partial(self._on_message, server),
                        client_info=mt.Implementation(name="mlxlocal", version=__version__)))
                    await session.initialize()
                    await self._list_tools(server, session)
                    server.session = session
                    scope.deadline = math.inf  # connected: no deadline on the rest of its life
                    ready.set_result(None)
                    await server.stop.wait()
            if scope.cancelled_caught and not ready.done():
                reason = f"no answer within {timeout:g} s while connecting"
        except Exception as exc:  # noqa: BLE001 - any failure of one server must not touch the others
            reason = _describe(exc)
        finally:
            server.session = None
        if not ready.done():
            self._fail(server.config.name, f"could not start: {reason or 'connection closed'}{self._stderr(server)}")
            ready.set_result(None)
        elif not self._closed and (not server.stop.is_set() or reason is not None):
            # The connection ended on its own (HTTP server gone, transport failure).
            self._mark_dead(server, f"the connection ended: {reason or 'closed by the server'}{self._stderr(server)}")

    def _transport(self, server: _Server, stack: AsyncExitStack):
        config = server.config
        if config.command is not None:
            # stderr to a file of ours: a server's log lines would otherwise land in the chat,
            # and its last lines are the best explanation when it fails to start.
            # Append mode: the child shares this file's offset, and our reads seek it.
            server.errlog = tempfile.TemporaryFile("a+", encoding="utf-8", errors="replace")
            params = StdioServerParameters(command=config.command, args=list(config.args), env=config.env,
                                           cwd=config.cwd)
            return stdio_client(params, errlog=server.errlog)
        # The SDK's documented way to send headers: our own client (its default timeouts:
        # 30 s to connect/write, 300 s read for long SSE streams; calls have their own bound).
        if config.url is None:  # config.py gives every server a command or a url
            raise ValueError(f"server {config.name!r} has neither a command nor a url")
        http = httpx2.AsyncClient(headers=config.headers or {}, timeout=httpx2.Timeout(30.0, read=300.0))
        stack.push_async_exit(http)
        return streamable_http_client(config.url, http_client=http)

    async def _list_tools(self, server: _Server, session: ClientSession) -> None:
        listed: list[mt.Tool] = []
        cursor = None
        for _ in range(_MAX_TOOL_PAGES):
            page = await session.list_tools(params=mt.PaginatedRequestParams(cursor=cursor) if cursor else None)
            listed.extend(page.tools)
            cursor = page.next_cursor
            if not cursor:
                break
        config = server.config
        tools, validators = {}, {}
        for tool in listed:
            if (config.allow is not None and tool.name not in config.allow) or tool.name in config.deny:
                continue
            annotations = tool.annotations.model_dump(by_alias=True, exclude_none=True) if tool.annotations else {}
            tools[tool.name] = ToolInfo(server=config.name, name=tool.name, description=tool.description or "",
                                        input_schema=dict(tool.input_schema), annotations=annotations)
            try:
                cls = jsonschema.validators.validator_for(tool.input_schema)
                cls.check_schema(tool.input_schema)
                validators[tool.name] = cls(tool.input_schema)
            except jsonschema.SchemaError:
                pass  # a broken schema cannot check anything; the server still validates its input
        with self._lock:
            server.tools, server.validators = tools, validators
            self.tools_version += 1

    async def _on_message(self, server: _Server, message: Any) -> None:
        # list_changed: re-list in a task of its own; this handler runs on the receive path.
        if isinstance(message, mt.ToolListChangedNotification) and server.session is not None:
            self._loop.create_task(self._refresh(server))

    async def _refresh(self, server: _Server) -> None:
        session = server.session
        if session is None or server.dead:
            return
        try:
            with anyio.fail_after(DEFAULT_CONNECT_TIMEOUT):
                await self._list_tools(server, session)
        except Exception:  # noqa: BLE001 - keep the old list; a dead server shows on the next call
            logging.getLogger(__name__).debug("re-listing %s's tools failed", server.config.name, exc_info=True)

    def _fail(self, name: str, reason: str) -> None:
        with self._lock:
            self._failed[name] = reason

    def _mark_dead(self, server: _Server, reason: str) -> None:
        """On the loop thread: stop offering the server, fail its in-flight calls, tear down."""
        if server.dead:
            return
        with self._lock:
            server.dead = True
            self._failed.setdefault(server.config.name, reason)
            self.tools_version += 1
        for control in list(server.calls):
            control.cancel(f"dead: {reason}")
        server.stop.set()

    def _stderr(self, server: _Server) -> str:
        """The tail of a stdio server's stderr, as a suffix for a failure reason."""
        if server.errlog is None or server.errlog.closed:
            return ""
        try:
            server.errlog.flush()
            server.errlog.seek(0)
            text = server.errlog.read().strip()
        except (OSError, ValueError):
            return ""
        if not text:
            return ""
        tail = text[-_STDERR_TAIL:].splitlines()
        return f" (its stderr ends: {' | '.join(line.strip() for line in tail[-6:] if line.strip())})"

    async def _close_all(self, timeout: float) -> None:
        tasks = []
        for server in list(self._servers.values()):
            for control in list(server.calls):
                control.cancel("closed")
            server.stop.set()
            if server.task is not None and not server.task.done():
                tasks.append(server.task)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:  # past the SDK's own kill escalation: give up on a clean exit
                task.cancel()


def _describe_block(block: Any) -> str:
    """One content block as text for the model: text as is, binary described by size."""
    if isinstance(block, mt.TextContent):
        return block.text
    if isinstance(block, mt.ImageContent | mt.AudioContent):
        return f"[{block.type}: {block.mime_type}, {_b64_size(block.data):,} bytes]"
    if isinstance(block, mt.ResourceLink):
        return f"[resource link: {block.uri}" + (f" ({block.name})" if block.name else "") + "]"
    if isinstance(block, mt.EmbeddedResource):
        res = block.resource
        if isinstance(res, mt.TextResourceContents):
            return f"[resource {res.uri}]\n{res.text}"
        return f"[resource: {res.uri}, {res.mime_type or 'binary'}, {_b64_size(res.blob):,} bytes]"
    return f"[{getattr(block, 'type', type(block).__name__)} content]"


def _b64_size(data: str) -> int:
    data = data.strip()
    return max(0, len(data) * 3 // 4 - data[-2:].count("="))


def _describe(exc: BaseException) -> str:
    """An exception as one line; anyio wraps task failures in (nested) exception groups."""
    while inner := getattr(exc, "exceptions", None):  # BaseExceptionGroup (builtin from 3.11)
        exc = inner[0]
    if isinstance(exc, MCPError):
        return exc.message
    text = str(exc).strip() or type(exc).__name__
    return text if isinstance(exc, OSError) else f"{type(exc).__name__}: {text}"
