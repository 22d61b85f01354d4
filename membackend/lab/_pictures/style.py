"""How the replay's pictures look, shared by the matplotlib figure and the HTML page: each series'
colour and line, each marker's line and legend text, the rug's glyphs, the failure counts' wording."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "SERIES",
    "SERIES_LABEL",
    "SERIES_STYLE",
    "DRAW_ORDER",
    "LineStyle",
    "MARKER_KINDS",
    "MARKER_STYLE",
    "FALLBACK_MARKER_STYLE",
    "UNLOAD_KINDS",
    "RUG_KINDS",
    "RUG_STYLE",
    "TALLY_TEXT",
    "RELEASE_LABEL",
    "RELEASE_GLYPH",
    "STEP_AXIS_LABEL",
    "GB",
    "marker_order",
]

GB = 10**9  # the lab writes sizes in GB, the unit of the reports it reproduces

SERIES = ("reserved", "resident", "committed")
SERIES_LABEL = {
    "reserved": "reserved (address space)",
    "resident": "resident",
    "committed": "committed",
}


@dataclass(frozen=True)
class LineStyle:
    colour: str
    dash: str  # matplotlib line style
    width: float
    alpha: float
    z: float
    svg_dash: str  # SVG stroke-dasharray, "" for solid


#: committed is wide and pale and drawn first, resident thin on it, reserved dashed on top: where
#: values are equal every line still shows (around the resident line, through the dashes' gaps)
SERIES_STYLE = {
    "reserved": LineStyle("#1f77b4", "--", 1.3, 1.0, 3.5, "6 3"),
    "committed": LineStyle("#d62728", "-", 4.0, 0.35, 1.0, ""),
    "resident": LineStyle("#2ca02c", "-", 1.4, 1.0, 3.0, ""),
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
STEP_AXIS_LABEL = "replay step: one per trace event, the same on both sides (unload steps widened)"


def marker_order(kind: str) -> tuple[int, str]:
    """A marker kind's place in the legend: the known kinds in :data:`MARKER_KINDS`' order, then the rest."""
    return (MARKER_KINDS.index(kind) if kind in MARKER_KINDS else len(MARKER_KINDS), kind)
