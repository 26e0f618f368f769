// rlbus dashboard: polls api/snapshot and draws every chart as hand-written SVG (no libraries, no CDN).
// Each card's plot gets an <svg data-points="N"> once it has data, or a ".empty" placeholder until then.
"use strict";

const POLL_MS = 1500;
const PALETTE = ["#2f6fde", "#e8833a", "#2aa876", "#8a5cd1", "#14a3b8", "#c2499b", "#8c7a3e", "#d1a92c",
                 "#5b6b8c", "#c8372d"];
const INK = "#1d2433";
const SVG_NS = "http://www.w3.org/2000/svg";
const W = 560, H = 240;
const M = { left: 74, right: 16, top: 12, bottom: 40 };

// --- small helpers -----------------------------------------------------------------------------------
function svgEl(tag, attrs, parent) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (parent) parent.appendChild(node);
  return node;
}

function htmlEl(tag, attrs, parent, text) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  if (text !== undefined) node.textContent = text;
  if (parent) parent.appendChild(node);
  return node;
}

function fmtNum(v) {
  if (v === null || v === undefined || !isFinite(v)) return "—";
  const a = Math.abs(v);
  if (a >= 1e9) return (v / 1e9).toPrecision(3) + "G";
  if (a >= 1e6) return (v / 1e6).toPrecision(3) + "M";
  if (a >= 1e4) return (v / 1e3).toPrecision(3) + "k";
  if (a !== 0 && a < 0.01) return v.toExponential(1).replace(".0e", "e");
  return String(+v.toPrecision(3));
}

function fmtBytes(v) {
  if (!isFinite(v)) return "—";
  const units = ["B", "kB", "MB", "GB", "TB"];
  let i = 0;
  while (Math.abs(v) >= 1000 && i < units.length - 1) { v /= 1000; i++; }
  return (i === 0 ? String(Math.round(v)) : String(+v.toPrecision(3))) + " " + units[i];
}

function fmtClock(seconds) {
  const s = Math.round(seconds);
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  const pad = (n) => String(n).padStart(2, "0");
  return h ? `${h}:${pad(m)}:${pad(r)}` : `${m}:${pad(r)}`;
}

function ago(seconds) {
  const s = Math.max(0, seconds);
  return s < 100 ? `${s.toFixed(1)} s ago` : `${fmtClock(s)} ago`;
}

function wallClock(unix) {
  return new Date(unix * 1000).toLocaleTimeString([], { hour12: false });
}

function quantile(values, q) {
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.max(0, Math.min(sorted.length - 1, Math.ceil(q * sorted.length) - 1))];
}

function niceStep(span, count, integer) {
  const raw = span / Math.max(1, count);
  const mag = Math.pow(10, Math.floor(Math.log10(raw)));
  const f = raw / mag;
  const step = (f < 1.5 ? 1 : f < 3 ? 2 : f < 7 ? 5 : 10) * mag;
  return integer ? Math.max(1, Math.round(step)) : step;
}

function linearTicks(lo, hi, count, integer) {
  const step = niceStep(hi - lo, count, integer);
  const out = [];
  for (let v = Math.ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}

function logTicks(lo, hi) {
  const out = [];
  const first = Math.floor(Math.log10(lo)), last = Math.ceil(Math.log10(hi));
  const mults = last - first <= 2 ? [1, 2, 5] : [1];
  for (let e = first; e <= last; e++) {
    for (const m of mults) {
      const v = m * Math.pow(10, e);
      if (v >= lo * 0.999 && v <= hi * 1.001) out.push(v);
    }
  }
  return out;
}

// --- the one plotting routine ----------------------------------------------------------------------------
// spec: { series: [{ name, color, kind: "line"|"step"|"points"|"bars", points: [[x, y], ...], width, dash }],
//         hlines: [{ name, y, color }], x: { label, format, categories, integer },
//         y: { label, format, log, zero, integer } }
function plot(container, spec) {
  const plotDiv = container.querySelector(".plot");
  const legend = container.querySelector(".legend");
  plotDiv.replaceChildren();
  if (legend) legend.replaceChildren();
  const ylog = !!spec.y.log;
  const usable = (p) => p && isFinite(p[0]) && isFinite(p[1]) && p[1] !== null && (!ylog || p[1] > 0);
  const series = spec.series.map((s) => ({ ...s, points: s.points.filter(usable) })).filter((s) => s.points.length);
  const hlines = (spec.hlines || []).filter((h) => isFinite(h.y) && (!ylog || h.y > 0));
  if (!series.length) {
    htmlEl("div", { class: "empty" }, plotDiv, "no data yet");
    return 0;
  }

  // domains
  const xs = series.flatMap((s) => s.points.map((p) => p[0]));
  const ys = series.flatMap((s) => s.points.map((p) => p[1])).concat(hlines.map((h) => h.y));
  const categories = spec.x.categories;
  let x0 = categories ? -0.5 : Math.min(...xs), x1 = categories ? categories.length - 0.5 : Math.max(...xs);
  const hasBars = series.some((s) => s.kind === "bars");
  if (!categories && hasBars) {
    const sorted = [...new Set(xs)].sort((a, b) => a - b);
    let gap = Infinity;
    for (let i = 1; i < sorted.length; i++) gap = Math.min(gap, sorted[i] - sorted[i - 1]);
    const pad = isFinite(gap) ? gap * 0.6 : 0.6;
    x0 -= pad; x1 += pad;
  }
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  let y0 = Math.min(...ys), y1 = Math.max(...ys);
  if (ylog) {
    y0 /= 1.6; y1 *= 1.6;
  } else {
    if (spec.y.zero || hasBars) y0 = Math.min(0, y0);
    if (y0 === y1) {  // a flat series: show it in a sensible band rather than on the frame
      const pad = y0 === 0 ? 1 : Math.abs(y0) * 0.5;
      y0 = y0 === 0 ? 0 : y0 - pad;
      y1 += pad;
    }
    y1 += (y1 - y0) * 0.06;
    if (y0 < 0 && !spec.y.zero) y0 -= (y1 - y0) * 0.04;
  }
  const px = (x) => M.left + ((x - x0) / (x1 - x0)) * (W - M.left - M.right);
  const py = ylog
    ? (y) => H - M.bottom - ((Math.log10(y) - Math.log10(y0)) / (Math.log10(y1) - Math.log10(y0))) * (H - M.top - M.bottom)
    : (y) => H - M.bottom - ((y - y0) / (y1 - y0)) * (H - M.top - M.bottom);

  const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
  const yfmt = spec.y.format || fmtNum, xfmt = spec.x.format || fmtNum;

  // grid, axes, tick labels
  const yticks = ylog ? logTicks(y0, y1) : linearTicks(y0, y1, 5, spec.y.integer);
  for (const t of yticks) {
    const y = py(t);
    svgEl("line", { class: "grid-line", x1: M.left, x2: W - M.right, y1: y, y2: y }, svg);
    svgEl("text", { x: M.left - 6, y: y + 4, "text-anchor": "end" }, svg).textContent = yfmt(t);
  }
  const xticks = categories ? categories.map((_, i) => i) : linearTicks(x0, x1, 6, spec.x.integer);
  for (const t of xticks) {
    const x = px(t);
    svgEl("line", { class: "axis", x1: x, x2: x, y1: H - M.bottom, y2: H - M.bottom + 4 }, svg);
    svgEl("text", { x, y: H - M.bottom + 16, "text-anchor": "middle" }, svg).textContent =
      categories ? categories[t] : xfmt(t);
  }
  svgEl("line", { class: "axis", x1: M.left, x2: W - M.right, y1: H - M.bottom, y2: H - M.bottom }, svg);
  svgEl("line", { class: "axis", x1: M.left, x2: M.left, y1: M.top, y2: H - M.bottom }, svg);
  svgEl("text", { class: "axis-label", x: (M.left + W - M.right) / 2, y: H - 6, "text-anchor": "middle" }, svg)
    .textContent = spec.x.label;
  svgEl("text", {
    class: "axis-label", x: 0, y: 0, "text-anchor": "middle",
    transform: `translate(13 ${(M.top + H - M.bottom) / 2}) rotate(-90)`,
  }, svg).textContent = spec.y.label;

  // marks
  let marks = 0;
  const base = ylog ? y0 : Math.max(y0, 0);
  const barSeries = series.filter((s) => s.kind === "bars");
  let band = 0;
  if (barSeries.length) {
    const step = categories ? 1 : Math.max(1e-9, minGap(series.flatMap((s) => s.points.map((p) => p[0]))));
    band = Math.max(1.5, Math.min(36, (px(x0 + step) - px(x0)) * 0.7));
  }
  for (const h of hlines) {
    svgEl("line", {
      x1: M.left, x2: W - M.right, y1: py(h.y), y2: py(h.y), stroke: h.color, "stroke-width": 1.5,
      "stroke-dasharray": "6 4",
    }, svg);
  }
  for (const s of series) {
    const pts = [...s.points].sort((a, b) => a[0] - b[0]);
    if (s.kind === "bars") {
      for (const [x, y] of pts) {
        const top = py(y), bottom = py(base);
        const rect = svgEl("rect", {
          x: px(x) - band / 2, y: Math.min(top, bottom), width: band, height: Math.max(1, Math.abs(bottom - top)),
          fill: s.color, rx: band > 6 ? 2 : 0,
        }, svg);
        svgEl("title", {}, rect).textContent = `${s.name}: ${categories ? categories[x] : xfmt(x)} → ${yfmt(y)}`;
        marks++;
      }
      continue;
    }
    if (s.kind === "line" || s.kind === "step") {
      let d = "";
      pts.forEach(([x, y], i) => {
        if (i === 0) d += `M${px(x).toFixed(1)},${py(y).toFixed(1)}`;
        else if (s.kind === "step") d += `H${px(x).toFixed(1)}V${py(y).toFixed(1)}`;
        else d += `L${px(x).toFixed(1)},${py(y).toFixed(1)}`;
      });
      svgEl("path", {
        d, fill: "none", stroke: s.color, "stroke-width": s.width || 1.8, "stroke-linejoin": "round",
        "stroke-dasharray": s.dash || "none",
      }, svg);
      marks += pts.length;
    }
    if (s.kind === "points" || (s.kind === "line" && pts.length <= 60)) {
      for (const [x, y] of pts) {
        const dot = svgEl("circle", {
          cx: px(x), cy: py(y), r: s.kind === "points" ? 3.2 : 2.2, fill: s.color,
          "fill-opacity": s.kind === "points" ? 0.75 : 1,
        }, svg);
        svgEl("title", {}, dot).textContent = `${s.name}: ${xfmt(x)} → ${yfmt(y)}`;
        if (s.kind === "points") marks++;
      }
    }
  }
  svg.setAttribute("data-points", String(marks));
  plotDiv.appendChild(svg);

  if (legend) {
    for (const s of series) legendItem(legend, s.name, s.color, s.kind === "points" ? "dot" : s.kind === "bars" ? "box" : "");
    for (const h of hlines) legendItem(legend, h.name, h.color, "dash");
  }
  return marks;
}

function minGap(values) {
  const sorted = [...new Set(values)].sort((a, b) => a - b);
  let gap = Infinity;
  for (let i = 1; i < sorted.length; i++) gap = Math.min(gap, sorted[i] - sorted[i - 1]);
  return isFinite(gap) ? gap : 1;
}

function legendItem(legend, name, color, shape) {
  const item = htmlEl("span", {}, legend);
  const swatch = htmlEl("i", { class: shape }, item);
  swatch.style.background = color;
  swatch.style.borderColor = color;
  item.appendChild(document.createTextNode(name));
}

function setSub(card, text) {
  card.querySelector(".sub").textContent = text;
}

// --- the charts ----------------------------------------------------------------------------------------
function timeOrigin(snap) {
  const times = [];
  for (const pts of Object.values(snap.rewards || {})) for (const p of pts) times.push(p[0]);
  for (const pts of Object.values(snap.versions || {})) for (const p of pts) times.push(p[0]);
  for (const pts of Object.values(snap.lag || {})) for (const p of pts) times.push(p[0]);
  for (const pts of Object.values(snap.swaps || {})) for (const p of pts) times.push(p[0]);
  for (const s of snap.steps || []) times.push(s.t);
  return times.length ? Math.min(...times) : snap.now || 0;
}

const CHARTS = {
  reward(card, snap, t0) {
    const sources = Object.entries(snap.rewards || {});
    const marks = plot(card, {
      series: sources.map(([name, pts], i) => ({
        name, color: PALETTE[i % PALETTE.length], kind: "line", points: pts.map((p) => [p[0] - t0, p[1]]),
      })),
      x: { label: `time since ${wallClock(t0)} (m:ss)`, format: fmtClock },
      y: { label: "reward" },
    });
    if (marks) {
      const judges = Object.values(snap.judges || {});
      const judged = judges.reduce((n, j) => n + (j.judge_judgements || 0), 0);
      const judgeText = judged ? " · judge: " + [
        `${fmtNum(judges.reduce((s, j) => s + (j.judge_latency_s || 0) * (j.judge_judgements || 0), 0) / judged)} s/judgement`,
        `${judges.reduce((n, j) => n + (j.judge_retries || 0), 0)} retries`,
        `${fmtNum(100 * judges.reduce((n, j) => n + (j.judge_invalid || 0), 0) / judged)} % invalid`,
      ].join(", ") : "";
      setSub(card, "mean per time bin · last: " + sources.map(([n, p]) => `${n} ${fmtNum(p[p.length - 1][1])}`).join(", ") + judgeText);
    }
  },

  versions(card, snap, t0) {
    const entries = Object.entries(snap.versions || {});
    const regions = snap.regions || {};
    let color = 0;
    const marks = plot(card, {
      series: entries.map(([name, pts]) => ({
        name: name === "trainer" ? "trainer (published)" : regions[name] ? `${name} (${regions[name]})` : name,
        color: name === "trainer" ? INK : PALETTE[color++ % PALETTE.length],
        kind: "step", width: name === "trainer" ? 2.6 : 1.8, dash: name === "trainer" ? "5 3" : "none",
        points: pts.map((p) => [p[0] - t0, p[1]]),
      })),
      x: { label: `time since ${wallClock(t0)} (m:ss)`, format: fmtClock },
      y: { label: "policy version", integer: true },
    });
    if (marks) {
      const trainer = snap.trainer || {};
      const behind = entries.filter(([n]) => n !== "trainer").map(([n, p]) => `${n} v${p[p.length - 1][1]}`);
      setSub(card, `trainer v${trainer.version ?? "—"} · ` + behind.join(", "));
    }
  },

  staleness(card, snap) {
    const hist = Object.entries(snap.staleness || {}).map(([k, n]) => [Number(k), n]).sort((a, b) => a[0] - b[0]);
    const marks = plot(card, {
      series: [{ name: "rollouts", color: PALETTE[1], kind: "bars", points: hist.map(([, n], i) => [i, n]) }],
      x: { label: "versions behind at arrival", categories: hist.map(([k]) => String(k)) },
      y: { label: "rollouts", integer: true },
    });
    if (marks) {
      const total = hist.reduce((a, [, n]) => a + n, 0);
      const fresh = hist.filter(([k]) => k <= 0).reduce((a, [, n]) => a + n, 0);
      setSub(card, `${total} rollouts · ${(100 * fresh / total).toFixed(0)} % on the newest version · max ` +
        `${hist[hist.length - 1][0]} behind`);
    }
  },

  lag(card, snap, t0) {
    const entries = Object.entries(snap.lag || {});
    const marks = plot(card, {
      series: entries.map(([name, pts], i) => ({
        name, color: PALETTE[i % PALETTE.length], kind: "line", points: pts.map((p) => [p[0] - t0, p[1]]),
      })),
      x: { label: `time since ${wallClock(t0)} (m:ss)`, format: fmtClock },
      y: { label: "messages behind", zero: true, integer: true },
    });
    if (marks) {
      const total = entries.reduce((a, [, p]) => a + p[p.length - 1][1], 0);
      setSub(card, `end − committed offset per topic ← consumer group · ${total} messages behind now`);
    }
  },

  bytes(card, snap) {
    const weights = snap.weights || [];
    const full = Math.max(0, ...weights.map((w) => w.full_bytes || 0));
    const marks = plot(card, {
      series: [
        { name: "delta (lossless)", color: PALETTE[0], kind: "bars",
          points: weights.filter((w) => w.delta_bytes).map((w) => [w.version, w.delta_bytes]) },
        { name: "keyframe", color: PALETTE[1], kind: "points",
          points: weights.filter((w) => w.keyframe_bytes).map((w) => [w.version, w.keyframe_bytes]) },
      ],
      hlines: full ? [{ name: "full weights", y: full, color: "#c8372d" }] : [],
      x: { label: "version", integer: true },
      y: { label: "bytes", log: true, format: fmtBytes },
    });
    const deltas = weights.filter((w) => w.delta_bytes);
    if (marks && deltas.length && full) {
      const last = deltas[deltas.length - 1];
      const mean = deltas.reduce((a, w) => a + w.delta_bytes, 0) / deltas.length;
      setSub(card, `last delta ${fmtBytes(last.delta_bytes)} = ${(100 * last.delta_bytes / full).toFixed(1)} % of ` +
        `${fmtBytes(full)} · mean ${(100 * mean / full).toFixed(1)} %`);
    }
  },

  swaps(card, snap, t0) {
    const entries = Object.entries(snap.swaps || {});
    const marks = plot(card, {
      series: entries.map(([name, pts], i) => ({
        name, color: PALETTE[i % PALETTE.length], kind: "points", points: pts.map((p) => [p[0] - t0, p[2]]),
      })),
      x: { label: `time since ${wallClock(t0)} (m:ss)`, format: fmtClock },
      y: { label: "pause (ms)", zero: true },
    });
    if (marks) {
      const all = entries.flatMap(([, pts]) => pts.map((p) => p[2]));
      setSub(card, `${all.length} swaps · p50 ${fmtNum(quantile(all, 0.5))} ms · p99 ${fmtNum(quantile(all, 0.99))} ms` +
        ` · max ${fmtNum(Math.max(...all))} ms`);
    }
  },

  mismatch(card, snap) {
    const steps = snap.steps || [];
    const marks = plot(card, {
      series: [
        { name: "KL(behaviour‖trainer), k3", color: PALETTE[3], kind: "line", points: steps.map((s) => [s.step, s.kl_k3]) },
        { name: "max |Δ log-prob|", color: PALETTE[4], kind: "line", width: 1.4,
          points: steps.map((s) => [s.step, s.max_abs_dlogprob]) },
      ],
      x: { label: "trainer step", integer: true },
      y: { label: "nats", log: true },
    });
    if (marks) {
      const last = steps[steps.length - 1];
      const flips = last.router_flip_rate === null ? "—" : fmtNum(last.router_flip_rate);
      setSub(card, `step ${last.step}: KL ${fmtNum(last.kl_k3)} · IS ESS ${fmtNum(last.is_ess)} · router flips ${flips}`);
    }
  },

  hacked(card, snap) {
    const steps = (snap.steps || []).filter((s) => s.hacked !== null && s.hacked !== undefined);
    const marks = plot(card, {
      series: [{ name: "hacked rollouts", color: PALETTE[9], kind: "line",
        points: steps.map((s) => [s.step, s.hacked]) }],
      x: { label: "trainer step", integer: true },
      y: { label: "share hacked", zero: true },
    });
    if (marks) {
      const last = steps[steps.length - 1];
      const peak = Math.max(...steps.map((s) => s.hacked));
      setSub(card, `step ${last.step}: ${fmtNum(100 * last.hacked)} % hacked, reward ${fmtNum(last.reward_mean)} · ` +
        `peak ${fmtNum(100 * peak)} %`);
    }
  },

  hacks(card, snap) {
    const workers = Object.values(snap.hacks || {});
    const totals = {};
    for (const w of workers) for (const [kind, n] of Object.entries(w.kinds || {})) totals[kind] = (totals[kind] || 0) + n;
    const kinds = Object.entries(totals).sort((a, b) => b[1] - a[1] || a[0].localeCompare(b[0]));
    if (!kinds.length) {  // nothing found, or no reward worker heartbeats (rlbus dashboard --redis)
      card.querySelector(".plot").replaceChildren(htmlEl("div", { class: "empty" }, null, "no reward hacking reported"));
      card.querySelector(".legend").replaceChildren();
      return;
    }
    plot(card, {
      series: [{ name: "findings", color: PALETTE[9], kind: "bars", points: kinds.map(([, n], i) => [i, n]) }],
      x: { label: "kind", categories: kinds.map(([k]) => k) },
      y: { label: "rollouts flagged", integer: true },
    });
    const policies = [...new Set(workers.map((w) => w.policy).filter(Boolean))];
    setSub(card, `${kinds.reduce((a, [, n]) => a + n, 0)} findings by ${workers.length} reward workers · ` +
      `hack_policy ${policies.join(", ") || "—"}`);
  },

  workers(card, snap) {
    const plotDiv = card.querySelector(".plot");
    plotDiv.replaceChildren();
    let rows = (snap.workers || []).map((w) => ({
      id: w.worker_id, role: w.role, region: w.region || "", version: w.version, seen: w.last_seen,
    }));
    if (!rows.length) {
      rows = Object.entries(snap.versions || {}).filter(([n]) => n !== "trainer").map(([n, pts]) => ({
        id: n, role: "rollout", region: (snap.regions || {})[n] || "", version: pts[pts.length - 1][1],
        seen: pts[pts.length - 1][0],
      }));
    }
    if (!rows.length) {
      htmlEl("div", { class: "empty" }, plotDiv, "no data yet");
      return;
    }
    const trainer = (snap.trainer || {}).version;
    const table = htmlEl("table", { "data-points": String(rows.length) }, plotDiv);
    const head = htmlEl("tr", {}, htmlEl("thead", {}, table));
    for (const h of ["worker", "role", "region", "version", "behind", "last seen"]) htmlEl("th", {}, head, h);
    const body = htmlEl("tbody", {}, table);
    for (const r of rows) {
      const tr = htmlEl("tr", {}, body);
      htmlEl("td", {}, tr, r.id);
      htmlEl("span", { class: "tag" }, htmlEl("td", {}, tr), r.role);
      htmlEl("td", {}, tr, r.region || "—");
      htmlEl("td", { class: "num" }, tr, r.version === null || r.version === undefined ? "—" : `v${r.version}`);
      const behind = Number.isInteger(r.version) && Number.isInteger(trainer) ? trainer - r.version : null;
      htmlEl("td", { class: "num" }, tr, behind === null ? "—" : String(behind));
      htmlEl("td", { class: "num" }, tr, r.seen ? ago((snap.now || r.seen) - r.seen) : "—");
    }
    setSub(card, `${rows.length} workers · ` + ((snap.workers || []).length ? "from heartbeats" : "from the rollouts they wrote"));
  },

  serving(card, snap) {
    const plotDiv = card.querySelector(".plot");
    plotDiv.replaceChildren();
    const gateways = (snap.workers || []).filter((w) => w.role === "serve");
    if (!gateways.length) {
      htmlEl("div", { class: "empty" }, plotDiv, "no gateway in this run (rlbus serve / rlbus up --serve)");
      return;
    }
    const cols = [["requests", "served"], ["p50 ms", "latency_p50_ms"], ["p99 ms", "latency_p99_ms"],
      ["tokens out", "completion_tokens"], ["recorded", "recorded"], ["buffered", "buffered"],
      ["dropped", "dropped"], ["429s", "rejected"], ["sessions", "sessions_open"], ["edits", "history_edits"]];
    const table = htmlEl("table", { "data-points": String(gateways.length) }, plotDiv);
    const head = htmlEl("tr", {}, htmlEl("thead", {}, table));
    for (const h of ["gateway", "version", ...cols.map(([h]) => h)]) htmlEl("th", {}, head, h);
    const body = htmlEl("tbody", {}, table);
    for (const g of gateways) {
      const info = g.info || {};
      const tr = htmlEl("tr", {}, body);
      htmlEl("td", {}, tr, g.worker_id + (g.region ? ` (${g.region})` : ""));
      htmlEl("td", { class: "num" }, tr, g.version === null || g.version === undefined ? "—" : `v${g.version}`);
      for (const [, key] of cols) {
        const v = info[key];
        htmlEl("td", { class: "num" }, tr, v === null || v === undefined ? "—" : fmtNum(v));
      }
    }
    const down = gateways.filter((g) => (g.info || {}).down).length;
    setSub(card, `${gateways.length} gateways` + (down ? ` · ${down} cannot reach the bus (buffering)` : ""));
  },
};

// --- the page ------------------------------------------------------------------------------------------
function stat(name, text, cls) {
  const node = document.querySelector(`[data-stat="${name}"]`);
  node.textContent = text;
  if (cls !== undefined) node.className = "pill " + cls;
}

function render(snap) {
  const t0 = timeOrigin(snap);
  let drawn = 0;
  for (const card of document.querySelectorAll(".card[data-chart]")) {
    try {
      CHARTS[card.dataset.chart](card, snap, t0);
      if (card.querySelector("[data-points]")) drawn++;
    } catch (err) {
      card.querySelector(".plot").replaceChildren(htmlEl("div", { class: "empty" }, null, "error: " + err));
    }
  }
  const trainer = snap.trainer || {};
  const counts = snap.counts || {};
  stat("phase", snap.phase || "");
  stat("trainer", `trainer v${trainer.version ?? "—"} · step ${trainer.step ?? "—"}`);
  const skipped = [counts.claimed ? `${counts.claimed} claim-checked` : "", counts.unreadable ?
    `${counts.unreadable} unreadable` : ""].filter(Boolean);
  stat("rollouts", `${counts.rollouts ?? 0} rollouts` + (skipped.length ? ` (+ ${skipped.join(", ")} records)` : ""));
  stat("rewards", `${counts.rewards ?? 0} rewards`);
  const workers = (snap.workers || []).length || Object.keys(snap.versions || {}).filter((n) => n !== "trainer").length;
  stat("workers", `${workers} workers`);
  stat("updated", `updated ${wallClock(snap.now || Date.now() / 1000)}`, "quiet live");
  const error = document.getElementById("error");
  error.hidden = !snap.error;
  error.textContent = snap.error || "";
  document.body.dataset.charts = String(drawn);
}

async function tick() {
  try {
    const response = await fetch("api/snapshot", { cache: "no-store" });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    render(await response.json());
  } catch (err) {
    stat("updated", `disconnected (${err.message})`, "quiet");
  } finally {
    setTimeout(tick, POLL_MS);
  }
}

tick();
