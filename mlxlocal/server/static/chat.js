// The page's side of the API: requests with the key, the chat stream parsed into events, the
// server's MCP tools. Nothing here touches the page.

const KEY = "mlxlocal.key";

export class NeedsKey extends Error {}

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

function headers(extra = {}) {
  const h = { ...extra };
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

async function failure(r) {
  let message = `${r.status} ${r.statusText}`;
  try {
    const body = await r.json();
    message = body?.error?.message || body?.error || body?.detail || message;
  } catch { /* not JSON */ }
  if (r.status === 401) return new NeedsKey(String(message));
  return new ApiError(r.status, String(message));
}

export async function listModels() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (!r.ok) throw await failure(r);
  return (await r.json()).data.map((m) => m.id);
}

// Server-sent events of a response body: yields {event, data} or {comment} per block.
async function* sse(body, signal) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buffer.search(/\r?\n\r?\n/)) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut).replace(/^\r?\n\r?\n/, "");
        const data = [];
        let event = "message";
        for (const line of block.split(/\r?\n/)) {
          if (line.startsWith(":")) yield { comment: line.slice(1).trim() };
          else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
          else if (line.startsWith("event:")) event = line.slice(6).trim();
        }
        if (data.length) yield { event, data: data.join("\n") };
      }
    }
  } finally {
    if (signal?.aborted) reader.cancel().catch(() => {});
    reader.releaseLock();
  }
}

// One streamed chat turn. `onEvent` gets {type: "progress"|"content"|"reasoning"|"tool"|
// "done", ...}; returns when the stream ends. An abort (the stop button) closes the
// connection, which cancels the request on the server.
export async function streamChat(body, { session, signal, onEvent }) {
  const extra = { "Content-Type": "application/json" };
  if (session) extra["X-Session-Id"] = session;
  const r = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(extra), signal,
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
  });
  if (!r.ok) throw await failure(r);
  let finish = null;
  for await (const ev of sse(r.body, signal)) {
    if (ev.comment !== undefined) {
      const m = /^keepalive (\d+)\/(\d+)/.exec(ev.comment);
      if (m) onEvent({ type: "progress", done: +m[1], total: +m[2] });
      continue;
    }
    if (ev.data === "[DONE]") break;
    const chunk = JSON.parse(ev.data);
    if (chunk.error) throw new ApiError(500, chunk.error.message || "the stream failed");
    for (const choice of chunk.choices || []) {
      const d = choice.delta || {};
      if (d.reasoning_content) onEvent({ type: "reasoning", text: d.reasoning_content });
      if (d.content) onEvent({ type: "content", text: d.content });
      for (const call of d.tool_calls || []) onEvent({ type: "tool", call });
      if (choice.finish_reason) finish = choice.finish_reason;
    }
    if (chunk.usage) onEvent({ type: "done", usage: chunk.usage, finish });
  }
  return finish;
}

// The tools the server's own MCP endpoint offers (Streamable HTTP: initialize, then
// tools/list, then the session closed); [] where it has none.
export async function mcpTools() {
  const base = { "Content-Type": "application/json",
                 Accept: "application/json, text/event-stream" };
  const call = async (msg, session) => {
    const h = headers(session ? { ...base, "Mcp-Session-Id": session } : base);
    const r = await fetch("/mcp", { method: "POST", headers: h, body: JSON.stringify(msg) });
    if (r.status === 401) throw new NeedsKey("API key needed");
    if (!r.ok || r.status === 202) return { response: r, result: null };
    let result = null;
    if ((r.headers.get("content-type") || "").includes("text/event-stream")) {
      for await (const ev of sse(r.body)) if (ev.data) result = JSON.parse(ev.data);
    } else {
      const text = await r.text();
      result = text ? JSON.parse(text) : null;
    }
    return { response: r, result };
  };
  const init = await call({
    jsonrpc: "2.0", id: 1, method: "initialize",
    params: { protocolVersion: "2025-06-18", capabilities: {},
              clientInfo: { name: "mlxlocal-chat-page", version: "1" } },
  });
  const session = init.response.headers.get("Mcp-Session-Id");
  if (!init.result?.result) return [];
  await call({ jsonrpc: "2.0", method: "notifications/initialized" }, session);
  const listed = await call({ jsonrpc: "2.0", id: 2, method: "tools/list" }, session);
  if (session) {
    fetch("/mcp", { method: "DELETE", headers: headers({ "Mcp-Session-Id": session }) })
      .catch(() => {});
  }
  return listed.result?.result?.tools || [];
}
