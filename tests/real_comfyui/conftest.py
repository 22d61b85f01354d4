"""Fixtures for the real-ComfyUI suite; skipped as a whole unless ``MEMBACKEND_COMFYUI`` names a tree.

Environment (read once, when pytest configures this package; the repository's autouse fixture
clears ``MEMBACKEND_*`` inside each test, which does not reach the ComfyUI children: the harness
builds their environment itself):

* ``MEMBACKEND_COMFYUI`` — the ComfyUI tree under test (never written: it is copied first);
* ``MEMBACKEND_COMFYUI_PYTHON`` — the Python that runs it (default ``<repo>/.venv-comfyui/bin/python``);
* ``MEMBACKEND_COMFYUI_MATRIX=full`` — the whole start-up matrix (default: the covering CI subset);
* ``MEMBACKEND_COMFYUI_REPORT`` — where ``report.json``, ``report.md`` and the runs' logs go
  (default: a folder in pytest's temporary directory; its path is printed at the end).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from . import harness

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Settings:
    tree: Path | None
    python: Path
    python_given: bool
    matrix: str
    report: Path | None

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "Settings":
        tree = env.get("MEMBACKEND_COMFYUI") or None
        python = env.get("MEMBACKEND_COMFYUI_PYTHON") or None
        report = env.get("MEMBACKEND_COMFYUI_REPORT") or None
        mode = "full" if (env.get("MEMBACKEND_COMFYUI_MATRIX") or "").strip().lower() == "full" else "ci"
        default_python = harness.REPO / ".venv-comfyui" / "bin" / "python"
        return cls(Path(tree).expanduser().absolute() if tree else None,
                   Path(python).expanduser().absolute() if python else default_python,
                   python is not None, mode, Path(report).expanduser().absolute() if report else None)

    def skip_reason(self) -> str | None:
        if self.tree is None:
            return "real ComfyUI tests: set MEMBACKEND_COMFYUI to a ComfyUI tree (see docs/real-comfyui-tests.md)"
        if not (self.tree / "main.py").is_file():
            return f"real ComfyUI tests: MEMBACKEND_COMFYUI={self.tree} is not a ComfyUI tree (no main.py)"
        if not self.python.exists():
            how = "MEMBACKEND_COMFYUI_PYTHON" if self.python_given else "the default"
            return (f"real ComfyUI tests: no Python at {self.python} ({how}); build one with "
                    "scripts/comfyui-python or set MEMBACKEND_COMFYUI_PYTHON")
        return None


SETTINGS = Settings.from_env(dict(os.environ))
_report_path: list[Path] = []


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "real_comfyui: runs membackend's adapter inside a real ComfyUI tree "
                                       "(needs MEMBACKEND_COMFYUI; see docs/real-comfyui-tests.md)")
    config.addinivalue_line("markers", "real_comfyui_full: a start-up matrix case outside the CI subset "
                                       "(collected only with MEMBACKEND_COMFYUI_MATRIX=full)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = SETTINGS.skip_reason()
    for item in items:
        if HERE not in Path(str(item.path)).resolve().parents:
            continue
        item.add_marker(pytest.mark.real_comfyui)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if _report_path:
        terminalreporter.write_line(f"real ComfyUI report: {_report_path[0] / 'report.md'} (and report.json, logs/)")


@pytest.fixture(scope="session")
def rc_settings() -> Settings:
    reason = SETTINGS.skip_reason()
    if reason:
        pytest.skip(reason)
    return SETTINGS


@pytest.fixture(scope="session")
def comfy_python(rc_settings: Settings) -> harness.ComfyPython:
    try:
        return harness.inspect_python(str(rc_settings.python))
    except harness.HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def report(rc_settings: Settings, comfy_python: harness.ComfyPython, tmp_path_factory) -> harness.Report:
    folder = rc_settings.report or tmp_path_factory.mktemp("real-comfyui-report")
    _report_path[:] = [folder]
    rep = harness.Report(folder)
    rep.put("environment", {"tree": str(rc_settings.tree), "matrix": rc_settings.matrix,
                            **harness.python_summary(comfy_python)})
    return rep


@pytest.fixture(scope="session")
def trees(rc_settings: Settings, comfy_python: harness.ComfyPython, tmp_path_factory) -> harness.Trees:
    """The tree copied once per session: a stock copy and one with membackend's node installed."""
    try:
        return harness.Trees.prepare(rc_settings.tree, tmp_path_factory.mktemp("comfyui"), comfy_python)
    except harness.HarnessError as exc:
        pytest.fail(f"could not prepare the ComfyUI trees: {exc}", pytrace=False)


@pytest.fixture(scope="session")
def matrix(request, rc_settings, comfy_python, trees, report) -> dict[harness.Case, harness.CaseResult | str]:
    """Every collected start-up case, run once (two at a time) on first use: a :class:`harness.CaseResult`,
    or the reason it cannot run here (a comfy-aimdo version this Python lacks)."""
    cases = sorted({item.callspec.params["case"] for item in request.session.items
                    if getattr(item, "originalname", None) == "test_startup_matrix" and hasattr(item, "callspec")})
    results: dict[harness.Case, harness.CaseResult | str] = {}
    runnable = []
    for case in cases:
        try:
            comfy_python.aimdo_dir(case.aimdo)
            runnable.append(case)
        except harness.AimdoMissing as exc:
            results[case] = str(exc)
    t0 = time.monotonic()
    results.update(harness.run_matrix(runnable, trees=trees, python=comfy_python, logs=report.folder / "logs"))
    report.put("matrix", {"mode": rc_settings.matrix, "seconds": time.monotonic() - t0,
                          "stock_runs": len({(c.flags, c.aimdo) for c in runnable}),
                          "not_run": {c.id: r for c, r in results.items() if isinstance(r, str)},
                          "cases": [results[c].row() for c in runnable]})
    return results


class ServedRuns:
    """The served configurations, each started once, on first use (see test_served.py)."""

    CONFIGS = {
        # name: (membackend node installed, flags, env, free after the workflows)
        "stock": (False, ("--cpu",), {}, False),
        "stock-dynamic": (False, ("--cpu", "--enable-dynamic-vram"), {}, False),
        "disabled": (True, ("--cpu",), {"MEMBACKEND_DISABLE": "1"}, False),
        "host-fallback": (True, ("--cpu",), {}, False),
        "takeover-h200": (True, ("--cpu", "--enable-dynamic-vram"), {"MEMBACKEND_SIM_PROFILE": "h200"}, True),
    }

    def __init__(self, trees: harness.Trees, python: harness.ComfyPython, report: harness.Report):
        self.trees, self.python, self.report = trees, python, report
        self.done: dict[str, harness.Served] = {}

    def __getitem__(self, name: str) -> harness.Served:
        if name not in self.done:
            node, flags, env, free = self.CONFIGS[name]
            self.done[name] = harness.run_served(
                name, self.trees.node if node else self.trees.stock, flags, env, trees=self.trees,
                python=self.python, logs=self.report.folder / "logs", free=free)
            self.report.put("served", {k: v.row() for k, v in self.done.items()})
        return self.done[name]


@pytest.fixture(scope="session")
def served(trees, comfy_python, report) -> ServedRuns:
    return ServedRuns(trees, comfy_python, report)


@pytest.fixture(scope="session")
def weight_models(rc_settings: Settings, comfy_python: harness.ComfyPython, trees: harness.Trees, report,
                  tmp_path_factory) -> dict:
    """The weights suite's models (:func:`weights.build_models`), built once, read by every tree copy."""
    from . import weights

    folder = tmp_path_factory.mktemp("models")
    try:
        built = weights.build_models(folder, tree=trees.stock, python=comfy_python)
    except harness.HarnessError as exc:
        pytest.fail(f"could not build the test models: {exc}", pytrace=False)
    for tree in (trees.stock, trees.node):
        weights.model_paths(tree, folder)
    built["folder"] = str(folder)  # where the model files are (a test that changes one finds it here)
    report.put("models", built)
    return built


class WeightRuns:
    """The weights suite's served runs, each started once, on first use (see test_weights.py)."""

    def __init__(self, trees: harness.Trees, python: harness.ComfyPython, report: harness.Report):
        self.trees, self.python, self.report = trees, python, report
        self.done: dict = {}
        self._stock = None

    def stock(self):
        from . import weights

        if self._stock is None:
            self._stock = weights.run_stock(trees=self.trees, python=self.python, logs=self.report.folder / "logs")
            self.report.put("weights_stock", self._stock.row())
        return self._stock

    def __getitem__(self, name: str):
        from . import weights

        if name not in self.done:
            env, _ = {**weights.BACKENDS, **weights.COMPARISONS}[name]
            self.done[name] = weights.run_weights(name, env, trees=self.trees, python=self.python,
                                                  logs=self.report.folder / "logs")
            self.report.put("weights", {k: v.row() for k, v in self.done.items()})
        return self.done[name]


@pytest.fixture(scope="session")
def weight_runs(trees, comfy_python, report, weight_models) -> WeightRuns:
    return WeightRuns(trees, comfy_python, report)


class SeedRuns:
    """The seed reports' scripted runs (see test_seeds.py) and the stock images they are compared with."""

    def __init__(self, trees: harness.Trees, python: harness.ComfyPython, report: harness.Report):
        self.trees, self.python, self.report = trees, python, report
        self.done: dict = {}
        self.stock: dict = {}

    def __getitem__(self, name: str):
        from . import weights

        if name not in self.done:
            env, flags, script = weights.SEEDS[name]
            self.done[name] = weights.run_script(name, env, script, trees=self.trees, python=self.python,
                                                 logs=self.report.folder / "logs",
                                                 flags=(*weights.DYNAMIC_FLAGS, *flags))
            self.report.put("seeds", {k: v.row() for k, v in self.done.items()})
        return self.done[name]

    def stock_images(self, name: str) -> dict:
        """The stock image of each prompt step of seed ``name``'s script, by label."""
        from . import weights

        if name not in self.stock:
            _, _, script = weights.SEEDS[name]
            prompts = [(label, wf) for kind, label, wf in script if kind == "prompt"]
            hashes = weights.stock_images([wf for _, wf in prompts], trees=self.trees, python=self.python,
                                          logs=self.report.folder / "logs", label=f"seed-{name}")
            self.stock[name] = dict(zip([label for label, _ in prompts], hashes))
            self.report.put("seeds_stock", self.stock)
        return self.stock[name]


@pytest.fixture(scope="session")
def seed_runs(trees, comfy_python, report, weight_models) -> SeedRuns:
    return SeedRuns(trees, comfy_python, report)
