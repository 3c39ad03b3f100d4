// The status page: polls /admin/status and draws it. No framework, no build step.
// Data is written with textContent only: worker ids and reasons come from the workers.
"use strict";

const POLL_MS = 2000;
const DECISIONS = 20;
const KEY_STORAGE = "kvroute.adminKey";  // sessionStorage: gone when the tab closes
const SVG = "http://www.w3.org/2000/svg";
const byId = (id) => document.getElementById(id);
let timer = null;

// ------------------------------------------------------------ polling and the key

function schedule(delay) {
  clearTimeout(timer);
  timer = setTimeout(poll, delay);
}

async function poll() {
  if (document.hidden) return schedule(POLL_MS);  // a background tab costs the orchestrator nothing
  const key = sessionStorage.getItem(KEY_STORAGE);
  const headers = key ? { Authorization: "Bearer " + key } : {};
  try {
    const response = await fetch("admin/status?decisions=" + DECISIONS, { headers, cache: "no-store" });
    if (response.status === 401 || response.status === 403) {
      return askForKey(key ? (await errorMessage(response)) : "");  // polls again once a key is given
    }
    if (!response.ok) {
      connection("error " + response.status + ": " + (await errorMessage(response)), "bad");
    } else {
      render(await response.json());
      connection("live · " + new Date().toLocaleTimeString(), "ok");
    }
  } catch (error) {
    connection("orchestrator unreachable", "bad");
  }
  schedule(POLL_MS);
}

async function errorMessage(response) {
  try {
    return (await response.json()).error.message;
  } catch (error) {
    return response.statusText;
  }
}

function askForKey(message) {
  sessionStorage.removeItem(KEY_STORAGE);
  byId("key-form").hidden = false;
  byId("key-message").textContent = message;
  byId("forget-key").hidden = true;
  connection("needs an admin API key", "bad");
  byId("key").focus();
}

function useKey(event) {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, byId("key").value.trim());
  byId("key").value = "";
  byId("key-form").hidden = true;
  byId("forget-key").hidden = false;
  schedule(0);
}

function forgetKey() {
  sessionStorage.removeItem(KEY_STORAGE);
  byId("forget-key").hidden = true;
  schedule(0);
}

function connection(text, state) {
  const element = byId("connection");
  element.textContent = text;
  element.dataset.state = state;
}

// ------------------------------------------------------------ formatting

function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? Math.round(value * 1000) + " ms" : value.toFixed(value < 10 ? 2 : 1) + " s";
}

function percent(value) {
  return value === null || value === undefined ? "–" : (100 * value).toFixed(1) + "%";
}

function count(value) {
  return value === null || value === undefined ? "–" : value.toLocaleString("en");
}

function age(createdAt, now) {
  const elapsed = Math.max(0, now - createdAt);
  return elapsed < 90 ? Math.round(elapsed) + " s" : Math.round(elapsed / 60) + " min";
}

function cell(row, text, className) {
  const td = row.insertCell();
  td.textContent = text;
  if (className) td.className = className;
  return td;
}

function replaceRows(table, rows) {
  table.tBodies[0].replaceChildren(...rows);
}

// ------------------------------------------------------------ drawing

function render(status) {
  byId("model").textContent = status.model + " · policy " + status.policy;
  renderActivity(status.activity);
  renderWorkers(status.workers, status.unavailable);
  renderDecisions(status.decisions, status.time);
}

function renderActivity(activity) {
  const totals = activity.totals;
  byId("requests").textContent = count(totals.requests);
  byId("failed").textContent = count(totals.failed);
  byId("ttft-p50").textContent = seconds(totals.ttft_p50);
  byId("ttft-p95").textContent = seconds(totals.ttft_p95);
  byId("hit-rate").textContent = percent(totals.hit_rate);
  const span = duration(activity.window_seconds);
  byId("window").textContent = span + ", in " + duration(activity.bucket_seconds) + " buckets";
  const buckets = activity.buckets;
  const ttftTop = Math.max(0.001, ...buckets.map((b) => b.ttft_p95 || 0));
  drawChart(byId("ttft-chart"), buckets.length, ttftTop, [seconds(ttftTop), "−" + span], [
    { className: "p95", points: buckets.map((b) => b.ttft_p95) },
    { className: "p50", points: buckets.map((b) => b.ttft_p50) },
  ]);
  drawChart(byId("hit-chart"), buckets.length, 1, ["100%", "−" + span], [
    { className: "hit", points: buckets.map((b) => b.hit_rate) },
  ]);
}

function duration(value) {
  return value % 60 === 0 ? value / 60 + " min" : value + " s";
}

// One polyline per series; a bucket without data (null) breaks the line. Fixed viewBox 600x140.
function drawChart(svg, slots, top, [topLabel, startLabel], series) {
  const width = 600, height = 140, pad = 14;
  const x = (i) => (slots > 1 ? (i * width) / (slots - 1) : width / 2);
  const y = (v) => height - pad - (v / top) * (height - 2 * pad);
  const shapes = [svgElement("line", { x1: 0, y1: y(0), x2: width, y2: y(0), class: "axis" })];
  for (const { className, points } of series) {
    let run = [];
    const flush = () => {
      if (run.length === 1) shapes.push(svgElement("circle", { cx: run[0][0], cy: run[0][1], r: 3, class: className }));
      if (run.length > 1) shapes.push(svgElement("polyline", { points: run.join(" "), class: className }));
      run = [];
    };
    points.forEach((v, i) => (v === null ? flush() : run.push([x(i).toFixed(1), y(v).toFixed(1)])));
    flush();
  }
  shapes.push(svgText(4, pad - 2, topLabel, "start"), svgText(4, height - 2, startLabel, "start"),
    svgText(width - 4, height - 2, "now", "end"));
  svg.replaceChildren(...shapes);
}

function svgElement(tag, attributes) {
  const element = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attributes)) element.setAttribute(name, value);
  return element;
}

function svgText(x, y, text, anchor) {
  const element = svgElement("text", { x, y, "text-anchor": anchor, class: "chart-label" });
  element.textContent = text;
  return element;
}

function renderWorkers(workers, unavailable) {
  const rows = workers.map((worker) => workerRow(worker));
  for (const worker of unavailable) {
    const row = document.createElement("tr");
    row.dataset.worker = worker.worker_id;
    cell(row, worker.worker_id);
    cell(row, worker.role);
    cell(row, worker.reason, "state bad");
    for (let i = 0; i < 7; i++) cell(row, "–", "num");
    rows.push(row);
  }
  replaceRows(byId("workers"), rows);
  const draining = workers.filter((w) => w.draining).length;
  byId("worker-count").textContent = (workers.length - draining) + " live"
    + (draining ? " · " + draining + " draining" : "") + (unavailable.length ? " · " + unavailable.length + " out" : "");
}

function workerRow(worker) {
  const load = worker.load;
  const row = document.createElement("tr");
  row.dataset.worker = worker.worker_id;
  cell(row, worker.worker_id);
  cell(row, worker.role);
  cell(row, worker.draining ? "draining" : "healthy", "state " + (worker.draining ? "warn" : "ok"));
  cell(row, count(load.num_running), "num");
  cell(row, count(load.num_waiting), "num");
  cell(row, count(load.num_queued_prefill_tokens), "num");
  cell(row, count(worker.in_flight), "num");
  kvUse(cell(row, ""), load);
  cell(row, count(worker.index_blocks), "num");
  cell(row, worker.prefill_speed === null ? "–" : worker.prefill_speed.toFixed(2) + "×", "num");
  return row;
}

function kvUse(td, load) {
  const total = load.num_total_blocks;
  if (!total) return (td.textContent = "–");
  const used = total - load.num_free_blocks;
  const bar = document.createElement("span");
  bar.className = "bar";
  const fill = document.createElement("span");
  fill.style.width = ((100 * used) / total).toFixed(1) + "%";  // CSSOM, which the CSP allows (no style attribute)
  bar.append(fill);
  const label = document.createElement("span");
  label.textContent = " " + percent(used / total) + " of " + count(total) + " blocks";
  td.append(bar, label);
}

function renderDecisions(decisions, now) {
  replaceRows(byId("decisions"), decisions.map((record) => decisionRow(record, now)));
}

function decisionRow(record, now) {
  const row = document.createElement("tr");
  const chosen = record.chosen || {};
  const estimate = chosen.estimate || {};
  const actual = record.actual;
  row.dataset.response = record.response_id;
  if (actual.error) row.className = "failed";
  cell(row, age(record.created_at, now));
  const shortId = record.response_id.slice(0, 14) + "…" + (record.choice_index ? " #" + record.choice_index : "");
  cell(row, shortId, "mono").title = record.response_id + " (request " + record.request_id + ")";
  cell(row, record.tenant);
  cell(row, record.policy);
  cell(row, planText(chosen), "plan");
  cell(row, seconds(estimate.ttft) + " → " + seconds(actual.ttft), "num");
  cell(row, count(record.predicted_reused_tokens) + " → " + count(actual.reused_tokens)
    + " of " + count(record.prompt_tokens), "num");
  alternatives(cell(row, ""), record.alternatives);
  cell(row, actual.error ? "failed: " + actual.error : record.reason, "reason");
  return row;
}

function planText(plan) {
  if (!plan.kind) return "none";
  const parts = [plan.kind];
  if (plan.source_worker) parts.push(plan.source_worker + " lends " + count(plan.lend_tokens) + " tokens →");
  if (plan.prefill_worker && plan.prefill_worker !== plan.decode_worker) parts.push(plan.prefill_worker + " →");
  parts.push(plan.decode_worker || "");
  return parts.join(" ");
}

function alternatives(td, plans) {
  if (!plans.length) return (td.textContent = "none");
  const details = document.createElement("details");
  const summary = document.createElement("summary");
  summary.textContent = plans.length + " other plan" + (plans.length > 1 ? "s" : "");
  const list = document.createElement("ol");
  for (const plan of plans) {
    const item = document.createElement("li");
    const cost = plan.feasible ? "TTFT " + seconds((plan.estimate || {}).ttft) : plan.infeasible_reason || "infeasible";
    item.textContent = planText(plan) + ": " + cost;
    list.append(item);
  }
  details.append(summary, list);
  td.append(details);
}

// ------------------------------------------------------------ start

byId("key-form").addEventListener("submit", useKey);
byId("forget-key").addEventListener("click", forgetKey);
byId("forget-key").hidden = !sessionStorage.getItem(KEY_STORAGE);
document.addEventListener("visibilitychange", () => document.hidden || schedule(0));
poll();
