// The chat page: conversations kept in this browser's local storage, replies streamed from the
// server's OpenAI Chat Completions endpoint. Reasoning is shown folded, tool calls as blocks, and
// each reply carries its model, time to first token and tokens per second.
"use strict";

const STORE = "infernix.chats";          // {chats: [{id, title, messages}], current}

let state = load();
let model = null;                        // the served model's name (GET /v1/models)
let inflight = null;                     // {controller, msg} while a reply streams
const nodes = new WeakMap();             // message -> its element (kept out of the stored JSON)

function load() {
  try {
    const s = JSON.parse(localStorage.getItem(STORE));
    if (s && Array.isArray(s.chats)) {      // (entries that are not chats are dropped, not fatal)
      s.chats = s.chats.filter(c => c && typeof c.id === "string" && Array.isArray(c.messages))
        .map(c => ({...c, title: String(c.title || "chat"),
                    messages: c.messages.filter(m => m && (m.role === "user" || m.role === "assistant"))}));
      return s;
    }
  } catch (e) { /* a damaged store starts afresh */ }
  return {chats: [], current: null};
}

function save() {
  try { localStorage.setItem(STORE, JSON.stringify(state)); setStatus(""); }
  catch (e) { setStatus("local storage is full: delete some chats to keep new ones"); }
}

function current() {
  let c = state.chats.find(c => c.id === state.current);
  if (!c) {
    c = {id: String(Date.now()) + Math.random().toString(16).slice(2, 6), title: "New chat", messages: []};
    state.chats.unshift(c);
    state.current = c.id;
  }
  return c;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", {headers: headers()});
    if (r.status === 401) { $("key-form").hidden = false; setStatus("API key needed"); return; }
    const body = await r.json();
    model = body.data && body.data.length ? body.data[0].id : null;
    $("model-name").textContent = model || "(no model)";
    $("key-form").hidden = true;
    setStatus("");
  } catch (e) { setStatus("server unreachable"); }
}

// ---- rendering -------------------------------------------------------------------------------
function renderList() {
  const ul = $("chat-list");
  ul.replaceChildren();
  for (const c of state.chats) {
    const li = el("li", c.id === state.current ? "active" : "", c.title);
    li.dataset.id = c.id;
    li.onclick = () => { if (!inflight) { state.current = c.id; save(); renderAll(); } };
    const del = el("button", "delete", "×");
    del.title = "Delete this chat";
    del.onclick = ev => {
      ev.stopPropagation();
      if (inflight) return;
      state.chats = state.chats.filter(x => x.id !== c.id);
      if (state.current === c.id) state.current = state.chats.length ? state.chats[0].id : null;
      save(); renderAll();
    };
    li.appendChild(del);
    ul.appendChild(li);
  }
}

function fillMessage(node, m) {
  node.replaceChildren();
  if (m.role === "user") { node.appendChild(el("div", "content", m.content)); return; }
  if (m.reasoning) {
    const d = el("details", "reasoning");
    d.appendChild(el("summary", "", m.content || (m.tool_calls || []).length ? "Reasoning" : "Reasoning…"));
    d.appendChild(el("div", "reasoning-text", m.reasoning));
    node.appendChild(d);
  }
  const content = el("div", "content");
  content.innerHTML = renderMarkdown(m.content || "");   // escaped inside renderMarkdown
  node.appendChild(content);
  for (const t of m.tool_calls || []) {
    const b = el("div", "tool-call");
    b.appendChild(el("div", "tool-name", "tool call: " + (t.name || "?")));
    b.appendChild(el("pre", "tool-args", t.arguments || ""));
    node.appendChild(b);
  }
  if (m.error) node.appendChild(el("div", "error", m.error));
  const s = m.stats;
  if (s || m.stopped) {
    const parts = [];
    if (s && s.model) parts.push(s.model);
    if (s && s.ttft_ms !== undefined) parts.push(`TTFT ${(s.ttft_ms / 1000).toFixed(2)} s`);
    if (s && s.tok_s !== undefined) parts.push(`${s.tok_s.toFixed(1)} tok/s`);
    if (s && s.tokens !== undefined) parts.push(`${s.tokens} tokens`);
    if (s && s.finish) parts.push(s.finish);
    if (s && s.live) parts.push("streaming");
    if (m.stopped) parts.push("stopped");
    node.appendChild(el("div", "stats", parts.join(" · ")));
  }
}

function renderAll() {
  renderList();
  const box = $("messages");
  box.replaceChildren();
  for (const m of current().messages) {
    const node = el("div", "msg " + m.role);
    fillMessage(node, m);
    box.appendChild(node);
    nodes.set(m, node);
  }
  box.scrollTop = box.scrollHeight;
}

// ---- one reply ---------------------------------------------------------------------------------
function requestBody(chat) {
  const body = {model: model || "default", stream: true, stream_options: {include_usage: true}, messages: []};
  for (const m of chat.messages) {
    if (m.role === "user") body.messages.push({role: "user", content: m.content});
    else if (m.content && !m.error) body.messages.push({role: "assistant", content: m.content});
  }
  const mt = parseInt($("max-tokens").value, 10), t = parseFloat($("temperature").value);
  if (mt > 0) body.max_tokens = mt;
  if (!Number.isNaN(t)) body.temperature = t;
  const tools = $("tools").value.trim();        // (the server says what is wrong with them)
  if (tools) {
    try { body.tools = JSON.parse(tools); } catch (e) { throw new Error("the tools are not valid JSON: " + e.message); }
  }
  return body;
}

async function send(text) {
  const chat = current();
  if (!chat.messages.length) chat.title = text.slice(0, 40);
  chat.messages.push({role: "user", content: text});
  const msg = {role: "assistant", content: "", reasoning: "", tool_calls: []};
  let body = null;
  try { body = requestBody(chat); } catch (e) { msg.error = e.message; }
  chat.messages.push(msg);
  if (!body) { save(); renderAll(); return; }
  save(); renderAll();
  const controller = new AbortController();
  inflight = {controller, msg};
  $("send").hidden = true; $("stop").hidden = false;
  const t0 = performance.now();
  let tFirst = null, usage = null, finish = null, pieces = 0;
  let pending = false;
  const redraw = () => {                 // at most once a frame, with the stats so far
    if (tFirst !== null) {
      const secs = (performance.now() - tFirst) / 1000;
      msg.stats = {model: model || undefined, ttft_ms: tFirst - t0, live: true};
      if (secs > 0 && pieces > 1) msg.stats.tok_s = (pieces - 1) / secs;
    }
    if (pending) return;
    pending = true;
    requestAnimationFrame(() => { pending = false; fillMessage(nodes.get(msg), msg); $("messages").scrollTop = $("messages").scrollHeight; });
  };
  try {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(), body: JSON.stringify(body),
                                                   signal: controller.signal});
    if (!r.ok) {
      let detail = r.statusText;
      try { const e = await r.json(); detail = (e.error && e.error.message) || JSON.stringify(e); } catch (e) { /* not JSON */ }
      if (r.status === 401) $("key-form").hidden = false;
      throw new Error(`${r.status}: ${detail}`);
    }
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (let done = false; !done;) {
      const next = await reader.read();
      done = next.done;
      buf = (buf + (done ? dec.decode() + "\n\n" : dec.decode(next.value, {stream: true}))).replace(/\r\n|\r(?!$)/g, "\n");
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, i);
        buf = buf.slice(i + 2);
        // an event's data lines, joined (SSE comments are heartbeats)
        const data = event.split("\n").filter(l => l.startsWith("data:")).map(l => l.slice(5).replace(/^ /, "")).join("\n").trim();
        if (!data || data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message || JSON.stringify(chunk.error));
        if (chunk.usage) usage = chunk.usage;
        for (const ch of chunk.choices || []) {
          const d = ch.delta || {};
          if (d.content || d.reasoning_content || d.tool_calls) { if (tFirst === null) tFirst = performance.now(); pieces++; }
          if (d.content) msg.content += d.content;
          if (d.reasoning_content) msg.reasoning += d.reasoning_content;
          for (const tc of d.tool_calls || []) {
            const slot = msg.tool_calls[tc.index] || (msg.tool_calls[tc.index] = {name: "", arguments: ""});
            if (tc.function && tc.function.name) slot.name += tc.function.name;
            if (tc.function && tc.function.arguments) slot.arguments += tc.function.arguments;
          }
          if (ch.finish_reason) finish = ch.finish_reason;
        }
        redraw();
      }
    }
  } catch (e) {
    if (e.name === "AbortError") msg.stopped = true;
    else msg.error = String(e.message || e);
  } finally {
    controller.abort();                  // whatever ended the reply, the server stops generating it
  }
  const tEnd = performance.now();
  const tokens = usage ? usage.completion_tokens : pieces;
  msg.stats = {model: model || undefined, finish: finish || undefined};
  if (tFirst !== null) {
    msg.stats.ttft_ms = tFirst - t0;
    if (tEnd > tFirst && tokens > 1) msg.stats.tok_s = (tokens - 1) / ((tEnd - tFirst) / 1000);
  }
  if (usage) msg.stats.tokens = usage.completion_tokens;
  msg.tool_calls = msg.tool_calls.filter(Boolean);
  inflight = null;
  $("send").hidden = false; $("stop").hidden = true;
  save();
  fillMessage(nodes.get(msg), msg);
}

// ---- wiring --------------------------------------------------------------------------------------
$("composer").addEventListener("submit", ev => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || inflight) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", ev => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (inflight) inflight.controller.abort(); });
$("new-chat").addEventListener("click", () => {
  if (inflight) return;
  state.current = null; current(); save(); renderAll(); $("prompt").focus();
});
$("key-button").addEventListener("click", () => { $("key-form").hidden = !$("key-form").hidden; });
wireKeyForm(loadModel);
$("forget-key").addEventListener("click", () => { localStorage.removeItem(KEY); loadModel(); });

renderAll();
loadModel();
