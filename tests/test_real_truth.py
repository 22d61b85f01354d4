"""Real hardware tells the truth (issue 34, item 5), checked without a GPU.

* ``membackend_inspect`` on the real CUDA and HIP bindings (cuda-python, hip-python) reports reserved,
  resident, held and committed bytes from the vmm backend's own handle ledger, checked one-sidedly against
  the driver's free figure: here the real bindings drive the stand-in driver library
  (``tests/fixtures/standin_driver``, as ``tests/test_standin_driver.py`` does), each in a child process.
* A backend whose vendor runtime is missing scores 0 with that reason and is never shown as broken: the
  manager's registration runs none of a plugin's attributes on every pluggy this package accepts (1.5
  included, which ``getattr``-ed them and so opened a platform's driver), and a probe that says the
  runtime cannot be loaded (``DriverError`` code ``unavailable``) is a "does not fit", not a failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from test_standin_driver import ROOT, _cache_dir, standin_build

from membackend._backends.host import HostBackend
from membackend._manager import BackendManager
from membackend._settings import load_settings
from membackend.hookspec import hookimpl
from membackend.types import Candidate, DriverError, Machine

#: builds the stand-in driver library and runs the real bindings in subprocesses: the long part
pytestmark = pytest.mark.long

MiB = 1 << 20

# the child: a vmm session over the real binding, its inspect after each step, as JSON
CHILD = textwrap.dedent("""
    import json, sys
    from membackend._backends.vmm import VmmBackend
    from membackend._machine import gather_machine
    from membackend._session import Session
    from membackend.platform import GENERIC
    from membackend.types import Capabilities
    vendor = sys.argv[1]
    if vendor == "cuda":
        from membackend._drivers.cuda import CudaDriver as Driver
    else:
        from membackend._drivers.hip import HipDriver as Driver
    driver = Driver()
    # handles recycled: a free keeps them, so the ledger holds memory no page maps
    backend = VmmBackend(GENERIC, driver, page_size=2 << 20, capabilities=Capabilities(recycle_handles=True))
    s = Session(backend, machine=gather_machine(), headroom=0)
    dev = s.devices()[0]
    out = {}
    def look(step):
        st = s.inspect(dev)
        led = backend.handle_ledger(dev)
        with driver.on_device(dev.index):
            free, total = driver.mem_get_info()
        out[step] = None if st is None else {"reserved": st.reserved, "resident": st.resident, "held": st.held,
            "committed": st.committed, "source": st.source, "unaccounted": led.unaccounted,
            "in_use": total - free}
    look("start")
    r = s.reserve(dev, 64 << 20)
    look("reserved")
    assert s.fault(r, 0, 64 << 20).ok
    look("faulted")
    s.free(r, 0, 32 << 20)
    look("freed")
    s.release_reservation(r)
    look("released")
    s.trim(dev)
    look("trimmed")
    s.close()
    print("RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="session")
def standin(pytestconfig, tmp_path_factory):
    """The built stand-in driver (the same cached build as ``tests/test_standin_driver.py``'s)."""
    try:
        return standin_build.build(_cache_dir(pytestconfig, tmp_path_factory, "membackend-standin-driver"))
    except standin_build.BuildUnavailable as exc:
        pytest.skip(str(exc))


def _inspect_through(standin, vendor: str, profile: str, **env: str) -> dict:
    child = standin_build.child_env(standin, profile, PYTHONPATH=str(ROOT), **env)
    proc = subprocess.run([sys.executable, "-c", CHILD, vendor], env=child, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


@pytest.mark.parametrize("profile", ["h200", "h200;ctxmem=300MiB"])
def test_inspect_on_real_cuda_bindings_reports_the_handle_ledger(standin, profile):
    """cuda-python over the stand-in: the ledger's figures at every step, vouched for by cuMemGetInfo; the
    context's own memory (``ctxmem``: use that is not membackend's) does not make the check fail."""
    pytest.importorskip("cuda.bindings.driver")
    r = _inspect_through(standin, "cuda", profile)
    assert all(v is not None for v in r.values()), f"membackend_inspect returned None on the real driver: {r}"
    seen = {k: (v["reserved"], v["resident"], v["held"], v["committed"]) for k, v in r.items()}
    assert seen == {"start": (0, 0, 0, 0), "reserved": (64 * MiB, 0, 0, 0),
                    "faulted": (64 * MiB, 64 * MiB, 0, 64 * MiB),
                    "freed": (64 * MiB, 32 * MiB, 32 * MiB, 64 * MiB),  # the freed handles are kept for reuse
                    # at most recycle_limit (16) handles of 2 MiB stay kept: the release gives the other 16 back
                    "released": (0, 0, 32 * MiB, 32 * MiB), "trimmed": (0, 0, 0, 0)}, r
    for step in ("faulted", "freed", "released"):
        v = r[step]
        assert v["source"].startswith("membackend's handle ledger (cuMemGetInfo"), v["source"]
        assert v["unaccounted"] == 0 and "cannot account" not in v["source"], v
        assert v["in_use"] >= v["committed"], v  # what the one-sided check relies on


def test_inspect_on_real_hip_bindings_says_what_the_free_figure_cannot_account_for(standin):
    """hip-python over a Strix Halo APU under ROCm 7.2: hipMemGetInfo reports free above the device's own
    total (the host's memory), so it cannot account for the handles the ledger holds; inspect says so, and
    how much, instead of vouching for the ledger. A discrete card's figure accounts for them."""
    pytest.importorskip("hip")
    apu = _inspect_through(standin, "hip", "strix-halo-128gb")["faulted"]
    assert (apu["resident"], apu["committed"]) == (64 * MiB, 64 * MiB), apu
    assert apu["unaccounted"] == 64 * MiB and "hipMemGetInfo" in apu["source"], apu
    assert "cannot account for 64.0 MiB of the 64.0 MiB committed" in apu["source"], apu["source"]
    card = _inspect_through(standin, "hip", "rx7900xtx-linux")["faulted"]
    assert card["committed"] == 64 * MiB and card["unaccounted"] == 0, card
    assert "cannot account" not in card["source"], card["source"]


# --------------------------------------------------------------------------- a missing vendor runtime


def test_a_probe_that_finds_no_runtime_scores_0_with_the_reason_and_is_not_broken():
    class NoRuntime(HostBackend):
        name = "vendor_x"

        @hookimpl
        def membackend_probe(self, machine: Machine) -> Candidate:
            raise DriverError("unavailable", "dlopen", "no HIP runtime library found; tried libamdhip64.so")

    mgr = BackendManager(load_settings(), builtins=[HostBackend(), NoRuntime()], entry_points=[])
    sel = mgr.select()
    assert "vendor_x" not in sel.broken, sel.broken
    c = sel.candidates["vendor_x"]
    assert c.score == 0 and "no HIP runtime library found" in c.reason, c
    assert sel.record.name == "host"


def test_a_probe_that_raises_anything_else_is_still_broken():
    class Raises(HostBackend):
        name = "vendor_y"

        @hookimpl
        def membackend_probe(self, machine: Machine) -> Candidate:
            raise DriverError(1, "cuDeviceGetAttribute")  # the library is there and answered: a real failure

    sel = BackendManager(load_settings(), builtins=[HostBackend(), Raises()], entry_points=[]).select()
    assert "vendor_y" in sel.broken and "vendor_y" not in sel.candidates, sel


@pytest.fixture(scope="session")
def pluggy15(pytestconfig, tmp_path_factory):
    """A folder holding pluggy 1.5.0, the oldest this package accepts (cached across runs)."""
    target = _cache_dir(pytestconfig, tmp_path_factory, "membackend-pluggy-1.5") / "site"
    if (target / "pluggy" / "__init__.py").is_file():
        return target
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", "--no-input",
           "--retries", "1", "--timeout", "20", "--target", str(target), "pluggy==1.5.0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.skip("pluggy 1.5.0 could not be installed: " + (proc.stderr or proc.stdout).strip()[-300:])
    return target


@pytest.mark.network
def test_no_runtime_on_this_machine_is_score_0_not_broken_under_pluggy_1_5(pluggy15):
    """``membackend backends --json`` with pluggy 1.5 and no CUDA or HIP runtime here: every platform
    (``rocm_linux``, ``rocm_windows`` and the CUDA ones where installed, the built-in ``vmm``) is listed with a
    score and its reason, none broken (pluggy 1.5 read every attribute at registration, which opened each
    platform's driver: "no HIP runtime library found" made them BROKEN)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMBACKEND_", "ROCM_PATH", "HIP_PATH"))}
    env["PYTHONPATH"] = os.pathsep.join([str(pluggy15), str(ROOT)])
    version = subprocess.run([sys.executable, "-c", "import pluggy; print(pluggy.__version__)"], env=env,
                             capture_output=True, text=True, timeout=60).stdout.strip()
    assert version == "1.5.0", version
    proc = subprocess.run([sys.executable, "-m", "membackend", "backends", "--json"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    rows = {r["name"]: r for r in report["backends"]}
    assert not [r for r in rows.values() if r.get("broken")], [r for r in rows.values() if r.get("broken")]
    assert rows["vmm"]["score"] == 0, rows["vmm"]
    for name in ("rocm_linux", "rocm_windows"):
        if name in rows:
            assert rows[name]["score"] == 0 and rows[name]["reason"], rows[name]


# --------------------------------------------------------------------------- the -m gpu tests in a bare Python

#: what pytest and membackend import, linked from this interpreter's site-packages into the bare one's path
BARE_PACKAGES = ("pytest", "_pytest", "pluggy", "iniconfig", "packaging", "pygments", "pydantic", "pydantic_core",
                 "annotated_types", "typing_extensions.py", "typing_inspection", "tomlkit", "psutil", "py.py")


def test_the_gpu_tests_run_in_a_bare_python_without_the_example_fixture(tmp_path):
    """``scripts/gpu-check --with-tests`` runs ``pytest -m gpu tests/test_gpu.py`` in a Python where membackend
    is on ``PYTHONPATH`` and nothing of this repository is installed: no site-packages (``-S``), the
    packages pytest and membackend need on the path, the example backend that ``membackend_targets`` names
    nowhere. The run must not end in pytest's usage error (exit 4): without a GPU every test skips."""
    import importlib.util

    site = tmp_path / "site"
    site.mkdir()
    for name in BARE_PACKAGES:
        spec = importlib.util.find_spec(name.removesuffix(".py"))
        if spec is None or spec.origin is None:
            continue
        origin = os.path.dirname(spec.origin) if spec.submodule_search_locations else spec.origin
        (site / os.path.basename(origin)).symlink_to(origin)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MEMBACKEND_", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(ROOT)])
    probe = subprocess.run([sys.executable, "-S", "-c", "import importlib.metadata as m; "
                            "print(sorted(d.metadata['Name'] for d in m.distributions()))"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert "membackend-example-backend" not in probe.stdout, probe.stdout  # the situation this test is about
    for autoload in ("1", "0"):  # membackend's pytest11 entry point loads the kit, or nothing does
        run_env = {**env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": autoload} if autoload == "1" else env
        proc = subprocess.run([sys.executable, "-S", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                               "tests/test_gpu.py", "--fixtures"], cwd=ROOT, env=run_env, capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, f"autoload off={autoload}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        assert "membackend_clean_env" in proc.stdout, proc.stdout[-3000:]  # the kit's fixtures are there
        proc = subprocess.run([sys.executable, "-S", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu",
                               "tests/test_gpu.py"], cwd=ROOT, env=run_env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, f"autoload off={autoload}: rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        assert "skipped" in proc.stdout or "passed" in proc.stdout, proc.stdout
