// clipd dashboard. The overview (#/ or #filter=open|finalized|failed) shows the server (/api/v1/server), the
// privacy ledgers (/api/v1/ledgers), the buffered streams (/api/v1/streams) and a card per aggregation
// (/api/v1/aggregations); #/aggregations/<id> shows one aggregation in detail, with its throughput as the server
// recorded it (/api/v1/aggregations/<id>/throughput).
// Plain DOM and SVG, no dependency. Every string reaches the page as text (textContent, setAttribute), never as
// HTML: aggregation, stream, layer and ledger names come from clients. A number the API does not give shows "—".
"use strict";
const SVG = "http://www.w3.org/2000/svg";
const REFRESH_MS = 2000;
const DASH = "—";
const OPEN_STATES = ["warming_up", "open", "finalizing"];
const FILTERS = {
  all: () => true,
  open: (a) => OPEN_STATES.includes(a.state),
  finalized: (a) => a.state === "finalized",
  failed: (a) => a.state === "failed",
};

// DOM ------------------------------------------------------------------------------------------------------
function el(tag, attrs = {}, ...children) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) node.setAttribute(k, String(v));
  for (const child of children) {
    if (child === undefined || child === null) continue;
    node.append(typeof child === "string" || typeof child === "number" ? document.createTextNode(String(child)) : child);
  }
  return node;
}

// Numbers ----------------------------------------------------------------------------------------------------
const missing = (x) => x === undefined || x === null;
const num = (x) => (x === "inf" ? Infinity : x === "-inf" ? -Infinity : x === "nan" ? NaN : x);
function fmtCount(x) {
  return missing(x) ? DASH : Number(x).toLocaleString("en-US", { maximumFractionDigits: 0 });
}
function fmtNum(x) {
  x = num(x);
  if (missing(x)) return DASH;
  if (!Number.isFinite(x)) return Number.isNaN(x) ? "NaN" : x > 0 ? "∞" : "-∞";
  if (Math.abs(x) >= 1000) return x.toLocaleString("en-US", { maximumFractionDigits: 1 });
  return String(Number(x.toPrecision(4)));
}
const pct = (x) => (missing(x) ? DASH : (100 * x).toFixed(1) + "%");
function fmtBytes(n) {
  if (missing(n)) return DASH;
  const units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i ? `${n.toFixed(1)} ${units[i]}` : `${n} B`;
}
function fmtDuration(s) {
  if (missing(s)) return DASH;
  s = Math.max(0, Math.floor(s));
  const d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24, m = Math.floor(s / 60) % 60, sec = s % 60;
  if (d) return `${d} d ${h} h`;
  if (h) return `${h} h ${m} min`;
  if (m) return `${m} min ${sec} s`;
  return `${sec} s`;
}
const two = (n) => String(n).padStart(2, "0");
function fmtTime(unix) {  // local time, unambiguous
  if (missing(unix)) return DASH;
  const d = new Date(unix * 1000);
  return `${d.getFullYear()}-${two(d.getMonth() + 1)}-${two(d.getDate())} ${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`;
}
const fmtClock = (unix) => { const d = new Date(unix * 1000); return `${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`; };
const yesNo = (x) => (missing(x) ? DASH : x ? "yes" : "no");

// An element showing one value of the API: its text formatted, data-value the API's own (absent: "—").
function value(attr, key, v, format = fmtNum, tag = "span") {
  return el(tag, { [attr]: key, "data-value": missing(v) ? null : typeof v === "object" ? JSON.stringify(v) : v },
    missing(v) ? DASH : format(v));
}
function stat(key, label, v, format = fmtNum) {
  const node = value("data-number", key, v, format, "div");
  const shown = node.textContent;
  node.replaceChildren(el("b", {}, shown), label);
  return node;
}
function gauge(used, limit) {
  if (missing(used) || missing(limit) || !(num(limit) > 0)) return null;
  const f = Math.min(1, used / num(limit));
  return el("span", { class: f > 0.9 ? "gauge high" : "gauge", title: pct(f) }, el("span", { style: `width:${100 * f}%` }));
}
const get = (obj, path) => path.split(".").reduce((o, k) => (missing(o) ? undefined : o[k]), obj);

// Charts (SVG) ----------------------------------------------------------------------------------------------------
// Round tick values from 0 to at least max: about n of them, steps of 1, 2 or 5 times a power of ten.
function ticks(max, n = 4) {
  if (!(max > 0)) return [0, 1];
  const raw = max / n, p = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * p).find((s) => s >= raw);
  const out = [];
  for (let v = 0; v < max + step - 1e-9 * step; v += step) out.push(Number(v.toPrecision(12)));
  if (out.length < 2) out.push(step);
  return out;
}
// An SVG of this size that shrinks with its column (viewBox).
function chart(width, height, attrs) {
  return el("svg:svg", { width, height, viewBox: `0 0 ${width} ${height}`, ...attrs });
}
function yAxis(svg, box, values, title) {
  const top = values[values.length - 1];
  for (const v of values) {
    const y = box.y + box.h - (box.h * v) / top;
    svg.append(el("svg:line", { x1: box.x, x2: box.x + box.w, y1: y, y2: y, class: v ? "grid" : "axis" }));
    svg.append(el("svg:text", { x: box.x - 4, y: y + 3, "text-anchor": "end", class: "tick" }, fmtNum(v)));
  }
  svg.append(el("svg:line", { x1: box.x, x2: box.x, y1: box.y, y2: box.y + box.h, class: "axis" }));
  svg.append(el("svg:text", { x: 10, y: box.y + box.h / 2, "text-anchor": "middle", class: "title",
    transform: `rotate(-90 10 ${box.y + box.h / 2})` }, title));
}

function clipFractionChart(agg) {
  const rowH = 18, labelW = 120, width = 420, barW = width - labelW - 110, axisH = 16;
  const rows = agg.layers.length;
  const svg = chart(width, rowH * rows + 4 + axisH, { class: "clip-fraction" });
  agg.layers.forEach((layer, i) => {
    const y = i * rowH + 2;
    svg.append(el("svg:text", { x: 0, y: y + 12 }, layer.name.length > 18 ? layer.name.slice(0, 17) + "…" : layer.name));
    svg.append(el("svg:rect", { x: labelW, y, width: barW, height: rowH - 4, fill: "#eef2f7" }));
    svg.append(el("svg:rect", {
      x: labelW, y, width: Math.max(0, barW * Math.min(1, layer.clip_fraction)), height: rowH - 4,
      class: "bar over", "data-layer": layer.name, "data-clipped": layer.clipped,
    }, el("svg:title", {}, `${layer.name}: ${layer.clipped} of ${agg.examples} examples clipped`)));
    svg.append(el("svg:text", { x: labelW + barW + 6, y: y + 12, class: "value" },
      `${pct(layer.clip_fraction)} (${fmtCount(layer.clipped)})`));
  });
  const y = rows * rowH + 4;
  svg.append(el("svg:line", { x1: labelW, x2: labelW + barW, y1: y, y2: y, class: "axis" }));
  for (const f of [0, 0.25, 0.5, 0.75, 1]) {
    svg.append(el("svg:line", { x1: labelW + barW * f, x2: labelW + barW * f, y1: y, y2: y + 3, class: "axis" }));
    svg.append(el("svg:text", { x: labelW + barW * f, y: y + 13, "text-anchor": "middle", class: "tick" }, `${100 * f}%`));
  }
  return svg;
}

// A bucket edge in units of the bound: 1/64, 1/16, 1/8, 1/4, 1/2, 0.75, ... 64.
function edgeLabel(x) {
  if (x > 0 && x < 1 && Number.isInteger(1 / x)) return `1/${1 / x}`;
  return String(x);
}

// Counts per bucket of norm / bound: bucket i holds (edges[i-1], edges[i]], the last one (edges[n-2], ∞).
function histogramChart(counts, edges, bound, label, yTitle = "examples") {
  const width = 440, height = 190, box = { x: 46, y: 14, w: width - 56, h: height - 14 - 48 };
  const n = counts.length, bw = box.w / n, at = (j) => box.x + j * bw;
  const values = ticks(Math.max(...counts, 0)), top = values[values.length - 1];
  const svg = chart(width, height, { class: "histogram", "data-label": label });
  yAxis(svg, box, values, yTitle);
  const boundIndex = edges.indexOf(1.0);
  counts.forEach((c, i) => {
    const h = (box.h * Math.max(0, c)) / top;
    const range = i === 0 ? `≤ ${edgeLabel(edges[0])}` : i === n - 1 ? `> ${edgeLabel(edges[i - 1])}`
      : `${edgeLabel(edges[i - 1])} – ${edgeLabel(edges[i])}`;
    svg.append(el("svg:rect", { x: at(i) + 1, y: box.y + box.h - h, width: Math.max(1, bw - 2), height: h,
      class: boundIndex >= 0 && i > boundIndex ? "bar over" : "bar", "data-bucket": i, "data-count": c },
      el("svg:title", {}, `norm / bound ${range}: ${fmtNum(c)}`)));
  });
  const bottom = box.y + box.h;
  svg.append(el("svg:line", { x1: box.x, x2: box.x + box.w, y1: bottom, y2: bottom, class: "axis" }));
  for (let j = 0; j <= n; j++) {  // an edge between buckets j-1 and j; staggered so the labels don't collide
    svg.append(el("svg:line", { x1: at(j), x2: at(j), y1: bottom, y2: bottom + 3, class: "axis" }));
    svg.append(el("svg:text", { x: at(j), y: bottom + (j % 2 ? 24 : 13), "text-anchor": "middle", class: "tick" },
      j === 0 ? "0" : j === n ? "∞" : edgeLabel(edges[j - 1])));
  }
  if (boundIndex >= 0) {
    const x = at(boundIndex + 1);
    svg.append(el("svg:line", { x1: x, x2: x, y1: box.y - 6, y2: bottom, class: "bound" }));
    svg.append(el("svg:text", { x: x + 4, y: box.y - 2 }, `bound = ${fmtNum(bound)}`));
  }
  svg.append(el("svg:text", { x: box.x + box.w / 2, y: height - 4, "text-anchor": "middle", class: "title" },
    "norm / bound (bucket edges)"));
  return svg;
}

// Examples per second, second by second, as the server recorded them (the same on every load).
function throughputChart(tp) {
  const points = tp.points, width = 720, height = 220, box = { x: 56, y: 12, w: width - 92, h: height - 12 - 44 };
  const svg = chart(width, height, { class: "throughput", "data-points": points.length,
    "data-peak": tp.peak_examples_per_second });
  const t0 = points.length ? points[0].t : 0, t1 = points.length ? Math.max(points[points.length - 1].t, t0 + 1) : 1;
  const values = ticks(tp.peak_examples_per_second), top = values[values.length - 1];
  yAxis(svg, box, values, "examples/s");
  const x = (t) => box.x + (box.w * (t - t0)) / (t1 - t0), y = (v) => box.y + box.h - (box.h * v) / top;
  const bottom = box.y + box.h;
  svg.append(el("svg:line", { x1: box.x, x2: box.x + box.w, y1: bottom, y2: bottom, class: "axis" }));
  const span = t1 - t0, step = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400]
    .find((s) => span / s <= 6) || 86400;
  for (let t = Math.ceil(t0 / step) * step; t <= t1; t += step) {
    svg.append(el("svg:line", { x1: x(t), x2: x(t), y1: bottom, y2: bottom + 3, class: "axis" }));
    svg.append(el("svg:text", { x: x(t), y: bottom + 14, "text-anchor": "middle", class: "tick" }, fmtClock(t)));
  }
  svg.append(el("svg:text", { x: box.x + box.w / 2, y: height - 4, "text-anchor": "middle", class: "title" },
    "server time (local)"));
  if (points.length) {
    svg.append(el("svg:path", { class: "line",
      d: points.map((p, i) => `${i ? "L" : "M"}${x(p.t).toFixed(1)},${y(p.examples_per_second).toFixed(1)}`).join(" ") }));
    for (const p of points) {  // a dot on each second when they are few, and on the peak
      if (points.length <= 120 || (p.examples_per_second === tp.peak_examples_per_second && p.examples_per_second > 0)) {
        svg.append(el("svg:circle", { cx: x(p.t), cy: y(p.examples_per_second), r: 3, class: "dot" },
          el("svg:title", {}, `${fmtClock(p.t)}: ${fmtNum(p.examples_per_second)} examples/s`)));
      }
    }
  }
  return svg;
}

// The server -----------------------------------------------------------------------------------------------------
function serverPanel(s) {
  const sv = (path, format = fmtCount) => value("data-server", path, get(s, path), format);
  const row = (label, ...cells) => [el("dt", {}, label), el("dd", {}, ...cells)];
  const kv = el("dl", { class: "kv" },
    ...row("serving", sv("serving", yesNo)),
    ...row("up", sv("uptime_seconds", fmtDuration), " since ", sv("started_unix_seconds", fmtTime)),
    ...row("Submit streams", sv("streams.active"), " open of ", sv("streams.limit"),
      gauge(get(s, "streams.active"), get(s, "streams.limit")), " · ", sv("streams.refused"), " refused"),
    ...row("buffered bytes", sv("buffered_bytes.used", fmtBytes), " of ", sv("buffered_bytes.limit", fmtBytes),
      gauge(get(s, "buffered_bytes.used"), get(s, "buffered_bytes.limit"))),
    ...row("refused batches", sv("refused_batches")),
    ...row("restarts", sv("restarts")),
    ...row("payload received", sv("payload_bytes_received", fmtBytes), " by this process · ",
      sv("shard_payload_bytes", fmtBytes), " by its shard processes"),
    ...row("queue", sv("queue_depth"), " items, ", sv("queued_bytes", fmtBytes)));
  const node = el("section", { class: "panel", id: "server" }, el("h2", {}, "Server"), kv);
  node.append(el("h3", {}, "rejected requests, by gRPC code"), countsTable(s.rejections, "data-rejection", "code"));
  node.append(el("h3", {}, "participation refusals, by ledger"),
    countsTable(s.participation_refusals, "data-refusals", "ledger"));
  node.append(el("h3", {}, "devices"));
  const devices = s.devices || [];
  node.append(table(["device", "kind", "platform", "steps", "process"], devices.map((d) => el("tr", { "data-device": d.id },
    el("td", {}, String(d.id)), el("td", {}, d.kind ?? DASH), el("td", {}, d.platform ?? DASH),
    el("td", {}, value("data-col", "steps", d.steps, fmtCount)), el("td", {}, missing(d.process) ? DASH : String(d.process))))));
  if (!missing(s.shard_processes) && s.shard_processes.length) {
    node.append(el("h3", {}, "shard processes"));
    node.append(table(["#", "pid", "alive", "serving", "restarts", "endpoint", "calls", "streams", "refused",
      "buffered", "refused batches", "rejected", "payload"], s.shard_processes.map(processRow)));
  }
  return node;
}
function processRow(p) {
  const c = (key, v, format = fmtCount) => el("td", {}, value("data-col", key, v, format));
  const rejected = missing(p.rejections) ? null : Object.values(p.rejections).reduce((a, b) => a + b, 0);
  return el("tr", { "data-process": p.index },
    el("td", {}, String(p.index)), c("pid", p.pid, String), c("alive", p.alive, yesNo), c("serving", p.serving, yesNo),
    c("restarts", p.restarts), el("td", {}, p.endpoint ?? DASH), c("calls", p.calls),
    el("td", {}, value("data-col", "streams.active", get(p, "streams.active"), fmtCount), " / ",
      value("data-col", "streams.limit", get(p, "streams.limit"), fmtCount)),
    c("streams.refused", get(p, "streams.refused")),
    el("td", {}, value("data-col", "buffered_bytes.used", get(p, "buffered_bytes.used"), fmtBytes), " / ",
      value("data-col", "buffered_bytes.limit", get(p, "buffered_bytes.limit"), fmtBytes)),
    c("refused_batches", p.refused_batches), c("rejected", rejected), c("payload_bytes", p.payload_bytes, fmtBytes));
}
function countsTable(counts, attr, what) {
  if (missing(counts)) return el("p", { class: "muted", [attr]: "" }, DASH);
  const keys = Object.keys(counts).sort();
  if (!keys.length) return el("p", { class: "muted" }, "none");
  return table([what, "count"], keys.map((k) => el("tr", {}, el("td", {}, k),
    el("td", {}, value(attr, k, counts[k], fmtCount)))));
}
function table(headers, rows) {
  return el("div", { class: "scroll" }, el("table", {}, el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", {}, h)))),
    el("tbody", {}, ...rows)));
}

// Ledgers -------------------------------------------------------------------------------------------------------
function ledgerPanel(ledgers) {
  const node = el("section", { class: "panel", id: "ledgers" }, el("h2", {}, "Privacy ledgers"));
  if (!ledgers.length) {
    node.append(el("p", { class: "muted" }, "No ledger yet: the first aggregation with a privacy policy makes its ledger."));
    return node;
  }
  node.append(...ledgers.map(ledgerBlock));
  return node;
}
// A ledger: epsilon spent against its budget (a bar), delta, releases, its mechanism and correlated stream.
function ledgerBlock(l) {
  const lv = (key, v, format = fmtNum) => el("b", {}, value("data-ledger-field", key, v, format));
  const budget = num(l.max_epsilon), spent = num(l.epsilon), stream = l.stream;
  const bar = Number.isFinite(budget) && budget > 0 ? gauge(Number.isFinite(spent) ? spent : budget, budget) : null;
  return el("div", { class: "ledger", "data-ledger": l.ledger_id },
    el("h4", {}, l.ledger_id, l.debug_raw_statistics ? el("span", { class: "error" }, " debug: ε is infinite") : null),
    el("div", {}, "ε ", lv("epsilon", l.epsilon), " spent of ",
      Number.isFinite(budget) ? lv("max_epsilon", l.max_epsilon) : lv("max_epsilon", l.max_epsilon, () => "no budget"),
      bar, Number.isFinite(budget) ? el("span", { class: "muted" }, " · left ", lv("budget_left", l.budget_left)) : null),
    el("div", { class: "meta" },
      el("span", {}, "δ ", lv("delta", l.delta, String)),
      el("span", {}, "per ", lv("unit", l.unit ?? "example", String)),
      l.client_ids ? el("span", { class: l.client_ids === "self_asserted" ? "error" : "" }, "client ids ",
        lv("client_ids", l.client_ids, clientIds)) : null,
      el("span", {}, lv("entries", missing(l.entries) ? null : l.entries.length, fmtCount), " releases"),
      el("span", {}, lv("mechanism", l.mechanism ?? "independent", String),
        stream ? el("span", {}, " stream: ", lv("stream.made", stream.made, fmtCount), " made, ",
          lv("stream.left", stream.left, fmtCount), " left of ", lv("stream.releases", stream.releases, fmtCount)) : null),
      el("span", {}, lv("participation_refusals", l.participation_refusals, fmtCount), " participation refusals")),
    l.audit ? auditLine(l.audit, lv) : null);
}
// A ledger's canary audit: open (its canaries and the releases it covers), or closed: the empirical lower bound on
// ε beside the ε claimed, at its confidence, and the most its canaries could show; refuted (a privacy bug) in red.
function auditLine(a, lv) {
  const covers = [" over ", lv("audit.releases", a.releases, fmtCount), " releases"];
  if (!a.closed) {
    return el("div", { class: "meta", "data-audit": "open" }, el("span", {}, "audit open: ",
      lv("audit.canaries", a.canaries, fmtCount), " canaries", ...covers));
  }
  return el("div", { class: a.refuted ? "meta error" : "meta", "data-audit": a.refuted ? "refuted" : "closed" },
    el("span", {}, a.refuted ? "audit REFUTES the claim: ε ≥ " : "audit: ε ≥ ", lv("audit.epsilon_lower", a.epsilon_lower),
      " against ε ", lv("audit.epsilon_claimed", a.epsilon_claimed), " claimed"),
    el("span", {}, "at ", lv("audit.confidence", a.confidence, (v) => `${(100 * v).toFixed(0)}%`), " confidence, ",
      lv("audit.canaries", a.canaries, fmtCount), " canaries", ...covers,
      " (they can show at most ", lv("audit.epsilon_ceiling", a.epsilon_ceiling), ")"));
}

// Buffered streams ----------------------------------------------------------------------------------------------
function streamPanel(streams) {
  const node = el("section", { class: "panel", id: "streams" }, el("h2", {}, "Buffered streams"));
  if (!streams.length) {
    node.append(el("p", { class: "muted" }, "No buffered stream: Client.create_stream makes one."));
    return node;
  }
  node.append(...[...streams].sort((a, b) => (b.created_unix_seconds ?? 0) - (a.created_unix_seconds ?? 0)).map(streamBlock));
  return node;
}
// A buffered stream (FedBuff): its state (a stopped one's reason in red), the newest version released, the open
// buffer's fill (a bar), releases per minute, its contributions' staleness (the mean, and the count at each
// staleness), its ledger's ε against the budget, and each client's limits (k participations, b versions apart).
function streamBlock(s) {
  const sv = (key, format = fmtNum) => el("b", {}, value("data-stream-field", key, get(s, key), format));
  const state = value("data-stream-field", "state", s.state, String);
  state.setAttribute("class", `state ${s.state === "stopped" ? "stopped" : "open"}`);
  const budget = num(s.max_epsilon), spent = num(s.ledger_epsilon);
  const bar = Number.isFinite(budget) && budget > 0 ? gauge(Number.isFinite(spent) ? spent : budget, budget) : null;
  return el("div", { class: "stream", "data-stream": s.stream_id },
    el("h4", {}, s.stream_id, " ", state),
    s.state === "stopped" ? el("div", { class: "error" }, "stopped: ",
      value("data-stream-field", "reason", s.reason || null, String)) : null,
    el("div", {}, "version ", sv("version", fmtCount), " released · buffer ", sv("buffer.filled", fmtCount), " of ",
      sv("buffer.size", fmtCount), " filled", gauge(get(s, "buffer.filled"), get(s, "buffer.size")), " for version ",
      sv("filling_version", fmtCount)),
    el("div", { class: "meta" },
      el("span", {}, sv("releases_per_minute"), " releases/min"),
      el("span", {}, "staleness mean ", sv("staleness.mean"), " over ", sv("staleness.contributions", fmtCount),
        " contributions"),
      el("span", {}, "weight (1 + τ)^-", sv("staleness.exponent"), ", τ ≤ ", sv("staleness.max", fmtCount)),
      missing(s.last_version) ? null : el("span", {}, "last version ", sv("last_version", fmtCount))),
    stalenessCounts(get(s, "staleness.by_staleness")),
    el("div", { class: "meta" },
      el("span", {}, "ledger ", sv("ledger_id", String), " · ε ", sv("ledger_epsilon"), " of ",
        Number.isFinite(budget) ? sv("max_epsilon") : sv("max_epsilon", () => "no budget"), bar),
      el("span", {}, "noise ", sv("mechanism", String)),
      el("span", {}, "each client: k = ", sv("participation.max_participations", fmtCount), " participations, b = ",
        sv("participation.min_separation", fmtCount), " min separation"),
      el("span", {}, "created ", sv("created_unix_seconds", fmtTime))));
}
// Contributions by staleness (the API's counts, keyed by staleness): a small bar above each count.
function stalenessCounts(counts) {
  if (missing(counts)) return el("div", { class: "muted", "data-staleness": "" }, "by staleness ", DASH);
  const keys = Object.keys(counts).sort((a, b) => Number(a) - Number(b));
  if (!keys.length) return el("div", { class: "muted" }, "no contribution yet");
  const top = Math.max(...keys.map((k) => Number(counts[k]) || 0), 1);
  return el("div", { class: "staleness", title: "contributions by staleness τ (versions behind)" },
    el("span", { class: "muted" }, "by staleness"),
    ...keys.map((k) => el("span", { class: "tau" },
      el("span", { class: "bar", style: `height:${Math.round((24 * Math.max(0, Number(counts[k]) || 0)) / top)}px` }),
      value("data-staleness", k, counts[k], fmtCount), el("span", { class: "muted" }, `τ=${k}`))));
}

// Aggregations --------------------------------------------------------------------------------------------------
const detailHash = (id) => `#/aggregations/${encodeURIComponent(id)}`;

function policyLine(agg) {
  const p = agg.policy;
  return el("div", { class: "muted" },
    `${p.kind} · C = ${p.kind === "per_layer_explicit" ? p.layer_clips.join(", ") : p.l2_norm_clip}` +
    `${p.rescale_to_unit_norm ? " · unit rescale" : ""} · non-finite: ${p.non_finite}`);
}
function metaLine(agg, now) {
  const m = (label, key, v, format) => el("span", {}, `${label} `, el("b", {}, value("data-field", key, v, format)));
  const end = agg.finished_unix_seconds;
  return el("div", { class: "meta" },
    m("created", "created", agg.created_unix_seconds, fmtTime),
    m("age", "age", missing(now) ? null : now - agg.created_unix_seconds, fmtDuration),
    missing(end) ? null : m(agg.state === "failed" ? "failed after" : "finished after", "ran", end - agg.created_unix_seconds, fmtDuration),
    agg.privacy ? m("ledger", "ledger", agg.privacy.ledger_id, String) : null,
    m("unit", "unit", agg.unit ?? "example", String),
    agg.client_ids ? m("client ids", "client_ids", agg.client_ids, clientIds) : null);
}
// How client ids are established where they count (unit client, an enforced participation).
function clientIds(v) {
  return v === "self_asserted" ? "self-asserted (a client may rename itself)" : v === "credential" ? "from credentials" : "not counted";
}
function clippedFraction(agg) {
  if (!agg.examples) return 0;
  return agg.clipped / (agg.examples * (agg.policy.kind === "global" ? 1 : agg.layers.length));
}
function rawNumbers(agg) {
  return el("div", { class: "numbers" },
    stat("clients", "clients", agg.clients, fmtCount), stat("examples", "examples", agg.examples, fmtCount),
    stat("batches", "batches", agg.batches, fmtCount),
    OPEN_STATES.includes(agg.state) ? stat("rate", "examples/s now", agg.examples_per_second) : null,
    stat("clipped", "clipped", clippedFraction(agg), pct), stat("non-finite", "non-finite", agg.non_finite, fmtCount),
    stat("bytes", "received", agg.bytes, fmtBytes));
}
// A private aggregation shows no raw number: once released, its noised ones and its epsilon.
function privateNumbers(agg) {
  const r = agg.privacy.release, numbers = el("div", { class: "numbers" });
  if (r) {
    numbers.append(stat("ledger-epsilon", "ε of the ledger", r.ledger_epsilon), stat("noise", "noise stddev", r.noise_stddev),
      stat("bound", "bound", r.bound), stat("next-bound", "next bound", r.next_bound));
    if (r.mechanism) numbers.append(stat("stream-release", `${r.mechanism} stream: release ${r.stream_release + 1} of ${r.stream_releases}`,
      r.stream_release + 1, fmtCount));
    if (r.statistics_noise_stddev > 0) numbers.append(stat("released-examples", "examples (noised)", r.examples));
  } else {
    numbers.append(stat("planned-epsilon", "ε once released", agg.privacy.planned_ledger_epsilon));
  }
  return numbers;
}
const released = (agg) => agg.privacy && agg.privacy.release && agg.privacy.release.statistics_noise_stddev > 0;
function exampleHistogram(agg) {
  if (agg.examples !== null) {
    return histogramChart(agg.example_norm_histogram, agg.bucket_upper_bounds, agg.example_bound, "example");
  }
  return histogramChart(agg.privacy.release.example_norm_histogram, agg.bucket_upper_bounds, agg.example_bound,
    "example", "examples (noised)");
}
function header(agg, tag = "h2", link = true) {
  const id = agg.aggregation_id;
  return el(tag, {}, link ? el("a", { href: detailHash(id), class: "id" }, id) : el("span", { class: "id" }, id),
    el("span", { class: `state ${agg.state}` }, agg.state));
}
function notices(agg) {
  const out = [];
  if (agg.privacy) {
    const pv = agg.privacy;
    out.push(el("div", { class: pv.debug_raw_statistics ? "debug" : "muted", "data-privacy": "notice" }, pv.notice));
  }
  if (agg.failure_reason) out.push(el("div", { class: "error", "data-field": "failure" }, `failed: ${agg.failure_reason}`));
  return out;
}

function card(agg, now) {
  const node = el("section", { class: "card", "data-aggregation": agg.aggregation_id, "data-state": agg.state });
  node.addEventListener("click", (e) => { if (!e.target.closest("a")) location.hash = detailHash(agg.aggregation_id); });
  node.append(header(agg), metaLine(agg, now), policyLine(agg), ...notices(agg));
  if (agg.examples === null) {
    node.append(privateNumbers(agg));
    if (released(agg)) {
      node.append(el("div", { class: "charts" }, el("div", {}, el("h3", {}, "example norm vs bound (noised)"), exampleHistogram(agg))));
    }
    return node;
  }
  if (agg.privacy && agg.privacy.release) node.append(privateNumbers(agg));
  node.append(rawNumbers(agg));
  node.append(el("div", { class: "charts" },
    el("div", {}, el("h3", {}, "clip fraction per layer"), clipFractionChart(agg)),
    el("div", {}, el("h3", {}, "example norm vs bound"), exampleHistogram(agg))));
  return node;
}

function overview(data, server, ledgers, streams, filter) {
  const view = [];
  view.push(el("div", { class: "panels" }, serverPanel(server), ledgerPanel(ledgers.ledgers || []),
    streamPanel(streams.streams || [])));
  const all = [...data.aggregations].sort((a, b) => b.created_unix_seconds - a.created_unix_seconds);
  const filters = el("nav", { class: "filters", id: "filters" }, el("b", {}, "Aggregations"));
  for (const [name, keep] of Object.entries(FILTERS)) {
    filters.append(el("a", { href: name === "all" ? "#/" : `#filter=${name}`, "data-filter": name,
      class: name === filter ? "active" : null }, `${name} `, el("span", { "data-count": name }, String(all.filter(keep).length))));
  }
  const shown = all.filter(FILTERS[filter]);
  const cards = el("div", { class: "cards", id: "aggregations", "data-filter": filter });
  for (const agg of shown) cards.append(card(agg, data.now_unix_seconds));
  if (!all.length) cards.append(document.getElementById("empty").content.cloneNode(true));
  else if (!shown.length) cards.append(el("p", { class: "muted" }, `No ${filter} aggregation.`));
  view.push(filters, cards);
  return view;
}

// One aggregation -----------------------------------------------------------------------------------------------
function layerTable(agg) {
  const r = agg.privacy && agg.privacy.release, raw = agg.examples !== null;
  const headers = ["layer", "shape", "dtype", "bound", raw ? "clipped" : "clipped (noised)", "clip fraction",
    "norm mean", "norm max", "p50 norm / bound", "p90", "p99"];
  const rows = agg.layers.map((layer, i) => {
    const c = (key, v, format = fmtNum) => el("td", {}, value("data-col", key, v, format));
    const q = layer.norm_ratio_quantiles || {};
    const clipped = raw ? layer.clipped : r && r.statistics_noise_stddev > 0 ? r.layer_clipped[i] : null;
    return el("tr", { "data-layer": layer.name },
      el("td", {}, layer.name), el("td", {}, `(${layer.shape.join(", ")})`), el("td", {}, layer.dtype),
      c("bound", layer.bound), c("clipped", clipped, raw ? fmtCount : fmtNum), c("clip_fraction", layer.clip_fraction, pct),
      c("norm_mean", layer.norm_mean), c("norm_max", layer.norm_max),
      c("p50", q["0.5"]), c("p90", q["0.9"]), c("p99", q["0.99"]));
  });
  return table(headers, rows);
}
const RELEASE_FIELDS = [["ledger_id", "ledger", String], ["epsilon", "ε of this release"], ["ledger_epsilon", "ε of the ledger after it"],
  ["delta", "δ", String], ["budget_left", "budget left"], ["ledger_releases", "releases of the ledger", fmtCount],
  ["noise_multiplier", "noise multiplier"], ["noise_stddev", "noise stddev (sum)"], ["sensitivity", "sensitivity"],
  ["bound", "bound"], ["next_bound", "next bound"], ["statistics_noise_stddev", "noise stddev (statistics)"],
  ["examples", "examples (noised)"], ["unclipped_fraction", "unclipped fraction (noised)"],
  ["mechanism", "correlated stream", String], ["stream_noise_stddev", "stream's noise stddev (sigma)"],
  ["unit", "unit (what ε protects)", String], ["client_ids", "client ids", clientIds],
  ["seeded", "seeded (not private: tests only)", yesNo]];
function releaseList(r) {
  const dl = el("dl", { class: "kv", id: "release" });
  for (const [key, label, format = fmtNum] of RELEASE_FIELDS) {
    if (missing(r[key])) continue;
    dl.append(el("dt", {}, label), el("dd", {}, value("data-release", key, r[key], format)));
  }
  return dl;
}

function detail(agg, tp, now) {
  const node = el("section", { class: "panel", id: "detail", "data-detail": agg.aggregation_id });
  node.append(el("p", {}, el("a", { href: "#/" }, "← all aggregations")), header(agg, "h2", false), metaLine(agg, now),
    policyLine(agg), ...notices(agg));
  node.append(agg.examples === null ? privateNumbers(agg) : rawNumbers(agg));
  node.append(el("h3", {}, "layers"), layerTable(agg));
  node.append(el("h3", {}, "examples per second"));
  if (tp.withheld) node.append(el("p", { class: "notice", "data-throughput": "withheld" }, tp.withheld));
  else if (!tp.points.length) {
    node.append(el("p", { class: "muted", "data-throughput": "empty" }, agg.examples
      ? "None recorded: its examples were summed before this server started (it records them as they are summed)."
      : "No example yet."));
  }
  else {
    node.append(throughputChart(tp), el("p", { class: "muted", "data-throughput": "caption" },
      `peak ${fmtNum(tp.peak_examples_per_second)} examples/s · ${tp.points.length} points, one for each second in which ` +
      `examples were summed (the last ${tp.kept_seconds} such seconds${tp.truncated ? ": older ones dropped out" : ""}), ` +
      "0 on each side of an idle gap · recorded by the server"));
  }
  const charts = el("div", { class: "charts" });
  if (agg.examples !== null || released(agg)) {
    charts.append(el("div", {}, el("h3", {}, agg.examples === null ? "example norm vs bound (noised)" : "example norm vs bound"),
      exampleHistogram(agg)));
  }
  if (agg.examples !== null) {
    charts.append(el("div", {}, el("h3", {}, "clip fraction per layer"), clipFractionChart(agg)));
    for (const layer of agg.layers) {
      charts.append(el("div", {}, el("h3", {}, `layer ${layer.name}: norm vs bound`),
        histogramChart(layer.norm_histogram, agg.bucket_upper_bounds, layer.bound, `layer:${layer.name}`)));
    }
  }
  node.append(charts);
  if (agg.privacy) {
    node.append(el("h3", {}, "release"));
    node.append(agg.privacy.release ? releaseList(agg.privacy.release)
      : el("p", { class: "muted", id: "release" }, `not released yet: ε of ledger ${agg.privacy.ledger_id} once released: ` +
        fmtNum(agg.privacy.planned_ledger_epsilon)));
  }
  return node;
}

// Loading and routing ------------------------------------------------------------------------------------------
class SignIn extends Error {}
async function getJSON(path, allow404 = false) {
  // Same-origin: the session cookie set by /login goes along (the token never appears in a URL).
  const response = await fetch(path, { credentials: "same-origin" });
  if (response.status === 401 || response.status === 403) throw new SignIn();
  if (allow404 && response.status === 404) return { notFound: (await response.json()).detail };
  if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
  return response.json();
}
function route() {
  const hash = location.hash;
  const m = hash.match(/^#\/aggregations\/(.+)$/);
  if (m) return { view: "detail", id: decodeURIComponent(m[1]) };
  const f = hash.match(/^#filter=(\w+)$/);
  return { view: "overview", filter: f && FILTERS[f[1]] ? f[1] : "all" };
}

let generation = 0, signingIn = false, timer = null;
async function refresh() {
  if (signingIn) return;
  const status = document.getElementById("status"), r = route(), mine = ++generation;
  try {
    const list = getJSON("/api/v1/aggregations");
    let nodes;
    if (r.view === "detail") {
      const path = `/api/v1/aggregations/${encodeURIComponent(r.id)}`;
      const [data, agg, tp] = await Promise.all([list, getJSON(path, true), getJSON(`${path}/throughput`, true)]);
      if (mine !== generation) return;
      banner(data);
      nodes = agg.notFound ? [el("section", { class: "panel", id: "detail" }, el("p", {}, el("a", { href: "#/" }, "← all aggregations")),
        el("p", { class: "error" }, agg.notFound))] : [detail(agg, tp, data.now_unix_seconds)];
    } else {
      const [data, server, ledgers, streams] = await Promise.all([list, getJSON("/api/v1/server"),
        getJSON("/api/v1/ledgers"), getJSON("/api/v1/streams")]);
      if (mine !== generation) return;
      banner(data);
      nodes = overview(data, server, ledgers, streams, r.filter);
    }
    document.getElementById("view").replaceChildren(...nodes);
    status.textContent = `updated ${fmtClock(Date.now() / 1000)}`;
    status.dataset.loaded = "true";
  } catch (e) {
    if (e instanceof SignIn) {  // stop polling; the form posts to /login, which sets the session cookie
      clearInterval(timer);
      signingIn = true;
      document.getElementById("view").replaceChildren(signInForm());
      status.textContent = "signed out";
      return;
    }
    status.textContent = `cannot reach the admin API: ${e.message}`;
  }
}
function signInForm() {
  return el("section", { class: "panel", id: "sign-in" }, el("h2", {}, "Sign in"),
    el("p", { class: "muted" }, "This server's admin API needs its admin token. Signing in keeps it in a session cookie, never in a URL."),
    el("form", { method: "post", action: "/login" },
      el("label", {}, "Admin token ", el("input", { type: "password", name: "token", autocomplete: "current-password" })), " ",
      el("button", { type: "submit" }, "Sign in")));
}
function banner(data) {
  document.getElementById("device").textContent = `device: ${data.device_kind}`;
  const debug = document.getElementById("privacy-debug");
  debug.textContent = data.privacy_debug_notice;
  debug.hidden = !data.privacy_debug_notice;
}
window.addEventListener("hashchange", refresh);
refresh();
timer = setInterval(refresh, REFRESH_MS);
