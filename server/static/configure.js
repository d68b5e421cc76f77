// The configure page: the running configuration from GET /admin/config, refreshed every 2 s; live
// settings applied with POST /admin/config {live}, the others saved for the next start {restart}.
"use strict";

const SAMPLING = ["temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty"];
let filled = false;                      // the forms are filled once (a refresh never undoes an edit)
let restart = null;                      // the last snapshot's restart part

const gib = n => (n / 2 ** 30).toFixed(2) + " GiB";

function dl(id, rows) {
  const d = $(id);
  d.replaceChildren();
  for (const [k, v] of rows) { d.appendChild(el("dt", "", k)); d.appendChild(el("dd", "", String(v))); }
}

function show(c) {
  const m = c.model;
  dl("model", [["name", m.name], ["path", m.path], ["family", `${m.family}, ${m.layers} layers`], ["dtype", m.dtype],
               ["weights", m.weights], ["KV dtype", m.kv_dtype], ["context", m.max_context],
               ["API key", c.api_key ? "required" : "none"]]);
  const kv = c.kv_pool, used = kv.blocks - kv.free_blocks;
  dl("kv", [["blocks in use", `${used} of ${kv.blocks} (${(100 * kv.used_ratio).toFixed(1)}%)`],
            ["block", `${kv.block_size} tokens, ${(kv.block_bytes / 1024).toFixed(0)} KiB`],
            ["pool", gib(kv.blocks * kv.block_bytes)]]);
  $("kv-bar").style.width = (100 * kv.used_ratio).toFixed(1) + "%";
  const p = c.prefix_cache;
  if (!p) dl("prefix", [["prefix cache", "off"]]);
  else {
    const rows = [["device blocks kept", p.device_cached_blocks],
                  ["tokens reused", `${p.stats.device} device, ${p.stats.ram} RAM, ${p.stats.ssd} SSD of ${p.stats.queried}`]];
    rows.push(["RAM tier", p.ram ? `${gib(p.ram.used_bytes)} of ${gib(p.ram.limit_bytes)}` : "off"]);
    rows.push(["SSD tier", p.ssd ? `${gib(p.ssd.written_bytes)} written, ${gib(p.ssd.capacity_bytes)} file` : "off"]);
    if (p.ssd) rows.push(["SSD write budget", `${gib(p.ssd.write_budget_left_bytes)} left now, ${p.ssd.write_budget_gib_per_hour} GiB/hour`]);
    dl("prefix", rows);
  }
  const r = c.requests;
  dl("requests", [["running", r.running], ["waiting", r.waiting], ["HTTP requests in flight", r.http_in_flight],
                  ["generations pending", r.pending]]);
  if (c.restart) {
    restart = c.restart;
    $("config-file").textContent = c.restart.config_file;
    $("restart-command").textContent = c.restart.command;
  }
  if (!filled) { fillLive(c.live); if (c.restart) fillRestart(c.restart); filled = true; }
}

function fillLive(live) {
  const f = $("live-form");
  for (const name of ["max-new-tokens", "max-http-clients", "max-pending-requests", "end-in-thinking"])
    f.elements[name].value = live[name] ?? "";
  f.elements["tolerant-tool-calls"].checked = !!live["tolerant-tool-calls"];
  const box = $("sampling");
  box.querySelectorAll("label").forEach(l => l.remove());
  for (const k of SAMPLING) {
    const l = el("label", "", k + " ");
    const i = el("input");
    i.name = "s:" + k; i.type = "number"; i.step = "any"; i.placeholder = "protocol default";
    i.value = live.sampling[k] ?? "";
    l.appendChild(i);
    box.appendChild(l);
  }
}

function shown(v) { return v === null || v === undefined ? "" : Array.isArray(v) ? v.join(" ") : String(v); }

function fillRestart(rs) {
  const body = $("restart-table").tBodies[0];
  body.replaceChildren();
  for (const o of rs.options) {
    const tr = el("tr");
    const name = el("td", "opt", o.name);
    name.title = o.help;
    const now = o.name in rs.started ? rs.started[o.name] : o.default;
    const next = o.name in rs.saved ? rs.saved[o.name] : now;
    let input;
    if (o.kind === "flag") { input = el("input"); input.type = "checkbox"; input.checked = !!next; }
    else if (o.choices) {
      input = el("select");
      for (const ch of ["", ...o.choices]) { const op = el("option", "", ch || "(default)"); op.value = ch; input.appendChild(op); }
      input.value = shown(next);
    } else {
      input = el("input");
      input.type = o.name === "api-key" ? "password" : "text";
      input.value = o.name === "api-key" ? "" : shown(next);
      input.placeholder = o.name === "api-key" ? (next ? "(set: type to change)" : "none") : shown(o.default) || "default";
    }
    input.name = o.name;
    input.dataset.kind = o.kind;
    input.dataset.was = o.kind === "flag" ? String(!!next) : (o.name === "api-key" ? "" : shown(next));
    tr.append(name, el("td", "now", o.name === "api-key" ? (now ? "(set)" : "") : shown(now)), el("td"));
    tr.lastChild.appendChild(input);
    body.appendChild(tr);
  }
}

function parsed(input) {
  const k = input.dataset.kind, v = input.value.trim();
  if (k === "flag") return input.checked;
  if (v === "") return null;                         // back to the default
  if (k === "int") return Number.isInteger(Number(v)) ? Number(v) : v;   // (the server says what is wrong)
  if (k === "float") return Number.isNaN(Number(v)) ? v : Number(v);
  if (k === "list") return v.split(/\s+/);
  return v;
}

async function post(body, out) {
  out.textContent = "…";
  out.className = "result";
  let r, res = null;
  try {
    r = await fetch("/admin/config", {method: "POST", headers: headers(), body: JSON.stringify(body)});
    res = await r.json();
  } catch (e) { /* unreachable, or an answer that is not JSON */ }
  if (!r || !r.ok || !res) {
    out.textContent = (res && res.error && res.error.message) || (r ? `${r.status} ${r.statusText}` : "server unreachable");
    out.className = "result error";
    return null;
  }
  return res;
}

$("live-form").addEventListener("submit", async ev => {
  ev.preventDefault();
  const f = $("live-form"), live = {sampling: {}};
  const mnt = f.elements["max-new-tokens"].value.trim();
  live["max-new-tokens"] = mnt === "" ? null : Number(mnt);
  for (const name of ["max-http-clients", "max-pending-requests"]) live[name] = Number(f.elements[name].value);
  live["end-in-thinking"] = f.elements["end-in-thinking"].value;
  live["tolerant-tool-calls"] = f.elements["tolerant-tool-calls"].checked;
  for (const k of SAMPLING) { const v = f.elements["s:" + k].value.trim(); if (v !== "") live.sampling[k] = Number(v); }
  const res = await post({live}, $("live-result"));
  if (res) $("live-result").textContent = "Applied." + (res.config_file ? ` Also saved to ${res.config_file}.` : "");
});

$("restart-form").addEventListener("submit", async ev => {
  ev.preventDefault();
  const changes = {};
  for (const input of $("restart-table").querySelectorAll("input, select")) {
    const now = input.dataset.kind === "flag" ? String(input.checked) : input.value.trim();
    if (now !== input.dataset.was) changes[input.name] = parsed(input);
  }
  if (!Object.keys(changes).length) { $("restart-result").textContent = "Nothing changed."; return; }
  const res = await post({restart: changes}, $("restart-result"));
  if (!res) return;
  $("restart-result").textContent = `Saved to ${res.config_file}. Restart the server with: ${res.command}`;
  fillRestart({...restart, saved: res.saved});       // what the file holds now (the live form keeps its edits)
});

async function refresh() {
  try {
    const r = await fetch("/admin/config", {headers: headers()});
    if (r.status === 401) { $("key-form").hidden = false; setStatus("API key needed"); return; }
    $("key-form").hidden = true;
    show(await r.json());
    setStatus("live");
  } catch (e) { setStatus("server unreachable"); }
}

wireKeyForm(refresh);
refresh();
setInterval(refresh, 2000);
