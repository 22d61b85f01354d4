"""On a real CUDA device: the VMM backend through cuda-python. Skipped where there is none.

Quick (seconds on an H200) and runnable in a bare Python with membackend on ``PYTHONPATH`` and pytest
(``scripts/gpu-check --with-tests``; ``tests/conftest.py`` says how). Each test gets its own session on
``cuda:0`` and closes it. The driver's free figure (``cuMemGetInfo``) moves with every process on the device
and with this one's own allocations, so the checks against it allow :data:`SLACK`.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

MiB = 1 << 20
SIZE = 256 * MiB
SLACK = 64 * MiB  # what other work on the device may move the driver's free figure by during one test


def _cuda_devices() -> int:
    try:
        from membackend._drivers.cuda import CudaDriver

        d = CudaDriver()
        d.init()
        return d.device_count()
    except Exception:
        return 0


requires_cuda = pytest.mark.skipif(_cuda_devices() == 0, reason="no CUDA device")


@pytest.fixture
def cuda():
    """``(session, driver)``: a session of the generic vmm backend over the real driver (no headroom)."""
    from membackend._backends.vmm import VmmBackend
    from membackend._drivers.cuda import CudaDriver
    from membackend._machine import gather_machine
    from membackend._session import Session
    from membackend.platform import GENERIC

    driver = CudaDriver()
    s = Session(VmmBackend(GENERIC, driver), machine=gather_machine(), headroom=0)
    yield s, driver
    s.close()


def _free(driver) -> int:
    with driver.on_device(0):
        return driver.mem_get_info()[0]


@requires_cuda
def test_real_round_trip_with_an_event_fence(cuda):
    s, driver = cuda
    r = s.reserve("cuda:0", 64 * MiB)
    assert s.fault(r, 0, 64 * MiB).ok
    pinned = driver.host_alloc_pinned(64 * MiB)
    stream = driver.stream_create()
    driver.memcpy_htod_async(r.base, pinned, 64 * MiB, stream)
    s.record(r, s.backend.fence_token(r, stream))
    assert s.free(r) == 64 * MiB
    s.release_reservation(r)
    driver.host_free_pinned(pinned)
    b = s.budget_query("cuda:0")
    assert b.total > 0 and b.source.startswith("cuMemGetInfo")


@requires_cuda
def test_g1_a_release_returns_the_memory_to_the_driver(cuda):
    s, driver = cuda
    s.trim("cuda:0")
    before = _free(driver)
    r = s.reserve("cuda:0", SIZE)
    assert s.fault(r, 0, SIZE).ok
    during = _free(driver)
    assert before - during >= SIZE - SLACK, f"free {before} -> {during} after backing {SIZE} bytes"
    s.release_reservation(r)
    s.trim("cuda:0")  # handles kept for reuse go back too: G1 is the driver back at its baseline
    after = _free(driver)
    assert after >= before - SLACK, f"free {before} before the load, {after} after the release"
    again = s.reserve("cuda:0", SIZE)  # the same use reserves again without the caller noticing
    assert s.fault(again, 0, SIZE).ok
    s.release_reservation(again)


@requires_cuda
def test_g2_a_free_waits_for_the_copies_recorded_on_its_range(cuda):
    s, driver = cuda
    r = s.reserve("cuda:0", SIZE)
    assert s.fault(r, 0, SIZE).ok
    pinned = driver.host_alloc_pinned(SIZE)
    stream = driver.stream_create()
    tokens = []
    try:
        for _ in range(4):  # long enough to be running still when the free is asked for
            driver.memcpy_htod_async(r.base, pinned, SIZE, stream)
        token = s.backend.fence_token(r, stream)
        tokens.append(token)
        s.record(r, token)
        assert s.free(r) == SIZE
        assert token.done(), "the free returned while a copy recorded on its range was unfinished"
        driver.stream_synchronize(stream)  # no error: nothing was unmapped under the copies
    finally:
        driver.host_free_pinned(pinned)
    s.release_reservation(r)


@requires_cuda
def test_inspect_reports_held_and_committed_bytes_on_the_real_driver(cuda):
    s, driver = cuda
    dev = s.devices()[0]
    r = s.reserve(dev, SIZE)
    assert s.fault(r, 0, SIZE).ok
    state = s.inspect(dev)
    assert state is not None, "membackend_inspect returned None on the real driver"
    assert (state.reserved, state.resident) == (SIZE, SIZE), state
    assert state.committed == SIZE + state.held and state.source.startswith("membackend's handle ledger"), state
    assert "cuMemGetInfo" in state.source and "cannot account" not in state.source, state.source
    s.free(r)
    kept = s.inspect(dev)
    assert kept.resident == 0 and kept.committed == kept.held, kept  # what the free kept for reuse is held
    s.release_reservation(r)
    s.trim(dev)
    end = s.inspect(dev)
    assert (end.reserved, end.resident, end.held, end.committed) == (0, 0, 0, 0), end


@requires_cuda
def test_the_budget_under_a_reserve_keeps_the_headroom_free(cuda):
    s, driver = cuda
    dev = s.devices()[0]
    total = s.budget_query(dev).total
    headroom = total // 4
    from membackend._backends.vmm import VmmBackend
    from membackend._machine import gather_machine
    from membackend._session import Session
    from membackend.platform import GENERIC

    capped = Session(VmmBackend(GENERIC, driver), machine=gather_machine(), headroom=headroom)
    try:
        low = _free(driver)
        b = capped.budget_query(dev)
        high = _free(driver)
        assert b.headroom == headroom and b.total == total, b
        assert min(low, high) - SLACK <= b.free <= max(low, high) + SLACK, (low, b.free, high)
        assert b.usable == max(0, b.free - headroom), b  # usable = free - headroom, as the session computes
        r = capped.reserve(dev, SIZE)
        assert capped.fault(r, 0, SIZE).ok
        after = capped.budget_query(dev)
        assert after.usable <= b.usable - SIZE + SLACK, (b, after)  # what it backed is no longer usable
        capped.release_reservation(r)
    finally:
        capped.close()


@requires_cuda
def test_the_doctor_selects_vmm_on_a_cuda_machine():
    from membackend._manager import BackendManager
    from membackend._settings import load_settings

    sel = BackendManager(load_settings()).select()
    assert sel.record.name in ("vmm", "aimdo") or sel.candidates["vmm"].score > 0
    assert not {n for n in sel.broken if n.startswith("rocm_")}, sel.broken  # no HIP runtime: score 0, not broken
