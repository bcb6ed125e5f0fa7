"""Incremental Server-Sent Events parsing and per-request stream accounting.

Pure code, no I/O: bytes go in with the time they arrived, timing and token figures come out.
Used by the endpoint benchmark, testable without a server.

- `SSEParser.feed(data, t)` takes bytes in arbitrary fragments (a `data:` line split across
  reads, a multi-byte UTF-8 character split across reads, CR/LF/CRLF line ends, comments,
  `event:` / `id:` / `retry:` fields) and returns the events completed by that fragment, each
  stamped with the arrival time of the read that completed it.
- `StreamAccount` follows one streamed reply in one of three dialects (`dialect=`):
  "chat" (OpenAI chat completions: content, reasoning and tool-call deltas, tool-call
  names/arguments assembled by index, the usage chunk, `[DONE]`), "anthropic" (/v1/messages:
  message_start's usage, content_block_start/_delta text, thinking and tool_use JSON,
  message_delta's stop_reason and output usage, message_stop) and "responses" (OpenAI
  Responses: response.output_text / reasoning / function_call_arguments deltas, the usage of
  response.completed or .incomplete, response.failed). Errors sent mid-stream and a connection
  that closes early count in every dialect. Its timing counts only events that carry output:
  role-only chunks, block starts without text, finish / usage / stop events and `[DONE]` do
  not move TTFT or the generation time. `usage_summary()` gives prompt, cached and output
  tokens in one shape whatever the dialect.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass, field
from typing import Any, Iterable


@dataclass
class SSEEvent:
    data: str
    event: str | None = None
    id: str | None = None
    t: float = 0.0  # arrival time of the read that completed the event


class SSEParser:
    """Incremental SSE parser (WHATWG event-stream rules).

    Lines end in LF, CRLF or CR. A blank line dispatches the pending event; several `data:`
    lines in one event are joined with newlines; lines starting with ':' are comments.
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []
        self._event: str | None = None
        self._id: str | None = None
        self._t_line = 0.0
        self._first = True
        self._skip_lf = False
        self.comments = 0
        self.bytes = 0

    def feed(self, chunk: bytes, t: float) -> list[SSEEvent]:
        self.bytes += len(chunk)
        text = self._decoder.decode(chunk)
        if self._first and text:
            self._first = False
            text = text.removeprefix("\ufeff")
        self._buf += text
        return self._drain(t)

    def close(self, t: float) -> list[SSEEvent]:
        """End of stream: flush the decoder; a final event lacking only its blank line is kept."""
        self._buf += self._decoder.decode(b"", final=True)
        out = self._drain(t)
        if self._buf:  # an unterminated last line: take it as a complete line
            self._line(self._buf.rstrip("\r"), t)
            self._buf = ""
        if self._data:
            out.append(self._dispatch())
        return out

    @property
    def pending(self) -> bool:
        """True if a partial line or an undispatched event is buffered."""
        return bool(self._buf or self._data)

    def _drain(self, t: float) -> list[SSEEvent]:
        out: list[SSEEvent] = []
        buf = self._buf
        if self._skip_lf and buf:  # the previous read ended in CR: an LF now completes a CRLF
            self._skip_lf = False
            if buf[0] == "\n":
                buf = buf[1:]
        start = 0
        n = len(buf)
        while start < n:
            i_lf = buf.find("\n", start)
            i_cr = buf.find("\r", start)
            if i_lf < 0 and i_cr < 0:
                break
            if i_cr >= 0 and (i_lf < 0 or i_cr < i_lf):
                # a CR ends the line now (honest timestamp); an LF after it may come next read
                end = i_cr
                if i_cr + 1 == n:
                    nxt, self._skip_lf = n, True
                else:
                    nxt = i_cr + (2 if buf[i_cr + 1] == "\n" else 1)
            else:
                end, nxt = i_lf, i_lf + 1
            line = buf[start:end]
            start = nxt
            if line == "":
                if self._data:
                    out.append(self._dispatch())
                else:
                    self._event = None
                continue
            self._line(line, t)
        self._buf = buf[start:]
        return out

    def _line(self, line: str, t: float) -> None:
        if line.startswith(":"):
            self.comments += 1
            return
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._t_line = t
        elif name == "event":
            self._event = value
        elif name == "id":
            self._id = value
        # `retry` and unknown fields are ignored

    def _dispatch(self) -> SSEEvent:
        ev = SSEEvent(data="\n".join(self._data), event=self._event, id=self._id, t=self._t_line)
        self._data, self._event = [], None
        return ev


@dataclass
class ToolCall:
    index: int
    id: str | None = None
    type: str | None = None
    name: str = ""
    arguments: str = ""


@dataclass
class StreamAccount:
    """Everything measured about one streamed chat completion.

    Feed it SSE events (`feed_event`) or raw bytes (`feed_bytes`); call `close(t)` when the
    connection ends. Times are whatever clock the caller uses (perf_counter in the bench).
    """

    t_start: float = 0.0
    content: str = ""
    reasoning: str = ""
    tool_calls: dict[int, ToolCall] = field(default_factory=dict)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    done: bool = False  # saw data: [DONE]
    closed: bool = False
    t_end: float | None = None  # connection end (or [DONE])
    output_times: list[float] = field(default_factory=list)  # one per output-bearing event
    events: int = 0
    error: str | None = None  # error kind: stream_error, truncated, bad_json ...
    error_message: str | None = None
    dialect: str = "chat"  # chat | anthropic | responses
    parser: SSEParser = field(default_factory=SSEParser, repr=False)

    # --- input ------------------------------------------------------------------------------
    def feed_bytes(self, chunk: bytes, t: float) -> None:
        for ev in self.parser.feed(chunk, t):
            self.feed_event(ev)

    def feed_event(self, ev: SSEEvent) -> None:
        if self.done or self.closed:
            return
        self.events += 1
        data = ev.data.strip()
        if data == "[DONE]":
            self.done = True
            self.t_end = ev.t
            return
        if not data:
            return
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            if ev.event == "error":
                self._fail("stream_error", data)
            else:
                self._fail("bad_json", f"undecodable event data: {data[:200]!r}")
            return
        if not isinstance(obj, dict):
            self._fail("bad_json", f"event data is not an object: {data[:200]!r}")
            return
        if self.dialect != "chat":
            if (self._anthropic if self.dialect == "anthropic" else self._responses)(obj, ev):
                self.output_times.append(ev.t)
            return
        if ev.event == "error" or "error" in obj:
            err = obj.get("error", obj)
            msg = err.get("message") if isinstance(err, dict) else err
            self._fail("stream_error", str(msg))
            return
        if obj.get("usage"):
            self.usage = obj["usage"]
        carried = False
        for choice in obj.get("choices") or []:
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
            delta = choice.get("delta") or {}
            if delta.get("content"):
                self.content += delta["content"]
                carried = True
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                self.reasoning += reasoning
                carried = True
            for tc in delta.get("tool_calls") or []:
                self._tool_delta(tc)
                carried = True
        if carried:
            self.output_times.append(ev.t)

    def _error_event(self, obj: dict, ev: SSEEvent) -> bool:
        kind = obj.get("type") or ev.event
        if kind == "error" or ev.event == "error" or (kind is None and obj.get("error")):
            err = obj.get("error", obj)
            msg = err.get("message") if isinstance(err, dict) else err
            self._fail("stream_error", str(msg))
            return True
        return False

    def _anthropic(self, obj: dict, ev: SSEEvent) -> bool:
        """One /v1/messages event; True if it carried output."""
        if self._error_event(obj, ev):
            return False
        kind = obj.get("type") or ev.event
        if kind == "message_start":
            usage = (obj.get("message") or {}).get("usage")
            if isinstance(usage, dict):
                self.usage = dict(usage)
        elif kind == "content_block_start":
            block = obj.get("content_block") or {}
            if block.get("type") == "tool_use":
                i = obj.get("index", len(self.tool_calls))
                self.tool_calls[i] = ToolCall(index=i, id=block.get("id"), type="tool_use",
                                              name=block.get("name") or "")
                return bool(block.get("name"))
            text = block.get("text") or block.get("thinking")
            if text:
                if block.get("type") == "thinking":
                    self.reasoning += text
                else:
                    self.content += text
                return True
        elif kind == "content_block_delta":
            d = obj.get("delta") or {}
            if d.get("type") == "text_delta" and d.get("text"):
                self.content += d["text"]
                return True
            if d.get("type") == "thinking_delta" and d.get("thinking"):
                self.reasoning += d["thinking"]
                return True
            if d.get("type") == "input_json_delta" and d.get("partial_json"):
                i = obj.get("index", 0)
                self.tool_calls.setdefault(i, ToolCall(index=i)).arguments += d["partial_json"]
                return True
        elif kind == "message_delta":
            reason = (obj.get("delta") or {}).get("stop_reason")
            if reason:
                self.finish_reason = reason
            if isinstance(obj.get("usage"), dict):
                self.usage = {**(self.usage or {}), **obj["usage"]}
        elif kind == "message_stop":
            self.done, self.t_end = True, ev.t
        return False

    def _responses(self, obj: dict, ev: SSEEvent) -> bool:
        """One Responses API event; True if it carried output."""
        if self._error_event(obj, ev):
            return False
        kind = str(obj.get("type") or ev.event or "")
        if kind in ("response.output_text.delta", "response.refusal.delta") and obj.get("delta"):
            self.content += obj["delta"]
            return True
        if kind in ("response.reasoning_text.delta", "response.reasoning_summary_text.delta") and obj.get("delta"):
            self.reasoning += obj["delta"]
            return True
        if kind == "response.output_item.added":
            item = obj.get("item") or {}
            if item.get("type") == "function_call":
                i = obj.get("output_index", len(self.tool_calls))
                self.tool_calls[i] = ToolCall(index=i, id=item.get("call_id") or item.get("id"),
                                              type="function_call", name=item.get("name") or "")
                return bool(item.get("name"))
            return False
        if kind == "response.function_call_arguments.delta" and obj.get("delta"):
            i = obj.get("output_index", 0)
            self.tool_calls.setdefault(i, ToolCall(index=i)).arguments += obj["delta"]
            return True
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            resp = obj.get("response") or {}
            if isinstance(resp.get("usage"), dict):
                self.usage = resp["usage"]
            if kind == "response.failed":
                err = resp.get("error") or {}
                self._fail("stream_error", str(err.get("message") if isinstance(err, dict) else err))
            else:
                details = resp.get("incomplete_details") or {}
                self.finish_reason = details.get("reason") or resp.get("status") or "completed"
            self.done, self.t_end = True, ev.t
        return False

    def usage_summary(self) -> dict[str, int | None]:
        """prompt / cached / output tokens as the server reported them, one shape for every dialect.

        chat: usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, completion_tokens.
        anthropic: input_tokens counts only uncached input, so prompt = input_tokens +
        cache_read_input_tokens + cache_creation_input_tokens; cached = cache_read_input_tokens.
        responses: usage.input_tokens, usage.input_tokens_details.cached_tokens, output_tokens.
        """
        u = self.usage or {}

        def num(d: Any, key: str) -> int | None:
            v = d.get(key) if isinstance(d, dict) else None
            return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

        if self.dialect == "anthropic":
            parts = [num(u, k) for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")]
            prompt = None if parts[0] is None else sum(p or 0 for p in parts)
            return {"prompt_tokens": prompt, "cached_tokens": parts[1], "output_tokens": num(u, "output_tokens")}
        if self.dialect == "responses":
            return {"prompt_tokens": num(u, "input_tokens"),
                    "cached_tokens": num(u.get("input_tokens_details"), "cached_tokens"),
                    "output_tokens": num(u, "output_tokens")}
        return {"prompt_tokens": num(u, "prompt_tokens"),
                "cached_tokens": num(u.get("prompt_tokens_details"), "cached_tokens"),
                "output_tokens": num(u, "completion_tokens")}

    def _tool_delta(self, tc: dict) -> None:
        index = tc.get("index")
        if index is None:  # some servers omit the index for a single call
            index = len(self.tool_calls) - 1 if self.tool_calls and not tc.get("id") else len(self.tool_calls)
        call = self.tool_calls.setdefault(index, ToolCall(index=index))
        if tc.get("id"):
            call.id = tc["id"]
        if tc.get("type"):
            call.type = tc["type"]
        fn = tc.get("function") or {}
        if fn.get("name"):
            call.name += fn["name"]
        if fn.get("arguments"):
            args = fn["arguments"]
            call.arguments += args if isinstance(args, str) else json.dumps(args)

    def _fail(self, kind: str, message: str) -> None:
        if self.error is None:
            self.error, self.error_message = kind, message

    def close(self, t: float) -> None:
        """The connection ended (normally or not). A stream with neither [DONE] nor a finish
        reason was cut short and counts as an error."""
        if self.closed:
            return
        for ev in self.parser.close(t):
            self.feed_event(ev)
        self.closed = True
        if self.t_end is None:
            self.t_end = t
        if self.error is None and not self.done and self.finish_reason is None:
            end = {"chat": "a finish_reason or [DONE]", "anthropic": "message_stop or a stop_reason",
                   "responses": "response.completed"}.get(self.dialect, "its end")
            self._fail("truncated", f"stream ended before {end}")

    # --- results ----------------------------------------------------------------------------
    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_text(self) -> str:
        """All generated text: reasoning, content, tool-call names and arguments."""
        calls = "".join(c.name + c.arguments for c in self.tool_calls.values())
        return self.reasoning + self.content + calls

    @property
    def ttft(self) -> float | None:
        return self.output_times[0] - self.t_start if self.output_times else None

    @property
    def gen_time(self) -> float | None:
        """First to last output-bearing event: later chunks (finish, usage, [DONE]) excluded."""
        return self.output_times[-1] - self.output_times[0] if self.output_times else None

    @property
    def itls(self) -> list[float]:
        """Gaps between output-bearing events (an event may carry several tokens)."""
        ts = self.output_times
        return [b - a for a, b in zip(ts, ts[1:])]

    @property
    def e2e(self) -> float | None:
        return None if self.t_end is None else self.t_end - self.t_start

    def usage_tokens(self, key: str) -> int | None:
        if not self.usage:
            return None
        v = self.usage.get(key)
        return int(v) if isinstance(v, (int, float)) else None

    def tpot(self, completion_tokens: int | None) -> float | None:
        """Time per output token after the first: gen_time / (completion_tokens - 1)."""
        if not completion_tokens or completion_tokens < 2 or self.gen_time is None:
            return None
        return self.gen_time / (completion_tokens - 1)


def account_stream(chunks: Iterable[tuple[float, bytes]], t_start: float = 0.0,
                   t_close: float | None = None, dialect: str = "chat") -> StreamAccount:
    """Run (arrival time, bytes) pairs through a StreamAccount; close at t_close (or the last time)."""
    acc = StreamAccount(t_start=t_start, dialect=dialect)
    t = t_start
    for t, chunk in chunks:
        acc.feed_bytes(chunk, t)
    acc.close(t if t_close is None else t_close)
    return acc
