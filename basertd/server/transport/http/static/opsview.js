// The operator's page of basertd (basertd/server/transport/http/opsview.py): polls
// /v1/basertd/overview once a second, draws the charts and tables, and runs the playground over
// the daemon's own OpenAI routes. No build step, no outside resources.
"use strict";

const POLL_MS = 1000;
const HISTORY_S = 300;
const KEY_STORE = "basertd.api_key";
const $ = (id) => document.getElementById(id);

// The API key: "#key=..." in the address sets it (then leaves the address), else localStorage.
(function takeKeyFromHash() {
  const m = /(?:^#|&)key=([^&]*)/.exec(location.hash);
  if (m) {
    localStorage.setItem(KEY_STORE, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);
  }
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  $("api-key").addEventListener("change", (e) => localStorage.setItem(KEY_STORE, e.target.value));
})();

function headers(extra) {
  const h = Object.assign({}, extra || {});
  const key = localStorage.getItem(KEY_STORE);
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function getJson(path) {
  const r = await fetch(path, { headers: headers(), cache: "no-store" });
  const body = await r.json();
  if (!r.ok) throw new Error((body.error && body.error.message) || r.status + " " + r.statusText);
  return body;
}

// --- charts: one canvas each, line series over the last HISTORY_S seconds -----------------------

const charts = {};
const queueSeries = []; // a gauge: sampled by this page at each poll

function drawChart(id, series, opts) {
  const canvas = $(id);
  const ctx = canvas.getContext("2d");
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== w * dpr) { canvas.width = w * dpr; canvas.height = h * dpr; }
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, h);
  const pad = { l: 40, r: 6, t: 6, b: 16 };
  let max = opts.max || 0;
  for (const s of series) for (const v of s.data) max = Math.max(max, v);
  if (max <= 0) max = 1;
  ctx.strokeStyle = "#d9dee4"; ctx.fillStyle = "#6b7580"; ctx.font = "10px sans-serif"; ctx.lineWidth = 1;
  for (let i = 0; i <= 2; i++) {
    const y = pad.t + (h - pad.t - pad.b) * (1 - i / 2);
    ctx.beginPath(); ctx.moveTo(pad.l, y); ctx.lineTo(w - pad.r, y); ctx.stroke();
    ctx.fillText(fmt(max * i / 2), 2, y + 3);
  }
  ctx.fillText("-" + HISTORY_S + " s", pad.l, h - 3);
  ctx.fillText("now", w - pad.r - 20, h - 3);
  for (const s of series) {
    const n = s.data.length;
    if (!n) continue;
    ctx.strokeStyle = s.color; ctx.lineWidth = 1.5; ctx.beginPath();
    s.data.forEach((v, i) => {
      const x = pad.l + (w - pad.l - pad.r) * ((HISTORY_S - n + i) / (HISTORY_S - 1));
      const y = pad.t + (h - pad.t - pad.b) * (1 - v / max);
      i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
    });
    ctx.stroke();
  }
  // what the chart shows, for scripts and tests: points and the sum of the last 10 s
  const total = series.reduce((a, s) => a + s.data.slice(-10).reduce((x, y) => x + y, 0), 0);
  canvas.dataset.points = String(series.reduce((a, s) => a + s.data.length, 0));
  canvas.dataset.recent = String(total);
  charts[id] = series;
}

function fmt(v) {
  if (v >= 100) return v.toFixed(0);
  if (v >= 1) return v.toFixed(1);
  return v.toFixed(2);
}
const ms = (s) => (s < 10 ? (s * 1000).toFixed(0) + " ms" : s.toFixed(1) + " s");
const pct = (r) => (r * 100).toFixed(0) + "%";

// --- tables ---------------------------------------------------------------------------------------

function fill(tableId, rows) {
  const body = $(tableId).tBodies[0];
  body.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    for (const c of cells) { const td = document.createElement("td"); td.textContent = String(c); tr.append(td); }
    return tr;
  }));
}

function stat(label, value) {
  const d = document.createElement("div");
  d.className = "stat";
  const b = document.createElement("b"); b.textContent = value;
  const s = document.createElement("span"); s.textContent = label;
  d.append(b, s);
  return d;
}

function latency(q) { return q.count ? ms(q.p50_s) + " / " + ms(q.p95_s) : "-"; }

function render(o) {
  const busy = o.workers.reduce((a, w) => a + w.lanes_busy, 0);
  const lanesMax = o.workers.reduce((a, w) => a + w.lanes_max, 0);
  const queued = o.queue.reduce((a, q) => a + q.depth, 0);
  $("summary").textContent = `${o.version}  ${o.state}  up ${o.uptime_s.toFixed(0)} s  lanes ${busy}/${lanesMax}  ` +
    `in flight ${o.in_flight}  requests ${o.requests_total}` + (o.problems.length ? "  problems: " + o.problems.join("; ") : "");
  $("stats").replaceChildren(
    stat(`tokens/s in (last ${o.rate_window_s} s)`, fmt(o.tokens_in_per_s)),
    stat(`tokens/s out (last ${o.rate_window_s} s)`, fmt(o.tokens_out_per_s)),
    stat(`TTFT p50 / p95 (last ${o.window_s} s)`, latency(o.ttft)),
    stat(`inter-token p50 / p95`, latency(o.itl)),
    stat("queue " + o.queue.map((q) => q.qos[0]).join("/"), o.queue.map((q) => q.depth).join(" / ")),
    stat("prefix-cache hits", pct(o.cache_hit_ratio)),
    stat("KV pool reserved", pct(o.pool_usage_ratio)),
    stat("preemptions / crash resumes",
      o.workers.reduce((a, w) => a + w.preemptions, 0) + " / " + o.workers.reduce((a, w) => a + w.crash_resumes, 0)),
    stat("WAL fsync p50 / p95", latency(o.wal_fsync)),
  );
  const h = o.history;
  if (h) {
    drawChart("chart-tokens", [{ data: h.tokens_in, color: "#2b7bd6" }, { data: h.tokens_out, color: "#d9822b" }], {});
    drawChart("chart-ttft", [{ data: h.ttft_s, color: "#8e44ad" }], {});
    drawChart("chart-cache", [{ data: h.cache_hit_ratio, color: "#27ae60" }], { max: 1 });
  }
  queueSeries.push(queued);
  if (queueSeries.length > HISTORY_S) queueSeries.shift();
  drawChart("chart-queue", [{ data: queueSeries, color: "#c0392b" }], {});
  fill("workers", o.workers.map((w) => [
    w.worker_id, w.model, w.engine, w.problem ? `${w.state}: ${w.problem}` : w.state, w.pid,
    `${w.lanes_busy}/${w.lanes_max}`, w.queue_depth,
    w.kv_capacity_tokens ? pct(w.kv_reserved_tokens / w.kv_capacity_tokens) : "-",
    w.pool_blocks_total ? `${w.pool_blocks_used}/${w.pool_blocks_total}` : "-",
    w.ticks_run, w.prefill_tokens, w.decode_tokens, w.preemptions, w.crash_resumes, w.respawns,
  ]));
  fill("lanes", o.lanes.map((l) => [
    l.worker_id, l.lane_tag, l.request_id, l.qos, l.state, l.prompt_tokens, l.generated_tokens,
    l.cached_tokens, l.age_s.toFixed(1) + " s",
  ]));
}

async function poll() {
  try {
    render(await getJson(`/v1/basertd/overview?history_s=${HISTORY_S}`));
    $("error").hidden = true;
  } catch (e) {
    $("error").textContent = "overview: " + e.message;
    $("error").hidden = false;
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

// --- playground: streamed completions and chat over the OpenAI routes ------------------------------

let controller = null;

async function loadModels() {
  try {
    const list = await getJson("/v1/models");
    $("p-model").replaceChildren(...list.data.map((m) => new Option(m.id, m.id)));
  } catch (e) {
    $("p-status").textContent = "models: " + e.message;
  }
}

function number(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

function requestBody() {
  const chat = $("p-mode").value === "chat";
  const prompt = $("p-prompt").value;
  const body = {
    model: $("p-model").value || "",
    stream: true,
    max_tokens: number("p-max_tokens"),
    temperature: number("p-temperature"),
    top_p: number("p-top_p"),
    top_k: number("p-top_k"),
    min_p: number("p-min_p"),
    repetition_penalty: number("p-repetition_penalty"),
    seed: number("p-seed"),
    qos: $("p-qos").value,
  };
  const stop = $("p-stop").value.split(",").map((s) => s.trim()).filter(Boolean);
  if (stop.length) body.stop = stop;
  if (chat) body.messages = [{ role: "user", content: prompt }];
  else body.prompt = prompt;
  for (const k of Object.keys(body)) if (body[k] === undefined) delete body[k];
  return { path: chat ? "/v1/chat/completions" : "/v1/completions", body, chat };
}

async function send(ev) {
  ev.preventDefault();
  const { path, body, chat } = requestBody();
  const out = $("p-output");
  out.textContent = "";
  $("p-status").textContent = "streaming…";
  $("p-send").disabled = true;
  $("p-cancel").disabled = false;
  controller = new AbortController();
  let finish = "";
  try {
    const r = await fetch(path, {
      method: "POST", body: JSON.stringify(body), signal: controller.signal,
      headers: headers({ "Content-Type": "application/json" }),
    });
    if (!r.ok) {
      const err = await r.json().catch(() => ({}));
      throw new Error((err.error && err.error.message) || r.status + " " + r.statusText);
    }
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const chunk = JSON.parse(data);
          if (chunk.error) throw new Error(chunk.error.message);
          const choice = chunk.choices && chunk.choices[0];
          if (!choice) continue;
          out.textContent += chat ? (choice.delta.content || "") : (choice.text || "");
          out.dataset.chunks = String(Number(out.dataset.chunks || 0) + 1);
          if (choice.finish_reason) finish = choice.finish_reason;
        }
      }
    }
    $("p-status").textContent = "done" + (finish ? ": " + finish : "");
  } catch (e) {
    $("p-status").textContent = e.name === "AbortError" ? "stopped" : "error: " + e.message;
  } finally {
    $("p-send").disabled = false;
    $("p-cancel").disabled = true;
    controller = null;
  }
}

$("play").addEventListener("submit", send);
$("p-cancel").addEventListener("click", () => controller && controller.abort());
loadModels();
poll();
