"""The replay's interactive picture: one self-contained HTML page.

Inline SVG, inline CSS and a little inline JavaScript for hover tooltips and toggling series: the
page loads nothing from anywhere (its Content-Security-Policy allows nothing else) and needs no
extra package. Every string that came from the caller or a trace is escaped; the tooltips read
only the page's JSON data block and write only with ``textContent``, so no label is ever parsed as
markup. The same layout as the static figure: one column per device, one row per side.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from typing import Any

from .layout import Lane, Layout, Panel, assign_lanes, empty_note, nice_ticks, panel_title, tick_text
from .style import (
    DRAW_ORDER,
    FALLBACK_MARKER_STYLE,
    GB,
    MARKER_STYLE,
    RELEASE_LABEL,
    RUG_KINDS,
    RUG_STYLE,
    SERIES,
    SERIES_LABEL,
    SERIES_STYLE,
    STEP_AXIS_LABEL,
)

__all__ = ["html_page"]

CELL_WIDTH, CELL_HEIGHT = 560, 230  # one panel with its axes (under its title band), in SVG units
PAD_LEFT, PAD_RIGHT, PAD_BOTTOM = 52, 14, 34
HTML_LANE, HTML_LABEL_PX, HTML_CHAR = 12, 10, 0.6  # a lane's height, the labels' size, a character's width (em)
HTML_SUMMARY, HTML_SUMMARY_PX, HTML_TITLE = 14, 11, 18  # a summary line's height, its size, the title's row
PLOT_W, PLOT_H = CELL_WIDTH - PAD_LEFT - PAD_RIGHT, CELL_HEIGHT - PAD_BOTTOM  # a panel's plotting area

esc = html.escape  # quote=True: also safe inside attribute values

Lanes = dict[tuple[str, str], list[Lane]]  # per panel (side, device), its labels' lanes


@dataclass(frozen=True)
class _Grid:
    """The page's rows: above each panel its title, its summary (one line, or one a part in every panel
    when one is too long, so the rows line up) and the band of label lanes."""

    rows: int
    band: int  # the label lanes' height
    split: bool  # the summaries are written one line a part
    summary_h: int

    @property
    def pad_top(self) -> int:
        return HTML_TITLE + self.summary_h + self.band

    @property
    def row_h(self) -> int:
        return self.pad_top + CELL_HEIGHT


@dataclass(frozen=True)
class _Cell:
    """One panel's plotting area on the page, its scales and where it sits in the grid."""

    left: int
    top: int
    x_max: float
    y_ticks: list[float]
    first_column: bool
    last_row: bool

    @property
    def y_top(self) -> float:
        return self.y_ticks[-1]

    def x(self, x: float) -> float:
        """A place on the step axis, in SVG units."""
        return self.left + x / self.x_max * PLOT_W

    def y(self, value: float) -> float:
        """A value in bytes, in SVG units."""
        return self.top + PLOT_H - value / GB / self.y_top * PLOT_H


def html_page(layout: Layout, *, title: str, reported: str | None) -> str:
    """The whole page as text. Every string that came from the caller or a trace is escaped."""
    lanes = _lanes(layout)
    grid = _grid(layout, lanes)
    x_ticks = layout.x_ticks()
    svg: list[str] = []
    data_panels: list[dict[str, Any]] = []
    for r, side in enumerate(layout.rows):
        for c, device in enumerate(layout.columns):
            panel = layout.panel(side, device)
            cell = _Cell(c * CELL_WIDTH + PAD_LEFT, r * grid.row_h + grid.pad_top, layout.x_max,
                         nice_ticks(0.0, layout.y_top(device)), c == 0, r == grid.rows - 1)
            svg += _panel_svg(layout, grid, cell, panel, lanes[(side, device)], x_ticks, len(data_panels))
            data_panels.append(_panel_data(layout, panel, cell))
    width, height = CELL_WIDTH * len(layout.columns), grid.row_h * grid.rows
    data = {"x1": layout.x_max, "gb": GB, "panels": data_panels}
    caption = f'<p class="caption">{esc(reported)}</p>' if reported else ""
    return _PAGE.format(
        title=esc(title),
        caption=caption,
        toggles=_toggles(),
        width=width,
        height=height,
        svg="\n".join(svg),
        data=_script_safe_json(data),
        script=_SCRIPT,
    )


def _lanes(layout: Layout) -> Lanes:
    """Each panel's labels sorted into lanes, their widths estimated from their length."""
    out = {}
    for side in layout.rows:
        for device in layout.columns:
            panel = layout.panel(side, device)
            spans = [(p.x / layout.x_max * PLOT_W, len(p.label_text) * HTML_LABEL_PX * HTML_CHAR + 6)
                     for p in panel.labelled]
            out[(side, device)] = assign_lanes(spans, 0.0, PLOT_W, gap=4.0)
    return out


def _grid(layout: Layout, lanes: Lanes) -> _Grid:
    """The rows' heights: the most lanes any panel's labels take, the longest summary."""
    band = max((lane[0] + 1 for ls in lanes.values() for lane in ls if lane), default=0) * HTML_LANE + 4
    panels = layout.all_panels()
    # a summary too long for its panel gets one line a part, in every panel, so the rows line up
    split = any(len(" · ".join(p.summary)) * HTML_SUMMARY_PX * HTML_CHAR > PLOT_W for p in panels)
    summary_lines = max((len(p.summary) for p in panels), default=1) if split else 1
    return _Grid(len(layout.rows), band, split, HTML_SUMMARY * summary_lines)


def _panel_svg(layout: Layout, grid: _Grid, cell: _Cell, panel: Panel, lanes: list[Lane],
               x_ticks: list[tuple[float, str]], index: int) -> list[str]:
    """One panel's SVG group: its heading, axes and data, the cursor, and the hover area that finds
    the panel's data (entry ``index`` of the data block)."""
    left, top = cell.left, cell.top
    svg = ['<g class="panel">']
    svg += _heading_svg(grid, cell, panel)
    svg += _axes_svg(layout, cell, x_ticks)
    note = empty_note(layout, panel)
    if note:
        svg.append(f'<text class="note" x="{left + PLOT_W / 2:.1f}" y="{top + PLOT_H / 2:.1f}"'
                   f' text-anchor="middle">{esc(note)}</text>')
    svg += _series_svg(cell, panel)
    svg += _marker_svg(cell, panel, lanes)
    svg += _rug_svg(cell, panel)
    svg.append(f'<line class="cursor" x1="0" y1="{top}" x2="0" y2="{top + PLOT_H}" visibility="hidden"/>')
    svg.append(f'<rect class="hover" data-panel="{index}" x="{left}" y="{top}"'
               f' width="{PLOT_W}" height="{PLOT_H}"/>')
    svg.append("</g>")
    return svg


def _heading_svg(grid: _Grid, cell: _Cell, panel: Panel) -> list[str]:
    """The panel's title and, under it, its summary."""
    left, top = cell.left, cell.top
    svg = [f'<text class="ptitle" x="{left}" y="{top - grid.band - grid.summary_h - 5}">'
           f"{esc(panel_title(panel))}</text>"]
    if panel.summary:
        y0 = top - grid.band - grid.summary_h + HTML_SUMMARY - 4
        lines = panel.summary if grid.split else [" · ".join(panel.summary)]
        spans = "".join(f'<tspan x="{left}" y="{y0 + i * HTML_SUMMARY}">{esc(line)}</tspan>'
                        for i, line in enumerate(lines))
        svg.append(f'<text class="summary">{spans}</text>')
    return svg


def _axes_svg(layout: Layout, cell: _Cell, x_ticks: list[tuple[float, str]]) -> list[str]:
    """The widened steps shaded, the grid lines and tick labels, the axis labels and the frame."""
    left, top = cell.left, cell.top
    svg = []
    for k in sorted(layout.widened):
        x0, x1 = cell.x(layout.edges[k]), cell.x(layout.edges[k + 1])
        svg.append(f'<rect class="widened" x="{x0:.1f}" y="{top}" width="{x1 - x0:.1f}" height="{PLOT_H}"/>')
    for tick in cell.y_ticks:
        y = cell.y(tick * GB)
        svg.append(f'<line class="grid" x1="{left}" y1="{y:.1f}" x2="{left + PLOT_W}" y2="{y:.1f}"/>')
        svg.append(f'<text class="tick" x="{left - 5}" y="{y + 3:.1f}" text-anchor="end">{tick_text(tick)}</text>')
    for x, text in x_ticks:
        px = cell.x(x)
        svg.append(f'<line class="grid" x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{top + PLOT_H}"/>')
        svg.append(f'<text class="tick" x="{px:.1f}" y="{top + PLOT_H + 13}" text-anchor="middle">{text}</text>')
    if cell.first_column:
        middle = f"{top + PLOT_H / 2:.1f}"
        svg.append(f'<text class="tick" x="{left - 40}" y="{middle}"'
                   f' transform="rotate(-90 {left - 40} {middle})" text-anchor="middle">GB</text>')
    if cell.last_row:
        svg.append(f'<text class="tick" x="{left + PLOT_W / 2:.1f}" y="{top + PLOT_H + 28}"'
                   f' text-anchor="middle">{STEP_AXIS_LABEL}</text>')
    svg.append(f'<rect class="frame" x="{left}" y="{top}" width="{PLOT_W}" height="{PLOT_H}"/>')
    return svg


def _series_svg(cell: _Cell, panel: Panel) -> list[str]:
    """The series as step lines (committed first, reserved on top), then the release marks."""
    svg = []
    for name in DRAW_ORDER:
        segments = panel.series.get(name)
        if not segments:
            continue
        style = SERIES_STYLE[name]
        path = " ".join(
            "M" + " L".join(f"{cell.x(x):.1f} {cell.y(v):.1f}" for x, v in segment) for segment in segments
        )
        dash_attr = f' stroke-dasharray="{style.svg_dash}"' if style.svg_dash else ""
        svg.append(f'<path class="series s-{name}" d="{path}" stroke="{style.colour}"'
                   f' stroke-width="{style.width + 0.3:.1f}" stroke-opacity="{style.alpha}"{dash_attr}/>')
    for release in panel.releases:
        px, py = cell.x(release.x), cell.y(release.value)
        svg.append(f'<path class="release s-{release.series}" d="M{px - 4:.1f} {py - 7:.1f} L{px + 4:.1f}'
                   f' {py - 7:.1f} L{px:.1f} {py:.1f} Z" fill="{SERIES_STYLE[release.series].colour}"/>')
    return svg


def _marker_svg(cell: _Cell, panel: Panel, lanes: list[Lane]) -> list[str]:
    """Each labelled marker's line (its tooltip names it) and, where a lane has room, its label."""
    top = cell.top
    svg = []
    for p, lane in zip(panel.labelled, lanes):
        colour, _, linewidth, dash, _ = MARKER_STYLE.get(p.marker.kind, FALLBACK_MARKER_STYLE)
        px = cell.x(p.x)
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        svg.append(
            f'<line class="marker" x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{top + PLOT_H}"'
            f' stroke="{colour}" stroke-width="{linewidth}"{dash_attr}>'
            f"<title>{esc(p.marker.kind)}: {esc(p.marker.label)}</title></line>"
        )
        if lane is None:
            continue  # no room: the line's tooltip names it
        row, flipped = lane
        tx, anchor = (px - 3, "end") if flipped else (px + 3, "start")
        ty = top - 4 - row * HTML_LANE
        if p.marker.kind == "workflow":
            rest = p.label_text[len(p.marker.label):]
            svg.append(f'<text class="marker wlabel" x="{tx:.1f}" y="{ty}" fill="{colour}" text-anchor="{anchor}">'
                       f'{esc(p.marker.label)}<tspan class="runtime">{esc(rest)}</tspan></text>')
        else:
            svg.append(f'<text class="marker ulabel" x="{tx:.1f}" y="{ty}" fill="{colour}"'
                       f' text-anchor="{anchor}">{esc(p.label_text)}</text>')
    return svg


def _rug_svg(cell: _Cell, panel: Panel) -> list[str]:
    """The row of crosses (bugchecks) and ticks (frees that raced pending work) along the panel's top."""
    svg = []
    for kind in RUG_KINDS:
        colour, _, rug_at, _ = RUG_STYLE[kind]
        py = cell.top + PLOT_H * (1 - rug_at)
        for p in panel.rug:
            if p.marker.kind == kind:
                svg.append(f'<path class="marker rug r-{kind}" d="{_rug_glyph(kind, cell.x(p.x), py)}"'
                           f' stroke="{colour}"/>')
    return svg


def _rug_glyph(kind: str, px: float, py: float) -> str:
    if kind == "bugcheck":
        return (f"M{px - 3:.1f} {py - 3:.1f} L{px + 3:.1f} {py + 3:.1f} M{px - 3:.1f} {py + 3:.1f}"
                f" L{px + 3:.1f} {py - 3:.1f}")
    return f"M{px:.1f} {py - 4:.1f} L{px:.1f} {py + 4:.1f}"


def _panel_data(layout: Layout, panel: Panel, cell: _Cell) -> dict[str, Any]:
    """The panel's entry in the data block the tooltips read."""
    return {
        "side": panel.side,
        "device": panel.device,
        "left": cell.left,
        "width": PLOT_W,
        # [t, reserved, resident, committed, x, step]: x is the step's place on the axis
        "samples": [[s.t, s.reserved, s.resident, s.committed, layout.edges[k], k]
                    for k, s in zip(panel.steps, panel.samples)],
        "markers": [[p.marker.t, p.marker.kind, p.marker.label, p.step] for p in panel.markers],
    }


def _toggles() -> str:
    """The controls above the picture: a box per series and one for the markers, then the key."""
    boxes = "".join(
        f'<label><input type="checkbox" data-hide="{name}" checked>'
        f'<span class="swatch" style="border-color:{SERIES_STYLE[name].colour}"></span>{SERIES_LABEL[name]}</label>'
        for name in SERIES
    )
    lines = "".join(f'<span class="key"><span class="swatch" style="border-color:{style[0]};'
                    f'border-top-style:{_key_line(kind)}"></span>{style[4]}</span>'
                    for kind, style in MARKER_STYLE.items())
    rugs = "".join(f'<span class="key" style="color:{style[0]}">{"×" if kind == "bugcheck" else "|"} {style[3]}</span>'
                   for kind, style in RUG_STYLE.items())
    return (boxes + '<label><input type="checkbox" data-hide="markers" checked>markers</label>' + lines + rugs
            + f'<span class="key">▼ {RELEASE_LABEL}</span>')


def _key_line(kind: str) -> str:
    return "dotted" if kind == "unload" else "dashed" if kind == "unload_all" else "solid"


def _script_safe_json(value: Any) -> str:
    """JSON that cannot end the <script> element it sits in, whatever the labels contain."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


# a backslash ending a line joins it to the next: the page keeps the long line, the source does not
_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; \
script-src 'unsafe-inline'">
<title>{title}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 16px; color: #222; }}
h1 {{ font-size: 17px; margin: 0 0 4px; }}
.caption {{ margin: 0 0 8px; color: #444; }}
.controls label, .controls .key {{ margin-right: 14px; white-space: nowrap; }}
.swatch {{ display: inline-block; width: 18px; height: 0; border-top: 2px solid; margin: 0 4px 3px 2px; \
vertical-align: middle; }}
svg {{ display: block; margin-top: 8px; }}
.ptitle {{ font-size: 12px; font-weight: 600; }}
.summary {{ font-size: 11px; fill: #444; }}
.tick {{ font-size: 10px; fill: #555; }}
.note {{ font-size: 12px; fill: #888; }}
.grid {{ stroke: #e4e4e4; stroke-width: 1; }}
.widened {{ fill: #000; fill-opacity: 0.04; }}
.frame {{ fill: none; stroke: #999; }}
.series {{ fill: none; stroke-linejoin: round; }}
.release {{ stroke: #222; stroke-width: 0.6; }}
.rug {{ fill: none; stroke-width: 1.3; }}
.wlabel, .ulabel {{ font-size: 10px; }}
.runtime {{ fill: #777; }}
.cursor {{ stroke: #666; stroke-width: 0.7; }}
.hover {{ fill: transparent; pointer-events: all; }}
.hide-reserved .s-reserved, .hide-resident .s-resident, .hide-committed .s-committed, \
.hide-markers .marker {{ display: none; }}
#tip {{ position: fixed; display: none; pointer-events: none; background: #fffffff0; border: 1px solid #aaa;
  padding: 4px 6px; font: 12px ui-monospace, monospace; white-space: pre; }}
</style>
</head>
<body>
<h1>{title}</h1>
{caption}
<div class="controls">{toggles}</div>
<svg id="plot" width="{width}" height="{height}" viewBox="0 0 {width} {height}">
{svg}
</svg>
<div id="tip"></div>
<script type="application/json" id="timeline-data">{data}</script>
<script>
{script}
</script>
</body>
</html>
"""

# Reads only the JSON above and writes only with textContent, so no label is ever parsed as markup.
_SCRIPT = """(function () {
  const data = JSON.parse(document.getElementById("timeline-data").textContent);
  const svg = document.getElementById("plot");
  const tip = document.getElementById("tip");
  document.querySelectorAll("input[data-hide]").forEach(function (box) {
    box.addEventListener("change", function () {
      svg.classList.toggle("hide-" + box.dataset.hide, !box.checked);
    });
  });
  const gb = function (bytes) { return bytes === null ? "-" : (bytes / data.gb).toFixed(3) + " GB"; };
  const lastAtOrBefore = function (samples, x) {
    let lo = 0, hi = samples.length;  // first index whose place is after x
    while (lo < hi) { const mid = (lo + hi) >> 1; if (samples[mid][4] <= x) lo = mid + 1; else hi = mid; }
    return lo - 1;
  };
  svg.querySelectorAll("rect.hover").forEach(function (area) {
    const panel = data.panels[Number(area.dataset.panel)];
    const cursor = area.parentNode.querySelector(".cursor");
    area.addEventListener("mousemove", function (event) {
      const point = svg.createSVGPoint();
      point.x = event.clientX; point.y = event.clientY;
      const px = point.matrixTransform(svg.getScreenCTM().inverse()).x;
      const x = (px - panel.left) * data.x1 / panel.width;
      const lines = [[panel.side, panel.device].filter(Boolean).join(" \\u00b7 ")];
      const i = lastAtOrBefore(panel.samples, x);
      if (i < 0) {
        lines.push("no sample yet");
      } else {
        const s = panel.samples[i];
        lines.push("step " + s[5] + ", t = " + s[0].toFixed(3) + " s (modelled)",
                   "reserved  " + gb(s[1]), "resident  " + gb(s[2]), "committed " + gb(s[3]));
        if (!svg.classList.contains("hide-markers")) {  // the events of this sample's steps
          const until = i + 1 < panel.samples.length ? panel.samples[i + 1][5] : Infinity;
          panel.markers.forEach(function (m) {
            if (m[3] >= s[5] && m[3] < until) lines.push("step " + m[3] + " " + m[1] + ": " + m[2]);
          });
        }
      }
      tip.textContent = lines.join("\\n");
      tip.style.display = "block";
      tip.style.left = (event.clientX + 14) + "px";
      tip.style.top = (event.clientY + 14) + "px";
      cursor.setAttribute("x1", px); cursor.setAttribute("x2", px);
      cursor.setAttribute("visibility", "visible");
    });
    area.addEventListener("mouseleave", function () {
      tip.style.display = "none";
      cursor.setAttribute("visibility", "hidden");
    });
  });
})();"""
