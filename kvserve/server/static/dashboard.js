// kvserve KV-cache dashboard: live from /v1/kv/state + /v1/kv/stream, or replayed from a --record file.
"use strict";

const KEY_STORE = "kvserve.apiKey";
const HISTORY_SECONDS = 300;
const MAX_CHIPS = 96;
const MAX_GROUPS = 4;      // block tables drawn per request (KV groups)
const STATE_CLASS = { f: "free", c: "cached", u: "used", s: "shared", r: "reserved" };
const $ = (id) => document.getElementById(id);

let samples = [];          // counter samples for the charts
let current = null;        // the snapshot on screen
let liveAbort = null;      // aborts the live stream
let frames = null;         // replay: snapshots of a recording
let playTimer = null;
let cells = [];            // block map cells, by block id
let hoverBlock = null;

// ---- the key: typed into the form, kept in sessionStorage, sent as a bearer header -----------
// A key in the address (?key=...) is never used: it would land in logs and the history.
let keyInUrl = false;
function dropKeyFromUrl() {
  const url = new URL(window.location.href);
  if (!url.searchParams.has("key")) return;
  keyInUrl = true;
  url.searchParams.delete("key");
  dropFromAddressBar(url);
}
function dropFromAddressBar(url) {
  window.history.replaceState(null, "", url.pathname + url.search + url.hash);
}
function authHeaders() {
  const key = sessionStorage.getItem(KEY_STORE);
  return key ? { Authorization: "Bearer " + key } : {};
}

// ---- live -----------------------------------------------------------------------------------
async function startLive() {
  stopReplay();
  setStatus("connecting…", "");
  let res;
  try {
    res = await fetch("/v1/kv/state", { headers: authHeaders(), cache: "no-store" });
  } catch (e) {
    return retryLive("server unreachable");
  }
  if (res.status === 401) return askForKey(sessionStorage.getItem(KEY_STORE) ? "that key was refused" :
    keyInUrl ? "a key in the address is not used: enter it here" : "");
  if (res.status === 403) return askForKey("that key cannot see the KV state: use the admin key");
  if (!res.ok) return retryLive("HTTP " + res.status);
  $("login").hidden = true;
  onSnapshot(await res.json());
  streamLive();
}

function retryLive(why) {
  setStatus("offline: " + why, "error");
  if (!frames) setTimeout(startLive, 2000);
}

async function streamLive() {
  liveAbort = new AbortController();
  const signal = liveAbort.signal;
  try {
    const res = await fetch("/v1/kv/stream", { headers: authHeaders(), signal, cache: "no-store" });
    if (!res.ok) throw new Error("HTTP " + res.status);
    setStatus("live", "live");
    await readEvents(res.body.getReader(), (snap) => { if (!frames) onSnapshot(snap); });
    if (!signal.aborted) retryLive("stream ended");
  } catch (e) {
    if (!signal.aborted) retryLive(e.message || "stream failed");
  }
}

async function readEvents(reader, onData) {
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5)).join("\n");
      if (data) onData(JSON.parse(data));
    }
  }
}

function stopLive() {
  if (liveAbort) liveAbort.abort();
  liveAbort = null;
}

function askForKey(error) {
  stopLive();
  setStatus("API key needed", "error");
  $("login").hidden = false;
  $("login-error").textContent = error;
  $("login-key").focus();
}

function onSnapshot(snap) {
  if (snap.history) samples = snap.history.slice();
  else if (snap.sample) samples.push(snap.sample);
  const last = samples.length ? samples[samples.length - 1].t : 0;
  while (samples.length && samples[0].t < last - HISTORY_SECONDS) samples.shift();
  render(snap);
}

function setStatus(text, cls) {
  const el = $("status");
  el.textContent = text;
  el.className = "status " + cls;
}

// ---- replay -----------------------------------------------------------------------------------
function loadRecording(file) {
  file.text().then((text) => {
    const parsed = text.split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l));
    if (!parsed.length) throw new Error("the file holds no snapshots");
    stopLive();
    frames = parsed;
    $("replay").hidden = false;
    $("live").hidden = false;
    const slider = $("replay-slider");
    slider.max = String(frames.length - 1);
    showFrame(0);
    setStatus("replay: " + file.name, "replay");
  }).catch((e) => setStatus("cannot replay: " + e.message, "error"));
}

function showFrame(i) {
  i = Math.max(0, Math.min(frames.length - 1, i));
  $("replay-slider").value = String(i);
  const start = frames[0].time;
  $("replay-pos").textContent = `${i + 1} / ${frames.length} · t+${(frames[i].time - start).toFixed(2)} s · step ${frames[i].step}`;
  samples = frames.slice(0, i + 1).map((f) => f.sample).filter(Boolean);
  render(frames[i]);
}

function togglePlay() {
  if (playTimer) return stopPlay();
  $("replay-play").textContent = "Pause";
  playTimer = setInterval(() => {
    const i = Number($("replay-slider").value) + 1;
    if (i >= frames.length) return stopPlay();
    showFrame(i);
  }, 250);
}

function stopPlay() {
  clearInterval(playTimer);
  playTimer = null;
  $("replay-play").textContent = "Play";
}

function stopReplay() {
  stopPlay();
  frames = null;
  $("replay").hidden = true;
  $("live").hidden = true;
}

// ---- rendering --------------------------------------------------------------------------------
function render(snap) {
  current = snap;
  renderFacts(snap);
  renderBlockMap(snap.pool);
  renderRequests(snap);
  renderCharts();
  renderCounters(snap);
  renderTiers(snap.counters);
  renderEviction(snap.requests);
  if (hoverBlock !== null) showBlock(hoverBlock);
}

function fmtBytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : String(n)) + " " + units[i];
}
function fmtNum(n) { return typeof n === "number" ? n.toLocaleString("en-US", { maximumFractionDigits: 3 }) : String(n); }
function pct(x) { return (100 * x).toFixed(1) + "%"; }
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}

function renderFacts(snap) {
  const kv = snap.kv;
  const facts = [
    ["model", snap.model], ["KV format", kv.format], ["bytes/token", fmtNum(kv.bytes_per_token)],
    ["block", kv.block_size + " tokens"], ["pool", fmtNum(kv.num_usable) + " blocks"],
    ["groups", kv.groups.length], ["policy", kv.policy || "keep all"], ["step", fmtNum(snap.step)],
  ];
  const box = $("facts");
  box.replaceChildren(...facts.map(([k, v]) => { const s = el("span", {}, k + " "); s.append(el("b", {}, String(v))); return s; }));
}

function renderBlockMap(pool) {
  const map = $("blockmap");
  const n = pool.state.length;
  if (cells.length !== n) {
    cells = [];
    const frag = document.createDocumentFragment();
    for (let b = 0; b < n; b++) {
      const c = el("div", { class: "cell", "data-block": String(b) });
      cells.push(c);
      frag.append(c);
    }
    map.replaceChildren(frag);
  }
  const pinned = new Set(pool.pinned || []);
  for (let b = 0; b < n; b++) {
    let cls = "cell " + STATE_CLASS[pool.state[b]];
    if (pinned.has(b)) cls += " pinned";
    if (b === hoverBlock) cls += " hl";
    const c = cells[b];
    if (c.className !== cls) c.className = cls;
    const ref = pool.ref[b] > 1 ? String(pool.ref[b]) : "";
    if (c.dataset.ref !== ref) c.dataset.ref = ref;
  }
  const k = pool.counts;
  $("pool-counts").textContent = `free ${k.f} · cached ${k.c} · used ${k.u} · shared ${k.s} · total ${n}`;
}

function blockText(b) {
  const pool = current.pool;
  const state = STATE_CLASS[pool.state[b]];
  const holders = (pool.holders[b] || []).map((i) => current.requests[i].id);
  const parts = [`block ${b}`, state, `ref ${pool.ref[b]}`];
  if (pool.group[b] >= 0) parts.push(`group ${pool.group[b]}`);
  const hash = pool.hash.substr(b * 16, 16);
  parts.push("hash " + (/^0+$/.test(hash) ? "—" : hash));
  parts.push("held by " + (holders.length ? holders.join(", ") : "nobody"));
  return parts.join(" · ");
}

function showBlock(b) {
  if (!current || b >= current.pool.state.length) return;
  $("block-info").textContent = blockText(b);
  const holders = new Set(current.pool.holders[b] || []);
  document.querySelectorAll("#requests tbody tr").forEach((tr) => {
    tr.classList.toggle("hl", holders.has(Number(tr.dataset.index)));
  });
}

function highlightBlock(b) {
  if (hoverBlock !== null && cells[hoverBlock]) cells[hoverBlock].classList.remove("hl");
  hoverBlock = b;
  if (b !== null && cells[b]) {
    cells[b].classList.add("hl");
    showBlock(b);
  }
}

function renderRequests(snap) {
  const body = $("requests").querySelector("tbody");
  const pool = snap.pool;
  const rows = snap.requests.map((r, i) => {
    const tr = el("tr", { "data-index": String(i) });
    tr.append(el("td", {}, r.id));
    tr.append(el("td", { class: "state-" + r.state }, r.state + (r.swap_blocks ? ` (${r.swap_blocks} host blocks)` : "")));
    tr.append(el("td", {}, `${r.prompt_tokens} + ${r.output_tokens} · ${r.computed_tokens} in cache`));
    tr.append(el("td", {}, String(r.prefix_hit_tokens)));
    const kept = r.kept_tokens ? ` · ${Math.min(...r.kept_tokens)}–${Math.max(...r.kept_tokens)} kept` : "";
    tr.append(el("td", {}, (r.policy || "—") + kept));
    const td = el("td", { class: "table" });
    const groups = r.blocks.slice(0, MAX_GROUPS);
    groups.forEach((table, g) => td.append(chips(table, pool, groups.length > 1 ? `g${g}` : null)));
    if (r.blocks.length > MAX_GROUPS) td.append(el("span", { class: "dim" }, `+${r.blocks.length - MAX_GROUPS} more groups`));
    tr.append(td);
    return tr;
  });
  body.replaceChildren(...rows);
  const by = {};
  snap.requests.forEach((r) => { by[r.state] = (by[r.state] || 0) + 1; });
  $("req-counts").textContent = Object.entries(by).map(([k, v]) => `${k} ${v}`).join(" · ") || "none";
}

function chips(table, pool, label) {
  const box = el("div", { class: "chips" });
  if (label) box.append(el("span", { class: "dim" }, label));
  table.slice(0, MAX_CHIPS).forEach((b) => {
    const st = pool.state[b];
    const cls = st === "r" ? "null" : STATE_CLASS[st];
    const c = el("span", { class: "chip " + cls, "data-block": String(b) }, String(b));
    if (pool.ref[b] > 1) c.title = `shared by ${pool.ref[b]}`;
    box.append(c);
  });
  if (table.length > MAX_CHIPS) box.append(el("span", { class: "dim" }, ` +${table.length - MAX_CHIPS}`));
  return box;
}

// ---- charts (hand-drawn on canvas) --------------------------------------------------------------
function series() {
  const usage = [], hits = [], tput = [];
  let rate = null;
  for (let i = 0; i < samples.length; i++) {
    const s = samples[i], p = samples[i - 1];
    usage.push([s.t, 100 * s.usage]);
    if (p) {
      const dq = s.queries - p.queries, dt = s.t - p.t;
      if (dq > 0) rate = 100 * (s.hits - p.hits) / dq;
      if (dt > 0) tput.push([s.t, (s.generation_tokens + s.prompt_tokens_computed - p.generation_tokens - p.prompt_tokens_computed) / dt]);
    } else if (s.queries > 0) rate = 100 * s.hits / s.queries;
    if (rate !== null) hits.push([s.t, rate]);
  }
  return { usage, hits, tput };
}

function renderCharts() {
  const s = series();
  drawChart($("chart-usage"), s.usage, 100, "%", "#3fa34d");
  drawChart($("chart-hits"), s.hits, 100, "%", "#2f6f9f");
  drawChart($("chart-throughput"), s.tput, null, "", "#e0a030");
}

function drawChart(canvas, points, fixedMax, unit, color) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || 420, h = canvas.clientHeight || 140;
  if (canvas.width !== w * dpr) { canvas.width = w * dpr; canvas.height = h * dpr; }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const left = 44, bottom = h - 18, top = 8, right = w - 6;
  const tMax = points.length ? points[points.length - 1][0] : 0;
  const tMin = Math.max(0, tMax - HISTORY_SECONDS);
  const yMax = fixedMax || Math.max(1, ...points.map((p) => p[1])) * 1.1;
  ctx.strokeStyle = "#27313c"; ctx.fillStyle = "#7d8a97"; ctx.font = "10px sans-serif";
  for (let i = 0; i <= 4; i++) {
    const y = bottom - (bottom - top) * i / 4;
    ctx.beginPath(); ctx.moveTo(left, y); ctx.lineTo(right, y); ctx.stroke();
    ctx.fillText((yMax * i / 4).toFixed(yMax >= 10 ? 0 : 1) + unit, 2, y + 3);
  }
  ctx.fillText(`last ${Math.round(tMax - tMin)} s`, left, h - 4);
  if (!points.length) return;
  const x = (t) => left + (right - left) * (tMax > tMin ? (t - tMin) / (tMax - tMin) : 1);
  const y = (v) => bottom - (bottom - top) * Math.min(v, yMax) / yMax;
  ctx.strokeStyle = color; ctx.lineWidth = 1.5; ctx.beginPath();
  points.filter((p) => p[0] >= tMin).forEach((p, i) => (i ? ctx.lineTo(x(p[0]), y(p[1])) : ctx.moveTo(x(p[0]), y(p[1]))));
  ctx.stroke();
  const lastV = points[points.length - 1][1];
  ctx.fillStyle = color; ctx.fillText(lastV.toFixed(1) + unit, right - 40, top + 10);
}

// ---- counters, tiers, eviction ------------------------------------------------------------------
function kvTable(rows) {
  return rows.map(([k, v]) => { const tr = el("tr"); tr.append(el("td", {}, k), el("td", {}, v)); return tr; });
}

function renderCounters(snap) {
  const c = snap.counters, a = snap.analyzer;
  $("counters").replaceChildren(...kvTable([
    ["KV usage", pct(c.kv_usage)],
    ["prefix hit rate (all time)", `${pct(c.prefix_hit_rate)} of ${fmtNum(c.prefix_queries)} tokens`],
    ["preemptions (recompute / swap)", `${c.num_recompute_preemptions} / ${c.num_swap_preemptions}`],
    ["copy-on-write copies", fmtNum(c.cow_copies)],
    ["cached blocks reused for new data", fmtNum(c.cache_evictions)],
    ["tokens: prompt computed / generated", `${fmtNum(c.prompt_tokens_computed)} / ${fmtNum(c.generation_tokens)}`],
    ["requests finished", fmtNum(c.requests_finished)],
    ["K/V rows computed", fmtNum(a.kv_rows_computed)],
    ["K/V rows a no-cache engine computes", fmtNum(a.kv_rows_no_cache)],
    ["K/V work the cache avoided", pct(a.saving)],
    ...specRows(c),
  ]));
}

function specRows(c) {
  if (c.spec_decode_num_draft_tokens === undefined) return [];
  const drafted = c.spec_decode_num_draft_tokens, accepted = c.spec_decode_num_accepted_tokens;
  return [["speculation: proposed tokens accepted", `${fmtNum(accepted)} of ${fmtNum(drafted)}` +
           (drafted ? ` (${pct(accepted / drafted)})` : "")]];
}

function renderTiers(c) {
  const box = $("tiers");
  const rows = [
    ["swap space", c.swap_space_bytes ? `${fmtBytes(c.swap_usage_bytes)} of ${fmtBytes(c.swap_space_bytes)}` : "off"],
    ["swapped out / in (blocks)", `${fmtNum(c.num_swapped_out_blocks)} / ${fmtNum(c.num_swapped_in_blocks)}`],
    ["requests swapped now", fmtNum(c.num_requests_swapped)],
  ];
  for (const [src, n] of Object.entries(c.prefix_cache_hits_by_source || {})) rows.push([`prefix hits from ${src} (tokens)`, fmtNum(n)]);
  const t = el("table", { class: "kv" });
  t.replaceChildren(...kvTable(rows));
  const parts = [t];
  const tiers = Object.entries(c.kv_tiers || {});
  if (tiers.length) {
    const tt = el("table", { class: "tiers" });
    const head = el("tr");
    ["tier", "policy", "hits", "misses", "read", "written", "holds", "queued"].forEach((h) => head.append(el("th", {}, h)));
    tt.append(head);
    for (const [name, s] of tiers) {
      const tr = el("tr");
      [name, s.write_policy, fmtNum(s.hits), fmtNum(s.misses), fmtBytes(s.bytes_read), fmtBytes(s.bytes_written),
        s.usage_bytes == null ? "—" : fmtBytes(s.usage_bytes), fmtNum(s.pending_writes)].forEach((v) => tr.append(el("td", {}, v)));
      tt.append(tr);
    }
    parts.push(tt);
  } else parts.push(el("p", { class: "dim" }, "no KV tiers (--kv-tiers)"));
  box.replaceChildren(...parts);
}

function renderEviction(requests) {
  const box = $("eviction");
  const c = current.counters;
  const head = el("p", { class: "dim" },
    `evicted tokens ${fmtNum(c.kv_evicted_tokens || 0)} · evictions ${fmtNum(c.kv_evictions || 0)} · blocks freed ${fmtNum(c.kv_eviction_blocks_freed || 0)}`);
  const evicting = requests.filter((r) => r.kept_positions);
  if (!evicting.length) {
    box.replaceChildren(head, el("p", { class: "dim" }, current.kv.policy ? "no request is evicting now" : "no kv_policy: every token is kept"));
    return;
  }
  const parts = [head];
  evicting.slice(0, 16).forEach((r) => {
    const kept = r.kept_positions.reduce((n, [a, b]) => n + b - a, 0);
    parts.push(el("div", {}, `${r.id} · ${r.policy} · keeps ${kept} of ${r.computed_tokens} positions`));
    const cv = el("canvas", { class: "strip", width: "400", height: "10" });
    parts.push(cv);
    drawStrip(cv, r.kept_positions, Math.max(1, r.computed_tokens));
  });
  box.replaceChildren(...parts);
}

function drawStrip(canvas, ranges, total) {
  const ctx = canvas.getContext("2d");
  ctx.fillStyle = "#2a333d"; ctx.fillRect(0, 0, canvas.width, canvas.height);
  ctx.fillStyle = "#3fa34d";
  for (const [a, b] of ranges) ctx.fillRect(canvas.width * a / total, 0, Math.max(1, canvas.width * (b - a) / total), canvas.height);
}

// ---- wiring -----------------------------------------------------------------------------------
function wire() {
  $("blockmap").addEventListener("mouseover", (e) => {
    const b = e.target.dataset && e.target.dataset.block;
    if (b !== undefined) highlightBlock(Number(b));
  });
  $("requests").addEventListener("mouseover", (e) => {
    const b = e.target.dataset && e.target.dataset.block;
    if (b !== undefined) highlightBlock(Number(b));
  });
  $("login-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY_STORE, $("login-key").value);
    $("login-key").value = "";
    startLive();
  });
  $("replay-file").addEventListener("change", (e) => { if (e.target.files[0]) loadRecording(e.target.files[0]); });
  $("replay-slider").addEventListener("input", (e) => { stopPlay(); showFrame(Number(e.target.value)); });
  $("replay-prev").addEventListener("click", () => { stopPlay(); showFrame(Number($("replay-slider").value) - 1); });
  $("replay-next").addEventListener("click", () => { stopPlay(); showFrame(Number($("replay-slider").value) + 1); });
  $("replay-play").addEventListener("click", togglePlay);
  $("live").addEventListener("click", () => { samples = []; startLive(); });
}

dropKeyFromUrl();
wire();
startLive();
