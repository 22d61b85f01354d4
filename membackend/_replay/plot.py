"""Draw the replay's timelines: one picture comparing the stock side with the plugin side.

:func:`write_plot` takes the :class:`~membackend._replay.timeline.Timeline` of each side that
ran (keys ``"stock"`` and/or ``"plugin"``) and writes one file whose suffix picks the format:

* ``.png``, ``.svg``, ``.pdf``: a static figure drawn with matplotlib (the optional extra
  ``membackend[plot]``). matplotlib is imported only here, and only its non-interactive Agg
  canvas is used, so nothing ever opens a window.
* ``.html``: one self-contained page (inline SVG, inline CSS and a little inline JavaScript for
  hover tooltips and toggling series). It loads nothing from anywhere and needs no extra package.

The picture has one column per device and one row per side (stock above plugin). Within a
device both sides share the y scale, and every panel shares the time axis, so the panels compare
at a glance. Each panel draws reserved / resident / committed bytes (in GiB) as steps in sample
order, and vertical lines for the side's markers: one style for a model's full unload, another
for unload-everything, and a labelled line for each workflow switch.

The file is written to a temporary file in the same folder and renamed into place, so a failure
leaves the previous file (or no file) rather than half of a new one.
"""

from __future__ import annotations

import contextlib
import html
import json
import math
import os
import pathlib
import textwrap
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import IO, Any

from ..types import MembackendError
from .timeline import Marker, Sample, Timeline

__all__ = [
    "ACCEPTED_SUFFIXES",
    "MATPLOTLIB_SUFFIXES",
    "HTML_SUFFIX",
    "PlotUnavailable",
    "PlotFormatError",
    "write_plot",
]

MATPLOTLIB_SUFFIXES = (".png", ".svg", ".pdf")
HTML_SUFFIX = ".html"
ACCEPTED_SUFFIXES = (*MATPLOTLIB_SUFFIXES, HTML_SUFFIX)
INSTALL_HINT = 'pip install "membackend[plot]"'

SIDE_ORDER = ("stock", "plugin")  # stock's row above plugin's; any other key follows
SERIES = ("reserved", "resident", "committed")
MARKER_KINDS = ("unload", "unload_all", "workflow")
GiB = 1 << 30

SERIES_STYLE = {  # colour, matplotlib line style, SVG dash pattern
    "reserved": ("#1f77b4", "-", ""),
    "resident": ("#2ca02c", "-", ""),
    "committed": ("#d62728", "--", "6 3"),
}
MARKER_STYLE = {  # colour, matplotlib line style, line width, SVG dash pattern, legend text
    "unload": ("#9467bd", ":", 1.0, "2 3", "model unloaded"),
    "unload_all": ("#000000", "--", 1.6, "7 4", "unload all"),
    "workflow": ("#ff7f0e", "-", 1.2, "", "workflow switch"),
}
FALLBACK_MARKER_STYLE = ("#7f7f7f", "-.", 1.0, "4 2 1 2", "other")
WORKFLOW_LABEL_CHARS = 40  # longer workflow names are cut in the static picture (the page shows them whole)


class PlotUnavailable(MembackendError, RuntimeError):
    """A matplotlib format was asked for and matplotlib is not installed."""


class PlotFormatError(MembackendError, ValueError):
    """The output path's suffix names no format :func:`write_plot` can write."""


def write_plot(
    path: str | os.PathLike[str],
    timelines: dict[str, Timeline],
    *,
    title: str,
    reported: str | None = None,
) -> pathlib.Path:
    """Write the timelines of the sides that ran to ``path`` and return it as a :class:`pathlib.Path`.

    ``timelines`` maps a side (``"stock"``, ``"plugin"``) to its timeline; either may be missing,
    and a timeline without samples gives an empty panel with a note. ``title`` goes on top;
    ``reported`` (a short sentence of what the run reported), when given, goes underneath as a
    caption. The suffix of ``path`` (case ignored) picks the format, see :data:`ACCEPTED_SUFFIXES`.

    Raises :class:`PlotFormatError` for any other suffix, :class:`PlotUnavailable` when a
    matplotlib format is asked for without matplotlib installed, and :class:`OSError` when the
    folder of ``path`` does not exist or cannot be written. On any failure no new file is left
    at ``path`` (a file already there stays as it was).
    """
    target = check_plot_target(path)
    suffix = target.suffix.lower()
    layout = _lay_out(timelines)
    if suffix == HTML_SUFFIX:
        page = _html_page(layout, title=title, reported=reported).encode("utf-8")
        _write_atomically(target, lambda fh: fh.write(page))
    else:
        figure = _matplotlib_figure(layout, title=title, reported=reported, suffix=suffix)
        _write_atomically(target, lambda fh: _save_figure(figure, fh, suffix[1:]))
    return target


def check_plot_target(path: str | os.PathLike[str]) -> pathlib.Path:
    """Check, before any work, that :func:`write_plot` can write ``path``: a known suffix, matplotlib
    importable for its formats, an existing folder. Raises what :func:`write_plot` would."""
    target = pathlib.Path(path)
    suffix = target.suffix.lower()
    if suffix not in ACCEPTED_SUFFIXES:
        raise PlotFormatError(
            f"cannot write a plot to {str(target)!r}: the suffix {target.suffix or '(none)'!r} names no"
            f" format; use one of {', '.join(ACCEPTED_SUFFIXES)}"
        )
    if suffix in MATPLOTLIB_SUFFIXES:
        _import_matplotlib(suffix)
    folder = target.parent
    if not folder.is_dir():
        raise FileNotFoundError(2, "no such folder for the plot", str(folder))
    if target.is_dir():
        raise IsADirectoryError(21, "the plot path is a folder", str(target))
    return target


def _write_atomically(target: pathlib.Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Let ``write`` fill a temporary file next to ``target``, then rename it over ``target``."""
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.chmod(temporary, 0o644)  # mkstemp makes it owner-only; the picture is meant to be shared
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


# --------------------------------------------------------------------------- layout shared by both renderers


Segment = list[tuple[float, int]]  # step vertices (t, bytes), ready to be joined by straight lines


@dataclass
class _Panel:
    """What one side recorded on one device."""

    side: str
    device: str
    samples: list[Sample]
    markers: list[Marker]
    series: dict[str, list[Segment]] = field(default_factory=dict)  # a name absent: nothing to draw


@dataclass
class _Layout:
    sides: list[str]  # the rows
    devices: list[str]  # the columns
    t_min: float
    t_max: float
    y_max: dict[str, int]  # per device, the largest value either side drew, in bytes
    panels: dict[tuple[str, str], _Panel]

    @property
    def rows(self) -> list[str]:
        return self.sides or [""]  # no timeline at all still gets one (empty) panel

    @property
    def columns(self) -> list[str]:
        return self.devices or [""]

    def panel(self, side: str, device: str) -> _Panel:
        return self.panels.get((side, device)) or _Panel(side, device, [], [])


def _lay_out(timelines: dict[str, Timeline]) -> _Layout:
    """Order the sides and devices, split samples and markers into panels, and fix the scales."""
    sides = [s for s in SIDE_ORDER if s in timelines] + [s for s in timelines if s not in SIDE_ORDER]
    devices: dict[str, None] = {}
    for side in sides:
        devices.update(dict.fromkeys(timelines[side].devices()))
    for side in sides:  # a marker aimed at a device nobody sampled still gets its column
        devices.update(dict.fromkeys(m.device for m in timelines[side].markers if m.device is not None))

    times = [s.t for side in sides for s in timelines[side].samples]
    times += [m.t for side in sides for m in timelines[side].markers]
    t_min, t_max = (min(0.0, *times), max(times)) if times else (0.0, 1.0)  # the modelled clock starts at 0
    if t_max <= t_min:
        t_max = t_min + 1.0

    panels: dict[tuple[str, str], _Panel] = {}
    y_max: dict[str, int] = dict.fromkeys(devices, 0)
    for side in sides:
        timeline = timelines[side]
        side_times = [s.t for s in timeline.samples] + [m.t for m in timeline.markers]
        side_end = max(side_times, default=t_min)  # every value holds until the side's last event
        for device in devices:
            samples = [s for s in timeline.samples if s.device == device]
            markers = [m for m in timeline.markers if m.device is None or m.device == device]
            panel = _Panel(side, device, samples, markers)
            for name in SERIES:
                segments = _step_segments(((s.t, getattr(s, name)) for s in samples), side_end)
                if segments:
                    panel.series[name] = segments
                    y_max[device] = max(y_max[device], *(v for seg in segments for _, v in seg))
            panels[(side, device)] = panel
    return _Layout(sides, list(devices), t_min, t_max, y_max, panels)


def _step_segments(points: Iterable[tuple[float, int | None]], end: float) -> list[Segment]:
    """Turn samples into step vertices: each value holds until the next sample, the last until ``end``.

    A ``None`` value (nothing measured) breaks the line until the next measured sample.
    """
    segments: list[Segment] = []
    current: Segment = []
    for t, value in points:
        if current and t != current[-1][0]:
            current.append((t, current[-1][1]))  # hold the previous value up to this instant
        if value is None:
            if current:
                segments.append(current)
                current = []
            continue
        current.append((t, value))
    if current:
        if end > current[-1][0]:
            current.append((end, current[-1][1]))
        segments.append(current)
    return segments


def _panel_title(panel: _Panel) -> str:
    return " · ".join(part for part in (panel.side, panel.device) if part)


def _empty_note(layout: _Layout, panel: _Panel) -> str | None:
    """The note an empty panel carries, or ``None`` when the panel has data."""
    if not layout.sides:
        return "no timeline recorded"
    if not panel.samples:
        return "no samples" + (f" on {panel.device}" if panel.device else "")
    return None


# --------------------------------------------------------------------------- matplotlib (png, svg, pdf)


def _import_matplotlib(suffix: str) -> None:
    try:
        import matplotlib  # noqa: F401  (the import that fails when the extra is missing)
        import matplotlib.backends.backend_agg  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(
            f"writing a {suffix} plot needs matplotlib, which is not installed; install it with"
            f" {INSTALL_HINT} (or ask for an {HTML_SUFFIX} plot, which needs nothing extra)"
        ) from exc


def _matplotlib_figure(layout: _Layout, *, title: str, reported: str | None, suffix: str) -> Any:
    """Draw the static figure; matplotlib is imported here so the rest of membackend never needs it."""
    _import_matplotlib(suffix)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    rows, columns = layout.rows, layout.columns
    panel_height = 2.3  # inches per row
    width = min(max(6.4, 4.4 * len(columns)), 18.0)
    # a long caption wraps to the figure's width (about 15 characters an inch at 9 pt), else the
    # layout engine squeezes the panels to make room for one long line
    caption = textwrap.fill(reported, width=int(width * 15)) if reported else ""
    footer_height = 0.35 + 0.18 * (caption.count("\n") + 1 if caption else 0)  # the legend, the caption
    height = panel_height * len(rows) + footer_height + 0.9
    figure = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(figure)  # draw with Agg, never through pyplot's interactive machinery
    figure.suptitle(title, fontsize=11, parse_math=False)  # titles and names are text, never TeX
    # The legend and caption sit in a footer row of the grid, so the layout engine keeps them
    # clear of the panels' tick labels (figure-level text would be drawn over them).
    grid = figure.add_gridspec(len(rows) + 1, len(columns),
                               height_ratios=[panel_height] * len(rows) + [footer_height])
    axes = [[None] * len(columns) for _ in rows]
    for r in range(len(rows)):
        for c in range(len(columns)):
            axes[r][c] = figure.add_subplot(grid[r, c], sharex=axes[0][0] if r or c else None)
    footer = figure.add_subplot(grid[len(rows), :])
    footer.axis("off")
    if caption:
        footer.text(0.5, 0.0, caption, transform=footer.transAxes, ha="center", va="bottom",
                    fontsize=9, parse_math=False)
    seen_series: set[str] = set()
    seen_markers: set[str] = set()
    for r, side in enumerate(rows):
        for c, device in enumerate(columns):
            ax = axes[r][c]
            panel = layout.panel(side, device)
            ax.set_title(_panel_title(panel), fontsize=9, parse_math=False)
            ax.set_xlim(layout.t_min, layout.t_max)
            ax.set_ylim(0, max(layout.y_max.get(device, 0), GiB) / GiB * 1.08)
            ax.tick_params(labelsize=8)
            ax.grid(True, linewidth=0.4, alpha=0.5)
            if c == 0:
                ax.set_ylabel("GiB", fontsize=8)
            if r == len(rows) - 1:
                ax.set_xlabel("modelled time (s)", fontsize=8)
            note = _empty_note(layout, panel)
            if note:
                ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center",
                        fontsize=9, color="#666666", parse_math=False)
            for name, segments in panel.series.items():
                colour, linestyle, _ = SERIES_STYLE[name]
                for segment in segments:
                    ax.plot([t for t, _ in segment], [v / GiB for _, v in segment],
                            color=colour, linestyle=linestyle, linewidth=1.2)
                seen_series.add(name)
            for marker in panel.markers:
                colour, linestyle, linewidth, _, _ = MARKER_STYLE.get(marker.kind, FALLBACK_MARKER_STYLE)
                ax.axvline(marker.t, color=colour, linestyle=linestyle, linewidth=linewidth, alpha=0.8)
                seen_markers.add(marker.kind)
                if marker.kind == "workflow":
                    ax.text(marker.t, 0.97, _shorten(marker.label), transform=ax.get_xaxis_transform(),
                            rotation=90, ha="right", va="top", fontsize=7, color=colour,
                            parse_math=False, clip_on=True)

    handles = [Line2D([], [], color=SERIES_STYLE[n][0], linestyle=SERIES_STYLE[n][1], label=n)
               for n in SERIES if n in seen_series]
    for kind in sorted(seen_markers, key=_marker_order):
        colour, linestyle, linewidth, _, text = MARKER_STYLE.get(kind, FALLBACK_MARKER_STYLE)
        handles.append(Line2D([], [], color=colour, linestyle=linestyle, linewidth=linewidth,
                              label=text if kind in MARKER_STYLE else kind))
    if handles:
        footer.legend(handles=handles, loc="upper center", ncols=len(handles), fontsize=8,
                      frameon=False, borderaxespad=0.0)
    return figure


def _save_figure(figure: Any, fh: IO[bytes], fmt: str) -> None:
    """Save without dates or random ids, so redrawing the same replay gives the same bytes."""
    import matplotlib

    metadata = {"png": {}, "svg": {"Date": None}, "pdf": {"CreationDate": None}}[fmt]
    with matplotlib.rc_context({"svg.hashsalt": "membackend-replay"}):
        figure.savefig(fh, format=fmt, metadata=metadata)


def _shorten(label: str) -> str:
    return label if len(label) <= WORKFLOW_LABEL_CHARS else label[: WORKFLOW_LABEL_CHARS - 1] + "…"


def _marker_order(kind: str) -> tuple[int, str]:
    return (MARKER_KINDS.index(kind) if kind in MARKER_KINDS else len(MARKER_KINDS), kind)


# --------------------------------------------------------------------------- self-contained HTML


CELL_WIDTH, CELL_HEIGHT = 470, 230  # one panel with its axes, in SVG units
PAD_LEFT, PAD_RIGHT, PAD_TOP, PAD_BOTTOM = 52, 14, 26, 34


def _html_page(layout: _Layout, *, title: str, reported: str | None) -> str:
    """The whole page as text. Every string that came from the caller or a trace is escaped."""
    esc = html.escape  # quote=True: also safe inside attribute values
    rows, columns = layout.rows, layout.columns
    width, height = CELL_WIDTH * len(columns), CELL_HEIGHT * len(rows)
    plot_w, plot_h = CELL_WIDTH - PAD_LEFT - PAD_RIGHT, CELL_HEIGHT - PAD_TOP - PAD_BOTTOM
    span = layout.t_max - layout.t_min
    x_ticks = _nice_ticks(layout.t_min, layout.t_max)

    svg: list[str] = []
    data_panels: list[dict[str, Any]] = []
    for r, side in enumerate(rows):
        for c, device in enumerate(columns):
            panel = layout.panel(side, device)
            left, top = c * CELL_WIDTH + PAD_LEFT, r * CELL_HEIGHT + PAD_TOP
            y_ticks = _nice_ticks(0.0, max(layout.y_max.get(device, 0), GiB) / GiB)
            y_top = y_ticks[-1]

            def x_of(t: float, left: float = left) -> float:
                return left + (t - layout.t_min) / span * plot_w

            def y_of(value: int, top: float = top, y_top: float = y_top) -> float:
                return top + plot_h - value / GiB / y_top * plot_h

            svg.append('<g class="panel">')
            svg.append(f'<text class="ptitle" x="{left}" y="{top - 8}">{esc(_panel_title(panel))}</text>')
            for tick in y_ticks:
                y = y_of(round(tick * GiB))
                svg.append(f'<line class="grid" x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}"/>')
                svg.append(f'<text class="tick" x="{left - 5}" y="{y + 3:.1f}" text-anchor="end">{_tick_text(tick)}</text>')
            for tick in x_ticks:
                x = x_of(tick)
                svg.append(f'<line class="grid" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + plot_h}"/>')
                svg.append(f'<text class="tick" x="{x:.1f}" y="{top + plot_h + 13}" text-anchor="middle">{_tick_text(tick)}</text>')
            if c == 0:
                svg.append(f'<text class="tick" x="{left - 40}" y="{top + plot_h / 2:.1f}"'
                           f' transform="rotate(-90 {left - 40} {top + plot_h / 2:.1f})" text-anchor="middle">GiB</text>')
            if r == len(rows) - 1:
                svg.append(f'<text class="tick" x="{left + plot_w / 2:.1f}" y="{top + plot_h + 28}"'
                           f' text-anchor="middle">modelled time (s)</text>')
            svg.append(f'<rect class="frame" x="{left}" y="{top}" width="{plot_w}" height="{plot_h}"/>')
            note = _empty_note(layout, panel)
            if note:
                svg.append(f'<text class="note" x="{left + plot_w / 2:.1f}" y="{top + plot_h / 2:.1f}"'
                           f' text-anchor="middle">{esc(note)}</text>')
            for name, segments in panel.series.items():
                colour, _, dash = SERIES_STYLE[name]
                path = " ".join(
                    "M" + " L".join(f"{x_of(t):.1f} {y_of(v):.1f}" for t, v in segment) for segment in segments
                )
                dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
                svg.append(f'<path class="series s-{name}" d="{path}" stroke="{colour}"{dash_attr}/>')
            for marker in panel.markers:
                colour, _, linewidth, dash, _ = MARKER_STYLE.get(marker.kind, FALLBACK_MARKER_STYLE)
                x = x_of(marker.t)
                dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
                svg.append(
                    f'<line class="marker" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{top + plot_h}"'
                    f' stroke="{colour}" stroke-width="{linewidth}"{dash_attr}>'
                    f"<title>{esc(marker.kind)}: {esc(marker.label)}</title></line>"
                )
                if marker.kind == "workflow":
                    svg.append(
                        f'<text class="marker wlabel" x="{x - 3:.1f}" y="{top + 4}" fill="{colour}"'
                        f' transform="rotate(-90 {x - 3:.1f} {top + 4})" text-anchor="end">{esc(marker.label)}</text>'
                    )
            svg.append(f'<line class="cursor" x1="0" y1="{top}" x2="0" y2="{top + plot_h}" visibility="hidden"/>')
            svg.append(f'<rect class="hover" data-panel="{len(data_panels)}" x="{left}" y="{top}"'
                       f' width="{plot_w}" height="{plot_h}"/>')
            svg.append("</g>")
            data_panels.append({
                "side": panel.side,
                "device": panel.device,
                "left": left,
                "width": plot_w,
                "samples": [[s.t, s.reserved, s.resident, s.committed] for s in panel.samples],
                "markers": [[m.t, m.kind, m.label] for m in panel.markers],
            })

    data = {"t0": layout.t_min, "t1": layout.t_max, "gib": GiB, "panels": data_panels}
    toggles = "".join(
        f'<label><input type="checkbox" data-hide="{name}" checked>'
        f'<span class="swatch" style="border-color:{SERIES_STYLE[name][0]}"></span>{name}</label>'
        for name in SERIES
    )
    toggles += ('<label><input type="checkbox" data-hide="markers" checked>markers</label>'
                + "".join(f'<span class="key"><span class="swatch" style="border-color:{style[0]};'
                          f'border-top-style:{"dotted" if kind == "unload" else "dashed" if kind == "unload_all" else "solid"}">'
                          f"</span>{style[4]}</span>" for kind, style in MARKER_STYLE.items()))
    caption = f'<p class="caption">{esc(reported)}</p>' if reported else ""
    return _PAGE.format(
        title=esc(title),
        caption=caption,
        toggles=toggles,
        width=width,
        height=height,
        svg="\n".join(svg),
        data=_script_safe_json(data),
        script=_SCRIPT,
    )


def _nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values from ``low`` to at least ``high``, about ``count`` of them."""
    span = max(high - low, 1e-12)
    raw = span / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.floor(low / step + 1e-9) * step
    ticks = [first]
    while ticks[-1] < high - step * 1e-9:
        ticks.append(first + len(ticks) * step)
    return [t for t in ticks if t >= low - step * 1e-9] or [low]


def _tick_text(value: float) -> str:
    return f"{value:.6g}"


def _script_safe_json(value: Any) -> str:
    """JSON that cannot end the <script> element it sits in, whatever the labels contain."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>{title}</title>
<style>
body {{ font: 13px system-ui, sans-serif; margin: 16px; color: #222; }}
h1 {{ font-size: 17px; margin: 0 0 4px; }}
.caption {{ margin: 0 0 8px; color: #444; }}
.controls label, .controls .key {{ margin-right: 14px; white-space: nowrap; }}
.swatch {{ display: inline-block; width: 18px; height: 0; border-top: 2px solid; margin: 0 4px 3px 2px; vertical-align: middle; }}
svg {{ display: block; margin-top: 8px; }}
.ptitle {{ font-size: 12px; font-weight: 600; }}
.tick {{ font-size: 10px; fill: #555; }}
.note {{ font-size: 12px; fill: #888; }}
.grid {{ stroke: #e4e4e4; stroke-width: 1; }}
.frame {{ fill: none; stroke: #999; }}
.series {{ fill: none; stroke-width: 1.5; }}
.wlabel {{ font-size: 10px; }}
.cursor {{ stroke: #666; stroke-width: 0.7; }}
.hover {{ fill: transparent; pointer-events: all; }}
.hide-reserved .s-reserved, .hide-resident .s-resident, .hide-committed .s-committed, .hide-markers .marker {{ display: none; }}
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
  const gib = function (bytes) { return bytes === null ? "-" : (bytes / data.gib).toFixed(3) + " GiB"; };
  const lastAtOrBefore = function (samples, t) {
    let lo = 0, hi = samples.length;  // first index whose time is after t
    while (lo < hi) { const mid = (lo + hi) >> 1; if (samples[mid][0] <= t) lo = mid + 1; else hi = mid; }
    return lo - 1;
  };
  svg.querySelectorAll("rect.hover").forEach(function (area) {
    const panel = data.panels[Number(area.dataset.panel)];
    const cursor = area.parentNode.querySelector(".cursor");
    area.addEventListener("mousemove", function (event) {
      const point = svg.createSVGPoint();
      point.x = event.clientX; point.y = event.clientY;
      const x = point.matrixTransform(svg.getScreenCTM().inverse()).x;
      const perUnit = (data.t1 - data.t0) / panel.width;
      const t = data.t0 + (x - panel.left) * perUnit;
      const lines = [[panel.side, panel.device].filter(Boolean).join(" \\u00b7 "), "t = " + t.toFixed(3) + " s"];
      const i = lastAtOrBefore(panel.samples, t);
      if (i < 0) {
        lines.push("no sample yet");
      } else {
        const s = panel.samples[i];
        lines.push("reserved  " + gib(s[1]), "resident  " + gib(s[2]), "committed " + gib(s[3]));
      }
      if (!svg.classList.contains("hide-markers")) {
        panel.markers.forEach(function (m) {
          if (Math.abs(m[0] - t) <= 4 * perUnit) lines.push(m[1] + ": " + m[2] + " (t = " + m[0].toFixed(3) + " s)");
        });
      }
      tip.textContent = lines.join("\\n");
      tip.style.display = "block";
      tip.style.left = (event.clientX + 14) + "px";
      tip.style.top = (event.clientY + 14) + "px";
      cursor.setAttribute("x1", x); cursor.setAttribute("x2", x);
      cursor.setAttribute("visibility", "visible");
    });
    area.addEventListener("mouseleave", function () {
      tip.style.display = "none";
      cursor.setAttribute("visibility", "hidden");
    });
  });
})();"""
