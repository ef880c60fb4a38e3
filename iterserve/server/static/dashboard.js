// iterserve's live scheduler dashboard: reads GET /v1/scheduler/stream (server-sent events) with
// fetch(), because EventSource cannot send the Authorization header an API key needs, and draws
// each tick on plain canvases. No library, nothing fetched from elsewhere. One panel per engine: the
// single server's stream is one engine's; the Ray ingress's labels each replica's part of a message
// (`replicas: [{replica, ...}]`) and lists the replicas now reporting (`live`).
"use strict";

const WINDOW_S = 60;  // charts show the last minute
const KEY_STORE = "iterserve-api-key";
const COLORS = {prefill: "#e8710a", decode: "#1a73e8", padding: "#c5221f", max: "#202124", limit: "#5f6368",
                a: "#1a73e8", b: "#8ab4f8", c: "#e8710a", d: "#fbbc04", free: "#e8eaed", cached: "#81c995",
                shared: "#202124", grid: "#e8eaed", text: "#5f6368"};

// What the page has received and drawn; the browser tests read it (window.iterserveDashboard).
// engines: one entry per panel, keyed by replica id ("" for the single server's engine).
const state = {status: "connecting", message: "", startId: null, restarts: 0, connections: 0, ticks: 0,
               engines: {}};
window.iterserveDashboard = state;

const engines = new Map();  // key -> {el, st (its entry in state.engines), series, config, owners}
let latencyWindowS = 60;
let retryDelay = 0;
let drawPending = false;

const $ = (id) => document.getElementById(id);

// ---- the API key -----------------------------------------------------------------------------
(function keyFromFragment() {  // dashboard#key=...: the fragment never reaches the server or its logs
  const m = location.hash.match(/(?:^#|&)key=([^&]*)/);
  if (m) {
    sessionStorage.setItem(KEY_STORE, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname + location.search);
  }
})();

$("auth-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  sessionStorage.setItem(KEY_STORE, $("auth-key").value.trim());
  $("auth-key").value = "";
  $("auth").hidden = true;
  retryDelay = 0;
  connect();
});

function setStatus(status, message = "") {
  state.status = status;
  state.message = message;
  const el = $("status");
  el.className = "status " + status;
  el.textContent = {live: "live", connecting: "connecting…", reconnecting: "reconnecting…",
                    auth: "API key needed", error: "error"}[status] || status;
  el.title = message;
}

function askForKey(message) {
  setStatus("auth", message);
  $("auth-message").textContent = message;
  $("auth").hidden = false;
  $("auth-key").focus();
}

// ---- the stream ------------------------------------------------------------------------------
async function connect() {
  const key = sessionStorage.getItem(KEY_STORE) || "";
  const headers = {Accept: "text/event-stream"};
  if (key) headers.Authorization = "Bearer " + key;
  const ctrl = new AbortController();
  let resp;
  try {
    resp = await fetch("v1/scheduler/stream", {headers, cache: "no-store", signal: ctrl.signal});
  } catch (e) {
    return retry("the server does not answer");
  }
  if (resp.status === 401) {
    const body = await resp.json().catch(() => ({}));
    const detail = body.error && body.error.message ? ` (${body.error.message})` : "";
    return askForKey(key ? `The server refused this API key${detail}. Enter the right one.`
                         : `This server needs an API key${detail}. Enter it to see the dashboard.`);
  }
  if (!resp.ok) return retry(`the stream answered HTTP ${resp.status}`);
  state.connections += 1;
  let lastData = Date.now();
  const watchdog = setInterval(() => {  // a stream silent for long is dead (e.g. a half-open socket)
    if (Date.now() - lastData > 5000) ctrl.abort();
  }, 1000);
  const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  try {
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      lastData = Date.now();
      buf += value;
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        onEvent(buf.slice(0, i));
        buf = buf.slice(i + 2);
      }
    }
  } catch (e) { /* aborted or cut: reconnect below */ }
  clearInterval(watchdog);
  retry("the stream ended (server restarting?)");
}

function retry(why) {
  setStatus("reconnecting", why);
  retryDelay = Math.min(5000, retryDelay ? retryDelay * 2 : 500);
  setTimeout(connect, retryDelay);
}

function onEvent(text) {
  let event = "message", data = "";
  for (const line of text.split("\n")) {
    if (line.startsWith("event:")) event = line.slice(6).trim();
    else if (line.startsWith("data:")) data += line.slice(5).trim();
  }
  if (!data) return;
  const msg = JSON.parse(data);
  if (event === "hello") onHello(msg);
  else if (event === "tick") onTick(msg);
}

function onHello(h) {
  if (state.startId !== null && h.start_id !== state.startId) {  // a new server process: start afresh
    state.restarts += 1;
    for (const key of [...engines.keys()]) dropEngine(key);
  }
  state.startId = h.start_id;
  retryDelay = 0;
  latencyWindowS = h.latency_window_s;
  const parts = h.replicas || [h];  // the single server's hello is its one engine's
  for (const p of parts) {
    const e = engineFor(p.replica);
    e.st.lastStep = null;  // the steps of this connection start at its first tick
    if (p.config) setConfig(e, p.config);
    if (p.blocks) applyBlocks(e, p.blocks);
  }
  if (h.replicas) keepOnly(h.replicas.map((p) => p.replica));
  setStatus("live");
  scheduleDraw();
}

function onTick(t) {
  state.ticks += 1;
  for (const p of t.replicas || [t]) onEngineTick(engineFor(p.replica), p);
  if (t.live) keepOnly(t.live);
  scheduleDraw();
}

function onEngineTick(e, t) {
  const st = e.st;
  st.ticks += 1;
  if (t.config) setConfig(e, t.config);
  if (t.steps) {
    // the steps of a tick are contiguous, and each tick starts where the last one ended
    if (st.lastStep !== null && t.first_step !== st.lastStep + 1) st.gaps += 1;
    if (t.last_step - t.first_step + 1 !== t.steps) st.gaps += 1;
    st.lastStep = t.last_step;
    st.steps += t.steps;
  }
  e.series.push(t);
  while (e.series.length && e.series[0].t < t.t - WINDOW_S) e.series.shift();
  if (t.blocks) applyBlocks(e, t.blocks);
}

// ---- one panel per engine --------------------------------------------------------------------
function engineFor(replica) {
  const key = replica || "";
  let e = engines.get(key);
  if (e) return e;
  const el = $("engine-template").content.firstElementChild.cloneNode(true);
  el.dataset.replica = key;
  if (key) {
    el.querySelector(".engine-title").hidden = false;
    el.querySelector(".engine-id").textContent = key;
  }
  $("engines").appendChild(el);
  const st = {ticks: 0, steps: 0, gaps: 0, lastStep: null, redraws: {}, blockUpdates: 0,
              blocks: {total: 0, held: 0, cached: 0, shared: 0, free: 0}};
  state.engines[key] = st;
  e = {el, st, series: [], config: null, owners: null};
  engines.set(key, e);
  $("engines").classList.toggle("multi", engines.size > 1);
  return e;
}

function dropEngine(key) {
  engines.get(key).el.remove();
  engines.delete(key);
  delete state.engines[key];
  $("engines").classList.toggle("multi", engines.size > 1);
}

function keepOnly(replicas) {  // a replica that stopped reporting (e.g. restarted under a new id)
  const live = new Set(replicas.map((r) => r || ""));
  for (const key of [...engines.keys()]) if (!live.has(key)) dropEngine(key);
}

const q = (e, cls) => e.el.querySelector("." + cls);

// ---- block map -------------------------------------------------------------------------------
function applyBlocks(e, b) {
  const owners = new Int32Array(b.total).fill(-1);  // -1 free, -2 cached, -3 shared, k >= 0 the request's number
  for (const id of b.cached) owners[id] = -2;
  let shared = 0;
  for (const [k, ids] of b.held) {
    for (const id of ids) {
      if (owners[id] >= 0 && owners[id] !== k) { owners[id] = -3; shared += 1; }
      else if (owners[id] !== -3) owners[id] = k;
    }
  }
  let held = 0, cached = 0;
  for (const o of owners) { if (o >= 0 || o === -3) held += 1; else if (o === -2) cached += 1; }
  e.owners = owners;
  e.st.blocks = {total: b.total, held, cached, shared, free: b.total - held - cached, requests: b.held.length};
  e.st.blockUpdates += 1;
  q(e, "blocks-summary").textContent =
    `${held} held by ${b.held.length} request(s) · ${cached} cached · ${b.total - held - cached} free of ${b.total}`;
}

function drawBlockMap(e) {
  const {ctx, w, h} = canvas2d(q(e, "block-map"));
  const owners = e.owners;
  if (!owners) return;
  const n = owners.length;
  let size = Math.max(1, Math.floor(Math.sqrt((w * h) / n)));
  while (size > 1 && Math.floor(w / size) * Math.floor(h / size) < n) size -= 1;
  const cols = Math.max(1, Math.floor(w / size));
  const gap = size >= 5 ? 1 : 0;
  for (let i = 0; i < n; i++) {
    const o = owners[i];
    ctx.fillStyle = o === -1 ? COLORS.free : o === -2 ? COLORS.cached : o === -3 ? COLORS.shared
                  : `hsl(${(o * 137.508) % 360}, 65%, 48%)`;
    ctx.fillRect((i % cols) * size, Math.floor(i / cols) * size, size - gap, size - gap);
  }
  e.st.redraws["block-map"] = (e.st.redraws["block-map"] || 0) + 1;
}

// ---- charts ----------------------------------------------------------------------------------
function canvas2d(c) {
  const dpr = window.devicePixelRatio || 1;
  const w = c.clientWidth, h = c.clientHeight;
  if (c.width !== Math.round(w * dpr) || c.height !== Math.round(h * dpr)) {
    c.width = Math.round(w * dpr);
    c.height = Math.round(h * dpr);
  }
  const ctx = c.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  return {ctx, w, h};
}

function fmt(v) {
  if (v === null || v === undefined || Number.isNaN(v)) return "–";
  const a = Math.abs(v);
  if (a >= 1000) return (v / 1000).toFixed(a >= 10000 ? 0 : 1) + "k";
  if (a >= 10 || v === Math.round(v)) return String(Math.round(v));
  return a >= 1 ? v.toFixed(1) : v.toFixed(2);
}

// spec: {bars: [{color, value(t)}] stacked, lines: [{color, value(t), dash}], hlines: [{color, y, dash}],
//        ymax (fixed) or ymin (at least), percent}
function plot(e, name, spec) {
  const {ctx, w, h} = canvas2d(q(e, name));
  const series = e.series;
  const L = 36, R = 6, T = 6, B = 16, pw = w - L - R, ph = h - T - B;
  const tEnd = series.length ? series[series.length - 1].t : WINDOW_S, t0 = tEnd - WINDOW_S;
  const x = (t) => L + ((t - t0) / WINDOW_S) * pw;
  let ymax = spec.ymax;
  if (ymax === undefined) {
    ymax = spec.ymin || 0;
    for (const t of series) {
      let stack = 0;
      for (const b of spec.bars || []) stack += b.value(t) || 0;
      ymax = Math.max(ymax, stack);
      for (const l of spec.lines || []) { const v = l.value(t); if (v !== null && v !== undefined) ymax = Math.max(ymax, v); }
    }
    for (const hl of spec.hlines || []) ymax = Math.max(ymax, hl.y);
    ymax = ymax > 0 ? ymax * 1.1 : 1;
  }
  const y = (v) => T + ph - (Math.min(v, ymax) / ymax) * ph;
  ctx.font = "10px system-ui, sans-serif";
  ctx.fillStyle = COLORS.text;
  ctx.strokeStyle = COLORS.grid;
  ctx.lineWidth = 1;
  for (const f of [0, 0.5, 1]) {
    const yy = Math.round(y(ymax * f)) + 0.5;
    ctx.beginPath(); ctx.moveTo(L, yy); ctx.lineTo(L + pw, yy); ctx.stroke();
    ctx.textAlign = "right";
    ctx.fillText(spec.percent ? Math.round(f * ymax * 100) + "%" : fmt(ymax * f), L - 4, yy + 3);
  }
  for (const s of [60, 45, 30, 15, 0]) {
    ctx.textAlign = s === 60 ? "left" : s ? "center" : "right";
    ctx.fillText(s ? `-${s}s` : "now", x(tEnd - s), h - 3);
  }
  for (const t of series) {  // stacked bars, one per tick, as wide as the tick
    const x1 = x(t.t), x0 = Math.min(x1 - 1, x(t.t - t.dt));
    let base = 0;
    for (const b of spec.bars || []) {
      const v = b.value(t) || 0;
      if (v > 0) {
        ctx.fillStyle = b.color;
        ctx.fillRect(x0, y(base + v), Math.max(1, x1 - x0), y(base) - y(base + v));
      }
      base += v;
    }
  }
  for (const hl of spec.hlines || []) {
    ctx.strokeStyle = hl.color; ctx.setLineDash(hl.dash ? [4, 3] : []);
    ctx.beginPath(); ctx.moveTo(L, y(hl.y)); ctx.lineTo(L + pw, y(hl.y)); ctx.stroke();
  }
  ctx.lineWidth = 1.5;
  for (const l of spec.lines || []) {
    ctx.strokeStyle = l.color; ctx.setLineDash(l.dash ? [4, 3] : []);
    ctx.beginPath();
    let pen = false;
    for (const t of series) {
      const v = l.value(t);
      if (v === null || v === undefined) { pen = false; continue; }
      if (pen) ctx.lineTo(x(t.t), y(v)); else ctx.moveTo(x(t.t), y(v));
      pen = true;
    }
    ctx.stroke();
  }
  ctx.setLineDash([]);
  e.st.redraws[name] = (e.st.redraws[name] || 0) + 1;
}

const perStep = (key) => (t) => (t.steps ? t[key] / t.steps : 0);
const perSecond = (key) => (t) => (t.dt > 0 ? (t[key] || 0) / t.dt : null);
const lat = (key) => (t) => t.latency[key];

function stepsPerSecond(series) {  // over the last 5 s
  const last = series[series.length - 1];
  const recent = series.filter((t) => t.t > last.t - 5);
  const span = recent.reduce((s, t) => s + t.dt, 0);
  return span > 0 ? recent.reduce((s, t) => s + t.steps, 0) / span : null;
}

function draw() {
  drawPending = false;
  const totals = {step: 0, running: 0, waiting: 0, stepsPerS: 0, any: false};
  for (const e of engines.values()) {
    drawEngine(e);
    const last = e.series[e.series.length - 1];
    if (!last) continue;
    totals.any = true;
    totals.step += last.step;
    totals.running += last.running;
    totals.waiting += last.waiting;
    totals.stepsPerS += stepsPerSecond(e.series) || 0;
  }
  $("stat-replicas-wrap").hidden = engines.size < 2;
  $("stat-replicas").textContent = engines.size;
  if (totals.any) {  // one engine: its own figures; several: their sums
    $("stat-step").textContent = totals.step;
    $("stat-running").textContent = totals.running;
    $("stat-waiting").textContent = totals.waiting;
    $("stat-steps-per-s").textContent = fmt(totals.stepsPerS);
  }
}

function drawEngine(e) {
  const last = e.series[e.series.length - 1];
  const config = e.config;
  const limit = config ? config.step_limit : 0;
  q(e, "limit-value").textContent = config ? `${limit} (${config.batching})` : "";
  q(e, "latency-window").textContent = `${Math.round(latencyWindowS)} s`;
  plot(e, "chart-batch", {
    bars: [{color: COLORS.prefill, value: perStep("seqs_prefill")}, {color: COLORS.decode, value: perStep("seqs_decode")},
           {color: COLORS.padding, value: perStep("seqs_padding")}],
    lines: [{color: COLORS.max, value: (t) => (t.steps ? t.batch_max : null)}],
    hlines: [{color: COLORS.limit, y: limit, dash: true}], ymin: limit});
  plot(e, "chart-queue", {lines: [{color: COLORS.a, value: (t) => t.waiting}, {color: COLORS.b, value: (t) => t.steps ? t.waiting_max : null}],
                          ymin: 1});
  plot(e, "chart-busy", {lines: [{color: COLORS.a, value: (t) => (t.dt > 0 ? Math.min(1, (t.busy_s || 0) / t.dt) : null)},
                                 {color: COLORS.b, value: (t) => t.busy_fraction}], ymax: 1, percent: true});
  plot(e, "chart-kv", {lines: [{color: COLORS.a, value: (t) => (t.kv_total ? t.kv_used / t.kv_total : 0)}], ymax: 1, percent: true});
  plot(e, "chart-throughput", {lines: [{color: COLORS.prefill, value: perSecond("prefill_tokens")},
                                       {color: COLORS.decode, value: perSecond("decode_tokens")}]});
  plot(e, "chart-latency", {lines: [{color: COLORS.a, value: lat("ttft_p50")}, {color: COLORS.b, value: lat("ttft_p95")},
                                    {color: COLORS.c, value: lat("e2e_p50")}, {color: COLORS.d, value: lat("e2e_p95")}]});
  drawBlockMap(e);
  if (last) {
    q(e, "engine-stats").textContent =
      `· step ${last.step} · ${fmt(stepsPerSecond(e.series))} steps/s · running ${last.running} · waiting ${last.waiting}`;
    q(e, "queue-p50").textContent = fmtS(last.latency.queue_p50);
    q(e, "queue-p95").textContent = fmtS(last.latency.queue_p95);
    q(e, "busy-now").textContent = Math.round(last.busy_fraction * 100) + "%";
    q(e, "kv-now").textContent = `${last.kv_used} / ${last.kv_total} blocks, ${last.kv_tokens} tokens`;
  }
  drawSpec(e);
}

// Speculative decoding over the ticks kept (the charts' window): shown once anything drafted, so a
// server that never speculates keeps its page as it was.
function drawSpec(e) {
  let rows = 0, drafted = 0, accepted = 0;
  for (const t of e.series) {
    rows += t.spec_drafts || 0;
    drafted += t.spec_draft_tokens || 0;
    accepted += t.spec_accepted_tokens || 0;
  }
  const line = q(e, "spec");
  line.hidden = drafted === 0;
  if (!drafted) return;
  q(e, "spec-drafted").textContent = drafted;
  q(e, "spec-accepted").textContent = accepted;
  q(e, "spec-rate").textContent = Math.round(100 * accepted / drafted) + "%";
  q(e, "spec-length").textContent = (1 + accepted / rows).toFixed(2);
}

function fmtS(v) { return v === null || v === undefined ? "–" : v < 1 ? `${Math.round(v * 1000)} ms` : `${v.toFixed(2)} s`; }

function scheduleDraw() {
  if (drawPending) return;
  drawPending = true;
  requestAnimationFrame(draw);  // a hidden tab draws nothing until it is shown again
}
window.addEventListener("resize", scheduleDraw);

// ---- configuration ---------------------------------------------------------------------------
const MAIN_KEYS = ["served_model_name", "batching", "step_limit", "max_num_seqs", "max_batch_size", "batch_timeout_ms",
                   "max_num_batched_tokens", "block_size", "num_kv_blocks", "max_model_len", "device",
                   "dtype", "decode_attention", "bf16_gemm", "cpu_kernels", "quantization", "compile",
                   "scheduling_policy"];

function setConfig(e, cfg) {
  e.config = cfg;
  const rows = (keys) => keys.filter((k) => k in cfg).map((k) => {
    const tr = document.createElement("tr");
    for (const text of [k, JSON.stringify(cfg[k])]) {
      const td = document.createElement("td");
      td.textContent = text;
      tr.appendChild(td);
    }
    return tr;
  });
  const main = MAIN_KEYS.filter((k) => cfg.batching === "static" ? k !== "max_num_seqs" : !["max_batch_size", "batch_timeout_ms"].includes(k));
  q(e, "config").replaceChildren(...rows(main));
  q(e, "config-all").replaceChildren(...rows(Object.keys(cfg).sort()));
  $("model").textContent = cfg.served_model_name;
  document.title = `iterserve · ${cfg.served_model_name}`;
}

connect();
