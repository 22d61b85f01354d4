"""Draw the replay's timelines: one picture comparing the stock side with the plugin side.

:func:`write_plot` takes the :class:`~membackend._replay.timeline.Timeline` of each side that
ran (keys ``"stock"`` and/or ``"plugin"``) and writes one file whose suffix picks the format:

* ``.png``, ``.svg``, ``.pdf``: a static figure drawn with matplotlib (the optional extra
  ``membackend[plot]``). matplotlib is imported only here, and only its non-interactive Agg
  canvas is used, so nothing ever opens a window.
* ``.html``: one self-contained page (inline SVG, inline CSS and a little inline JavaScript for
  hover tooltips and toggling series). It loads nothing from anywhere and needs no extra package.

The picture has one column per device and one row per side (stock above plugin). Within a
device both sides share the y scale. Each panel draws reserved (address space), resident and
committed bytes in GiB as steps: committed wide and pale, resident on it, reserved dashed on
top, so every line shows where values are equal; a triangle marks each release (reserved or
committed falling). Vertical lines mark a model's full unload, unload-everything, each workflow switch
and each fault that ran out of memory, each labelled above the panel; a row of crosses along
the top marks every simulated bugcheck and every free that raced pending work. Under each
panel's title, a summary: what the side still held at the end, and its failure counts.

The x axis counts replay steps, not modelled time: step ``k`` is the state after the trace's
``k``-th event, and both sides replay the same events, so one x is the same moment of the
workload in every panel. Unloads, releases and workflow switches take no modelled time; on a
time axis every unload of a run and the release after it would share its last pixel column.
Every step is equally wide except the steps of an unload (the unload's own and the
instantaneous ones after it, such as the idle that gives memory back), which share about a
third of the width, so each unload and each release gets a span of its own. Workflow labels
carry each run's modelled seconds, so time is still read off the picture.

The file is written to a temporary file in the same folder and renamed into place, so a failure
leaves the previous file (or no file) rather than half of a new one.
"""

from __future__ import annotations

import bisect
import contextlib
import html
import json
import math
import os
import pathlib
import textwrap
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from ..types import PlotFormatError, PlotUnavailable
from .timeline import TALLY_MARKERS, Marker, Sample, Timeline

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
SERIES_LABEL = {
    "reserved": "reserved (address space)",
    "resident": "resident",
    "committed": "committed",
}
GiB = 1 << 30


@dataclass(frozen=True)
class _LineStyle:
    colour: str
    dash: str  # matplotlib line style
    width: float
    alpha: float
    z: float
    svg_dash: str  # SVG stroke-dasharray, "" for solid


#: committed is wide and pale and drawn first, resident thin on it, reserved dashed on top: where
#: values are equal every line still shows (around the resident line, through the dashes' gaps)
SERIES_STYLE = {
    "reserved": _LineStyle("#1f77b4", "--", 1.3, 1.0, 3.5, "6 3"),
    "committed": _LineStyle("#d62728", "-", 4.0, 0.35, 1.0, ""),
    "resident": _LineStyle("#2ca02c", "-", 1.4, 1.0, 3.0, ""),
}
DRAW_ORDER = ("committed", "resident", "reserved")

MARKER_KINDS = ("workflow", "unload", "unload_all", "oom")  # vertical lines, in the legend's order
MARKER_STYLE = {  # colour, matplotlib line style, line width, SVG dash pattern, legend text
    "unload": ("#9467bd", ":", 1.4, "2 3", "model unloaded"),
    "unload_all": ("#000000", "--", 1.6, "7 4", "unload all"),
    "workflow": ("#ff7f0e", "-", 1.2, "", "workflow switch (its modelled run time)"),
    "oom": ("#e377c2", "-", 1.6, "", "fault out of memory"),
}
FALLBACK_MARKER_STYLE = ("#7f7f7f", "-.", 1.0, "4 2 1 2", "other")
UNLOAD_KINDS = ("unload", "unload_all")
RUG_KINDS = ("bugcheck", "raced_free")  # too many for lines: a row of glyphs along the panel's top
RUG_STYLE = {  # colour, matplotlib marker, height in the panel (axes fraction), legend text
    "bugcheck": ("#b2182b", "x", 0.95, "simulated bugcheck"),
    "raced_free": ("#8c510a", "|", 0.89, "free raced pending work"),
}
TALLY_TEXT = {  # singular, plural
    "bugchecks": ("simulated bugcheck", "simulated bugchecks"),
    "raced_frees": ("free raced pending work", "frees raced pending work"),
    "oom": ("fault out of memory", "faults out of memory"),
}
RELEASE_LABEL = "released (reserved or committed fell)"
RELEASE_GLYPH = [(0.0, 0.0), (-0.5, 1.0), (0.5, 1.0), (0.0, 0.0)]  # a triangle pointing down, its tip at (0, 0)
WORKFLOW_LABEL_CHARS = 40  # longer model and workflow names are cut in the static picture (the page keeps them)

WIDENED_SHARE = 0.33  # of the x axis: what the unload steps share, when there are several
WIDENED_STEP_SHARE = 0.08  # of the x axis: the most one unload step gets
RELEASE_MIN_SHARE = 0.02  # a fall smaller than this share of the device's scale gets no release mark
TICK_MIN_SHARE = 0.07  # of the x axis: the least room between two step tick labels
MAX_LANES = 4  # rows of marker labels above a panel; a label that fits in none is left out
HEADROOM = 1.08  # the y scale over the largest value
RUG_HEADROOM = 1.3  # ... where a row of crosses runs along the top


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
    importable for its formats, an existing folder. Raises what :func:`write_plot` would; an empty
    ``path`` (which ``pathlib`` would read as the current folder) is a :class:`PlotFormatError`."""
    if not os.fspath(path):
        raise PlotFormatError(
            "an empty path names no file to write the plot to; accepted: a file path ending in"
            f" {', '.join(ACCEPTED_SUFFIXES)} ({', '.join(MATPLOTLIB_SUFFIXES)} need membackend[plot])"
        )
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


Segment = list[tuple[float, int]]  # step vertices (x, bytes), ready to be joined by straight lines


@dataclass
class _Placed:
    """A marker with its place on the step axis."""

    marker: Marker
    step: int  # the first of the panel's samples that comes after it
    x: float
    text: str | None  # the label written above the panel; None for a rug glyph


@dataclass
class _Release:
    series: str  # "reserved" or "committed"
    x: float  # where the fall is drawn
    value: int  # bytes, after the fall


@dataclass
class _Panel:
    """What one side recorded on one device."""

    side: str
    device: str
    samples: list[Sample]
    steps: list[int] = field(default_factory=list)  # each sample's replay step, ascending
    markers: list[_Placed] = field(default_factory=list)
    series: dict[str, list[Segment]] = field(default_factory=dict)  # a name absent: nothing to draw
    releases: list[_Release] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)  # under the title: the end state, the failure counts

    @property
    def labelled(self) -> list[_Placed]:
        return [p for p in self.markers if p.text is not None]

    @property
    def rug(self) -> list[_Placed]:
        return [p for p in self.markers if p.text is None]


@dataclass
class _Layout:
    sides: list[str]  # the rows
    devices: list[str]  # the columns
    edges: list[float]  # step k spans edges[k] .. edges[k + 1]; shared by every panel
    widened: set[int]  # the unload steps, wider than the rest
    y_max: dict[str, int]  # per device, the largest value either side drew, in bytes
    panels: dict[tuple[str, str], _Panel]
    has_rug: bool = False

    @property
    def steps(self) -> int:
        return len(self.edges) - 1

    @property
    def x_max(self) -> float:
        return self.edges[-1] if self.edges[-1] > 0 else 1.0

    @property
    def rows(self) -> list[str]:
        return self.sides or [""]  # no timeline at all still gets one (empty) panel

    @property
    def columns(self) -> list[str]:
        return self.devices or [""]

    def panel(self, side: str, device: str) -> _Panel:
        return self.panels.get((side, device)) or _Panel(side, device, [])

    def y_top(self, device: str) -> float:
        """The y scale's top for ``device``, in GiB."""
        return max(self.y_max.get(device, 0), GiB) / GiB * (RUG_HEADROOM if self.has_rug else HEADROOM)

    def x_ticks(self) -> list[tuple[float, str]]:
        """Round step numbers at their place on the axis, those too close to the previous one left out."""
        out: list[tuple[float, str]] = []
        for step in _nice_ticks(0.0, float(max(self.steps, 1))):
            k = int(round(step))
            if k > self.steps:
                break
            x = self.edges[k]
            if not out or x - out[-1][0] >= TICK_MIN_SHARE * self.x_max:
                out.append((x, f"{k}"))
        return out


def _lay_out(timelines: dict[str, Timeline]) -> _Layout:
    """Order the sides and devices, place samples and markers on the step axis, and fix the scales."""
    sides = [s for s in SIDE_ORDER if s in timelines] + [s for s in timelines if s not in SIDE_ORDER]
    devices: dict[str, None] = {}
    for side in sides:
        devices.update(dict.fromkeys(timelines[side].devices()))
    for side in sides:  # a marker aimed at a device nobody sampled still gets its column
        devices.update(dict.fromkeys(m.device for m in timelines[side].markers if m.device is not None))

    panels: dict[tuple[str, str], _Panel] = {}
    placed: dict[tuple[str, str], list[tuple[Marker, int]]] = {}
    side_end: dict[str, int] = {}  # per side, one past its last step
    for side in sides:
        timeline = timelines[side]
        for device in devices:
            samples = [s for s in timeline.samples if s.device == device]
            steps = [s.step if s.step is not None else k for k, s in enumerate(samples)]
            times = [s.t for s in samples]
            here = []
            for m in timeline.markers:
                if m.device is not None and m.device != device:
                    continue
                if m.step is not None:
                    step = m.step
                else:  # placed by time: at the first sample at or after it
                    k = bisect.bisect_left(times, m.t)
                    step = steps[k] if k < len(steps) else (steps[-1] + 1 if steps else 0)
                here.append((m, step))
            panels[(side, device)] = _Panel(side, device, samples, steps)
            placed[(side, device)] = here
        side_end[side] = 1 + max([st for (sd, _), p in panels.items() if sd == side for st in p.steps]
                                 + [st for (sd, _), ms in placed.items() if sd == side for _, st in ms], default=-1)

    steps_total = max(side_end.values(), default=0)
    widened = _unload_steps(panels, placed)
    edges = _edges(steps_total, widened)
    layout = _Layout(sides, list(devices), edges, widened, dict.fromkeys(devices, 0), panels)
    layout.has_rug = any(m.kind in RUG_KINDS for ms in placed.values() for m, _ in ms)

    shown_tallies = [n for n in TALLY_MARKERS if any(timelines[s].tallies.get(n) for s in sides)]
    for (side, device), panel in panels.items():
        timeline = timelines[side]
        for name in SERIES:
            points = ((edges[k], getattr(s, name)) for k, s in zip(panel.steps, panel.samples))
            segments = _step_segments(points, edges[side_end[side]])  # every value holds until the side's last step
            if segments:
                panel.series[name] = segments
                layout.y_max[device] = max(layout.y_max[device], *(v for seg in segments for _, v in seg))
        seconds = _run_seconds(timeline)
        for m, step in placed[(side, device)]:
            text = None if m.kind in RUG_KINDS else _marker_text(m, seconds.get(id(m)))
            panel.markers.append(_Placed(m, step, edges[min(step, steps_total)], text))
        panel.summary = _summary(panel, timeline, shown_tallies)
    for (side, device), panel in panels.items():
        panel.releases = _releases(panel, edges, layout.y_max[device])
    return layout


def _unload_steps(panels: dict[tuple[str, str], _Panel], placed: dict[tuple[str, str], list[tuple[Marker, int]]]
                  ) -> set[int]:
    """The steps of every unload: the unload's own and the instantaneous ones after it (as long as the
    side's modelled time stands still), on any panel."""
    known: dict[str, list[tuple[int, float]]] = {}  # per side, (step, t) of every sample and marker
    for (side, _), panel in panels.items():
        known.setdefault(side, []).extend(zip(panel.steps, (s.t for s in panel.samples)))
    for (side, _), ms in placed.items():
        known[side].extend((step, m.t) for m, step in ms)
    out: set[int] = set()
    for (side, _), ms in placed.items():
        for marker, step in ms:
            if marker.kind in UNLOAD_KINDS:
                # the modelled clock never runs back, so every step up to the last one still at the
                # unload's time is part of it
                last = max([st for st, t in known[side] if t == marker.t and st >= step], default=step)
                out.update(range(step, last + 1))
    return out


def _edges(steps: int, widened: set[int]) -> list[float]:
    """Where each step begins (and, last, where the last one ends): width 1 a step, more for the widened."""
    widened = {k for k in widened if 0 <= k < steps}
    plain = steps - len(widened)
    share = min(WIDENED_SHARE / len(widened), WIDENED_STEP_SHARE) if widened and plain else 0.0
    wide = share * plain / (1.0 - share * len(widened)) if share else 1.0
    edges = [0.0]
    for k in range(steps):
        edges.append(edges[-1] + (wide if k in widened else 1.0))
    return edges


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


def _run_seconds(timeline: Timeline) -> dict[int, float]:
    """Each workflow marker's run, in modelled seconds: until the next switch, the last until the side's end."""
    switches = [m for m in timeline.markers if m.kind == "workflow"]
    end = max([s.t for s in timeline.samples] + [m.t for m in timeline.markers], default=0.0)
    return {id(m): (switches[i + 1].t if i + 1 < len(switches) else end) - m.t for i, m in enumerate(switches)}


def _marker_text(marker: Marker, seconds: float | None) -> str:
    """The label written above a marker's line."""
    if marker.kind == "workflow":
        return marker.label + (f" · {_seconds_text(seconds)}" if seconds else "")
    if marker.kind == "unload":
        return f"unload {marker.label}"
    if marker.kind == "unload_all":
        return "unload all"
    if marker.kind == "oom":
        return "out of memory" + (f" ×{marker.label}" if marker.label not in ("", "1") else "")
    return f"{marker.kind} {marker.label}".strip()


def _seconds_text(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 100 else f"{seconds:.3g} s"


def _gib_text(value: int) -> str:
    return "0" if value == 0 else f"{value / GiB:.3g}"


def _summary(panel: _Panel, timeline: Timeline, tallies: Sequence[str]) -> list[str]:
    """What the side held at its end on this device, then its failure counts (those that any side had)."""
    out = []
    if panel.samples:
        last = panel.samples[-1]
        held = [f"reserved {_gib_text(last.reserved)}", f"resident {_gib_text(last.resident)}"]
        if last.committed is not None:
            held.append(f"committed {_gib_text(last.committed)}")
        out.append("at the end: " + ", ".join(held) + " GiB")
    counts = []
    for name in tallies:
        if name in timeline.tallies:
            n = timeline.tallies[name]
            counts.append(f"{n:,} {TALLY_TEXT[name][0 if n == 1 else 1]}")
    if counts:
        out.append("in this run: " + ", ".join(counts))
    return out


def _releases(panel: _Panel, edges: list[float], y_max: int) -> list[_Release]:
    """Every step where reserved or committed fell by a visible amount."""
    out = []
    least = max(RELEASE_MIN_SHARE * y_max, 1)
    for k in range(1, len(panel.samples)):
        before, now = panel.samples[k - 1], panel.samples[k]
        for name in ("reserved", "committed"):
            old, new = getattr(before, name), getattr(now, name)
            if old is not None and new is not None and old - new >= least:
                out.append(_Release(name, edges[panel.steps[k]], new))
    return out


def _panel_title(panel: _Panel) -> str:
    return " · ".join(part for part in (panel.side, panel.device) if part)


def _empty_note(layout: _Layout, panel: _Panel) -> str | None:
    """The note an empty panel carries, or ``None`` when the panel has data."""
    if not layout.sides:
        return "no timeline recorded"
    if not panel.samples:
        return "no samples" + (f" on {panel.device}" if panel.device else "")
    return None


def _assign_lanes(spans: Sequence[tuple[float, float]], left: float, right: float, gap: float,
                  lanes: int = MAX_LANES) -> list[tuple[int, bool] | None]:
    """Rows for labels that must not overlap: ``spans`` are (anchor, width) in one unit; a label
    starts at its anchor, or ends there (``True``, flipped) where it would run past ``right``.
    Returns, per label, ``(lane, flipped)``, lane 0 nearest the panel, or ``None`` where no lane
    has room. ``left`` is where labels may begin."""
    placed: list[tuple[float, float, int]] = []
    for i, (anchor, width) in enumerate(spans):
        flipped = anchor + width > right and anchor - width >= left
        start = anchor - width if flipped else anchor
        placed.append((start, start + width, i))
    ends: list[float] = []  # per lane, where its last label ends
    out: list[tuple[int, bool] | None] = [None] * len(spans)
    for start, end, i in sorted(placed):
        lane = next((n for n, last in enumerate(ends) if start >= last + gap), None)
        if lane is None and len(ends) < lanes:
            lane = len(ends)
            ends.append(end)
        elif lane is not None:
            ends[lane] = end
        if lane is not None:
            out[i] = (lane, start < spans[i][0])
    return out


def _shorten(label: str, chars: int = WORKFLOW_LABEL_CHARS) -> str:
    return label if len(label) <= chars else label[: chars - 1] + "…"


def _marker_order(kind: str) -> tuple[int, str]:
    return (MARKER_KINDS.index(kind) if kind in MARKER_KINDS else len(MARKER_KINDS), kind)


# --------------------------------------------------------------------------- matplotlib (png, svg, pdf)


LANE_PT = 9.5  # one row of marker labels, in points
LABEL_PT = 7.0
SUMMARY_PT = 7.5
TITLE_PT = 9.0
DPI = 100


def _import_matplotlib(suffix: str) -> None:
    try:
        import matplotlib  # noqa: F401  (the import that fails when the extra is missing)
        import matplotlib.backends.backend_agg  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(
            f"writing a {suffix} plot needs matplotlib, which is not installed; install it with"
            f" {INSTALL_HINT} (or ask for an {HTML_SUFFIX} plot, which needs nothing extra)"
        ) from exc


def _legend_entries(layout: _Layout) -> list[tuple[str, str]]:
    """(what, kind) of every legend entry the picture needs: series, release marks, lines, glyphs."""
    panels = [layout.panel(side, device) for side in layout.rows for device in layout.columns]
    out = [("series", n) for n in SERIES if any(n in p.series for p in panels)]
    if any(p.releases for p in panels):
        out.append(("release", ""))
    kinds = {p.marker.kind for panel in panels for p in panel.labelled}
    out += [("line", k) for k in sorted(kinds, key=_marker_order)]
    out += [("rug", k) for k in RUG_KINDS if any(p.marker.kind == k for panel in panels for p in panel.rug)]
    return out


def _matplotlib_figure(layout: _Layout, *, title: str, reported: str | None, suffix: str) -> Any:
    """Draw the static figure; matplotlib is imported here so the rest of membackend never needs it.

    Labels are placed in two passes: the layout engine places the panels, then the marker labels
    are sorted into rows that do not overlap, and the figure is laid out again with room for them.
    """
    _import_matplotlib(suffix)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.font_manager import FontProperties
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedFormatter, FixedLocator

    rows, columns = layout.rows, layout.columns
    width = min(max(9.0, 5.2 * len(columns)), 18.0)
    # a long caption wraps to the figure's width (about 14 characters an inch at 9 pt), else the
    # layout engine squeezes the panels to make room for one long line
    caption = textwrap.fill(reported, width=int(width * 14)) if reported else ""
    figure = Figure(figsize=(width, 4.0), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)  # draw with Agg, never through pyplot's interactive machinery
    renderer = figure.canvas.get_renderer()

    entries = _legend_entries(layout)
    handles = [_legend_handle(what, kind, Line2D) for what, kind in entries]
    legend_font = FontProperties(size=8)
    ncols = _legend_columns([h.get_label() for h in handles], width * DPI * 0.96, renderer, legend_font)
    legend_rows = math.ceil(len(handles) / ncols) if handles else 0
    footer_height = 0.1 + 0.22 * legend_rows + (0.17 * (caption.count("\n") + 1) if caption else 0.0)
    panel_height = 2.3

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
    if handles:
        footer.legend(handles=handles, loc="upper center", ncols=ncols, fontsize=8, frameon=False,
                      borderaxespad=0.0, handlelength=2.2)

    ticks = layout.x_ticks()
    labels: list[tuple[Any, list[tuple[Any, _Placed]]]] = []  # per axes, its marker labels
    summaries: list[tuple[Any, Any, list[str]]] = []
    for r, side in enumerate(rows):
        for c, device in enumerate(columns):
            ax = axes[r][c]
            panel = layout.panel(side, device)
            ax.set_xlim(0.0, layout.x_max)
            ax.set_ylim(0, layout.y_top(device))
            ax.xaxis.set_major_locator(FixedLocator([x for x, _ in ticks]))
            ax.xaxis.set_major_formatter(FixedFormatter([text for _, text in ticks]))
            ax.tick_params(labelsize=8)
            ax.grid(True, linewidth=0.4, alpha=0.5)
            if c == 0:
                ax.set_ylabel("GiB", fontsize=8)
            if r == len(rows) - 1:
                ax.set_xlabel("replay step: one per trace event, the same on both sides (unload steps widened)",
                              fontsize=8)
            for x in sorted(layout.widened):  # the widened steps, shaded: the axis is not uniform there
                ax.axvspan(layout.edges[x], layout.edges[x + 1], color="#000000", alpha=0.035, linewidth=0, zorder=0)
            note = _empty_note(layout, panel)
            if note:
                ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center",
                        fontsize=9, color="#666666", parse_math=False)
            _draw_panel(ax, panel)
            texts = []
            for p in panel.labelled:
                colour = MARKER_STYLE.get(p.marker.kind, FALLBACK_MARKER_STYLE)[0]
                text = ax.annotate(_shorten(p.text), xy=(p.x, 1.0), xycoords=ax.get_xaxis_transform(),
                                   xytext=(2.5, 2.0), textcoords="offset points", ha="left", va="bottom",
                                   fontsize=LABEL_PT, color=colour, annotation_clip=False, parse_math=False)
                texts.append((text, p))
            labels.append((ax, texts))
            summary = ax.annotate("", xy=(0.5, 1.0), xycoords="axes fraction", xytext=(0, 2.0),
                                  textcoords="offset points", ha="center", va="bottom", fontsize=SUMMARY_PT,
                                  color="#444444", parse_math=False)
            summaries.append((ax, summary, panel.summary))
            ax.set_title(_panel_title(panel), fontsize=TITLE_PT, fontweight="bold", parse_math=False)

    lanes_used = 0
    for _ in range(3):  # lay out, sort the labels into lanes for where the panels now are, again
        band = _place_band(figure, renderer, labels, summaries, lanes_used)
        figure.set_size_inches(width, len(rows) * (panel_height + band) + footer_height + 0.55)
        figure.canvas.draw()
        lanes_now = _assign_label_lanes(renderer, labels)
        if lanes_now <= lanes_used:
            break
        lanes_used = lanes_now
    return figure


def _draw_panel(ax: Any, panel: _Panel) -> None:
    """The series, the release marks, the marker lines and the rug of one panel."""
    for name in DRAW_ORDER:
        style = SERIES_STYLE[name]
        for segment in panel.series.get(name, []):
            ax.plot([x for x, _ in segment], [v / GiB for _, v in segment], color=style.colour,
                    linestyle=style.dash, linewidth=style.width, alpha=style.alpha, zorder=style.z,
                    solid_capstyle="butt")
    for release in panel.releases:  # the triangle's tip on the value after the fall, so one at 0 still shows
        ax.plot([release.x], [release.value / GiB], linestyle="none", marker=RELEASE_GLYPH, markersize=9,
                color=SERIES_STYLE[release.series].colour, markeredgecolor="#222222", markeredgewidth=0.5, zorder=4,
                clip_on=False)
    for p in panel.labelled:
        colour, linestyle, linewidth, _, _ = MARKER_STYLE.get(p.marker.kind, FALLBACK_MARKER_STYLE)
        ax.axvline(p.x, color=colour, linestyle=linestyle, linewidth=linewidth, alpha=0.85, zorder=2.5)
    for kind in RUG_KINDS:
        xs = [p.x for p in panel.rug if p.marker.kind == kind]
        if xs:
            colour, glyph, height, _ = RUG_STYLE[kind]
            ax.plot(xs, [height] * len(xs), transform=ax.get_xaxis_transform(), linestyle="none", marker=glyph,
                    markersize=4.5, color=colour, markeredgewidth=1.0, zorder=5, clip_on=False)


def _place_band(figure: Any, renderer: Any, labels: list, summaries: list, lanes: int) -> float:
    """Put each panel's summary above its label lanes and its title above that; return the band's height
    in inches (the same for every panel, so the rows line up)."""
    lines = 1
    for ax, summary, parts in summaries:
        one_line = " · ".join(parts)
        summary.set_text(one_line)
        if parts and summary.get_window_extent(renderer).width > ax.bbox.width * 0.98:
            summary.set_text("\n".join(parts))
            lines = max(lines, len(parts))
    band_pt = 2.0 + lanes * LANE_PT
    summary_pt = lines * SUMMARY_PT * 1.25 + 3.0
    for ax, summary, _ in summaries:
        summary.xyann = (0, band_pt + 1.0)
        ax.set_title(ax.get_title(), fontsize=TITLE_PT, fontweight="bold", parse_math=False, pad=band_pt + summary_pt)
    return (band_pt + summary_pt + TITLE_PT * 1.4) / 72.0


def _assign_label_lanes(renderer: Any, labels: list) -> int:
    """Sort every panel's marker labels into lanes (see :func:`_assign_lanes`); return the most lanes a panel needs.
    A label that fits in no lane is hidden: its line stays, and the legend names its kind."""
    most = 0
    for ax, texts in labels:
        if not texts:
            continue
        pad = 2.5 * DPI / 72.0
        spans = []
        for text, p in texts:
            text.set_visible(True)
            text.set_ha("left")
            text.xyann = (2.5, 2.0)
            spans.append((ax.transData.transform((p.x, 0.0))[0], text.get_window_extent(renderer).width + pad))
        lanes = _assign_lanes(spans, ax.bbox.x0, ax.bbox.x1, gap=3.0)
        for (text, _), lane in zip(texts, lanes):
            if lane is None:
                text.set_visible(False)
                continue
            row, flipped = lane
            text.set_ha("right" if flipped else "left")
            text.xyann = (-2.5 if flipped else 2.5, 2.0 + row * LANE_PT)
            most = max(most, row + 1)
    return most


def _legend_handle(what: str, kind: str, line2d: Any) -> Any:
    if what == "series":
        style = SERIES_STYLE[kind]
        return line2d([], [], color=style.colour, linestyle=style.dash, linewidth=style.width, alpha=style.alpha,
                      label=SERIES_LABEL[kind])
    if what == "release":
        return line2d([], [], linestyle="none", marker="v", markersize=5, color="#bbbbbb",  # centred, for the key
                      markeredgecolor="#222222", markeredgewidth=0.5, label=RELEASE_LABEL)
    if what == "rug":
        colour, glyph, _, text = RUG_STYLE[kind]
        return line2d([], [], linestyle="none", marker=glyph, markersize=5, color=colour, label=text)
    colour, linestyle, linewidth, _, text = MARKER_STYLE.get(kind, FALLBACK_MARKER_STYLE)
    return line2d([], [], color=colour, linestyle=linestyle, linewidth=linewidth,
                  label=text if kind in MARKER_STYLE else kind)


def _legend_columns(labels: list[str], room: float, renderer: Any, font: Any) -> int:
    """The most legend columns whose row fits in ``room`` pixels (entries fill column by column)."""
    if not labels:
        return 1
    em = font.get_size_in_points() * DPI / 72.0
    widths = [renderer.get_text_width_height_descent(label, font, ismath=False)[0] + 3.2 * em for label in labels]
    for ncols in range(len(labels), 0, -1):
        per_column = math.ceil(len(labels) / ncols)
        columns = [widths[i:i + per_column] for i in range(0, len(widths), per_column)]
        if sum(max(col) for col in columns) + 2.0 * em * (len(columns) - 1) <= room:
            return len(columns)
    return 1


def _save_figure(figure: Any, fh: IO[bytes], fmt: str) -> None:
    """Save without dates or random ids, so redrawing the same replay gives the same bytes."""
    import matplotlib

    metadata = {"png": {}, "svg": {"Date": None}, "pdf": {"CreationDate": None}}[fmt]
    with matplotlib.rc_context({"svg.hashsalt": "membackend-replay"}):
        figure.savefig(fh, format=fmt, metadata=metadata)


# --------------------------------------------------------------------------- self-contained HTML


CELL_WIDTH, CELL_HEIGHT = 560, 230  # one panel with its axes (under its title band), in SVG units
PAD_LEFT, PAD_RIGHT, PAD_BOTTOM = 52, 14, 34
HTML_LANE, HTML_LABEL_PX, HTML_CHAR = 12, 10, 0.6  # a lane's height, the labels' size, a character's width (em)
HTML_SUMMARY, HTML_SUMMARY_PX, HTML_TITLE = 14, 11, 18  # a summary line's height, its size, the title's row


def _html_lanes(layout: _Layout, plot_w: float) -> dict[tuple[str, str], list[tuple[int, bool] | None]]:
    """Each panel's labels sorted into lanes, their widths estimated from their length."""
    out = {}
    for side in layout.rows:
        for device in layout.columns:
            panel = layout.panel(side, device)
            spans = [(p.x / layout.x_max * plot_w, len(p.text) * HTML_LABEL_PX * HTML_CHAR + 6) for p in panel.labelled]
            out[(side, device)] = _assign_lanes(spans, 0.0, plot_w, gap=4.0)
    return out


def _html_page(layout: _Layout, *, title: str, reported: str | None) -> str:
    """The whole page as text. Every string that came from the caller or a trace is escaped."""
    esc = html.escape  # quote=True: also safe inside attribute values
    rows, columns = layout.rows, layout.columns
    plot_w, plot_h = CELL_WIDTH - PAD_LEFT - PAD_RIGHT, CELL_HEIGHT - PAD_BOTTOM
    lanes = _html_lanes(layout, plot_w)
    band = max((lane[0] + 1 for ls in lanes.values() for lane in ls if lane), default=0) * HTML_LANE + 4
    panels = [layout.panel(side, device) for side in rows for device in columns]
    # a summary too long for its panel gets one line a part, in every panel, so the rows line up
    split = any(len(" · ".join(p.summary)) * HTML_SUMMARY_PX * HTML_CHAR > plot_w for p in panels)
    summary_lines = max((len(p.summary) for p in panels), default=1) if split else 1
    summary_h = HTML_SUMMARY * summary_lines
    pad_top = HTML_TITLE + summary_h + band
    row_h = pad_top + CELL_HEIGHT
    width, height = CELL_WIDTH * len(columns), row_h * len(rows)
    x_ticks = layout.x_ticks()

    svg: list[str] = []
    data_panels: list[dict[str, Any]] = []
    for r, side in enumerate(rows):
        for c, device in enumerate(columns):
            panel = layout.panel(side, device)
            left, top = c * CELL_WIDTH + PAD_LEFT, r * row_h + pad_top
            y_ticks = _nice_ticks(0.0, layout.y_top(device))
            y_top = y_ticks[-1]

            def x_of(x: float, left: float = left) -> float:
                return left + x / layout.x_max * plot_w

            def y_of(value: float, top: float = top, y_top: float = y_top) -> float:
                return top + plot_h - value / GiB / y_top * plot_h

            svg.append('<g class="panel">')
            svg.append(f'<text class="ptitle" x="{left}" y="{top - band - summary_h - 5}">'
                       f"{esc(_panel_title(panel))}</text>")
            if panel.summary:
                y0 = top - band - summary_h + HTML_SUMMARY - 4
                lines = panel.summary if split else [" · ".join(panel.summary)]
                spans = "".join(f'<tspan x="{left}" y="{y0 + i * HTML_SUMMARY}">{esc(line)}</tspan>'
                                for i, line in enumerate(lines))
                svg.append(f'<text class="summary">{spans}</text>')
            for x in sorted(layout.widened):
                x0, x1 = x_of(layout.edges[x]), x_of(layout.edges[x + 1])
                svg.append(f'<rect class="widened" x="{x0:.1f}" y="{top}" width="{x1 - x0:.1f}" height="{plot_h}"/>')
            for tick in y_ticks:
                y = y_of(tick * GiB)
                svg.append(f'<line class="grid" x1="{left}" y1="{y:.1f}" x2="{left + plot_w}" y2="{y:.1f}"/>')
                svg.append(f'<text class="tick" x="{left - 5}" y="{y + 3:.1f}" text-anchor="end">{_tick_text(tick)}</text>')
            for x, text in x_ticks:
                px = x_of(x)
                svg.append(f'<line class="grid" x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{top + plot_h}"/>')
                svg.append(f'<text class="tick" x="{px:.1f}" y="{top + plot_h + 13}" text-anchor="middle">{text}</text>')
            if c == 0:
                svg.append(f'<text class="tick" x="{left - 40}" y="{top + plot_h / 2:.1f}"'
                           f' transform="rotate(-90 {left - 40} {top + plot_h / 2:.1f})" text-anchor="middle">GiB</text>')
            if r == len(rows) - 1:
                svg.append(f'<text class="tick" x="{left + plot_w / 2:.1f}" y="{top + plot_h + 28}"'
                           f' text-anchor="middle">replay step: one per trace event, the same on both sides'
                           f" (unload steps widened)</text>")
            svg.append(f'<rect class="frame" x="{left}" y="{top}" width="{plot_w}" height="{plot_h}"/>')
            note = _empty_note(layout, panel)
            if note:
                svg.append(f'<text class="note" x="{left + plot_w / 2:.1f}" y="{top + plot_h / 2:.1f}"'
                           f' text-anchor="middle">{esc(note)}</text>')
            for name in DRAW_ORDER:
                segments = panel.series.get(name)
                if not segments:
                    continue
                style = SERIES_STYLE[name]
                path = " ".join(
                    "M" + " L".join(f"{x_of(x):.1f} {y_of(v):.1f}" for x, v in segment) for segment in segments
                )
                dash_attr = f' stroke-dasharray="{style.svg_dash}"' if style.svg_dash else ""
                svg.append(f'<path class="series s-{name}" d="{path}" stroke="{style.colour}"'
                           f' stroke-width="{style.width + 0.3:.1f}" stroke-opacity="{style.alpha}"{dash_attr}/>')
            for release in panel.releases:
                px, py = x_of(release.x), y_of(release.value)
                svg.append(f'<path class="release s-{release.series}" d="M{px - 4:.1f} {py - 7:.1f} L{px + 4:.1f}'
                           f' {py - 7:.1f} L{px:.1f} {py:.1f} Z" fill="{SERIES_STYLE[release.series].colour}"/>')
            for p, lane in zip(panel.labelled, lanes[(side, device)]):
                colour, _, linewidth, dash, _ = MARKER_STYLE.get(p.marker.kind, FALLBACK_MARKER_STYLE)
                px = x_of(p.x)
                dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
                svg.append(
                    f'<line class="marker" x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{top + plot_h}"'
                    f' stroke="{colour}" stroke-width="{linewidth}"{dash_attr}>'
                    f"<title>{esc(p.marker.kind)}: {esc(p.marker.label)}</title></line>"
                )
                if lane is None:
                    continue  # no room: the line's tooltip names it
                row, flipped = lane
                tx, anchor = (px - 3, "end") if flipped else (px + 3, "start")
                ty = top - 4 - row * HTML_LANE
                if p.marker.kind == "workflow":
                    rest = p.text[len(p.marker.label):]
                    svg.append(f'<text class="marker wlabel" x="{tx:.1f}" y="{ty}" fill="{colour}" text-anchor="{anchor}">'
                               f'{esc(p.marker.label)}<tspan class="runtime">{esc(rest)}</tspan></text>')
                else:
                    svg.append(f'<text class="marker ulabel" x="{tx:.1f}" y="{ty}" fill="{colour}"'
                               f' text-anchor="{anchor}">{esc(p.text)}</text>')
            for kind in RUG_KINDS:
                colour, _, rug_at, _ = RUG_STYLE[kind]
                py = top + plot_h * (1 - rug_at)
                for p in panel.rug:
                    if p.marker.kind == kind:
                        px = x_of(p.x)
                        glyph = (f"M{px - 3:.1f} {py - 3:.1f} L{px + 3:.1f} {py + 3:.1f} M{px - 3:.1f} {py + 3:.1f}"
                                 f" L{px + 3:.1f} {py - 3:.1f}") if kind == "bugcheck" else (
                                 f"M{px:.1f} {py - 4:.1f} L{px:.1f} {py + 4:.1f}")
                        svg.append(f'<path class="marker rug r-{kind}" d="{glyph}" stroke="{colour}"/>')
            svg.append(f'<line class="cursor" x1="0" y1="{top}" x2="0" y2="{top + plot_h}" visibility="hidden"/>')
            svg.append(f'<rect class="hover" data-panel="{len(data_panels)}" x="{left}" y="{top}"'
                       f' width="{plot_w}" height="{plot_h}"/>')
            svg.append("</g>")
            data_panels.append({
                "side": panel.side,
                "device": panel.device,
                "left": left,
                "width": plot_w,
                # [t, reserved, resident, committed, x, step]: x is the step's place on the axis
                "samples": [[s.t, s.reserved, s.resident, s.committed, layout.edges[k], k]
                            for k, s in zip(panel.steps, panel.samples)],
                "markers": [[p.marker.t, p.marker.kind, p.marker.label, p.step] for p in panel.markers],
            })

    data = {"x1": layout.x_max, "gib": GiB, "panels": data_panels}
    toggles = "".join(
        f'<label><input type="checkbox" data-hide="{name}" checked>'
        f'<span class="swatch" style="border-color:{SERIES_STYLE[name].colour}"></span>{SERIES_LABEL[name]}</label>'
        for name in SERIES
    )
    toggles += ('<label><input type="checkbox" data-hide="markers" checked>markers</label>'
                + "".join(f'<span class="key"><span class="swatch" style="border-color:{style[0]};'
                          f'border-top-style:{"dotted" if kind == "unload" else "dashed" if kind == "unload_all" else "solid"}">'
                          f"</span>{style[4]}</span>" for kind, style in MARKER_STYLE.items())
                + "".join(f'<span class="key" style="color:{style[0]}">{"×" if kind == "bugcheck" else "|"} {style[3]}</span>'
                          for kind, style in RUG_STYLE.items())
                + f'<span class="key">▼ {RELEASE_LABEL}</span>')
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
                   "reserved  " + gib(s[1]), "resident  " + gib(s[2]), "committed " + gib(s[3]));
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
