// The /bench page: a form, a POST /bench stream read with fetch, and small SVG charts: each
// run's figures, or (under load) each level's against the number of clients.
// No libraries: the page must work offline, served by duet itself.
"use strict";

const COLOURS = { torch: "#e4572e", mlx: "#1f77b4", transformers: "#7a7a7a", "mlx-lm": "#6a3d9a" };
const EXTRA = ["#2ca02c", "#bcbd22", "#17becf", "#d62728"];
const SVG_NS = "http://www.w3.org/2000/svg";
const MiB = 1024 * 1024;

// Everything the page knows about the current run; the headless test reads it too.
const state = window.benchState = {
  running: false, mode: "runs", events: [], targets: [], series: {}, levels: [], clients: [],
  summary: null, error: null,
};

const $ = (id) => document.getElementById(id);

function colour(name) {
  if (COLOURS[name]) return COLOURS[name];
  const i = Object.keys(state.series).indexOf(name);
  return EXTRA[(i < 0 ? 0 : i) % EXTRA.length];
}

function setStatus(text, isError = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", isError);
}

// ------------------------------------------------------------------ the form
async function loadModels() {
  const resp = await fetch("/v1/models");
  const models = (await resp.json()).data.filter((m) => m.task === "generate");
  const select = $("model");
  for (const m of models) select.add(new Option(m.id, m.id));
  const showEngines = () => {
    const model = models.find((m) => m.id === select.value);
    const box = $("engines");
    box.querySelectorAll("label").forEach((l) => l.remove());
    for (const e of model ? model.engines : []) {
      const label = document.createElement("label");
      const input = document.createElement("input");
      Object.assign(input, { type: "checkbox", name: "engine", value: e.name,
                             checked: e.available, disabled: !e.available });
      label.append(input, ` ${e.name}${e.available ? "" : " (not installed)"}`);
      box.append(label);
    }
  };
  select.addEventListener("change", showEngines);
  showEngines();
}

function showMode() {
  const load = $("mode").value === "load";
  document.querySelectorAll(".runs-only").forEach((n) => { n.hidden = load; });
  document.querySelectorAll(".load-only").forEach((n) => { n.hidden = !load; });
}

function clientLevels() {
  return $("clients").value.split(",").map((c) => c.trim()).filter(Boolean).map(Number);
}

function requestBody() {
  const checked = (name) => [...document.querySelectorAll(`input[name=${name}]:checked`)]
    .map((i) => i.value);
  const body = {
    model: $("model").value || undefined,
    engines: checked("engine"),
    references: checked("reference"),
    preset: $("preset").value,
    max_tokens: Number($("max_tokens").value),
    stream: true,
  };
  if (state.mode === "load") return { ...body, clients: clientLevels() };
  return { ...body, repeats: Number($("repeats").value), warmup: Number($("warmup").value) };
}

// ------------------------------------------------------------------ the stream
let controller = null;

async function start(event) {
  event.preventDefault();
  if (state.running) return;
  state.mode = $("mode").value;
  reset();
  state.running = true;
  $("start").disabled = true;
  $("download").disabled = true;
  $("stop").disabled = false;
  setStatus("Loading engines and tokenizing prompts…");
  controller = new AbortController();
  try {
    const resp = await fetch("/bench", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify(requestBody()), signal: controller.signal,
    });
    if (!resp.ok) {
      const body = await resp.json().catch(() => ({}));
      throw new Error(body.error ? body.error.message : `HTTP ${resp.status}`);
    }
    await readEvents(resp.body, handle);
    if (!state.summary) setStatus("Stopped.");
  } catch (err) {
    if (err.name === "AbortError") setStatus("Stopped: the server ends the run.");
    else { state.error = err.message; setStatus(err.message, true); }
  } finally {
    state.running = false;
    $("start").disabled = false;
    $("stop").disabled = true;
    $("download").disabled = !state.summary;
  }
}

// Server-sent events over a POST: EventSource only does GET, so frames are split by hand.
async function readEvents(stream, onEvent) {
  const reader = stream.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const frame = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = frame.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      onEvent(JSON.parse(data));
    }
  }
}

function reset() {
  const load = state.mode === "load";
  Object.assign(state, { events: [], targets: [], series: {}, levels: [],
                         clients: load ? clientLevels() : [], summary: null, error: null,
                         environment: null });
  $("summary").hidden = true;
  $("load-summary").hidden = true;
  $("environment").hidden = true;
  $("charts").hidden = load;
  $("load-charts").hidden = !load;
  drawAll();
}

function addTarget(info) {
  state.targets.push(info);
  state.series[info.name] = state.series[info.name] || { decode: [], ttft: [], peak: [], kv: [] };
  showEnvironment();
}

function handle(ev) {
  state.events.push(ev);
  if (ev.type === "start") {
    state.environment = ev.environment;
    ev.targets.forEach(addTarget);
    const targets = ev.targets.length + ev.references.length;
    if (state.mode === "load") {
      state.planned = state.clients.length * targets;
      setStatus(`Running ${ev.model} under load: ${state.clients.join(", ")} clients, ` +
                `${ev.max_tokens} tokens each…`);
    } else {
      state.planned = (ev.warmup + ev.repeats * ev.prompts.length) * targets;
      setStatus(`Running ${ev.model}: ${ev.prompts.length} prompts × ${ev.repeats} repeats, ` +
                `${ev.max_tokens} tokens each…`);
    }
  } else if (ev.type === "compiling") {
    setStatus(`Waiting for ${ev.target} to finish compiling its decode step (not measured)…`);
  } else if (ev.type === "compile_error") {
    setStatus(`${ev.target}'s compiled decode step failed (${ev.message}): its slower ` +
              `eager steps are measured.`);
  } else if (ev.type === "warmup") {
    setStatus(`Warming up ${ev.target} at ${ev.clients} clients (not measured)…`);
  } else if (ev.type === "level") {
    state.levels.push(ev);
    setStatus(`Level ${state.levels.length} of ${state.planned} finished (${ev.target}, ` +
              `${ev.clients} clients: ${fmt(ev.aggregate_tok_s)} tok/s).`);
    showLevels();
    drawAll();
  } else if (ev.type === "target") {
    addTarget(ev);
  } else if (ev.type === "run") {
    const runs = state.events.filter((e) => e.type === "run").length;
    setStatus(`Run ${runs} of about ${state.planned} finished (${ev.target}` +
              `${ev.warmup ? ", warm-up" : ""}).`);
    if (!ev.warmup) {
      const s = state.series[ev.target];
      s.decode.push(ev.decode_tokens_per_s);
      s.ttft.push(ev.ttft_s * 1000);
      s.peak.push(ev.peak_memory_bytes / MiB);
      s.kv.push((ev.kv_cache_bytes || 0) / MiB);  // references do not report it
      drawAll();
    }
  } else if (ev.type === "error") {
    setStatus(`${ev.target}: ${ev.error.message}`, true);
  } else if (ev.type === "summary") {
    state.summary = ev;
    if (ev.mode === "load") showLoadRatios(ev);
    else showSummary(ev);
    setStatus(`Done in ${ev.wall_s.toFixed(1)} s${ev.cancelled ? " (stopped early)" : ""}.`);
  }
}

// ------------------------------------------------------------------ tables
function row(cells) {
  const tr = document.createElement("tr");
  for (const c of cells) {
    const td = document.createElement("td");
    td.textContent = c;
    tr.append(td);
  }
  return tr;
}

function showEnvironment() {
  $("environment").hidden = false;
  const body = $("targets-table").tBodies[0];
  body.replaceChildren(...state.targets.map((t) =>
    row([t.name, t.device_name || t.device, t.dtype, t.backend_version,
         t.memory_measure || "–"])));
  const env = state.environment;
  if (env) {
    $("versions").textContent = `${env.host}. ` +
      Object.entries(env.versions).map(([k, v]) => `${k} ${v}`).join(", ");
  }
}

function fmt(x, digits = 1) { return Number.isFinite(x) ? x.toFixed(digits) : "–"; }

function showSummary(sum) {
  $("summary").hidden = false;
  const pair = (m, scale = 1, d = 1) => m ? `${fmt(m.median * scale, d)} (${fmt(m.p90 * scale, d)})` : "–";
  $("summary-table").tBodies[0].replaceChildren(...Object.entries(sum.targets).map(([name, t]) =>
    t.runs ? row([name, t.runs, pair(t.ttft_s, 1000), pair(t.prefill_tokens_per_s, 1, 0),
                  pair(t.decode_tokens_per_s), pair(t.peak_memory_bytes, 1 / MiB, 0),
                  pair(t.kv_cache_bytes, 1 / MiB, 1)])
           : row([name, 0, t.error || "no runs", "", "", "", ""])));
  $("ratios").replaceChildren(...Object.entries(sum.ratios).map(([k, r]) => {
    const li = document.createElement("li");
    li.textContent = `${k}: decode ${fmt(r.decode_tokens_per_s, 2)}×, prefill ` +
      `${fmt(r.prefill_tokens_per_s, 2)}×, TTFT ${fmt(r.ttft_s, 2)}×, peak memory ` +
      `${fmt(r.peak_memory_bytes, 2)}×`;
    return li;
  }));
}

const mib = (bytes, d = 1) => (bytes === null || bytes === undefined ? "–" : fmt(bytes / MiB, d));
const pair2 = (a, b, d = 0) => `${fmt(a ?? NaN, d)} / ${fmt(b ?? NaN, d)}`;

function showLevels() {
  $("load-summary").hidden = false;
  $("load-table").tBodies[0].replaceChildren(...state.levels.map((lv) => row([
    lv.target, lv.clients, fmt(lv.aggregate_tok_s), pair2(lv.ttft_ms_p50, lv.ttft_ms_p99),
    pair2(lv.itl_ms_p50, lv.itl_ms_p99, 1), fmt(lv.server_queue_ms_p50 ?? NaN, 0),
    lv.peak_batch ?? "–", mib(lv.peak_kv_used_bytes), mib(lv.rss_peak_delta_bytes),
    lv.engine_peak_memory_bytes ? mib(lv.engine_peak_memory_bytes, 0) : "–"])));
}

function showLoadRatios(sum) {
  $("load-ratios").replaceChildren(...Object.entries(sum.ratios).map(([k, r]) => {
    const li = document.createElement("li");
    li.textContent = `${k} clients: ${fmt(r, 2)}× aggregate tokens/s`;
    return li;
  }));
}

// Save the last run's summary (every level or run, the targets and where they ran) as JSON.
function download() {
  if (!state.summary) return;
  const blob = new Blob([JSON.stringify(state.summary, null, 2)], { type: "application/json" });
  const a = document.createElement("a");
  a.href = URL.createObjectURL(blob);
  a.download = `duet-bench-${state.summary.mode || "runs"}-${state.summary.date}.json`;
  document.body.append(a);
  a.click();
  a.remove();
  setTimeout(() => URL.revokeObjectURL(a.href), 1000);
}

// ------------------------------------------------------------------ charts
const BOX = { w: 520, h: 260, left: 48, right: 12, top: 24, bottom: 28 };

function el(name, attrs = {}, text) {
  const node = document.createElementNS(SVG_NS, name);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}

// The top of the y axis: four gridline steps of 1, 2, 2.5 or 5 times a power of ten.
function niceMax(x) {
  if (!(x > 0)) return 1;
  const raw = x / 4, power = 10 ** Math.floor(Math.log10(raw));
  const m = [1, 2, 2.5, 5, 10].find((k) => k * power >= raw);
  return 4 * m * power;
}

function axes(svg, yMax, xLabels) {
  const g = el("g", { class: "axis" });
  const plotH = BOX.h - BOX.top - BOX.bottom;
  for (let i = 0; i <= 4; i++) {
    const y = BOX.top + plotH * (1 - i / 4);
    g.append(el("line", { x1: BOX.left, x2: BOX.w - BOX.right, y1: y, y2: y }));
    const v = (yMax * i) / 4;
    g.append(el("text", { x: BOX.left - 6, y: y + 4, "text-anchor": "end" },
                String(Number(v.toPrecision(3)))));
  }
  xLabels.forEach(([x, label]) => g.append(el("text", {
    x, y: BOX.h - 8, "text-anchor": x > BOX.w - BOX.right - 20 ? "end" : "middle" }, label)));
  svg.append(g);
}

function legend(svg, names) {
  const g = el("g", { class: "legend" });
  let x = BOX.left;
  for (const name of names) {
    g.append(el("rect", { x, y: 6, width: 10, height: 10, fill: colour(name) }));
    g.append(el("text", { x: x + 14, y: 15 }, name));
    x += 24 + name.length * 7;
  }
  svg.append(g);
}

function lineChart(svg, key) {
  svg.replaceChildren();
  const names = Object.keys(state.series);
  const n = Math.max(1, ...names.map((t) => state.series[t][key].length));
  const yMax = niceMax(Math.max(0, ...names.flatMap((t) => state.series[t][key])) * 1.1);
  const plotW = BOX.w - BOX.left - BOX.right, plotH = BOX.h - BOX.top - BOX.bottom;
  const xAt = (i) => BOX.left + (n === 1 ? plotW / 2 : (plotW * i) / (n - 1));
  const yAt = (v) => BOX.top + plotH * (1 - v / yMax);
  axes(svg, yMax, [[xAt(0), "run 1"], ...(n > 1 ? [[xAt(n - 1), `run ${n}`]] : [])]);
  for (const name of names) {
    const values = state.series[name][key];
    const g = el("g", { class: "series", "data-target": name, "data-points": values.length });
    if (values.length > 1) {
      g.append(el("polyline", {
        points: values.map((v, i) => `${xAt(i)},${yAt(v)}`).join(" "),
        fill: "none", stroke: colour(name), "stroke-width": 2,
      }));
    }
    values.forEach((v, i) => g.append(el("circle", { cx: xAt(i), cy: yAt(v), r: 3.5,
                                                     fill: colour(name) })));
    svg.append(g);
  }
  legend(svg, names);
}

function memoryChart(svg) {
  svg.replaceChildren();
  const names = Object.keys(state.series);
  const last = (a) => (a.length ? a[a.length - 1] : 0);
  const bars = names.map((t) => [t, last(state.series[t].peak), last(state.series[t].kv)]);
  const yMax = niceMax(Math.max(0, ...bars.flatMap(([, p, k]) => [p, k])) * 1.1);
  const plotW = BOX.w - BOX.left - BOX.right, plotH = BOX.h - BOX.top - BOX.bottom;
  const slot = plotW / Math.max(1, names.length);
  const yAt = (v) => BOX.top + plotH * (1 - v / yMax);
  axes(svg, yMax, bars.map(([t], i) => [BOX.left + slot * (i + 0.5), t]));
  bars.forEach(([name, peak, kv], i) => {
    const g = el("g", { class: "series", "data-target": name,
                        "data-points": state.series[name].peak.length });
    const w = Math.min(40, slot / 3), x0 = BOX.left + slot * (i + 0.5) - w;
    g.append(el("rect", { x: x0, y: yAt(peak), width: w - 2, height: yAt(0) - yAt(peak),
                          fill: colour(name) }));
    g.append(el("rect", { x: x0 + w, y: yAt(kv), width: w - 2, height: yAt(0) - yAt(kv),
                          fill: colour(name), "fill-opacity": 0.45 }));
    svg.append(g);
  });
  legend(svg, names);
}

// A chart against the sweep's levels (evenly spaced, as client counts usually grow by
// factors): lines = [{name, key, dash}], a point per level that has the figure.
function levelChart(svg, lines) {
  svg.replaceChildren();
  const levels = state.clients.length ? state.clients : [1];
  const names = [...new Set(state.levels.map((lv) => lv.target))];
  const value = (lv, key) => (lv[key] === null || lv[key] === undefined ? null : lv[key]);
  const all = lines.flatMap(({ key, scale = 1 }) =>
    state.levels.map((lv) => value(lv, key)).filter((v) => v !== null).map((v) => v * scale));
  const yMax = niceMax(Math.max(0, ...all) * 1.1);
  const plotW = BOX.w - BOX.left - BOX.right, plotH = BOX.h - BOX.top - BOX.bottom;
  const xAt = (i) => BOX.left + (levels.length === 1 ? plotW / 2
                                                     : (plotW * i) / (levels.length - 1));
  const yAt = (v) => BOX.top + plotH * (1 - Math.max(0, v) / yMax);
  axes(svg, yMax, levels.map((n, i) => [xAt(i), `${n}`]));
  for (const name of names) {
    for (const { key, dash, scale = 1 } of lines) {
      const points = state.levels
        .filter((lv) => lv.target === name && value(lv, key) !== null)
        .map((lv) => [xAt(levels.indexOf(lv.clients)), yAt(value(lv, key) * scale)]);
      const g = el("g", { class: "series", "data-target": name, "data-key": key,
                          "data-points": points.length });
      if (points.length > 1) {
        g.append(el("polyline", { points: points.map((p) => p.join(",")).join(" "),
                                  fill: "none", stroke: colour(name), "stroke-width": 2,
                                  ...(dash ? { "stroke-dasharray": "5 4" } : {}) }));
      }
      points.forEach(([x, y]) => g.append(el("circle", { cx: x, cy: y, r: 3.5,
                                                         fill: colour(name) })));
      svg.append(g);
    }
  }
  legend(svg, names);
}

function drawAll() {
  if (state.mode === "load") {
    levelChart($("chart-load-tps"), [{ key: "aggregate_tok_s" }]);
    levelChart($("chart-load-latency"), [{ key: "ttft_ms_p50" }, { key: "itl_ms_p50", dash: true }]);
    levelChart($("chart-load-memory"), [{ key: "rss_peak_delta_bytes", scale: 1 / MiB }]);
    return;
  }
  lineChart($("chart-decode"), "decode");
  lineChart($("chart-ttft"), "ttft");
  memoryChart($("chart-memory"));
}

$("bench-form").addEventListener("submit", start);
$("stop").addEventListener("click", () => controller && controller.abort());
$("download").addEventListener("click", download);
$("mode").addEventListener("change", showMode);
showMode();
drawAll();
loadModels().then(() => { state.ready = true; })
  .catch((err) => setStatus(`Could not list models: ${err.message}`, true));
