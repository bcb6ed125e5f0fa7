// The chat page: conversations kept in localStorage, one server session per conversation (its
// KV stays pinned between turns), replies streamed and rendered as Markdown.
import { ApiError, NeedsKey, apiKey, listModels, mcpTools, setApiKey, streamChat } from "./chat.js";

const STORE = "mlxlocal.conversations";
const CURRENT = "mlxlocal.current";
const LAST_MODEL = "mlxlocal.model";
const $ = (id) => document.getElementById(id);

let conversations = load();
let current = null;
let models = [];
let running = null; // {controller, message} while a reply streams
let afterKey = null; // what to retry once the API key is given

// --- storage -----------------------------------------------------------------------------
function load() {
  try {
    const list = JSON.parse(localStorage.getItem(STORE) || "[]");
    return Array.isArray(list) ? list.filter(valid) : [];
  } catch {
    return [];
  }
}

function valid(c) {
  return c && typeof c.id === "string" && Array.isArray(c.messages) &&
    c.messages.every((m) => m && typeof m.role === "string");
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(conversations));
    if (current) localStorage.setItem(CURRENT, current.id);
  } catch (e) { // the browser's quota (a few MB): the page goes on, unsaved, and says so
    status(`Not saved: the browser's storage is full (${e.name}). Export, then delete old chats.`,
           true);
  }
}

function newId() {
  return crypto.randomUUID ? crypto.randomUUID() :
    `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
}

function newConversation() {
  const c = { id: newId(), title: "New chat", created: Date.now(), updated: Date.now(),
              model: localStorage.getItem(LAST_MODEL) || models[0] || "", system: "",
              params: { temperature: 0.7, top_p: 1, max_tokens: 1024 },
              session: newId(), drops: [], messages: [] };
  conversations.unshift(c);
  return c;
}

// --- rendering ---------------------------------------------------------------------------
function markdown(el, text) {
  el.innerHTML = window.DOMPurify.sanitize(window.marked.parse(text || ""));
  for (const a of el.querySelectorAll("a[href]")) {
    a.target = "_blank";
    a.rel = "noopener noreferrer";
  }
  for (const code of el.querySelectorAll("pre code")) {
    window.hljs.highlightElement(code);
    const copy = button("Copy", "copy-code", () => copyText(code.textContent, copy));
    code.parentElement.prepend(copy);
  }
}

function button(label, cls, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.textContent = label;
  b.className = cls;
  b.addEventListener("click", onClick);
  return b;
}

function copyText(text, b) {
  const done = () => {
    b.textContent = "Copied";
    setTimeout(() => (b.textContent = "Copy"), 1200);
  };
  if (navigator.clipboard?.writeText) navigator.clipboard.writeText(text).then(done, done);
  else done();
}

function statsLine(s) {
  if (!s) return "";
  const parts = [];
  if (s.ttft_ms != null) parts.push(`TTFT ${Math.round(s.ttft_ms)} ms`);
  if (s.tok_s != null) parts.push(`${s.tok_s.toFixed(1)} tok/s`);
  if (s.completion != null) parts.push(`${s.completion} tokens`);
  if (s.prompt != null) parts.push(`${s.cached ?? 0} of ${s.prompt} prompt tokens cached`);
  if (s.finish) parts.push(s.finish);
  return parts.join(" · ");
}

function renderMessage(m, i) {
  const div = document.createElement("div");
  div.className = `msg ${m.role}`;
  div.dataset.index = i;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role === "user" ? "You" : m.role === "tool" ? "Tool result" :
    m.role === "assistant" ? `Assistant${m.model ? ` · ${m.model}` : ""}` : m.role;
  div.append(role);
  if (m.reasoning) {
    const d = document.createElement("details");
    d.className = "reasoning";
    d.open = running?.message === m;
    const s = document.createElement("summary");
    s.textContent = "Reasoning";
    const body = document.createElement("div");
    body.className = "md";
    markdown(body, m.reasoning);
    d.append(s, body);
    div.append(d);
  }
  const content = document.createElement("div");
  content.className = "md content";
  if (m.role === "tool") {
    content.classList.add("tool-card");
    const pre = document.createElement("pre");
    pre.textContent = typeof m.content === "string" ? m.content : JSON.stringify(m.content);
    content.append(pre);
  } else if (m.role === "user") {
    content.classList.add("plain");
    content.textContent = m.content;
  } else {
    markdown(content, m.content);
  }
  div.append(content);
  for (const call of m.tool_calls || []) div.append(toolCard(call));
  if (m.error) {
    const e = document.createElement("div");
    e.className = "error";
    e.textContent = m.error;
    div.append(e);
  }
  const stats = document.createElement("div");
  stats.className = "stats";
  stats.textContent = statsLine(m.stats);
  div.append(stats);
  if (running?.message !== m) div.append(actions(m, i));
  return div;
}

function toolCard(call) {
  const card = document.createElement("div");
  card.className = "tool-card call";
  const title = document.createElement("div");
  title.className = "tool-name";
  title.textContent = `Tool call: ${call.function?.name || "?"}`;
  const args = document.createElement("pre");
  let text = call.function?.arguments || "";
  try { text = JSON.stringify(JSON.parse(text), null, 2); } catch { /* partial */ }
  args.textContent = text;
  card.append(title, args);
  return card;
}

function actions(m, i) {
  const bar = document.createElement("div");
  bar.className = "actions";
  if (m.role !== "tool") bar.append(button("Copy", "copy", (e) => copyText(m.content, e.target)));
  if (m.role === "user") bar.append(button("Edit", "edit", () => startEdit(i)));
  if (m.role === "assistant") bar.append(button("Regenerate", "regenerate", () => regenerate(i)));
  return bar;
}

function renderAll() {
  const box = $("messages");
  box.replaceChildren();
  if (!current.messages.length) {
    const p = document.createElement("p");
    p.id = "empty";
    p.className = "hint";
    p.textContent = "Ask something. Replies stream from the local model.";
    box.append(p);
  }
  current.messages.forEach((m, i) => box.append(renderMessage(m, i)));
  box.scrollTop = box.scrollHeight;
  renderList();
  renderSettings();
  renderSession();
}

let pending = false;
function renderLive() { // a streaming reply: re-rendered at most once a frame
  if (pending) return;
  pending = true;
  requestAnimationFrame(() => {
    pending = false;
    const i = current.messages.indexOf(running?.message);
    const old = document.querySelector(`.msg[data-index="${i}"]`);
    if (i < 0 || !old) return;
    const box = $("messages");
    const atEnd = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    old.replaceWith(renderMessage(running.message, i));
    if (atEnd) box.scrollTop = box.scrollHeight;
  });
}

function renderList() {
  const ul = $("conversations");
  ul.replaceChildren();
  for (const c of conversations) {
    const li = document.createElement("li");
    li.className = c === current ? "active" : "";
    const open = button(c.title || "Untitled", "open", () => switchTo(c));
    const del = button("×", "delete", () => remove(c));
    del.title = "Delete";
    li.append(open, del);
    ul.append(li);
  }
}

function renderSettings() {
  $("system").value = current.system || "";
  for (const k of ["temperature", "top_p", "max_tokens"]) $(k).value = current.params?.[k] ?? "";
  const select = $("model");
  if (current.model && !models.includes(current.model) && models.length) current.model = models[0];
  select.value = current.model;
}

function renderSession() {
  const last = [...current.messages].reverse().find((m) => m.stats?.prompt != null);
  const line = $("kv-line");
  if (!last) {
    line.textContent = "Session: no turns yet";
    return;
  }
  const s = last.stats;
  const held = s.prompt - (s.dropped || 0) + (s.completion || 0);
  const pct = s.prompt ? Math.round((100 * (s.cached || 0)) / s.prompt) : 0;
  const pendingDrops = current.drops.filter((d) => d.trigger >= current.messages.length)
    .reduce((n, d) => n + d.messages.length, 0);
  line.textContent = `Session KV ≈ ${held} tokens · last prompt ${pct}% from cache ` +
    `(${s.cached || 0} of ${s.prompt})` + (s.dropped ? ` · ${s.dropped} tokens dropped` : "") +
    (pendingDrops ? ` · ${pendingDrops} tool outputs leave with the next message` : "");
}

function status(text, error = false) {
  const el = $("status");
  el.textContent = text || "";
  el.classList.toggle("error", error);
}

// --- actions -----------------------------------------------------------------------------
function switchTo(c) {
  if (running) return;
  current = c;
  save();
  renderAll();
  document.body.classList.remove("show-sidebar");
}

function remove(c) {
  if (running && c === current) return;
  if (!confirm(`Delete "${c.title}"?`)) return;
  conversations = conversations.filter((x) => x !== c);
  if (c === current) current = conversations[0] || newConversation();
  save();
  renderAll();
}

function startEdit(i) {
  if (running) return;
  const m = current.messages[i];
  const div = document.querySelector(`.msg[data-index="${i}"]`);
  const area = document.createElement("textarea");
  area.className = "edit-box";
  area.value = m.content;
  const ok = button("Save & send", "save-edit", () => {
    m.content = area.value;
    truncate(i + 1);
    generate();
  });
  const cancel = button("Cancel", "cancel-edit", renderAll);
  div.querySelector(".content").replaceWith(area);
  div.querySelector(".actions").replaceChildren(ok, cancel);
  area.focus();
}

function truncate(n) { // the conversation cut after n messages; drop plans past it go too
  current.messages = current.messages.slice(0, n);
  current.drops = current.drops.filter((d) => d.trigger <= n);
}

function regenerate(i) {
  if (running) return;
  truncate(i);
  generate();
}

function compact() {
  const planned = new Set(current.drops.flatMap((d) => d.messages));
  const old = current.messages.map((m, i) => (m.role === "tool" && !planned.has(i) ? i : -1))
    .filter((i) => i >= 0);
  if (!old.length) {
    status("Nothing to compact: no tool outputs in the session's cache yet.");
    return;
  }
  current.drops.push({ trigger: current.messages.length, messages: old });
  save();
  renderSession();
  status(`${old.length} tool output(s) will leave the session's KV cache with your next message.`);
}

function requestBody() {
  const off = current.system ? 1 : 0;
  const messages = current.system ? [{ role: "system", content: current.system }] : [];
  for (const m of current.messages.slice(0, -1)) {
    const out = { role: m.role, content: m.content ?? "" };
    if (m.tool_calls?.length) out.tool_calls = m.tool_calls;
    if (m.tool_call_id) out.tool_call_id = m.tool_call_id;
    if (m.name) out.name = m.name;
    messages.push(out);
  }
  const body = { model: current.model, messages };
  for (const k of ["temperature", "top_p", "max_tokens"]) {
    const v = current.params?.[k];
    if (v !== "" && v != null && !Number.isNaN(+v)) body[k] = +v;
  }
  const due = current.drops.filter((d) => d.trigger + off < messages.length);
  if (due.length) {
    body.drop_message = Object.fromEntries(due.map((d) => [String(d.trigger + off),
                                                           d.messages.map((i) => i + off)]));
  }
  return body;
}

async function generate() {
  const m = { role: "assistant", content: "", reasoning: "", model: current.model };
  current.messages.push(m);
  current.updated = Date.now();
  const controller = new AbortController();
  running = { controller, message: m };
  setRunning(true);
  renderAll();
  const t0 = performance.now();
  let first = null, usage = null, finish = null;
  const calls = [];
  const onEvent = (ev) => {
    if (ev.type === "progress") {
      status(`Reading the prompt: ${ev.done} of ${ev.total} tokens`);
      return;
    }
    if (ev.type === "done") {
      usage = ev.usage;
      finish = ev.finish || finish;
      return;
    }
    if (first == null) {
      first = performance.now();
      status("");
    }
    if (ev.type === "content") m.content += ev.text;
    else if (ev.type === "reasoning") m.reasoning += ev.text;
    else if (ev.type === "tool") {
      const at = ev.call.index ?? calls.length;
      calls[at] ||= { id: ev.call.id, type: "function", function: { name: "", arguments: "" } };
      if (ev.call.function?.name) calls[at].function.name += ev.call.function.name;
      if (ev.call.function?.arguments) calls[at].function.arguments += ev.call.function.arguments;
      m.tool_calls = calls.filter(Boolean);
    }
    renderLive();
  };
  let stopped = false;
  try {
    for (let tries = 0; ; tries++) {
      try {
        const options = { session: current.session, signal: controller.signal, onEvent };
        finish = await streamChat(requestBody(), options);
        break;
      } catch (e) { // 409: the session's previous reply is still being cancelled
        if (!(e instanceof ApiError && e.status === 409 && tries < 20)) throw e;
        await new Promise((r) => setTimeout(r, 250));
      }
    }
  } catch (e) {
    if (controller.signal.aborted) stopped = true;
    else if (e instanceof NeedsKey) {
      current.messages.pop();
      running = null;
      setRunning(false);
      renderAll();
      askKey(() => generate());
      return;
    } else m.error = e.message || String(e);
  }
  const end = performance.now();
  const completion = usage?.completion_tokens;
  m.stats = {
    ttft_ms: first != null ? first - t0 : null,
    // Decode speed: the tokens after the first over the time after it (the first is TTFT's).
    tok_s: completion > 1 && first != null && end > first ?
      (completion - 1) / ((end - first) / 1000) : null,
    completion: completion ?? null,
    prompt: usage?.prompt_tokens ?? null,
    cached: usage?.prompt_tokens_details?.cached_tokens ?? null,
    dropped: usage?.drop_skipped_tokens ?? 0,
    finish: stopped ? "stopped" : m.error ? "error" : finish,
  };
  if (current.messages[0] === current.messages.find((x) => x.role === "user") &&
      current.title === "New chat") {
    current.title = current.messages[0].content.slice(0, 48) || "Untitled";
  }
  running = null;
  setRunning(false);
  if (stopped) status("Stopped.");
  else if (!m.error) status("");
  save(); // after: a storage error stays on the status line
  renderAll();
}

function setRunning(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  document.body.classList.toggle("running", on);
}

async function send(text) {
  if (running || !text.trim()) return;
  if (!current.model) {
    status("No model to send to: the server lists none (or needs the API key).", true);
    return;
  }
  current.messages.push({ role: "user", content: text });
  $("input").value = "";
  await generate();
}

function askKey(then) {
  afterKey = then;
  $("key-input").value = apiKey();
  $("key-dialog").showModal();
}

async function loadModels() {
  try {
    models = await listModels();
  } catch (e) {
    if (e instanceof NeedsKey) {
      status("This server needs an API key.", true);
      askKey(loadModels);
    } else status(`Could not list the models: ${e.message}`, true);
    return;
  }
  const select = $("model");
  select.replaceChildren(...models.map((id) => new Option(id, id)));
  if (!current.model || !models.includes(current.model)) {
    const last = localStorage.getItem(LAST_MODEL);
    current.model = models.includes(last) ? last : models[0] || "";
  }
  renderSettings();
  status("");
  loadMcp();
}

async function loadMcp() {
  let tools = [];
  try { tools = await mcpTools(); } catch { tools = []; }
  $("mcp").hidden = !tools.length;
  $("mcp-url").textContent = `${location.origin}/mcp`;
  $("mcp-tools").replaceChildren(...tools.map((t) => {
    const li = document.createElement("li");
    const name = document.createElement("code");
    name.textContent = t.name;
    const about = (t.description || "").replace(/\s+/g, " ").split(/(?<=\.) /)[0];  // 1st sentence
    li.append(name, ` ${about}`);
    return li;
  }));
}

function exportAll() {
  const data = { format: "mlxlocal-chat", version: 1, conversations };
  const blob = new Blob([JSON.stringify(data, null, 1)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `mlxlocal-chats-${new Date().toISOString().slice(0, 10)}.json`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

async function importFile(file) {
  let data;
  try {
    data = JSON.parse(await file.text());
  } catch (e) {
    status(`${file.name}: not JSON (${e.message})`, true);
    return;
  }
  const list = Array.isArray(data) ? data : data?.conversations;
  if (!Array.isArray(list)) {
    status(`${file.name}: no "conversations" list in it`, true);
    return;
  }
  const good = list.filter(valid);
  const known = new Set(conversations.map((c) => c.id));
  for (const c of good) {
    c.drops ||= [];
    c.params ||= { temperature: 0.7, top_p: 1, max_tokens: 1024 };
    c.session ||= newId();
    if (!known.has(c.id)) conversations.push(c);
  }
  const skipped = list.length - good.length;
  status(`Imported ${good.length} conversation(s) from ${file.name}` +
         (skipped ? `; ${skipped} left out (no id or messages)` : ""), skipped > 0);
  if (good.length) current = good[0];
  save();
  renderAll();
}

// --- wiring ------------------------------------------------------------------------------
function start() {
  window.hljs.configure({ ignoreUnescapedHTML: true });
  const id = localStorage.getItem(CURRENT);
  current = conversations.find((c) => c.id === id) || conversations[0] || newConversation();
  $("composer").addEventListener("submit", (e) => { e.preventDefault(); send($("input").value); });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send($("input").value);
    }
  });
  $("stop").addEventListener("click", () => running?.controller.abort());
  $("new-chat").addEventListener("click", () => { if (!running) switchTo(newConversation()); });
  $("model").addEventListener("change", (e) => {
    current.model = e.target.value;
    localStorage.setItem(LAST_MODEL, current.model);
    save();
  });
  $("system").addEventListener("change", (e) => { current.system = e.target.value; save(); });
  for (const k of ["temperature", "top_p", "max_tokens"]) {
    $(k).addEventListener("change", (e) => { current.params[k] = e.target.value; save(); });
  }
  $("toggle-settings").addEventListener("click", (e) => {
    const s = $("settings");
    s.hidden = !s.hidden;
    e.target.setAttribute("aria-expanded", String(!s.hidden));
  });
  $("toggle-sidebar").addEventListener("click",
                                       () => document.body.classList.toggle("show-sidebar"));
  $("key-button").addEventListener("click", () => askKey(loadModels));
  $("key-dialog").addEventListener("close", () => {
    if ($("key-dialog").returnValue !== "ok") return;
    setApiKey($("key-input").value.trim());
    const then = afterKey;
    afterKey = null;
    if (then) then();
  });
  $("compact").addEventListener("click", compact);
  $("export").addEventListener("click", exportAll);
  $("import-file").addEventListener("change", (e) => {
    if (e.target.files[0]) importFile(e.target.files[0]);
    e.target.value = "";
  });
  save();
  renderAll();
  loadModels();
}

start();
