"""One pool (G3): the budget is MemAvailable capped by the memory cgroup, minus the headroom; pinned
host memory and device pages both draw from it."""

from __future__ import annotations

import functools
from collections import namedtuple

import pytest

from membackend import _hostmem as hostmem
from membackend._backends.vmm import VmmBackend
from membackend._drivers.gpu import GpuDriver
from membackend._drivers.open import machine_for, open_gpu_driver
from membackend._ledger import Ledger
from membackend._manager import BackendManager
from membackend._session import Session
from membackend._settings import load_settings
from membackend.types import ConfigError
from membackend_unified_gb10 import HEADROOM_ENV, PLATFORM

from workload_unified_gb10 import CUDA0, GB, GIB, gb10_session, stock_session


@pytest.fixture
def session():
    s = gb10_session()
    yield s
    s.close()


def test_the_budget_is_memavailable_not_memfree(session):
    sim = session.backend.driver.sim
    info = sim.meminfo()
    assert info["MemFree"] < info["MemAvailable"]  # the page cache: reclaimable, counted only by MemAvailable
    b = session.budget_query(CUDA0)
    assert b.free == info["MemAvailable"] and b.total == info["MemTotal"] and b.unified
    assert "MemAvailable" in b.source
    assert b.usable == b.free - b.headroom
    # stock (the driver's mem-get-info, what comfy-aimdo reads) reports MemFree (#15285)
    stock = stock_session()
    try:
        assert stock.budget_query(CUDA0).free == stock.backend.driver.sim.meminfo()["MemFree"] < b.free
    finally:
        stock.close()


def test_pinned_host_copies_and_device_pages_draw_from_the_same_budget(session):
    driver = session.backend.driver
    before = session.budget_query(CUDA0).free
    pinned = driver.host_alloc_pinned(10 * GB)  # a pinned staging copy of weights
    assert session.budget_query(CUDA0).free == before - 10 * GB
    r = session.reserve(CUDA0, 4 * GIB)
    assert session.budget_query(CUDA0).free == before - 10 * GB  # address space costs nothing
    assert session.fault(r, 0, 4 * GIB).ok
    assert session.budget_query(CUDA0).free == before - 10 * GB - 4 * GIB
    driver.host_free_pinned(pinned)
    session.release_reservation(r)
    assert session.budget_query(CUDA0).free == before


def test_the_default_headroom_is_an_eighth_of_the_pool_within_bounds(session):
    b = session.budget_query(CUDA0)
    assert b.total == 128 * GB and b.headroom == 16 * GB  # 128 GB / 8, under the 16 GiB cap


def test_the_headroom_variable_replaces_the_default_read_once_and_a_live_change_goes_through_the_session(
        monkeypatch):
    monkeypatch.setenv(HEADROOM_ENV, "8GiB")
    s = gb10_session()
    try:
        b = s.budget_query(CUDA0)
        assert b.headroom == 8 * GIB and b.usable == b.free - 8 * GIB
        assert s.headroom_in_force(CUDA0) == (
            8 * GIB,
            "platform unified_gb10's own rule (unified_gb10.headroom from env MEMBACKEND_UNIFIED_GB10_HEADROOM)")
        monkeypatch.setenv(HEADROOM_ENV, "20GB")  # read once, when the backend was built: nothing changes
        assert s.budget_query(CUDA0).headroom == 8 * GIB
        s.set_headroom(CUDA0, 20 * GB, source="live")  # changed while running: through the session
        assert s.budget_query(CUDA0).headroom == 20 * GB and s.headroom_in_force(CUDA0) == (20 * GB, "live")
    finally:
        s.close()


@pytest.mark.parametrize("source", ["live", "flags", "setting", "platform setting"])
def test_the_refusal_up_front_follows_the_headroom_in_force_whichever_source_sets_it(monkeypatch, source):
    """The backend's own decision (a fault past the pool is refused before the driver is asked) uses the
    session's headroom, not one of its own: one owner for the value the budget reports and the one it acts on."""
    settings = {}
    if source == "setting":
        settings["headroom"] = "100GB"
    elif source == "platform setting":
        monkeypatch.setenv(HEADROOM_ENV, "100GB")
    s = BackendManager(load_settings(sim_profile="gb10-128gb", **settings)).session()
    try:
        if source == "live":
            s.set_headroom(CUDA0, 100 * GB, source="live")
        elif source == "flags":
            s.set_headroom(CUDA0, 100 * GB, source="comfyui --reserve-vram/--vram-headroom")
        assert s.name == "unified_gb10" and s.budget_query(CUDA0).headroom == 100 * GB
        r = s.reserve(CUDA0, 40 * GB)
        assert not s.fault(r, 0, 40 * GB).ok  # 128 GB - 100 GB leaves 28 GB
        if source in ("live", "flags"):
            s.set_headroom(CUDA0, None, source="live" if source == "live" else "comfyui --reserve-vram")
            assert s.budget_query(CUDA0).headroom == 16 * GB  # back to the platform's rule
            assert s.fault(r, 0, 40 * GB).ok
        s.release_reservation(r)
    finally:
        s.close()


@pytest.mark.parametrize("value, match", [("lots", "'lots' is not a size"), ("-1", "not a size .negative")])
def test_a_bad_headroom_variable_is_a_config_error_saying_what_is_accepted(monkeypatch, value, match):
    monkeypatch.setenv(HEADROOM_ENV, value)
    with pytest.raises(ConfigError, match=match) as info:
        PLATFORM.setting_values()
    assert (info.value.key, info.value.source) == ("unified_gb10.headroom", f"env {HEADROOM_ENV}")
    assert "GiB" in info.value.accepted


def test_a_headroom_not_below_the_pool_scores_zero_and_selection_goes_on(monkeypatch):
    """Refused at the probe, naming the key and its source: another backend is chosen, nothing fails later."""
    from membackend._manager import BackendManager

    monkeypatch.setenv(HEADROOM_ENV, "200GB")
    settings = load_settings(sim_profile="gb10-128gb")
    selection = BackendManager(settings).select(machine_for(settings))
    c = selection.candidates["unified_gb10"]
    assert c.score == 0 and f"unified_gb10.headroom (env {HEADROOM_ENV})" in c.reason, c
    assert "not less than the" in c.reason and "unified_gb10" not in selection.broken
    assert selection.record.name != "unified_gb10"


def test_the_generic_headroom_setting_overrides_this_backends(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_HEADROOM", "2GiB")
    monkeypatch.setenv(HEADROOM_ENV, "8GiB")
    s = gb10_session()
    try:
        assert s.name == "unified_gb10" and s.budget_query(CUDA0).headroom == 2 * GIB
        assert s.headroom_in_force(CUDA0) == (2 * GIB, "start-up setting headroom (from env MEMBACKEND_HEADROOM)")
    finally:
        s.close()


# ------------------------------------------------------------------ the real unified source, cgroup-capped

VM = namedtuple("VM", "total available free")


@pytest.fixture
def real_source(monkeypatch, tmp_path):
    """A session on the plugin whose budget comes from the real ``unified`` source (psutil and the memory
    cgroup under a fake root) instead of the simulation's /proc/meminfo model; the machine is a GB10."""
    monkeypatch.setattr(hostmem.psutil, "virtual_memory", lambda: VM(128 * GB, 100 * GB, 60 * GB))
    real_cgroup = hostmem.read_cgroup
    monkeypatch.setattr(hostmem, "read_cgroup", lambda root=None: real_cgroup(tmp_path))
    driver = open_gpu_driver("cuda", "gb10-128gb")
    driver.budget = functools.partial(GpuDriver.budget, driver)  # the real source, not the twin's
    s = Session(VmmBackend(PLATFORM, driver), machine=machine_for(load_settings(sim_profile="gb10-128gb")),
                ledger=Ledger())
    yield s, tmp_path
    s.close()


def test_the_real_source_reads_memavailable_when_no_cgroup_limits_it(real_source):
    s, _root = real_source
    b = s.budget_query(CUDA0)
    assert (b.total, b.free, b.headroom) == (128 * GB, 100 * GB, 16 * GB)  # available, not free (60 GB)
    assert b.source == "unified pool: psutil MemAvailable"


@pytest.mark.parametrize("layout", ["v2", "v1"])
def test_the_real_source_is_capped_by_the_memory_cgroup(real_source, layout):
    s, root = real_source
    if layout == "v2":
        (root / "memory.max").write_text("64000000000\n")
        (root / "memory.current").write_text("10000000000\n")
    else:
        (root / "memory").mkdir()
        (root / "memory" / "memory.limit_in_bytes").write_text("64000000000\n")
        (root / "memory" / "memory.usage_in_bytes").write_text("10000000000\n")
    b = s.budget_query(CUDA0)
    assert (b.total, b.free) == (64 * GB, 54 * GB) and b.source == "unified pool: cgroup memory limit"
    assert b.headroom == 8 * GB and b.usable == 46 * GB  # an eighth of the capped pool
    # the refusal up front uses the capped pool too: the machine has room, the cgroup does not
    sim = s.backend.driver.sim
    r = s.reserve(CUDA0, 50 * GB)
    creates = sim.faults.calls.get("cuMemCreate", 0)
    assert not s.fault(r, 0, 47 * GB).ok and sim.faults.calls.get("cuMemCreate", 0) == creates
    assert s.fault(r, 0, 45 * GB).ok
    s.release_reservation(r)
