"""The replay's static picture (PNG, SVG, PDF), drawn with matplotlib, the optional extra
``membackend[plot]``.

matplotlib is imported inside the functions here, never when membackend is imported, and only its
non-interactive Agg canvas is used (never pyplot), so nothing ever opens a window. The figure has
one column per device and one row per side; a footer row holds the legend and the caption. Marker
labels are placed in passes: the layout engine places the panels, the labels are sorted into lanes
that do not overlap (:func:`~membackend.lab._pictures.layout.assign_lanes`), and the figure is laid out
again with room for them. :func:`save_figure` writes no date and no random id, so the same replay
gives the same bytes.
"""

from __future__ import annotations

import math
import textwrap
from typing import IO, Any

from .layout import Layout, Panel, Placed, assign_lanes, empty_note, panel_title, shorten
from .style import (
    DRAW_ORDER,
    FALLBACK_MARKER_STYLE,
    GB,
    MARKER_STYLE,
    RELEASE_GLYPH,
    RELEASE_LABEL,
    RUG_KINDS,
    RUG_STYLE,
    SERIES,
    SERIES_LABEL,
    SERIES_STYLE,
    STEP_AXIS_LABEL,
    marker_order,
)

__all__ = ["draw_figure", "save_figure", "DPI"]

LANE_PT = 9.5  # one row of marker labels, in points
LABEL_PT = 7.0
SUMMARY_PT = 7.5
TITLE_PT = 9.0
DPI = 100
PANEL_HEIGHT = 2.3  # inches, one row of panels without its title band

Labels = list[tuple[Any, list[tuple[Any, Placed]]]]  # per axes, its marker labels (the text and its marker)
Summaries = list[tuple[Any, Any, list[str]]]  # per axes, its summary's text and the summary's parts


def draw_figure(layout: Layout, *, title: str, reported: str | None) -> Any:
    """Draw the static figure of ``layout`` (a matplotlib ``Figure`` on an Agg canvas) with ``title``
    on top and ``reported``, when given, as a caption under the panels."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.font_manager import FontProperties
    from matplotlib.lines import Line2D

    rows, columns = layout.rows, layout.columns
    width = min(max(9.0, 5.2 * len(columns)), 18.0)
    # a long caption wraps to the figure's width (about 14 characters an inch at 9 pt), else the
    # layout engine squeezes the panels to make room for one long line
    caption = textwrap.fill(reported, width=int(width * 14)) if reported else ""
    figure = Figure(figsize=(width, 4.0), dpi=DPI, layout="constrained")
    renderer = FigureCanvasAgg(figure).get_renderer()  # draw with Agg, never through pyplot's machinery

    handles = [_legend_handle(what, kind, Line2D) for what, kind in _legend_entries(layout)]
    ncols = _legend_columns([h.get_label() for h in handles], width * DPI * 0.96, renderer, FontProperties(size=8))
    legend_rows = math.ceil(len(handles) / ncols) if handles else 0
    footer_height = 0.1 + 0.22 * legend_rows + (0.17 * (caption.count("\n") + 1) if caption else 0.0)

    figure.suptitle(title, fontsize=11, parse_math=False)  # titles and names are text, never TeX
    axes = _grid(figure, len(rows), len(columns), footer_height)
    _footer(figure, axes[-1][0], caption, handles, ncols)
    ticks = layout.x_ticks()
    labels: Labels = []
    summaries: Summaries = []
    for r, side in enumerate(rows):
        for c, device in enumerate(columns):
            ax, panel = axes[r][c], layout.panel(side, device)
            _set_up_axes(ax, layout, panel, ticks, first_column=c == 0, last_row=r == len(rows) - 1)
            _draw_panel(ax, panel)
            labels.append((ax, _annotate_markers(ax, panel)))
            summaries.append((ax, _summary_annotation(ax), panel.summary))
            ax.set_title(panel_title(panel), fontsize=TITLE_PT, fontweight="bold", parse_math=False)
    _fit_labels(figure, renderer, labels, summaries, width, len(rows), footer_height)
    return figure


def _grid(figure: Any, rows: int, columns: int, footer_height: float) -> list[list[Any]]:
    """The panels' axes, row by row, sharing the x axis; last, a row holding the footer's axes alone.

    The legend and caption sit in that footer row of the grid, so the layout engine keeps them clear
    of the panels' tick labels (figure-level text would be drawn over them)."""
    grid = figure.add_gridspec(rows + 1, columns, height_ratios=[PANEL_HEIGHT] * rows + [footer_height])
    axes: list[list[Any]] = []
    first = None
    for r in range(rows):
        axes.append([])
        for c in range(columns):
            ax = figure.add_subplot(grid[r, c], sharex=first)
            first = ax if first is None else first
            axes[r].append(ax)
    axes.append([figure.add_subplot(grid[rows, :])])
    return axes


def _footer(figure: Any, footer: Any, caption: str, handles: list[Any], ncols: int) -> None:
    """The caption and the legend, under the panels."""
    footer.axis("off")
    if caption:
        footer.text(0.5, 0.0, caption, transform=footer.transAxes, ha="center", va="bottom",
                    fontsize=9, parse_math=False)
    if handles:
        footer.legend(handles=handles, loc="upper center", ncols=ncols, fontsize=8, frameon=False,
                      borderaxespad=0.0, handlelength=2.2)


def _set_up_axes(ax: Any, layout: Layout, panel: Panel, ticks: list[tuple[float, str]], *, first_column: bool,
                 last_row: bool) -> None:
    """A panel's scales, ticks, grid and axis labels, the widened steps shaded, the note of an empty one."""
    from matplotlib.ticker import FixedFormatter, FixedLocator

    ax.set_xlim(0.0, layout.x_max)
    ax.set_ylim(0, layout.y_top(panel.device))
    ax.xaxis.set_major_locator(FixedLocator([x for x, _ in ticks]))
    ax.xaxis.set_major_formatter(FixedFormatter([text for _, text in ticks]))
    ax.tick_params(labelsize=8)
    ax.grid(True, linewidth=0.4, alpha=0.5)
    if first_column:
        ax.set_ylabel("GB", fontsize=8)
    if last_row:
        ax.set_xlabel(STEP_AXIS_LABEL, fontsize=8)
    for x in sorted(layout.widened):  # the widened steps, shaded: the axis is not uniform there
        ax.axvspan(layout.edges[x], layout.edges[x + 1], color="#000000", alpha=0.035, linewidth=0, zorder=0)
    note = empty_note(layout, panel)
    if note:
        ax.text(0.5, 0.5, note, transform=ax.transAxes, ha="center", va="center",
                fontsize=9, color="#666666", parse_math=False)


def _draw_panel(ax: Any, panel: Panel) -> None:
    """The series, the release marks, the marker lines and the rug of one panel."""
    for name in DRAW_ORDER:
        style = SERIES_STYLE[name]
        for segment in panel.series.get(name, []):
            ax.plot([x for x, _ in segment], [v / GB for _, v in segment], color=style.colour,
                    linestyle=style.dash, linewidth=style.width, alpha=style.alpha, zorder=style.z,
                    solid_capstyle="butt")
    for release in panel.releases:  # the triangle's tip on the value after the fall, so one at 0 still shows
        ax.plot([release.x], [release.value / GB], linestyle="none", marker=RELEASE_GLYPH, markersize=9,
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


def _annotate_markers(ax: Any, panel: Panel) -> list[tuple[Any, Placed]]:
    """Each labelled marker's text above the panel, at first in lane 0 (:func:`_assign_label_lanes` moves it)."""
    texts = []
    for p in panel.labelled:
        colour = MARKER_STYLE.get(p.marker.kind, FALLBACK_MARKER_STYLE)[0]
        text = ax.annotate(shorten(p.label_text), xy=(p.x, 1.0), xycoords=ax.get_xaxis_transform(),
                           xytext=(2.5, 2.0), textcoords="offset points", ha="left", va="bottom",
                           fontsize=LABEL_PT, color=colour, annotation_clip=False, parse_math=False)
        texts.append((text, p))
    return texts


def _summary_annotation(ax: Any) -> Any:
    """The (still empty) summary line above a panel; :func:`_place_band` writes and places it."""
    return ax.annotate("", xy=(0.5, 1.0), xycoords="axes fraction", xytext=(0, 2.0),
                       textcoords="offset points", ha="center", va="bottom", fontsize=SUMMARY_PT,
                       color="#444444", parse_math=False)


def _fit_labels(figure: Any, renderer: Any, labels: Labels, summaries: Summaries, width: float, rows: int,
                footer_height: float) -> None:
    """Lay out, sort the labels into lanes for where the panels now are, and again, until the lanes
    they need stop growing (three passes at most)."""
    lanes_used = 0
    for _ in range(3):
        band = _place_band(figure, renderer, labels, summaries, lanes_used)
        figure.set_size_inches(width, rows * (PANEL_HEIGHT + band) + footer_height + 0.55)
        figure.canvas.draw()
        lanes_now = _assign_label_lanes(renderer, labels)
        if lanes_now <= lanes_used:
            break
        lanes_used = lanes_now


def _place_band(figure: Any, renderer: Any, labels: Labels, summaries: Summaries, lanes: int) -> float:
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


def _assign_label_lanes(renderer: Any, labels: Labels) -> int:
    """Sort every panel's marker labels into lanes (see :func:`assign_lanes`); return the most lanes a panel needs.
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
        lanes = assign_lanes(spans, ax.bbox.x0, ax.bbox.x1, gap=3.0)
        for (text, _), lane in zip(texts, lanes):
            if lane is None:
                text.set_visible(False)
                continue
            row, flipped = lane
            text.set_ha("right" if flipped else "left")
            text.xyann = (-2.5 if flipped else 2.5, 2.0 + row * LANE_PT)
            most = max(most, row + 1)
    return most


# --------------------------------------------------------------------------- the legend


def _legend_entries(layout: Layout) -> list[tuple[str, str]]:
    """(what, kind) of every legend entry the picture needs: series, release marks, lines, glyphs."""
    panels = layout.all_panels()
    out = [("series", n) for n in SERIES if any(n in p.series for p in panels)]
    if any(p.releases for p in panels):
        out.append(("release", ""))
    out += [("line", k) for k in sorted({p.marker.kind for panel in panels for p in panel.labelled}, key=marker_order)]
    out += [("rug", k) for k in RUG_KINDS if _has_rug(panels, k)]
    return out


def _has_rug(panels: list[Panel], kind: str) -> bool:
    return any(p.marker.kind == kind for panel in panels for p in panel.rug)


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


def save_figure(figure: Any, fh: IO[bytes], fmt: str) -> None:
    """Save as ``fmt`` (``png``, ``svg``, ``pdf``) without dates or random ids, so redrawing the same
    replay gives the same bytes."""
    import matplotlib

    metadata: dict[str, Any] = {"png": {}, "svg": {"Date": None}, "pdf": {"CreationDate": None}}[fmt]
    with matplotlib.rc_context({"svg.hashsalt": "membackend-replay"}):
        figure.savefig(fh, format=fmt, metadata=metadata)
