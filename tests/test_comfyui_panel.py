"""The memory panel in a real browser: Debian's chromium, headless, driven by playwright.

* **In the real ComfyUI tree** (``MEMBACKEND_COMFYUI``, its Python ``MEMBACKEND_COMFYUI_PYTHON``; see
  ``docs/real-comfyui-tests.md``): the tree is copied, membackend's node installed with the real
  ``membackend comfyui install``, and served on 127.0.0.1 under ``--cpu --enable-dynamic-vram`` with the
  adapter taking over on the simulated H200. The panel opens from ComfyUI's sidebar and shows the budgets
  the status route reports; it updates after a workflow runs and after ``POST /free``; a headroom typed into
  it is the one the status route and the next budget query report, and a bad one is refused there with the
  accepted range. Screenshots in ComfyUI's dark and light themes go to ``$MEMBACKEND_PANEL_SCREENSHOTS``
  (default: pytest's temporary folder; ``docs/images`` for the README's).
* **Where the stand-in streams weights** (on CPU no model of the real tree gets a VBAR, so its models list
  stays empty): the stand-in ComfyUI runs an image -> image -> video -> image sequence through the adapter,
  and the panel's own file renders that status in chromium (a minimal page standing in for ComfyUI's
  ``app`` and ``api`` modules): the models list, the per-load lines and the live chart are checked.

Skipped, with the reason, where chromium, playwright or (for the first) the tree is missing.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

#: drives the memory panel in a browser against the stand-in: the long part
pytestmark = pytest.mark.long

REPO = Path(__file__).resolve().parents[1]
WEB = REPO / "membackend" / "_comfyui" / "web"
STANDIN = Path(__file__).parent / "fixtures" / "comfyui_standin"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 60_000
TAB_COMMAND = "Workspace.ToggleSidebarTab.membackend-memory"
# read when the module is imported: the suite's autouse fixture clears MEMBACKEND_* inside each test
ENV = {k: os.environ.get(k) for k in ("MEMBACKEND_COMFYUI", "MEMBACKEND_COMFYUI_PYTHON", "MEMBACKEND_CHROMIUM",
                                      "MEMBACKEND_PANEL_SCREENSHOTS")}
SCREENSHOTS = Path(ENV["MEMBACKEND_PANEL_SCREENSHOTS"]).absolute() if ENV["MEMBACKEND_PANEL_SCREENSHOTS"] else None


def _chromium() -> str:
    for candidate in (ENV["MEMBACKEND_CHROMIUM"], shutil.which("chromium"), "/usr/bin/chromium"):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.skip("no chromium (Debian: apt-get install chromium; .ci/run installs it where it runs as root)")


def _playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[browser]'; .ci/run installs that extra)")
    return sync_playwright


@contextlib.contextmanager
def _browser(tmp_path: Path):
    """A headless chromium with an empty profile; playwright never downloads one of its own."""
    exe = _chromium()
    sync_playwright = _playwright()
    profile = tmp_path / "chromium-profile"
    profile.mkdir()
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    with sync_playwright() as pw:
        context = pw.chromium.launch_persistent_context(
            str(profile), executable_path=exe, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1400, "height": 900})
        try:
            yield context
        finally:
            context.close()


def _shots() -> Path | None:
    return SCREENSHOTS


# ---------------------------------------------------------------------------------------------- the stand-in


STUB_APP = """export const app = {
  extensions: [],
  registerExtension(ext) { this.extensions.push(ext); },
  extensionManager: { tabs: [], registerSidebarTab(tab) { this.tabs.push(tab); } },
};
window.app = app;
"""
STUB_API = """export const api = {
  fetchApi(route, options) { return fetch(route, options); },
  addEventListener() {},
};
"""
PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>membackend panel</title></head>
<body style="margin:0;background:#202020"><div id="host" style="width:440px;height:880px"></div>
<script type="module">
import { app } from "/scripts/app.js";
await import("/extensions/membackend/membackend_panel.js");
for (const ext of app.extensions) await ext.setup?.();
app.extensionManager.tabs[0].render(document.getElementById("host"));
window.panelReady = true;
</script></body></html>"""


def _standin_status(tmp_path: Path) -> dict:
    """The status route's answer after the stand-in ran image, image, video, image through the adapter."""
    pytest.importorskip("torch")
    pytest.importorskip("comfy_aimdo")
    tree = tmp_path / "standin"
    shutil.copytree(STANDIN, tree)
    subprocess.run([sys.executable, "-m", "membackend._cli", "comfyui", "install", str(tree)], check=True,
                   capture_output=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMBACKEND_", "STANDIN_"))}
    env.update(MEMBACKEND_BACKEND="host", MEMBACKEND_HEADROOM="0", MEMBACKEND_HOST_CAPACITY="8MiB",
               STANDIN_ARGS="--enable-dynamic-vram", STANDIN_EXTRA="0", PYTHONPATH=str(REPO / "tests"))
    p = subprocess.run([sys.executable, str(tree / "scenario.py"), "panel"], capture_output=True, text=True,
                       env=env, cwd=str(tmp_path), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])["panel"]["status"]


@contextlib.contextmanager
def _serve_panel(status: dict):
    """127.0.0.1: the page, stand-ins for ComfyUI's app and api modules, the panel's real file and the
    status."""
    files = {"/": (PAGE, "text/html"), "/scripts/app.js": (STUB_APP, "text/javascript"),
             "/scripts/api.js": (STUB_API, "text/javascript"),
             "/extensions/membackend/membackend_panel.js":
                 ((WEB / "membackend_panel.js").read_text(encoding="utf-8"), "text/javascript"),
             "/membackend/status": (json.dumps(status), "application/json")}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body, kind = files.get(self.path.split("?")[0], ("not found", "text/plain"))
            self.send_response(200 if self.path.split("?")[0] in files else 404)
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _open_panel(context, url: str, ready: str) -> tuple[Any, list[str]]:
    """A page on the served panel once it rendered ``ready`` (a CSS selector), and the page errors it raises."""
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(url + "/")
    page.wait_for_function(f"window.panelReady === true && document.querySelector('{ready}')", timeout=TIMEOUT_MS)
    return page, errors


def test_panel_shows_the_models_loads_and_chart_the_standin_streamed(tmp_path):
    status = _standin_status(tmp_path)
    models = status["models"]
    assert len(models) == 2 and status["load_count"] == 4, status
    with _serve_panel(status) as url, _browser(tmp_path) as context:
        page, errors = _open_panel(context, url, "[data-mb=models]")
        rows = page.locator("[data-mb=models] tr[data-model]")
        assert rows.count() == len(models)
        shown = {rows.nth(i).get_attribute("data-model"): (rows.nth(i).get_attribute("data-name"),
                                                           int(rows.nth(i).get_attribute("data-resident")))
                 for i in range(rows.count())}
        assert shown == {k: (v["name"], v["resident"]) for k, v in models.items()}
        text = page.locator("[data-mb=models]").inner_text()
        # states by the weights' pages: one model wholly resident (warm), one evicted (not resident)
        assert "warm" in text and "not resident" in text and "ago" in text, text
        # a model's size is its weights' bytes (the address range is in the tooltip)
        assert {r.get_attribute("data-model"): int(r.get_attribute("data-size")) for r in rows.all()} == \
            {k: v["size"] for k, v in models.items()}
        # the table fits the sidebar at ComfyUI's default width: nothing clipped, no horizontal scroll
        for width in (300, 360):
            page.evaluate(f"document.querySelector('#membackend-panel').style.width = '{width}px'")
            fits = page.evaluate("""() => { const t = document.querySelector('[data-mb=models]');
                const p = document.querySelector('#membackend-panel');
                return [t.scrollWidth, p.clientWidth, [...t.querySelectorAll('td, th')].every(
                    (c) => c.scrollWidth <= c.clientWidth + 1)]; }""")
            assert fits[0] <= fits[1] and fits[2], (width, fits)
        legend = page.locator("[data-mb=chart] + .mb-legend").inner_text()
        assert "reserved (address space)" in legend, legend
        loads = page.locator("[data-mb=loads] li")
        kinds = [loads.nth(i).get_attribute("data-kind") for i in range(loads.count())]
        assert kinds == ["reloaded", "cold", "kept", "cold"], kinds  # newest first
        assert "reloaded" in loads.nth(0).inner_text() and "evicted at" in loads.nth(0).inner_text()
        chart = page.locator("[data-mb=chart]")
        assert int(chart.get_attribute("data-samples")) == len(status["history"]["cpu:0"]) >= 4
        for series in ("reserved", "resident"):
            points = chart.locator(f"polyline[data-series={series}]").get_attribute("points").split()
            assert len(points) >= 4, (series, points)
        ys = {p.split(",")[1] for p in chart.locator("polyline[data-series=reserved]").get_attribute("points").split()}
        assert len(ys) >= 2  # the video's reservation raised the line
        assert "evicted" in page.locator("[data-mb=unloads]").inner_text()
        assert page.locator("[data-mb=kept-windows]").count() == 0  # the host backend keeps no window
        assert not errors, errors
        if _shots() is not None:
            _shots().mkdir(parents=True, exist_ok=True)
            page.locator("#membackend-panel").screenshot(path=str(_shots() / "comfyui-memory-panel-models.png"))


def test_panel_shows_the_address_windows_a_backend_keeps(tmp_path):
    """rocm_windows keeps released address windows against the driver's reserve-churn defect: the panel says how
    many, how large, the bound and why, per device (the status's ``kept_windows``)."""
    status = {"running": True, "state": "running", "version": "x", "line": "membackend x: using rocm_windows",
              "reason": "test", "how_to": "", "backend": "rocm_windows", "models": {}, "loads": [], "unloads": [],
              "budgets": {"hip:0": {"total": 24 << 30, "free": 20 << 30, "headroom": 0, "usable": 20 << 30,
                                    "source": "hipMemGetInfo"}},
              "headroom": {"hip:0": {"bytes": 0, "source": "default", "live": False, "min": 0, "max": 24 << 30}},
              "kept_windows": {"hip:0": {"windows": 1, "bytes": 3 << 30, "largest": 3 << 30, "bound": 1,
                                         "bound_rule": "the kept_windows setting", "give_back": 0,
                                         "reason": "released large windows kept for the next reserve",
                                         "large_frees_spent": 12, "large_frees_allowed": 12,
                                         "line": "hip:0: 1 address window(s) kept, 3.0 GiB"}},
              "history": {}}
    with _serve_panel(status) as url, _browser(tmp_path) as context:
        page, errors = _open_panel(context, url, "[data-mb=device]")
        kept = page.locator("[data-mb=device][data-device='hip:0'] [data-mb=kept-windows]")
        assert kept.count() == 1 and kept.get_attribute("data-bytes") == str(3 << 30)
        text = kept.inner_text()
        assert "kept address windows: 1" in text and "at most 1" in text and "kept for the next reserve" in text, text
        assert not errors, errors


def test_panel_shows_the_cache_and_the_models_on_the_classic_path(tmp_path):
    """Issue 41: the bytes of dropped models kept as cache, apart from what live models hold (the status's
    ``cache``), a cached model as "cached, reclaimable", and a model ComfyUI runs on its classic path as such."""
    models = {"vbar-1": {"name": "BaseModel (dropped)", "size": 2 << 30, "resident": 2 << 30, "state": "cached",
                         "path": "dynamic", "pinned": 0, "evictable": 2 << 30, "held": False, "last_used": None,
                         "kind": "diffusion", "device": "cuda:0", "address_range": 20 << 30},
              "vbar-2": {"name": "AutoencoderKL", "size": 300 << 20, "resident": 320 << 20, "state": "warm",
                         "path": "classic", "pinned": 0, "evictable": 320 << 20, "held": True, "last_used": None,
                         "kind": "diffusion", "device": "cuda:0", "address_range": 3 << 30}}
    status = {"running": True, "state": "running", "version": "x", "line": "membackend x: using vmm",
              "reason": "test", "how_to": "", "backend": "vmm", "models": models, "loads": [], "unloads": [],
              "budgets": {"cuda:0": {"total": 140 << 30, "free": 137 << 30, "headroom": 1 << 28,
                                     "usable": 136 << 30, "source": "cuMemGetInfo"}},
              "headroom": {"cuda:0": {"bytes": 1 << 28, "source": "default", "live": False, "min": 0,
                                      "max": 140 << 30}},
              "cache": {"cuda:0": {"bytes": 2 << 30, "keep_dropped": "auto"}}, "history": {}}
    with _serve_panel(status) as url, _browser(tmp_path) as context:
        page, errors = _open_panel(context, url, "[data-mb=device]")
        cached = page.locator("[data-mb=device][data-device='cuda:0'] [data-mb=cached]")
        assert cached.count() == 1 and cached.get_attribute("data-bytes") == str(2 << 30)
        states = {page.locator(f"[data-model='{k}'] [data-mb=model-state]").inner_text() for k in models}
        assert states == {"cached, reclaimable", "warm, classic path, kept warm"}, states
        assert not errors, errors


# ---------------------------------------------------------------------------------------------- the real tree


def _real_tree():
    tree = ENV["MEMBACKEND_COMFYUI"]
    if not tree:
        pytest.skip("the panel in real ComfyUI: set MEMBACKEND_COMFYUI to a ComfyUI tree (see "
                    "docs/real-comfyui-tests.md)")
    python = ENV["MEMBACKEND_COMFYUI_PYTHON"] or str(REPO / ".venv-comfyui" / "bin" / "python")
    if not Path(python).exists():
        pytest.skip(f"the panel in real ComfyUI: no Python at {python}; build one with scripts/comfyui-python")
    return Path(tree).absolute(), python


def _panel_numbers(page, device: str) -> dict[str, int]:
    card = page.locator(f"[data-mb=device][data-device='{device}']")
    return {k: int(card.locator(f"[data-mb={k}]").get_attribute("data-bytes"))
            for k in ("total", "usable", "free", "headroom")}


def _wait_polls(page, more: int = 2) -> None:
    now = int(page.locator("#membackend-panel").get_attribute("data-polls"))
    page.wait_for_function(f"Number(document.getElementById('membackend-panel').dataset.polls) >= {now + more}",
                           timeout=TIMEOUT_MS)


def test_panel_in_real_comfyui(tmp_path):
    source, python_path = _real_tree()
    _chromium()
    _playwright()
    from real_comfyui import harness

    python = harness.inspect_python(python_path)
    tree = harness.copy_tree(source, tmp_path / "ComfyUI")
    harness.writable(tree)
    shutil.rmtree(tree / "custom_nodes" / "membackend", ignore_errors=True)
    harness.build_vae(tree, python=python)
    harness.run_child([python.path, "-m", "membackend._cli", "comfyui", "install", str(tree)])
    # a returning user: no first-run template dialog over the page
    settings = tree / "user" / "default" / "comfy.settings.json"
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({"Comfy.TutorialCompleted": True}), encoding="utf-8")
    flags = ("--cpu", "--enable-dynamic-vram")
    with harness.serve(tree, flags, {"MEMBACKEND_SIM_PROFILE": "h200"}, python=python,
                       log=tmp_path / "server.log") as server, _browser(tmp_path) as context:
        code, st = server.get("/membackend/status")
        assert code == 200 and st["state"] == "running", st
        device = next(iter(st["budgets"]))
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(server.url + "/")
        page.wait_for_function("window.app && window.app.extensionManager && window.app.extensionManager.command",
                               timeout=TIMEOUT_MS)
        for _ in range(3):  # any dialog ComfyUI opens on its own (news, templates) goes first
            if page.locator("[role=dialog]").count() == 0:
                break
            page.keyboard.press("Escape")
            page.wait_for_timeout(300)
        page.evaluate(f"window.app.extensionManager.command.execute({json.dumps(TAB_COMMAND)})")
        page.wait_for_selector("#membackend-panel [data-mb=state][data-state=running]", timeout=TIMEOUT_MS)
        page.wait_for_selector(f"[data-mb=device][data-device='{device}']", timeout=TIMEOUT_MS)

        # the budgets the status route reports
        b = server.get("/membackend/status")[1]["budgets"][device]
        shown = _panel_numbers(page, device)
        assert shown["total"] == b["total"] and shown["headroom"] == b["headroom"], (shown, b)
        assert "vmm" in page.locator("[data-mb=backend]").inner_text()

        # a workflow runs: the panel refreshes (ComfyUI's "executed" event and its poll) and shows the route's
        polls = int(page.locator("#membackend-panel").get_attribute("data-polls"))
        server.run_prompt(harness.vae_workflow())
        _wait_polls(page)
        assert int(page.locator("#membackend-panel").get_attribute("data-polls")) > polls
        after = server.get("/membackend/status")[1]
        assert after["idle"]["times"] >= 1, after["idle"]
        idle = page.locator("[data-mb=idle]")
        assert int(idle.get_attribute("data-times")) == after["idle"]["times"]  # the prompt it just finished
        assert _panel_numbers(page, device)["total"] == after["budgets"][device]["total"]

        # POST /free: the panel follows
        assert server.post("/free", {"unload_models": True, "free_memory": True})[0] == 200
        _wait_polls(page)
        assert server.get("/membackend/status")[1]["reservations"] == []
        assert page.locator("[data-mb=idle]").get_attribute("data-reservations") == "0"
        assert page.locator("[data-mb=models-empty]").count() == 1  # on CPU no model gets a VBAR

        # a headroom typed into the panel: the route and the next budget query say the same
        box = page.locator(f"[data-mb=headroom-input][data-device='{device}']")
        box.fill("3GiB")
        page.locator(f"[data-mb=headroom-apply][data-device='{device}']").click()
        page.wait_for_selector("[data-mb=headroom-ok]", timeout=TIMEOUT_MS)
        st = server.get("/membackend/status")[1]
        assert st["budgets"][device]["headroom"] == 3 << 30 and st["headroom"][device]["live"], st["headroom"]
        assert "live change" in st["headroom"][device]["source"]
        _wait_polls(page, 1)
        assert _panel_numbers(page, device)["headroom"] == 3 << 30
        assert "live change" in page.locator("[data-mb=headroom-source]").inner_text()
        shots = _shots() or tmp_path
        shots.mkdir(parents=True, exist_ok=True)
        clip = {"x": 0, "y": 0, "width": 820, "height": 900}  # the sidebar, the panel and some of the graph
        page.screenshot(path=str(shots / "comfyui-memory-panel-dark.png"), clip=clip)

        # ComfyUI's light theme: the panel follows its colours
        dark_bg = page.evaluate("getComputedStyle(document.getElementById('membackend-panel')).backgroundColor")
        page.evaluate("window.app.extensionManager.setting.set('Comfy.ColorPalette', 'light')")
        page.wait_for_function(
            f"getComputedStyle(document.getElementById('membackend-panel')).backgroundColor !== {json.dumps(dark_bg)}",
            timeout=TIMEOUT_MS)
        page.screenshot(path=str(shots / "comfyui-memory-panel-light.png"), clip=clip)

        # a bad value: refused in the panel with the accepted range; nothing changed
        box.fill("-1")
        page.locator(f"[data-mb=headroom-apply][data-device='{device}']").click()
        page.wait_for_selector("[data-mb=headroom-error]", timeout=TIMEOUT_MS)
        said = page.locator("[data-mb=headroom-error]").inner_text()
        assert "InvalidSize" in said and f"from 0 to {b['total']} bytes" in said, said
        assert server.get("/membackend/status")[1]["budgets"][device]["headroom"] == 3 << 30
        assert not errors, errors
