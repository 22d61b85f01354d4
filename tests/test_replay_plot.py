"""``membackend._replay.plot.write_plot``: every format, the escaping, the typed errors, the atomic write."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from membackend._replay import plot
from membackend._replay.plot import ACCEPTED_SUFFIXES, PlotFormatError, PlotUnavailable, write_plot
from membackend._replay.timeline import Marker, Sample, Timeline
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
        "from membackend._replay.plot import write_plot\n"
        "from membackend._replay.timeline import Sample, Timeline\n"
        "assert 'matplotlib' not in sys.modules, 'imported at module load'\n"
        f"write_plot({str(tmp_path / 'x.png')!r}, {{'stock': Timeline('stock', [Sample(0, 'cpu', 1, 1)])}}, title='t')\n"
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
    assert plot._step_segments(points, end=4.0) == [
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

    monkeypatch.setattr(plot.os, "replace", refuse)
    with pytest.raises(PermissionError):
        write_plot(tmp_path / "timeline.html", _both(), title="t")
    assert list(tmp_path.iterdir()) == []


def test_missing_folder_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        write_plot(tmp_path / "absent" / "timeline.html", _both(), title="t")
