// crowdtrain dashboard: fetches each page's JSON every POLL_MS and redraws it. Hand-written, no library.
// Every string from the server is set as text (textContent), never as markup.
"use strict";

const POLL_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";

// ---- formatting -------------------------------------------------------------------------------

function pct(x) { return x === null || x === undefined ? "–" : (100 * x).toFixed(1) + "%"; }
function num(x, digits) {
  if (x === null || x === undefined) return "–";
  return digits === undefined ? x.toLocaleString("en") : x.toFixed(digits);
}
function credit(x) {
  // Cobblestones: small jobs earn fractions of one, so show three significant digits.
  if (x === null || x === undefined) return "–";
  return x === 0 ? "0" : x >= 1000 ? Math.round(x).toLocaleString("en") : x.toPrecision(3);
}
function duration(seconds) {
  if (seconds === null || seconds === undefined) return "–";
  const s = Math.round(seconds);
  if (s < 120) return s + " s";
  if (s < 7200) return Math.floor(s / 60) + " min " + (s % 60) + " s";
  return Math.floor(s / 3600) + " h " + Math.floor((s % 3600) / 60) + " min";
}
function ago(iso) {
  if (!iso) return "–";
  return duration((Date.now() - Date.parse(iso)) / 1000) + " ago";
}
function until(iso) {
  // A moment from now: "in 3 min" ahead, "3 min ago" past.
  if (!iso) return "–";
  const s = (Date.parse(iso) - Date.now()) / 1000;
  return s >= 0 ? "in " + duration(s) : duration(-s) + " ago";
}
function compact(x) {
  if (x >= 1e6) return (x / 1e6).toFixed(1) + "M";
  if (x >= 1e3) return (x / 1e3).toFixed(x >= 1e4 ? 0 : 1) + "k";
  return String(Math.round(x * 100) / 100);
}

// ---- DOM helpers --------------------------------------------------------------------------------

function setText(id, text) { const el = document.getElementById(id); if (el) el.textContent = text; }

function cell(content, cls) {
  const td = document.createElement("td");
  if (content instanceof Node) td.appendChild(content); else td.textContent = content;
  if (cls) td.className = cls;
  return td;
}

function link(href, text) { const a = document.createElement("a"); a.href = href; a.textContent = text; return a; }

function statusBadge(status) {
  const span = document.createElement("span");
  span.className = "status " + status;
  span.textContent = status;
  return span;
}

// Replace a table's body with one row per item; `row` gives the cells (strings, nodes, or [content, class]).
function fillTable(id, items, row) {
  const body = document.querySelector("#" + id + " tbody");
  const rows = items.map((item) => {
    const tr = document.createElement("tr");
    for (const c of row(item)) tr.appendChild(Array.isArray(c) ? cell(c[0], c[1]) : cell(c));
    return tr;
  });
  body.replaceChildren(...rows);
}

// ---- polling ------------------------------------------------------------------------------------

async function fetchJson(url) {
  const resp = await fetch(url, { credentials: "same-origin", cache: "no-store" });
  if (resp.status === 401) { window.location.assign("/dashboard/login"); throw new Error("logged out"); }
  if (!resp.ok) throw new Error(resp.status + " " + (await resp.text()).slice(0, 200));
  return resp.json();
}

function poll(url, render) {
  const tick = async () => {
    try {
      render(await fetchJson(url));
      setText("updated", "updated " + new Date().toLocaleTimeString("en-GB"));
    } catch (err) {
      setText("updated", "not updated: " + err.message);
    }
    setTimeout(tick, POLL_MS);
  };
  tick();
}

// ---- the SVG line chart -------------------------------------------------------------------------

function svgEl(name, attrs, text) {
  const el = document.createElementNS(SVG, name);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, v);
  if (text !== undefined) el.textContent = text;
  return el;
}

function ticks(lo, hi, n) {
  const span = hi - lo || 1;
  const step0 = span / n;
  const mag = Math.pow(10, Math.floor(Math.log10(step0)));
  const step = [1, 2, 2.5, 5, 10].map((m) => m * mag).find((s) => s >= step0);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) out.push(v);
  return out;
}

// points: [{x, y, epoch}], x ascending. Draws epoch bands, axes, the target line, the line and one circle
// per point (class "point").
function lineChart(svg, points, xLabel, target) {
  const W = 640, H = 280, L = 48, R = 12, T = 12, B = 40;
  svg.replaceChildren();
  if (!points.length) {
    svg.appendChild(svgEl("text", { x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty" }, "no merges yet"));
    return;
  }
  const xmax = Math.max(points[points.length - 1].x, 1e-9);
  const ys = points.map((p) => p.y).concat(target === null ? [] : [target]);
  const ylo = Math.max(0, Math.floor(Math.min(...ys) * 10) / 10), yhi = Math.min(1, Math.ceil(Math.max(...ys) * 10) / 10);
  const yspan = yhi - ylo || 0.1;
  const sx = (x) => L + (x / xmax) * (W - L - R);
  const sy = (y) => T + (1 - (y - ylo) / yspan) * (H - T - B);

  // Epoch bands: from an epoch's first merge to the next epoch's first, every other one shaded. (A straggler
  // of an epoch may be merged after the next epoch's first merge; it falls in the next band.)
  const first = new Map();
  for (const p of points) if (!first.has(p.epoch) || p.x < first.get(p.epoch)) first.set(p.epoch, p.x);
  const starts = Array.from(first, ([epoch, x]) => ({ epoch: epoch, x: x })).sort((a, b) => a.epoch - b.epoch);
  starts[0].x = 0;
  let labelEnd = -Infinity; // right edge of the last epoch label drawn: a label that would overlap it is left out
  starts.forEach((s, i) => {
    const x0 = sx(s.x), x1 = sx(i + 1 < starts.length ? starts[i + 1].x : xmax);
    if (i % 2 === 0) svg.appendChild(svgEl("rect", { x: x0, y: T, width: Math.max(x1 - x0, 0), height: H - T - B, class: "band" }));
    if (x1 - x0 <= 14) return;
    const label = svgEl("text", { x: (x0 + x1) / 2, y: T + 10, "text-anchor": "middle", class: "band-label" }, "e" + s.epoch);
    svg.appendChild(label);
    const box = label.getBBox(); // measured as drawn (0 wide where the SVG is not rendered)
    if (box.x < labelEnd + 2) label.remove();
    else labelEnd = box.x + box.width;
  });
  for (const v of ticks(ylo, yhi, 5)) {
    svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: sy(v), y2: sy(v), class: "grid" }));
    svg.appendChild(svgEl("text", { x: L - 6, y: sy(v) + 3, "text-anchor": "end", class: "tick" }, v.toFixed(2)));
  }
  for (const v of ticks(0, xmax, 6)) {
    svg.appendChild(svgEl("text", { x: sx(v), y: H - B + 14, "text-anchor": "middle", class: "tick" }, compact(v)));
  }
  svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: H - B, y2: H - B, class: "axis" }));
  svg.appendChild(svgEl("line", { x1: L, x2: L, y1: T, y2: H - B, class: "axis" }));
  svg.appendChild(svgEl("text", { x: (L + W - R) / 2, y: H - 6, "text-anchor": "middle", class: "tick" }, xLabel));
  if (target !== null) svg.appendChild(svgEl("line", { x1: L, x2: W - R, y1: sy(target), y2: sy(target), class: "target" }));
  const d = points.map((p, i) => (i ? "L" : "M") + sx(p.x).toFixed(1) + " " + sy(p.y).toFixed(1)).join(" ");
  svg.appendChild(svgEl("path", { d: d, class: "line" }));
  for (const p of points) {
    const c = svgEl("circle", { cx: sx(p.x).toFixed(1), cy: sy(p.y).toFixed(1), r: 2.5, class: "point" });
    c.appendChild(svgEl("title", {}, "epoch " + p.epoch + ": " + pct(p.y)));
    svg.appendChild(c);
  }
}

// ---- pages --------------------------------------------------------------------------------------

function jobsPage() {
  poll("/dashboard/api/jobs", (jobs) => fillTable("jobs", jobs, (j) => [
    link("/dashboard/jobs/" + j.job_id, String(j.job_id)), link("/dashboard/jobs/" + j.job_id, j.name), j.mode,
    statusBadge(j.status), j.current_epoch + (j.max_epochs ? " / " + j.max_epochs : ""), pct(j.accuracy),
    ago(j.created_at),
  ]));
}

function counts(obj) { return Object.entries(obj).sort((a, b) => b[1] - a[1]); }

function inFlightSection(f) {
  document.getElementById("in-flight-section").hidden = false;
  setText("fl-running", num(f.running_total) + (f.running_total > f.running.length ? " (oldest " + f.running.length + " shown)" : ""));
  setText("fl-backlog", num(f.merge_backlog) + (f.oldest_upload_seconds === null ? "" : " (" + duration(f.oldest_upload_seconds) + ")"));
  const b = f.in_flight;
  setText("fl-budget", b ? num(b.count) + " / " + (b.budget === null ? "no budget yet" : num(b.budget)) + (b.held_back ? " (held back)" : "") : "–");
  setText("fl-median", duration(f.median_seconds));
  setText("fl-stragglers", num(f.stragglers) + (f.median_seconds === null ? "" : " (> " + duration(f.straggler_factor * f.median_seconds) + ")"));
  setText("fl-duplicates", num(f.duplicates.length));
  fillTable("in-flight", f.running, (a) => [
    String(a.assignment_id), a.host_name, String(a.epoch), String(a.workunit_id), [duration(a.age_seconds), "num"],
    until(a.deadline), until(a.expected_finish) + " (" + a.expected_from + ")",
    [[a.straggler ? "straggler" : "", a.duplicate ? "duplicate" : ""].filter(Boolean).join(", "), a.straggler || a.duplicate ? "revoked" : ""],
  ]);
}

function dedlocSection(f) {
  document.getElementById("dedloc-section").hidden = false;
  setText("dl-steps", num(f.steps_committed) + " / " + num(f.max_steps));
  setText("dl-phase", "step " + f.step + ", " + f.phase);
  setText("dl-members", (f.members_last === null ? "–" : num(f.members_last)) + " / " + num(f.members_seen) + " / " + num(f.peers_live));
  setText("dl-round", duration(f.mean_round_seconds));
  setText("dl-examples", f.examples_per_step === null ? "–" : num(f.examples_per_step, 1) + " (" + num(f.examples_min) + " – " + num(f.examples_max) + ")");
  setText("dl-target", num(f.target_batch_size) + (f.overshoot === null ? "" : " (+" + num(f.overshoot, 1) + " on average)"));
  fillTable("dedloc-steps", f.recent, (s) => [
    String(s.step), [num(s.attempt), "num"], [num(s.members), "num"], [num(s.examples), "num"],
    [num(s.examples - f.target_batch_size), "num"], [duration(s.seconds), "num"],
  ]);
}

function share(part, whole) { return whole ? pct(part / whole) : "–"; }

function expertsSection(m) {
  document.getElementById("experts-section").hidden = false;
  const sum = (key) => m.experts.reduce((total, e) => total + e[key], 0);
  const calls = sum("answered") + sum("failed") + sum("late");
  const rate = m.experts.filter((e) => e.answers_per_s !== null).reduce((total, e) => total + e.answers_per_s, 0);
  setText("ex-served", num(m.served) + " / " + num(m.experts.length));
  setText("ex-hosts", num(new Set(m.experts.filter((e) => e.host_id !== null).map((e) => e.host_id)).size));
  setText("ex-rate", num(rate, 1));
  setText("ex-unanswered", share(sum("failed") + sum("late"), calls));
  setText("ex-refused", num(sum("refused")));
  setText("ex-moves", num(m.experts.reduce((total, e) => total + Math.max(0, e.leases - 1), 0)));
  fillTable("experts", m.experts, (e) => [
    m.layout.replicas > 1 ? e.uid + " #" + e.replica : e.uid, e.host_id === null ? "–" : String(e.host_id),
    e.url || "not served",
    e.url ? until(e.lease_expires_at) : "–", [num(Math.max(0, e.leases - 1)), "num"],
    e.checkpoint_at ? "step " + num(e.checkpoint_step) + ", " + ago(e.checkpoint_at) : "none yet",
    [e.answers_per_s === null ? "–" : num(e.answers_per_s, 1), "num"],
    [share(e.failed + e.late, e.answered + e.failed + e.late), "num"],
    [num(e.refused), e.refused ? "revoked" : "num"],
  ]);
}

function jobPage() {
  const jobId = window.location.pathname.split("/").filter(Boolean).pop();
  const base = "/dashboard/api/jobs/" + encodeURIComponent(jobId);
  let sectionStarted = false;  // the mode's own section, polled once the job's mode is known
  poll(base, (d) => {
    if (!sectionStarted) {
      if (d.mode === "dedloc") poll(base + "/dedloc", dedlocSection);
      else poll(base + "/in-flight", inFlightSection);
      if (d.job.mixture_id !== null) poll("/dashboard/api/mixtures/" + d.job.mixture_id, expertsSection);
    }
    sectionStarted = true;
    const job = d.job, m = job.metrics;
    document.title = "crowdtrain · " + job.name;
    setText("job-name", job.name + " (job " + job.job_id + ")");
    const badge = document.getElementById("job-status");
    badge.className = "status " + job.status;
    badge.textContent = job.status;
    setText("job-message", job.status_message);
    setText("fig-accuracy", pct(m.length ? m[m.length - 1].val_accuracy : null));
    setText("fig-best", pct(job.best_epoch_accuracy));
    setText("fig-target", pct(job.target_accuracy));
    setText("fig-epoch", job.current_epoch + " / " + job.max_epochs);
    setText("fig-merges", num(job.merges));
    setText("fig-rate", num(d.merges_per_second, 2) + (d.merges_per_second_overall === null ? "" : " (" + num(d.merges_per_second_overall, 2) + " overall)"));
    const st = d.staleness;
    setText("fig-staleness", st.merges ? num(st.mean, 1) + " / " + num(st.recent_mean, 1) + " / " + st.max : "–");
    const fl = job.in_flight;
    setText("fig-in-flight", fl ? num(fl.count) + " / " + (fl.budget === null ? "–" : num(fl.budget)) + (fl.held_back ? " (held back)" : "") : "–");
    setText("fig-hosts", num(job.active_hosts));
    setText("fig-elapsed", duration(job.elapsed_seconds));
    lineChart(document.getElementById("chart-time"), m.map((p) => ({ x: p.t, y: p.val_accuracy, epoch: p.epoch })), "seconds since start", job.target_accuracy);
    const byExamples = m.filter((p) => p.examples !== null).map((p) => ({ x: p.examples, y: p.val_accuracy, epoch: p.epoch }));
    lineChart(document.getElementById("chart-examples"), byExamples, "training examples merged", job.target_accuracy);
    const statuses = Array.from(new Set(Object.keys(d.workunits).concat(Object.keys(d.epoch_workunits))));
    fillTable("workunits", statuses, (s) => [s, [num(d.epoch_workunits[s] || 0), "num"], [num(d.workunits[s] || 0), "num"]]);
    fillTable("assignments", counts(job.assignments), ([s, n]) => [s, [num(n), "num"]]);
    fillTable("epochs", job.epochs.slice().reverse(), (e) => [
      String(e.epoch), [num(e.workunits), "num"], [num(e.done), "num"], [num(e.failed), "num"], [num(e.merges), "num"],
      [pct(e.mean_accuracy), "num"], [e.merges ? pct(e.min_accuracy) + " – " + pct(e.max_accuracy) : "–", "num"],
    ]);
    const p = d.problems;
    setText("findings", p.findings.join(" "));
    fillTable("problems", p.reasons.length ? p.reasons : [{ status: "–", reason: "none", count: 0 }], (r) => [r.status, r.reason, [num(r.count), "num"]]);
    fillTable("recent-problems", p.recent, (a) => [String(a.assignment_id), a.host_name, String(a.epoch), a.status, a.message, ago(a.finished_at)]);
    document.getElementById("late-section").hidden = !p.late;
    setText("late-count", num(p.late));
    fillTable("late", p.late_recent, (a) => [String(a.assignment_id), a.host_name, String(a.epoch), a.message, ago(a.finished_at)]);
  });
}

function quarantined(h) {
  return h.quarantined_until !== null && new Date(h.quarantined_until) > new Date();
}

function hostsPage() {
  poll("/dashboard/api/hosts", (hosts) => fillTable("hosts", hosts, (h) => [
    String(h.id), h.name, h.device, h.frameworks.join(", "), h.cpus + (h.gpu ? " / " + h.gpu : ""),
    [num(h.examples_per_second, 0), "num"], [num(h.results_merged), "num"],
    [num(h.results_valid) + " / " + num(h.results_failed), "num"], [num(h.consecutive_valid), "num"],
    [h.mean_turnaround === null ? "–" : duration(h.mean_turnaround), "num"], ago(h.last_seen),
    h.revoked ? ["revoked", "revoked"] : "no",
    [pct(h.reputation), "num"], h.account || "–", [credit(h.credit), "num"],
    quarantined(h) ? ["until " + new Date(h.quarantined_until).toLocaleString("en-GB") + ": " + h.quarantine_reason,
      "revoked"] : "no",
  ]));
}

function projectPage() {
  poll("/v1/project", (p) => {
    setText("fig-jobs", num(p.jobs.length));
    setText("fig-results", num(p.results_merged));
    setText("fig-examples", num(p.examples));
    setText("fig-active", num(p.hosts_active));
    setText("fig-credit", credit(p.credit));
    fillTable("project-jobs", p.jobs, (j) => [
      j.name, statusBadge(j.status), j.current_epoch + (j.max_epochs ? " / " + j.max_epochs : ""),
      [pct(j.best_accuracy), "num"], [num(j.results_merged), "num"], [num(j.examples), "num"],
    ]);
    fillTable("volunteers", p.volunteers, (v) => [
      String(p.volunteers.indexOf(v) + 1), v.name, [num(v.hosts), "num"], [num(v.results_merged), "num"],
      [num(v.results_valid), "num"], [num(v.examples), "num"], [credit(v.credit), "num"],
    ]);
    fillTable("host-credit", p.hosts, (h) => [
      "host " + h.host_id, h.account || "anonymous", [num(h.results), "num"], [credit(h.credit), "num"],
    ]);
  });
}

// ---- health banner: a part down or a kind of process missing, on the operator's pages ----------------

function healthBanner() {
  const banner = document.createElement("p");
  banner.id = "health-banner";
  banner.className = "banner";
  banner.hidden = true;
  document.querySelector("main").prepend(banner);
  const tick = async () => {
    try {
      const resp = await fetch("/v1/health", { cache: "no-store" });
      const report = await resp.json();
      const down = Object.entries(report.parts).filter(([, part]) => !part.ok);
      banner.textContent = down.length
        ? "Not running: " + down.map(([name, part]) => name + " (" + part.detail + ")").join("; ")
        : "";
      banner.hidden = !down.length;
    } catch (err) {
      banner.textContent = "The scheduler's health could not be read: " + err.message;
      banner.hidden = false;
    }
    setTimeout(tick, POLL_MS);
  };
  tick();
}

const PAGES = { jobs: jobsPage, job: jobPage, hosts: hostsPage, project: projectPage };
const start = PAGES[document.body.dataset.page];
if (start) start();
if (start && document.body.dataset.page !== "project") healthBanner();
