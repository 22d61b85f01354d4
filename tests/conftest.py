"""Shared fixtures: isolated settings for every test (the kit's ``membackend_clean_env``: no stray
MEMBACKEND_* variable or config file, an empty working directory) and host sessions.

Runs in a bare Python too (membackend on ``PYTHONPATH``, pytest, nothing installed: ``scripts/gpu-check
--with-tests`` on a GPU machine): where membackend's ``pytest11`` entry point did not load the conformance
kit's pytest plugin, this file loads it. The third-party example backend that ``membackend_targets`` names
is installed nowhere (``scripts/test`` keeps test fixtures out of the user's ``.venv``): this file makes that
fixture findable as the distribution it is, for this run only, from its own ``pyproject.toml``
(:func:`_example_findable`), so the kit resolves its targets instead of ending the run with a usage error
(exit 4).
"""

from __future__ import annotations

import atexit
import importlib.metadata
import shutil
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from membackend._backends.host import HostBackend
from membackend._ledger import Ledger
from membackend._machine import gather_machine
from membackend._session import Session

EXAMPLE = Path(__file__).resolve().parent / "fixtures" / "example_backend"

if "membackend.testing.plugin" not in sys.modules:  # no pytest11 entry point loaded it: membackend not installed
    pytest_plugins = ["membackend.testing.plugin"]


def _example_findable() -> None:
    """Make the example backend fixture a distribution on ``sys.path`` when none is installed: its package
    folder goes on the path, and a temporary folder holds the ``.dist-info`` its ``pyproject.toml`` describes
    (name, version, entry points), so ``importlib.metadata`` finds its entry point exactly as it finds an
    installed one's. Nothing happens where it is installed (a ``pip install`` of the fixture by hand)."""
    meta = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    try:
        importlib.metadata.distribution(meta["name"])
        return
    except importlib.metadata.PackageNotFoundError:
        pass
    site = Path(tempfile.mkdtemp(prefix="membackend-example-dist-"))
    atexit.register(shutil.rmtree, site, True)
    info = site / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n")
    groups = meta.get("entry-points", {})
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items()) + "\n"
        for group, points in groups.items()))
    sys.path[:0] = [str(EXAMPLE), str(site)]


_example_findable()


@pytest.fixture(autouse=True)
def _clean_env(membackend_clean_env):
    """Every test starts with no MEMBACKEND_* variables, in an empty directory."""


@pytest.fixture
def host_session():
    backend = HostBackend(page_size=2 << 20)
    session = Session(backend, machine=gather_machine(), ledger=Ledger())
    yield session
    session.close()


@pytest.fixture
def sanitized_session():
    backend = HostBackend(page_size=2 << 20)
    session = Session(backend, machine=gather_machine(), ledger=Ledger(sanitize=True))
    yield session
    session.close()


@pytest.fixture
def host_adapters():
    """A factory: ``host_adapters(pages=16)`` arms a ComfyUI adapter on the host backend with room for ``pages``
    pages of 2 MiB, no headroom, no reaper, no ComfyUI patches (the facade's calls land on real host memory);
    each is stopped after the test."""
    import host_arming

    armed = []

    def arm(pages: int = 16):
        armed.append(host_arming.arm(pages))
        return armed[-1]

    try:
        yield arm
    finally:
        for runtime in armed:
            runtime.stop()
        host_arming.disarm()


@pytest.fixture
def host_adapter(host_adapters):
    """An armed ComfyUI adapter on the host backend (16 pages of 2 MiB, no headroom), no reaper, no ComfyUI
    patches: the facade's calls land on real host memory."""
    return host_adapters(16)


@pytest.fixture
def sim_adapter():
    """A factory: ``sim_adapter(profile, devices=1)`` starts a ComfyUI adapter on that simulated machine, serving
    its first ``devices`` devices (its reaper thread running), no ComfyUI patches; each is stopped after the test."""
    from membackend._comfyui import runtime as adapter
    from membackend._comfyui.runtime import Runtime
    from membackend._drivers.open import machine_for
    from membackend._manager import BackendManager
    from membackend._settings import load_settings

    started = []

    def start(profile: str, devices: int = 1):
        settings = load_settings(sim_profile=profile, headroom=0)
        mgr = BackendManager(settings)
        machine = machine_for(settings)
        runtime = Runtime(mgr, machine, mgr.select(machine), wire=lambda rt: None)
        runtime.start([(i, 0) for i in range(devices)])
        runtime.started = True
        adapter.decided("armed", "test", "membackend test", runtime)
        started.append(runtime)
        return runtime

    try:
        yield start
    finally:
        for runtime in started:
            runtime.stop()
        adapter.decided("stock", "test over", "", None)


@pytest.fixture
def h200_adapter(sim_adapter):
    """A started ComfyUI adapter on the simulated H200 (its reaper thread running), no ComfyUI patches."""
    return sim_adapter("h200")
