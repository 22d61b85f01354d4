"""The replay's pictures: one picture comparing the stock side's timeline with the plugin side's.

:func:`write_plot` takes the :class:`~membackend.lab._replay.timeline.Timeline` of each side that
ran (keys ``"stock"`` and/or ``"plugin"``) and writes one file whose suffix picks the format:

* ``.png``, ``.svg``, ``.pdf``: a static figure drawn with matplotlib (the optional extra
  ``membackend[plot]``), :mod:`~membackend.lab._pictures.figure`. matplotlib is imported only there,
  and only when drawing.
* ``.html``: one self-contained page (inline SVG, CSS and JavaScript for hover tooltips and
  toggling series), :mod:`~membackend.lab._pictures.page`. It loads nothing from anywhere and needs
  no extra package.

Both draw the same :class:`~membackend.lab._pictures.layout.Layout`
(:mod:`~membackend.lab._pictures.layout`, with the look both share in
:mod:`~membackend.lab._pictures.style`). The picture has one column per device and one row per side
(stock above plugin). Within a device both sides share the y scale. Each panel draws reserved
(address space), resident and committed bytes in GB as steps: committed wide and pale, resident
on it, reserved dashed on top, so every line shows where values are equal; a triangle marks each
release (reserved or committed falling). Vertical lines mark a model's full unload,
unload-everything, each workflow switch and each fault that ran out of memory, each labelled above
the panel; a row of crosses along the top marks every simulated bugcheck and every free that raced
pending work. Under each panel's title, a summary: what the side still held at the end, and its
failure counts.

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

import contextlib
import os
import pathlib
import tempfile
from collections.abc import Callable
from typing import IO, Any

from ...types import _PlotFormatError as PlotFormatError
from ...types import _PlotUnavailable as PlotUnavailable
from .._replay.timeline import Timeline
from .figure import draw_figure, save_figure
from .layout import lay_out
from .page import html_page

__all__ = [
    "ACCEPTED_SUFFIXES",
    "MATPLOTLIB_SUFFIXES",
    "HTML_SUFFIX",
    "PlotUnavailable",
    "PlotFormatError",
    "write_plot",
    "check_plot_target",
]

MATPLOTLIB_SUFFIXES = (".png", ".svg", ".pdf")
HTML_SUFFIX = ".html"
ACCEPTED_SUFFIXES = (*MATPLOTLIB_SUFFIXES, HTML_SUFFIX)
INSTALL_HINT = 'pip install "membackend[plot]"'


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
    layout = lay_out(timelines)
    if suffix == HTML_SUFFIX:
        page = html_page(layout, title=title, reported=reported).encode("utf-8")
        _write_atomically(target, lambda fh: fh.write(page))
    else:
        figure = draw_figure(layout, title=title, reported=reported)
        _write_atomically(target, lambda fh: save_figure(figure, fh, suffix[1:]))
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
        _require_matplotlib(suffix)
    folder = target.parent
    if not folder.is_dir():
        raise FileNotFoundError(2, "no such folder for the plot", str(folder))
    if target.is_dir():
        raise IsADirectoryError(21, "the plot path is a folder", str(target))
    return target


def _require_matplotlib(suffix: str) -> None:
    """:class:`PlotUnavailable`, saying how to install it, when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401  (the import that fails when the extra is missing)
        import matplotlib.backends.backend_agg  # noqa: F401
    except ImportError as exc:
        raise PlotUnavailable(
            f"writing a {suffix} plot needs matplotlib, which is not installed; install it with"
            f" {INSTALL_HINT} (or ask for an {HTML_SUFFIX} plot, which needs nothing extra)"
        ) from exc


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
