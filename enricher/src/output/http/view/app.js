// firn's local web view: one query (/api/view) per change of window, mode or filter;
// the flame graph, the chart and the tables are drawn here as SVG and HTML, no library.
"use strict";

const FILTERS = [["comm", "comm"], ["executable", "executable"], ["container_id", "container"],
                 ["systemd_unit", "systemd unit"], ["pod", "pod"]];
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d", "#6b7280"];
const ROW = 17;
const SVG = "http://www.w3.org/2000/svg";

const state = { minutes: 5, mode: "cpu", filters: {}, view: null, zoom: [], search: "" };
// What each mode weighs: on-CPU samples, off-CPU time, or both as wall time.
const MODES = {
    cpu: { chart: "CPU over time", per: "ms of CPU per second", top: "samples",
           tip: "on-CPU: where threads ran (samples)" },
    off: { chart: "Off-CPU time over time", per: "ms waited off CPU per second", top: "ms off CPU",
           tip: "off-CPU: where threads waited (blocked), in time" },
    wall: { chart: "Wall time over time", per: "ms on + off CPU per second", top: "ms of wall time",
            tip: "both: wall time = on-CPU samples × period + off-CPU time" },
};
const NO_OFF_CPU = "no round in this window measured off-CPU time (firn-sampler --off-cpu)";
const $ = (id) => document.getElementById(id);

function el(tag, attrs, text) {
    const e = tag.startsWith("svg:") ? document.createElementNS(SVG, tag.slice(4)) : document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
}

function query() {
    const p = new URLSearchParams({ minutes: String(state.minutes) });
    if (state.mode !== "cpu") p.set("mode", state.mode);
    for (const [k, v] of Object.entries(state.filters)) if (v) p.set(k, v);
    return p;
}

function saveHash() {
    history.replaceState(null, "", "#" + query().toString());
}

function loadHash() {
    const p = new URLSearchParams(location.hash.slice(1));
    if (p.has("minutes")) state.minutes = Number(p.get("minutes")) || 5;
    // An unknown mode goes to the server, which says what it accepts.
    if (p.has("mode")) state.mode = p.get("mode");
    for (const [k, v] of p) if (k !== "minutes" && k !== "mode") state.filters[k] = v;
}

// Answers can come back out of order (a slow window's query, then a quick filtered one):
// only the answer to the latest query is drawn.
let asked = 0;

async function refresh(keepZoom) {
    const mine = ++asked;
    saveHash();
    $("minutes").value = String(state.minutes);
    const p = query();
    const dl = new URLSearchParams(p);
    dl.delete("minutes");
    dl.delete("mode"); // the pprof carries every sample type
    dl.set("seconds", String(state.minutes * 60));
    $("download").href = "/pprof/cpu?" + dl.toString();
    let r;
    try {
        r = await fetch("/api/view?" + p.toString());
    } catch (e) {
        if (mine !== asked) return;
        return showError("cannot reach the enricher: " + e);
    }
    const body = await r.text();
    if (mine !== asked) return;
    if (!r.ok) return showError(body);
    $("error").hidden = true;
    state.view = JSON.parse(body);
    if (!keepZoom) state.zoom = [];
    draw();
}

function showError(msg) {
    $("error").textContent = msg;
    $("error").hidden = false;
}

// A weight in the view's unit, for people.
function fmt(n) {
    if (state.view.unit === "samples") return `${n} samples`;
    return n >= 1e9 ? `${(n / 1e9).toFixed(2)} s` : `${(n / 1e6).toFixed(1)} ms`;
}

// A table cell's number: samples as they are, time in ms.
function num(n) {
    return state.view.unit === "samples" ? String(n) : (n / 1e6).toFixed(1);
}

function drawMode() {
    const v = state.view;
    for (const b of document.querySelectorAll("#mode button")) {
        const m = b.dataset.mode;
        b.setAttribute("aria-pressed", String(m === state.mode));
        b.disabled = m !== "cpu" && !v.off_cpu;
        b.title = b.disabled ? NO_OFF_CPU : MODES[m].tip;
    }
    $("mode").title = v.off_cpu ? "" : NO_OFF_CPU;
    const m = MODES[v.mode] || MODES.cpu;
    $("chart-title").textContent = m.chart;
    $("chart-unit").textContent = `(${m.per}, per round; click a name to filter)`;
    $("top-unit").textContent = `(${m.top})`;
    $("process-unit").textContent = v.unit === "samples" ? "samples" : "ms";
}

function draw() {
    const v = state.view;
    $("node").textContent = v.node;
    const secs = (v.to_ns - v.from_ns) / 1e9;
    const what = { cpu: "", off: " off CPU", wall: " of wall time" }[v.mode] || "";
    $("status").textContent = `${fmt(v.total)}${what} in ${v.stacks} stacks over ${v.rounds} rounds` +
        (v.mode === "wall" ? ` (${(100 * v.off_total / (v.total || 1)).toFixed(1)} % off CPU)` : "") +
        (v.mode !== "cpu" && !v.off_cpu ? " — " + NO_OFF_CPU : "") +
        (secs > 0 ? ` (${Math.round(secs)} s)` : "") +
        (v.shortened ? " — the window reaches back less than asked (at most 20,000 stacks and 8 MiB are kept)" : "") +
        (v.cut_short ? ` — ${v.cut_short} stacks too varied for the flame graph's bound end early` : "");
    drawMode();
    drawFilters();
    drawChart();
    drawFlame();
    drawTop();
    drawProcesses();
}

function drawFilters() {
    const box = $("filters");
    box.replaceChildren();
    for (const [key, label] of FILTERS) {
        const values = state.view.choices[key] || [];
        if (!values.length && !state.filters[key]) continue;
        const sel = el("select", { "data-filter": key });
        sel.append(el("option", { value: "" }, `all (${values.length})`));
        for (const [value, n] of values) {
            sel.append(el("option", { value }, `${value} (${state.view.unit === "samples" ? n : fmt(n)})`));
        }
        if (state.filters[key] && !values.some(([x]) => x === state.filters[key])) {
            sel.append(el("option", { value: state.filters[key] }, state.filters[key]));
        }
        sel.value = state.filters[key] || "";
        sel.addEventListener("change", () => { state.filters[key] = sel.value; refresh(); });
        const l = el("label", {}, label + " ");
        l.append(sel);
        box.append(l);
    }
    if (state.filters.pid) {
        const b = el("button", { type: "button", id: "pid-filter" }, `pid ${state.filters.pid} ✕`);
        b.addEventListener("click", () => { delete state.filters.pid; refresh(); });
        box.append(b);
    }
}

function drawChart() {
    const box = $("chart");
    box.replaceChildren();
    const series = state.view.series;
    if (!series.length) { box.textContent = "nothing in this window"; return; }
    const W = Math.max(300, (box.clientWidth || 800) - 2), H = 140, pad = 30;
    const xs = series[0].points.map((p) => p[0]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs);
    const ymax = Math.max(1, ...series.flatMap((s) => s.points.map((p) => p[1])));
    const svg = el("svg:svg", { width: W, height: H, id: "chart-svg" });
    svg.append(el("svg:text", { x: 2, y: 12, "font-size": 10 }, ymax.toFixed(1)));
    svg.append(el("svg:text", { x: 2, y: H - 4, "font-size": 10 }, "0"));
    const legend = el("div", { class: "legend" });
    series.forEach((s, i) => {
        const color = COLORS[i % COLORS.length];
        const pts = s.points.map((p) => {
            const x = pad + (x1 > x0 ? (p[0] - x0) / (x1 - x0) : 0.5) * (W - pad - 5);
            const y = H - 5 - (p[1] / ymax) * (H - 15);
            return `${x.toFixed(1)},${y.toFixed(1)}`;
        });
        svg.append(el("svg:polyline", { points: pts.join(" "), fill: "none", stroke: color, "stroke-width": 1.5 }));
        const item = el("span", { "data-series": s.key });
        const swatch = el("i", {});
        swatch.style.background = color;
        item.append(swatch, document.createTextNode(s.key));
        if (s.filter) {
            item.addEventListener("click", () => { state.filters[s.filter[0]] = s.filter[1]; refresh(); });
        }
        legend.append(item);
    });
    box.append(svg, legend);
}

function hue(name) {
    let h = 0;
    for (let i = 0; i < name.length; i++) h = (h * 31 + name.charCodeAt(i)) >>> 0;
    return h;
}

// Frame kinds (the server's FrameKind): native warm, kernel blue, Python green; and
// frames whose time is mostly off CPU (waiting), violet whatever ran them.
const KIND_HUES = [[10, 45], [200, 30], [95, 45]];

// A node spent most of its weight off CPU.
const offCpu = (n) => n[3] * 2 > n[1];

function color(name, depth, kind, off) {
    if (depth === 0) return "#9ca3af";
    if (off) {
        const h = hue(name);
        return `hsl(${255 + (h % 25)}, ${35 + (h % 15)}%, ${66 + (h % 10)}%)`;
    }
    if (kind !== 2 && (name.startsWith("[") || /^0x|\+0x/.test(name))) return "#d1d5db";
    const h = hue(name);
    const [base, span] = KIND_HUES[kind] || KIND_HUES[0];
    return `hsl(${base + (h % span)}, ${60 + (h % 20)}%, ${55 + (h % 15)}%)`;
}

function drawFlame() {
    const v = state.view, box = $("flame");
    box.replaceChildren();
    let root = v.tree;
    const path = [];
    for (const i of state.zoom) {
        if (!root[2][i]) { state.zoom = []; return drawFlame(); }
        path.push(root);
        root = root[2][i];
    }
    const W = Math.max(300, (box.clientWidth || 1000) - 2);
    let depthMax = 0;
    const nodes = [];
    const total = root[1] || 1;
    let re = null;
    if (state.search) { try { re = new RegExp(state.search, "i"); } catch (e) { re = null; } }
    let matched = 0;
    const walk = (n, x, depth, idxPath) => {
        const w = (n[1] / total) * W;
        if (w < 0.5) return;
        nodes.push([n, x, w, depth, idxPath]);
        depthMax = Math.max(depthMax, depth);
        let cx = x;
        n[2].forEach((c, i) => { walk(c, cx, depth + 1, idxPath.concat([i])); cx += (c[1] / total) * W; });
    };
    walk(root, 0, 0, []);
    // Ancestors of the zoomed node stay visible above it, full width.
    const top = path.length;
    const H = (depthMax + 1 + top) * ROW;
    const svg = el("svg:svg", { width: W, height: H, id: "flame-svg" });
    path.forEach((a, i) => {
        const name = v.names[a[0]];
        const g = el("svg:g", { "data-zoom-out": i });
        const rect = el("svg:rect", { x: 0, y: i * ROW, width: W, height: ROW - 1, fill: "#e5e7eb" });
        rect.append(el("svg:title", {}, `${name} — click to zoom out`));
        g.append(rect, el("svg:text", { x: 3, y: i * ROW + 12 }, name));
        g.addEventListener("click", () => { state.zoom = state.zoom.slice(0, i); drawFlame(); });
        svg.append(g);
    });
    const matches = new Set();
    for (const [n, x, w, depth, idxPath] of nodes) {
        const name = v.names[n[0]];
        const y = (depth + top) * ROW;
        const off = depth + top > 0 && offCpu(n);
        const rect = el("svg:rect", { x: x.toFixed(2), y, width: Math.max(0.5, w - 0.5).toFixed(2), height: ROW - 1,
                                      fill: color(name, depth + top, (v.kinds || [])[n[0]], off),
                                      "data-name": name, "data-kind": (v.kinds || [])[n[0]] || 0 });
        if (off) rect.setAttribute("data-off", "1");
        const pct = (100 * n[1] / (v.total || 1)).toFixed(2);
        const offPct = v.mode === "wall" ? `, ${(100 * n[3] / (n[1] || 1)).toFixed(0)} % off CPU` : "";
        rect.append(el("svg:title", {}, `${name}\n${fmt(n[1])} (${pct} % of all${offPct})`));
        if (re && depth + top > 0 && re.test(name)) {
            rect.classList.add("match");
            matches.add(idxPath.join("."));
        }
        const g = el("svg:g", {});
        g.append(rect);
        if (w > 30) {
            const chars = Math.floor((w - 6) / 6.6);
            const label = name.length > chars ? name.slice(0, Math.max(1, chars - 1)) + "…" : name;
            g.append(el("svg:text", { x: (x + 3).toFixed(2), y: y + 12 }, label));
        }
        g.addEventListener("click", () => { state.zoom = state.zoom.concat(idxPath); drawFlame(); });
        svg.append(g);
    }
    // Matched share: matched nodes not under another matched node.
    if (re) {
        for (const [n, , , , idxPath] of nodes) {
            const key = idxPath.join(".");
            if (!matches.has(key)) continue;
            let covered = false;
            for (let k = 1; k < idxPath.length; k++) if (matches.has(idxPath.slice(0, k).join("."))) covered = true;
            if (!covered) matched += n[1];
        }
    }
    box.append(svg);
    $("flame-info").textContent = (state.zoom.length ? "zoomed; click a bar above to zoom out · " : "click a frame to zoom · ") +
        (re ? `search matches ${(100 * matched / total).toFixed(1)} % of what is shown` : `${v.folded_nodes} small nodes folded into […]`);
}

function drawTop() {
    const v = state.view, tb = $("top").tBodies[0];
    tb.replaceChildren();
    const t = v.total || 1;
    for (const f of v.top) {
        const tr = el("tr", {});
        const name = el("td", { class: "fn", title: f.name }, f.name);
        name.addEventListener("click", () => { $("search").value = f.name.replace(/[.*+?^${}()|[\]\\]/g, "\\$&"); onSearch(); });
        tr.append(name, el("td", {}, num(f.flat)), el("td", {}, (100 * f.flat / t).toFixed(1)),
                  el("td", {}, num(f.cum)), el("td", {}, (100 * f.cum / t).toFixed(1)));
        tb.append(tr);
    }
}

function drawProcesses() {
    const tb = $("processes").tBodies[0];
    tb.replaceChildren();
    for (const p of state.view.processes) {
        const tr = el("tr", { "data-pid": p.pid });
        tr.append(el("td", {}, p.pid), el("td", {}, p.comm), el("td", {}, p.executable),
                  el("td", {}, p.container_id.slice(0, 12)), el("td", {}, num(p.value)));
        tr.addEventListener("click", () => { if (p.pid) { state.filters.pid = p.pid; refresh(); } });
        tb.append(tr);
    }
}

function onSearch() {
    state.search = $("search").value.trim();
    if (state.view) drawFlame();
}

// For tests and the console: the data behind the page.
window.__firnView = () => state.view;

window.addEventListener("DOMContentLoaded", () => {
    loadHash();
    $("minutes").addEventListener("change", () => { state.minutes = Number($("minutes").value); refresh(); });
    for (const b of document.querySelectorAll("#mode button")) {
        b.addEventListener("click", () => { state.mode = b.dataset.mode; refresh(); });
    }
    $("search").addEventListener("input", onSearch);
    $("reset").addEventListener("click", () => { state.filters = {}; state.zoom = []; $("search").value = ""; state.search = ""; refresh(); });
    window.addEventListener("resize", () => { if (state.view) { drawChart(); drawFlame(); } });
    refresh();
    setInterval(() => { if (!document.hidden) refresh(true); }, 30000);
});
