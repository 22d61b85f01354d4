// membackend's memory panel for ComfyUI: served by the membackend custom node (WEB_DIRECTORY) under
// /extensions/membackend/. Plain JavaScript against the frontend's extension API, no build step, no network
// beyond this ComfyUI server: it reads GET /membackend/status and posts POST /membackend/headroom.
//
// Per device: the budget (total, usable, free, the headroom and where it came from), the address windows a
// backend keeps after release (where it keeps any), a headroom control that
// changes it live, and a chart of reserved / resident / committed bytes over the last minutes. Then the
// models (size, resident, pinned / warm / cached / evictable, on the classic path, when last used), the bytes of
// dropped models kept as cache, the backend (why it was chosen, how to
// change it), the recent loads with the line that says why, the recent unloads and evictions with their
// cause. When membackend is off or stays out of ComfyUI's way it says so, in the start-up line's words.
// Colours are ComfyUI's theme variables, so the panel follows its light and dark palettes.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const POLL_MS = 2000;
const CHART_SECONDS = 300;
const TAB_ID = "membackend-memory";

// A size as membackend writes one everywhere (membackend.types.format_size): binary units, one decimal, the
// largest unit that is at least 1 ("6.0 GiB", "512.0 MiB"); below 1 KiB the bytes themselves.
const SIZE_UNITS = [["PiB", 2 ** 50], ["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];

function gb(n) {
  if (n === null || n === undefined) return "–";
  const a = Math.abs(n);
  for (const [unit, size] of SIZE_UNITS) {
    if (a >= size) {
      const text = (n / size).toLocaleString("en-US", { minimumFractionDigits: 1, maximumFractionDigits: 1 });
      return `${text} ${unit}`;
    }
  }
  const whole = Math.trunc(n);
  return Math.abs(whole) === 1 ? `${whole} byte` : `${whole} bytes`;
}

function ago(t) {
  if (!t) return "not used yet";
  const s = Math.max(0, Date.now() / 1000 - t);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  return `${(s / 3600).toFixed(1)} h ago`;
}

function clock(t) {
  return t ? new Date(t * 1000).toLocaleTimeString() : "";
}

// a DOM element; text is always set as text (never parsed as HTML)
function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null) continue;
    if (k === "text") e.textContent = v;
    else if (k === "style") e.style.cssText = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) e.append(c);
  return e;
}

const SVG = "http://www.w3.org/2000/svg";
function svg(tag, attrs = {}) {
  const e = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  return e;
}

const CSS = `
.mb-panel { color: var(--fg-color, #ddd); background: var(--comfy-menu-bg, #353535); font: 12px/1.4 sans-serif;
  padding: 8px 10px; height: 100%; overflow-y: auto; box-sizing: border-box; }
.mb-panel h3 { font-size: 13px; margin: 12px 0 4px; color: var(--fg-color, #ddd); }
.mb-panel .mb-muted { color: var(--descrip-text, #999); }
.mb-panel .mb-card { background: var(--comfy-input-bg, #222); border: 1px solid var(--border-color, #4e4e4e);
  border-radius: 6px; padding: 6px 8px; margin: 6px 0; }
.mb-panel .mb-state { display: inline-block; padding: 1px 6px; border-radius: 8px; font-weight: bold;
  border: 1px solid var(--border-color, #4e4e4e); }
.mb-panel .mb-state[data-state="running"] { color: #3fa34d; }
.mb-panel .mb-state[data-state="switched-off"], .mb-panel .mb-state[data-state="not-started"] { color: var(--error-text, #ff4444); }
.mb-panel table { border-collapse: collapse; width: 100%; }
.mb-panel table.mb-models { table-layout: fixed; }
.mb-panel table.mb-models td { overflow-wrap: anywhere; }
.mb-panel table.mb-models th:nth-child(2), .mb-panel table.mb-models th:nth-child(3) { width: 4.6em; }
.mb-panel td, .mb-panel th { text-align: left; padding: 2px 4px; border-bottom: 1px solid var(--border-color, #4e4e4e);
  vertical-align: top; }
.mb-panel th { color: var(--descrip-text, #999); font-weight: normal; }
.mb-panel td.mb-num, .mb-panel th.mb-num { text-align: right; white-space: nowrap; }
.mb-panel input { background: var(--comfy-menu-bg, #353535); color: var(--input-text, #ddd);
  border: 1px solid var(--border-color, #4e4e4e); border-radius: 4px; padding: 2px 4px; width: 7em; }
.mb-panel button { background: var(--comfy-menu-secondary-bg, #444); color: var(--fg-color, #ddd);
  border: 1px solid var(--border-color, #4e4e4e); border-radius: 4px; padding: 2px 8px; cursor: pointer; }
.mb-panel .mb-error { color: var(--error-text, #ff4444); white-space: pre-wrap; }
.mb-panel .mb-ok { color: #3fa34d; }
.mb-panel ul { margin: 2px 0; padding-left: 16px; }
.mb-panel .mb-legend span { margin-right: 10px; white-space: nowrap; }
.mb-panel .mb-line { font-family: monospace; font-size: 11px; word-break: break-word; }
.mb-floating { position: fixed; right: 12px; bottom: 48px; width: 420px; height: 70vh; z-index: 1000;
  box-shadow: 0 0 12px rgba(0,0,0,.4); border-radius: 8px; }
.mb-toggle { position: fixed; right: 12px; bottom: 12px; z-index: 1001; }
`;
// [series, sample index, colour, legend]: reserved is address space, not memory
const SERIES = [["reserved", 1, "#8a8aff", "reserved (address space)"], ["resident", 2, "#3fa34d", "resident"],
                ["committed", 3, "#e0a030", "committed"]];

function chart(samples, total) {
  const w = 360, h = 90;
  const now = Math.max(Date.now() / 1000, ...(samples || []).map((s) => s[0]));
  const pts = (samples || []).filter((s) => now - s[0] <= CHART_SECONDS);
  // the last CHART_SECONDS, or from the first sample when there is less history than that
  const span = Math.max(10, Math.min(CHART_SECONDS, pts.length ? now - pts[0][0] : CHART_SECONDS));
  const box = svg("svg", { viewBox: `0 0 ${w} ${h}`, width: "100%", height: h, "data-mb": "chart",
                           preserveAspectRatio: "none",
                           "data-samples": String(pts.length), role: "img",
                           "aria-label": "reserved address space, resident and committed bytes over the last minutes" });
  box.append(svg("rect", { x: 0, y: 0, width: w, height: h, fill: "none", stroke: "var(--border-color, #4e4e4e)" }));
  let peak = 0;
  for (const s of pts) for (const [, i] of SERIES) if (s[i] !== null && s[i] > peak) peak = s[i];
  const top = Math.max(peak, 1) * 1.1;
  const x = (t) => ((t - (now - span)) / span) * w;
  const y = (v) => h - 2 - (v / top) * (h - 4);
  for (const [name, i, colour] of SERIES) {
    const line = pts.filter((s) => s[i] !== null).map((s) => `${x(s[0]).toFixed(1)},${y(s[i]).toFixed(1)}`);
    if (line.length === 1) line.push(`${w},${line[0].split(",")[1]}`); // one sample: a flat line to now
    box.append(svg("polyline", { points: line.join(" "), fill: "none", stroke: colour, "stroke-width": 1.5, "vector-effect": "non-scaling-stroke",
                                 "data-series": name }));
  }
  const label = `${gb(peak)} peak · last ${span >= 120 ? `${Math.round(span / 60)} min` : `${Math.round(span)} s`}`;
  const legend = el("div", { class: "mb-legend mb-muted" }, el("span", { text: label }),
    ...SERIES.map(([name, , colour, words]) => el("span", { "data-series": name },
      el("b", { style: `color:${colour}`, text: "— " }), words)));
  return el("div", {}, box, legend);
}

class Panel {
  constructor() {
    this.root = el("div", { class: "mb-panel", id: "membackend-panel", "data-polls": "0" });
    this.timer = null;
    this.polls = 0;
    this.messages = {}; // device -> {ok|error text}, kept across refreshes
    this.drafts = {}; // device -> what the user is typing in the headroom box
    this.last = null;
  }

  mount(container) {
    if (!document.getElementById("membackend-panel-css")) {
      document.head.append(el("style", { id: "membackend-panel-css", text: CSS }));
    }
    container.append(this.root);
    this.refresh();
    this.timer = setInterval(() => this.refresh(), POLL_MS);
  }

  unmount() {
    clearInterval(this.timer);
    this.timer = null;
    this.root.remove();
  }

  async refresh(force = false) {
    try {
      const r = await api.fetchApi("/membackend/status", { cache: "no-store" });
      this.last = await r.json();
      this.error = r.ok ? null : `GET /membackend/status answered ${r.status}`;
    } catch (e) {
      this.error = `GET /membackend/status failed: ${e}`;
    }
    this.polls += 1;
    this.root.setAttribute("data-polls", String(this.polls));
    this.render(force);
  }

  // a person typing a headroom or pressing a button: no rebuild under them (it would drop the click)
  busy() {
    const a = document.activeElement;
    return a && this.root.contains(a) && (a.tagName === "INPUT" || a.tagName === "BUTTON");
  }

  async setHeadroom(device, value, save = false) {
    let answer, ok;
    try {
      const r = await api.fetchApi("/membackend/headroom", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(save ? { device, headroom: value, save: true } : { device, headroom: value }),
      });
      ok = r.ok;
      answer = await r.json();
    } catch (e) {
      ok = false;
      answer = { error: "request failed", message: String(e) };
    }
    if (ok) {
      this.messages[device] = { ok: `headroom ${gb(answer.headroom)} (${answer.source})` +
                                    (answer.freed ? `; gave back ${gb(answer.freed)}` : "") +
                                    (answer.saved ? `; saved to ${answer.saved} for the next starts` : "") +
                                    (answer.note ? ` (${answer.note})` : "") };
      delete this.drafts[device];
    } else {
      const accepted = answer.accepted && !String(answer.message).includes(answer.accepted)
        ? `\naccepted: ${answer.accepted}` : "";
      this.messages[device] = { error: `${answer.error}: ${answer.message}${accepted}` };
    }
    if (this.root.contains(document.activeElement)) document.activeElement.blur();
    await this.refresh(true);
  }

  render(force = false) {
    if (!force && this.busy()) {
      this.stale = true;
      return;
    }
    this.stale = false;
    const st = this.last;
    const focused = document.activeElement && this.root.contains(document.activeElement)
      ? document.activeElement.getAttribute("data-device") : null;
    this.root.replaceChildren();
    this.root.append(el("div", { style: "display:flex;justify-content:space-between;align-items:center" },
      el("b", { text: `membackend ${st?.version ?? ""}` }),
      el("span", { class: "mb-state", "data-mb": "state", "data-state": st?.state ?? "unknown",
                   text: st?.state ?? "unknown" })));
    if (this.error) this.root.append(el("div", { class: "mb-error", "data-mb": "fetch-error", text: this.error }));
    if (!st) return;
    if (!st.running) {
      this.root.append(el("div", { class: "mb-card", "data-mb": "not-running" },
        el("div", { text: st.state === "disabled" ? "membackend is off." :
          st.state === "switched-off" ? "membackend switched itself off; ComfyUI carries on stock." :
          "membackend stays out of ComfyUI's way: ComfyUI runs stock." }),
        el("div", { class: "mb-muted", "data-mb": "reason", text: st.reason }),
        st.line ? el("div", { class: "mb-line", "data-mb": "line", text: st.line }) : null,
        st.how_to ? el("div", { class: "mb-muted", text: `To change it: ${st.how_to}` }) : null));
    }
    for (const [dev, b] of Object.entries(st.budgets || {})) this.root.append(this.device(dev, b, st, focused));
    this.root.append(this.models(st.models || {}));
    this.root.append(el("h3", { text: "Backend" }), el("div", { class: "mb-card", "data-mb": "backend" },
      el("div", {}, el("b", { text: st.backend ?? "none" }), ` (${st.how ?? "?"})`),
      el("div", { class: "mb-muted", text: st.selection_reason ?? st.reason }),
      st.line && st.running ? el("div", { class: "mb-line", text: st.line }) : null,
      st.line && st.running && st.how_to && st.line.includes(st.how_to) ? null
        : el("div", { class: "mb-muted", text: `To change it: ${st.how_to ?? ""}` }),
      el("div", { class: "mb-muted", "data-mb": "idle", "data-times": String(st.idle?.times ?? 0),
                  "data-reservations": String((st.reservations || []).length),
                  text: `prompts finished: ${st.idle?.times ?? 0} · live reservations: ${(st.reservations || []).length}` +
                        ` · loads: ${st.load_count ?? 0} (${gb(st.loaded_bytes ?? 0)} copied in)` })));
    this.root.append(this.loads(st.loads || []), this.unloads(st));
    this.root.append(el("div", { class: "mb-muted", "data-mb": "updated",
                                 text: `updated ${new Date().toLocaleTimeString()}` }));
    if (focused) this.root.querySelector(`input[data-device="${focused}"]`)?.focus();
  }

  device(dev, b, st, focused) {
    const hr = (st.headroom || {})[dev] || { bytes: b.headroom, source: "?" };
    const msg = this.messages[dev] || {};
    const input = el("input", { "data-mb": "headroom-input", "data-device": dev, placeholder: "e.g. 2GiB",
                                "aria-label": `headroom on ${dev}` });
    input.value = this.drafts[dev] ?? "";
    input.addEventListener("input", () => { this.drafts[dev] = input.value; });
    input.addEventListener("blur", () => setTimeout(() => { if (this.stale && !this.busy()) this.render(); }, 0));
    input.addEventListener("keydown", (e) => { if (e.key === "Enter") this.setHeadroom(dev, input.value); });
    const row = (label, value, key, extra) => el("tr", {},
      el("th", { text: label }), el("td", { class: "mb-num", "data-mb": key, "data-bytes": String(value), text: gb(value) }),
      el("td", { class: "mb-muted", text: extra ?? "" }));
    const cache = (st.cache || {})[dev];
    return el("div", { class: "mb-card", "data-mb": "device", "data-device": dev },
      el("b", { text: dev }), el("span", { class: "mb-muted", text: `  budget from ${b.source}` }),
      el("table", {},
        row("total", b.total, "total"),
        row("usable", b.usable, "usable", "free minus headroom: what models may use"),
        row("free", b.free, "free"),
        row("headroom", b.headroom, "headroom"),
        ...(cache ? [row("cached, reclaimable", cache.bytes, "cached",
                         `weights of models ComfyUI dropped (keep_dropped = ${cache.keep_dropped}): they go first ` +
                         "when anything needs the room, and a load of the same file copies from them")] : []),
        ...(b.split ? [
          row("other use", b.split.other, "split-other", "the process's context, activations, cast buffers"),
          row("weights' room", b.split.weights_room, "split-weights-room", "room under the headroom, less other use"),
          row("weights resident", b.split.weights_resident, "split-weights-resident"),
        ] : []),
      ),
      el("div", { class: "mb-muted", "data-mb": "headroom-source",
                  text: `headroom in force: ${gb(hr.bytes)}, from ${hr.source}` }),
      el("div", { style: "margin-top:4px" }, "Keep free: ", input, " ",
        el("button", { "data-mb": "headroom-apply", "data-device": dev, text: "Apply",
                       onclick: () => this.setHeadroom(dev, input.value) }), " ",
        el("button", { "data-mb": "headroom-save", "data-device": dev, text: "Apply and save",
                       title: "also write it to membackend.toml: every device keeps this much free from the next start on",
                       onclick: () => this.setHeadroom(dev, input.value, true) }), " ",
        el("button", { "data-mb": "headroom-reset", "data-device": dev, text: "Start-up value",
                       title: "back to the value membackend started with", onclick: () => this.setHeadroom(dev, null) })),
      el("div", { class: "mb-muted", text: `${gb(hr.min ?? 0)} to ${gb(hr.max ?? b.total)}. Apply lasts until ` +
        "ComfyUI stops; Apply and save also writes it to membackend.toml for the next starts." }),
      msg.error ? el("div", { class: "mb-error", "data-mb": "headroom-error", text: msg.error }) : null,
      msg.ok ? el("div", { class: "mb-ok", "data-mb": "headroom-ok", text: msg.ok }) : null,
      this.keptWindows((st.kept_windows || {})[dev]),
      chart((st.history || {})[dev], b.total));
  }

  // released address windows a backend keeps against a driver's reserve-churn limit (rocm_windows): what stays
  // charged to the process after a full unload, and why
  keptWindows(k) {
    if (!k) return null;
    const text = k.windows
      ? `kept address windows: ${k.windows} (${gb(k.bytes)}), at most ${k.bound} once no free is left; ${k.reason}`
      : `kept address windows: none (at most ${k.bound})`;
    return el("div", { class: "mb-muted", "data-mb": "kept-windows", "data-windows": String(k.windows),
                       "data-bytes": String(k.bytes), title: k.line, text });
  }

  models(models) {
    const rows = Object.entries(models).sort((a, b) => (b[1].last_used ?? 0) - (a[1].last_used ?? 0));
    // four columns, so that the table fits the sidebar at its default width; evictable bytes and the last use
    // go on the state's second line; size is the weights' bytes (the address range is in the tooltip)
    const body = rows.length ? el("table", { "data-mb": "models", class: "mb-models" },
      el("tr", {}, ...["model", "size", "resident", "state"].map((h, i) =>
        el("th", { class: i === 1 || i === 2 ? "mb-num" : "", text: h }))),
      ...rows.map(([id, m]) => el("tr", { "data-model": id, "data-name": m.name, "data-resident": String(m.resident),
                                          "data-size": String(m.size) },
        el("td", { text: m.name, title: `${id} (${m.kind}) on ${m.device}; address range ${gb(m.address_range ?? 0)}` }),
        el("td", { class: "mb-num", text: gb(m.size) }),
        el("td", { class: "mb-num", text: gb(m.resident) }),
        el("td", {}, el("div", { "data-mb": "model-state", "data-path": m.path ?? "dynamic",
                                 text: (m.state === "cached" ? "cached, reclaimable" : m.state) +
                                   (m.path === "classic" ? ", classic path" : "") + (m.held ? ", kept warm" : "") +
                                   (m.pinned ? ` (${gb(m.pinned)} pinned)` : "") }),
          el("div", { class: "mb-muted", text: `${gb(m.evictable)} evictable · ${ago(m.last_used)}` })))))
      : el("div", { class: "mb-muted", "data-mb": "models-empty",
                    text: "No model streams through membackend yet (ComfyUI loads models on a CPU device itself)." });
    return el("div", {}, el("h3", { text: "Models" }), body);
  }

  loads(loads) {
    const recent = loads.slice(-8).reverse();
    return el("div", {}, el("h3", { text: "Recent loads" }), recent.length
      ? el("ul", { "data-mb": "loads" }, ...recent.map((l) => el("li", { "data-kind": l.kind },
          el("span", { class: "mb-muted", text: `${clock(l.began)} ` }), el("b", { text: l.name }), `: ${l.text}`)))
      : el("div", { class: "mb-muted", text: "none yet" }));
  }

  unloads(st) {
    const items = [];
    for (const u of (st.unloads || []).slice(-8)) {
      items.push([u.time ?? 0, `${u.name ?? u.model}: full unload, ${gb(u.bytes)} freed (${u.reason})`, "unload"]);
    }
    for (const [id, m] of Object.entries(st.models || {})) {
      const lost = (st.evictions || {})[id];
      if (lost) items.push([lost.time, `${m.name}: ${gb(lost.bytes)} evicted (${lost.reason})`, "eviction"]);
    }
    items.sort((a, b) => b[0] - a[0]);
    return el("div", {}, el("h3", { text: "Recent unloads and evictions" }), items.length
      ? el("ul", { "data-mb": "unloads" }, ...items.slice(0, 10).map(([t, text, kind]) =>
          el("li", { "data-kind": kind }, el("span", { class: "mb-muted", text: `${clock(t)} ` }), text)))
      : el("div", { class: "mb-muted", text: "none yet" }));
  }
}

const panel = new Panel();

app.registerExtension({
  name: "membackend.MemoryPanel",
  async setup() {
    const manager = app.extensionManager;
    if (manager && typeof manager.registerSidebarTab === "function") {
      manager.registerSidebarTab({
        id: TAB_ID, icon: "pi pi-server", title: "Memory", tooltip: "membackend: memory and VRAM cap",
        type: "custom", render: (container) => panel.mount(container), destroy: () => panel.unmount(),
      });
    } else { // a frontend without sidebar tabs: a floating panel behind a button
      const box = el("div", { class: "mb-floating", style: "display:none" });
      document.body.append(box, el("button", { class: "mb-toggle", text: "Memory", onclick: () => {
        const open = box.style.display === "none";
        box.style.display = open ? "block" : "none";
        if (open) panel.mount(box); else panel.unmount();
      } }));
    }
    // a prompt finished or the queue changed: refresh now rather than at the next poll
    for (const event of ["executed", "execution_success", "status"]) {
      api.addEventListener(event, () => { if (panel.timer) panel.refresh(); });
    }
  },
});
