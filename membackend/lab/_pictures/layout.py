"""What both renderers draw: the sides and devices in order, every sample and marker placed on the
step axis, the series as step vertices, the release marks, each panel's summary, the scales.

:func:`lay_out` turns the :class:`~membackend.lab._replay.timeline.Timeline` of each side into a
:class:`Layout`: one :class:`Panel` per side (a row) and device (a column). The x axis counts
replay steps; every step is equally wide except the steps of an unload (the unload's own and the
instantaneous ones after it), which share about a third of the width (:func:`step_edges`).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .._replay.timeline import TALLY_MARKERS, Marker, Sample, Timeline
from .style import GB, RUG_KINDS, SERIES, TALLY_TEXT, UNLOAD_KINDS

__all__ = [
    "Segment",
    "Placed",
    "Release",
    "Panel",
    "Layout",
    "lay_out",
    "step_edges",
    "step_segments",
    "marker_text",
    "seconds_text",
    "panel_title",
    "empty_note",
    "assign_lanes",
    "nice_ticks",
    "tick_text",
    "shorten",
    "MAX_LANES",
]

SIDE_ORDER = ("stock", "plugin")  # stock's row above plugin's; any other key follows
WORKFLOW_LABEL_CHARS = 40  # longer model and workflow names are cut in the static picture (the page keeps them)

WIDENED_SHARE = 0.33  # of the x axis: what the unload steps share, when there are several
WIDENED_STEP_SHARE = 0.08  # of the x axis: the most one unload step gets
RELEASE_MIN_SHARE = 0.02  # a fall smaller than this share of the device's scale gets no release mark
TICK_MIN_SHARE = 0.07  # of the x axis: the least room between two step tick labels
MAX_LANES = 4  # rows of marker labels above a panel; a label that fits in none is left out
HEADROOM = 1.08  # the y scale over the largest value
RUG_HEADROOM = 1.3  # ... where a row of crosses runs along the top


Segment = list[tuple[float, int]]  # step vertices (x, bytes), ready to be joined by straight lines
Lane = tuple[int, bool] | None  # (lane, flipped) of a label, or None where no lane has room


@dataclass
class Placed:
    """A marker with its place on the step axis."""

    marker: Marker
    step: int  # the first of the panel's samples that comes after it
    x: float
    text: str | None  # the label written above the panel; None for a rug glyph

    @property
    def label_text(self) -> str:
        """The label written above the panel ("" for a rug glyph, which has none)."""
        return self.text or ""


@dataclass
class Release:
    series: str  # "reserved" or "committed"
    x: float  # where the fall is drawn
    value: int  # bytes, after the fall


@dataclass
class Panel:
    """What one side recorded on one device."""

    side: str
    device: str
    samples: list[Sample]
    steps: list[int] = field(default_factory=list)  # each sample's replay step, ascending
    markers: list[Placed] = field(default_factory=list)
    series: dict[str, list[Segment]] = field(default_factory=dict)  # a name absent: nothing to draw
    releases: list[Release] = field(default_factory=list)
    summary: list[str] = field(default_factory=list)  # under the title: the end state, the failure counts

    @property
    def labelled(self) -> list[Placed]:
        return [p for p in self.markers if p.text is not None]

    @property
    def rug(self) -> list[Placed]:
        return [p for p in self.markers if p.text is None]


@dataclass
class Layout:
    sides: list[str]  # the rows
    devices: list[str]  # the columns
    edges: list[float]  # step k spans edges[k] .. edges[k + 1]; shared by every panel
    widened: set[int]  # the unload steps, wider than the rest
    y_max: dict[str, int]  # per device, the largest value either side drew, in bytes
    panels: dict[tuple[str, str], Panel]
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

    def panel(self, side: str, device: str) -> Panel:
        return self.panels.get((side, device)) or Panel(side, device, [])

    def all_panels(self) -> list[Panel]:
        """Every panel drawn, row by row (an empty one where a side has nothing on a device)."""
        return [self.panel(side, device) for side in self.rows for device in self.columns]

    def y_top(self, device: str) -> float:
        """The y scale's top for ``device``, in GB."""
        return max(self.y_max.get(device, 0), GB) / GB * (RUG_HEADROOM if self.has_rug else HEADROOM)

    def x_ticks(self) -> list[tuple[float, str]]:
        """Round step numbers at their place on the axis, those too close to the previous one left out."""
        out: list[tuple[float, str]] = []
        for step in nice_ticks(0.0, float(max(self.steps, 1))):
            k = int(round(step))
            if k > self.steps:
                break
            x = self.edges[k]
            if not out or x - out[-1][0] >= TICK_MIN_SHARE * self.x_max:
                out.append((x, f"{k}"))
        return out


# --------------------------------------------------------------------------- laying out


Placements = dict[tuple[str, str], list[tuple[Marker, int]]]  # per panel, each marker and its step


def lay_out(timelines: dict[str, Timeline]) -> Layout:
    """Order the sides and devices, place samples and markers on the step axis, and fix the scales."""
    sides = _sides(timelines)
    devices = _devices(timelines, sides)
    panels: dict[tuple[str, str], Panel] = {}
    placed: Placements = {}
    side_end: dict[str, int] = {}  # per side, one past its last step
    for side in sides:
        for device in devices:
            panels[(side, device)], placed[(side, device)] = _place(timelines[side], side, device)
        side_end[side] = _end_of_side(side, panels, placed)

    widened = _unload_steps(panels, placed)
    edges = step_edges(max(side_end.values(), default=0), widened)
    layout = Layout(sides, devices, edges, widened, dict.fromkeys(devices, 0), panels)
    layout.has_rug = any(m.kind in RUG_KINDS for ms in placed.values() for m, _ in ms)
    shown_tallies = _shown_tallies(timelines, sides)
    for (side, device), panel in panels.items():
        _fill(layout, panel, timelines[side], placed[(side, device)], edges[side_end[side]], shown_tallies)
    for (side, device), panel in panels.items():
        panel.releases = _releases(panel, edges, layout.y_max[device])
    return layout


def _sides(timelines: dict[str, Timeline]) -> list[str]:
    """The rows: stock above plugin, then any other side in the order given."""
    return [s for s in SIDE_ORDER if s in timelines] + [s for s in timelines if s not in SIDE_ORDER]


def _shown_tallies(timelines: dict[str, Timeline], sides: list[str]) -> list[str]:
    """The failure counts the summaries show: those that any side had."""
    return [n for n in TALLY_MARKERS if any(timelines[s].tallies.get(n) for s in sides)]


def _devices(timelines: dict[str, Timeline], sides: list[str]) -> list[str]:
    """Every device a side sampled, in the order first seen; then those only a marker names."""
    devices: dict[str, None] = {}
    for side in sides:
        devices.update(dict.fromkeys(timelines[side].devices()))
    for side in sides:  # a marker aimed at a device nobody sampled still gets its column
        devices.update(dict.fromkeys(m.device for m in timelines[side].markers if m.device is not None))
    return list(devices)


def _place(timeline: Timeline, side: str, device: str) -> tuple[Panel, list[tuple[Marker, int]]]:
    """The panel of ``side`` on ``device`` with its samples' steps, and each marker that applies to it
    with its step."""
    samples = [s for s in timeline.samples if s.device == device]
    steps = [s.step if s.step is not None else k for k, s in enumerate(samples)]
    times = [s.t for s in samples]
    here = [(m, _marker_step(m, times, steps)) for m in timeline.markers if m.device is None or m.device == device]
    return Panel(side, device, samples, steps), here


def _marker_step(marker: Marker, times: list[float], steps: list[int]) -> int:
    """The marker's own step, else (placed by time) the step of the first sample at or after it."""
    if marker.step is not None:
        return marker.step
    k = bisect.bisect_left(times, marker.t)
    return steps[k] if k < len(steps) else (steps[-1] + 1 if steps else 0)


def _end_of_side(side: str, panels: dict[tuple[str, str], Panel], placed: Placements) -> int:
    """One past the last step of any sample or marker of ``side``."""
    sampled = [st for (sd, _), p in panels.items() if sd == side for st in p.steps]
    marked = [st for (sd, _), ms in placed.items() if sd == side for _, st in ms]
    return 1 + max(sampled + marked, default=-1)


def _fill(layout: Layout, panel: Panel, timeline: Timeline, placed: list[tuple[Marker, int]], end: float,
          tallies: Sequence[str]) -> None:
    """Give ``panel`` its series (every value holds until ``end``, the side's last step), its markers'
    places and texts and its summary; raise the device's scale to what it draws."""
    edges = layout.edges
    for name in SERIES:
        points = ((edges[k], getattr(s, name)) for k, s in zip(panel.steps, panel.samples))
        segments = step_segments(points, end)
        if segments:
            panel.series[name] = segments
            layout.y_max[panel.device] = max(layout.y_max[panel.device], *(v for seg in segments for _, v in seg))
    seconds = _run_seconds(timeline)
    for m, step in placed:
        text = None if m.kind in RUG_KINDS else marker_text(m, seconds.get(id(m)))
        panel.markers.append(Placed(m, step, edges[min(step, layout.steps)], text))
    panel.summary = _summary(panel, timeline, tallies)


def _unload_steps(panels: dict[tuple[str, str], Panel], placed: Placements) -> set[int]:
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


def step_edges(steps: int, widened: set[int]) -> list[float]:
    """Where each step begins (and, last, where the last one ends): width 1 a step, more for the widened."""
    widened = {k for k in widened if 0 <= k < steps}
    plain = steps - len(widened)
    share = min(WIDENED_SHARE / len(widened), WIDENED_STEP_SHARE) if widened and plain else 0.0
    wide = share * plain / (1.0 - share * len(widened)) if share else 1.0
    edges = [0.0]
    for k in range(steps):
        edges.append(edges[-1] + (wide if k in widened else 1.0))
    return edges


def step_segments(points: Iterable[tuple[float, int | None]], end: float) -> list[Segment]:
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


def marker_text(marker: Marker, seconds: float | None) -> str:
    """The label written above a marker's line."""
    if marker.kind == "workflow":
        return marker.label + (f" · {seconds_text(seconds)}" if seconds else "")
    if marker.kind == "unload":
        return f"unload {marker.label}"
    if marker.kind == "unload_all":
        return "unload all"
    if marker.kind == "oom":
        return "out of memory" + (f" ×{marker.label}" if marker.label not in ("", "1") else "")
    return f"{marker.kind} {marker.label}".strip()


def seconds_text(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 100 else f"{seconds:.3g} s"


def _gb_text(value: int) -> str:
    return "0" if value == 0 else f"{value / GB:.3g}"


def _summary(panel: Panel, timeline: Timeline, tallies: Sequence[str]) -> list[str]:
    """What the side held at its end on this device, then its failure counts (those that any side had)."""
    out = []
    if panel.samples:
        last = panel.samples[-1]
        held = [f"reserved {_gb_text(last.reserved)}", f"resident {_gb_text(last.resident)}"]
        if last.committed is not None:
            held.append(f"committed {_gb_text(last.committed)}")
        out.append("at the end: " + ", ".join(held) + " GB")
    counts = []
    for name in tallies:
        if name in timeline.tallies:
            n = timeline.tallies[name]
            counts.append(f"{n:,} {TALLY_TEXT[name][0 if n == 1 else 1]}")
    if counts:
        out.append("in this run: " + ", ".join(counts))
    return out


def _releases(panel: Panel, edges: list[float], y_max: int) -> list[Release]:
    """Every step where reserved or committed fell by a visible amount."""
    out = []
    least = max(RELEASE_MIN_SHARE * y_max, 1)
    for k in range(1, len(panel.samples)):
        before, now = panel.samples[k - 1], panel.samples[k]
        for name in ("reserved", "committed"):
            old, new = getattr(before, name), getattr(now, name)
            if old is not None and new is not None and old - new >= least:
                out.append(Release(name, edges[panel.steps[k]], new))
    return out


# --------------------------------------------------------------------------- helpers both renderers use


def panel_title(panel: Panel) -> str:
    return " · ".join(part for part in (panel.side, panel.device) if part)


def empty_note(layout: Layout, panel: Panel) -> str | None:
    """The note an empty panel carries, or ``None`` when the panel has data."""
    if not layout.sides:
        return "no timeline recorded"
    if not panel.samples:
        return "no samples" + (f" on {panel.device}" if panel.device else "")
    return None


def assign_lanes(spans: Sequence[tuple[float, float]], left: float, right: float, gap: float,
                 lanes: int = MAX_LANES) -> list[Lane]:
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
    out: list[Lane] = [None] * len(spans)
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


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
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


def tick_text(value: float) -> str:
    return f"{value:.6g}"


def shorten(label: str, chars: int = WORKFLOW_LABEL_CHARS) -> str:
    return label if len(label) <= chars else label[: chars - 1] + "…"
