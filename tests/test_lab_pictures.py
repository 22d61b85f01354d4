"""``membackend.lab._pictures.write_plot`` and the modules it draws with (``layout``, ``figure``, ``page``): every
format, the escaping, the typed errors, the atomic write, what the pictures must show."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

import membackend.lab._pictures as pictures
from membackend.lab import PlotFormatError, PlotUnavailable
from membackend.lab._pictures import ACCEPTED_SUFFIXES, style, write_plot
from membackend.lab._pictures.figure import draw_figure
from membackend.lab._pictures.layout import MAX_LANES, assign_lanes, lay_out, step_segments
from membackend.lab._replay.timeline import Marker, Sample, Timeline
from membackend.types import MembackendError

GiB = 1 << 30
EVIL = "<script>alert(1)</script>"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _side(side: str, scale: float) -> Timeline:
    """Two devices: cuda:0 with a commit charge, cpu without (committed None)."""
    samples = []
    for i, t in enumerate((0.0, 0.5, 0.5, 1.0, 2.0, 3.0)):  # two samples at t=0.5: drawn as a step, in order
        resident = int(i * 2 * GiB * scale)
        samples.append(Sample(t, "cuda:0", 24 * GiB, resident, resident + GiB))
        samples.append(Sample(t, "cpu", 64 * GiB, resident // 2, None))
    markers = [
        Marker(0.0, "workflow", "sdxl-base"),
        Marker(1.0, "unload", EVIL, "cuda:0"),
        Marker(1.5, "workflow", "flux a$\\frac{$b"),  # would break matplotlib's mathtext if parsed
        Marker(2.5, "unload_all", "", None),
    ]
    return Timeline(side, samples, markers)


def _both() -> dict[str, Timeline]:
    return {"stock": _side("stock", 1.0), "plugin": _side("plugin", 0.4)}


def _html(tmp_path, timelines, **kw) -> str:
    kw.setdefault("title", "t")
    return write_plot(tmp_path / "out.html", timelines, **kw).read_text(encoding="utf-8")


def _svg_of(page: str) -> ET.Element:
    """The page's inline SVG as XML (so a label that broke the markup fails to parse)."""
    return ET.fromstring(re.search(r"<svg.*?</svg>", page, re.S).group(0))


def _panels(page: str) -> list[ET.Element]:
    return [g for g in _svg_of(page).iter("g") if g.get("class") == "panel"]


def _png_shape(path) -> tuple[int, int]:
    image = pytest.importorskip("matplotlib.image").imread(path)
    return image.shape[0], image.shape[1]


# --------------------------------------------------------------------------- matplotlib formats


def test_png_is_a_small_decodable_image(tmp_path):
    pytest.importorskip("matplotlib")
    out = write_plot(tmp_path / "timeline.png", _both(), title="sdxl then flux",
                     reported="reported: 41.58 GB private after unload (stock), 7.33 GB released")
    assert out == tmp_path / "timeline.png"
    data = out.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) < 150_000, "the picture is committed to the repository"
    height, width = _png_shape(out)
    assert 300 <= height <= 1300 and 600 <= width <= 1900
    assert width > height  # two devices side by side


def test_svg_parses_as_xml_and_pdf_has_its_header(tmp_path):
    pytest.importorskip("matplotlib")
    root = ET.parse(write_plot(tmp_path / "t.svg", _both(), title=EVIL)).getroot()
    assert root.tag.endswith("svg")
    assert write_plot(tmp_path / "t.pdf", _both(), title="t").read_bytes().startswith(b"%PDF-")


def test_svg_is_reproducible(tmp_path):
    pytest.importorskip("matplotlib")
    first = write_plot(tmp_path / "a.svg", _both(), title="t").read_bytes()
    second = write_plot(tmp_path / "b.svg", _both(), title="t").read_bytes()
    assert first == second


def test_suffix_case_is_ignored_and_str_paths_work(tmp_path):
    pytest.importorskip("matplotlib")
    out = write_plot(str(tmp_path / "T.PNG"), _both(), title="t")
    assert out == tmp_path / "T.PNG" and out.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize("present", ["stock", "plugin"])
def test_png_with_one_side_has_one_row(tmp_path, present):
    pytest.importorskip("matplotlib")
    both = write_plot(tmp_path / "both.png", _both(), title="t")
    one = write_plot(tmp_path / "one.png", {present: _both()[present]}, title="t")
    assert one.read_bytes().startswith(PNG_SIGNATURE)
    assert _png_shape(one)[0] < _png_shape(both)[0]


@pytest.mark.parametrize("timelines", [{"stock": Timeline("stock")}, {}], ids=["no-samples", "no-sides"])
def test_png_of_nothing_is_still_an_image(tmp_path, timelines):
    pytest.importorskip("matplotlib")
    out = write_plot(tmp_path / "empty.png", timelines, title="empty")
    assert out.read_bytes().startswith(PNG_SIGNATURE)
    assert min(_png_shape(out)) > 100


def test_matplotlib_is_imported_only_when_drawing_and_never_pyplot(tmp_path):
    pytest.importorskip("matplotlib")
    script = (
        "import sys\n"
        "from membackend.lab._pictures import write_plot\n"
        "from membackend.lab._replay.timeline import Sample, Timeline\n"
        "assert 'matplotlib' not in sys.modules, 'imported at module load'\n"
        f"write_plot({str(tmp_path / 'x.png')!r}, {{'stock': Timeline('stock', [Sample(0, 'cpu', 1, 1)])}},"
        " title='t')\n"
        "assert 'matplotlib' in sys.modules\n"
        "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot may pick an interactive backend'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "DISPLAY")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr


# --------------------------------------------------------------------------- html


def test_html_is_self_contained_and_escapes_labels(tmp_path):
    page = _html(tmp_path, _both(), title=f"title {EVIL}", reported=f"reported {EVIL}")
    assert "<svg" in page
    assert "http://" not in page and "https://" not in page
    assert not re.search(r"""\b(src|href)\s*=""", page), "nothing may be loaded from anywhere"
    assert EVIL not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # the model name, shown escaped
    assert page.count("<script") == 2  # the data block and the tooltip code, nothing injected
    assert page.count("</script>") == 2


def test_html_data_block_keeps_labels_exact(tmp_path):
    page = _html(tmp_path, _both())
    data = json.loads(re.search(r'<script type="application/json" id="timeline-data">(.*?)</script>', page, re.S)[1])
    labels = {m[2] for p in data["panels"] for m in p["markers"]}
    assert EVIL in labels and "flux a$\\frac{$b" in labels
    cpu = next(p for p in data["panels"] if p["side"] == "stock" and p["device"] == "cpu")
    assert all(s[3] is None for s in cpu["samples"])  # no commit charge: null, shown as "-"
    assert [s[0] for s in cpu["samples"]] == [0.0, 0.5, 0.5, 1.0, 2.0, 3.0]


def test_html_panels_stock_above_plugin_sharing_each_devices_scale(tmp_path):
    panels = _panels(_html(tmp_path, _both()))
    titles = ["".join(t.itertext()) for p in panels for t in p.iter("text") if t.get("class") == "ptitle"]
    assert titles == ["stock · cuda:0", "stock · cpu", "plugin · cuda:0", "plugin · cpu"]

    def y_ticks(panel):  # the y tick labels are the right-aligned ones
        return [t.text for t in panel.iter("text") if t.get("text-anchor") == "end" and t.get("class") == "tick"]

    assert y_ticks(panels[0]) == y_ticks(panels[2])  # cuda:0: stock and plugin on one scale
    assert y_ticks(panels[1]) == y_ticks(panels[3])
    assert y_ticks(panels[0]) != y_ticks(panels[1])  # ... but each device its own


def test_html_lines_stay_inside_their_panel(tmp_path):
    for panel in _panels(_html(tmp_path, _both())):
        frame = next(r for r in panel.iter("rect") if r.get("class") == "frame")
        left, top = float(frame.get("x")), float(frame.get("y"))
        right, bottom = left + float(frame.get("width")), top + float(frame.get("height"))
        paths = [p for p in panel.iter("path") if "series" in p.get("class", "")]
        assert {p.get("class") for p in paths} <= {"series s-reserved", "series s-resident", "series s-committed"}
        for path in paths:
            numbers = [float(n) for n in re.findall(r"-?\d+(?:\.\d+)?", path.get("d"))]
            for x, y in zip(numbers[::2], numbers[1::2]):
                assert left - 0.05 <= x <= right + 0.05 and top - 0.05 <= y <= bottom + 0.05


def test_html_committed_line_only_where_committed_is_measured(tmp_path):
    panels = _panels(_html(tmp_path, _both()))

    def series(panel):
        return {p.get("class") for p in panel.iter("path")}

    assert "series s-committed" in series(panels[0])  # cuda:0
    assert "series s-committed" not in series(panels[1])  # cpu: committed None throughout
    assert "series s-resident" in series(panels[1])


def test_html_draws_every_marker_kind_and_labels_workflows(tmp_path):
    stock = _panels(_html(tmp_path, {"stock": _side("stock", 1.0)}))
    cuda, cpu = stock
    titles = lambda panel: ["".join(t.itertext()) for t in panel.iter("title")]  # noqa: E731
    assert titles(cuda) == ["workflow: sdxl-base", f"unload: {EVIL}", "workflow: flux a$\\frac{$b", "unload_all: "]
    assert f"unload: {EVIL}" not in titles(cpu)  # aimed at cuda:0 only; the others apply to every device
    labels = [t.text for t in cuda.iter("text") if "wlabel" in t.get("class", "")]
    assert labels == ["sdxl-base", "flux a$\\frac{$b"]


@pytest.mark.parametrize("present", ["stock", "plugin"])
def test_html_with_one_side(tmp_path, present):
    panels = _panels(_html(tmp_path, {present: _both()[present]}))
    assert len(panels) == 2
    assert all("".join(next(panel.iter("text")).itertext()).startswith(present) for panel in panels)


@pytest.mark.parametrize(
    ("timelines", "note"),
    [({"plugin": Timeline("plugin")}, "no samples"), ({}, "no timeline recorded")],
    ids=["no-samples", "no-sides"],
)
def test_html_of_nothing_is_an_empty_panel_with_a_note(tmp_path, timelines, note):
    page = _html(tmp_path, timelines)
    (panel,) = _panels(page)
    assert note in [t.text for t in panel.iter("text") if t.get("class") == "note"]


def test_html_needs_no_matplotlib(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # "import matplotlib" now raises ImportError
    assert "<svg" in _html(tmp_path, _both())


def test_step_vertices_hold_each_value_until_the_next_sample():
    points = [(0.0, 1), (1.0, 2), (1.0, 3), (2.0, None), (3.0, 5)]
    assert step_segments(points, end=4.0) == [
        [(0.0, 1), (1.0, 1), (1.0, 2), (1.0, 3), (2.0, 3)],  # same instant: each value in order
        [(3.0, 5), (4.0, 5)],  # None broke the line; the last value holds to the end
    ]


# --------------------------------------------------------------------------- errors and the atomic write


@pytest.mark.parametrize("name", ["timeline.jpg", "timeline", "timeline.png.bak"])
def test_unknown_suffix_is_a_typed_error_naming_the_accepted_ones(tmp_path, name):
    with pytest.raises(PlotFormatError) as caught:
        write_plot(tmp_path / name, _both(), title="t")
    assert isinstance(caught.value, MembackendError) and isinstance(caught.value, ValueError)
    for suffix in ACCEPTED_SUFFIXES:
        assert suffix in str(caught.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("suffix", [".png", ".svg", ".pdf"])
def test_missing_matplotlib_says_how_to_install_it(tmp_path, monkeypatch, suffix):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotUnavailable) as caught:
        write_plot(tmp_path / f"t{suffix}", _both(), title="t")
    assert isinstance(caught.value, MembackendError) and isinstance(caught.value, RuntimeError)
    assert 'pip install "membackend[plot]"' in str(caught.value)
    assert suffix in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_a_failed_drawing_leaves_the_old_file_and_no_partial_one(tmp_path, monkeypatch):
    figure = pytest.importorskip("matplotlib.figure")
    target = tmp_path / "timeline.png"
    target.write_bytes(b"previous picture")

    def half_written(self, fh, **kw):
        fh.write(PNG_SIGNATURE + b"half")
        raise RuntimeError("renderer crashed")

    monkeypatch.setattr(figure.Figure, "savefig", half_written)
    with pytest.raises(RuntimeError, match="renderer crashed"):
        write_plot(target, _both(), title="t")
    assert list(tmp_path.iterdir()) == [target]
    assert target.read_bytes() == b"previous picture"


def test_a_failed_rename_leaves_no_file(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise PermissionError("target locked")

    monkeypatch.setattr(pictures.os, "replace", refuse)
    with pytest.raises(PermissionError):
        write_plot(tmp_path / "timeline.html", _both(), title="t")
    assert list(tmp_path.iterdir()) == []


def test_missing_folder_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_plot(tmp_path / "absent" / "timeline.html", _both(), title="t")


# --------------------------------------------------------------------------- what the pictures must show


from membackend.lab._replay.timeline import TALLY_MARKERS, TimelineError  # noqa: E402

#: draws the replays' pictures with matplotlib: the long part
pytestmark = pytest.mark.long


def _figure(timelines, *, title="t", reported=None):
    """The static figure, drawn, and its renderer (what write_plot saves)."""
    pytest.importorskip("matplotlib")
    figure = draw_figure(lay_out(timelines), title=title, reported=reported)
    figure.canvas.draw()
    return figure, figure.canvas.get_renderer()


def _texts(figure):
    from matplotlib.text import Text

    return [t for t in figure.findobj(Text) if t.get_visible() and t.get_text().strip()]


def _overlaps(figure, renderer):
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in _texts(figure)]
    return [(a, b) for i, (a, ba) in enumerate(boxes) for b, bb in boxes[i + 1:]
            if min(ba.x1, bb.x1) - max(ba.x0, bb.x0) > 0.5 and min(ba.y1, bb.y1) - max(ba.y0, bb.y0) > 0.5]


def _inside(box, figure, slack=0.5):
    return (box.x0 >= -slack and box.y0 >= -slack and box.x1 <= figure.bbox.width + slack
            and box.y1 <= figure.bbox.height + slack)


@pytest.fixture(scope="module")
def rocm():
    from membackend.lab._replay.compare import replay

    return replay("full-unload-rocm", seeds=1)


@pytest.fixture(scope="module")
def churn():
    from membackend.lab._replay.compare import replay

    return replay("churn-wddm", seeds=1)


def _stepped_side(side, *, release_at_idle):
    """An engine-like timeline: 40 load steps, then three unloads and an idle in one instant. Only the
    markers' steps can tell those four apart: they share their modelled time."""
    timeline = Timeline(side)
    resident, reserved, committed = 0, 16 * GiB, 32 * GiB
    timeline.next_step(0.0)
    timeline.samples.append(Sample(0.0, "hip:0", reserved, resident, committed, 0))
    for k in range(1, 41):
        step = timeline.next_step(k * 0.01)
        resident += GiB // 4
        timeline.samples.append(Sample(k * 0.01, "hip:0", reserved, resident, committed, step))
    end = 0.4
    for model in ("text_encoder", "unet", "vae"):
        timeline.markers.append(Marker(end, "unload", model, step=timeline.steps))
        step = timeline.next_step(end)
        resident = max(0, resident - 4 * GiB)
        if release_at_idle:
            reserved = max(0, reserved - 6 * GiB)
        timeline.samples.append(Sample(end, "hip:0", reserved, resident, committed, step))
    step = timeline.next_step(end)  # the idle: the plugin gives the commit back here
    timeline.samples.append(Sample(end, "hip:0", reserved, resident, 0 if release_at_idle else committed, step))
    return timeline


def test_markers_sharing_an_instant_get_their_own_steps_and_widened_spans():
    layout = lay_out({"stock": _stepped_side("stock", release_at_idle=False),
                            "plugin": _stepped_side("plugin", release_at_idle=True)})
    plugin = layout.panel("plugin", "hip:0")
    unloads = [p.x for p in plugin.markers if p.marker.kind == "unload"]
    assert len(set(unloads)) == 3 and unloads == sorted(unloads)
    assert layout.widened == {41, 42, 43, 44}  # the three unloads and the idle after them, same instant
    span = layout.edges[42] - layout.edges[41]
    assert span >= 0.05 * layout.x_max  # each an own visible span, not a pixel column
    assert layout.edges[2] - layout.edges[1] < span / 3  # the load steps stay narrow
    commit_release = [r.x for r in plugin.releases if r.series == "committed"]
    assert commit_release == [layout.edges[44]]  # the idle's release, after every unload
    assert not [r for r in layout.panel("stock", "hip:0").releases if r.series == "committed"]
    assert [t for _, t in layout.x_ticks()] == sorted({t for _, t in layout.x_ticks()}, key=int)
    assert all(int(t) <= layout.steps for _, t in layout.x_ticks())


def test_sparse_samples_hold_their_value_until_the_next_step():
    timeline = Timeline("stock", [Sample(0.0, "cuda:0", 0, 0, None, 0), Sample(1.0, "cuda:0", 0, GiB, None, 5),
                                  Sample(2.0, "cuda:0", 0, 0, None, 9)])
    layout = lay_out({"stock": timeline})
    assert layout.steps == 10
    (segment,) = layout.panel("stock", "cuda:0").series["resident"]
    assert segment == [(0.0, 0), (5.0, 0), (5.0, GiB), (9.0, GiB), (9.0, 0), (10.0, 0)]


def test_full_unload_rocm_draws_each_unload_and_the_release_apart(rocm):
    layout = lay_out(rocm.timelines())
    figure, _ = _figure(rocm.timelines())
    axes = figure.axes[layout.columns.index("hip:0") + len(layout.columns)]  # plugin · hip:0
    assert axes.get_title() == "plugin · hip:0"
    plugin = layout.panel("plugin", "hip:0")
    unloads = [p.x for p in plugin.markers if p.marker.kind == "unload"]
    releases = [r.x for r in plugin.releases]
    assert len(unloads) == 3 and releases, "the plugin releases what the unloads leave"
    assert max(releases) > max(unloads), "the commit comes back after the last unload, at the idle"
    pixels = sorted({axes.transData.transform((x, 0))[0] for x in unloads + releases})
    assert len(pixels) >= 4
    assert min(b - a for a, b in zip(pixels, pixels[1:])) >= 15, "each event a span of its own, not one pixel column"
    assert not _overlaps(figure, figure.canvas.get_renderer())


def test_full_unload_rocm_summaries_show_what_each_side_kept(rocm):
    figure, _ = _figure(rocm.timelines())
    texts = [t.get_text() for t in _texts(figure)]
    stock_end = rocm.timelines()["stock"].samples[-2]  # hip:0's last sample (hip:1 comes after it)
    assert stock_end.device == "hip:0" and stock_end.committed > 0
    assert any(f"committed {stock_end.committed / 10**9:.3g} GB" in t for t in texts)
    assert any("reserved 0, resident 0, committed 0 GB" in t for t in texts)  # the plugin gave it all back


def test_churn_picture_draws_and_counts_the_bugchecks(churn, tmp_path):
    stock, plugin = churn.results["stock"][0], churn.results["plugin"][0]
    assert stock.bugchecks > 0 and plugin.bugchecks == 0
    timelines = churn.timelines()
    drawn = sum(int(m.label) for m in timelines["stock"].markers if m.kind == "bugcheck")
    assert drawn == stock.bugchecks == timelines["stock"].tallies["bugchecks"]
    assert sum(int(m.label) for m in timelines["stock"].markers if m.kind == "raced_free") == stock.hazards
    figure, renderer = _figure(timelines)
    texts = [t.get_text() for t in _texts(figure)]
    assert any(f"{stock.bugchecks:,} simulated bugchecks" in t for t in texts)
    assert any("0 simulated bugchecks" in t for t in texts)
    assert any(f"{stock.hazards:,} frees raced pending work" in t for t in texts)
    stock_axes = figure.axes[0]
    crosses = [line for line in stock_axes.get_lines() if line.get_marker() == style.RUG_STYLE["bugcheck"][1]]
    assert sum(len(line.get_xdata()) for line in crosses) == len(
        [m for m in timelines["stock"].markers if m.kind == "bugcheck"])
    assert not [line for line in figure.axes[1].get_lines() if line.get_marker() == style.RUG_STYLE["bugcheck"][1]]
    assert not _overlaps(figure, renderer)
    page = _html(tmp_path, timelines)
    assert page.count('class="marker rug r-bugcheck"') == len([m for m in timelines["stock"].markers
                                                               if m.kind == "bugcheck"])
    assert f"{stock.bugchecks:,} simulated bugchecks" in page


def _every_legend_entry() -> dict[str, Timeline]:
    """One device, every series, release, marker line and rug kind: the widest legend there is."""
    sides = {}
    for side in ("stock", "plugin"):
        timeline = Timeline(side)
        for k in range(30):
            step = timeline.next_step(k * 0.1, bugchecks=k // 3, raced_frees=k // 4, oom=k // 10)
            held = (k % 10) * GiB
            timeline.samples.append(Sample(k * 0.1, "cuda:0", 20 * GiB - (k // 10) * 5 * GiB, held, held, step))
            if k in (0, 12):
                timeline.markers.append(Marker(k * 0.1, "workflow", f"workflow-{k}", step=timeline.steps))
            if k == 20:
                timeline.markers.append(Marker(k * 0.1, "unload", "a model with a long name", step=timeline.steps))
            if k == 25:
                timeline.markers.append(Marker(k * 0.1, "unload_all", "unload all", step=timeline.steps))
        sides[side] = timeline
    return sides


def test_legend_and_every_text_lie_inside_the_figure(tmp_path):
    caption = "a caption long enough to wrap " * 8
    figure, renderer = _figure(_every_legend_entry(), title="a title", reported=caption)
    (legend,) = [a.get_legend() for a in figure.axes if a.get_legend() is not None]
    labels = [t.get_text() for t in legend.get_texts()]
    assert len(labels) == 10  # 3 series, the release, 4 line kinds, 2 rug kinds
    assert _inside(legend.get_window_extent(renderer), figure)
    outside = [t.get_text() for t in _texts(figure) if not _inside(t.get_window_extent(renderer), figure)]
    assert outside == []
    assert not _overlaps(figure, renderer)
    out = write_plot(tmp_path / "all.png", _every_legend_entry(), title="a title", reported=caption)  # that figure
    height, width = _png_shape(out)
    assert abs(height - figure.bbox.height) <= 1 and abs(width - figure.bbox.width) <= 1


def test_reserved_is_labelled_address_space_and_resident_is_drawn_over_committed():
    figure, _ = _figure(_both())
    (legend,) = [a.get_legend() for a in figure.axes if a.get_legend() is not None]
    assert "reserved (address space)" in [t.get_text() for t in legend.get_texts()]
    lines = {line.get_color(): line for line in figure.axes[0].get_lines()}
    resident, committed = lines[style.SERIES_STYLE["resident"].colour], lines[style.SERIES_STYLE["committed"].colour]
    assert resident.get_zorder() > committed.get_zorder()
    assert committed.get_linewidth() > 2 * resident.get_linewidth()  # where they are equal, committed shows around it


def test_crowded_labels_take_lanes_and_never_overlap():
    timeline = Timeline("stock")
    for k in range(60):
        timeline.next_step(k * 0.1)
        timeline.samples.append(Sample(k * 0.1, "cuda:0", 8 * GiB, k * GiB // 10, None, k))
    for k in range(20, 32):  # twelve long labels on neighbouring steps
        timeline.markers.append(Marker(k * 0.1, "workflow", f"a long workflow name {k}", step=k))
    figure, renderer = _figure({"stock": timeline})
    shown = [t for t in _texts(figure) if t.get_text().startswith("a long workflow name")]
    assert len(shown) >= MAX_LANES  # every lane used: not a vacuous check
    assert not _overlaps(figure, renderer)


def test_lane_assignment_never_overlaps_and_flips_at_the_right_edge():
    import random

    rng = random.Random(7)
    spans = [(rng.uniform(0, 500), rng.uniform(20, 120)) for _ in range(40)]
    lanes = assign_lanes(spans, 0.0, 500.0, gap=3.0)
    placed = []
    for (anchor, width), lane in zip(spans, lanes):
        if lane is None:
            continue
        row, flipped = lane
        start = anchor - width if flipped else anchor
        assert start >= 0.0 and (start + width <= 500.0 or not flipped)
        placed.append((row, start, start + width))
    assert any(lane is None for lane in lanes) and len({row for row, _, _ in placed}) == MAX_LANES
    for i, (row, a0, a1) in enumerate(placed):
        for other, b0, b1 in placed[i + 1:]:
            assert row != other or a1 + 3.0 <= b0 or b1 + 3.0 <= a0
    assert assign_lanes([(490.0, 50.0)], 0.0, 500.0, gap=3.0) == [(0, True)]


def test_html_marks_unloads_rugs_and_summaries(tmp_path):
    sides = _every_legend_entry()
    page = _html(tmp_path, sides)
    panels = _panels(page)
    labels = ["".join(t.itertext()) for t in panels[0].iter("text") if "ulabel" in t.get("class", "")]
    assert "unload a model with a long name" in labels and "unload all" in labels
    assert [t.text for t in panels[0].iter("text") if "wlabel" in t.get("class", "")] == ["workflow-0", "workflow-12"]
    rugs = [p for p in panels[0].iter("path") if "r-bugcheck" in p.get("class", "")]
    assert len(rugs) == len([m for m in sides["stock"].markers if m.kind == "bugcheck"])
    summary = "".join("".join(t.itertext()) for t in panels[0].iter("text") if t.get("class") == "summary")
    assert f"{sides['stock'].tallies['bugchecks']} simulated bugchecks" in summary


# --------------------------------------------------------------------------- Timeline.next_step


def test_next_step_counts_steps_and_marks_each_increase():
    timeline = Timeline("stock")
    assert timeline.next_step(0.0, bugchecks=0, raced_frees=0) == 0
    assert timeline.next_step(0.5, bugchecks=2, raced_frees=0) == 1
    assert timeline.next_step(0.7, bugchecks=2, raced_frees=1, oom=3) == 2
    assert [(m.kind, m.label, m.step, m.t) for m in timeline.markers] == [
        ("bugcheck", "2", 1, 0.5), ("raced_free", "1", 2, 0.7), ("oom", "3", 2, 0.7)]
    assert timeline.tallies == {"bugchecks": 2, "raced_frees": 1, "oom": 3}
    assert timeline.steps == 3
    assert set(TALLY_MARKERS) == set(timeline.tallies)


@pytest.mark.parametrize("totals", [{"crashes": 1}, {"bugchecks": -1}, {"bugchecks": 1.5}, {"bugchecks": True},
                                    {"bugchecks": 1, "oom": "2"}, {"raced_frees": 4}])
def test_next_step_refuses_a_bad_total_and_changes_nothing(totals):
    timeline = Timeline("stock")
    timeline.next_step(0.0, bugchecks=2, raced_frees=5)
    with pytest.raises(TimelineError) as caught:
        timeline.next_step(1.0, **totals)
    assert isinstance(caught.value, MembackendError) and isinstance(caught.value, ValueError)
    assert any(word in str(caught.value) for word in ("accepted", "whole number", "never falls"))
    assert timeline.steps == 1 and timeline.tallies == {"bugchecks": 2, "raced_frees": 5}
    assert [m.kind for m in timeline.markers] == ["bugcheck", "raced_free"]
