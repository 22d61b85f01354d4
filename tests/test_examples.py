"""The example backend in docs/examples/ installs as a third party's would and passes the kit, and
the tutorial (docs/tutorial-platform.md) says what is true: its platform, installed from its own code
blocks, passes the kit on a simulated machine, and its verb examples are the example's code.

``docs/examples/memfd_backend`` is installed with pip (offline: ``--no-deps --no-build-isolation``,
setuptools from this environment) from a copy of its folder, so the build leaves nothing in the tree,
into a temporary target directory. Everything then runs in subprocesses whose ``PYTHONPATH`` is that
target alone, from a folder outside the repository: membackend must find the backend through its entry
point in ``membackend.backends`` (not by import path), select it when forced, run the doctor's
self-test on it, and the conformance kit must check it fully (``--membackend-backend memfd``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from membackend.lab.simulated import simulated_profiles
from membackend.platform import Platform
from membackend.types import Device, DeviceInfo, Machine, Score

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "docs" / "examples" / "memfd_backend"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="memfd and /proc/self/maps are Linux's")

#: membackend's command line, run by this interpreter (the installed script lives in the venv's bin/)
CLI = [sys.executable, "-c", "import sys; from membackend._cli import main; sys.exit(main(sys.argv[1:]))"]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, object]:
    """The example installed into a fresh target directory; returns the environment and folder to run in."""
    pytest.importorskip("setuptools")
    src, target, cwd = (tmp_path_factory.mktemp(n) for n in ("src", "site", "elsewhere"))
    shutil.copytree(EXAMPLE, src / "memfd_backend", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", "--quiet",
           "--target", str(target), str(src / "memfd_backend")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, f"pip could not install the example:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")}
    env["PYTHONPATH"] = str(target)  # only the install: the repository's copy must not be importable
    return {"env": env, "cwd": cwd, "target": target}


def _run(installed, *args: str, extra_env: dict[str, str] | None = None, timeout: int = 180):
    env = {**installed["env"], **(extra_env or {})}
    return subprocess.run(list(args), cwd=installed["cwd"], env=env, capture_output=True, text=True, timeout=timeout)


def test_the_install_holds_the_module_its_metadata_and_the_entry_point(installed):
    target: Path = installed["target"]
    assert (target / "membackend_memfd.py").is_file(), sorted(p.name for p in target.iterdir())
    info = next(target.glob("membackend_memfd-*.dist-info"))
    entry_points = (info / "entry_points.txt").read_text()
    assert "[membackend.backends]" in entry_points and "memfd = membackend_memfd:MemfdBackend" in entry_points, \
        entry_points
    assert (info / "licenses" / "LICENSE").read_text() == (ROOT / "LICENSE").read_text()


def test_membackend_finds_the_example_through_its_entry_point(installed):
    p = _run(installed, *CLI, "backends", "--json")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    rows = {row["name"]: row for row in json.loads(p.stdout)["backends"]}
    assert "memfd" in rows, f"the example's entry point was not found: {sorted(rows)}"
    memfd = rows["memfd"]
    assert memfd["origin"] == "entry point memfd = membackend_memfd:MemfdBackend", memfd
    assert memfd["version"] == "0.1.0" and memfd["score"] == 1 and not memfd["selected"], memfd  # opt-in
    # it came from the install, not from the repository
    where = _run(installed, sys.executable, "-c", "import membackend_memfd; print(membackend_memfd.__file__)")
    assert where.returncode == 0 and Path(where.stdout.strip()).parent == installed["target"], where


def test_forced_by_name_the_doctor_self_test_runs_on_it(installed):
    p = _run(installed, *CLI, "doctor", extra_env={"MEMBACKEND_BACKEND": "memfd"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "selected: memfd (forced)" in p.stdout, p.stdout[-3000:]
    assert "self-test on memfd" in p.stdout and "self-test: passed" in p.stdout, p.stdout[-3000:]


@pytest.mark.kit_long  # the whole kit in a subprocess
def test_the_kit_checks_the_installed_example_fully(installed):
    p = _run(installed, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
             "membackend.testing.conformance", "--membackend-backend", "memfd", "--membackend-examples", "5",
             timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "not checked" not in out, out[-2000:]
    checked = next((line for line in out.splitlines() if line.startswith("membackend kit: memfd: checked:")), None)
    assert checked is not None, out[-2000:]
    for check in ("ledger vs kernel", "out-of-memory rollback (capacity)", "out-of-memory rollback (injected)",
                  "rollback under injected driver failures"):
        assert check in checked, checked


# --------------------------------------------------------------------------- docs/tutorial-platform.md

TUTORIAL = ROOT / "docs" / "tutorial-platform.md"


def _blocks(text: str) -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced code block."""
    return [(lang, code) for lang, code in re.findall(r"(?ms)^```(\w*)\n(.*?)^```", text)]


def _file_block(name: str) -> str:
    """The tutorial's block whose first line is ``# <name>``, without that line."""
    for _lang, code in _blocks(TUTORIAL.read_text()):
        first, _, rest = code.partition("\n")
        if first.strip() == f"# {name}":
            return rest
    raise AssertionError(f"docs/tutorial-platform.md has no block starting with '# {name}'")


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _machine(*names: str, vmm: bool | None = True) -> Machine:
    devices = tuple(DeviceInfo(Device("cuda", i), name=n, total_memory=64 << 30, integrated=True, vmm_supported=vmm)
                    for i, n in enumerate(names))
    return Machine("linux", 8, 64 << 30, 60 << 30, None, None, None, devices)


def test_the_tutorials_platform_fits_in_40_lines_and_probes_as_it_says(tmp_path):
    code = _file_block("acme_orbit.py")
    assert len(code.splitlines()) <= 40, f"the platform takes {len(code.splitlines())} lines"
    (tmp_path / "acme_orbit.py").write_text(code)
    acme = _load(tmp_path / "acme_orbit.py")
    assert isinstance(acme.PLATFORM, Platform) and acme.PLATFORM.name == "acme_orbit"
    fits = acme.probe(_machine("Acme Orbit X1", "Acme Orbit X1"))
    assert fits.name == "acme_orbit" and fits.score == acme.SCORE and fits.score in Score.PLATFORM, fits
    for machine, why in ((_machine(), "no CUDA device"), (_machine("NVIDIA GB10"), "NVIDIA GB10, not an Acme Orbit"),
                         (_machine("Acme Orbit X1", vmm=None), "virtual memory management")):
        c = acme.probe(machine)
        assert c.score == Score.NONE and why in c.reason, c
    assert acme.PLATFORM.headroom_for(128 << 30) == 8 << 30 and acme.PLATFORM.headroom_for(4 << 30) == 1 << 30


@pytest.mark.kit_long  # the whole kit in a subprocess
def test_the_tutorials_platform_installs_from_its_blocks_and_passes_the_kit(tmp_path):
    src, target, cwd = tmp_path / "acme_orbit", tmp_path / "site", tmp_path / "elsewhere"
    src.mkdir(), cwd.mkdir()
    (src / "acme_orbit.py").write_text(_file_block("acme_orbit.py"))
    (src / "pyproject.toml").write_text(_file_block("pyproject.toml"))
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                        "--quiet", "--target", str(target), str(src)], capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, f"the tutorial's platform does not install:\n{p.stderr[-2000:]}"
    installed = {"env": {**{k: v for k, v in os.environ.items() if not k.startswith("MEMBACKEND_")},
                         "PYTHONPATH": str(target)}, "cwd": cwd, "target": target}
    p = _run(installed, *CLI, "backends", "--json")
    rows = {row["name"]: row for row in json.loads(p.stdout)["backends"]} if p.returncode == 0 else {}
    assert rows.get("acme_orbit", {}).get("origin") == "entry point acme_orbit = acme_orbit:PLATFORM", \
        p.stdout[-2000:] + p.stderr[-2000:]
    p = _run(installed, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs",
             "membackend.testing.conformance", "--membackend-backend", "acme_orbit:gb10-128gb",
             "--membackend-examples", "5", timeout=300)
    out = p.stdout + p.stderr
    # the one check a made-up device cannot have: no simulated machine is an Acme Orbit, so where it fits is unjudged
    gaps = [x for x in out.splitlines() if x.startswith("membackend kit: acme_orbit:gb10-128gb: not checked:")]
    machines = ", ".join(simulated_profiles(vmm_only=True))  # wddm-6gb, rocm-win-2gpu, gb10-128gb, ...
    assert p.returncode == 0 and gaps == ["membackend kit: acme_orbit:gb10-128gb: not checked: where the platform "
                                          f"fits (its probe fits none of the simulated machines ({machines}))"], \
        out[-4000:]
    summary = "membackend kit: acme_orbit:gb10-128gb: checked:"
    checked = next(line for line in out.splitlines() if line.startswith(summary))
    for check in ("ledger vs driver (membackend_inspect)", "rollback under injected driver failures"):
        assert check in checked, checked


def test_every_code_block_of_the_tutorials_part_2_is_the_example_verbatim():
    text = TUTORIAL.read_text()
    part2 = text[text.index("## Part 2"):text.index("## The records at a glance")]
    module = (EXAMPLE / "membackend_memfd.py").read_text()
    pyproject = (EXAMPLE / "pyproject.toml").read_text()
    blocks = _blocks(part2)
    assert sum(lang == "python" for lang, _ in blocks) >= 8, "one block per verb at least"
    for lang, code in blocks:
        code = code.rstrip("\n")
        if lang == "python":
            assert code in module or textwrap.indent(code, "    ") in module, f"not in the example:\n{code}"
        elif lang == "toml":
            assert code in pyproject, f"not in the example's pyproject.toml:\n{code}"


def test_every_kit_rule_the_docs_name_is_a_rule_of_the_kit():
    conformance = pytest.importorskip("membackend.testing.conformance")
    for page in ("tutorial-platform.md", "kit.md"):
        named = set(re.findall(r"`(test_\w+)`", (ROOT / "docs" / page).read_text()))
        assert named, page
        unknown = sorted(n for n in named if not callable(getattr(conformance, n, None)))
        assert not unknown, f"docs/{page} names kit rules that do not exist: {unknown}"
