// clipd dashboard: polls /api/v1/aggregations and draws, per aggregation, the clip fraction per
// layer, the example norm histogram against the bound, and examples/s over time. No dependencies.
"use strict";
const SVG = "http://www.w3.org/2000/svg";
const history = new Map();  // aggregation id -> [{t, rate}]

function el(tag, attrs = {}, text) {
  const node = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  return node;
}
const pct = (x) => (100 * x).toFixed(1) + "%";
const fmt = (x) => (typeof x === "number" ? x.toLocaleString("en-US", { maximumFractionDigits: 1 }) : x);

function clipFractionChart(agg) {
  const rowH = 18, labelW = 110, width = 400, barW = width - labelW - 110;
  const svg = el("svg:svg", { width, height: rowH * agg.layers.length + 4, class: "clip-fraction" });
  agg.layers.forEach((layer, i) => {
    const y = i * rowH + 2;
    svg.append(el("svg:text", { x: 0, y: y + 12 }, layer.name));
    svg.append(el("svg:rect", { x: labelW, y, width: barW, height: rowH - 4, fill: "#eef2f7" }));
    svg.append(el("svg:rect", {
      x: labelW, y, width: Math.max(0, barW * layer.clip_fraction), height: rowH - 4,
      class: "bar over", "data-layer": layer.name, "data-clipped": layer.clipped,
    }));
    svg.append(el("svg:text", { x: labelW + barW + 6, y: y + 12, class: "value" },
      `${pct(layer.clip_fraction)} (${layer.clipped})`));
  });
  return svg;
}

function histogramChart(counts, edges, bound, label) {
  const width = 360, height = 140, pad = 20, n = counts.length, bw = (width - pad) / n;
  const max = Math.max(1, ...counts);
  const svg = el("svg:svg", { width, height: height + 30, class: "histogram", "data-label": label });
  counts.forEach((c, i) => {
    const h = (height - 10) * c / max, over = i > edges.indexOf(1.0);
    const bar = el("svg:rect", { x: pad + i * bw + 1, y: height - h, width: bw - 2, height: h,
      class: over ? "bar over" : "bar", "data-bucket": i, "data-count": c });
    bar.append(el("svg:title", {}, `${i ? "> " + edges[i - 1] : "≤ " + edges[0]}× bound: ${c}`));
    svg.append(bar);
  });
  const boundX = pad + (edges.indexOf(1.0) + 1) * bw;
  svg.append(el("svg:line", { x1: boundX, x2: boundX, y1: 0, y2: height, class: "bound" }));
  svg.append(el("svg:text", { x: boundX + 3, y: 10 }, `bound ${bound}`));
  [0, edges.indexOf(1.0) + 1, n].forEach((i) => svg.append(el("svg:text", { x: pad + i * bw - 8, y: height + 14 },
    i === 0 ? "0" : i === n ? "∞" : "1×")));
  svg.append(el("svg:text", { x: pad, y: height + 28, class: "muted" }, "norm / bound"));
  return svg;
}

function rateChart(id) {
  const points = history.get(id) || [], width = 360, height = 80;
  const svg = el("svg:svg", { width, height: height + 16, class: "rate" });
  const max = Math.max(1, ...points.map((p) => p.rate));
  const path = points.map((p, i) => `${i ? "L" : "M"}${(width * i) / Math.max(1, points.length - 1)},${height - (height - 4) * p.rate / max}`);
  if (points.length > 1) svg.append(el("svg:path", { d: path.join(" "), class: "line" }));
  svg.append(el("svg:text", { x: 0, y: height + 14 }, `peak ${fmt(max)} examples/s`));
  return svg;
}

function card(agg) {
  const node = el("section", { class: "card", "data-aggregation": agg.aggregation_id });
  const title = el("h2", {}, agg.aggregation_id);
  title.append(el("span", { class: `state ${agg.state}` }, agg.state));
  node.append(title);
  const p = agg.policy;
  node.append(el("div", { class: "muted" },
    `${p.kind} · C = ${p.kind === "per_layer_explicit" ? p.layer_clips.join(", ") : p.l2_norm_clip}` +
    `${p.rescale_to_unit_norm ? " · unit rescale" : ""} · non-finite: ${p.non_finite}`));
  if (agg.privacy) {
    const pv = agg.privacy;
    node.append(el("div", { class: pv.debug_raw_statistics ? "debug" : "muted", "data-privacy": "notice" },
      `ledger ${pv.ledger_id} · ${pv.notice}`));
    if (agg.examples === null) return privateCard(node, agg);
  }
  const numbers = el("div", { class: "numbers" });
  const clipFrac = agg.examples ? agg.clipped / (agg.examples * (p.kind === "global" ? 1 : agg.layers.length)) : 0;
  for (const [name, value, key] of [["examples", fmt(agg.examples), "examples"],
      ["examples/s", fmt(agg.examples_per_second), "rate"], ["clipped", pct(clipFrac), "clipped"],
      ["non-finite", fmt(agg.non_finite), "non-finite"], ["batches", fmt(agg.batches), "batches"]]) {
    const d = el("div", { "data-number": key });
    d.append(el("b", {}, value), document.createTextNode(name));
    numbers.append(d);
  }
  node.append(numbers);
  const charts = el("div", { class: "charts" });
  const a = el("div"); a.append(el("h3", {}, "clip fraction per layer"), clipFractionChart(agg));
  const b = el("div"); b.append(el("h3", {}, "example norm vs bound"),
    histogramChart(agg.example_norm_histogram, agg.bucket_upper_bounds, agg.example_bound, "example"));
  const c = el("div"); c.append(el("h3", {}, "examples/s"), rateChart(agg.aggregation_id));
  charts.append(a, b, c);
  node.append(charts);
  return node;
}

// A private aggregation: no raw number; once released, its noised numbers and epsilon.
function privateCard(node, agg) {
  const r = agg.privacy.release;
  const numbers = el("div", { class: "numbers" });
  const rows = r ? [["ε of the ledger", fmt(r.ledger_epsilon), "ledger-epsilon"],
                    ["noise stddev", fmt(r.noise_stddev), "noise"], ["bound", fmt(r.bound), "bound"],
                    ["next bound", fmt(r.next_bound), "next-bound"]]
                 : [["ε once released", fmt(agg.privacy.planned_ledger_epsilon), "planned-epsilon"]];
  if (r && r.mechanism) rows.push([`${r.mechanism} stream: release ${r.stream_release + 1} of ${r.stream_releases}`,
                                   fmt(r.stream_release + 1), "stream-release"]);
  if (r && r.statistics_noise_stddev > 0) rows.push(["examples (noised)", fmt(r.examples), "released-examples"]);
  for (const [name, value, key] of rows) {
    const d = el("div", { "data-number": key });
    d.append(el("b", {}, value), document.createTextNode(name));
    numbers.append(d);
  }
  node.append(numbers);
  if (r && r.statistics_noise_stddev > 0) {
    const b = el("div", { class: "charts" });
    const h = el("div"); h.append(el("h3", {}, "example norm vs bound (noised)"),
      histogramChart(r.example_norm_histogram.map((v) => Math.max(0, v)), agg.bucket_upper_bounds,
                     agg.example_bound, "example"));
    b.append(h);
    node.append(b);
  }
  return node;
}

async function refresh() {
  const status = document.getElementById("status");
  try {
    // Same-origin: the session cookie set by /login goes along (the token never appears in a URL).
    const response = await fetch("/api/v1/aggregations", { credentials: "same-origin" });
    if (response.status === 401 || response.status === 403) {
      location.assign("/login");
      return;
    }
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const data = await response.json();
    document.getElementById("device").textContent = `device: ${data.device_kind}`;
    const debug = document.getElementById("privacy-debug");
    debug.textContent = data.privacy_debug_notice;
    debug.hidden = !data.privacy_debug_notice;
    const main = document.getElementById("aggregations");
    main.replaceChildren();
    for (const agg of data.aggregations) {
      const points = history.get(agg.aggregation_id) || [];
      points.push({ t: Date.now(), rate: agg.examples_per_second });
      history.set(agg.aggregation_id, points.slice(-120));
      main.append(card(agg));
    }
    if (!data.aggregations.length) main.append(document.getElementById("empty").content.cloneNode(true));
    status.textContent = `updated ${new Date().toLocaleTimeString()}`;
    status.dataset.loaded = "true";
  } catch (e) {
    status.textContent = `cannot reach the admin API: ${e.message}`;
  }
}
refresh();
setInterval(refresh, 1000);
