"""One pool (G3): the budget is MemAvailable capped by the memory cgroup, minus the headroom; pinned
host memory and device pages both draw from it."""

from __future__ import annotations

import functools
from collections import namedtuple

import pytest

from membackend_unified_gb10.workload import CUDA0, GB, GIB, gb10_session, stock_session
from membackend import _hostmem as hostmem
from membackend._backends.vmm import VmmBackend
from membackend._drivers.gpu import GpuDriver
from membackend._drivers.open import machine_for, open_gpu_driver
from membackend._ledger import Ledger
from membackend._session import Session
from membackend._settings import load_settings
from membackend.types import ConfigError
from membackend_unified_gb10 import HEADROOM_ENV, PLATFORM


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
    # the generic backend on the same machine reports the driver's mem-get-info: MemFree (#15285)
    stock = stock_session()
    try:
        assert stock.budget_query(CUDA0).free == stock.backend.driver.sim.meminfo()["MemFree"] < b.free
    finally:
        stock.close()


def test_pinned_host_copies_and_device_pages_draw_from_the_same_budget(session):
    driver = session.backend.driver
    before = session.budget_query(CUDA0).free
    driver.host_alloc_pinned(10 * GB)  # a pinned staging copy of weights
    assert session.budget_query(CUDA0).free == before - 10 * GB
    r = session.reserve(CUDA0, 4 * GIB)
    assert session.budget_query(CUDA0).free == before - 10 * GB  # address space costs nothing
    assert session.fault(r, 0, 4 * GIB).ok
    assert session.budget_query(CUDA0).free == before - 10 * GB - 4 * GIB
    driver.host_free_pinned(10 * GB)
    session.release_reservation(r)
    assert session.budget_query(CUDA0).free == before


def test_the_default_headroom_is_an_eighth_of_the_pool_within_bounds(session):
    b = session.budget_query(CUDA0)
    assert b.total == 128 * GB and b.headroom == 16 * GB  # 128 GB / 8, under the 16 GiB cap


def test_the_headroom_variable_replaces_the_default_and_is_read_at_every_query(session, monkeypatch):
    monkeypatch.setenv(HEADROOM_ENV, "8GiB")
    b = session.budget_query(CUDA0)
    assert b.headroom == 8 * GIB and b.usable == b.free - 8 * GIB
    monkeypatch.setenv(HEADROOM_ENV, "20GB")  # changed while running: no new session needed
    assert session.budget_query(CUDA0).headroom == 20 * GB


def test_the_refusal_up_front_follows_the_configured_headroom(session, monkeypatch):
    monkeypatch.setenv(HEADROOM_ENV, "100GB")
    r = session.reserve(CUDA0, 40 * GB)
    assert not session.fault(r, 0, 40 * GB).ok  # 128 GB - 100 GB leaves 28 GB
    monkeypatch.delenv(HEADROOM_ENV)
    assert session.fault(r, 0, 40 * GB).ok
    session.release_reservation(r)


@pytest.mark.parametrize("value, match", [("lots", "not a size"), ("-1", "not a size|negative"),
                                          ("200GB", "not less than the 128000000000 byte pool")])
def test_a_bad_headroom_variable_is_a_config_error_saying_what_is_accepted(session, monkeypatch, value, match):
    monkeypatch.setenv(HEADROOM_ENV, value)
    with pytest.raises(ConfigError, match=match) as info:
        session.budget_query(CUDA0)
    assert info.value.key == HEADROOM_ENV and info.value.source == "env" and info.value.accepted


def test_the_generic_headroom_setting_overrides_this_backends(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_HEADROOM", "2GiB")
    s = gb10_session()
    try:
        assert s.name == "unified_gb10" and s.budget_query(CUDA0).headroom == 2 * GIB
    finally:
        s.close()


# ------------------------------------------------------------------ the real unified source, cgroup-capped

VM = namedtuple("VM", "total available free")


@pytest.fixture
def real_source(monkeypatch, tmp_path):
    """A session on the plugin whose budget comes from the real ``unified`` source (psutil and the memory
    cgroup under a fake root) instead of the simulation's /proc/meminfo model; the machine is a GB10."""
    monkeypatch.setattr(hostmem.psutil, "virtual_memory", lambda: VM(128 * GB, 100 * GB, 60 * GB))
    real_cgroup = hostmem.cgroup_memory
    monkeypatch.setattr(hostmem, "cgroup_memory", lambda root=None: real_cgroup(tmp_path))
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
