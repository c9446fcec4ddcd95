// The DSpark round view (gateway/round_view.py, docs/round-view.md).
// Reads /ui/events (server-sent events, read with fetch so that it can send the API key), keeps
// per-request and per-round state from the round messages, and draws it: request cards, the
// rounds table, the SPS(B) chart with Algorithm 1's Θ, running charts. Plain JS, no libraries.
"use strict";

const MAX_CARDS = 16;      // request cards kept (finished ones go first)
const MAX_ROWS = 30;       // rows of the rounds table
const HISTORY = 200;       // rounds the running charts remember
const SPEED_WINDOW_S = 2;  // tokens/s over this many recent seconds

const $ = (id) => document.getElementById(id);
const state = {
  model: null,
  key: sessionStorage.getItem("dspark-api-key") || "",
  policy: null,
  profiles: new Map(),   // SPS profile key -> {batch_sizes, step_seconds}
  sources: new Map(),    // source -> {lastRound, missed, seenAt}
  requests: new Map(),   // request id -> the request's state and its card
  rounds: [],            // round summaries, oldest first (at most HISTORY)
  lastRound: null,       // the newest round message
  lastScheduled: null,   // the newest round message with Algorithm 1's trace
  mine: new Set(),       // request ids sent from this page
  decodeRounds: 0,       // Σ over rounds of decoding requests (for the running τ)
  decodeEmitted: 0,
  dirty: false,
};

// ---- the event stream -------------------------------------------------------------------------

function authHeaders() {
  return state.key ? { Authorization: `Bearer ${state.key}` } : {};
}

async function* sseData(response) {
  // The `data:` payloads of an SSE body, as they arrive.
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
      if (data) yield data;
    }
  }
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
let keyGiven = null;  // resolves when the key form is submitted

function setStatus(kind, text) {
  const el = $("status");
  el.dataset.state = kind;
  el.textContent = text || kind;
}

async function follow() {
  let delay = 500;
  for (;;) {
    let response;
    try {
      response = await fetch("/ui/events", { headers: authHeaders(), cache: "no-store" });
    } catch (e) {
      setStatus("reconnecting", "server unreachable: reconnecting");
      await sleep(delay);
      delay = Math.min(delay * 2, 4000);
      continue;
    }
    if (response.status === 401) {
      setStatus("auth", state.key ? "wrong API key" : "API key needed");
      showKeyForm();
      await new Promise((resolve) => { keyGiven = resolve; });
      continue;
    }
    if (!response.ok) {
      setStatus("reconnecting", `HTTP ${response.status}: reconnecting`);
      await sleep(delay);
      delay = Math.min(delay * 2, 4000);
      continue;
    }
    delay = 500;
    setStatus("live", "live");
    state.sources.clear();  // the schedulers relaying to this connection announce themselves on it
    try {
      for await (const data of sseData(response)) onMessage(JSON.parse(data));
    } catch (e) {
      // the server went away mid-stream
    }
    setStatus("reconnecting", "stream ended: reconnecting");
    await sleep(delay);
  }
}

function onMessage(m) {
  switch (m.type) {
    case "hello": state.model = m.model; $("model").textContent = m.model; break;
    case "sps": state.profiles.set(m.key, m); break;
    case "source": source(m.source); break;
    case "round": onRound(m); break;
    case "dropped": setStatus("reconnecting", "too slow: dropped, reconnecting"); break;
  }
  markDirty();
}

function source(name) {
  let s = state.sources.get(name);
  if (!s) state.sources.set(name, (s = { lastRound: null, missed: 0, seenAt: 0 }));
  s.seenAt = performance.now();
  return s;
}

// ---- rounds ---------------------------------------------------------------------------------

function kindOf(r, i) {
  // What the i-th emitted token of a request's round was.
  if (r.prefill) return "prefill";
  if (i < r.accepted) return "accepted";
  return r.accepted < r.admitted ? "corrected" : "bonus";
}

function onRound(m) {
  const src = source(m.source || "");
  if (src.lastRound !== null && m.round_id > src.lastRound + 1) src.missed += m.round_id - src.lastRound - 1;
  src.lastRound = m.round_id;
  state.policy = m.policy;
  let decoding = 0, sumEll = 0, accepted = 0, emitted = 0, emittedDecode = 0;
  for (const r of m.requests) {
    const q = state.requests.get(r.request_id) || newRequest(r.request_id, m);
    if (r.joined && !q.gapShown) {
      q.transcript.append(Object.assign(document.createElement("span"), { className: "gap", textContent: "…" }));
      q.gapShown = true;
    }
    r.emitted.forEach((_, i) => {
      const span = document.createElement("span");
      span.className = "tok";
      span.dataset.kind = kindOf(r, i);
      span.textContent = r.emitted_text[i];
      q.transcript.append(span);
    });
    q.transcript.scrollTop = q.transcript.scrollHeight;
    q.tokens += r.emitted.length;
    if (!r.prefill) {
      q.rounds += 1; q.verified += r.admitted; q.accepted += r.accepted; q.emittedInRounds += r.emitted.length;
      decoding += 1; sumEll += r.admitted; accepted += r.accepted; emittedDecode += r.emitted.length;
    }
    emitted += r.emitted.length;
    q.last = r;
    q.lastSchedule = m.schedule;
    q.lastRoundId = m.round_id;
    q.lastTime = m.time;
    if (r.finish_reason) q.finish = r.finish_reason;
    q.dirty = true;
  }
  state.decodeRounds += decoding;
  state.decodeEmitted += emittedDecode;
  const summary = {
    id: m.round_id, source: m.source || "", time: m.time, R: m.requests.length, B: m.batch_tokens, decoding, sumEll,
    accepted, emitted, emittedDecode, running: m.running, theta: m.schedule ? m.schedule.thetas[m.schedule.admitted] : null,
    stop: stopText(m), draftMs: m.draft_s * 1000,
    verifyMs: m.verify_s * 1000, scheduleMs: m.schedule_s * 1000,
  };
  state.rounds.push(summary);
  if (state.rounds.length > HISTORY) state.rounds.shift();
  addRoundRow(summary);
  state.lastRound = m;
  if (m.schedule && m.requests.some((r) => r.drafted.length)) state.lastScheduled = m;  // a round with drafts to schedule
}

function stopText(m) {
  // Why Algorithm 1 stopped admitting; what the draft gate did when it skipped the drafter's model.
  const stop = m.schedule ? m.schedule.stop : "–";
  if (m.drafting) return stop;
  return m.requests.some((r) => r.drafted.length) ? `${stop} (gate: lookups only)` : "gate: no drafts";
}

function newRequest(id, m) {
  const card = document.createElement("div");
  card.className = "card";
  card.dataset.requestId = id;
  card.innerHTML = `<div class="card-head"><span class="rid"></span><span class="badge" hidden>yours</span>
    <span class="stat">state <b data-stat="state">running</b></span>
    <span class="stat">rounds <b data-stat="rounds">0</b></span>
    <span class="stat">drafts verified <b data-stat="verified">0</b></span>
    <span class="stat">accepted <b data-stat="accepted">0</b></span>
    <span class="stat">τ <b data-stat="tau">–</b></span>
    <span class="stat">tokens <b data-stat="tokens">0</b></span>
    <span class="stat">tok/s <b data-stat="speed">–</b></span></div>
    <div class="transcript"></div><div class="last-round"></div>`;
  card.querySelector(".rid").textContent = id.length > 22 ? id.slice(0, 12) + "…" + id.slice(-6) : id;
  card.querySelector(".rid").title = id;
  const q = {
    id, source: m.source || "", card, transcript: card.querySelector(".transcript"), lastRow: card.querySelector(".last-round"),
    firstTime: m.time, lastTime: m.time, rounds: 0, verified: 0, accepted: 0, emittedInRounds: 0, tokens: 0,
    finish: null, last: null, lastSchedule: null, lastRoundId: null, gapShown: false, dirty: true,
  };
  state.requests.set(id, q);
  $("requests").prepend(card);
  pruneCards();
  return q;
}

function pruneCards() {
  if (state.requests.size <= MAX_CARDS) return;
  const all = [...state.requests.values()];
  const victim = all.find((q) => q.finish && !state.mine.has(q.id)) || all.find((q) => q.finish) ||
    all.find((q) => !state.mine.has(q.id)) || all[0];
  victim.card.remove();
  state.requests.delete(victim.id);
}

function addRoundRow(s) {
  const tbody = $("rounds").tBodies[0];
  const tr = document.createElement("tr");
  tr.dataset.round = s.id;
  tr.dataset.source = s.source;
  const cells = [s.id, s.source, s.R, s.B, s.sumEll, s.accepted, s.emitted, s.theta === null ? "–" : s.theta.toFixed(1),
    s.stop, s.draftMs.toFixed(1), s.verifyMs.toFixed(1)];
  const names = ["round", "source", "R", "B", "ell", "accepted", "emitted", "theta", "stop", "draft", "verify"];
  cells.forEach((v, i) => {
    const td = document.createElement("td");
    td.textContent = v;
    td.dataset.col = names[i];
    tr.append(td);
  });
  tbody.prepend(tr);
  while (tbody.rows.length > MAX_ROWS) tbody.deleteRow(-1);
}

// ---- drawing ----------------------------------------------------------------------------------

function markDirty() {
  if (state.dirty) return;
  state.dirty = true;
  requestAnimationFrame(() => { state.dirty = false; render(); });
}

function confidenceColor(c) {
  return `hsl(${Math.round(120 * Math.max(0, Math.min(1, c)))}, 75%, 86%)`;
}

function renderCard(q) {
  const stat = (name, value) => { q.card.querySelector(`[data-stat="${name}"]`).textContent = value; };
  stat("state", q.finish ? `finished (${q.finish})` : "running");
  stat("rounds", q.rounds);
  stat("verified", q.verified);
  stat("accepted", q.accepted);
  stat("tau", q.rounds ? (q.emittedInRounds / q.rounds).toFixed(3) : "–");
  stat("tokens", q.tokens);
  const seconds = q.lastTime - q.firstTime;
  stat("speed", seconds > 0 ? ((q.tokens - 1) / seconds).toFixed(1) : "–");
  q.card.classList.toggle("finished", Boolean(q.finish));
  q.card.classList.toggle("mine", state.mine.has(q.id));
  q.card.querySelector(".badge").hidden = !state.mine.has(q.id);
  const r = q.last;
  const row = q.lastRow;
  row.replaceChildren();
  if (!r) return;
  const label = document.createElement("span");
  label.className = "label";
  label.textContent = `round ${q.lastRoundId}:`;
  row.append(label);
  if (r.prefill) {
    label.textContent += " prefill →";
    row.append(chip("new prefill", r.emitted_text[0] ?? ""));
    return;
  }
  const cut = q.lastSchedule && q.lastSchedule.break_request === q.id ? q.lastSchedule.break_position : null;
  r.drafted.forEach((_, j) => {
    if (j === r.admitted) row.append(Object.assign(document.createElement("span"), { className: "ell", title: `ℓ = ${r.admitted}` }));
    if (cut === j + 1) row.append(Object.assign(document.createElement("span"), { className: "cut", textContent: "✂", title: "the break: admitting this draft would not raise Θ" }));
    // accepted | the first rejected | verified but after the rejection | beyond ℓ_r: never verified
    const cls = j < r.accepted ? "accepted" : j === r.accepted && j < r.admitted ? "rejected" : j < r.admitted ? "discarded" : "beyond";
    const el = chip(`draft ${cls}`, r.drafted_text[j]);
    if (r.confidences.length) {
      el.style.background = confidenceColor(r.confidences[j]);
      el.title = `c = ${r.confidences[j].toFixed(3)}`;
    }
    row.append(el);
  });
  if (r.admitted === r.drafted.length && r.drafted.length) {
    row.append(Object.assign(document.createElement("span"), { className: "ell", title: `ℓ = ${r.admitted}` }));
  }
  if (r.emitted.length > r.accepted) {
    row.append(Object.assign(document.createElement("span"), { className: "label", textContent: " →" }));
    row.append(chip(`new ${kindOf(r, r.accepted)}`, r.emitted_text[r.accepted]));
  }
}

function chip(className, text) {
  const el = document.createElement("span");
  el.className = className;
  el.textContent = text === "" ? "·" : JSON.stringify(text).slice(1, -1);
  return el;
}

function render() {
  for (const q of state.requests.values()) {
    if (q.dirty) { renderCard(q); q.dirty = false; }
  }
  const running = [...state.requests.values()].filter((q) => !q.finish).length;
  $("request-count").textContent = `${running} running, ${state.requests.size} shown`;
  $("policy").textContent = state.policy ?? (state.lastRound ? "all drafts" : "–");
  const now = performance.now();
  $("sources").textContent = [...state.sources.entries()].map(([name, s]) =>
    `${name || "engine"}${now - s.seenAt > 15000 ? " (quiet)" : ""}${s.missed ? ` · ${s.missed} rounds missed` : ""}`).join(", ");
  drawSps();
  drawRunning();
}

// A tiny chart kit on <canvas>: axes, lines, points, bars.
function frame(canvas, { xMin, xMax, yMin, yMax, y2Max, title, xLabel }) {
  // x is a count (batch size, round, requests): its ends are labelled as integers
  const ctx = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, L = 44, R = y2Max ? 48 : 10, T = 16, B = 20;
  ctx.clearRect(0, 0, W, H);
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillStyle = "#374151";
  ctx.fillText(title, L, 11);
  const x = (v) => L + ((v - xMin) / (xMax - xMin || 1)) * (W - L - R);
  const y = (v) => H - B - ((v - yMin) / (yMax - yMin || 1)) * (H - T - B);
  const y2 = (v) => H - B - (v / (y2Max || 1)) * (H - T - B);
  ctx.strokeStyle = "#dde1e6";
  ctx.fillStyle = "#6b7480";
  for (let i = 0; i <= 4; i++) {
    const v = yMin + ((yMax - yMin) * i) / 4;
    ctx.beginPath(); ctx.moveTo(L, y(v)); ctx.lineTo(W - R, y(v)); ctx.stroke();
    ctx.fillText(fmt(v), 2, y(v) + 4);
    if (y2Max) ctx.fillText(fmt((y2Max * i) / 4), W - R + 4, y(v) + 4);
  }
  ctx.fillText(String(Math.round(xMin)), L, H - 6);
  ctx.fillText(String(Math.round(xMax)), W - R - 24, H - 6);
  if (xLabel) ctx.fillText(xLabel, (W - L - R) / 2 + L - 20, H - 6);
  return { ctx, x, y, y2, W, H, L, R, T, B };
}

function fmt(v) {
  const a = Math.abs(v);
  return a >= 1000 ? v.toFixed(0) : a >= 10 ? v.toFixed(1) : a >= 1 ? v.toFixed(2) : v.toFixed(3);
}

function line(f, points, color, width = 1.5, yOf = f.y) {
  const { ctx } = f;
  ctx.strokeStyle = color;
  ctx.lineWidth = width;
  ctx.beginPath();
  points.forEach(([px, py], i) => (i ? ctx.lineTo(f.x(px), yOf(py)) : ctx.moveTo(f.x(px), yOf(py))));
  ctx.stroke();
  ctx.lineWidth = 1;
}

function dot(f, px, py, color, r = 3, yOf = f.y) {
  f.ctx.fillStyle = color;
  f.ctx.beginPath();
  f.ctx.arc(f.x(px), yOf(py), r, 0, 2 * Math.PI);
  f.ctx.fill();
}

function legend(f, items) {
  let at = f.W - f.R - 8;
  f.ctx.font = "11px system-ui, sans-serif";
  for (const [text, color] of [...items].reverse()) {
    const w = f.ctx.measureText(text).width;
    at -= w;
    f.ctx.fillStyle = color;
    f.ctx.fillText(text, at, 11);
    at -= 14;
  }
}

function spsAt(profile, b) {
  // SPS(B), as dspark/profiling/sps.py interpolates it: linear in step time, ∝ B past the last point.
  const bs = profile.batch_sizes, ts = profile.step_seconds, n = bs.length;
  let t;
  if (b >= bs[n - 1]) t = (ts[n - 1] * b) / bs[n - 1];
  else if (b <= bs[0]) t = ts[0];
  else {
    let i = 1;
    while (bs[i] < b) i++;
    t = ts[i - 1] + ((ts[i] - ts[i - 1]) * (b - bs[i - 1])) / (bs[i] - bs[i - 1]);
  }
  return 1 / t;
}

function drawSps() {
  const canvas = $("sps-chart");
  const m = state.lastScheduled || state.lastRound;
  const profile = m && m.sps_key ? state.profiles.get(m.sps_key) : null;
  if (!profile) {
    frame(canvas, { xMin: 1, xMax: 64, yMin: 0, yMax: 1, title: "SPS(B): no profile yet" });
    return;
  }
  const s = m.schedule;
  const thetas = s ? s.thetas : [];
  const bMax = Math.max(profile.batch_sizes[profile.batch_sizes.length - 1], s ? s.base_batch + thetas.length + 2 : 0, m.batch_tokens + 2);
  const curve = [];
  for (let b = 1; b <= bMax; b += Math.max(1, Math.floor(bMax / 200))) curve.push([b, spsAt(profile, b)]);
  const spsMax = Math.max(...curve.map((p) => p[1])) * 1.05;
  const thetaMax = thetas.length ? Math.max(...thetas) * 1.15 : 0;
  const f = frame(canvas, { xMin: 1, xMax: bMax, yMin: 0, yMax: spsMax, y2Max: thetaMax || undefined,
    title: "SPS(B) steps/s (left)   Θ tok/s (right)", xLabel: "B (tokens per forward)" });
  line(f, curve, "#6b7480", 1.5);
  const B = s ? s.base_batch + s.admitted : m.batch_tokens;
  f.ctx.strokeStyle = "#2563eb";
  f.ctx.setLineDash([4, 3]);
  f.ctx.beginPath(); f.ctx.moveTo(f.x(B), f.T); f.ctx.lineTo(f.x(B), f.H - f.B); f.ctx.stroke();
  f.ctx.setLineDash([]);
  dot(f, B, spsAt(profile, B), "#2563eb", 3);
  if (s) {
    const pts = thetas.map((t, k) => [s.base_batch + k, t]);
    line(f, pts.slice(0, s.admitted + 1), "#1f8f4e", 2, f.y2);
    pts.slice(0, s.admitted + 1).forEach(([b, t]) => dot(f, b, t, "#1f8f4e", 2, f.y2));
    dot(f, B, s.thetas[s.admitted], "#1f8f4e", 5, f.y2);
    if (s.stop === "break") {
      const [bb, tb] = pts[pts.length - 1];
      line(f, pts.slice(-2), "#c81e1e", 1, f.y2);
      f.ctx.strokeStyle = "#c81e1e";
      f.ctx.lineWidth = 2;
      const X = f.x(bb), Y = f.y2(tb);
      f.ctx.beginPath(); f.ctx.moveTo(X - 4, Y - 4); f.ctx.lineTo(X + 4, Y + 4); f.ctx.moveTo(X + 4, Y - 4); f.ctx.lineTo(X - 4, Y + 4); f.ctx.stroke();
      f.ctx.lineWidth = 1;
    }
    legend(f, [["SPS(B)", "#6b7480"], ["Θ per admission", "#1f8f4e"], ["break", "#c81e1e"], ["chosen B", "#2563eb"]]);
  }
  $("sps-round").textContent = `round ${m.round_id}`;
  const why = !s ? "no Algorithm 1 trace (policy " + (m.policy ?? "all drafts") + ")"
    : s.stop === "break" ? `the break fired at draft ${s.break_position} of ${shortId(s.break_request)}: admitting it would not raise Θ`
    : s.stop === "table" ? "stopped at the end of the SPS table" : "every draft with a positive survival was admitted";
  $("sps-caption").textContent = s
    ? `B = ${B} (${s.base_batch} prefill + anchor tokens, ${s.admitted} drafts), Θ = ${s.thetas[s.admitted].toFixed(1)} tok/s expected; ${why}`
    : `B = ${B}; ${why}`;
}

function shortId(id) {
  return id && id.length > 16 ? id.slice(0, 8) + "…" + id.slice(-4) : id;
}

function drawRunning() {
  const rounds = state.rounds;
  if (!rounds.length) return;
  const x0 = rounds[0].id, x1 = Math.max(rounds[rounds.length - 1].id, x0 + 1);
  const decoded = rounds.filter((r) => r.decoding > 0);

  const tau = decoded.map((r) => [r.id, r.emittedDecode / r.decoding]);
  let sumE = 0, sumR = 0;
  const runningTau = decoded.map((r) => { sumE += r.emittedDecode; sumR += r.decoding; return [r.id, sumE / sumR]; });
  const tauMax = Math.max(2, ...tau.map((p) => p[1])) * 1.1;
  let f = frame($("tau-chart"), { xMin: x0, xMax: x1, yMin: 0, yMax: tauMax,
    title: `mean accepted length τ per round (running ${state.decodeRounds ? (state.decodeEmitted / state.decodeRounds).toFixed(2) : "–"})` });
  tau.forEach(([px, py]) => dot(f, px, py, "#93c5fd", 2));
  line(f, runningTau, "#1d4ed8", 2);
  legend(f, [["round", "#93c5fd"], ["running mean", "#1d4ed8"]]);

  // verification budget per request (ℓ + 1) against the requests in the round: a scatter, newest darkest
  const budget = decoded.map((r) => [r.decoding, (r.sumEll + r.decoding) / r.decoding]);
  const rMax = Math.max(2, ...budget.map((p) => p[0]));
  const bMax = Math.max(2, ...budget.map((p) => p[1])) * 1.1;
  f = frame($("budget-chart"), { xMin: 0, xMax: rMax, yMin: 0, yMax: bMax,
    title: "verification budget per request (ℓ+1) against decoding requests", xLabel: "requests" });
  budget.forEach(([px, py], i) => dot(f, px, py, `rgba(124, 58, 237, ${0.15 + (0.85 * (i + 1)) / budget.length})`, 3));

  // tokens/s: all requests, and per user (the mean over the requests running then)
  const speeds = rounds.map((r, i) => {
    let tokens = 0, j = i;
    while (j >= 0 && r.time - rounds[j].time <= SPEED_WINDOW_S) tokens += rounds[j--].emitted;
    const span = Math.max(r.time - rounds[Math.min(j + 1, i)].time, 1e-3);
    const aggregate = i > j + 1 ? tokens / span : 0;
    return [r.id, aggregate, r.decoding ? aggregate / Math.max(1, r.decoding) : 0];
  });
  const sMax = Math.max(1, ...speeds.map((p) => p[1])) * 1.1;
  f = frame($("speed-chart"), { xMin: x0, xMax: x1, yMin: 0, yMax: sMax, title: `tokens/s over ${SPEED_WINDOW_S} s` });
  line(f, speeds.map((p) => [p[0], p[1]]), "#059669", 2);
  line(f, speeds.map((p) => [p[0], p[2]]), "#d97706", 1.5);
  legend(f, [["aggregate", "#059669"], ["per user", "#d97706"]]);

  // drafting vs verification time per round, stacked
  const tMax = Math.max(1, ...rounds.map((r) => r.draftMs + r.verifyMs + r.scheduleMs)) * 1.1;
  f = frame($("time-chart"), { xMin: x0 - 0.5, xMax: x1 + 0.5, yMin: 0, yMax: tMax, title: "ms per round" });
  const w = Math.max(1, (f.W - f.L - f.R) / (x1 - x0 + 1) - 1);
  for (const r of rounds) {
    const X = f.x(r.id) - w / 2;
    f.ctx.fillStyle = "#2563eb";
    f.ctx.fillRect(X, f.y(r.verifyMs), w, f.y(0) - f.y(r.verifyMs));
    f.ctx.fillStyle = "#f59e0b";
    f.ctx.fillRect(X, f.y(r.verifyMs + r.draftMs), w, f.y(r.verifyMs) - f.y(r.verifyMs + r.draftMs));
  }
  legend(f, [["draft", "#f59e0b"], ["verify", "#2563eb"]]);
}

// ---- the prompt box -------------------------------------------------------------------------

async function send(event) {
  event.preventDefault();
  const button = $("send");
  button.disabled = true;
  $("answer").hidden = false;
  delete $("answer").dataset.finish;
  delete $("answer").dataset.requestId;
  $("answer-text").textContent = "";
  $("answer-id").textContent = "sending…";
  $("answer-stats").textContent = "";
  for (const k of Object.keys($("answer-stats").dataset)) delete $("answer-stats").dataset[k];
  const body = {
    model: state.model, stream: true, messages: [{ role: "user", content: $("prompt").value }],
    temperature: Number($("temperature").value), max_tokens: Number($("max-tokens").value),
  };
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: { "Content-Type": "application/json", ...authHeaders() }, body: JSON.stringify(body),
    });
    if (!response.ok) {
      const error = await response.json().catch(() => ({}));
      $("answer-id").textContent = `HTTP ${response.status}: ${error.error ? error.error.message : ""}`;
      if (response.status === 401) showKeyForm();
      return;
    }
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) { $("answer-id").textContent = `error: ${chunk.error.message}`; break; }
      if (!state.mine.has(chunk.id)) {
        state.mine.add(chunk.id);
        $("answer").dataset.requestId = chunk.id;
        $("answer-id").textContent = chunk.id;
        const q = state.requests.get(chunk.id);
        if (q) { q.dirty = true; markDirty(); }
      }
      for (const choice of chunk.choices || []) {
        if (choice.delta && choice.delta.content) $("answer-text").textContent += choice.delta.content;
        if (choice.finish_reason) $("answer").dataset.finish = choice.finish_reason;
      }
      if (chunk.speculative) {
        const s = chunk.speculative;
        Object.assign($("answer-stats").dataset, { rounds: s.rounds, draftTokens: s.draft_tokens,
          acceptedTokens: s.accepted_tokens, tau: s.mean_accepted_length });
        $("answer-stats").textContent = `API: ${s.rounds} rounds, ${s.draft_tokens} drafts verified, ` +
          `${s.accepted_tokens} accepted, τ ${s.mean_accepted_length.toFixed(3)}`;
      }
    }
  } catch (e) {
    $("answer-id").textContent = `failed: ${e}`;
  } finally {
    button.disabled = false;
  }
}

// ---- the API key ----------------------------------------------------------------------------

function showKeyForm() {
  $("key-form").hidden = false;
  $("key").focus();
}

$("key-button").addEventListener("click", () => { $("key-form").hidden = !$("key-form").hidden; });
$("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  state.key = $("key").value.trim();
  sessionStorage.setItem("dspark-api-key", state.key);
  $("key-form").hidden = true;
  if (keyGiven) { keyGiven(); keyGiven = null; }
});
$("prompt-form").addEventListener("submit", send);
setInterval(markDirty, 1000);  // "quiet" sources, even when no round arrives
follow();
